import Crypto
import Foundation
import JWTKit
import _CryptoExtras

extension OAuth2Configuration {
    /// A private key that signs SMART Backend Services client assertions (RFC 7523, `private_key_jwt`).
    ///
    /// ```swift
    /// let key = try OAuth2Configuration.ClientAssertionKey(pemFile: "/etc/dq/client-key.pem", keyID: "dq-1")
    /// ```
    public struct ClientAssertionKey: Sendable {
        /// The JWS algorithm.
        public enum Algorithm: String, Sendable, CaseIterable {
            /// RSASSA-PKCS1-v1_5 with SHA-256.
            case rs256 = "RS256"
            /// RSASSA-PKCS1-v1_5 with SHA-384.
            case rs384 = "RS384"
            /// ECDSA on P-256 with SHA-256.
            case es256 = "ES256"
            /// ECDSA on P-384 with SHA-384.
            case es384 = "ES384"
        }

        private enum Backing: Sendable {
            case rsa(_RSA.Signing.PrivateKey)
            case p256(P256.Signing.PrivateKey)
            case p384(P384.Signing.PrivateKey)
        }

        private let backing: Backing
        /// The `kid` put in every assertion header and in the JWK.
        public let keyID: String
        /// The algorithm: from the curve of an EC key; RS384 or RS256 (as chosen) for an RSA key.
        public let algorithm: Algorithm

        /// Reads an RSA (2048 bits or more), P-256 or P-384 private key from a PEM file.
        /// - Parameters:
        ///   - path: the PEM file (PKCS#8, or the traditional RSA or EC form).
        ///   - keyID: the `kid` put in assertions. The default (nil) is the key's RFC 7638 thumbprint.
        ///   - algorithm: for an RSA key, RS384 (the default) or RS256; for an EC key it must match the
        ///     curve (ES256 for P-256, ES384 for P-384) or be nil.
        /// - Throws: ``DataQueueError`` with `.invalidConfiguration` naming the file.
        public init(pemFile path: String, keyID: String? = nil, algorithm: Algorithm? = nil) throws {
            guard let data = FileManager.default.contents(atPath: path) else {
                throw DataQueueError(.invalidConfiguration, "configuration: \"auth.private_key\": cannot read \(path)")
            }
            try self.init(pem: String(decoding: data, as: UTF8.self), keyID: keyID, algorithm: algorithm, source: path)
        }

        /// Reads an RSA, P-256 or P-384 private key from PEM text (see ``init(pemFile:keyID:algorithm:)``).
        public init(pem: String, keyID: String? = nil, algorithm: Algorithm? = nil, source: String = "private key") throws {
            let backing: Backing
            let chosen: Algorithm
            if let key = try? P384.Signing.PrivateKey(pemRepresentation: pem) {
                (backing, chosen) = (.p384(key), .es384)
            } else if let key = try? P256.Signing.PrivateKey(pemRepresentation: pem) {
                (backing, chosen) = (.p256(key), .es256)
            } else if let key = try? _RSA.Signing.PrivateKey(pemRepresentation: pem) {
                (backing, chosen) = (.rsa(key), algorithm == .rs256 ? .rs256 : .rs384)
            } else {
                throw DataQueueError(
                    .invalidConfiguration,
                    "configuration: \"auth.private_key\": \(source) is not an RSA (2048+ bits), P-256 or P-384 private key in PEM")
            }
            if let algorithm, algorithm != chosen {
                throw DataQueueError(
                    .invalidConfiguration,
                    "configuration: \"auth.key_alg\" is \(algorithm.rawValue), but \(source) is a key for \(chosen.rawValue)")
            }
            // The default kid is the RFC 7638 thumbprint of the public key: stable across runs.
            let thumbprint = OAuth2Configuration.ClientAssertionKey(backing: backing, algorithm: chosen, keyID: "").thumbprint
            self.init(backing: backing, algorithm: chosen, keyID: keyID ?? thumbprint)
        }

        private init(backing: Backing, algorithm: Algorithm, keyID: String) {
            self.backing = backing
            self.algorithm = algorithm
            self.keyID = keyID
        }

        /// Makes a new key pair.
        public static func generate(_ algorithm: Algorithm, keyID: String? = nil) throws -> (
            OAuth2Configuration.ClientAssertionKey, pem: String
        ) {
            let pem: String
            switch algorithm {
            case .rs256, .rs384: pem = try _RSA.Signing.PrivateKey(keySize: .bits2048).pemRepresentation
            case .es256: pem = P256.Signing.PrivateKey().pemRepresentation
            case .es384: pem = P384.Signing.PrivateKey().pemRepresentation
            }
            return (try OAuth2Configuration.ClientAssertionKey(pem: pem, keyID: keyID, algorithm: algorithm), pem)
        }

