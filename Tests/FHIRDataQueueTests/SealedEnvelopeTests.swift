import Foundation
import Testing

@testable import FHIRDataQueue

/// The shape check of an envelope queued as it is, without a key, and where such an envelope goes.
@Suite("Sealed envelopes queued as they are")
struct SealedEnvelopeTests {
    let scratch: Scratch
    init() throws { scratch = try Scratch("dq-envelope") }

    static let good = #"{"key_id":"k1","symmetric_key":"AAEC","message":"AwQF","version":"1.0.2"}"#

    @Test("A well-formed envelope is kept byte for byte; its key id and version are read")
    func wellFormed() throws {
        let envelope = try SealedEnvelope(json: Data(Self.good.utf8), resourceType: "QuestionnaireResponse")
        #expect(envelope.data == Data(Self.good.utf8))
        #expect(envelope.keyID == "k1" && envelope.version == "1.0.2")
        let authenticated = #"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"4.0.1","alg":"A256GCM+RSA-OAEP-256"}"#
        #expect(throws: Never.self) { _ = try SealedEnvelope(json: Data(authenticated.utf8), resourceType: "Patient") }
    }

    @Test("Escaped strings are read as JSON reads them: Apple's \\/ in base64, \\u escapes in the key id; the bytes kept")
    func escapes() throws {
        // NSJSONSerialization (C3-PRO's iOS apps) writes every / as \/.
        let apple = #"{"key_id":"k\u0031","symmetric_key":"AA\/B","message":"a\/\/b","version":"1.0.2"}"#
        let envelope = try SealedEnvelope(json: Data(apple.utf8), resourceType: "Observation")
        #expect(envelope.keyID == "k1" && envelope.data == Data(apple.utf8))
        #expect(JSONScanner.string(in: Data(#""a\/\/b""#.utf8), 0..<8) == "a//b")
        #expect(JSONScanner.string(in: Data(#""a\/\nb""#.utf8), 0..<8) == "a/\nb", "other escapes: the full unescape")
        #expect(JSONScanner.string(in: Data(#""a\/\\""#.utf8), 0..<7) == "a/\\")
    }

    @Test(
        "Every FHIR version C3-PRO apps were built with is taken, those the original allow-list left out (1.4.0, the STU3 ballots, Android's dstu 3) included",
        arguments: [
            "0.5.0", "0.9.0", "1.0.2", "1.4.0", "1.6.0", "1.8.0", "3.0.0", "3.0.2", "4.0.1", "5.0.0-ballot", "5.0.0-draft-final",
            "dstu 3", "3.0",
        ])
    func versions(version: String) throws {
        let json = #"{"key_id":"k1","symmetric_key":"AAEC","message":"AwQF","version":"\#(version)"}"#
        let envelope = try SealedEnvelope(json: Data(json.utf8), resourceType: "Observation")
        #expect(envelope.version == version && envelope.data == Data(json.utf8))
    }

    @Test(
        "A malformed envelope is refused naming what is wrong",
        arguments: [
            (#"[1]"#, "not a JSON object"), (#"{"key_id":"k","symmetric_key":"AA==","message":"AA=="}"#, "\"version\""),
            (#"{"key_id":1,"symmetric_key":"AA==","message":"AA==","version":"1.0.2"}"#, "\"key_id\""),
            (#"{"key_id":"k","symmetric_key":"not base64!","message":"AA==","version":"1.0.2"}"#, "\"symmetric_key\""),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"%%%","version":"1.0.2"}"#, "\"message\""),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"   "}"#, "\"version\""),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"3.0.0\n"}"#, "\"version\""),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"3.0.0\u00e9"}"#, "\"version\""),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"1.0.2.0.0.0.0.0.0.0.0.0.0.0.0.0.0"}"#, "\"version\""),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"1.0.2","alg":"none"}"#, "\"alg\""),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"1.0.2","resourceType":"Patient"}"#, "resourceType"),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"1.0.2","alg":7}"#, "\"alg\""),
            (#"{"key_id":"k","key_id":"j","symmetric_key":"AA==","message":"AA==","version":"1.0.2"}"#, "not a JSON object"),
            (#"{"key_id":"k","symmetric_key":"AA==","message":"AA==","version":"1.0.2"} x"#, "not a JSON object"),
        ])
    func malformed(json: String, named: String) {
        #expect {
            _ = try SealedEnvelope(json: Data(json.utf8), resourceType: "Observation")
        } throws: { error in
            (error as? DataQueueError).map { $0.code == .invalidResource && $0.message.contains(named) } ?? false
        }
    }

    @Test("A bad resource type is refused")
    func badType() {
        #expect(throws: DataQueueError.self) { _ = try SealedEnvelope(json: Data(Self.good.utf8), resourceType: "../x") }
    }

    @Test("A queue with no encrypted endpoint refuses an envelope and queues nothing")
    func noEndpoint() async throws {
        let queue = try await DataQueue(
            baseURL: URL(string: "http://127.0.0.1:9/fhir")!,
            configuration: DataQueue.Configuration(databasePath: scratch.url.appendingPathComponent("q.sqlite").path))
        await #expect(throws: DataQueueError.self) {
            try await queue.enqueue(try SealedEnvelope(json: Data(Self.good.utf8), resourceType: "Observation"))
        }
        #expect(try await queue.status().pending == 0)
        try await queue.shutdown()
    }

    @Test("Envelopes go to the encrypted endpoint unchanged, plain items to the server, in the order queued")
    func routedInOrder() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Observation/x/_history/1")) }
        var configuration = DataQueue.Configuration(databasePath: scratch.url.appendingPathComponent("q.sqlite").path)
        configuration.encryptedEndpoint = URL(string: server.baseURL + "/c3pro/encfhir")!
        configuration.batchSize = 1
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Observation","status":"final"}"#.utf8)))
        try await queue.enqueue(try SealedEnvelope(json: Data(Self.good.utf8), resourceType: "QuestionnaireResponse"))
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        let report = try await queue.flush()
        #expect(report.delivered == 3)
        let posts = server.requests.filter { $0.method == "POST" }
        #expect(posts.map(\.uri) == ["/fhir/Observation", "/c3pro/encfhir/QuestionnaireResponse", "/fhir/Patient"])
        #expect(posts.count == 3 && posts[1].body == Data(Self.good.utf8))
        try await queue.shutdown()
        try await server.shutdown()
    }
}
