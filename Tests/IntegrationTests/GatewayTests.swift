import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// `Examples/Gateway` (a Hummingbird 2 server embedding dq) driven over HTTP, delivering to sekmet-fhir.
@Suite("The Hummingbird gateway example against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct GatewayTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    /// The gateway binary `swift build` builds (`Examples/Gateway`, a target of this package).
    static var binary: String {
        Peers.environment["DQ_GATEWAY_BIN"]
            ?? Peers.packageRoot.appendingPathComponent(".build/debug/Gateway").path
    }

    @Test(
        "Observations posted while the server is down are answered 202, then delivered in order by the service alone; 201 once it is up; metrics count them"
    )
    func gatewayQueuesAndDelivers() async throws {
        #expect(FileManager.default.isExecutableFile(atPath: Self.binary), "build it with make test")
        let server = try FHIRServer()  // not started yet: the gateway must queue
        let port = Peers.freePort()
        let env = [
            "DQ_SERVER": server.base, "DQ_DATABASE": work.file("gateway.sqlite"), "DQ_IDEMPOTENT": "true",
            "DQ_BATCH_SIZE": "1", "HOME": work.path,
        ]
        // A short backoff: the attempts made while the server is down must not push the next one past the wait
        // below (on a loaded machine more of them fit before the server starts).
        let config = try work.write("gateway.json", #"{"retry": {"initial_seconds": 0.1, "maximum_seconds": 0.5}}"#)
        let gateway = try ChildProcess(
            Self.binary, ["--port", String(port), "--poll-interval", "0.2", "--config", config], environment: env)
        #expect(try await eventually(timeout: .seconds(30)) { Peers.isListening(port: port) }, "the gateway listens")
        let endpoint = "http://127.0.0.1:\(port)/Observation"

        var queuedIDs: [String] = []
        for index in 0..<3 {
            let (status, body) = try await HTTP.post(endpoint, json: Data(resources.observation(index).utf8))
            #expect(status == 202, "the FHIR server is down: accepted, queued")
            let answer = try JSONSerialization.jsonObject(with: body) as? [String: String]
            queuedIDs.append(answer?["queued"] ?? "")
        }
        #expect(Set(queuedIDs).count == 3 && !queuedIDs.contains(""), "each answer names its queued item")

        // Bad input is refused and queues nothing.
        let patient = Data(
            #"{"resourceType":"Patient","identifier":[{"system":"\#(resources.system)","value":"p"}]}"#.utf8)
        #expect(try await HTTP.post(endpoint, json: patient).0 == 400)
        #expect(try await HTTP.post(endpoint, json: Data("{not json".utf8)).0 == 400)
        // Without --c3pro-antispam the C3-PRO routes are not mounted.
        #expect(try await HTTP.post("http://127.0.0.1:\(port)/c3pro/register", json: Data("{}".utf8)).0 == 404)

        try await server.start()
        let arrived = try await eventually(timeout: .seconds(30)) {
            (try await server.values("Observation", system: resources.system)).count == 3
        }
        #expect(arrived, "the gateway's DataQueueService delivered without another request")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2"])

        // With the server up, an Observation is delivered during its own request.
        let (created, _) = try await HTTP.post(endpoint, json: Data(resources.observation(3).utf8))
        #expect(created == 201)
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2", "3"])
        #expect(try await server.values("Patient", system: resources.system).isEmpty, "the Patient was refused")

        let (status, body) = try await HTTP.get("http://127.0.0.1:\(port)/metrics")
        let text = String(decoding: body, as: UTF8.self)
        #expect(status == 200)
        #expect(text.contains(#"dq_items_enqueued_total{destination="\#(server.base)"} 4"#), "\(text)")
        #expect(text.contains(#"dq_items_delivered_total{destination="\#(server.base)"} 4"#), "\(text)")
        #expect(text.contains(#"dq_queue_depth{destination="\#(server.base)"} 0"#), "\(text)")
        #expect(text.contains("hb_requests"), "Hummingbird's own request metrics are served too")

        gateway.kill(SIGTERM)
        let result = await gateway.wait(timeout: .seconds(30))
        #expect(result.status == 0, "a graceful stop exits 0: \(result.stderr)")
        #expect(!result.stderr.contains("Observation/"), "no resource content in the logs")
    }

    @Test(
        "With --c3pro-antispam and --c3pro-keys the gateway mounts the C3-PRO receiver under /c3pro: a Python C3-PRO client registers, gets a token and posts a plain Observation and an envelope; both arrive on sekmet once, opened, after the gateway's own POST /Observation"
    )
    func gatewayMountsTheReceiver() async throws {
        let server = try await FHIRServer.start()
        // ServeTests' C3-PRO client (Python requests + cryptography, the iOS envelope), its antispam secret and resources.
        let c3pro = try ServeTests()
        let keys = try await TestKeys()
        try FileManager.default.createDirectory(atPath: work.file("keys"), withIntermediateDirectories: true)
        try FileManager.default.copyItem(atPath: keys.privateKey, toPath: work.file("keys/k1.pem"))
        let antispam = try work.write("antispam.txt", "# the apps' secret\n\(c3pro.antispam)\n")
        let config = try work.write("gateway.json", #"{"retry": {"initial_seconds": 0.1, "maximum_seconds": 0.5}}"#)
        let port = Peers.freePort()
        let gateway = try ChildProcess(
            Self.binary,
            [
                "--port", String(port), "--poll-interval", "0.2", "--config", config, "--c3pro-antispam", antispam,
                "--c3pro-keys", work.file("keys"),
            ],
            environment: ["DQ_SERVER": server.base, "DQ_DATABASE": work.file("gateway.sqlite"), "HOME": work.path])
        #expect(try await eventually(timeout: .seconds(30)) { Peers.isListening(port: port) }, "the gateway listens")
        let base = "http://127.0.0.1:\(port)"

        // The gateway's own route goes on as before.
        let own = c3pro.observation("g0")
        #expect(try await HTTP.post(base + "/Observation", json: Data(own.utf8)).0 == 201)

        let registered = try await c3pro.register(base)
        let bearer = try await c3pro.token(base, registered)
        let plain = c3pro.observation("g1")
        let sealed = c3pro.observation("g2", extra: " sealed")
        let answers = try await c3pro.client(
            base,
            [
                c3pro.plain("/c3pro/fhir/Observation", plain, token: bearer),
                c3pro.sealed("/c3pro/encfhir/Observation", sealed, certificate: keys.certificate, keyID: "k1", token: bearer),
                // A wrong Antispam secret is refused by the mounted receiver as by dq serve.
                c3pro.registration("not-the-secret"),
            ])
        #expect(answers.count == 3, "\(answers)")
        // The plain resource's 201 depends on the receiver's 2 s delivery wait (ReceiverLibraryTests checks it alone).
        #expect(
            answers.first.map { ($0.status == 201 && $0.location.contains("/Observation/")) || $0.status == 202 } == true,
            "\(answers)")
        #expect(answers.dropFirst().first?.status == 202, "the envelope is taken: \(answers)")
        #expect(answers.last?.status == 401, "\(answers)")

        let system = c3pro.resources.system
        let arrived = try await eventually(timeout: .seconds(60)) {
            try await server.values("Observation", system: system).count >= 3
        }
        #expect(arrived, "\((try? String(contentsOfFile: gateway.stderrPath, encoding: .utf8)) ?? "")")
        let stored = try await server.resources("Observation", system: system)
        #expect(stored.map(\.0) == ["g0", "g1", "g2"], "once each, in order")
        for (value, posted) in [("g1", plain), ("g2", sealed)] {
            let resource = try #require(stored.first { $0.0 == value }?.1)
            let sent = try #require(try JSONSerialization.jsonObject(with: Data(posted.utf8)) as? [String: Any])
            #expect(c3pro.content(resource) == c3pro.content(sent), "\(value) arrived opened and unchanged: \(resource)")
        }

        gateway.kill(SIGTERM)
        let result = await gateway.wait(timeout: .seconds(30))
        #expect(result.status == 0, "a graceful stop exits 0: \(result.stderr)")
        #expect(try await server.values("Observation", system: system) == ["g0", "g1", "g2"], "nothing sent again")
        for secret in [c3pro.antispam, registered.secret, bearer, "steps g"] {
            #expect(!result.stderr.contains(secret) && !result.stdout.contains(secret), "no secret or content in the output")
        }
    }

    @Test("The C3-PRO flags are checked before anything starts: an unreadable antispam file, keys without antispam (exit 64)")
    func gatewayRefusesBadC3PROFlags() async throws {
        let antispam = try work.write("antispam.txt", "# only a comment\n")
        let good = try work.write("good.txt", "a-secret\n")
        for (arguments, says) in [
            (["--c3pro-antispam", work.file("absent.txt")], "cannot be read"),
            (["--c3pro-antispam", antispam], "holds no secret"),
            (["--c3pro-keys", work.path], "needs --c3pro-antispam"),
            (["--c3pro-antispam", good, "--c3pro-keys", work.file("none")], "not a directory"),
        ] {
            let gateway = try ChildProcess(Self.binary, ["--port", "0"] + arguments, environment: ["HOME": work.path])
            let result = await gateway.wait(timeout: .seconds(30))
            #expect(result.status == 64 && result.stderr.contains(says), "\(arguments): \(result.status) \(result.stderr)")
        }
    }
}
