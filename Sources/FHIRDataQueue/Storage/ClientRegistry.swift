import Crypto
import Foundation

/// Clients registered with a receiver (`dq serve`) and the bearer tokens issued to them, kept in the queue's database
/// so that a token is valid across a restart and on every receiver sharing one PostgreSQL database until it expires.
///
/// The registry stores hashes only: a client's secret as ``ClientSecrets/hash(secret:)`` made it (slow and salted),
/// a token as ``ClientSecrets/tokenHash(_:)`` (SHA-256: a token is random enough that a fast hash is right). Neither
/// is PHI, so neither is sealed at rest. Times are the caller's clock, stored as the queue stores its other times.
///
/// ```swift
/// let registry = queue.clientRegistry
/// let id = ClientSecrets.newClientID(), secret = ClientSecrets.newSecret()
/// try await registry.register(clientID: id, secretHash: try ClientSecrets.hash(secret: secret), at: .now)
/// let token = ClientSecrets.newToken()
/// try await registry.issueToken(tokenHash: ClientSecrets.tokenHash(token), clientID: id, expiresAt: .now + 1800)
/// try await registry.token(hash: ClientSecrets.tokenHash(token), now: .now)?.clientID  // id
/// ```
package protocol ClientRegistry: Sendable {
    /// Stores a new client.
    ///
    /// - Throws: ``DataQueueError`` (`.storage`) when `clientID` is registered already, or the database fails.
    func register(clientID: String, secretHash: String, at: Date) async throws

    /// Stores each client whose id is not registered yet, in one transaction, and leaves a registered one as it is
    /// (never overwritten: an import run twice takes nothing the second time).
    ///
    /// - Parameter clients: client id to secret hash (`dq serve import-credentials` gives C3-PRO's hashes as
    ///   ``ClientSecrets/legacyHash(sha1Base64:)`` makes them).
    /// - Returns: the ids it stored.
    /// - Throws: ``DataQueueError`` (`.storage`) when the database fails; then none is stored.
    func registerAbsent(_ clients: [String: String], at: Date) async throws -> Set<String>

    /// The stored secret hash of a client, or nil when unknown.
    func secretHash(clientID: String) async throws -> String?

    /// Replaces a client's hash if it is still `old` (for re-hashing a legacy hash on first use); returns whether it did.
    ///
    /// A compare-and-swap: of two receivers re-hashing one client at once, one replaces it and the other finds it
    /// changed (and its own new hash unused, which is harmless: both verify the same secret).
    func replaceSecretHash(clientID: String, old: String, new: String) async throws -> Bool

    /// Stores an issued token by its hash.
    ///
    /// - Throws: ``DataQueueError`` (`.storage`) when `clientID` is not registered, or the database fails.
    func issueToken(tokenHash: String, clientID: String, expiresAt: Date) async throws

    /// The client and expiry of a token that has not expired at `now` (its expiry is later than `now`), or nil.
    func token(hash tokenHash: String, now: Date) async throws -> (clientID: String, expiresAt: Date)?

    /// Removes tokens that expired before `cutoff`, at most `limit` of them in one transaction; returns how many.
    func pruneTokens(before cutoff: Date, limit: Int) async throws -> Int

    /// Records that `clientID` writes `target` (`Type/id` on the server `queue` names) unless another client did
    /// first, and returns the client that holds it: `clientID` when the claim is (or already was) its own. Kept as
    /// the SHA-256 of queue and target (no resource id in the database), for the receiver's write policy
    /// (``WritePolicy``): a device updates only what it wrote.
    func claimResource(queue: String, target: String, clientID: String, at: Date) async throws -> String

    /// The client that holds `target` on `queue` (see ``claimResource(queue:target:clientID:at:)``), or nil.
    func resourceOwner(queue: String, target: String) async throws -> String?

    /// How many items a client sent that are still in the database (pending or parked, any queue), and their bytes as
    /// stored: what a receiver limits per client.
    func waiting(clientID: String) async throws -> (count: Int, bytes: Int)
}

/// The key a resource's claim is kept under: the SHA-256 of the queue and `Type/id`, in hex.
func resourceClaimKey(queue: String, target: String) -> String {
    var hash = SHA256()
    hash.update(data: Data(queue.utf8))
    hash.update(data: Data([0]))
    hash.update(data: Data(target.utf8))
    return hash.finalize().hexString
}

extension ClientRegistry {
    /// Removes every token that expired before `cutoff`; returns how many.
    func pruneTokens(before cutoff: Date) async throws -> Int {
        try await pruneTokens(before: cutoff, limit: .max)
    }
}

extension DataQueue {
    /// The clients and tokens of a receiver, in this queue's own database (SQLite or PostgreSQL).
    package var clientRegistry: any ClientRegistry {
        // The sealing wrapper leaves clients alone: their hashes are not PHI.
        let base = (store as? SealedStorage)?.inner ?? store
        return base as? any ClientRegistry ?? NoClientRegistry()
    }
}

extension DataQueueError {
    /// ``ClientRegistry/register(clientID:secretHash:at:)`` with an id that is taken.
    static func clientAlreadyRegistered(_ clientID: String) -> DataQueueError {
        DataQueueError(.storage, "cannot register client \(clientID): a client with this id is registered already")
    }

    /// ``ClientRegistry/issueToken(tokenHash:clientID:expiresAt:)`` for a client that is not registered.
    static func clientNotRegistered(_ clientID: String) -> DataQueueError {
        DataQueueError(.storage, "cannot store a token for client \(clientID): no such client is registered")
    }
}

/// The registry of a store that keeps no clients (a test's own store): every call throws.
private struct NoClientRegistry: ClientRegistry {
    private var refusal: DataQueueError { DataQueueError(.storage, "this queue's store cannot keep registered clients") }

    func register(clientID: String, secretHash: String, at: Date) async throws { throw refusal }
    func registerAbsent(_ clients: [String: String], at: Date) async throws -> Set<String> { throw refusal }
    func secretHash(clientID: String) async throws -> String? { throw refusal }
    func replaceSecretHash(clientID: String, old: String, new: String) async throws -> Bool { throw refusal }
    func issueToken(tokenHash: String, clientID: String, expiresAt: Date) async throws { throw refusal }
    func token(hash tokenHash: String, now: Date) async throws -> (clientID: String, expiresAt: Date)? { throw refusal }
    func pruneTokens(before cutoff: Date, limit: Int) async throws -> Int { throw refusal }
    func claimResource(queue: String, target: String, clientID: String, at: Date) async throws -> String { throw refusal }
    func resourceOwner(queue: String, target: String) async throws -> String? { throw refusal }
    func waiting(clientID: String) async throws -> (count: Int, bytes: Int) { throw refusal }
}
