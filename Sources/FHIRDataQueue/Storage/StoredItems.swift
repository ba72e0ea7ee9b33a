import Foundation

/// A request to store, before it has a sequence number: the ``DataQueue/PreparedRequest`` a resource became, with the
/// item's identity (its id and its server's queue) and what links it to other items.
struct NewItem: Sendable {
    var id: UUID
    var queue: String
    var request: DataQueue.PreparedRequest
    /// The producer's `fullUrl` for the resource (`urn:uuid:…`), which later items may reference.
    var fullURL: String? = nil
    /// The `urn:uuid` fullUrls the body references (lowercased, in order; none for an encrypted item), found
    /// once when the item is made: a bulk enqueue finds them on the threads that make items, not on the writer.
    var references: [String] = []
    /// Whether ``Sealer/seal(_:)`` made this item (its values are sealed, its fullUrl and references hashed).
    var sealed = false
    /// The authenticated client of a receiver (`dq serve`) that sent it, stored with it: the decrypting side
    /// recognises a repeat by the client and the plaintext's digest. Nil for items a producer queued.
    var clientID: String? = nil

    var method: FHIRMethod { request.method }
    /// The request path relative to the endpoint (stored as the item's `url`).
    var url: String { request.path }
    var resourceType: String { request.resourceType }
    var resourceID: String? { request.resourceID }
    var encrypted: Bool { request.encrypted }
    var contentType: String { request.contentType }
    var body: Data { request.body }

    init(id: UUID, queue: String, request: DataQueue.PreparedRequest, fullURL: String? = nil, references: [String] = []) {
        self.id = id
        self.queue = queue
        self.request = request
        self.fullURL = fullURL
        self.references = references
    }

    /// An item from its parts (rows moved between stores, tests).
    init(
        id: UUID, queue: String, method: FHIRMethod, url: String, resourceType: String, resourceID: String?, encrypted: Bool,
        contentType: String, body: Data, fullURL: String? = nil, references: [String] = []
    ) {
        self.init(
            id: id, queue: queue,
            request: DataQueue.PreparedRequest(
                method: method, path: url, contentType: contentType, body: body, resourceType: resourceType,
                resourceID: resourceID, encrypted: encrypted),
            fullURL: fullURL, references: references)
    }
}

/// A stored item with what is needed to send it.
struct StoredItem: Sendable {
    var info: QueuedItem
    var contentType: String
    /// Whether idempotent mode may send it as a conditional create (an operator can turn it off per item).
    var conditionalCreate: Bool = true
    var body: Data
    /// The producer's `fullUrl`, if it gave one.
    var fullURL: String? = nil
    /// Why the item cannot be read (its seal at rest does not open): it is parked with this reason, never sent.
    var unreadable: String? = nil
    /// The client of a receiver that sent it (see ``NewItem/clientID``).
    var clientID: String? = nil
    /// Made in memory when the item is read for sending: the client and the SHA-256 of its plaintext (an envelope
    /// opened, or a plain body), by which a repeat of a delivered resource is recognised.
    var digest: ContentDigest? = nil
    /// Made in memory when a receiver's item is read for sending: whether the write policy was applied to it, and the
    /// `PUT` targets it allowed only once each is found new or the client's own (see ``WritePolicy/Target``).
    var policyApplied = false
    var writeTargets: [WritePolicy.Target] = []
}
