import Foundation

/// A request to store, before it has a sequence number.
struct NewItem: Sendable {
    var id: UUID
    var queue: String
    var method: FHIRMethod
    var url: String
    var resourceType: String
    var resourceID: String?
    var encrypted: Bool
    var contentType: String
    var body: Data
    /// The producer's `fullUrl` for the resource (`urn:uuid:…`), which later items may reference.
    var fullURL: String? = nil
    /// The `urn:uuid` fullUrls the body references (lowercased, in order; none for an encrypted item), found
    /// once when the item is made: a bulk enqueue finds them on the threads that make items, not on the writer.
    var references: [String] = []
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
}
