import Foundation
import Testing

/// The write policy of `dq serve` (`serve.write_policy`): a device writes only what is its own. Before it, an envelope
/// holding a resource with an id overwrote a Patient made on the server directly, a transaction Bundle's DELETE
/// removed one, and a path's type restricted nothing.
extension ServeRepeatsSuite {
    func patient(_ id: String?, _ value: String, active: Bool = true) -> String {
        let idMember = id.map { #""id":"\#($0)","# } ?? ""
        return
            #"{"resourceType":"Patient",\#(idMember)"identifier":[{"system":"\#(resources.system)","value":"\#(value)"}],"active":\#(active)}"#
    }

    func transactionBundle(_ entries: [[String: Any]]) throws -> String {
        let bundle: [String: Any] = ["resourceType": "Bundle", "type": "transaction", "entry": entries]
        return String(decoding: try JSONSerialization.data(withJSONObject: bundle, options: [.sortedKeys]), as: UTF8.self)
    }

    @Test(
        "Write policy: a device cannot overwrite or delete what it did not write (envelopes and plain), nor write a type outside the policy or under another type's path; refusals are quarantined or 403, journaled and counted; its own PUTs create and update"
    )
    func writePolicy() async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: server.base)
        let receiver = try await start(config)

        // A Patient made on the research server directly, not through the receiver.
        let foreignID = "foreign-" + UUID().uuidString.prefix(8).lowercased()
        let made = try await client(
            server.base, [["path": "/Patient/\(foreignID)", "method": "PUT", "fhir": patient(foreignID, "foreign")]])
        #expect(made.first.map { [200, 201].contains($0.status) } == true, "\(made)")

