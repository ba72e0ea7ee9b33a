import Foundation

/// The HTTP method a queued item is sent with.
public enum FHIRMethod: String, Sendable, Codable, CaseIterable {
    /// `POST [base]/[type]` (create) or `POST [base]` (transaction/batch Bundle).
    case post = "POST"
    /// `PUT [base]/[type]/[id]` (update, or update-as-create).
    case put = "PUT"
}

extension QueuedItem {
    /// Where an item is in its life. Delivered items leave the queue for the delivery journal.
    public enum State: String, Sendable, Codable {
        /// Waiting to be sent, in enqueue order.
        case pending
        /// Permanently rejected by the server; kept for an operator to retry or drop.
        case parked
    }
}

/// A request waiting in the queue, as an operator sees it (no body unless asked for).
public struct QueuedItem: Sendable, Encodable, Hashable {
    /// The position in the queue: items of one server are sent in increasing `sequence`.
    public let sequence: Int64
    /// The stable identifier of the item, kept across retries and in the delivery journal.
    public let id: UUID
    /// The server's base URL, which names the queue.
    public let queue: String
    /// The HTTP method.
    public let method: FHIRMethod
    /// The request path relative to its endpoint (the server's base URL, or the encrypted endpoint for an
    /// encrypted item): `Patient`, `Patient/123`, or empty for a Bundle posted to the base.
    public let url: String
    /// The resource type (the envelope's resource type for encrypted items).
    public let resourceType: String
    /// The resource id, for updates.
    public let resourceID: String?
    /// Whether the body is an encrypted envelope rather than a plain FHIR resource.
    public let encrypted: Bool
    /// The current state.
    public let state: QueuedItem.State
    /// How many times a send was attempted.
    public let attempts: Int
    /// When the item was enqueued.
    public let enqueuedAt: Date
    /// When the last attempt was made.
    public let lastAttemptAt: Date?
    /// The HTTP status of the last failed attempt, if the server answered.
    public let lastStatus: Int?
    /// A PHI-free description of the last failure.
    public let lastError: String?
    /// The server's OperationOutcome (or error body) for a parked item.
    public let outcome: String?
    /// The size of the body in bytes.
    public let size: Int
    /// The client of a receiver (`dq serve`) that sent it; nil for an item queued otherwise.
    public var clientID: String? = nil
}

/// One line of the delivery journal: the chain-of-custody record of an item (no resource body).
public struct DeliveryRecord: Sendable, Encodable, Hashable {
    /// How the note of a delivery that may be a second copy begins (``QueueStatus/possibleDuplicates``).
    public static let possibleDuplicateNote = "possible duplicate: "

    /// What happened to the item.
    public enum Event: String, Sendable, Codable {
        /// The server accepted the item (and created or updated the resource).
        case delivered
        /// A conditional create (idempotent mode) found the resource already on the server, answered 200 with
        /// its location, and created nothing: an earlier attempt whose answer was lost had stored it.
        case alreadyPresent = "already-present"
        /// An operator removed the item from the queue without sending it (the line keeps its last status).
        case dropped
        /// The server rejected the item for good; it stays in the queue, parked, for an operator.
        case parked
        /// A receiver's item whose resource the same client sent before and dq delivered within the dedupe window
        /// (`serve.dedupe_window_days`): removed unsent; the note names the item that was delivered.
        case duplicate
    }
    /// The journal's own sequence number.
    public let sequence: Int64
    /// The item's stable identifier.
    public let id: UUID
    /// What happened.
    public let event: Event
    /// The queue (server base URL).
    public let queue: String
    /// The method and URL the item was sent to.
    public let method: FHIRMethod
    /// The request URL.
    public let url: String
    /// The resource type.
    public let resourceType: String
    /// The server's HTTP status (for deliveries).
    public let status: Int?
    /// The server's `Location` header.
    public let location: String?
    /// The id the server gave the resource.
    public let serverID: String?
    /// The version id the server gave the resource.
    public let versionID: String?
    /// How many attempts it took.
    public let attempts: Int
    /// When the item was enqueued.
    public let enqueuedAt: Date
    /// When it was delivered, parked or dropped.
    public let at: Date
    /// Why it was parked, or what it last failed with when dropped (PHI-free).
    public var note: String? = nil
    /// The producer's `fullUrl` for the resource, if it gave one.
    public var fullURL: String? = nil
    /// The id of the transaction Bundle the item travelled in, when dq batched it with others.
    public var bundle: String? = nil
    /// For a Bundle queued as one item: the location of each of its entries, from the transaction-response.
    public var entryLocations: [String?]? = nil
}

