import Crypto
import Foundation
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// The decisions of a person's sign-in: PKCE, the authorization URL, and each ID-token check. Tokens are
/// signed here with swift-crypto directly (ES256, r||s), independently of jwt-kit, which dq verifies with.
@Suite("Sign-in decisions")
struct SignInDecisionTests {
    static let issuer = "https://id.example.org"
    let key = P256.Signing.PrivateKey()
    let fetches = Counter()

    final class Counter: Sendable {
        let value = NIOLockedValueBox(0)
        func add() { value.withLockedValue { $0 += 1 } }
        var count: Int { value.withLockedValue { $0 } }
    }

    func jwks(kid: String? = "k1") -> Data {
        let raw = key.publicKey.rawRepresentation  // x || y
        var jwk: [String: Any] = [
            "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256",
            "x": AuthorizationCodeClient.base64URL(raw.prefix(32)), "y": AuthorizationCodeClient.base64URL(raw.suffix(32)),
        ]
        jwk["kid"] = kid
        return try! JSONSerialization.data(withJSONObject: ["keys": [jwk]])
    }

    func verifier(kid: String? = "k1") -> IDTokenVerifier {
        let set = jwks(kid: kid)
        let fetches = self.fetches
        return IDTokenVerifier(jwksURL: URL(string: Self.issuer + "/jwks")!) { _ in
            fetches.add()
            return set
        }
    }

    func token(
        _ claims: [String: Any], header: [String: Any] = ["alg": "ES256", "kid": "k1", "typ": "JWT"],
        with signer: P256.Signing.PrivateKey? = nil
    )
        throws -> String
    {
        let head = AuthorizationCodeClient.base64URL(try JSONSerialization.data(withJSONObject: header))
        let body = AuthorizationCodeClient.base64URL(try JSONSerialization.data(withJSONObject: claims))
        let signature = try (signer ?? key).signature(for: Data((head + "." + body).utf8)).rawRepresentation
        return head + "." + body + "." + AuthorizationCodeClient.base64URL(signature)
    }

    func claims(_ changes: [String: Any] = [:]) -> [String: Any] {
        let now = Int(Date().timeIntervalSince1970)
        var claims: [String: Any] = [
            "iss": Self.issuer, "sub": "alice", "aud": ["app"], "iat": now, "exp": now + 300, "nonce": "n-1",
            "fhirUser": "Practitioner/7",
        ]
        for (name, value) in changes { claims[name] = value is NSNull ? nil : value }
        return claims
    }

