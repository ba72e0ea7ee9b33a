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
}
