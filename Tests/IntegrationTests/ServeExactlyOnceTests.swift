import Foundation
import Testing

/// A receiver's creates exactly once without touching what the app wrote: before, a resource with no identifier whose
/// answer was lost (the server had stored it; dq killed, the connection cut) was sent again and stored twice.
extension ServeTests {
    @Test(
        "A create whose answer is lost after sekmet stored it is sent again conditioned on the meta.source naming its item: one copy, journaled already present, its content as the app wrote it"
    )
    func exactlyOnceBySource() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: proxy.base)
        let receiver = try await start(config)
        let bearer = try await token(receiver.base, try await register(receiver.base))
        // No identifier: nothing of the research content to make a condition of.
        let text = "no identifier \(marker)"
        let observation = #"{"resourceType":"Observation","status":"final","code":{"text":"\#(text)"},"valueQuantity":{"value":1.50,"unit":"kg"}}"#
        try await proxy.inject(["drop-after"])
        let answers = try await client(
            receiver.base, [sealed("/c3pro/encfhir/Observation", observation, certificate: keys.certificate, keyID: "k1", token: bearer)])
        #expect(answers.first?.status == 202, "\(answers)")
        #expect(try await eventually(timeout: .seconds(60)) { try await counts(config).delivered == 1 }, "\(receiver.log.suffix(3000))")
        let faults = try await proxy.stats()["faults"] as? [String: Any]
        #expect(faults?["drop-after"] as? Int == 1, "the first send's answer was lost: \(faults ?? [:])")

        let search = try await HTTP.json(server.base + "/Observation?_count=50")
        let entries = (search["entry"] as? [[String: Any]] ?? []).compactMap { $0["resource"] as? [String: Any] }
        #expect(entries.count == 1, "one copy on sekmet: \(entries.count)")
        let stored = try #require(entries.first)
        let lines = try await journal(config)
        #expect(lines.count == 1 && lines.first?["event"] as? String == "already-present", "\(lines)")
        let item = try #require(lines.first?["id"] as? String)
        #expect((stored["meta"] as? [String: Any])?["source"] as? String == "urn:uuid:\(item)", "\(stored)")
        #expect((stored["code"] as? [String: Any])?["text"] as? String == text)
        #expect(stored["identifier"] == nil, "nothing added to the research content: \(stored)")
        #expect(await receiver.stop().status == 0)
    }
}
