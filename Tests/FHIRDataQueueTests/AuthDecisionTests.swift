import Crypto
import Foundation
import Testing
import _CryptoExtras

@testable import FHIRDataQueue

@Suite("OAuth2 decisions")
struct AuthDecisionTests {
    let smart: [String: Any] = ["token_endpoint": "https://a/token", "registration_endpoint": "https://a/register"]
    let capability: [String: Any] = [
        "resourceType": "CapabilityStatement",
        "rest": [
            [
                "security": [
                    "extension": [
                        [
                            "url": "http://fhir-registry.smarthealthit.org/StructureDefinition/oauth-uris",
                            "extension": [
                                ["url": "token", "valueUri": "https://b/token"], ["url": "register", "valueUri": "https://b/register"],
                                ["url": "authorize", "valueUri": "https://b/authorize"],
                            ],
                        ]
                    ]
                ]
            ]
        ],
    ]

    @Test("Discovery prefers smart-configuration, then the CapabilityStatement's oauth-uris")
    func discoveryOrder() {
        let both = OAuth2ClientCredentials.endpoints(smartConfiguration: smart, capabilityStatement: capability)
        #expect(both.token?.absoluteString == "https://a/token" && both.registration?.absoluteString == "https://a/register")
        let onlyCapability = OAuth2ClientCredentials.endpoints(smartConfiguration: nil, capabilityStatement: capability)
        #expect(onlyCapability.token?.absoluteString == "https://b/token")
        #expect(onlyCapability.registration?.absoluteString == "https://b/register")
        let emptySmart = OAuth2ClientCredentials.endpoints(smartConfiguration: ["issuer": "x"], capabilityStatement: capability)
        #expect(emptySmart.token?.absoluteString == "https://b/token")
        let none = OAuth2ClientCredentials.endpoints(smartConfiguration: nil, capabilityStatement: ["resourceType": "CapabilityStatement"])
        #expect(none.token == nil)
    }

