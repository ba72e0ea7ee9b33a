import Foundation
import GRDB
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// The defects an outside probe found in the command line (issue 42), each run as the probe ran it.
@Suite(
    "Defects found by the probe, through dq",
    .enabled(if: Peers.required || FileManager.default.isExecutableFile(atPath: Peers.dqBinary), "dq is not built"))
struct ProbeCommandTests {
    let work: TemporaryDirectory
    let env: [String: String]

    init() throws {
        try #require(FileManager.default.isExecutableFile(atPath: Peers.dqBinary), "the dq binary \(Peers.dqBinary) is missing")
        work = try TemporaryDirectory()
        env = ["DQ_SERVER": "http://127.0.0.1:9/fhir", "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
    }

    func patient() throws -> String { try work.write("p.json", #"{"resourceType":"Patient"}"#) }

    @Test(
        "A server URL whose port overflows is refused (78) naming the port, and nothing is opened",
        arguments: ["99999999999999999999", "9223372036854775808", "18446744073709551616"])
    func overflowingServerPort(port: String) async throws {
        var environment = env
        environment["DQ_SERVER"] = "http://127.0.0.1:\(port)/fhir"
        let result = try await dq(["enqueue", try patient()], environment)
        #expect(result.status == 78, "\(result.stderr)")
        #expect(result.stderr.contains(port), "\(result.stderr)")
        #expect(!FileManager.default.fileExists(atPath: work.file("queue.sqlite")))
    }

    @Test("A token URL or proxy whose port overflows is refused (78)")
    func overflowingOtherPorts() async throws {
        let config = try work.write(
            "dq.json", #"{"auth": {"client_id": "c", "client_secret": "s", "token_uri": "http://127.0.0.1:18446744073709551616/token"}}"#)
        let token = try await dq(["enqueue", "--config", config, try patient()], env)
        #expect(token.status == 78, "\(token.stderr)")
        #expect(token.stderr.contains("18446744073709551616") && token.stderr.contains("auth.token_uri"), "\(token.stderr)")
        var environment = env
        environment["HTTPS_PROXY"] = "http://127.0.0.1:99999999999999999999"
        environment["HTTP_PROXY"] = "http://127.0.0.1:99999999999999999999"
        let proxy = try await dq(["enqueue", try patient()], environment)
        #expect(proxy.status == 78, "\(proxy.stderr)")
        #expect(proxy.stderr.contains("99999999999999999999"), "\(proxy.stderr)")
    }

    @Test("--metrics-address with a port out of range names the range")
    func metricsAddressRange() async throws {
        let result = try await dq(["run", "--metrics-address", "127.0.0.1:99999"], env)
        #expect(result.status == 64, "\(result.stderr)")
        #expect(result.stderr.contains("0 to 65535"), "\(result.stderr)")
    }

    @Test("Relative paths in a config file named without a directory are relative to that file's directory")
    func relativePathsInWorkingDirectory() async throws {
        let made = try await dq(["keygen", "--at-rest", "--out", work.file("ka")], env)
        #expect(made.status == 0, "\(made.stderr)")
        _ = try work.write("dq.json", #"{"at_rest": {"key_file": "ka"}}"#)
        let result = try await dq(["enqueue", "--config", "dq.json", try patient()], env, directory: work.path)
        #expect(result.status == 0, "\(result.stderr)")
        let status = try await dq(["status", "--config", "dq.json", "--json"], env, directory: work.path)
        #expect(status.status == 0, "\(status.stderr)")
        #expect(status.stdout.contains("\"pending\" : 1") || status.stdout.contains("\"pending\":1"), "\(status.stdout)")
    }

    @Test("dq keygen refusing to overwrite exits 73 (cannot create), naming the file; the file is unchanged")
    func keygenRefusal() async throws {
        let file = try work.write("existing.key", "keep me\n")
        for arguments in [["keygen", "--at-rest", "--out", file], ["keygen", "--out", file]] {
            let result = try await dq(arguments, env)
            #expect(result.status == 73, "\(arguments): \(result.stderr)")
            #expect(result.stderr.contains(file))
        }
        #expect(try String(contentsOfFile: file, encoding: .utf8) == "keep me\n")
    }

    @Test("dq rekey --to a missing file names the flag's file, not at_rest.key_file")
    func rekeyMissingTarget() async throws {
        #expect(try await dq(["keygen", "--at-rest", "--out", work.file("k1")], env).status == 0)
        let config = try work.write("dq.json", #"{"at_rest": {"key_file": "k1"}}"#)
        #expect(try await dq(["enqueue", "--config", config, try patient()], env).status == 0)
        let result = try await dq(["rekey", "--config", config, "--to", work.file("missing.key")], env)
        #expect(result.status == 78, "\(result.stderr)")
        #expect(result.stderr.contains("--to") && result.stderr.contains("missing.key"), "\(result.stderr)")
        #expect(!result.stderr.contains("at_rest.key_file"), "\(result.stderr)")
    }

    @Test("dq status --check --all needs no server, as dq status --all does")
    func checkAllWithoutServer() async throws {
        #expect(try await dq(["enqueue", try patient()], env).status == 0)
        var environment = env
        environment["DQ_SERVER"] = nil
        let result = try await dq(["status", "--check", "--all", "--max-pending", "5"], environment)
        #expect(result.status == 0, "\(result.stdout) \(result.stderr)")
        #expect(result.stdout.hasPrefix("DQ OK - 1 pending"), "\(result.stdout)")
        let critical = try await dq(["status", "--check", "--all", "--max-pending", "0"], environment)
        #expect(critical.status == 2, "\(critical.stdout)")
    }

    @Test("dq enqueue of a named pipe nobody writes to is refused at once, not waited on for ever")
    func fifoWithoutWriter() async throws {
        let fifo = work.file("pipe")
        #expect(mkfifo(fifo, 0o600) == 0)
        let child = try ChildProcess(Peers.dqBinary, ["enqueue", fifo], environment: env)
        let finished = try await eventually(timeout: .seconds(30)) { !child.isRunning }
        if !finished { child.kill() }
        #expect(finished, "dq enqueue still waits on the pipe")
        let result = await child.wait()
        #expect(result.status == 66, "\(result.stderr)")
        #expect(result.stderr.contains("named pipe"), "\(result.stderr)")
    }

    @Test("A UTF-8 byte order mark in the config file is named")
    func byteOrderMark() async throws {
        let config = work.file("bom.json")
        try (Data([0xEF, 0xBB, 0xBF]) + Data(#"{"batch_size": 5}"#.utf8)).write(to: URL(fileURLWithPath: config))
        let result = try await dq(["enqueue", "--config", config, try patient()], env)
        #expect(result.status == 78)
        #expect(result.stderr.contains("byte order mark"), "\(result.stderr)")
    }

    @Test("A repeated key inside at_rest is refused (78)")
    func repeatedAtRestKey() async throws {
        let config = try work.write("dq.json", #"{"at_rest": {"key_file": "a", "key_file": "b"}}"#)
        let result = try await dq(["enqueue", "--config", config, try patient()], env)
        #expect(result.status == 78, "\(result.stderr)")
        #expect(result.stderr.contains("\"at_rest.key_file\" appears twice"), "\(result.stderr)")
    }

    @Test("retry.initial_seconds above retry.maximum_seconds is refused (78)")
    func retryOrder() async throws {
        let config = try work.write("dq.json", #"{"retry": {"initial_seconds": 60, "maximum_seconds": 10}}"#)
        let result = try await dq(["enqueue", "--config", config, try patient()], env)
        #expect(result.status == 78, "\(result.stderr)")
        #expect(result.stderr.contains("retry.initial_seconds"), "\(result.stderr)")
    }

    /// A marker as it would show in a log: as text, or as the hex of its bytes.
    static func appears(_ marker: String, in text: String) -> Bool {
        let hex = marker.utf8.map { String(format: "%02x", $0) }.joined()
        return text.contains(marker) || text.lowercased().contains(hex) || text.lowercased().contains(hex.prefix(16))
    }

    @Test("At trace level no byte of a resource or an answer reaches the log; sizes and timings do", .enabled(if: Peers.enabled))
    func traceLogHasNoBodies() async throws {
        let server = try await FHIRServer.start()
        let marker = "Zyxwvuts\(UUID().uuidString.prefix(6))"
        let file = try work.write(
            "named.json", #"{"resourceType":"Patient","name":[{"family":"\#(marker)","given":["\#(marker)"]}]}"#)
        var environment = env
        environment["DQ_SERVER"] = server.base
        environment["DQ_LOG_LEVEL"] = "trace"
        #expect(try await dq(["enqueue", file], environment).status == 0)
        let flushed = try await dq(["flush"], environment)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(flushed.stderr.contains("HTTP exchange"), "the trace lines are there: \(flushed.stderr.prefix(2000))")
        #expect(!Self.appears(marker, in: flushed.stderr + flushed.stdout), "\(flushed.stderr)")
    }

    /// dq run on a queue whose server is down, with 400 items of 4 KB queued beside it: its WAL holds real pages.
    func runningWithBigWAL() async throws -> (ChildProcess, environment: [String: String], database: String) {
        var environment = env
        environment["DQ_CONFIG"] = try work.write("dq.json", #"{"retry": {"initial_seconds": 600}}"#)
        let body = String(repeating: "y", count: 4000)
        let lines = (0..<400).map { #"{"resourceType":"Observation","status":"final","code":{"text":"\#(body)\#($0)"}}"# }
        let run = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.1"], environment: environment)
        let database = work.file("queue.sqlite")
        #expect(try await eventually { FileManager.default.fileExists(atPath: database + "-wal") })
        let file = try work.write("many.ndjson", lines.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", file], environment).status == 0)
        let wal = (try FileManager.default.attributesOfItem(atPath: database + "-wal")[.size] as? NSNumber)?.intValue ?? 0
        #expect(wal > 500_000, "the WAL holds real pages: \(wal) bytes")
        return (run, environment, database)
    }

    /// After the old database went: one new item queued, its queue sound and holding nothing of the old one.
    func expectCleanSuccessor(_ environment: [String: String], _ database: String) async throws {
        let status = try await dq(["status", "--json"], environment)
        let counts = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(counts["pending"] as? Int == 1, "\(status.stdout)")
        let check = try await DatabaseQueue(path: database).read { db in try String.fetchOne(db, sql: "PRAGMA integrity_check") }
        #expect(check == "ok")
    }

    @Test(
        "A database deleted under dq run: dq run stops (74) and moves its -wal and -shm aside; the next enqueue makes a clean queue",
        .timeLimit(.minutes(3)))
    func deletedUnderRun() async throws {
        let (run, environment, database) = try await runningWithBigWAL()
        try await Task.sleep(for: .milliseconds(300))  // dq run has looked at its files while they were its own
        try FileManager.default.removeItem(atPath: database)
        let stopped = await run.wait(timeout: .seconds(60))
        #expect(stopped.status == 74, "\(stopped.stderr)")
        #expect(stopped.stderr.contains("moved aside"), "\(stopped.stderr)")
        #expect(!FileManager.default.fileExists(atPath: database + "-wal"))
        #expect(!FileManager.default.fileExists(atPath: database + "-shm"))

        #expect(try await dq(["enqueue", try patient()], environment).status == 0)
        try await expectCleanSuccessor(environment, database)
    }

    @Test("A queue killed with its WAL, then deleted: the next enqueue moves the orphans aside and says where")
    func orphansAfterAKill() async throws {
        let (run, environment, database) = try await runningWithBigWAL()
        run.kill(SIGKILL)
        _ = await run.wait()
        #expect(FileManager.default.fileExists(atPath: database + "-wal"))
        try FileManager.default.removeItem(atPath: database)

        let enqueued = try await dq(["enqueue", try patient()], environment)
        #expect(enqueued.status == 0, "\(enqueued.stderr)")
        #expect(enqueued.stderr.contains("moved aside") && enqueued.stderr.contains(".orphaned-"), "\(enqueued.stderr)")
        try await expectCleanSuccessor(environment, database)
    }

    @Test("A resourceType that is not FHIR R4's is refused at enqueue (65, nothing queued) unless extra_resource_types names it")
    func unknownResourceType() async throws {
        let file = try work.write("odd.json", #"{"resourceType":"NotAType"}"#)
        let refused = try await dq(["enqueue", try patient(), file], env)
        #expect(refused.status == 65, "\(refused.stderr)")
        #expect(refused.stderr.contains("NotAType") && refused.stderr.contains("extra_resource_types"), "\(refused.stderr)")
        let none = try await dq(["status", "--json"], env)
        #expect(none.stdout.contains("\"pending\" : 0") || none.status != 0, "nothing queued: \(none.stdout)")
        var environment = env
        environment["DQ_EXTRA_RESOURCE_TYPES"] = "NotAType"
        #expect(try await dq(["enqueue", file], environment).status == 0)
        let config = try work.write("any.json", #"{"extra_resource_types": ["*"]}"#)
        let other = try work.write("other.json", #"{"resourceType":"AlsoNotAType"}"#)
        #expect(try await dq(["enqueue", "--config", config, other], env).status == 0)
        let bad = try work.write("bad.json", #"{"extra_resource_types": ["not a type"]}"#)
        #expect(try await dq(["enqueue", "--config", bad, other], env).status == 78)
    }
}
