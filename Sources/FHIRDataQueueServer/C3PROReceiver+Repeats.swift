import Crypto
import FHIRDataQueue
import Foundation
import Hummingbird
import NIOCore

// Repeats a device cannot avoid: a request with an `Idempotency-Key` (draft-ietf-httpapi-idempotency-key-header) is
// answered once and stored once per client and key; the queue recognises a repeat without one by its client and
// plaintext (``DataQueue/Configuration/duplicateWindow``).
extension C3PROReceiver {
    /// An answer as bytes, so that the first answer to a keyed request can be kept and given again byte for byte.
    struct Answer: Sendable {
        var status: Int
        var location: String?
        var contentType: String?
        var body: Data

        var response: Response {
            var headers = HTTPFields()
            if let location { headers[.location] = location }
            if let contentType { headers[.contentType] = contentType }
            return Response(
                status: HTTPResponse.Status(code: status), headers: headers,
                body: body.isEmpty ? .init() : .init(byteBuffer: ByteBuffer(bytes: body)))
        }

        /// 201 with the resource's `Location` under `locationBase` (the receiver's own `<prefix>/fhir`, never the FHIR
        /// server's address): `<base>/<type>/<id>/_history/<version>`, as much of it as the server said.
        static func delivered(_ record: DeliveryRecord, locationBase: String) -> Answer {
            var location: String?
            if let id = record.serverID {
                location = "\(locationBase)/\(record.resourceType)/\(id)" + (record.versionID.map { "/_history/\($0)" } ?? "")
            }
            return Answer(status: 201, location: location, contentType: nil, body: Data())
        }

