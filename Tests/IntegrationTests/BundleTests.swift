import Foundation
import Testing

/// Delivery in transaction Bundles against sekmet-fhir, through a proxy that counts requests: everything
/// arrives once and in order in about N / batch size requests, a poison item is isolated, servers that refuse
/// large Bundles or transactions still get everything, references resolve, and a lost answer is safe.
@Suite("Transaction Bundles against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct BundleTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    func environment(_ server: String, idempotent: Bool = false, batch: Int? = nil) -> [String: String] {
        var env = ["DQ_SERVER": server, "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
        env["DQ_IDEMPOTENT"] = String(idempotent)  // "false" too: the default is "auto"
        if let batch { env["DQ_BATCH_SIZE"] = String(batch) }
        return env
    }

    func count(_ stats: [String: Any], _ key: String) -> Int { stats[key] as? Int ?? -1 }

    @Test("N items arrive once, in order, in about N / batch size requests; automatic batching reads the CapabilityStatement once")
    func batchedInOrder() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server, options: [])
        let file = try work.write("many.ndjson", resources.ndjson(0..<230))
        let env = environment(proxy.base)  // automatic: sekmet declares transactions
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let flushed = try await dq(["flush", "--json"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        let stats = try await proxy.stats()
        // 230 items at the default 100 per Bundle: 3 Bundles, plus the one CapabilityStatement read.
        #expect(count(stats, "bundles") == 3 && count(stats, "entries") == 230)
        #expect(count(stats, "forwarded") == 4)
        #expect(try await server.values("Observation", system: resources.system) == (0..<230).map(String.init))
        let log = try await dq(["log", "--json", "--limit", "1000"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(journal.count == 230)
        #expect(journal.allSatisfy { ($0["location"] as? String)?.contains("/Observation/") == true && $0["bundle"] != nil })
        #expect(Set(journal.compactMap { $0["bundle"] as? String }).count == 3)

        // The answer is cached: the next run reads no CapabilityStatement.
        let more = try work.write("more.ndjson", resources.ndjson(230..<240))
        #expect(try await dq(["enqueue", "--ndjson", more], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        #expect(count(try await proxy.stats(), "forwarded") == 5)
        // One by one when asked: one request per item.
        let single = try work.write("single.ndjson", resources.ndjson(240..<245))
        #expect(try await dq(["enqueue", "--ndjson", single], env).status == 0)
        #expect(try await dq(["flush", "--batch-size", "1"], env).status == 0)
        let after = try await proxy.stats()
        #expect(count(after, "forwarded") == 10 && count(after, "bundles") == 4)
        #expect(try await server.values("Observation", system: resources.system) == (0..<245).map(String.init))
    }

    @Test("A poison item in the middle of a Bundle is parked alone; the others are delivered in order")
    func poisonIsIsolated() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server, options: [])
        var lines = (0..<16).map { resources.observation($0) }
        lines[11] = resources.invalid(11)
        let file = try work.write("poison.ndjson", lines.joined(separator: "\n"))
        let env = environment(proxy.base, batch: 16)
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 65, "the run parked an item: \(flushed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == (0..<16).filter { $0 != 11 }.map(String.init))
        let parked = try await dq(["list", "--parked", "--json"], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [[String: Any]])
        #expect(items.count == 1 && items.first?["lastStatus"] as? Int == 400)
        // Halving 16 down to the one bad entry: a logarithmic number of extra requests, not one per item.
        let requests = count(try await proxy.stats(), "forwarded")
        #expect(requests <= 1 + 2 * 4 + 1, "\(requests) requests")
    }

    @Test("A server that answers 413 to big Bundles gets everything in smaller ones, and that is remembered")
    func tooLargeHalves() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server, options: ["--max-entries", "20"])
        let env = environment(proxy.base, batch: 64)
        let file = try work.write("many.ndjson", resources.ndjson(0..<100))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == (0..<100).map(String.init))
        let first = try await proxy.stats()
        #expect(count(first, "refused_bundles") == 2, "64 refused, then 32, then 16 fits")
        let more = try work.write("more.ndjson", resources.ndjson(100..<140))
        #expect(try await dq(["enqueue", "--ndjson", more], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        let second = try await proxy.stats()
        #expect(count(second, "refused_bundles") == 2, "the smaller size was remembered")
        #expect(try await server.values("Observation", system: resources.system) == (0..<140).map(String.init))
    }

    @Test("A server that refuses transactions gets single requests, remembered for the next run")
    func refusedTransactionsFallBack() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server, options: ["--no-transactions"])
        let env = environment(proxy.base)
        let file = try work.write("some.ndjson", resources.ndjson(0..<12))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        #expect(try await server.values("Observation", system: resources.system) == (0..<12).map(String.init))
        let first = count(try await proxy.stats(), "refused_bundles")
        #expect(first == 1)
        let more = try work.write("more.ndjson", resources.ndjson(12..<15))
        #expect(try await dq(["enqueue", "--ndjson", more], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        #expect(count(try await proxy.stats(), "refused_bundles") == 1, "no second try")
        #expect(try await server.values("Observation", system: resources.system) == (0..<15).map(String.init))
    }

    @Test("A lost answer to a Bundle creates no duplicate in idempotent mode; without it the same run does", arguments: [true, false])
    func lostAnswer(idempotent: Bool) async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server, options: [])
        let env = environment(proxy.base, idempotent: idempotent, batch: 10)
        let file = try work.write("ten.ndjson", resources.ndjson(0..<10))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        try await proxy.inject(["drop-after"])  // the server applies the Bundle; its answer is lost
        #expect(try await dq(["flush"], env).status == 75)
        #expect(try await dq(["flush", "--now"], env).status == 0)
        let values = try await server.values("Observation", system: resources.system)
        if idempotent {
            #expect(values == (0..<10).map(String.init))
            let log = try await dq(["log", "--json"], env)
            let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
            #expect(journal.count == 10 && journal.allSatisfy { $0["event"] as? String == "already-present" })
        } else {
            #expect(values.count == 20, "without idempotent mode the retried Bundle is stored again")
        }
    }

    @Test("Resources that reference each other by urn:uuid resolve on the server, in one Bundle or across requests")
    func referencesResolve() async throws {
        let server = try await FHIRServer.start()
        let patients = (0..<3).map { _ in "urn:uuid:" + UUID().uuidString.lowercased() }
        var lines: [String] = []
        for (index, fullURL) in patients.enumerated() {
            lines.append(
                #"{"fullUrl":"\#(fullURL)","resource":{"resourceType":"Patient","gender":"other","birthDate":"2000-01-0\#(index + 1)"}}"#)
            for n in 0..<2 {
                let observation = resources.observation(index * 10 + n, extra: "")
                    .replacingOccurrences(of: #""status":"final","#, with: #""status":"final","subject":{"reference":"\#(fullURL)"},"#)
                lines.append(observation)
            }
        }
        let file = try work.write("linked.ndjson", lines.joined(separator: "\n"))
        // Bundles of 2: most references cross a request boundary and are rewritten from the journal.
        let env = environment(server.base, batch: 2)
        let queued = try await dq(["enqueue", "--ndjson", file], env)
        #expect(queued.status == 0, "\(queued.stderr)")
        #expect(try await dq(["flush"], env).status == 0)
        let stored = try await server.resources("Observation", system: resources.system)
        #expect(stored.count == 6)
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        let patientIDs = journal.filter { $0["resourceType"] as? String == "Patient" }.compactMap { $0["serverID"] as? String }
        #expect(patientIDs.count == 3)
        for (value, observation) in stored {
            let reference = (observation["subject"] as? [String: Any])?["reference"] as? String
            let owner = Int(value)! / 10
            #expect(reference == "Patient/\(patientIDs[owner])", "observation \(value): \(reference ?? "none")")
        }
        // The server finds them by patient.
        let search = try await HTTP.json("\(server.base)/Observation?patient=\(patientIDs[0])")
        #expect((search["entry"] as? [[String: Any]])?.count == 2)
    }

    @Test("A reference to a urn:uuid no item declares is refused at enqueue, naming it")
    func unknownReferenceRefused() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        let orphan = "urn:uuid:" + UUID().uuidString.lowercased()
        let file = try work.write(
            "orphan.json", #"{"resourceType":"Observation","status":"final","code":{"text":"x"},"subject":{"reference":"\#(orphan)"}}"#)
        let result = try await dq(["enqueue", file], env)
        #expect(result.status == 65)
        #expect(result.stderr.contains(orphan) && result.stderr.contains("no earlier item declares"), "\(result.stderr)")
    }
}
