import Crypto
import Foundation
import NIOConcurrencyHelpers

/// Whether two byte sequences of the same length are equal, in time that depends on that length only.
func constantTimeEquals(_ x: [UInt8], _ y: [UInt8]) -> Bool {
    guard x.count == y.count else { return false }
    var difference: UInt8 = 0
    for (a, b) in zip(x, y) { difference |= a ^ b }
    return difference == 0
}

/// The `Antispam` values `register` accepts, replaceable while the receiver serves. Each is kept as its SHA-256, and
/// an offered value is hashed and compared with each in constant time: the time an answer takes depends on the
/// offered value's length only, never on a secret's content or length.
final class AntispamSecrets: Sendable {
    private let digests: NIOLockedValueBox<[[UInt8]]>

    init(_ secrets: [String]) { digests = NIOLockedValueBox(secrets.map(Self.digest)) }

    /// Accepts `secrets` from now on (and no other).
    func replace(_ secrets: [String]) { digests.withLockedValue { $0 = secrets.map(Self.digest) } }

    /// Whether `offered` is one of the secrets. Every secret is compared, whichever matches.
    func accepts(_ offered: String) -> Bool {
        let candidate = Self.digest(offered)
        return digests.withLockedValue { $0 }.reduce(false) { found, digest in constantTimeEquals(digest, candidate) || found }
    }

    private static func digest(_ secret: String) -> [UInt8] { Array(SHA256.hash(data: Data(secret.utf8))) }
}