        /// 202 with the queued item's id: taken, not sent yet.
        static func queued(_ id: UUID) -> Answer {
            Answer(status: 202, contentType: "application/json", body: Data(#"{"queued":"\#(id.uuidString.lowercased())"}"#.utf8))
        }

        /// 202 with an OperationOutcome warning (a body C3-PRO apps read as success): taken, parked for an operator.
        static let takenButParked: Answer = {
            let issue: [String: Any] = [
                "severity": "warning", "code": "processing",
                "diagnostics": "taken; the FHIR server rejected it, and it waits for an operator",
            ]
            let json =
                (try? JSONSerialization.data(
                    withJSONObject: ["resourceType": "OperationOutcome", "issue": [issue]], options: [.sortedKeys])) ?? Data()
            return Answer(status: 202, contentType: "application/fhir+json", body: json)
        }()

        /// What a plain resource's journal line answers, nil while it has none.
        static func of(_ record: DeliveryRecord?, item: UUID, locationBase: String) -> Answer? {
            guard let record else { return nil }
            switch record.event {
            case .delivered, .alreadyPresent: return .delivered(record, locationBase: locationBase)
            // Refused by the write policy when it was sent (a `PUT` over a resource on the server that is not the
            // client's): the 403 the receiver gives when it can tell at once.
            case .parked where record.note?.hasPrefix(DataQueue.quarantinePrefix + WritePolicy.refusalPrefix) == true:
                let reason = String(record.note?.dropFirst(DataQueue.quarantinePrefix.count) ?? "")
                let issue: [String: Any] = ["severity": "error", "code": "forbidden", "diagnostics": reason]
                let json =
                    (try? JSONSerialization.data(
                        withJSONObject: ["resourceType": "OperationOutcome", "issue": [issue]], options: [.sortedKeys])) ?? Data()
                return Answer(status: 403, contentType: "application/fhir+json", body: json)
            // Parked for an operator (dq list --parked): the device is told it is taken. A refusal would make it
            // send the resource again and again (each copy parked again), and its queue, which stops at its first
            // error, would never move past it.
            case .parked: return .takenButParked
            // Dropped by an operator, or a repeat of a resource delivered before: taken.
            case .dropped, .duplicate: return .queued(item)
            }
        }
    }

    /// The request's `Idempotency-Key`, nil when it has none. The draft gives the key as a Structured Field string
    /// (`"…"`); a bare value is taken as well.
    /// - Throws: ``Refused``, the 400 that says why it is not one.
    static func idempotencyKey(_ request: Request) throws -> String? {
        let values: [String] = request.headers[values: .init("Idempotency-Key")!]
        guard let value = values.first else { return nil }
        func refuse(_ why: String) -> Refused {
            Refused(FHIRExchange.outcome(.badRequest, "invalid", "the Idempotency-Key header \(why)"))
        }
        guard values.count == 1 else { throw refuse("is given more than once") }
        var key = Substring(value.trimmingCharacters(in: .whitespaces))
        if key.count >= 2, key.hasPrefix("\""), key.hasSuffix("\"") { key = key.dropFirst().dropLast() }
        guard !key.isEmpty, key.count <= Receipt.maximumKeyLength else {
            throw refuse("must be 1 to \(Receipt.maximumKeyLength) characters")
        }
        func printable(_ scalar: Unicode.Scalar) -> Bool {
            (0x20..<0x7F).contains(scalar.value) && scalar != "\"" && scalar != "\\"
        }
        guard key.unicodeScalars.allSatisfy(printable) else {
            throw refuse("must be printable ASCII without quotes or backslashes")
        }
        return String(key)
    }

    /// The fingerprint of an envelope request: what stays the same when a C3-PRO app sends it again. The app seals
    /// each try anew (a fresh AES key and IV, a fresh RSA-OAEP wrap), so no byte of `message` or `symmetric_key` is
    /// kept: the path's type, `key_id` and `version` are, and, where the receiver holds the key, the SHA-256 of the
    /// client and the plaintext inside (opened in memory for keyed requests only, never stored). A different resource
    /// under a reused key is then refused (422); an edge, which holds no key, cannot tell it from a retry.
    func envelopeFingerprint(_ envelope: SealedEnvelope, client: String) -> String {
        var hash = SHA256()
        for part in ["encfhir", envelope.resourceType, envelope.keyID, envelope.version] {
            hash.update(data: Data(part.utf8))
            hash.update(data: Data([0]))
        }
        let outer = hash.finalize().hexString
        guard let keyring = queue.configuration.envelopeKeyring, let resource = try? keyring.openUncounted(envelope.data) else {
            return outer
        }
        var inner = SHA256()
        inner.update(data: Data(client.utf8))
        inner.update(data: Data([0]))
        inner.update(data: resource.data)
        return outer + ":" + inner.finalize().hexString
    }

    /// The fingerprint of a plain request: its method, path and body.
    static func plainFingerprint(method: String, path: String, body: Data) -> String {
        var hash = SHA256()
        hash.update(data: Data("\(method) \(path)".utf8))
        hash.update(data: Data([0]))
        hash.update(data: body)
        return hash.finalize().hexString
    }

    /// The answer to a repeat of a keyed request: the first answer again; 422 when the key was used for another
    /// request; 409 while the first is still being answered.
    func answerRepeat(_ receipt: Receipt, fingerprint: String) async throws -> Response {
        guard receipt.fingerprint == fingerprint else {
            return FHIRExchange.outcome(
                .unprocessableContent, "business-rule", "this Idempotency-Key was used for another request by this client")
        }
        if let status = receipt.status {
            return Answer(status: status, location: receipt.location, contentType: receipt.contentType, body: receipt.body ?? Data())
                .response
        }
        // A plain resource's first answer is recorded once it is made. Until then the first request is in progress
        // (409, the draft's answer to a concurrent repeat); a receipt older than that lost its answer to a stop of
        // the receiver, and the item's state answers (and is kept, so that later repeats get it too).
        // The receipt's time is the store's (the queue's wall clock), so its age is read on that clock too.
        let age = Date().timeIntervalSince(receipt.createdAt)
        let wait = configuration.deliveryWait.components
        if age < Double(wait.seconds) + Double(wait.attoseconds) / 1e18 + 30 {
            var response = FHIRExchange.outcome(
                .conflict, "conflict", "the first request with this Idempotency-Key is still being answered")
            response.headers[.retryAfter] = "1"
            return response
        }
        let answer =
            Answer.of(
                try await queue.journalRecord(receipt.itemID.uuidString.lowercased()), item: receipt.itemID,
                locationBase: locationBase)
            ?? .queued(receipt.itemID)
        try await record(answer, for: receipt)
        return answer.response
    }

    /// Keeps the answer given to a keyed request's first try.
    func record(_ answer: Answer, for receipt: Receipt) async throws {
        var answered = receipt
        answered.status = answer.status
        answered.location = answer.location
        answered.contentType = answer.contentType
        answered.body = answer.body
        try await queue.recordAnswer(answered)
    }
}
