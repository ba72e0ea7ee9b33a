import Foundation
import NIOConcurrencyHelpers

/// Bearer tokens found valid, by their hash, so that a device's requests do not each read the database (on SQLite
/// that read waits its turn behind the commits on the one connection). A token can only expire (there is no
/// revocation), so an entry is good until its token's expiry; it is kept at most ``longest`` all the same, so that a
/// removal made in the database takes effect within that time. An unknown token is not remembered: one issued by
/// another receiver on the same database is found there on its first use.
final class TokenCache: Sendable {
    /// The longest an entry is trusted without reading the database again.
    static let longest: TimeInterval = 300
    /// The most entries kept (one per device token in use); past it, the expired go, then all.
    static let capacity = 20_000
    private let entries = NIOLockedValueBox<[String: (clientID: String, until: Date)]>([:])

    /// The client of a cached token still valid at `now`, or nil.
    func client(tokenHash: String, now: Date) -> String? {
        entries.withLockedValue { entries in
            guard let entry = entries[tokenHash] else { return nil }
            guard entry.until > now else {
                entries[tokenHash] = nil
                return nil
            }
            return entry.clientID
        }
    }

    /// How many entries are kept.
    var count: Int { entries.withLockedValue { $0.count } }

    /// Remembers a token the database found valid until `expiresAt`.
    func remember(tokenHash: String, clientID: String, expiresAt: Date, now: Date) {
        let until = min(expiresAt, now.addingTimeInterval(Self.longest))
        entries.withLockedValue { entries in
            if entries.count >= Self.capacity {
                entries = entries.filter { $0.value.until > now }
                if entries.count >= Self.capacity { entries.removeAll(keepingCapacity: true) }
            }
            entries[tokenHash] = (clientID, until)
        }
    }
}
