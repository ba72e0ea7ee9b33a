import Crypto
import Foundation
import JWTKit
import NIOConcurrencyHelpers
import _CryptoExtras

/// Checks the signed client assertions (SMART Backend Services, RFC 7523 `private_key_jwt`) that clients with a
/// key set of their own (edges forwarding to a decrypting receiver) authenticate to the token endpoint with.
///
/// An assertion is taken when it is signed by a key in its client's JWKS (RS256/384, ES256/384, PS256/384), its
/// `iss` and `sub` are the client's id, its `aud` is the token endpoint (its path is enough: the receiver does not
/// know the name it is reached by behind a proxy), it expires within five minutes (`exp`), and its `jti` was not
/// seen before it expires. The `jti`s seen are kept by this process: a replay on another receiver sharing the
/// database within those five minutes is not caught (the assertion only buys a short-lived token there, too).
final class ClientAssertionVerifier: Sendable {
    /// Why an assertion was refused: said to the client as `invalid_client`; never names the assertion.
    struct Refusal: Error, CustomStringConvertible {
        let description: String
    }

    struct Claims: JWTPayload {
        var iss: String
        var sub: String
        var aud: AudienceClaim
        var exp: ExpirationClaim
        var jti: String?

        /// The checks are made by ``ClientAssertionVerifier`` one by one, each with its own reason.
        func verify(using algorithm: some JWTAlgorithm) async throws {}
    }

    static let assertionType = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
    static let algorithms: Set<String> = ["RS256", "RS384", "ES256", "ES384", "PS256", "PS384"]
    /// The longest life an assertion may claim (SMART: no more than five minutes), and the clock skew allowed.
    static let maximumLifetime: TimeInterval = 300
    static let leeway: TimeInterval = 60

    private let keySets: [String: [JWK]]
    private let collections = NIOLockedValueBox<[String: JWTKeyCollection]>([:])
    private let seen = NIOLockedValueBox<[String: Date]>([:])

