import Foundation
import Testing

/// A receiver's creates exactly once without touching what the app wrote: before, a resource with no identifier whose
/// answer was lost (the server had stored it; dq killed, the connection cut) was sent again and stored twice.
extension ServeRepeatsSuite {
    @Test(
        "A create whose answer is lost after sekmet stored it is sent again conditioned on the meta.source naming its item: one copy, journaled already present, its content as the app wrote it"
    )
    func exactlyOnceBySource() async throws {
        let (server, proxy, keys, config, receiver, bearer) = try await startBehindProxy()
        // No identifier: nothing of the research content to make a condition of.
        let text = "no identifier \(marker)"
        let observation =
            #"{"resourceType":"Observation","status":"final","code":{"text":"\#(text)"},"valueQuantity":{"value":1.50,"unit":"kg"}}"#
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

    @Test(
        "Where the server offers no condition (no conditional create), a create sent again after its answer was lost is journaled as a possible duplicate: noted, counted by dq status and /metrics, listed by dq log --possible-duplicates"
    )
    func possibleDuplicateNamed() async throws {
        let (server, proxy, keys, config, receiver, bearer) = try await startBehindProxy(options: ["--no-conditional-create"])
        // The answer is lost after sekmet stored the first request, and the first resend is refused (503): the flush
        // that stops on that refusal must leave the items marked for the next one.
        try await proxy.inject(["drop-after", "503:0"])
        let answers = try await client(
            receiver.base,
            [
                sealed("/c3pro/encfhir/Observation", observation("p1"), certificate: keys.certificate, keyID: "k1", token: bearer),
                sealed("/c3pro/encfhir/Observation", observation("p2"), certificate: keys.certificate, keyID: "k1", token: bearer),
            ])
        #expect(answers.map(\.status) == [202, 202], "\(answers)")
        #expect(try await eventually(timeout: .seconds(60)) { try await counts(config).delivered == 2 }, "\(receiver.log.suffix(3000))")
        // What the lost answer covered (p1 alone, or p1 and p2 in one Bundle) is on the server twice: dq could not
        // prevent it, and says so, once for each.
        let onServer = try await values(server)
        let twice = Set(onServer.filter { value in onServer.filter { $0 == value }.count == 2 })
        #expect(Set(onServer) == ["p1", "p2"] && twice.contains("p1") && onServer.count == 2 + twice.count, "\(onServer)")
        let status = try await dqCommand(["status", "--json"], config: config)
        let object = try #require(try json(status) as? [String: Any], "\(status.stdout)")
        #expect(object["possibleDuplicates"] as? Int == twice.count, "\(status.stdout)")
        let text = try await dqCommand(["status"], config: config)
        #expect(text.stdout.contains("possible duplicates: \(twice.count)"), "\(text.stdout)")
        let listed = try await dqCommand(["log", "--possible-duplicates", "--json"], config: config)
        let lines = try #require(try json(listed) as? [[String: Any]], "\(listed.stdout)")
        #expect(lines.count == twice.count, "\(lines)")
        #expect(lines.allSatisfy { ($0["note"] as? String)?.hasPrefix("possible duplicate: ") == true }, "\(lines)")
        let metrics = try await metricLines(receiver, "dq_items_possible_duplicates_total")
        #expect(metrics.contains { $0.hasSuffix(" \(twice.count)") }, "\(metrics)")
        #expect(await receiver.stop().status == 0)
    }
}
