import Foundation

/// An envelope sealed elsewhere (by a C3-PRO app, or a dq that holds the receiver's certificate), queued as it is
/// for the encrypted endpoint by a queue that cannot open it.
///
/// Its shape is checked without a key: a JSON object whose `key_id`, `symmetric_key`, `message` and `version` are
/// strings (`key_id` may be empty), `symmetric_key` and `message` standard base64, `version` a FHIR version C3-PRO apps and dq send, and
/// `alg`, when present, dq's authenticated format. The bytes are stored and sent unchanged.
///
/// ```swift
/// let envelope = try SealedEnvelope(json: body, resourceType: "QuestionnaireResponse")
/// try await queue.enqueue(envelope)   // POSTed to the encrypted endpoint, in its place in the queue's order
/// ```
public struct SealedEnvelope: Sendable, Hashable {
    /// The envelope's bytes, as received.
    public let data: Data
    /// The type of the resource inside, as the sender named it (the path it is posted to: `{encrypted}/{type}`).
    public let resourceType: String
    /// The `key_id`: which receiver key opens it (empty: the receiver's default key).
    public let keyID: String
    /// The `version`: the FHIR version of the resource inside.
    public let version: String

    /// The type an envelope is queued under when its sender did not name one (FHIR's base type, `Resource`): a
    /// device that posts to the bare encrypted endpoint. The type inside is known once it is opened.
    public static let unnamedType = "Resource"

    /// Whether `version` is taken: 1 to 32 printable ASCII characters, not all spaces (`3.0.0`, `1.4.0`,
    /// `5.0.0-draft-final`, `dstu 3`).
    ///
    /// C3-PRO apps sent the FHIR version their framework was built with: `1.0.2`, later `1.4.0` to `3.0.0` (and
    /// their servers defaulted to `0.5.0` or `1.0.2`); C3-PRO's Android framework names it `dstu 3`. The original
    /// receiver never checked it, and a device's queue stops at its first refusal, so any such text is taken: an
    /// allow-list or a pattern would block, for good, every device built with one it left out. The version only
    /// routes (`serve.routes`) and is kept.
    public static func isVersion(_ version: String) -> Bool {
        let bytes = version.utf8
        return (1...32).contains(bytes.count) && bytes.allSatisfy { (0x20...0x7E).contains($0) }
            && bytes.contains { $0 != 0x20 }
    }

    /// The members an envelope may have.
    static let members: Set<String> = ["key_id", "symmetric_key", "message", "version", "alg"]

    /// Checks `json`'s shape and keeps its bytes.
    ///
    /// - Parameters:
    ///   - json: the envelope as received.
    ///   - resourceType: the type of the resource inside (a device posts to `…/encfhir/{type}`).
    /// - Throws: ``DataQueueError`` with `.invalidResource` naming the first thing wrong (never a value).
    public init(json: Data, resourceType: String) throws {
        func invalid(_ why: String) -> DataQueueError { DataQueueError(.invalidResource, "envelope: \(why)") }
        guard FHIRResource.isValidTypeName(resourceType) else {
            throw invalid("\(FHIRResource.printable(resourceType)) is not a resource type name")
        }
        // One pass of the scanner (no objects built): a receiver checks every envelope it takes.
        guard let document = try? JSONScanner.scan(json, 0..<json.count, keys: Self.members), document.isObject else {
            throw invalid("not a JSON object")
        }
        var fields: [String: String] = [:]
        for field in ["key_id", "symmetric_key", "message", "version"] {
            // An empty key_id is what C3-PRO apps send when they have none: the receiver's default key.
            guard let range = document.members[field], let value = JSONScanner.string(in: json, range),
                !value.isEmpty || field == "key_id"
            else {
                throw invalid("\"\(field)\" is missing, empty or not a string")
            }
            fields[field] = value
        }
        for field in ["symmetric_key", "message"] where Data(base64Encoded: fields[field]!) == nil {
            throw invalid("\"\(field)\" is not standard base64")
        }
        guard let version = fields["version"], Self.isVersion(version) else {
            throw invalid("\"version\" is not a version (1 to 32 printable ASCII characters, as 3.0.0)")
        }
        if let alg = document.members["alg"], JSONScanner.string(in: json, alg) != EnvelopeSealer.Format.authenticatedMarker {
            throw invalid("\"alg\" is not \(EnvelopeSealer.Format.authenticatedMarker)")
        }
        if document.memberCount > document.members.count {
            // Named from a full parse: the rare refusal may cost more than the common case.
            let object = (try? JSONSerialization.jsonObject(with: json)) as? [String: Any] ?? [:]
            let other = object.keys.sorted().first { !Self.members.contains($0) } ?? "a member"
            throw invalid("\(FHIRResource.printable(other)) is not a member of an envelope")
        }
        self.data = json
        self.resourceType = resourceType
        self.keyID = fields["key_id"]!
        self.version = version
    }
}
