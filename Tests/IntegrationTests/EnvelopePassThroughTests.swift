import FHIRDataQueue
import Foundation
import Testing

/// Envelopes sealed by another program (Python `cryptography`, C3-PRO's format), queued as they are by a queue that
/// holds no private key, delivered in order to a receiver that opens them.
@Suite("Envelopes queued as they are", .serialized, .enabled(if: Peers.enabled))
struct EnvelopePassThroughTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    @Test("A plain DataQueue with no key forwards Python-made envelopes unchanged, in order with its plain items")
    func pythonEnvelopesForwarded() async throws {
        let keys = try await TestKeys()
        let server = try await FHIRServer.start()
        let receiver = try await C3PROReceiver(key: keys.privateKey, forwardTo: server)
        var configuration = DataQueue.Configuration(databasePath: work.file("queue.sqlite"))
        configuration.encryptedEndpoint = URL(string: receiver.base)!
        configuration.batchSize = 1
        let queue = try await DataQueue(baseURL: URL(string: server.base)!, configuration: configuration)

        var envelopes: [Data] = []
        for index in 0..<6 {
            if index % 2 == 0 {
                try await queue.enqueue(try FHIRResource(json: Data(resources.observation(index).utf8)))
                continue
            }
            let plain = try work.write("r\(index).json", resources.observation(index))
            let sealed = try await C3PROReceiver.tool(["seal", "--cert", keys.certificate, "--key-id", "k1", plain])
            #expect(sealed.status == 0, "\(sealed.stderr)")
            let envelope = Data(sealed.stdout.utf8)
            envelopes.append(envelope)
            let item = try await queue.enqueue(try SealedEnvelope(json: envelope, resourceType: "Observation"))
            #expect(item.encrypted)
            // Stored as it came: the queue cannot open it, and does not change it.
            let (_, body) = try await queue.item(item.id.uuidString.lowercased())
            #expect(body == envelope)
        }
        let report = try await queue.flush()
        #expect(report.delivered == 6, "\(report)")
        #expect((try await receiver.stats())["forwarded"] as? Int == 3)
        // Every resource on the server once, the envelopes' among the plain ones in the order they were queued.
        #expect(try await server.values("Observation", system: resources.system) == (0..<6).map(String.init))
        try await queue.shutdown()
    }
}
