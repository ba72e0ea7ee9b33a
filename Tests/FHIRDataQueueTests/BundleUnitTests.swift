import Foundation
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// The pieces of Bundle delivery that need no FHIR server: references, bytes, answers, and envelopes in flight.
@Suite("Bundles and references")
struct BundleUnitTests {
    @Test("Only reference members are references; identifiers with the same urn:uuid are left alone")
    func referencesOnly() {
        let target = "urn:uuid:5f0c3a6e-8a1b-4c2d-9e3f-1a2b3c4d5e6f"
        let body = Data(
            #"{"resourceType":"Observation","identifier":[{"system":"urn:ietf:rfc:3986","value":"\#(target)"}],"subject":{"reference" : "\#(target)"},"performer":[{"reference":"Practitioner/1"}]}"#
                .utf8)
        let found = TransactionBundle.references(in: body)
        #expect(found.map(\.fullURL) == [target])
        let rewritten = TransactionBundle.rewritingReferences(body, [target: "Patient/p-9"])
        let text = String(decoding: rewritten, as: UTF8.self)
        #expect(text.contains(#""reference" : "Patient/p-9""#))
        #expect(text.contains(#""value":"\#(target)""#), "the identifier keeps its value")
        #expect(text.contains(#""reference":"Practitioner/1""#))
        _ = try? FHIRResource(json: rewritten)
    }

    @Test("A Bundle is built around the items' bytes and parses as JSON with one entry per item")
    func buildBundle() throws {
        let entries = [
            TransactionBundle.Entry(
                method: .post, path: "Patient", fullURL: "urn:uuid:1", ifNoneExist: "identifier=s|1",
                body: Data(#"{"resourceType":"Patient","value":1.50}"#.utf8)),
            TransactionBundle.Entry(
                method: .put, path: "Patient/p1", fullURL: "http://h/fhir/Patient/p1", ifNoneExist: nil,
                body: Data(#"{"resourceType":"Patient","id":"p1"}"#.utf8)),
        ]
        let data = TransactionBundle.build(entries)
        #expect(String(decoding: data, as: UTF8.self).contains(#""value":1.50"#), "decimals keep their bytes")
        let object = try #require(try JSONSerialization.jsonObject(with: data) as? [String: Any])
        let parsed = try #require(object["entry"] as? [[String: Any]])
        #expect(parsed.count == 2)
        #expect((parsed[0]["request"] as? [String: String])?["ifNoneExist"] == "identifier=s|1")
        #expect((parsed[1]["request"] as? [String: String]) == ["method": "PUT", "url": "Patient/p1"])
    }

    @Test("Transaction-response entries give status, location and version")
    func parseAnswers() {
        let body = Data(
            #"{"resourceType":"Bundle","type":"transaction-response","entry":[{"response":{"status":"201 Created","location":"Patient/a/_history/1","etag":"W/\"1\""}},{"response":{"status":"200 OK"}}]}"#
                .utf8)
        let answers = TransactionBundle.parseResponse(body)
        #expect(answers?.map(\.status) == [201, 200])
        #expect(answers?.first?.location == "Patient/a/_history/1")
        #expect(TransactionBundle.version(fromETag: answers?.first?.etag) == "1")
        #expect(TransactionBundle.parseResponse(Data(#"{"resourceType":"OperationOutcome"}"#.utf8)) == nil)
    }

    @Test(
        "A receiver's items fill whole Bundles across prefetches: 300 creates from one client go as three Bundles of 100, none cut where a prefetch of 256 ends"
    )
    func receiverItemsFillBundles() async throws {
        let scratch = try Scratch("dq-bundle-receiver")
        let server = try await ScriptedServer { request in
            guard request.method == "POST", request.path.hasSuffix("/fhir") else {
                return .respond(.init(status: 200, body: AutomaticIdempotenceTests.metadata(declaring: [], transactions: true)))
            }
            return .respond(AutomaticIdempotenceTests.answer(request))
        }
        var configuration = DataQueue.Configuration(
            databasePath: scratch.url.appendingPathComponent("q.sqlite").path, idempotent: .init(false))
        configuration.batchSize = 100
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        for index in 0..<300 {
            let json = #"{"resourceType":"Observation","status":"final","code":{"text":"r\#(index)"}}"#
            _ = try await queue.enqueue(try FHIRResource(json: Data(json.utf8)), method: .post, from: "client-1", idempotency: nil)
        }
        let report = try await queue.flush()
        #expect(report.delivered == 300)
        let bundles = server.requests.filter { $0.method == "POST" }.map { request in
            ((try? JSONSerialization.jsonObject(with: request.body)) as? [String: Any])?["entry"] as? [Any]
        }
        #expect(bundles.map { $0?.count ?? 0 } == Array(repeating: 100, count: 3), "whole Bundles, in three requests")
        #expect(try await queue.items().isEmpty)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("Envelopes in flight at once: every one delivered or parked exactly, no more than in_flight at a time")
    func envelopesInFlight() async throws {
        let inFlight = NIOLockedValueBox((now: 0, most: 0, started: 0))
        let server = try await ScriptedServer { request in
            let index = inFlight.withLockedValue {
                $0.now += 1
                $0.started += 1
                $0.most = max($0.most, $0.now)
                return $0.started - 1
            }
            // Each answer waits until its group of three (the seventh alone) has all arrived, so that the overlap
            // does not depend on how fast a loaded machine sends: a dq sending one at a time makes each wait out
            // the 20 s and leaves `most` at 1.
            let groupEnd = min(7, (index / 3 + 1) * 3)
            for _ in 0..<2000 {
                if inFlight.withLockedValue({ $0.started >= groupEnd }) { break }
                try? await Task.sleep(for: .milliseconds(10))
            }
            inFlight.withLockedValue { $0.now -= 1 }
            return request.bodyText.contains("\"key_id\"") && request.uri.hasSuffix("/Condition")
                ? .respond(.init(status: 400, body: "{}")) : .respond(.init(status: 200))
        }
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-env-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        var configuration = DataQueue.Configuration(databasePath: directory.appendingPathComponent("q.sqlite").path)
        configuration.encryptedInFlight = 3
        let (recipient, _) = try EnvelopeTests.keyPair()
        let queue = try await EncryptedDataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, encryptedBaseURL: URL(string: server.baseURL + "/enc")!,
            sealer: EnvelopeSealer(recipient: recipient, keyID: "k1"), configuration: configuration)
        for n in 0..<7 {
            let type = n == 4 ? "Condition" : "Observation"
            try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"\#(type)","status":"final"}"#.utf8)))
        }
        let report = try await queue.flush()
        #expect(report.delivered == 6 && report.parked == 1 && report.remaining == 0)
        #expect(inFlight.withLockedValue { $0.most } == 3)
        let journal = try await queue.deliveries()
        #expect(journal.filter { $0.event == .delivered }.count == 6)
        #expect(journal.filter { $0.event == .parked }.map(\.resourceType) == ["Condition"])
        try await queue.shutdown()
        try await server.shutdown()
    }
}
