import Foundation
import Testing

/// RFC 7591 dynamic registration against Canaille, a real OAuth2 server.
@Suite("Dynamic client registration against Canaille", .serialized, .enabled(if: Peers.enabled))
struct RegistrationTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    func storedCredentials() throws -> [String: Any] {
        let directory = work.file("creds")
        let files = try FileManager.default.contentsOfDirectory(atPath: directory)
        try #require(files.count == 1, "one credential file: \(files)")
        let path = directory + "/" + files[0]
        let mode = try FileManager.default.attributesOfItem(atPath: path)[.posixPermissions] as? Int
        #expect(mode == 0o600)
        let data = try Data(contentsOf: URL(fileURLWithPath: path))
        return try #require(JSONSerialization.jsonObject(with: data) as? [String: Any])
    }

    @Test("dq registers itself, stores the credentials 0600, gets a token Canaille's introspection accepts, and reuses them")
    func registerAndReuse() async throws {
        let canaille = try await CanailleServer()
        let proxy = try await FaultProxy(upstreamPort: canaille.port)
        let fhir = try await FHIRServer.start()
        let auth: [String: Any] = [
            "authorize_type": "client_credentials",
            "registration_uri": "http://127.0.0.1:\(proxy.port)/oauth/register",
            "token_uri": "http://127.0.0.1:\(proxy.port)/oauth/token",
            "client_name": "dq integration test", "scope": "openid",
            "registration_fields": ["sandbox": true, "receipt-data": "NO-APP-RECEIPT"],
            "registration_headers": ["Antispam": "test-shared-secret"],
            "credentials_dir": work.file("creds"),
        ]
        let config = work.file("dq.json")
        try JSONSerialization.data(withJSONObject: ["server": fhir.base, "database": work.file("q.sqlite"), "auth": auth])
            .write(to: URL(fileURLWithPath: config))
        let env = ["DQ_CONFIG": config, "HOME": work.path]

        let first = try await dq(["send", try work.write("a.json", resources.observation(0))], env)
        #expect(first.status == 0, "\(first.stderr)")
        let credentials = try storedCredentials()
        let clientID = try #require(credentials["client_id"] as? String)
        let secret = try #require(credentials["client_secret"] as? String)
        #expect(!(first.stdout + first.stderr).contains(secret))

        let stats = try await proxy.stats()
        let registrations = try #require(stats["registrations"] as? [[String: Any]])
        #expect(registrations.count == 1)
        let body = try #require(registrations.first?["body"] as? String)
        let sent = try #require(JSONSerialization.jsonObject(with: Data(body.utf8)) as? [String: Any])
        #expect(sent["client_name"] as? String == "dq integration test")
        #expect(sent["grant_types"] as? [String] == ["client_credentials"])
        #expect(sent["token_endpoint_auth_method"] as? String == "client_secret_basic")
        #expect(sent["sandbox"] as? Bool == true && sent["receipt-data"] as? String == "NO-APP-RECEIPT")
        let headers = registrations.first?["headers"] as? [String: String] ?? [:]
        #expect(headers.first { $0.key.lowercased() == "antispam" }?.value == "test-shared-secret")

        let tokens = try #require(stats["tokens"] as? [String])
        let token = try #require(tokens.last)
        let introspection = try await canaille.introspect(token, clientID: clientID, secret: secret)
        #expect(introspection["active"] as? Bool == true)
        #expect(introspection["client_id"] as? String == clientID)

        // A second run reuses the stored credentials: no new registration.
        let second = try await dq(["send", try work.write("b.json", resources.observation(1))], env)
        #expect(second.status == 0, "\(second.stderr)")
        #expect(((try await proxy.stats())["registrations"] as? [Any])?.count == 1)
        #expect(try storedCredentials()["client_id"] as? String == clientID)

        // dq register replaces them.
        let again = try await dq(["register"], env)
        #expect(again.status == 0, "\(again.stderr)")
        #expect(!again.stdout.contains(secret))
        let replaced = try storedCredentials()
        #expect(replaced["client_id"] as? String != clientID)
        #expect(try await fhir.values("Observation", system: resources.system) == ["0", "1"])
    }
}