extension QueuedItem {
    private enum CodingKeys: String, CodingKey {
        case sequence, id, queue, method, url, resourceType, resourceID, encrypted, state, attempts, enqueuedAt
        case lastAttemptAt, lastStatus, lastError, outcome, size, clientID
    }

    /// Encodes the item with its id in lowercase, as dq prints ids everywhere.
    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(sequence, forKey: .sequence)
        try container.encode(id.lowercasedString, forKey: .id)
        try container.encode(queue, forKey: .queue)
        try container.encode(method, forKey: .method)
        try container.encode(url, forKey: .url)
        try container.encode(resourceType, forKey: .resourceType)
        try container.encodeIfPresent(resourceID, forKey: .resourceID)
        try container.encode(encrypted, forKey: .encrypted)
        try container.encode(state, forKey: .state)
        try container.encode(attempts, forKey: .attempts)
        try container.encode(enqueuedAt, forKey: .enqueuedAt)
        try container.encodeIfPresent(lastAttemptAt, forKey: .lastAttemptAt)
        try container.encodeIfPresent(lastStatus, forKey: .lastStatus)
        try container.encodeIfPresent(lastError, forKey: .lastError)
        // The server's answer is embedded as JSON when it is JSON (an OperationOutcome), else as text.
        if let outcome {
            if let value = JSONValue(parsing: outcome) {
                try container.encode(value, forKey: .outcome)
            } else {
                try container.encode(outcome, forKey: .outcome)
            }
        }
        try container.encode(size, forKey: .size)
        try container.encodeIfPresent(clientID, forKey: .clientID)
    }
}

extension DeliveryRecord {
    private enum CodingKeys: String, CodingKey {
        case sequence, id, event, queue, method, url, resourceType, status, location, serverID, versionID, attempts
        case enqueuedAt, at, note, fullURL, bundle, entryLocations
    }

    /// Encodes the record with its id in lowercase, as dq prints ids everywhere.
    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        try container.encode(sequence, forKey: .sequence)
        try container.encode(id.lowercasedString, forKey: .id)
        try container.encode(event, forKey: .event)
        try container.encode(queue, forKey: .queue)
        try container.encode(method, forKey: .method)
        try container.encode(url, forKey: .url)
        try container.encode(resourceType, forKey: .resourceType)
        try container.encodeIfPresent(status, forKey: .status)
        try container.encodeIfPresent(location, forKey: .location)
        try container.encodeIfPresent(serverID, forKey: .serverID)
        try container.encodeIfPresent(versionID, forKey: .versionID)
        try container.encode(attempts, forKey: .attempts)
        try container.encode(enqueuedAt, forKey: .enqueuedAt)
        try container.encode(at, forKey: .at)
        try container.encodeIfPresent(note, forKey: .note)
        try container.encodeIfPresent(fullURL, forKey: .fullURL)
        try container.encodeIfPresent(bundle, forKey: .bundle)
        try container.encodeIfPresent(entryLocations, forKey: .entryLocations)
    }
}

/// A JSON value parsed from text, to embed a server's answer in dq's own JSON output as JSON.
enum JSONValue: Encodable {
    case null, bool(Bool), number(NSNumber), string(String), array([JSONValue]), object([String: JSONValue])

    /// Parses `text`, or nil when it is not a JSON object or array.
    init?(parsing text: String) {
        let trimmed = text.drop { $0 == " " || $0 == "\n" || $0 == "\r" || $0 == "\t" }
        guard trimmed.first == "{" || trimmed.first == "[",
            let object = try? JSONSerialization.jsonObject(with: Data(text.utf8))
        else { return nil }
        self.init(object)
    }

    init(_ object: Any) {
        switch object {
        case let dictionary as [String: Any]: self = .object(dictionary.mapValues(JSONValue.init))
        case let array as [Any]: self = .array(array.map(JSONValue.init))
        case let text as String: self = .string(text)
        case let number as NSNumber:
            self = String(cString: number.objCType) == "c" || type(of: object) == Bool.self ? .bool(number.boolValue) : .number(number)
        default: self = .null
        }
    }

    func encode(to encoder: any Encoder) throws {
        var container = encoder.singleValueContainer()
        switch self {
        case .null: try container.encodeNil()
        case .bool(let flag): try container.encode(flag)
        case .number(let number):
            if let exact = Int64(exactly: number.doubleValue), number.stringValue == String(exact) {
                try container.encode(exact)
            } else {
                try container.encode(number.doubleValue)
            }
        case .string(let text): try container.encode(text)
        case .array(let values): try container.encode(values)
        case .object(let members): try container.encode(members)
        }
    }
}