        /// The public key as a JWK (`kty`, `kid`, `alg`, `use: sig`, and `n`/`e` or `crv`/`x`/`y`).
        public var publicJWK: [String: String] {
            var jwk = publicJWKMembers
            jwk["kid"] = keyID
            jwk["alg"] = algorithm.rawValue
            jwk["use"] = "sig"
            return jwk
        }

        /// `{"keys":[jwk]}` as JSON text, to register with a server.
        public var publicJWKS: String {
            let data = try? JSONSerialization.data(
                withJSONObject: ["keys": [publicJWK]], options: [.sortedKeys, .prettyPrinted, .withoutEscapingSlashes])
            return String(decoding: data ?? Data(), as: UTF8.self)
        }

        private var publicJWKMembers: [String: String] {
            switch backing {
            case .rsa(let key):
                let (n, e) = Self.rsaComponents(pkcs1: key.publicKey.pkcs1DERRepresentation)
                return ["kty": "RSA", "n": n.base64URL, "e": e.base64URL]
            case .p256(let key):
                let point = key.publicKey.x963Representation.dropFirst()
                return ["kty": "EC", "crv": "P-256", "x": Data(point.prefix(32)).base64URL, "y": Data(point.suffix(32)).base64URL]
            case .p384(let key):
                let point = key.publicKey.x963Representation.dropFirst()
                return ["kty": "EC", "crv": "P-384", "x": Data(point.prefix(48)).base64URL, "y": Data(point.suffix(48)).base64URL]
            }
        }

        /// The RFC 7638 JWK thumbprint (SHA-256, base64url).
        var thumbprint: String {
            let members = publicJWKMembers
            let required = members["kty"] == "RSA" ? ["e", "kty", "n"] : ["crv", "kty", "x", "y"]
            let json = "{" + required.map { "\"\($0)\":\"\(members[$0]!)\"" }.joined(separator: ",") + "}"
            return Data(SHA256.hash(data: Data(json.utf8))).base64URL
        }

        /// Signs a client assertion for `clientID` at `tokenURL`, valid for `lifetime` seconds (at most 300):
        /// `iss` = `sub` = the client id, `aud` = the token URL, a fresh `jti`, the `kid`. Signed by jwt-kit.
        public func assertion(clientID: String, tokenURL: String, lifetime: TimeInterval = 240, now: Date = Date()) async throws
            -> String
        {
            let keys = JWTKeyCollection()
            let kid = keyID.isEmpty ? nil : JWKIdentifier(string: keyID)
            switch backing {
            case .rsa(let key):
                await keys.add(
                    rsa: try Insecure.RSA.PrivateKey(backing: key), digestAlgorithm: algorithm == .rs256 ? .sha256 : .sha384, kid: kid)
            case .p256(let key):
                await keys.add(ecdsa: try ES256PrivateKey(backing: key), kid: kid)
            case .p384(let key):
                await keys.add(ecdsa: try ES384PrivateKey(backing: key), kid: kid)
            }
            let issued = Date(timeIntervalSince1970: now.timeIntervalSince1970.rounded(.down))
            let claims = AssertionClaims(
                iss: IssuerClaim(value: clientID), sub: SubjectClaim(value: clientID), aud: AudienceClaim(value: [tokenURL]),
                exp: ExpirationClaim(value: issued.addingTimeInterval(min(lifetime, 300).rounded(.down))),
                iat: IssuedAtClaim(value: issued),
                jti: IDClaim(value: UUID().uuidString.lowercased()))
            return try await keys.sign(claims, kid: kid, header: ["typ": "JWT"])
        }

        /// The claims of an RFC 7523 client assertion.
        struct AssertionClaims: JWTPayload {
            var iss: IssuerClaim
            var sub: SubjectClaim
            var aud: AudienceClaim
            var exp: ExpirationClaim
            var iat: IssuedAtClaim
            var jti: IDClaim

            /// dq signs these; the token endpoint verifies them.
            func verify(using algorithm: some JWTAlgorithm) async throws {}
        }

        /// Splits a PKCS#1 RSAPublicKey DER into modulus and exponent (leading zero bytes removed).
        static func rsaComponents(pkcs1 der: Data) -> (Data, Data) {
            var bytes = [UInt8](der)
            var index = 0
            func length() -> Int {
                var count = Int(bytes[index]); index += 1
                if count & 0x80 != 0 {
                    let octets = count & 0x7F
                    count = 0
                    for _ in 0..<octets { count = (count << 8) | Int(bytes[index]); index += 1 }
                }
                return count
            }
            func integer() -> Data {
                index += 1  // INTEGER tag
                let count = length()
                var value = Array(bytes[index..<index + count])
                index += count
                while value.count > 1 && value.first == 0 { value.removeFirst() }
                return Data(value)
            }
            index += 1  // SEQUENCE tag
            _ = length()
            let modulus = integer()
            let exponent = integer()
            bytes.removeAll()
            return (modulus, exponent)
        }
    }
}

extension Data {
    /// Base64url without padding (RFC 7515).
    var base64URL: String {
        base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }
}