    @Test("Token responses: 200 and 202, expires_in as number or string, errors classified")
    func tokenResponses() throws {
        let ok = try OAuth2ClientCredentials.parseTokenResponse(
            status: 202, body: Data(#"{"access_token":"t","token_type":"bearer","expires_in":"1800"}"#.utf8))
        #expect(ok.token == "t" && ok.expiresIn == 1800)
        let number = try OAuth2ClientCredentials.parseTokenResponse(status: 200, body: Data(#"{"access_token":"u","expires_in":60}"#.utf8))
        #expect(number.expiresIn == 60)
        #expect {
            try OAuth2ClientCredentials.parseTokenResponse(status: 401, body: Data(#"{"error":"invalid_client"}"#.utf8))
        } throws: { ($0 as? DataQueueError)?.code == .authentication }
        #expect {
            try OAuth2ClientCredentials.parseTokenResponse(status: 503, body: Data())
        } throws: { ($0 as? DataQueueError)?.code == .transport }
    }

    @Test("Basic credentials are form-urlencoded first (RFC 6749 §2.3.1)")
    func basicEncoding() {
        let header = OAuth2HTTP.basic("id 1", "a+b/c=", encoded: true)
        let decoded = String(decoding: Data(base64Encoded: String(header.dropFirst(6)))!, as: UTF8.self)
        #expect(decoded == "id+1:a%2Bb%2Fc%3D")
    }

    @Test("A registration answer with a trailing comma is read (the C3-PRO server sends one)")
    func lenientRegistration() throws {
        let body = Data("{\"client_id\": \"abc\", \"client_secret\": \"x\",\n \"grant_types\": [\"client_credentials\",],\n}".utf8)
        let object = try JSONSerialization.jsonObject(with: OAuth2HTTP.lenientJSON(body)) as? [String: Any]
        #expect(object?["client_id"] as? String == "abc")
    }

    @Test("Stored credentials are 0600, replaced atomically, one file per registration endpoint")
    func credentialStore() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-cred-\(UUID().uuidString.prefix(8))").path
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let store = OAuth2Configuration.CredentialStore(directory: directory)
        let first = StoredCredentials(
            registrationURI: "https://r/register", clientID: "a", clientSecret: "s", tokenEndpointAuthMethod: nil,
            clientSecretExpiresAt: nil, registeredAt: Date(timeIntervalSince1970: 1))
        try store.save(first)
        var second = first
        second.clientID = "b"
        try store.save(second)
        #expect(try store.load(registrationURI: "https://r/register")?.clientID == "b")
        #expect(try store.load(registrationURI: "https://other/register") == nil)
        let mode = try FileManager.default.attributesOfItem(atPath: store.path(for: "https://r/register"))[.posixPermissions] as? Int
        #expect(mode == 0o600)
        #expect(try FileManager.default.contentsOfDirectory(atPath: directory).count == 1, "no temporary files left")
    }

    @Test(
        "Client assertions carry iss = sub = client_id, the exact token URL, exp within 5 minutes and a fresh jti",
        arguments: OAuth2Configuration.ClientAssertionKey.Algorithm.allCases)
    func assertions(algorithm: OAuth2Configuration.ClientAssertionKey.Algorithm) async throws {
        let (key, _) = try OAuth2Configuration.ClientAssertionKey.generate(algorithm, keyID: "k1")
        let now = Date()
        let first = try await key.assertion(clientID: "c", tokenURL: "http://127.0.0.1:1/auth/token", now: now)
        let second = try await key.assertion(clientID: "c", tokenURL: "http://127.0.0.1:1/auth/token", now: now)
        func part(_ jwt: String, _ index: Int) throws -> [String: Any] {
            var text = String(jwt.split(separator: ".")[index]).replacingOccurrences(of: "-", with: "+")
                .replacingOccurrences(of: "_", with: "/")
            while text.count % 4 != 0 { text += "=" }
            let data = try #require(Data(base64Encoded: text))
            return try #require(JSONSerialization.jsonObject(with: data) as? [String: Any])
        }
        let header = try part(first, 0)
        let claims = try part(first, 1)
        #expect(header["alg"] as? String == algorithm.rawValue && header["kid"] as? String == "k1" && header["typ"] as? String == "JWT")
        #expect(claims["iss"] as? String == "c" && claims["sub"] as? String == "c")
        #expect(claims["aud"] as? String == "http://127.0.0.1:1/auth/token")
        let exp = try #require(claims["exp"] as? Int)
        #expect(exp > Int(now.timeIntervalSince1970) && exp <= Int(now.timeIntervalSince1970) + 300)
        #expect(try part(second, 1)["jti"] as? String != claims["jti"] as? String)
        let signature = first.split(separator: ".")[2]
        let lengths: [OAuth2Configuration.ClientAssertionKey.Algorithm: Int] = [.es256: 86, .es384: 128, .rs256: 342, .rs384: 342]
        #expect(signature.count == lengths[algorithm], "raw r||s for ES256/ES384, 256 bytes for RSA")
        #expect(key.algorithm == algorithm && key.publicJWK["alg"] == algorithm.rawValue)
    }

    @Test("An RSA key signs RS384 unless RS256 is asked for; an EC key's curve decides, and a mismatch is named")
    func assertionAlgorithms() async throws {
        let (_, rsaPEM) = try OAuth2Configuration.ClientAssertionKey.generate(.rs256)
        #expect(try OAuth2Configuration.ClientAssertionKey(pem: rsaPEM).algorithm == .rs384)
        #expect(try OAuth2Configuration.ClientAssertionKey(pem: rsaPEM, algorithm: .rs256).algorithm == .rs256)
        let (_, p256PEM) = try OAuth2Configuration.ClientAssertionKey.generate(.es256)
        #expect(try OAuth2Configuration.ClientAssertionKey(pem: p256PEM).algorithm == .es256)
        #expect(try OAuth2Configuration.ClientAssertionKey(pem: p256PEM).publicJWK["crv"] == "P-256")
        let mismatch = try #require(throws: DataQueueError.self) {
            try OAuth2Configuration.ClientAssertionKey(pem: p256PEM, algorithm: .es384, source: "k.pem")
        }
        #expect(mismatch.message.contains("ES384") && mismatch.message.contains("k.pem is a key for ES256"))
        #expect(throws: DataQueueError.self) { try OAuth2Configuration.ClientAssertionKey(pem: rsaPEM, algorithm: .es256) }

        // The hash is the one the header names: an RS256 signature verifies over SHA-256, not SHA-384.
        let rsa = try _RSA.Signing.PrivateKey(pemRepresentation: rsaPEM)
        let jwt = try await OAuth2Configuration.ClientAssertionKey(pem: rsaPEM, algorithm: .rs256).assertion(
            clientID: "c", tokenURL: "http://t")
        let parts = jwt.split(separator: ".")
        let input = Data((parts[0] + "." + parts[1]).utf8)
        var text = String(parts[2]).replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while text.count % 4 != 0 { text += "=" }
        let signature = _RSA.Signing.RSASignature(rawRepresentation: try #require(Data(base64Encoded: text)))
        #expect(rsa.publicKey.isValidSignature(signature, for: SHA256.hash(data: input), padding: .insecurePKCS1v1_5))
        #expect(!rsa.publicKey.isValidSignature(signature, for: SHA384.hash(data: input), padding: .insecurePKCS1v1_5))
        // ES256 over P-256 with SHA-256 (swift-crypto hashes inside).
        let p256 = try P256.Signing.PrivateKey(pemRepresentation: p256PEM)
        let es = try await OAuth2Configuration.ClientAssertionKey(pem: p256PEM).assertion(clientID: "c", tokenURL: "http://t").split(
            separator: ".")
        var esText = String(es[2]).replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while esText.count % 4 != 0 { esText += "=" }
        let esSignature = try P256.Signing.ECDSASignature(rawRepresentation: try #require(Data(base64Encoded: esText)))
        #expect(p256.publicKey.isValidSignature(esSignature, for: Data((es[0] + "." + es[1]).utf8)))
    }
}
