import Crypto
import Foundation
import NIOPosix
import _CryptoExtras

/// The client ids, secrets and bearer tokens a receiver (`dq serve`) hands out, and the hashes of them that a
/// ``ClientRegistry`` keeps.
///
/// A secret is stored only as a slow salted hash (scrypt), in a self-describing form that carries its cost, so that
/// a later dq can raise the cost and still verify what an earlier one stored:
/// `scrypt$<N>$<r>$<p>$<salt, base64>$<hash, base64>`. A token is stored as its SHA-256 in hexadecimal: it has
/// 384 random bits, so a fast hash is right, and a token can be found by its hash.
///
/// ```swift
/// let secret = ClientSecrets.newSecret()
/// let stored = try await ClientSecrets.hashOffPool(secret: secret)   // not on the cooperative pool: it is slow
/// try await ClientSecrets.verifyOffPool(secret: secret, against: stored)  // true
/// ```
///
/// > Important: ``hash(secret:)`` and ``verify(secret:against:)`` are slow on purpose (tens of milliseconds of CPU
/// > and 32 MiB of memory each in a release build). Run them where blocking a thread is fine, and limit how often
/// > a client may ask.
///
/// C3-PRO's Java receiver stored a secret as the Base64 of its unsalted SHA-1. Such a hash, imported as
/// `sha1b64$<Base64 of SHA-1(secret)>` (``legacyHash(sha1Base64:)``), verifies too, so that devices keep the
/// credentials they have; ``isLegacy(_:)`` tells the caller to replace it with ``hash(secret:)`` on first use
/// (``ClientRegistry/replaceSecretHash(clientID:old:new:)``).
package enum ClientSecrets {
    /// scrypt's cost for new hashes: N = 2^15, r = 8, p = 3 (32 MiB), one of OWASP's equivalent recommendations
    /// (2023) for password storage.
    static let cost = ScryptCost(rounds: 1 << 15, blockSize: 8, parallelism: 3)
    /// Bytes of salt in a new hash.
    static let saltByteCount = 16
    /// Bytes of scrypt output in a new hash.
    static let hashByteCount = 32
    /// The prefix of a hash made here.
    static let scryptPrefix = "scrypt"
    /// The prefix of a hash imported from C3-PRO's Java receiver.
    static let legacyPrefix = "sha1b64"

    /// scrypt's parameters.
    struct ScryptCost: Equatable {
        /// N, the CPU and memory cost: a power of two.
        var rounds: Int
        /// r.
        var blockSize: Int
        /// p.
        var parallelism: Int

        /// Whether a stored hash's parameters are ones this dq computes: a damaged or hostile row must not make it
        /// allocate gigabytes or spin for minutes.
        var isAcceptable: Bool {
            rounds >= 2 && rounds <= 1 << 20 && rounds & (rounds - 1) == 0 && (1...32).contains(blockSize)
                && (1...16).contains(parallelism) && 128 * rounds * blockSize <= 256 << 20
        }
    }

    // MARK: - New credentials

    /// A new client id: a random UUID, lowercased (`"0f8fad5b-d9cb-469f-a165-70867728950e"`), as C3-PRO's were.
    package static func newClientID() -> String {
        UUID().uuidString.lowercased()
    }

    /// A new client secret: 32 random bytes as base64url without padding (43 characters of `A-Z a-z 0-9 - _`), so
    /// that it needs no escaping in HTTP Basic credentials, form bodies or URLs.
    package static func newSecret() -> String {
        randomBytes(32).base64URL
    }

    /// A new bearer token: 48 random bytes as base64url, 64 characters of `A-Z a-z 0-9 - _` (C3-PRO's tokens were 64
    /// characters long).
    package static func newToken() -> String {
        randomBytes(48).base64URL
    }

    // MARK: - Secrets

    /// A slow salted hash of `secret` to store: `scrypt$32768$8$3$<salt>$<hash>` (a fresh 16-byte salt, so two
    /// hashes of one secret differ).
    ///
    /// - Throws: ``DataQueueError`` (`.invalidResource`) for an empty secret; (`.encryption`) when scrypt fails (it
    ///   could not allocate its memory).
    package static func hash(secret: String) throws -> String {
        guard !secret.isEmpty else { throw DataQueueError(.invalidResource, "a client secret cannot be empty") }
        let salt = randomBytes(saltByteCount)
        let key: SymmetricKey
        do {
            key = try derive(secret, salt: salt, cost: cost, byteCount: hashByteCount)
        } catch {
            throw DataQueueError(.encryption, "cannot hash a client secret: scrypt failed")
        }
        let hash = key.withUnsafeBytes { Data($0) }
        return [
            scryptPrefix, String(cost.rounds), String(cost.blockSize), String(cost.parallelism), salt.base64EncodedString(),
            hash.base64EncodedString(),
        ].joined(separator: "$")
    }

    /// Whether `secret` is the one `hash` was made of, compared in constant time.
    ///
    /// Takes what ``hash(secret:)`` makes, of any cost this dq accepts, and C3-PRO's `sha1b64$…`; anything else
    /// (an empty secret, an unknown or damaged hash) is false.
    package static func verify(secret: String, against hash: String) -> Bool {
        guard !secret.isEmpty else { return false }
        let parts = hash.split(separator: "$", omittingEmptySubsequences: false)
        switch parts.first.map(String.init) {
        case scryptPrefix:
            guard parts.count == 6, let rounds = Int(parts[1]), let blockSize = Int(parts[2]), let parallelism = Int(parts[3]),
                let salt = Data(base64Encoded: String(parts[4])), let expected = Data(base64Encoded: String(parts[5])),
                !salt.isEmpty, (16...64).contains(expected.count)
            else { return false }
            let cost = ScryptCost(rounds: rounds, blockSize: blockSize, parallelism: parallelism)
            guard cost.isAcceptable, let derived = try? derive(secret, salt: salt, cost: cost, byteCount: expected.count) else {
                return false
            }
            return derived == SymmetricKey(data: expected)
        case legacyPrefix:
            guard parts.count == 2, let expected = Data(base64Encoded: String(parts[1])) else { return false }
            let digest = Insecure.SHA1.hash(data: Data(secret.utf8))
            return SymmetricKey(data: Data(digest)) == SymmetricKey(data: expected)
        default:
            return false
        }
    }

    /// ``hash(secret:)`` on NIO's thread pool: a slow hash (tens to hundreds of milliseconds) must not hold one of
    /// the cooperative pool's few threads, which every other request of the receiver needs.
    package static func hashOffPool(secret: String) async throws -> String {
        try await NIOThreadPool.singleton.runIfActive { try hash(secret: secret) }
    }

    /// ``verify(secret:against:)`` on NIO's thread pool; with no stored hash (an unknown client id) it spends the
    /// same time on a hash of nothing and answers false, so the answer's timing does not tell which ids exist.
    package static func verifyOffPool(secret: String, against stored: String?) async throws -> Bool {
        try await NIOThreadPool.singleton.runIfActive {
            guard let stored else {
                _ = verify(secret: secret, against: unknownClientHash)
                return false
            }
            return verify(secret: secret, against: stored)
        }
    }

    /// A hash no secret is checked against for real (made once, of random bytes).
    private static let unknownClientHash: String = (try? hash(secret: newSecret())) ?? ""

    /// Whether `hash` is C3-PRO's unsalted SHA-1 (`sha1b64$…`), to be replaced by ``hash(secret:)`` once the secret
    /// has been verified against it.
    package static func isLegacy(_ hash: String) -> Bool {
        hash.hasPrefix(legacyPrefix + "$")
    }

    /// The stored form of a secret hash from C3-PRO's Java receiver: its `Users` row's Base64 of the secret's SHA-1.
    package static func legacyHash(sha1Base64: String) -> String {
        legacyPrefix + "$" + sha1Base64
    }

    // MARK: - Tokens

    /// What a ``ClientRegistry`` keeps of `token`: its SHA-256, 64 lowercase hexadecimal digits.
    package static func tokenHash(_ token: String) -> String {
        SHA256.hash(data: Data(token.utf8)).hexString
    }

    // MARK: - Helpers

    private static func derive(_ secret: String, salt: Data, cost: ScryptCost, byteCount: Int) throws -> SymmetricKey {
        try KDF.Scrypt.deriveKey(
            from: Array(secret.utf8), salt: Array(salt), outputByteCount: byteCount, rounds: cost.rounds, blockSize: cost.blockSize,
            parallelism: cost.parallelism)
    }

    /// `count` bytes from the system's CSPRNG.
    private static func randomBytes(_ count: Int) -> Data {
        var generator = SystemRandomNumberGenerator()
        return Data((0..<count).map { _ in UInt8.random(in: .min ... .max, using: &generator) })
    }
}
