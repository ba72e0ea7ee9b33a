import Foundation
import JWTKit

/// The claims of an OpenID Connect ID token that dq checks and keeps.
struct IDTokenClaims: JWTPayload {
    var iss: String
    var sub: String?
    var aud: AudienceClaim
    var exp: ExpirationClaim
    var iat: IssuedAtClaim
    var nonce: String?
    var azp: String?
    var fhirUser: String?

    /// The checks are made by ``IDTokenVerifier`` one by one, each with its own message.
    func verify(using algorithm: some JWTAlgorithm) async throws {}
}

/// Checks an ID token as OpenID Connect Core 3.1.3.7 asks, before anything is stored: the signature
/// against the issuer's JWKS (RS256/384/512, PS256/384/512, ES256/384; the keys fetched from `jwks_uri`
/// once per process and fetched again once when a token names an unknown key), then `iss`, `aud` (and
/// `azp` when there are several audiences), `exp`, `iat` and `nonce`. Signatures are checked by jwt-kit.
///
/// Every refusal is a ``DataQueueError`` with code ``DataQueueError/Code/authentication`` that names the
/// failed check and never the token.
actor IDTokenVerifier {
    static let algorithms: Set<String> = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384"]
    /// Clock skew allowed on `exp` and `iat`, in seconds.
    static let leeway: TimeInterval = 120

    private let jwksURL: URL
    private let fetch: @Sendable (URL) async throws -> Data
    private var keys: (collection: JWTKeyCollection, kids: Set<String>)?

    init(jwksURL: URL, fetch: @escaping @Sendable (URL) async throws -> Data) {
        self.jwksURL = jwksURL
        self.fetch = fetch
    }

    /// The verified claims.
    func verify(
        _ token: String, issuer: String, clientID: String, nonce: String?, now: Date = Date()
    ) async throws -> IDTokenClaims {
        let header = try Self.header(of: token)
        guard let alg = header["alg"] as? String, Self.algorithms.contains(alg) else {
            throw Self.refused(
                "is signed with \((header["alg"] as? String).map { "\"\($0.prefix(16))\"" } ?? "no algorithm"), which dq does not accept")
        }
        let kid = header["kid"] as? String
        var collection = try await keySet(refresh: false)
        if let kid, !collection.kids.contains(kid) {
            collection = try await keySet(refresh: true)  // the issuer may have rotated its keys
            guard collection.kids.contains(kid) else { throw Self.refused("names a key the issuer's JWKS does not hold") }
        }
        let claims: IDTokenClaims
        do {
            // A token without kid is tried with each of the issuer's keys (one of them signed it, or none).
            claims = try await collection.collection.verify(token, as: IDTokenClaims.self, iteratingKeys: kid == nil)
        } catch let error as JWTError where error.errorType == .signatureVerificationFailed {
            throw Self.refused("has a signature that does not verify with the issuer's key")
        } catch {
            throw Self.refused("cannot be verified (\(Self.describe(error)))")
        }
        guard claims.iss == issuer else { throw Self.refused("was issued by another issuer (iss)") }
        guard claims.aud.value.contains(clientID) else { throw Self.refused("is meant for another client (aud)") }
        if claims.aud.value.count > 1, claims.azp != clientID {
            throw Self.refused("has several audiences and another authorized party (azp)")
        }
        guard claims.exp.value.addingTimeInterval(Self.leeway) > now else { throw Self.refused("has expired (exp)") }
        guard claims.iat.value.addingTimeInterval(-Self.leeway) <= now else { throw Self.refused("was issued in the future (iat)") }
        if let nonce, claims.nonce != nonce { throw Self.refused("does not carry the nonce dq sent (nonce)") }
        return claims
    }

    private func keySet(refresh: Bool) async throws -> (collection: JWTKeyCollection, kids: Set<String>) {
        if !refresh, let keys { return keys }
        let data = try await fetch(jwksURL)
        guard let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
            let list = object["keys"] as? [[String: Any]]
        else {
            // An error page where the key set should be (a proxy in trouble): passing, not a refused token.
            throw DataQueueError(.transport, "the ID token cannot be checked yet: the issuer's JWKS answer is not a key set")
        }
        let collection = JWTKeyCollection()
        var kids = Set<String>()
        for (index, var entry) in list.enumerated() where (entry["use"] as? String ?? "sig") == "sig" {
            // A key without kid (legal in a one-key set) gets a name of its own.
            let kid = entry["kid"] as? String ?? "dq-unnamed-key-\(index)"
            entry["kid"] = kid
            guard let json = try? JSONSerialization.data(withJSONObject: entry),
                let jwk = try? JSONDecoder().decode(JWK.self, from: json),
                (try? await collection.add(jwk: jwk)) != nil
            else { continue }  // a key of a type jwt-kit does not know is skipped
            kids.insert(kid)
        }
        guard !kids.isEmpty else { throw Self.refused("cannot be checked: the issuer's JWKS holds no usable signing key") }
        keys = (collection, kids)
        return (collection, kids)
    }

    static func header(of token: String) throws -> [String: Any] {
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let data = base64URLDecode(String(parts[0])),
            let header = try? JSONSerialization.jsonObject(with: data) as? [String: Any]
        else { throw refused("is not a signed JWT") }
        return header
    }

    static func base64URLDecode(_ text: String) -> Data? {
        var base64 = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        base64 += String(repeating: "=", count: (4 - base64.count % 4) % 4)
        return Data(base64Encoded: base64)
    }

    static func refused(_ reason: String) -> DataQueueError {
        DataQueueError(.authentication, "the ID token \(reason); nothing was stored")
    }

    static func describe(_ error: any Error) -> String {
        if let error = error as? JWTError { return "\(error.errorType)" }
        return String(describing: type(of: error))
    }
}
