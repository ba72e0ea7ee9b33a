import Foundation
import Testing

/// Exactly once with default settings (`idempotent: auto`): a create whose answer was lost is not stored again
/// wherever the server declares conditional create, and `dq status` and `dq doctor` say when it does not.
@Suite("Exactly once by default against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct ExactlyOnceTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    /// Default settings: no `idempotent`, no `batch_size` (automatic: transaction Bundles), no config file.
    func environment(_ server: String) -> [String: String] {
        ["DQ_SERVER": server, "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
    }

    /// The settings a kill-mid-flush loop runs with.
    enum Setting: String, CaseIterable, Sendable, CustomTestStringConvertible {
        /// Nothing set: `idempotent` is `auto`.
        case defaults
        /// `DQ_IDEMPOTENT=false`, the default before `auto`: the same loop stores items again (the test can fail).
        case idempotentFalse
        var testDescription: String { rawValue }
    }

    @Test(
        "A flush SIGKILLed while the proxy holds the server's answer to its transaction Bundle, three times over, then a flush: with default settings every item is stored once; with idempotent false again",
        arguments: Setting.allCases)
    func killMidFlushLoop(setting: Setting) async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        var env = environment(proxy.base)
        if setting == .idempotentFalse { env["DQ_IDEMPOTENT"] = "false" }
        let rounds = 3
        let perRound = 20
        for round in 0..<rounds {
            let file = try work.write("round\(round).ndjson", resources.ndjson((round * perRound)..<((round + 1) * perRound)))
            let enqueued = try await dq(["enqueue", "--ndjson", file], env)
            #expect(enqueued.status == 0, "\(enqueued.stderr)")
            // The server applies the Bundle (every item pending so far: those whose answer was lost before, and the
            // new ones); its answer waits in the proxy while the flush is killed.
            try await proxy.inject(["hold"])
            let flush = try ChildProcess(Peers.dqBinary, ["flush", "--now"], environment: env)
            let held = try await eventually { (try await proxy.stats()["holding"] as? Int) == 1 }
            flush.kill()
            let killed = await flush.wait()
            try await proxy.release()
            try #require(held, "round \(round): within 30 seconds no Bundle reached the server: \(killed.stderr)")
            #expect(try await eventually { (try await proxy.stats()["holding"] as? Int) == 0 })
            // The next round's hold holds again.
            _ = try await HTTP.post("http://127.0.0.1:\(proxy.port)/__proxy/reset", json: Data("{}".utf8))
        }
        let last = try await dq(["flush", "--now"], env)
        #expect(last.status == 0, "\(last.stderr)")
        let stored = try await server.values("Observation", system: resources.system)
        let queued = (0..<(rounds * perRound)).map(String.init)
        switch setting {
        case .defaults:
            #expect(stored.count == queued.count, "every item once: \(stored.count) stored of \(queued.count) queued")
            #expect(stored.sorted() == queued.sorted())
            let log = try await dq(["log", "--json"], env)
            let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
            #expect(journal.count == queued.count)
            #expect(
                journal.allSatisfy { $0["event"] as? String == "already-present" },
                "every item was stored by a killed flush, and found by the last one")
        case .idempotentFalse:
            #expect(stored.count > queued.count, "plain creates are stored again: \(stored.count) of \(queued.count)")
            #expect(Set(stored) == Set(queued))
        }
    }

    @Test(
        "Default settings: If-None-Exist only for the types sekmet declares (an Observation found again), none for a QuestionnaireResponse it does not; nothing added to a resource"
    )
    func onlyDeclaredTypes() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        let metadata = try await HTTP.json("\(server.base)/metadata")
        let declared = Set(
            ((metadata["rest"] as? [[String: Any]])?.first?["resource"] as? [[String: Any]] ?? [])
                .filter { $0["conditionalCreate"] as? Bool == true }.compactMap { $0["type"] as? String })
        try #require(declared.contains("Observation") && !declared.contains("QuestionnaireResponse"), "\(declared.sorted())")

        // sekmet refuses a conditional create of a QuestionnaireResponse (400, unknown search parameter), so its
        // delivery shows that none was sent; the same Observation twice shows that one was.
        let questionnaire = Peers.packageRoot.appendingPathComponent("Fixtures/resources/questionnaire-response.json").path
        let observation = try work.write("observation.json", resources.observation(0))
        let marker = UUID().uuidString
        let patient = try work.write("patient.json", #"{"resourceType":"Patient","name":[{"family":"\#(marker)"}]}"#)
        for file in [questionnaire, observation, observation, patient] {
            let enqueued = try await dq(["enqueue", file], env)
            #expect(enqueued.status == 0, "\(enqueued.stderr)")
        }
        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(flushed.stdout.contains("4 delivered, 0 parked"), "\(flushed.stdout)")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(journal.map { $0["event"] as? String } == ["delivered", "delivered", "already-present", "delivered"])
        let patients = try await HTTP.json("\(server.base)/Patient/_history?_count=500")["entry"] as? [[String: Any]] ?? []
        let mine = patients.compactMap { $0["resource"] as? [String: Any] }.filter {
            (($0["name"] as? [[String: Any]])?.first?["family"] as? String) == marker
        }
        #expect(mine.count == 1 && mine.first?["identifier"] == nil, "a resource without an identifier is stored as it was")

        let status = try await dq(["status"], env)
        #expect(status.stdout.contains("conditional create for \(declared.count) type(s)"), "\(status.stdout)")
        #expect(!status.stdout.contains("at least once"), "\(status.stdout)")
        let config = try await dq(["config", "--json"], env)
        let shown = try #require(try JSONSerialization.jsonObject(with: Data(config.stdout.utf8)) as? [String: [String: String]])
        #expect(shown["idempotent"]?["value"] == "auto", "\(config.stdout)")
    }

    @Test(
        "A server that declares no conditional create: default settings send plain creates, and dq status and dq doctor say it offers no way to be exactly once"
    )
    func noConditionalCreate() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server, options: ["--no-conditional-create"])
        let env = environment(proxy.base)
        let observation = try work.write("observation.json", resources.observation(0))
        for _ in 0..<2 { #expect(try await dq(["enqueue", observation], env).status == 0) }
        let before = try await dq(["status"], env)
        #expect(before.stdout.contains("capabilities not read yet") && !before.stdout.contains("at least once"), "\(before.stdout)")

        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "0"], "plain creates, as before auto")
        let line = "delivery:   at least once, not exactly once: the server declares conditional create for no type"
        let status = try await dq(["status"], env)
        #expect(status.stdout.contains(line), "\(status.stdout)")
        let doctor = try await dq(["doctor"], env)
        #expect(doctor.status == 0, "\(doctor.stderr)")
        #expect(doctor.stdout.contains(line), "\(doctor.stdout)")

        // Where the server declares it, idempotent false is said too.
        var plain = environment(server.base)
        plain["DQ_DATABASE"] = work.file("plain.sqlite")
        plain["DQ_IDEMPOTENT"] = "false"
        #expect(try await dq(["enqueue", observation], plain).status == 0)
        #expect(try await dq(["flush"], plain).status == 0)
        let off = try await dq(["status"], plain)
        #expect(off.stdout.contains("delivery:   at least once, not exactly once: idempotent is false"), "\(off.stdout)")
    }
}