        let a = try await register(receiver.base)
        let aToken = try await token(receiver.base, a)
        let ownID = "own-" + UUID().uuidString.prefix(8).lowercased()
        let deletion = try transactionBundle([["request": ["method": "DELETE", "url": "Patient/\(foreignID)"]]])
        func seal(_ path: String, _ resource: String, _ bearer: String) -> Step {
            sealed(path, resource, certificate: keys.certificate, keyID: "k1", token: bearer)
        }
        let attack = try await client(
            receiver.base,
            [
                seal("/c3pro/encfhir/Patient", patient(foreignID, "w1", active: false), aToken),
                seal("/c3pro/encfhir", deletion, aToken),
                seal("/c3pro/encfhir/Observation", patient(nil, "w3"), aToken),
                seal("/c3pro/encfhir", #"{"resourceType":"Basic","identifier":[{"system":"\#(resources.system)","value":"w4"}]}"#, aToken),
                ["path": "/c3pro/fhir/Patient/\(foreignID)", "method": "PUT", "bearer": aToken, "fhir": patient(foreignID, "w5")],
                plain("/c3pro/fhir/Bundle", deletion, token: aToken),
                [
                    "path": "/c3pro/fhir/Basic/b1", "method": "PUT", "bearer": aToken,
                    "fhir": #"{"resourceType":"Basic","id":"b1","identifier":[{"system":"\#(resources.system)","value":"w7"}]}"#,
                ],
                seal("/c3pro/encfhir/Patient", patient(ownID, "a1"), aToken),
                seal("/c3pro/encfhir/Observation", observation("a2"), aToken),
            ])
        #expect(attack.count == 9, "\(attack)")
        for index in 0..<4 { #expect(attack[index].status == 202, "\(index): an envelope is taken, then judged: \(attack[index])") }
        // Refused when it was sent: within the answer's wait, 403; after it, 202 and quarantined all the same.
        #expect([202, 403].contains(attack[4].status), "\(attack[4])")
        for index in [5, 6] {
            #expect(attack[index].status == 403, "\(index): \(attack[index])")
            let issue = (attack[index].object["issue"] as? [[String: Any]])?.first
            #expect(issue?["code"] as? String == "forbidden", "\(index): \(attack[index])")
            #expect((issue?["diagnostics"] as? String)?.contains("write policy") == true, "\(index): \(attack[index])")
        }
        #expect(attack[7].status == 202 && attack[8].status == 202, "\(attack)")
        #expect(try await eventually(timeout: .seconds(60)) { try await values(server).count >= 3 }, "\(receiver.log.suffix(3000))")

        // Another device cannot touch the first one's Patient; the first updates its own.
        let b = try await register(receiver.base)
        let bToken = try await token(receiver.base, b)
        let other = try await client(
            receiver.base,
            [
                seal("/c3pro/encfhir/Patient", patient(ownID, "b1", active: false), bToken),
                ["path": "/c3pro/fhir/Patient/\(ownID)", "method": "PUT", "bearer": bToken, "fhir": patient(ownID, "b2")],
            ])
        #expect(other.first?.status == 202, "\(other)")
        #expect(other.last?.status == 403, "the receiver knows whose it is at once: \(other)")
        #expect(other.last?.body.contains("written by another client") == true, "\(other)")
        let update = try await client(receiver.base, [seal("/c3pro/encfhir/Patient", patient(ownID, "a3", active: false), aToken)])
        #expect(update.first?.status == 202, "\(update)")
        #expect(try await eventually(timeout: .seconds(60)) { try await values(server).count >= 4 }, "\(receiver.log.suffix(3000))")
        #expect(try await eventually { try await counts(config).pending == 0 }, "\(receiver.log.suffix(3000))")

        let onServer = try await values(server)
        // a1 and a2 may share a transaction Bundle, inside which the server orders a POST before a PUT.
        #expect(onServer.count == 4, "\(onServer)")
        #expect(onServer.sorted() == ["a1", "a2", "a3", "foreign"], "nothing of the refused writes reached the server: \(onServer)")
        let foreign = try await HTTP.json("\(server.base)/Patient/\(foreignID)")
        #expect(foreign["active"] as? Bool == true, "not overwritten, not deleted: \(foreign)")
        #expect((foreign["meta"] as? [String: Any])?["versionId"] as? String == "1", "\(foreign)")
        let own = try await HTTP.json("\(server.base)/Patient/\(ownID)")
        #expect(own["active"] as? Bool == false, "the device's own update: \(own)")
        #expect((own["meta"] as? [String: Any])?["versionId"] as? String == "2", "\(own)")

        // Quarantined with the reason, in order: never sent, journaled as parked.
        let listed = try await dqCommand(["quarantine", "list", "--json"], config: config)
        #expect(listed.status == 0, "\(listed.stderr)")
        let quarantined = try #require(try json(listed) as? [[String: Any]], "\(listed.stdout)")
        let reasons = quarantined.map { $0["lastError"] as? String ?? "" }
        let expected = [
            "\(foreignID) is on the server and was not written by this client", "is a DELETE", "the path names Observation",
            "may not create Basic", "\(foreignID) is on the server and was not written by this client", "was written by another client",
        ]
        #expect(reasons.count == expected.count, "\(reasons)")
        for (reason, part) in zip(reasons, expected) {
            #expect(reason.contains("refused by the write policy") && reason.contains(part), "\(part): \(reason)")
        }
        let log = try await dqCommand(["log", "--json"], config: config)
        let lines = try #require(try json(log) as? [[String: Any]], "\(log.stdout)")
        let delivered = lines.filter { $0["event"] as? String == "delivered" }.compactMap { $0["url"] as? String }
        #expect(delivered.count == 3, "a1, a2, a3 and nothing else: \(delivered)")
        #expect(!delivered.contains { $0.contains(foreignID) }, "\(delivered)")
        #expect(lines.filter { $0["event"] as? String == "parked" }.count == 6, "\(log.stdout.prefix(3000))")

        let metrics = String(decoding: try await HTTP.get(receiver.base + "/metrics").1, as: UTF8.self).split(separator: "\n")
        let refusals = metrics.first { $0.hasPrefix("dq_write_policy_refusals_total") }.flatMap {
            Double($0.split(separator: " ").last ?? "")
        }
        #expect((refusals ?? 0) >= 9, "six quarantined, three 403: \(metrics.filter { $0.contains("policy") })")
        #expect(
            metrics.contains { $0.hasPrefix("dq_envelopes_quarantined_total{") && $0.contains(#"reason="write_policy""#) },
            "\(metrics.filter { $0.contains("quarantined") })")
        #expect(await receiver.stop().status == 0)
    }
}