    /// A verifier for the clients in `keySets` (client id → the JWKS JSON).
    /// - Throws: ``Refusal`` naming the client whose key set is not a JWKS or holds no signing key.
    init(keySets: [String: String]) throws(Refusal) {
        var parsed: [String: [JWK]] = [:]
        for (client, text) in keySets {
            guard let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any],
                let list = object["keys"] as? [[String: Any]]
            else { throw Refusal(description: "the key set of client \(client) is not a JWKS ({\"keys\": [...]})") }
            var jwks: [JWK] = []
            for (index, var entry) in list.enumerated() where (entry["use"] as? String ?? "sig") == "sig" {
                // A key without kid (legal in a one-key set) gets a name of its own.
                let kid = entry["kid"] as? String ?? "dq-unnamed-key-\(index)"
                entry["kid"] = kid
                // Every signing key must be usable: one dropped in silence would refuse that edge's tokens later.
                if let problem = Self.problem(with: entry) {
                    throw Refusal(description: "key \(kid) of client \(client)'s key set cannot be used: \(problem)")
                }
                guard let json = try? JSONSerialization.data(withJSONObject: entry),
                    let jwk = try? JSONDecoder().decode(JWK.self, from: json)
                else { throw Refusal(description: "key \(kid) of client \(client)'s key set is not a JWK") }
                jwks.append(jwk)
            }
            guard !jwks.isEmpty else { throw Refusal(description: "the key set of client \(client) holds no signing key") }
            parsed[client] = jwks
        }
        self.keySets = parsed
    }

    /// Why a JWK (its members) is not a public key an assertion can be checked with, or nil: an RSA key of at least
    /// 2048 bits, or an EC key whose point is on P-256 or P-384. jwt-kit takes an EC point off its curve when the
    /// key is added; swift-crypto checks the point.
    static func problem(with jwk: [String: Any]) -> String? {
        func bytes(_ name: String) -> Data? { (jwk[name] as? String).flatMap(base64URLDecode) }
        if jwk["d"] != nil { return "it holds a private key (give the public key only)" }
        switch jwk["kty"] as? String {
        case "RSA":
            guard let n = bytes("n"), let e = bytes("e") else { return "an RSA key needs n and e" }
            // swift-crypto refuses a modulus under 2048 bits.
            return (try? _RSA.Signing.PublicKey(n: n, e: e)) == nil ? "n and e are not an RSA public key of 2048 bits or more" : nil
        case "EC":
            guard let x = bytes("x"), let y = bytes("y") else { return "an EC key needs x and y" }
            let point = Data([0x04]) + x + y
            switch jwk["crv"] as? String {
            case "P-256": return (try? P256.Signing.PublicKey(x963Representation: point)) == nil ? "x and y are not a point on P-256" : nil
            case "P-384": return (try? P384.Signing.PublicKey(x963Representation: point)) == nil ? "x and y are not a point on P-384" : nil
            default: return "an EC key on a curve other than P-256 or P-384"
            }
        default:
            return "a key type other than RSA or EC"
        }
    }

    /// Whether `client` authenticates with a key set here.
    func knows(_ client: String) -> Bool { keySets[client] != nil }

    /// Loads every client's keys into jwt-kit now (a host calls it at start, through
    /// ``C3PROReceiver/loadClientKeySets()``): a key jwt-kit cannot use is named then, not refused at each token request.
    /// - Throws: ``Refusal`` naming the client and the key.
    func load() async throws(Refusal) {
        for (client, jwks) in keySets.sorted(by: { $0.key < $1.key }) {
            let collection = JWTKeyCollection()
            for jwk in jwks {
                do {
                    try await collection.add(jwk: jwk)
                } catch {
                    throw Refusal(
                        description: "a key of client \(client)'s key set cannot be used (\(jwk.keyIdentifier?.string ?? "no kid"))")
                }
            }
            collections.withLockedValue { $0[client] = collection }
        }
    }

    /// The client's keys for jwt-kit, made on first use.
    private func collection(for client: String) async -> JWTKeyCollection? {
        if let made = collections.withLockedValue({ $0[client] }) { return made }
        guard let jwks = keySets[client] else { return nil }
        let collection = JWTKeyCollection()
        for jwk in jwks { _ = try? await collection.add(jwk: jwk) }
        collections.withLockedValue { $0[client] = collection }
        return collection
    }

    /// The client id an assertion authenticates, or why it is refused.
    func verify(_ assertion: String, tokenPath: String, now: Date = Date()) async -> Result<String, Refusal> {
        let parts = assertion.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let headerData = Self.base64URLDecode(String(parts[0])),
            let header = try? JSONSerialization.jsonObject(with: headerData) as? [String: Any],
            let payloadData = Self.base64URLDecode(String(parts[1])),
            let payload = try? JSONSerialization.jsonObject(with: payloadData) as? [String: Any]
        else { return .failure(Refusal(description: "the client assertion is not a signed JWT")) }
        guard let alg = header["alg"] as? String, Self.algorithms.contains(alg) else {
            return .failure(Refusal(description: "the client assertion's algorithm is not accepted"))
        }
        guard let issuer = payload["iss"] as? String, let collection = await collection(for: issuer) else {
            return .failure(Refusal(description: "the client assertion's issuer has no key set here"))
        }
        let claims: Claims
        do {
            claims = try await collection.verify(assertion, as: Claims.self, iteratingKeys: header["kid"] == nil)
        } catch {
            return .failure(Refusal(description: "the client assertion's signature does not verify with the client's keys"))
        }
        guard claims.sub == claims.iss else { return .failure(Refusal(description: "the client assertion's sub is not its iss")) }
        let audiences = claims.aud.value.compactMap { URL(string: $0)?.path }
        guard audiences.contains(where: { $0 == tokenPath || $0 == tokenPath + "/" }) else {
            return .failure(Refusal(description: "the client assertion is meant for another token endpoint (aud)"))
        }
        let expiry = claims.exp.value
        guard expiry.addingTimeInterval(Self.leeway) > now else {
            return .failure(Refusal(description: "the client assertion has expired (exp)"))
        }
        guard expiry <= now.addingTimeInterval(Self.maximumLifetime + Self.leeway) else {
            return .failure(Refusal(description: "the client assertion lives longer than five minutes (exp)"))
        }
        guard let jti = claims.jti, !jti.isEmpty else {
            return .failure(Refusal(description: "the client assertion has no jti"))
        }
        let fresh = seen.withLockedValue { seen in
            seen = seen.filter { $0.value.addingTimeInterval(Self.leeway) > now }
            return seen.updateValue(expiry, forKey: issuer + " " + jti) == nil
        }
        guard fresh else { return .failure(Refusal(description: "the client assertion was used before (jti)")) }
        return .success(issuer)
    }

    static func base64URLDecode(_ text: String) -> Data? {
        var base64 = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        base64 += String(repeating: "=", count: (4 - base64.count % 4) % 4)
        return Data(base64Encoded: base64)
    }
}
