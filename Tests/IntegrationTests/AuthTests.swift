import FHIRDataQueue
import Foundation
import Testing

/// OAuth2 client_credentials and SMART Backend Services against sekmet-fhir's own token endpoint.
@Suite("OAuth2 against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct AuthTests {
    let work: TemporaryDirectory
    let resources = Resources()
    /// A secret with the characters that form-urlencoding changes.
    let secret = "s3cr+t/\(UUID().uuidString.prefix(6))=="

    init() throws { work = try TemporaryDirectory() }

    /// A server with smart auth: c1 has a secret, c2 an RS384 key, c3 an ES384 key, c4 an ES256 key, c5 an RS256 key.
    func server(lifetime: Int = 300) async throws -> (FHIRServer, rsa: String, ec: String) {
        let rsa = work.file("rsa.pem")
        let ec = work.file("ec.pem")
        let rsaJWKS = try await dq(["keygen", "--alg", "RS384", "--out", rsa], [:])
        let ecJWKS = try await dq(["keygen", "--alg", "ES384", "--out", ec, "--kid", "ec-1"], [:])
        let es256JWKS = try await dq(["keygen", "--alg", "ES256", "--out", work.file("es256.pem")], [:])
        let rs256JWKS = try await dq(["keygen", "--alg", "rs256", "--out", work.file("rs256.pem")], [:])
        #expect(rsaJWKS.status == 0 && ecJWKS.status == 0 && es256JWKS.status == 0 && rs256JWKS.status == 0)
        #expect(es256JWKS.stdout.contains("\"ES256\"") && es256JWKS.stdout.contains("\"P-256\""))
        #expect(rs256JWKS.stdout.contains("\"RS256\"") && rs256JWKS.stderr.contains("key_alg"))
        #expect(!rsaJWKS.stdout.contains("PRIVATE") && rsaJWKS.stdout.contains("\"RS384\""))
        let mode = try FileManager.default.attributesOfItem(atPath: rsa)[.posixPermissions] as? Int
        #expect(mode == 0o600)
        func flat(_ json: String) -> String { json.replacingOccurrences(of: "\n", with: " ") }
        let readerToken = "reader-\(UUID().uuidString)"
        let auth = """
              types: [bearer, smart]
              tokens: [\(readerToken)]
              token_lifetime: \(lifetime)
              smart_clients:
                - {client_id: c1, client_secret: "\(secret)", scopes: 'system/*.cruds'}
                - {client_id: c2, jwks: \(flat(rsaJWKS.stdout)), scopes: 'system/*.cruds'}
                - {client_id: c3, jwks: \(flat(ecJWKS.stdout)), scopes: 'system/*.cruds'}
                - {client_id: c4, jwks: \(flat(es256JWKS.stdout)), scopes: 'system/*.cruds'}
                - {client_id: c5, jwks: \(flat(rs256JWKS.stdout)), scopes: 'system/*.cruds'}
            """
        let server = try FHIRServer(tokens: nil, auth: auth, readerToken: readerToken)
        try await server.start()
        return (server, rsa, ec)
    }

    func config(_ server: String, auth: [String: String]) throws -> [String: String] {
        let object: [String: Any] = ["server": server, "database": work.file("queue.sqlite"), "auth": auth]
        let path = work.file("dq-\(UUID().uuidString.prefix(8)).json")
        try JSONSerialization.data(withJSONObject: object).write(to: URL(fileURLWithPath: path))
        return ["DQ_CONFIG": path, "HOME": work.path]
    }

    @Test(
        "A flush delivers with client_secret_basic, client_secret_post, and RS384, ES384, ES256 and RS256 assertions")
    func eachAuthMode() async throws {
        let (server, rsa, ec) = try await server()
        let modes: [[String: String]] = [
            ["client_id": "c1", "client_secret": secret],
            ["client_id": "c1", "client_secret": secret, "token_endpoint_auth_method": "client_secret_post"],
            ["client_id": "c2", "private_key": rsa],
            ["client_id": "c3", "private_key": ec, "key_id": "ec-1"],
            ["client_id": "c4", "private_key": work.file("es256.pem")],
            ["client_id": "c5", "private_key": work.file("rs256.pem"), "key_alg": "RS256"],
        ]
        // The RSA key readable by others draws the warning secret files get; the others (0600) do not.
        #expect(chmod(rsa, 0o644) == 0)
        for key in [ec, work.file("es256.pem"), work.file("rs256.pem")] { #expect(chmod(key, 0o600) == 0) }
        for (index, auth) in modes.enumerated() {
            let env = try config(server.base, auth: auth)
            let file = try work.write("o\(index).json", resources.observation(index))
            let sent = try await dq(["send", file], env)
            #expect(sent.status == 0, "\(auth["token_endpoint_auth_method"] ?? auth["client_id"]!): \(sent.stderr)")
            let warned = sent.stderr.contains("the private_key_jwt key \(rsa) is readable by others (mode 644); run: chmod 600")
            #expect(warned == (auth["private_key"] == rsa), "\(auth["client_id"]!): \(sent.stderr)")
            #expect(!sent.stderr.contains("PRIVATE KEY"))
        }
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2", "3", "4", "5"])
    }

    @Test("A flush longer than the token lifetime delivers everything (tokens are renewed)")
    func renewal() async throws {
        let (server, _, ec) = try await server(lifetime: 2)
        let env = try config(server.base, auth: ["client_id": "c3", "private_key": ec, "key_id": "ec-1"])
        let count = 1500  // at least three token lifetimes of one-by-one sends on this machine (500 took 1.8 s)
        let file = try work.write("many.ndjson", resources.ndjson(0..<count))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let started = Date()
        // One request per item, so that the flush outlasts the token (Bundles would deliver it all at once).
        let flushed = try await dq(["flush", "--batch-size", "1"], env)
        let elapsed = Date().timeIntervalSince(started)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(elapsed > 2, "the flush must outlast one token (took \(elapsed) s)")
        #expect(try await server.values("Observation", system: resources.system) == (0..<count).map(String.init))
    }

    @Test("A wrong secret gives exit 77 and loses nothing; the right one then delivers")
    func wrongCredentials() async throws {
        let (server, _, _) = try await server()
        let wrong = try config(server.base, auth: ["client_id": "c1", "client_secret": "wrong"])
        let file = try work.write("two.ndjson", resources.ndjson(0..<2))
        #expect(try await dq(["enqueue", "--ndjson", file], wrong).status == 0)
        let refused = try await dq(["flush"], wrong)
        #expect(refused.status == 77, "\(refused.stderr)")
        #expect(refused.stderr.contains("invalid_client"))
        #expect(refused.stdout.contains("2 pending"))
        // Inside the backoff that follows, refused credentials are still refused credentials (77), not an outage (75).
        let again = try await dq(["flush"], wrong)
        #expect(again.status == 77, "\(again.stderr)")
        #expect(again.stderr.contains("invalid_client") && again.stderr.contains("--now"), "\(again.stderr)")
        let right = try config(server.base, auth: ["client_id": "c1", "client_secret": secret])
        #expect(try await dq(["flush", "--now"], right).status == 0)
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1"])
    }

    @Test(
        "SIGHUP with a rotated client secret (client_secret_file in $CREDENTIALS_DIRECTORY): dq run's next token request uses the new one; nothing is lost"
    )
    func rotatedSecretOnHangup() async throws {
        let (server, _, _) = try await server()
        let credentials = work.file("credentials")
        try FileManager.default.createDirectory(atPath: credentials, withIntermediateDirectories: true)
        let secretFile = credentials + "/client-secret"
        // The authorization server has rotated the secret already; dq still holds the one before.
        let before = "before-\(UUID().uuidString.prefix(8))"
        _ = FileManager.default.createFile(atPath: secretFile, contents: Data((before + "\n").utf8), attributes: [.posixPermissions: 0o600])
        let object: [String: Any] = [
            "server": server.base, "database": work.file("queue.sqlite"),
            "auth": ["client_id": "c1", "client_secret_file": "client-secret"],
            "retry": ["initial_seconds": 0.1, "maximum_seconds": 0.3],
        ]
        let config = work.file("rotating.json")
        try JSONSerialization.data(withJSONObject: object).write(to: URL(fileURLWithPath: config))
        let env = ["DQ_CONFIG": config, "HOME": work.path, "CREDENTIALS_DIRECTORY": credentials, "DQ_LOG_LEVEL": "notice"]
        #expect(try await dq(["enqueue", "--ndjson", try work.write("two.ndjson", resources.ndjson(0..<2))], env).status == 0)
        let run = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.1"], environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { log().contains("invalid_client") }, "the old secret is refused: \(log())")
        #expect(try await server.values("Observation", system: resources.system).isEmpty)

        try Data((secret + "\n").utf8).write(to: URL(fileURLWithPath: secretFile))
        run.kill(SIGHUP)
        #expect(
            try await eventually { (try await server.values("Observation", system: resources.system)) == ["0", "1"] },
            "delivered with the rotated secret, without a restart: \(log())")
        #expect(log().contains("configuration reloaded") && log().contains("changed=auth.client_secret"), "\(log())")
        #expect(run.isRunning, "no restart")
        run.kill(SIGTERM)
        let result = await run.wait(timeout: .seconds(30))
        #expect(result.status == 0, "\(result.stderr)")
        #expect(!result.stderr.contains(secret) && !result.stderr.contains(before), "no secret in any line")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1"], "each once")
    }

    @Test("No secret, assertion or token appears in any output of an authenticated run")
    func noSecretsInOutput() async throws {
        let (server, _, _) = try await server()
        let proxy = try await FaultProxy(upstream: server)
        // The token endpoint through the proxy, which records the tokens it forwards.
        let tokenURI = "http://127.0.0.1:\(proxy.port)/auth/token"
        let env = try config(proxy.base, auth: ["client_id": "c1", "client_secret": secret, "token_uri": tokenURI])
        let file = try work.write("o.ndjson", resources.ndjson(0..<3))
        var outputs: [String] = []
        for arguments in [
            ["enqueue", "-v", "--ndjson", file], ["flush", "-v"], ["status", "--json"], ["log", "--json"],
            ["list", "--json"], ["status", "-v"],
        ] {
            let result = try await dq(arguments, env)
            outputs.append(result.stdout + result.stderr)
        }
        let wrong = try config(proxy.base, auth: ["client_id": "c1", "client_secret": secret + "x", "token_uri": tokenURI])
        _ = try await dq(["enqueue", file], wrong)
        let refused = try await dq(["flush", "-v", "--now"], wrong)
        outputs.append(refused.stdout + refused.stderr)
        let tokens = try #require((try await proxy.stats())["tokens"] as? [String])
        #expect(!tokens.isEmpty, "a token was issued")
        let all = outputs.joined(separator: "\n")
        #expect(all.contains("delivered"), "the run did something")
        #expect(!all.contains(secret))
        #expect(!all.contains(String(secret.prefix(8))))
        for token in tokens { #expect(!all.contains(token)) }
        #expect(!all.contains("eyJ"), "no JWT (token or assertion) in the output")
    }

    @Test("Endpoints are discovered from .well-known/smart-configuration")
    func discovery() async throws {
        let (server, _, ec) = try await server()
        var configuration = OAuth2Configuration(fhirBaseURL: URL(string: server.base)!)
        configuration.clientID = "c3"
        configuration.assertionKey = try OAuth2Configuration.ClientAssertionKey(pemFile: ec, keyID: "ec-1")
        let oauth = try OAuth2ClientCredentials(configuration: configuration)
        let tokens = try await withThrowingTaskGroup(of: String.self) { group in
            for _ in 0..<20 { group.addTask { try await oauth.accessToken() } }
            return try await group.reduce(into: [String]()) { $0.append($1) }
        }
        #expect(Set(tokens).count == 1, "20 concurrent callers share one token")
        #expect(await oauth.tokenRequests == 1, "one token request in flight at a time")
        try await oauth.shutdown()
    }
}