    @Test("RFC 7636 appendix B: the S256 challenge of the example verifier")
    func pkce() {
        #expect(
            AuthorizationCodeClient.codeChallenge(for: "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk")
                == "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM")
        let verifier = AuthorizationCodeClient.randomToken(32)
        #expect(verifier.count == 43 && verifier.allSatisfy { $0.isLetter || $0.isNumber || $0 == "-" || $0 == "_" })
        #expect(AuthorizationCodeClient.randomToken(32) != verifier)
    }

    @Test("the authorization URL carries PKCE S256, state, nonce, aud and the loopback redirect; no verifier")
    func authorizationURL() async throws {
        var configuration = AuthorizationCodeClient.Configuration(fhirBaseURL: URL(string: "https://fhir.example.org/r4")!, clientID: "app")
        configuration.authorizationURL = URL(string: "https://id.example.org/authorize?tenant=t1")
        configuration.tokenURL = URL(string: "https://id.example.org/token")
        configuration.issuer = Self.issuer
        configuration.scope = "launch/patient patient/*.cruds offline_access"  // no openid: no discovery needed
        let client = AuthorizationCodeClient(configuration: configuration)
        let pending = try await client.prepareSignIn(redirectURI: "http://127.0.0.1:5123/callback")
        try await client.shutdown()
        let items = try #require(URLComponents(url: pending.authorizationURL, resolvingAgainstBaseURL: false)?.queryItems)
        func value(_ name: String) -> String? { items.first { $0.name == name }?.value }
        #expect(value("tenant") == "t1")
        #expect(value("response_type") == "code" && value("client_id") == "app")
        #expect(value("redirect_uri") == "http://127.0.0.1:5123/callback")
        #expect(value("aud") == "https://fhir.example.org/r4")
        #expect(value("scope") == "launch/patient patient/*.cruds offline_access")
        #expect(value("code_challenge_method") == "S256")
        #expect(value("code_challenge") == AuthorizationCodeClient.codeChallenge(for: pending.codeVerifier))
        #expect(value("state") == pending.state && pending.state.count >= 22)
        #expect(value("nonce") == nil, "no openid, no nonce")
        #expect(!pending.authorizationURL.absoluteString.contains(pending.codeVerifier))
    }

    @Test("a sound ID token passes; its claims are read")
    func sound() async throws {
        let verified = try await verifier().verify(try token(claims()), issuer: Self.issuer, clientID: "app", nonce: "n-1")
        #expect(verified.sub == "alice" && verified.fhirUser == "Practitioner/7")
        // Within the clock-skew allowance.
        let now = Int(Date().timeIntervalSince1970)
        _ = try await verifier().verify(
            try token(claims(["exp": now - 60, "iat": now + 60])), issuer: Self.issuer, clientID: "app", nonce: "n-1")
    }

    @Test(
        "each check refuses with its own reason and never shows the token",
        arguments: [
            ("iss", "another issuer (iss)"), ("aud", "another client (aud)"), ("azp", "authorized party (azp)"),
            ("exp", "has expired (exp)"), ("iat", "issued in the future (iat)"), ("nonce", "nonce dq sent"),
            ("no-nonce", "nonce dq sent"), ("signature", "does not verify"), ("other-key", "does not verify"),
            ("none", "\"none\""), ("hs256", "\"HS256\""), ("unknown-kid", "names a key"), ("garbage", "not a signed JWT"),
        ])
    func refusals(_ check: String, _ reason: String) async throws {
        let now = Int(Date().timeIntervalSince1970)
        var header: [String: Any] = ["alg": "ES256", "kid": "k1"]
        var signer: P256.Signing.PrivateKey?
        var changes: [String: Any] = [:]
        switch check {
        case "iss": changes["iss"] = "https://evil.example.org"
        case "aud": changes["aud"] = "other-app"
        case "azp": changes = ["aud": ["app", "other"], "azp": "other"]
        case "exp": changes["exp"] = now - 600
        case "iat": changes["iat"] = now + 600
        case "nonce": changes["nonce"] = "n-2"
        case "no-nonce": changes["nonce"] = NSNull()
        case "other-key": signer = P256.Signing.PrivateKey()
        case "none": header["alg"] = "none"
        case "hs256": header["alg"] = "HS256"
        case "unknown-kid": header["kid"] = "k9"
        default: break
        }
        var jwt = try token(claims(changes), header: header, with: signer)
        if check == "signature" {
            var parts = jwt.split(separator: ".").map(String.init)
            parts[1] = AuthorizationCodeClient.base64URL(try JSONSerialization.data(withJSONObject: claims(["sub": "mallory"])))
            jwt = parts.joined(separator: ".")
        }
        if check == "garbage" { jwt = "not.a-token" }
        let tokenText = jwt
        let error = try await #require(throws: DataQueueError.self) {
            _ = try await verifier().verify(tokenText, issuer: Self.issuer, clientID: "app", nonce: "n-1")
        }
        #expect(error.code == .authentication)
        #expect(error.message.contains(reason), "\(check): \(error.message)")
        #expect(error.message.hasSuffix("nothing was stored"))
        #expect(!error.message.contains(tokenText))
        if check == "unknown-kid" {
            #expect(fetches.count == 2, "an unknown kid fetches the JWKS once more (key rotation)")
        }
    }

    @Test("the JWKS is fetched once for many ID tokens (cached)")
    func jwksCached() async throws {
        let verifier = verifier()
        for _ in 0..<3 {
            _ = try await verifier.verify(try token(claims()), issuer: Self.issuer, clientID: "app", nonce: "n-1")
        }
        #expect(fetches.count == 1, "three verifications, one fetch")
    }

    @Test("JWKS keys without kid verify a token whose header names no kid; a token signed by another key is refused")
    func keyWithoutKid() async throws {
        let verifier = verifier(kid: nil)
        let verified = try await verifier.verify(
            try token(claims(), header: ["alg": "ES256", "typ": "JWT"]), issuer: Self.issuer, clientID: "app", nonce: "n-1")
        #expect(verified.sub == "alice")
        // Two keys without kid, the signer's second: each key is tried.
        let other = P256.Signing.PrivateKey().publicKey.rawRepresentation
        var set = try #require(try JSONSerialization.jsonObject(with: jwks(kid: nil)) as? [String: [[String: Any]]])
        set["keys"]!.insert(
            [
                "kty": "EC", "crv": "P-256", "use": "sig", "x": AuthorizationCodeClient.base64URL(other.prefix(32)),
                "y": AuthorizationCodeClient.base64URL(other.suffix(32)),
            ], at: 0)
        let two = try JSONSerialization.data(withJSONObject: set)
        let twoKeys = IDTokenVerifier(jwksURL: URL(string: Self.issuer + "/jwks")!) { _ in two }
        let second = try await twoKeys.verify(
            try token(claims(), header: ["alg": "ES256", "typ": "JWT"]), issuer: Self.issuer, clientID: "app", nonce: "n-1")
        #expect(second.sub == "alice")
        let forged = try token(claims(), header: ["alg": "ES256", "typ": "JWT"], with: P256.Signing.PrivateKey())
        await #expect(throws: DataQueueError.self) {
            _ = try await verifier.verify(forged, issuer: Self.issuer, clientID: "app", nonce: "n-1")
        }
    }

    @Test(
        "endpoint discovery: the SMART configuration first, then the OpenID configuration, then the CapabilityStatement",
        arguments: ["smart", "openid", "metadata"])
    func discoveryOrder(source: String) async throws {
        let server = try await ScriptedServer { request in
            let base = "http://127.0.0.1:\(request.header("Host")?.split(separator: ":").last ?? "")"
            func document(_ prefix: String) -> ScriptedServer.Action {
                let object: [String: Any] = [
                    "issuer": base, "jwks_uri": base + "/jwks", "authorization_endpoint": base + "/\(prefix)-authorize",
                    "token_endpoint": base + "/\(prefix)-token",
                ]
                return .respond(.init(status: 200, data: try! JSONSerialization.data(withJSONObject: object)))
            }
            switch (request.path, source) {
            case ("/fhir/.well-known/smart-configuration", "smart"): return document("smart")
            case ("/fhir/.well-known/openid-configuration", "openid"): return document("openid")
            case ("/fhir/metadata", _):
                let oauth: [String: Any] = [
                    "url": "http://fhir-registry.smarthealthit.org/StructureDefinition/oauth-uris",
                    "extension": [
                        ["url": "authorize", "valueUri": base + "/metadata-authorize"],
                        ["url": "token", "valueUri": base + "/metadata-token"],
                    ],
                ]
                let capability: [String: Any] = ["resourceType": "CapabilityStatement", "rest": [["security": ["extension": [oauth]]]]]
                return .respond(.init(status: 200, data: try! JSONSerialization.data(withJSONObject: capability)))
            default: return .respond(.init(status: 404))
            }
        }
        var configuration = AuthorizationCodeClient.Configuration(fhirBaseURL: URL(string: server.baseURL + "/fhir")!, clientID: "app")
        configuration.scope = "launch/patient offline_access patient/*.cruds"
        configuration.credentialsDirectory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-disc-\(UUID())").path
        let client = AuthorizationCodeClient(configuration: configuration)
        let pending = try await client.prepareSignIn(redirectURI: "http://127.0.0.1:1/callback")
        #expect(pending.authorizationURL.path == "/\(source)-authorize", "\(pending.authorizationURL)")
        let asked = server.requests.map(\.path)
        let expected = [
            "/fhir/.well-known/smart-configuration", "/fhir/.well-known/openid-configuration", "/fhir/metadata",
        ]
        let count = ["smart": 1, "openid": 2, "metadata": 3][source]!
        #expect(asked.count == count && asked == Array(expected.prefix(count)), "\(asked)")
        try await client.shutdown()
        try await server.shutdown()
    }
}
