import Crypto
import Foundation

/// What a receiver (`dq serve`) keeps of a request that came with an `Idempotency-Key` header
/// (draft-ietf-httpapi-idempotency-key-header): which client sent it, a fingerprint of what it asked for, the item it
/// queued, and the answer it was given, so that a repeat is given the same answer and stores nothing.
///
/// Stored in the queue's database beside the item, in the item's own transaction (``ReceiptStore/insert(_:receipt:)``):
/// a crash leaves both or neither. Not PHI (a key, hashes, an answer that names no input), so not sealed at rest.
package struct Receipt: Sendable, Equatable {
    /// The authenticated client that sent the request.
    package var clientID: String
    /// The `Idempotency-Key` value, as sent (at most ``maximumKeyLength`` characters).
    package var key: String
    /// The hex SHA-256 of what the request asked for (a repeat with another fingerprint is refused with 422).
    package var fingerprint: String
    /// The item the first request queued.
    package var itemID: UUID
    /// The first answer's status; nil while it is not recorded yet (a plain resource's answer is made after the
    /// commit, once the queue had a short while to deliver it).
    package var status: Int?
    /// The first answer's `Location`.
    package var location: String?
    /// The first answer's `Content-Type`.
    package var contentType: String?
    /// The first answer's body.
    package var body: Data?
    /// When the first request was committed; a receipt older than the dedupe window is forgotten.
    package var createdAt: Date

    /// The longest key taken.
    package static let maximumKeyLength = 255

    /// A receipt from its parts.
    package init(
        clientID: String, key: String, fingerprint: String, itemID: UUID, status: Int? = nil, location: String? = nil,
        contentType: String? = nil, body: Data? = nil, createdAt: Date = Date()
    ) {
        self.clientID = clientID
        self.key = key
        self.fingerprint = fingerprint
        self.itemID = itemID
        self.status = status
        self.location = location
        self.contentType = contentType
        self.body = body
        self.createdAt = createdAt
    }
}

/// What ``ReceiptStore/insert(_:receipt:)`` did.
package enum ReceiptInsert: Sendable, Equatable {
    /// The item and its receipt are committed; the item's sequence number.
    case stored(Int64)
    /// The key was taken already (by this receipt, within the window): nothing was stored.
    case taken(Receipt)
}

/// A resource a client sent, by the client and the SHA-256 of its plaintext: how the decrypting side recognises a
/// repeat that came without an `Idempotency-Key` (a device that lost the answer and sent the envelope again, its AES
/// key wrapped anew).
struct ContentDigest: Sendable, Hashable {
    var clientID: String
    /// Hex SHA-256 of the plaintext (in a sealed queue, stored as the queue's keyed index hash of it).
    var digest: String

    /// The digest of `plaintext` sent by `clientID`. The plaintext is read in memory only.
    init(clientID: String, plaintext: Data) {
        self.clientID = clientID
        self.digest = SHA256.hash(data: plaintext).hexString
    }

    init(clientID: String, digest: String) {
        self.clientID = clientID
        self.digest = digest
    }
}

/// The receipts of `Idempotency-Key` requests and the content digests of delivered resources, in the queue's own
/// database (SQLite or PostgreSQL): conformed to by the stores and by ``SealedStorage``.
protocol ReceiptStore: Sendable {
    /// Stores `item` and, when given, `receipt` in one transaction: both or neither. When the client used the
    /// receipt's key already (a receipt committed at `expiredBefore` or later), nothing is stored and that receipt is
    /// returned: of two requests with one key at once, one stores and the other is told the key is taken.
    ///
    /// - Parameters:
    ///   - item: the new item (its ``NewItem/clientID`` is stored with it).
    ///   - receipt: the request's receipt; nil when it came without a key.
    ///   - expiredBefore: receipts of the same key committed before this time are forgotten first.
    /// - Throws: ``DataQueueError`` (`.storage`, `.storageFull`).
    func insert(_ item: NewItem, receipt: Receipt?, expiredBefore: Date) async throws -> ReceiptInsert

    /// The receipt of `key` sent by `clientID`, committed at `since` or later, if any.
    func receipt(clientID: String, key: String, since: Date) async throws -> Receipt?

    /// Records the answer given to the request of a receipt (once: an answer recorded already stays).
    func recordAnswer(_ receipt: Receipt) async throws

    /// Which of `digests` were delivered at `since` or later, each with the item that was (recorded in the journal's
    /// transaction from ``CompletedDelivery/digest``).
    func deliveredDigests(_ digests: Set<ContentDigest>, since: Date) async throws -> [ContentDigest: UUID]

    /// Removes `item` from the queue unsent, journaling it as a ``DeliveryRecord/Event/duplicate`` with `note`.
    func recordDuplicate(_ item: QueuedItem, url: String, note: String, owner: any FlushOwnership) async throws

    /// Forgets receipts and digests older than `cutoff`; returns how many.
    func pruneReceipts(before cutoff: Date) async throws -> Int
}

extension DataQueue {
    /// The receipts and digests of this queue's store, when it keeps them (SQLite, PostgreSQL, sealed or not).
    var receiptStore: (any ReceiptStore)? { store as? any ReceiptStore }
}
