import Foundation
import GRDB
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// The core promises, proven against a real FHIR server through the `dq` command line:
/// nothing lost, nothing duplicated, order kept, never blocked by one bad item.
@Suite("Delivery through dq against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct QueueDeliveryTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    /// One request per item: these tests script faults request by request (BundleTests cover Bundles).
    func environment(_ server: String, idempotent: Bool = false) -> [String: String] {
        var env = ["DQ_SERVER": server, "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path, "DQ_BATCH_SIZE": "1"]
        env["DQ_IDEMPOTENT"] = String(idempotent)  // "false" too: the default is "auto"
        return env
    }

    @Test("Resources queued while the server is down are all delivered in order once it is up")
    func serverDownThenUp() async throws {
        let server = try FHIRServer()  // not started: nothing listens on its port
        // A backoff long enough that the server's start-up cannot outlast it.
        let config = try work.write("dq.json", #"{"retry": {"initial_seconds": 600}}"#)
        var env = environment(server.base)
        env["DQ_CONFIG"] = config
        let file = try work.write("batch.ndjson", resources.ndjson(0..<20))

        let enqueue = try await dq(["enqueue", "--ndjson", file], env)
        #expect(enqueue.status == 0, "\(enqueue.stderr)")

        let failed = try await dq(["flush"], env)
        #expect(failed.status == 75, "a flush against a down server exits 75: \(failed.stderr)")
        #expect(failed.stderr.contains("connection refused"))

        let status = try await dq(["status", "--json"], env)
        let counts = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(counts["pending"] as? Int == 20)

        try await server.start()
        let backingOff = try await dq(["flush"], env)
        #expect(backingOff.status == 75, "a cron flush does not hammer a server that just failed")
        #expect(backingOff.stderr.contains("backing off"))
        #expect(try await server.values("Observation", system: resources.system).isEmpty)

        let flushed = try await dq(["flush", "--now"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(flushed.stdout.contains("20 delivered"))
        #expect(try await server.values("Observation", system: resources.system) == (0..<20).map(String.init))

        let journal = try await dq(["log", "--json"], env)
        let lines = try #require(try JSONSerialization.jsonObject(with: Data(journal.stdout.utf8)) as? [[String: Any]])
        #expect(lines.count == 20)
        #expect(lines.allSatisfy { ($0["location"] as? String)?.hasPrefix(server.base + "/Observation/") == true })
        #expect(lines.allSatisfy { $0["status"] as? Int == 201 && $0["event"] as? String == "delivered" })
    }

    @Test("A resource the server rejects is parked with its OperationOutcome and the rest are delivered")
    func rejectedResourceIsParked() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        var lines: [String] = []
        for index in 0..<6 { lines.append(index == 2 ? resources.invalid(index) : resources.observation(index)) }
        let file = try work.write("mixed.ndjson", lines.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)

        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 65, "parked in this run, nothing pending: \(flushed.stderr)")
        #expect(flushed.stdout.contains("5 delivered, 1 parked"))
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "3", "4", "5"])

        let parked = try await dq(["list", "--parked", "--json"], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [[String: Any]])
        #expect(items.count == 1)
        let id = try #require(items.first?["id"] as? String)
        #expect(items.first?["lastStatus"] as? Int == 400)
        // The server's OperationOutcome is embedded as JSON, not as a string holding JSON.
        #expect((items.first?["outcome"] as? [String: Any])?["resourceType"] as? String == "OperationOutcome")

        let show = try await dq(["show", id], env)
        #expect(show.status == 0)
        #expect(show.stdout.contains("parked"))

        // Retry puts it back; it is rejected again and parked again, never lost.
        #expect(try await dq(["retry", id], env).status == 0)
        let again = try await dq(["flush"], env)
        #expect(again.stdout.contains("0 delivered, 1 parked"))

        // Drop removes it and the journal says so.
        let dropped = try await dq(["drop", String(id.prefix(8))], env)
        #expect(dropped.status == 0, "\(dropped.stderr)")
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(journal.filter { $0["event"] as? String == "dropped" }.count == 1)
        #expect(journal.last?["id"] as? String == id)
        let status = try await dq(["status", "--json"], env)
        let counts = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(counts["parked"] as? Int == 0 && counts["pending"] as? Int == 0)
        let shown = try await dq(["show", id], env)
        #expect(shown.status == 0 && shown.stdout.contains("dropped (from the journal"), "a dropped item is shown from the journal")
    }

    @Test("A create whose response was lost after the server committed it is not created twice")
    func lostResponseIsNotDuplicated() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let env = environment(proxy.base, idempotent: true)
        let file = try work.write("three.ndjson", resources.ndjson(0..<3))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)

        try await proxy.inject(["pass", "drop-after"])  // item 1 reaches the server; its answer is lost
        let first = try await dq(["flush"], env)
        #expect(first.status == 75, "\(first.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1"])

        let second = try await dq(["flush", "--now"], env)
        #expect(second.status == 0, "\(second.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2"])
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(journal.map { $0["status"] as? Int } == [201, 200, 201], "the retried create matched the existing one")
        #expect(journal.map { $0["event"] as? String } == ["delivered", "already-present", "delivered"])
    }

    @Test(
        "A queued transaction Bundle whose answer was lost is stored once in idempotent mode, twice without it",
        arguments: [true, false])
    func lostBundleAnswer(idempotent: Bool) async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let env = environment(proxy.base, idempotent: idempotent)
        // Six Observations with identifiers of their own, and a Patient with none (idempotent mode generates one).
        var entries = (0..<6).map { #"{"resource":\#(resources.observation($0)),"request":{"method":"POST","url":"Observation"}}"# }
        entries.append(#"{"resource":{"resourceType":"Patient","gender":"other"},"request":{"method":"POST","url":"Patient"}}"#)
        let bundle = #"{"resourceType":"Bundle","type":"transaction","entry":[\#(entries.joined(separator: ","))]}"#
        let file = try work.write("bundle.json", bundle)
        #expect(try await dq(["enqueue", file], env).status == 0)

        try await proxy.inject(["drop-after"])  // the server applies the transaction; its answer is lost
        let first = try await dq(["flush"], env)
        #expect(first.status == 75, "\(first.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == (0..<6).map(String.init))

        let second = try await dq(["flush", "--now"], env)
        #expect(second.status == 0, "\(second.stderr)")
        let observations = try await server.values("Observation", system: resources.system)
        let patients = try await HTTP.json("\(server.base)/Patient/_history?_count=500")["entry"] as? [[String: Any]] ?? []
        if idempotent {
            #expect(observations == (0..<6).map(String.init), "every entry once")
            #expect(patients.count == 1, "the Patient without an identifier was matched by its generated one")
            // The Bundle's entries keep their locations from the transaction-response in the journal.
            let log = try await dq(["log", "--json"], env)
            let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
            let locations = try #require(journal.last?["entryLocations"] as? [String])
            #expect(locations.count == 7 && locations.allSatisfy { $0.contains("/Observation/") || $0.contains("/Patient/") })
        } else {
            // Without idempotent mode the retry stores the Bundle again: the test above can fail.
            #expect(observations.count == 12)
            #expect(patients.count == 2)
        }
    }

    @Test("A resource the server refuses for its If-None-Exist is delivered after dq retry --no-conditional")
    func retryWithoutCondition() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base, idempotent: true)
        let fixture = Peers.packageRoot.appendingPathComponent("Fixtures/resources/questionnaire-response.json").path
        #expect(try await dq(["enqueue", fixture], env).status == 0)
        #expect(try await dq(["flush"], env).stdout.contains("0 delivered, 1 parked"))
        let parked = try await dq(["list", "--parked", "--json"], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [[String: Any]])
        let id = try #require(items.first?["id"] as? String)
        #expect(items.first?["lastStatus"] as? Int == 400)
        // A plain retry keeps the condition: refused again.
        #expect(try await dq(["retry", id], env).status == 0)
        #expect(try await dq(["flush"], env).stdout.contains("0 delivered, 1 parked"))
        #expect(try await dq(["retry", id, "--no-conditional"], env).status == 0)
        let delivered = try await dq(["flush"], env)
        #expect(delivered.status == 0, "\(delivered.stderr)")
        #expect(delivered.stdout.contains("1 delivered, 0 parked"))
        let stored = try await HTTP.json("\(server.base)/QuestionnaireResponse/_history?_count=50")["entry"] as? [[String: Any]]
        #expect(stored?.count == 1)
    }

    @Test("A flush killed with its request on the wire leaves a marker; the next one lets that request settle")
    func killedMidRequestSettles() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let env = environment(proxy.base, idempotent: true)
        let file = try work.write("two.ndjson", resources.ndjson(0..<2))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        try await proxy.inject(["hold"])  // the server stores item 0; its answer waits for the test
        let first = try ChildProcess(Peers.dqBinary, ["flush"], environment: env)
        let held = try await eventually { (try await proxy.stats()["holding"] as? Int) == 1 }
        first.kill()
        _ = await first.wait()
        try #require(held, "within 30 seconds the flush did not get its first item through the proxy")
        try await proxy.release()
        // One lock file per queue, named after a hash of the queue: the only one in this directory.
        let lockFile = try #require(
            try FileManager.default.contentsOfDirectory(atPath: work.path).first {
                $0.hasPrefix("queue.sqlite.flush-") && $0.hasSuffix(".lock")
            })
        let marker = try String(contentsOfFile: work.file(lockFile), encoding: .utf8)
        #expect(marker.split(separator: " ").first == "1", "the marker names item 1 (sequence): \(marker)")

        // The next flush reads the marker: it waits out the rest of the settle time, or says the request has had
        // it (a busy machine may take longer than that to start the flush).
        let config = try work.write("settle.json", #"{"settle_seconds": 4}"#)
        let second = try await dq(["flush", "--now", "--config", config], env)
        #expect(second.status == 0, "\(second.stderr)")
        #expect(second.stderr.contains("a previous flush stopped while sending"), "\(second.stderr)")
        #expect(second.stderr.contains("item=1"), "\(second.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1"])
        let after = try String(contentsOfFile: work.file(lockFile), encoding: .utf8)
        #expect(
            after.trimmingCharacters(in: .whitespacesAndNewlines).isEmpty, "an orderly flush leaves no marker (a blank record)")
    }

    @Test("An answer far over the 1 MiB dq reads is still a delivery: journaled once, never re-sent")
    func hugeAnswerIsDelivered() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let env = environment(proxy.base, idempotent: false)
        let file = try work.write("two.ndjson", resources.ndjson(0..<2))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        try await proxy.inject(["pad:5000000"])  // the first answer carries 5 MB of trailing whitespace
        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(flushed.stdout.contains("2 delivered"), "\(flushed.stdout)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1"])
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(journal.map { $0["status"] as? Int } == [201, 201])
        #expect(try await proxy.stats()["faults"] as? [String: Int] == ["pad": 1])
    }

    @Test("Without idempotent mode the same lost response does create a duplicate (the test can fail)")
    func lostResponseWithoutIdempotencyDuplicates() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let env = environment(proxy.base, idempotent: false)
        let file = try work.write("one.json", resources.observation(0))
        #expect(try await dq(["enqueue", file], env).status == 0)
        try await proxy.inject(["drop-after"])
        #expect(try await dq(["flush"], env).status == 75)
        #expect(try await dq(["flush", "--now"], env).status == 0)
        #expect(try await server.values("Observation", system: resources.system) == ["0", "0"])
    }

    @Test("A resource without an identifier gets one in idempotent mode, so its retry is safe too")
    func idempotentModeTagsResourcesWithoutIdentifier() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let env = environment(proxy.base, idempotent: true)
        let marker = UUID().uuidString
        let file = try work.write("noid.json", #"{"resourceType":"Patient","name":[{"family":"\#(marker)"}]}"#)
        let enqueued = try await dq(["enqueue", "--json", file], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(enqueued.stdout.utf8)) as? [[String: Any]])
        let id = try #require(items.first?["id"] as? String)
        try await proxy.inject(["drop-after"])
        #expect(try await dq(["flush"], env).status == 75)
        #expect(try await dq(["flush", "--now"], env).status == 0)
        let stored = try await server.resources("Patient", system: "urn:ietf:rfc:3986")
        let mine = stored.filter { $0.0 == "urn:uuid:\(id)" }
        #expect(mine.count == 1)
    }

    @Test("The server killed in the middle of a flush loses nothing; the next flush delivers the rest once, in order")
    func serverKilledMidFlush() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base, idempotent: true)
        let count = 120
        let file = try work.write("many.ndjson", resources.ndjson(0..<count))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)

        let flush = try ChildProcess(Peers.dqBinary, ["flush"], environment: env)
        let started = try await eventually {
            try await server.values("Observation", system: resources.system).count >= 20
        }
        await server.kill()
        let interrupted = await flush.wait()
        try #require(started, "the flush did not deliver 20 items within 30 seconds: \(interrupted.stderr)")
        #expect(interrupted.status == 75, "\(interrupted.stderr)")

        try await server.start()
        let resumed = try await dq(["flush", "--now"], env)
        #expect(resumed.status == 0, "\(resumed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == (0..<count).map(String.init))
    }

    @Test("Two concurrent dq flush processes deliver each item once, in order")
    func concurrentFlushes() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        let count = 150
        let file = try work.write("many.ndjson", resources.ndjson(0..<count))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)

        let first = try ChildProcess(Peers.dqBinary, ["flush", "--wait", "120"], environment: env)
        let second = try ChildProcess(Peers.dqBinary, ["flush", "--wait", "120"], environment: env)
        let results = [await first.wait(), await second.wait()]
        #expect(results.allSatisfy { $0.status == 0 }, "\(results.map(\.stderr))")
        #expect(try await server.values("Observation", system: resources.system) == (0..<count).map(String.init))
        let delivered = results.map { $0.stdout }.joined()
        #expect(delivered.contains("\(count) delivered") && delivered.contains("0 delivered"))
    }

    @Test("A flush while another holds the queue's lock exits 75 and sends nothing; the next one sends each item once")
    func busyFlushExits75() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        // A first flush leaves the queue's flush lock file beside the database.
        let warmUp = try work.write("warm-up.json", #"{"resourceType":"Patient"}"#)
        #expect(try await dq(["enqueue", warmUp], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        let files = try FileManager.default.contentsOfDirectory(atPath: work.path)
        let lockName = try #require(
            files.first { $0.hasPrefix("queue.sqlite.flush") && $0.hasSuffix(".lock") }, "no flush lock file in \(files)")
        let file = try work.write("many.ndjson", resources.ndjson(0..<80))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        // The test holds the flush lock (flock, as a running flush does), so the queue is busy for certain.
        let lockFile = open(work.file(lockName), O_RDWR | O_CLOEXEC)
        try #require(lockFile >= 0, "cannot open the flush lock \(lockName): \(String(cString: strerror(errno)))")
        defer { _ = close(lockFile) }
        try #require(flock(lockFile, LOCK_EX | LOCK_NB) == 0, "the flush lock is already held")
        let busy = try await dq(["flush"], env)
        _ = flock(lockFile, LOCK_UN)
        #expect(busy.status == 75, "\(busy.stderr)")
        #expect(busy.stderr.contains("another flush of this queue is running"), "\(busy.stderr)")
        #expect(busy.stdout.contains(": 0 delivered") && busy.stdout.contains("80 pending"), "\(busy.stdout)")
        #expect(try await server.values("Observation", system: resources.system).isEmpty, "a busy flush sends nothing")

        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(flushed.stdout.contains("80 delivered"), "\(flushed.stdout)")
        #expect(try await server.values("Observation", system: resources.system) == (0..<80).map(String.init))
    }

    @Test("dq send flushes older items first, then sends, and reports per item")
    func sendKeepsOrder() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        // Two items already wait in the server's queue.
        let older = try work.write("older.ndjson", resources.ndjson(0..<2))
        #expect(try await dq(["enqueue", "--ndjson", older], env).status == 0)
        let newer = try work.write("newer.json", resources.observation(2))
        let sent = try await dq(["send", newer], env)
        #expect(sent.status == 0, "\(sent.stderr)")
        #expect(sent.stdout.contains("1 delivered"))
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2"])
    }

    @Test("dq send to an unreachable server queues the resource and exits 75")
    func sendQueuesWhenDown() async throws {
        let env = environment("http://127.0.0.1:\(Peers.freePort())/fhir")
        let file = try work.write("one.json", resources.observation(0))
        let sent = try await dq(["send", file], env)
        #expect(sent.status == 75)
        #expect(sent.stdout.contains("1 queued"))
        let list = try await dq(["list", "--json"], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [[String: Any]])
        #expect(items.count == 1 && items.first?["attempts"] as? Int == 1)
    }

    @Test("PUT updates and a transaction Bundle is one request to the base URL")
    func updateAndTransaction() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        let id = "dq-\(UUID().uuidString.prefix(8).lowercased())"
        let put = try work.write(
            "put.json", #"{"resourceType":"Patient","id":"\#(id)","identifier":[{"system":"\#(resources.system)","value":"p"}]}"#)
        let bundle = try work.write(
            "bundle.json",
            #"{"resourceType":"Bundle","type":"transaction","entry":[{"resource":\#(resources.observation(7)),"request":{"method":"POST","url":"Observation"}}]}"#
        )
        let sent = try await dq(["send", "--method", "auto", put, bundle], env)
        #expect(sent.status == 0, "\(sent.stderr)")
        let (status, _) = try await HTTP.get("\(server.base)/Patient/\(id)")
        #expect(status == 200)
        #expect(try await server.values("Observation", system: resources.system) == ["7"])
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(journal.map { $0["method"] as? String } == ["PUT", "POST"])
        #expect(journal.last?["url"] as? String == server.base)
    }
}
