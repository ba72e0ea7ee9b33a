import DQTestSupport
import FHIRDataQueue
import Foundation
import Logging
import ServiceLifecycle
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Background delivery: `DataQueueService` in a service group, and `dq run` under signals, against sekmet-fhir.
@Suite("Background delivery against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct ServiceTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    func environment(_ server: String, idempotent: Bool = true, batch: Int? = nil) -> [String: String] {
        var env = ["DQ_SERVER": server, "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
        env["DQ_IDEMPOTENT"] = String(idempotent)  // "false" too: the default is "auto"
        if let batch { env["DQ_BATCH_SIZE"] = String(batch) }
        return env
    }

    @Test("Items queued while the server is down arrive once it is up, with no call to flush (the service alone)")
    func serviceDeliversByItself() async throws {
        let server = try FHIRServer()  // not started yet
        var configuration = DataQueue.Configuration(databasePath: work.file("queue.sqlite"))
        configuration.retryPolicy = RetryPolicy(initialDelay: 0.2, maximumDelay: 0.5, jitter: 0)
        configuration.connectTimeout = 2
        let queue = try await DataQueue(baseURL: URL(string: server.base)!, configuration: configuration)
        let group = ServiceGroup(
            services: [DataQueueService(queues: [queue], configuration: .init(pollInterval: .milliseconds(200)))],
            logger: Logger(label: "test"))
        let running = Task { try await group.run() }
        for index in 0..<5 {
            _ = try await queue.enqueue(try FHIRResource(json: Data(resources.observation(index).utf8)))
        }
        try await Task.sleep(for: .milliseconds(500))  // the service has tried and failed: the server is down
        try await server.start()
        let arrived = try await eventually(timeout: .seconds(30)) {
            (try await server.values("Observation", system: resources.system)).count == 5
        }
        #expect(arrived, "the service delivered without any flush() call")
        // An enqueue wakes it at once.
        _ = try await queue.enqueue(try FHIRResource(json: Data(resources.observation(5).utf8)))
        #expect(
            try await eventually(timeout: .seconds(10)) {
                (try await server.values("Observation", system: resources.system)).count == 6
            })
        await group.triggerGracefulShutdown()
        try await running.value
        #expect(try await server.values("Observation", system: resources.system) == (0..<6).map(String.init))
        try await queue.shutdown()
    }

    @Test(
        "dq run delivers what a separate dq enqueue queued, in order, and drains and exits 0 on SIGTERM and on SIGINT",
        arguments: [SIGTERM, SIGINT])
    func runDeliversOtherProcesses(signal: Int32) async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        let run = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.2"], environment: env)
        for chunk in 0..<3 {
            let file = try work.write("c\(chunk).ndjson", resources.ndjson((chunk * 10)..<(chunk * 10 + 10)))
            #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        }
        #expect(
            try await eventually(timeout: .seconds(30)) {
                (try await server.values("Observation", system: resources.system)).count == 30
            })
        run.kill(signal)
        let result = await run.wait(timeout: .seconds(30))
        #expect(result.status == 0, "\(result.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == (0..<30).map(String.init))
    }

    @Test(
        "SIGTERM while an answer is held: dq run gives up the drain at its timeout and exits 0, with the answer still held; nothing lost or duplicated"
    )
    func sigtermMidFlush() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let env = environment(proxy.base, batch: 1)
        let file = try work.write("five.ndjson", resources.ndjson(0..<5))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        try await proxy.inject(["pass", "hold"])  // item 1 reaches the server; its answer waits for the test
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.2", "--drain-timeout", "2"], environment: env)
        #expect(try await eventually { (try await proxy.stats()["holding"] as? Int) == 1 })
        run.kill(SIGTERM)
        let result = await run.wait(timeout: .seconds(60))
        #expect(result.status == 0, "\(result.stderr)")
        // It ended on its drain timeout, not on the answer: that is still held.
        #expect(try await proxy.stats()["holding"] as? Int == 1)
        try await proxy.release()
        #expect(try await dq(["flush", "--now"], env).status == 0)
        #expect(try await server.values("Observation", system: resources.system) == (0..<5).map(String.init))
    }

    @Test(
        "SIGTERM while a validated reload drains its round ends dq run: the request on the wire is answered, no next round starts"
    )
    func sigtermWhileReloadDrains() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        var env = environment(proxy.base, batch: 1)
        env["DQ_LOG_LEVEL"] = "notice"
        let file = try work.write("three.ndjson", resources.ndjson(0..<3))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        try await proxy.inject(["hold"])  // item 0 reaches the server; its answer waits for the test
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1", "--drain-timeout", "120"], environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { (try await proxy.stats()["holding"] as? Int) == 1 }, "\(log())")
        // The reload validates and ends the round, which drains: it waits for the held answer.
        run.kill(SIGHUP)
        #expect(try await eventually { log().contains("configuration reloaded") }, "\(log())")
        run.kill(SIGTERM)
        // The answer is released once dq run has taken the stop: a signal is handled on a task of its own, which a
        // busy machine may run only after the drain ended (a new round had then sent item 1 before the stop).
        #expect(try await eventually { log().contains("stopping on SIGTERM") }, "\(log())")
        try await proxy.release()
        let result = await run.wait(timeout: .seconds(60))
        #expect(result.status == 0, "\(result.stderr)")
        // Item 0 was answered and journaled; no round came after the stop to send the other two.
        #expect(try await server.values("Observation", system: resources.system) == ["0"])
        let status = try await dq(["status", "--json"], env)
        let counts = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(counts["pending"] as? Int == 2 && counts["delivered"] as? Int == 1, "\(status.stdout)")
    }

    @Test("dq run whose database stops taking writes (a file-size limit): logged once, nothing sent after, clean SIGTERM")
    func fileSizeLimitUnderRun() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base, idempotent: false, batch: 1)
        let config = try work.write("dq.json", #"{"retry": {"initial_seconds": 0.1, "maximum_seconds": 0.3}}"#)
        #expect(try await dq(["enqueue", try work.write("warm.json", resources.observation(100))], env).status == 0)
        #expect(try await dq(["flush", "--now"], env).status == 0)
        // dq run may write 150 blocks to a file; other processes then make the WAL larger than that.
        let port = Peers.freePort()
        let run = try ChildProcess(
            "/bin/sh",
            [
                "-c", #"ulimit -f 150 && exec "$0" run --poll-interval 0.05 --config "$1" --metrics-address "$2""#, Peers.dqBinary,
                config, "127.0.0.1:\(port)",
            ],
            environment: env)
        let readyz = { () async -> (Int, String) in
            guard let (status, body) = try? await HTTP.get("http://127.0.0.1:\(port)/readyz") else { return (0, "") }
            return (status, String(decoding: body, as: UTF8.self))
        }
        #expect(try await eventually { await readyz().0 == 200 }, "ready before the fault")
        let padding = String(repeating: "x", count: 50_000)
        for index in 0..<6 {
            let file = try work.write("big\(index).json", resources.observation(index, extra: padding))
            #expect(try await dq(["enqueue", file], env).status == 0)
        }
        let values = { try await server.values("Observation", system: resources.system).filter { $0 != "100" } }
        let reported = try await eventually(timeout: .seconds(30)) {
            ((try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "").contains("flush failed")
        }
        #expect(reported, "the failed journal write is logged")
        let atReport = try await values()
        try await Task.sleep(for: .seconds(2))  // a dozen backoff rounds
        let later = try await values()
        #expect(later.count == atReport.count, "nothing sent after the failure was logged: \(atReport) then \(later)")
        let (status, reason) = await readyz()
        #expect(status == 503 && reason.contains(#""ready":false"#) && reason.contains("flush failed"), "\(status) \(reason)")
        #expect(try await HTTP.get("http://127.0.0.1:\(port)/healthz").0 == 200, "alive all the same")
        #expect(!atReport.isEmpty && Set(atReport).count == atReport.count, "no copy sent while failing: \(atReport)")
        run.kill(SIGTERM)
        let result = await run.wait(timeout: .seconds(30))
        #expect(result.status == 0, "a clean exit on SIGTERM: \(result.stderr)")
        #expect(result.stderr.components(separatedBy: "flush failed").count == 2, "logged once: \(result.stderr)")

        #expect(try await dq(["flush", "--now"], env).status == 0)
        let delivered = try await values()
        var firsts: [String] = []
        for value in delivered where !firsts.contains(value) { firsts.append(value) }
        #expect(firsts == (0..<6).map(String.init), "every item, in order: \(delivered)")
        // The next process sends again what dq run delivered but could not journal: the requests on the wire
        // when the write failed (the journal commits while the next request goes out), never more than once.
        let copies = Dictionary(grouping: delivered) { $0 }.mapValues(\.count)
        #expect(copies.values.allSatisfy { $0 <= 2 }, "\(delivered)")
        #expect(delivered.count - firsts.count <= atReport.count, "only items sent before the failure was logged: \(delivered)")
    }

    @Test("Log lines: under systemd's journal stream each starts with its syslog priority; --log-format json lines parse, without secrets")
    func logFormats() async throws {
        let server = try FHIRServer()  // never started: a warning that delivery stopped
        var env = environment(server.base)
        env["DQ_TOKEN"] = "tok-s3cret-value"
        #expect(try await dq(["enqueue", try work.write("one.json", resources.observation(0))], env).status == 0)

        // JOURNAL_STREAM names the file standard error is (as systemd sets it): priority prefixes.
        let journalFile = work.file("journal.err")
        _ = FileManager.default.createFile(atPath: journalFile, contents: nil)
        var info = stat()
        #expect(stat(journalFile, &info) == 0)
        let journal = try ChildProcess(
            "/bin/sh", ["-c", #"exec "$0" run --poll-interval 0.1 2>>"$1""#, Peers.dqBinary, journalFile],
            environment: env.merging(["JOURNAL_STREAM": "\(info.st_dev):\(info.st_ino)"]) { $1 })
        let text = { (try? String(contentsOfFile: journalFile, encoding: .utf8)) ?? "" }
        #expect(try await eventually { text().contains("delivery stopped") })
        journal.kill(SIGTERM)
        #expect(await journal.wait(timeout: .seconds(30)).status == 0)
        let lines = text().split(separator: "\n").map(String.init)
        #expect(lines.contains { $0.hasPrefix("<4>dq: warning: delivery stopped") }, "\(lines)")
        #expect(lines.allSatisfy { $0.hasPrefix("<") }, "every line prefixed: \(lines)")

        // dq's own lines, not only the logger's: a refused setting is an error (<3>), an unknown variable a
        // warning (<4>).
        try Data().write(to: URL(fileURLWithPath: journalFile))
        let journalEnvironment = env.merging(["JOURNAL_STREAM": "\(info.st_dev):\(info.st_ino)"]) { $1 }
        let refused = try await ChildProcess(
            "/bin/sh", ["-c", #"exec "$0" flush --now 2>>"$1""#, Peers.dqBinary, journalFile],
            environment: journalEnvironment.merging(["DQ_BATCH_SIZE": "0"]) { $1 }
        ).wait()
        #expect(refused.status == 78)
        let warned = try await ChildProcess(
            "/bin/sh", ["-c", #"exec "$0" status 2>>"$1""#, Peers.dqBinary, journalFile],
            environment: journalEnvironment.merging(["DQ_SEVER": "x"]) { $1 }
        ).wait()
        #expect(warned.status == 0)
        let refusedLines = text().split(separator: "\n").map(String.init)
        #expect(refusedLines.contains { $0.hasPrefix("<3>dq: configuration: DQ_BATCH_SIZE must be") }, "\(refusedLines)")
        #expect(refusedLines.contains { $0.hasPrefix("<4>dq: warning: DQ_SEVER is not a dq setting") }, "\(refusedLines)")
        #expect(!refusedLines.isEmpty && refusedLines.allSatisfy { $0.hasPrefix("<") }, "every line prefixed: \(refusedLines)")

        // A usage error (ArgumentParser's, exit 64) is an error line too, every line of it prefixed.
        try Data().write(to: URL(fileURLWithPath: journalFile))
        let usage = try await ChildProcess(
            "/bin/sh", ["-c", #"exec "$0" flush --bogus 2>>"$1""#, Peers.dqBinary, journalFile], environment: journalEnvironment
        ).wait()
        #expect(usage.status == 64)
        let usageLines = text().split(separator: "\n").map(String.init)
        #expect(usageLines.first?.hasPrefix("<3>") == true && usageLines.contains { $0.contains("--bogus") }, "\(usageLines)")
        #expect(usageLines.allSatisfy { $0.hasPrefix("<3>") }, "every line prefixed: \(usageLines)")
        // In JSON: a usage error (DQ_LOG_FORMAT names the format, as no flag was read), and the warnings written
        // while the settings are read, before the queue opens.
        let usageJSON = try await dq(["status", "--nope"], env.merging(["DQ_LOG_FORMAT": "json"]) { $1 })
        #expect(usageJSON.status == 64)
        let early = try await dq(
            ["status", "--log-format", "json", "--proxy", "http://u:pw-S3CRET@proxy.example:3128"],
            env.merging(["DQ_SEVER": "x"]) { $1 })
        #expect(early.status == 0, "\(early.stderr)")
        for (output, wanted) in [(usageJSON.stderr, "--nope"), (early.stderr, "DQ_SEVER"), (early.stderr, "--proxy")] {
            let lines = output.split(separator: "\n")
            let objects = lines.compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
            #expect(!lines.isEmpty && objects.count == lines.count, "not JSON lines: \(output)")
            #expect(objects.contains { ($0["message"] as? String)?.contains(wanted) == true }, "\(wanted): \(output)")
        }
        #expect(!early.stderr.contains("pw-S3CRET"))

        // A JOURNAL_STREAM that is not standard error (a child of a service writing elsewhere): plain lines.
        let plain = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1"], environment: env.merging(["JOURNAL_STREAM": "1:2"]) { $1 })
        #expect(
            try await eventually { ((try? String(contentsOfFile: plain.stderrPath, encoding: .utf8)) ?? "").contains("delivery stopped") })
        plain.kill(SIGTERM)
        let plainResult = await plain.wait(timeout: .seconds(30))
        #expect(plainResult.stderr.hasPrefix("dq: warning: delivery stopped"), "\(plainResult.stderr)")

        // JSON lines for log shippers.
        let json = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.1", "--log-format", "json"], environment: env)
        #expect(
            try await eventually { ((try? String(contentsOfFile: json.stderrPath, encoding: .utf8)) ?? "").contains("delivery stopped") })
        json.kill(SIGTERM)
        let jsonResult = await json.wait(timeout: .seconds(30))
        let objects = jsonResult.stderr.split(separator: "\n").map {
            try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any]
        }
        #expect(!objects.isEmpty && objects.allSatisfy { $0 != nil }, "every line is a JSON object: \(jsonResult.stderr)")
        let stopped = objects.compactMap { $0 }.first { ($0["message"] as? String) == "delivery stopped; items stay queued" }
        #expect(stopped?["level"] as? String == "warning" && stopped?["queue"] as? String == server.base, "\(jsonResult.stderr)")
        #expect((stopped?["time"] as? String)?.hasSuffix("Z") == true, "RFC 3339 in UTC")
        #expect(!jsonResult.stderr.contains("tok-s3cret-value") && !text().contains("tok-s3cret-value"), "no secret in any line")
        // A one-shot flush's own lines (what it could not do) are JSON objects too, at their level.
        let flushJSON = try await dq(["flush", "--now", "--log-format", "json"], env)
        #expect(flushJSON.status == 75, "\(flushJSON.stderr)")
        let flushObjects = flushJSON.stderr.split(separator: "\n").map {
            try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any]
        }
        #expect(!flushObjects.isEmpty && flushObjects.allSatisfy { $0 != nil }, "every line is a JSON object: \(flushJSON.stderr)")
        #expect(
            flushObjects.compactMap { $0 }.contains {
                $0["level"] as? String == "error" && !(($0["message"] as? String) ?? "dq: ").hasPrefix("dq: ")
            },
            "\(flushJSON.stderr)")
        #expect(!flushJSON.stderr.contains("tok-s3cret-value"))
        let bad = try await dq(["flush", "--log-format", "xml"], env)
        #expect(bad.status == 78 && bad.stderr.contains("text or json"), "\(bad.stderr)")
    }

    @Test("A one-shot dq flush whose journal write fails stops at once and exits 74; the next flush delivers the rest")
    func flushUnderFileSizeLimit() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base, idempotent: false, batch: 1)
        let padding = String(repeating: "x", count: 50_000)
        for index in 0..<6 {
            #expect(
                try await dq(["enqueue", try work.write("big\(index).json", resources.observation(index, extra: padding))], env).status == 0
            )
        }
        // The WAL already holds 300 KB: the limit stops the first journal write.
        let limited = try await ChildProcess(
            "/bin/sh", ["-c", #"ulimit -f 100 && exec "$0" flush --now"#, Peers.dqBinary], environment: env
        ).wait()
        #expect(limited.status == 74, "\(limited.stderr)")
        #expect(limited.stderr.contains("cannot record a delivery"), "\(limited.stderr)")
        let sent = try await server.values("Observation", system: resources.system)
        #expect(sent.count <= 2, "stopped at once: at most the request on the wire after the first: \(sent)")
        #expect(try await dq(["flush", "--now"], env).status == 0)
        var firsts: [String] = []
        let all = try await server.values("Observation", system: resources.system)
        for value in all where !firsts.contains(value) { firsts.append(value) }
        #expect(firsts == (0..<6).map(String.init) && all.count - firsts.count <= sent.count, "\(all)")
    }

    @Test("dq flush --metrics-textfile: node_exporter's textfile, parsed by prometheus_client: counts, gauges, build info")
    func metricsTextfile() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base, idempotent: false, batch: 1)
        let lines = [resources.observation(0), resources.invalid(1), resources.observation(2)]
        #expect(try await dq(["enqueue", "--ndjson", try work.write("three.ndjson", lines.joined(separator: "\n"))], env).status == 0)
        let textfile = work.file("dq.prom")
        let flushed = try await dq(["flush", "--metrics-textfile", textfile], env)
        #expect(flushed.status == 65, "one parked: \(flushed.stderr)")
        let script = """
            import sys, json
            from prometheus_client.parser import text_string_to_metric_families
            out = {}
            for family in text_string_to_metric_families(open(sys.argv[1]).read()):
                for sample in family.samples:
                    out[sample.name] = (sample.value, sample.labels)
            print(json.dumps(out))
            """
        let parsed = try await ChildProcess(Peers.venv + "/bin/python", ["-c", script, textfile]).wait()
        #expect(parsed.status == 0, "the textfile parses: \(parsed.stderr)")
        let samples = try JSONSerialization.jsonObject(with: Data(parsed.stdout.utf8)) as? [String: [Any]] ?? [:]
        func value(_ name: String) -> Double? { samples[name]?.first as? Double }
        #expect(value("dq_items_delivered_total") == 2, "\(parsed.stdout)")
        #expect(value("dq_items_parked_total") == 1 && value("dq_items_parked") == 1)
        #expect(value("dq_queue_depth") == 0)
        let last = try #require(value("dq_last_delivery_timestamp_seconds"))
        #expect(abs(last - Date().timeIntervalSince1970) < 600, "a recent Unix time: \(last)")
        #expect((samples["dq_build_info"]?.last as? [String: String])?["version"] != nil, "\(parsed.stdout)")
        // The file is written as `<textfile>.<pid>.tmp` and renamed: nothing of that kind is left beside it.
        let folder = (textfile as NSString).deletingLastPathComponent
        let name = (textfile as NSString).lastPathComponent
        let leftovers = try FileManager.default.contentsOfDirectory(atPath: folder).filter { $0.hasPrefix(name + ".") }
        #expect(leftovers.isEmpty, "no temporary file left: \(leftovers)")
        // Every family has its HELP text, as the parser reads it.
        let helpScript = """
            import sys, json
            from prometheus_client.parser import text_string_to_metric_families
            print(json.dumps({f.name: f.documentation for f in text_string_to_metric_families(open(sys.argv[1]).read())}))
            """
        let help = try await ChildProcess(Peers.venv + "/bin/python", ["-c", helpScript, textfile]).wait()
        let documented = try JSONSerialization.jsonObject(with: Data(help.stdout.utf8)) as? [String: String] ?? [:]
        #expect(documented.count >= 8, "\(help.stdout) \(help.stderr)")
        #expect(documented.values.allSatisfy { !$0.isEmpty }, "\(documented)")
        #expect(documented["dq_queue_depth"] == "Items pending in the queue now.", "\(documented)")

        // A later cron flush with nothing to do still reports when the last delivery was.
        #expect(try await dq(["flush", "--metrics-textfile", textfile], env).status == 0)
        let again = try await ChildProcess(Peers.venv + "/bin/python", ["-c", script, textfile]).wait()
        let later = try JSONSerialization.jsonObject(with: Data(again.stdout.utf8)) as? [String: [Any]] ?? [:]
        #expect((later["dq_last_delivery_timestamp_seconds"]?.first as? Double) == last, "from the journal, not this process")
    }

    @Test(
        "SIGHUP reloads: a rotated secret file takes effect without a restart; a broken configuration is refused and the old one keeps delivering"
    )
    func reloadOnHangup() async throws {
        let server = try FHIRServer(tokens: ["new-t0ken"], readerToken: "new-t0ken")
        try await server.start()
        let credentials = work.file("creds")
        try FileManager.default.createDirectory(atPath: credentials, withIntermediateDirectories: true)
        let token = credentials + "/token"
        _ = FileManager.default.createFile(atPath: token, contents: Data("old-t0ken".utf8), attributes: [.posixPermissions: 0o600])
        let configText =
            #"{"server": "\#(server.base)", "auth": {"bearer_token_file": "token"}, "retry": {"initial_seconds": 0.1, "maximum_seconds": 0.3}}"#
        let config = try work.write("dq.json", configText)
        let env = [
            "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path, "CREDENTIALS_DIRECTORY": credentials, "DQ_LOG_LEVEL": "notice",
        ]
        #expect(
            try await dq(["enqueue", "--config", config, "--ndjson", try work.write("two.ndjson", resources.ndjson(0..<2))], env).status
                == 0)
        let run = try ChildProcess(Peers.dqBinary, ["run", "--config", config, "--poll-interval", "0.1"], environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { log().contains("delivery stopped") }, "the old token is refused: \(log())")

        // The secret rotated in its file, then SIGHUP: delivered with the new one, no restart.
        try Data("new-t0ken".utf8).write(to: URL(fileURLWithPath: token))
        run.kill(SIGHUP)
        #expect(try await eventually { (try await server.values("Observation", system: resources.system)) == ["0", "1"] }, "\(log())")
        #expect(log().contains("configuration reloaded") && log().contains("changed=auth.bearer_token"), "\(log())")

        // A configuration that does not validate: refused, logged, and the running one goes on delivering.
        try Data("{".utf8).write(to: URL(fileURLWithPath: config))
        run.kill(SIGHUP)
        #expect(try await eventually { log().contains("reload refused") }, "\(log())")
        #expect(run.isRunning)
        try Data(configText.utf8).write(to: URL(fileURLWithPath: config))
        #expect(try await dq(["enqueue", "--config", config, try work.write("third.json", resources.observation(2))], env).status == 0)
        #expect(try await eventually { (try await server.values("Observation", system: resources.system)) == ["0", "1", "2"] })
        run.kill(SIGTERM)
        let result = await run.wait(timeout: .seconds(30))
        #expect(result.status == 0, "\(result.stderr)")
        #expect(!result.stderr.contains("t0ken"), "no token in any line")
    }

    /// The inode of the socket listening on 127.0.0.1:`port` (from /proc/net/tcp): which socket it is.
    static func listeningSocket(port: Int) -> String? {
        guard let table = try? String(contentsOfFile: "/proc/net/tcp", encoding: .utf8) else { return nil }
        let local = "0100007F:" + String(format: "%04X", port)
        for line in table.split(separator: "\n").dropFirst() {
            let fields = line.split(separator: " ")
            if fields.count > 9, fields[1] == local, fields[3] == "0A" { return String(fields[9]) }
        }
        return nil
    }

    @Test(
        "SIGHUP keeps the metrics endpoint: a client's keep-alive connection and the listening socket survive the reload, and the changed setting takes effect"
    )
    func reloadKeepsMetricsListener() async throws {
        let server = try await FHIRServer.start()
        let port = Peers.freePort()
        let config = try work.write("dq.json", #"{"server": "\#(server.base)", "batch_size": 1}"#)
        let env = ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path, "DQ_LOG_LEVEL": "notice"]
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--config", config, "--poll-interval", "0.1", "--metrics-address", "127.0.0.1:\(port)"],
            environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { (try? await HTTP.get("http://127.0.0.1:\(port)/readyz"))?.0 == 200 }, "\(log())")

        // One HTTP/1.1 connection (Python's http.client, which never reconnects on its own after the server closed
        // it): a request, then, after the reload, two more on the same socket.
        let client = try ChildProcess(
            "/usr/bin/env",
            [
                "python3", "-c",
                """
                import http.client, sys, time
                c = http.client.HTTPConnection("127.0.0.1", \(port), timeout=30)
                c.request("GET", "/metrics"); r = c.getresponse(); r.read()
                first = c.sock.getsockname()
                print("first", r.status, flush=True)
                sys.stdin.readline()
                c.auto_open = 0
                for path in ("/metrics", "/readyz"):
                    # Asked again on this connection while it answers 503: the 200 the test saw after the reload's
                    # log line may have been the old round's, still draining, and between two rounds (and while the
                    # next one starts) /readyz says 503, "reloading" or "starting".
                    for _ in range(600):
                        c.request("GET", path); r = c.getresponse(); body = r.read()
                        if r.status != 503: break
                        time.sleep(0.05)
                    print(path, r.status, c.sock.getsockname() == first, flush=True)
                """,
            ], keepStdinOpen: true)
        #expect(try await eventually { client.outputSoFar.contains("first 200") }, "\(client.outputSoFar)")
        let listening = try #require(Self.listeningSocket(port: port), "no socket listens on \(port)")

        // dq's own keys are reported too: one that applies at the next round (the flag keeps the interval), one
        // that applies at the next start.
        try Data(#"{"server": "\#(server.base)", "batch_size": 7, "poll_interval_seconds": 0.5, "log_format": "text"}"#.utf8)
            .write(to: URL(fileURLWithPath: config))
        run.kill(SIGHUP)
        #expect(
            try await eventually { log().contains("changed=batch_size,log_format (at the next start),poll_interval_seconds") }, "\(log())")
        // Ready again (the old round draining, or the new one running), then the old connection asks.
        #expect(try await eventually { (try? await HTTP.get("http://127.0.0.1:\(port)/readyz"))?.0 == 200 }, "\(log())")
        #expect(Self.listeningSocket(port: port) == listening, "the listening socket is the one from before the reload")
        client.writeStdin(Data("go\n".utf8))
        client.closeStdin()
        let answers = await client.wait(timeout: .seconds(60))
        #expect(answers.status == 0, "\(answers.stderr)")
        #expect(
            answers.stdout.contains("/metrics 200 True") && answers.stdout.contains("/readyz 200 True"),
            "\(answers.stdout) \(answers.stderr)")

        // The new setting is the one in use: seven items go in one Bundle, not one by one.
        let file = try work.write("seven.ndjson", resources.ndjson(0..<7))
        #expect(try await dq(["enqueue", "--config", config, "--ndjson", file], env).status == 0)
        // The seven journal lines commit after the Bundle's answer reaches the flusher (sekmet has stored it before):
        // wait on the journal, then check the server's copy.
        var journal = try await dq(["log", "--json", "--config", config], env)
        var lines: [[String: Any]] = []
        let journaled = try await eventually {
            journal = try await dq(["log", "--json", "--config", config], env)
            lines = (try? JSONSerialization.jsonObject(with: Data(journal.stdout.utf8)) as? [[String: Any]]) ?? []
            return lines.count == 7
        }
        #expect(journaled, "\(journal.stdout.prefix(600))")
        #expect(try await server.values("Observation", system: resources.system).count == 7)
        #expect(Set(lines.compactMap { $0["bundle"] as? String }).count == 1, "one Bundle of seven: \(journal.stdout.prefix(600))")
        let metrics = String(decoding: try await HTTP.get("http://127.0.0.1:\(port)/metrics").1, as: UTF8.self)
        #expect(metrics.contains("dq_"), "\(metrics.prefix(500))")
        run.kill(SIGTERM)
        #expect(await run.wait(timeout: .seconds(30)).status == 0)
    }

    @Test("/readyz: a server that is down is not a readiness failure; an item older than --ready-max-age is")
    func readinessAge() async throws {
        let server = try FHIRServer()  // never started: connection refused
        let env = environment(server.base)
        #expect(try await dq(["enqueue", try work.write("one.json", resources.observation(0))], env).status == 0)
        let port = Peers.freePort()
        // dq run's own settings from the environment, as from flags (DQ_METRICS_ADDRESS, DQ_POLL_INTERVAL_SECONDS).
        let relaxed = try ChildProcess(
            Peers.dqBinary, ["run"],
            environment: env.merging(["DQ_METRICS_ADDRESS": "127.0.0.1:\(port)", "DQ_POLL_INTERVAL_SECONDS": "0.1"]) { $1 })
        #expect(try await eventually { (try? await HTTP.get("http://127.0.0.1:\(port)/readyz").0) == 200 }, "ready, waiting for the server")
        relaxed.kill(SIGTERM)
        #expect(await relaxed.wait(timeout: .seconds(30)).status == 0)
        try await Task.sleep(for: .seconds(1.2))
        let strict = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1", "--metrics-address", "127.0.0.1:\(port)", "--ready-max-age", "1"],
            environment: env)
        var answer = (0, "")
        let failed = try await eventually {
            guard let (status, body) = try? await HTTP.get("http://127.0.0.1:\(port)/readyz") else { return false }
            answer = (status, String(decoding: body, as: UTF8.self))
            return status == 503 && answer.1.contains("the oldest pending item waits")
        }
        #expect(failed && answer.1.contains("the oldest pending item waits"), "\(answer)")
        strict.kill(SIGTERM)
        #expect(await strict.wait(timeout: .seconds(30)).status == 0)
    }

    @Test(
        "/readyz turns 503 while the database files refuse writes (chattr +i) and 200 once they take them again; nothing lost",
        .enabled(if: getuid() == 0, "chattr +i needs root (make test runs as root on CI)"))
    func readinessUnwritable() async throws {
        let server = try FHIRServer()
        let env = environment(server.base, idempotent: false, batch: 1)
        let config = try work.write("dq.json", #"{"retry": {"initial_seconds": 0.1, "maximum_seconds": 0.3}}"#)
        #expect(try await dq(["enqueue", "--ndjson", try work.write("two.ndjson", resources.ndjson(0..<2))], env).status == 0)
        let port = Peers.freePort()
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1", "--config", config, "--metrics-address", "127.0.0.1:\(port)"],
            environment: env)
        let ready = { (try? await HTTP.get("http://127.0.0.1:\(port)/readyz").0) ?? 0 }
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { await ready() == 200 })
        // The database and its WAL, not the -shm: on ext4 a write to a mapped page of an immutable file is SIGBUS
        // once the kernel has written the page back, in any SQLite program (README, "Writes refused").
        let files = ["", "-wal"].map { work.file("queue.sqlite") + $0 }.filter { FileManager.default.fileExists(atPath: $0) }
        #expect(try await ChildProcess("/usr/bin/chattr", ["+i"] + files).wait().status == 0)
        // On a thrown error only (the files are made writable again below): not awaited, a defer cannot.
        defer { _ = try? BackgroundProcess("/usr/bin/chattr", ["-i"] + files, stdout: .null, stderr: .null) }
        try await server.start()
        #expect(try await eventually { await ready() == 503 }, "not ready while writes fail: \(log()), running: \(run.isRunning)")
        // Counted by kind, for an alert: dq_flush_errors_total{kind="storage"} (or storage_full).
        let metrics = String(decoding: (try await HTTP.get("http://127.0.0.1:\(port)/metrics")).1, as: UTF8.self)
        let storageErrors = metrics.split(separator: "\n").filter {
            $0.hasPrefix("dq_flush_errors_total{") && ($0.contains("kind=\"storage\"") || $0.contains("kind=\"storage_full\""))
        }.compactMap { $0.split(separator: " ").last.flatMap { Double($0) } }.reduce(0, +)
        #expect(storageErrors >= 1, "\(metrics.split(separator: "\n").filter { $0.contains("flush_errors") })")
        #expect(try await ChildProcess("/usr/bin/chattr", ["-i"] + files).wait().status == 0)
        #expect(try await eventually { await ready() == 200 }, "ready again once the files take writes")
        #expect(
            try await eventually {
                Set(try await server.values("Observation", system: resources.system)) == ["0", "1"]
            })
        run.kill(SIGTERM)
        #expect(await run.wait(timeout: .seconds(30)).status == 0)
        let values = try await server.values("Observation", system: resources.system)
        // The delivery whose journal write failed was held and written once the files took writes: not sent again.
        #expect(values == ["0", "1"], "\(values)")
    }

    @Test("Two dq run processes and a cron-style dq flush on one database deliver each item once")
    func twoRunnersAndCron() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base, batch: 4)
        let ports = [Peers.freePort(), Peers.freePort()]
        let first = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1", "--metrics-address", "127.0.0.1:\(ports[0])"], environment: env)
        let second = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1", "--metrics-address", "127.0.0.1:\(ports[1])"], environment: env)
        for chunk in 0..<8 {
            let file = try work.write("c\(chunk).ndjson", resources.ndjson((chunk * 10)..<(chunk * 10 + 10)))
            #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
            _ = try await dq(["flush", "--wait", "5"], env)
        }
        #expect(
            try await eventually(timeout: .seconds(60)) {
                (try await server.values("Observation", system: resources.system)).count >= 80
            })
        // The cron flushes may have delivered everything: each runner is stopped once it traps SIGTERM.
        for port in ports {
            #expect(try await serviceGroupRuns(metricsPort: port), "the runner with metrics on \(port) traps SIGTERM")
        }
        first.kill(SIGTERM)
        second.kill(SIGTERM)
        #expect(await first.wait(timeout: .seconds(30)).status == 0)
        #expect(await second.wait(timeout: .seconds(30)).status == 0)
        #expect(try await server.values("Observation", system: resources.system) == (0..<80).map(String.init))
    }

    @Test("/metrics after known work: 3 delivered, 1 parked, depth 0; /healthz answers")
    func metricsScrape() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base, idempotent: false, batch: 1)
        let port = Peers.freePort()
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.2", "--metrics-address", "127.0.0.1:\(port)"], environment: env)
        let lines = [resources.observation(0), resources.observation(1), resources.invalid(2), resources.observation(3)]
        let file = try work.write("four.ndjson", lines.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let queue = server.base
        let scraped = try await eventually(timeout: .seconds(30)) {
            guard let (status, body) = try? await HTTP.get("http://127.0.0.1:\(port)/metrics"), status == 200 else {
                return false
            }
            let text = String(decoding: body, as: UTF8.self)
            return text.contains(#"dq_items_delivered_total{destination="\#(queue)"} 3"#)
                && text.contains(#"dq_items_parked_total{destination="\#(queue)"} 1"#)
                && text.contains(#"dq_queue_depth{destination="\#(queue)"} 0"#)
        }
        let (_, body) = try await HTTP.get("http://127.0.0.1:\(port)/metrics")
        let text = String(decoding: body, as: UTF8.self)
        #expect(scraped, "\(text)")
        #expect(text.contains("dq_request_duration_seconds_bucket"))
        // Buckets up to the longest request timeout dq takes (a day); HELP text on the families.
        #expect(text.contains(#"dq_request_duration_seconds_bucket{destination="\#(queue)",le="120.0"}"#), "\(text)")
        #expect(text.contains(#"dq_request_duration_seconds_bucket{destination="\#(queue)",le="86400.0"}"#), "\(text)")
        #expect(text.contains("# HELP dq_items_delivered_total Items this process delivered"), "\(text)")
        let (health, ok) = try await HTTP.get("http://127.0.0.1:\(port)/healthz")
        #expect(health == 200 && String(decoding: ok, as: UTF8.self) == "ok\n")
        run.kill(SIGTERM)
        #expect(await run.wait(timeout: .seconds(30)).status == 0)
    }

    @Test(
        "The gauges move: while the server is down the oldest pending item ages and the backoff ends in the future; once delivered both are 0"
    )
    func gaugesMove() async throws {
        let server = try FHIRServer()  // not started yet: connection refused
        var env = environment(server.base)
        env["DQ_RETRY_INITIAL_SECONDS"] = "0.5"
        env["DQ_RETRY_MAXIMUM_SECONDS"] = "1"
        #expect(try await dq(["enqueue", try work.write("one.json", resources.observation(0))], env).status == 0)
        let port = Peers.freePort()
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1", "--metrics-address", "127.0.0.1:\(port)"], environment: env)
        let queue = server.base
        func gauge(_ name: String) async -> Double? {
            guard let (status, body) = try? await HTTP.get("http://127.0.0.1:\(port)/metrics"), status == 200 else { return nil }
            let prefix = "\(name){destination=\"\(queue)\"} "
            return String(decoding: body, as: UTF8.self).split(separator: "\n").first { $0.hasPrefix(prefix) }
                .flatMap { Double($0.dropFirst(prefix.count)) }
        }
        #expect(try await eventually { (await gauge("dq_backoff_until_timestamp_seconds") ?? 0) > Date().timeIntervalSince1970 - 1 })
        let backoff = await gauge("dq_backoff_until_timestamp_seconds") ?? 0
        #expect(backoff > 1_000_000_000, "a Unix time: \(backoff)")
        let firstAge = await gauge("dq_oldest_pending_age_seconds") ?? 0
        #expect(firstAge > 0, "an item pending: \(firstAge)")
        #expect(
            try await eventually { (await gauge("dq_oldest_pending_age_seconds") ?? 0) >= firstAge + 1 },
            "the pending item ages from \(firstAge)")
        #expect(await gauge("dq_queue_depth") == 1)

        try await server.start()
        #expect(
            try await eventually {
                let depth = await gauge("dq_queue_depth")
                let age = await gauge("dq_oldest_pending_age_seconds")
                let backoff = await gauge("dq_backoff_until_timestamp_seconds")
                return depth == 0 && age == 0 && backoff == 0
            }, "delivered: no pending age, no backoff")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])

        #expect(await gauge("dq_items_parked") == 0)
        run.kill(SIGTERM)
        #expect(await run.wait(timeout: .seconds(30)).status == 0)

        // Parked items are a gauge of the queue, whoever parked them: an item parked by a one-shot flush while no
        // dq run is up shows in the next dq run's gauge (its own counter stays 0), and dq drop takes it away.
        #expect(try await dq(["send", try work.write("bad.json", resources.invalid(1))], env).status == 65)
        let next = try ChildProcess(
            Peers.dqBinary, ["run", "--poll-interval", "0.1", "--metrics-address", "127.0.0.1:\(port)"], environment: env)
        #expect(try await eventually { await gauge("dq_items_parked") == 1 }, "the item another process parked")
        #expect(await gauge("dq_items_parked_total") ?? 0 == 0, "this dq run parked nothing")
        let parked = try await dq(["list", "--parked", "--json"], env)
        let id = try #require(
            (try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [[String: Any]])?.first?["id"] as? String,
            "\(parked.stdout)")
        #expect(try await dq(["drop", id], env).status == 0)
        #expect(try await eventually { await gauge("dq_items_parked") == 0 }, "dropped")
        next.kill(SIGTERM)
        #expect(await next.wait(timeout: .seconds(30)).status == 0)
    }

    @Test("With NOTIFY_SOCKET, dq run tells systemd READY=1 and STOPPING=1, and WATCHDOG=1 when WATCHDOG_USEC asks")
    func systemdNotify() async throws {
        let notify = try NotifySocket(path: work.file("notify.sock"))
        var env = environment("http://127.0.0.1:9/fhir")
        env["NOTIFY_SOCKET"] = notify.path
        let run = try ChildProcess(Peers.dqBinary, ["run"], environment: env)
        let ready = await notify.receive()
        #expect(ready.contains("READY=1"), "\(ready)")
        run.kill(SIGTERM)
        let stopping = await notify.receive()
        #expect(stopping.contains("STOPPING=1"), "\(stopping)")
        #expect(await run.wait(timeout: .seconds(30)).status == 0)

        // WatchdogSec=: WATCHDOG=1 from the delivery loop at least every half of WATCHDOG_USEC, also while it
        // backs off from a server that is down (poll interval 30 s, longer than the watchdog).
        env["WATCHDOG_USEC"] = "400000"
        let watched = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "30"], environment: env)
        // Without beats during the waits there would be one per 30 s round: five take at least two rounds.
        let messages = await notify.messages(until: 5, contain: "WATCHDOG=1")
        watched.kill(SIGTERM)
        #expect(await watched.wait(timeout: .seconds(30)).status == 0)
        #expect(messages.filter { $0.contains("WATCHDOG=1") }.count >= 5, "beats while waiting: \(messages)")
        // The watched run's last beats and its STOPPING=1 go first, so that the next run is judged by its own.
        _ = notify.waiting()
        env["WATCHDOG_PID"] = "1"
        let other = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "30"], environment: env)
        // From its READY=1 (its group runs and traps SIGTERM) for three watchdog periods, then to its end.
        var foreign = [await notify.receive()]
        for _ in 0..<3 {
            let message = await notify.receive(timeout: .seconds(1))
            if !message.isEmpty { foreign.append(message) }
        }
        other.kill(SIGTERM)
        #expect(await other.wait(timeout: .seconds(30)).status == 0)
        foreign += notify.waiting()
        #expect(foreign[0].contains("READY=1"), "\(foreign)")
        #expect(!foreign.contains { $0.contains("WATCHDOG=1") }, "WATCHDOG_PID of another process: no beats: \(foreign)")
    }

    @Test(
        "systemd-analyze verify accepts the shipped units",
        arguments: ["dq.service", "dq-serve.service", "dq-flush.service", "dq-flush.timer"])
    func unitFileVerifies(name: String) async throws {
        let analyze = "/usr/bin/systemd-analyze"
        try #require(FileManager.default.isExecutableFile(atPath: analyze), "systemd-analyze is missing: make deps installs systemd")
        let directory = Peers.packageRoot.appendingPathComponent("Examples/systemd")
        // The units name the installed binary; verify them against the built one (a timer beside its service).
        var local = ""
        for file in name.hasSuffix(".timer") ? ["dq-flush.service", name] : [name] {
            let unit = try String(contentsOf: directory.appendingPathComponent(file), encoding: .utf8)
            local = try work.write(file, unit.replacingOccurrences(of: "/usr/local/bin/dq", with: Peers.dqBinary))
        }
        let result = try await ChildProcess(analyze, ["verify", local]).wait(timeout: .seconds(60))
        let complaints = result.stderr.split(separator: "\n").filter { line in
            // Only the units' own lines count; systemd also comments on units of the host it runs on.
            line.contains("dq.service") || line.contains("dq-flush")
        }
        #expect(result.status == 0 && complaints.isEmpty, "\(result.stdout)\(result.stderr)")
        guard name.hasSuffix(".service") else { return }
        // The hardening systemd proposes, as far as dq allows (the unit says what is left out and why): an
        // exposure of 1.2 ("OK") with it, 1.8 without the system call, IPC, mount and /proc lines.
        let security = try await ChildProcess(analyze, ["security", "--offline=true", "--threshold=13", local]).wait(timeout: .seconds(60))
        let overall = security.stdout.split(separator: "\n").first { $0.contains("Overall exposure level") }.map(String.init) ?? ""
        let level = overall.split(separator: " ").compactMap { Double($0) }.first
        #expect(level != nil && level! <= 1.2, "\(overall)\n\(security.stdout.suffix(3000))\(security.stderr)")
        for line in ["ProtectProc=", "SystemCallFilter=~@privileged", "SystemCallFilter=~@resources", "RemoveIPC=", "PrivateMounts="] {
            #expect(
                security.stdout.split(separator: "\n").contains { $0.contains("✓ \(line)") },
                "\(line) not set: \(security.stdout.suffix(3000))")
        }
    }
}
