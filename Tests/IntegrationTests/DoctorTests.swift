import Foundation
import Testing

/// `dq doctor` checks what `dq flush` needs (the settings' files, the server, the proxy, the token endpoint) and
/// fails, naming each problem with its remedy, when one is missing; and a proxy that does not answer is named as
/// the dead party wherever a failed send is reported.
@Suite("Doctor and dead proxies", .serialized, .enabled(if: Peers.enabled))
struct DoctorTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    /// The environment of a queue for `server`, with one item queued (the database exists, as after any enqueue).
    func queued(_ server: String) async throws -> [String: String] {
        let env = ["DQ_SERVER": server, "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
        let enqueued = try await dq(["enqueue", try work.write("o.json", resources.observation(0))], env)
        #expect(enqueued.status == 0, "\(enqueued.stderr)")
        return env
    }

    /// A loopback port nothing listens on.
    func closedPort() -> Int {
        let port = Peers.freePort()
        #expect(!Peers.isListening(port: port))
        return port
    }

    /// `dq doctor --json`'s findings, each as `about` and `problem`.
    func findings(_ text: String) throws -> (ok: Bool?, exitCode: Int?, findings: [[String: Any]]) {
        let object = try #require(try JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any], "\(text)")
        return (object["ok"] as? Bool, object["exitCode"] as? Int, object["findings"] as? [[String: Any]] ?? [])
    }

    /// Runs `dq doctor` and `dq doctor --json` with `env`: both exit `status`, and a finding about `about` holds
    /// `naming` in its problem and has a remedy; stderr says the same.
    func expectProblem(
        _ env: [String: String], status: Int32, about: String, naming: String, sourceLocation: SourceLocation = #_sourceLocation
    ) async throws {
        let doctor = try await dq(["doctor"], env)
        #expect(doctor.status == status, "\(doctor.stdout)\(doctor.stderr)", sourceLocation: sourceLocation)
        #expect(doctor.stderr.contains(naming) && doctor.stderr.contains("fix: "), "\(doctor.stderr)", sourceLocation: sourceLocation)
        let json = try await dq(["doctor", "--json"], env)
        #expect(json.status == status, "\(json.stderr)", sourceLocation: sourceLocation)
        let report = try findings(json.stdout)
        #expect(report.ok == false && report.exitCode == Int(status), "\(json.stdout)", sourceLocation: sourceLocation)
        #expect(
            report.findings.contains {
                $0["about"] as? String == about && ($0["problem"] as? String)?.contains(naming) == true
                    && !(($0["remedy"] as? String) ?? "").isEmpty
            }, "\(json.stdout)", sourceLocation: sourceLocation)
    }

    @Test("A healthy configuration against a real server: exit 0, the server answers, --json is ok with no findings")
    func healthy() async throws {
        let server = try await FHIRServer.start()
        let env = try await queued(server.base)
        let doctor = try await dq(["doctor"], env)
        #expect(doctor.status == 0, "\(doctor.stdout)\(doctor.stderr)")
        #expect(doctor.stdout.contains(": ok") && doctor.stdout.contains("server answers (HTTP 200"), "\(doctor.stdout)")
        let json = try await dq(["doctor", "--json"], env)
        let report = try findings(json.stdout)
        #expect(json.status == 0 && report.ok == true && report.exitCode == 0 && report.findings.isEmpty, "\(json.stdout)")
    }

    @Test("A CA bundle that does not exist, or is not PEM: exit 78 naming the file, and the server's route still shown")
    func badCABundle() async throws {
        let server = try await FHIRServer.start()
        var env = try await queued(server.base)
        env["DQ_CA_BUNDLE"] = "/nonexistent"
        try await expectProblem(env, status: 78, about: "configuration", naming: "/nonexistent")
        let shown = try await dq(["doctor"], env)
        #expect(shown.stdout.contains("server: \(server.base) (direct)"), "the route does not vanish: \(shown.stdout)")
        env["DQ_CA_BUNDLE"] = try work.write("not-a-ca.pem", "this is not a certificate\n")
        try await expectProblem(env, status: 78, about: "configuration", naming: work.file("not-a-ca.pem"))
    }

    @Test("A server on a closed port: exit 69 naming the server; --offline checks the settings and the database only")
    func serverDown() async throws {
        let port = closedPort()
        let env = try await queued("http://127.0.0.1:\(port)/fhir")
        try await expectProblem(env, status: 69, about: "server", naming: "no answer from http://127.0.0.1:\(port)")
        let offline = try await dq(["doctor", "--offline"], env)
        #expect(offline.status == 0 && offline.stdout.contains(": ok"), "\(offline.stdout)\(offline.stderr)")
    }

    @Test("A proxy that does not answer: exit 69 naming the proxy (without its password), not the server")
    func proxyDown() async throws {
        let server = try await FHIRServer.start()
        let port = closedPort()
        var env = try await queued(server.base)
        env["HTTP_PROXY"] = "http://ops:pr0xy-s3cret@127.0.0.1:\(port)"
        try await expectProblem(env, status: 69, about: "proxy", naming: "no answer from the proxy http://127.0.0.1:\(port)")
        let doctor = try await dq(["doctor"], env)
        #expect(!doctor.stdout.contains("pr0xy-s3cret") && !doctor.stderr.contains("pr0xy-s3cret"))
        #expect(
            !doctor.stderr.contains("no answer from http://127.0.0.1:\(server.port)"), "the server is not the dead party: \(doctor.stderr)")
    }

    /// A sekmet server whose token endpoint knows client `c1` with `secret`.
    func smartServer(secret: String) async throws -> FHIRServer {
        let server = try FHIRServer(
            auth: """
                  types: [bearer, smart]
                  tokens: [reader-\(UUID().uuidString)]
                  token_lifetime: 300
                  smart_clients:
                    - {client_id: c1, client_secret: "\(secret)", scopes: 'system/*.cruds'}
                """)
        try await server.start()
        return server
    }

    /// The environment of a config file for `server` with `auth`.
    func authConfig(_ server: String, auth: [String: String]) throws -> [String: String] {
        let object: [String: Any] = ["server": server, "database": work.file("queue.sqlite"), "auth": auth]
        let path = work.file("dq-\(UUID().uuidString.prefix(8)).json")
        try JSONSerialization.data(withJSONObject: object).write(to: URL(fileURLWithPath: path))
        chmod(path, 0o600)
        return ["DQ_CONFIG": path, "HOME": work.path]
    }

    @Test("A token endpoint that does not answer: exit 69 naming it; one that refuses the client: 77; one that issues a token: 0")
    func tokenEndpoint() async throws {
        let secret = "s3cret-\(UUID().uuidString.prefix(6))"
        let server = try await smartServer(secret: secret)
        _ = try await queued(server.base)
        let port = closedPort()
        let dead = try authConfig(
            server.base, auth: ["client_id": "c1", "client_secret": secret, "token_uri": "http://127.0.0.1:\(port)/auth/token"])
        try await expectProblem(
            dead, status: 69, about: "token endpoint",
            naming: "the token endpoint http://127.0.0.1:\(port)/auth/token: no answer from http://127.0.0.1:\(port): connection refused")
        let token = "http://127.0.0.1:\(server.port)/auth/token"
        let refused = try authConfig(server.base, auth: ["client_id": "c1", "client_secret": secret + "x", "token_uri": token])
        try await expectProblem(refused, status: 77, about: "token endpoint", naming: "the token endpoint refused the client")
        let good = try authConfig(server.base, auth: ["client_id": "c1", "client_secret": secret, "token_uri": token])
        let doctor = try await dq(["doctor"], good)
        #expect(doctor.status == 0 && doctor.stdout.contains("token endpoint \(token) issued a token"), "\(doctor.stdout)\(doctor.stderr)")
        #expect(!doctor.stdout.contains(secret) && !doctor.stderr.contains(secret))
    }

    @Test("flush, list and status name a proxy that does not answer as the dead party, not the server")
    func deadProxyInMessages() async throws {
        let server = try await FHIRServer.start()
        let port = closedPort()
        var env = try await queued(server.base)
        env["HTTP_PROXY"] = "http://ops:pr0xy-s3cret@127.0.0.1:\(port)"
        let proxyDead = "no answer from the proxy http://127.0.0.1:\(port) (for http://127.0.0.1:\(server.port)): connection refused"
        let serverDead = "no answer from http://127.0.0.1:\(server.port)"
        let flush = try await dq(["flush"], env)
        #expect(flush.status == 75 && flush.stderr.contains(proxyDead) && !flush.stderr.contains(serverDead), "\(flush.stderr)")
        let list = try await dq(["list"], env)
        #expect(list.stdout.contains(proxyDead) && !list.stdout.contains(serverDead), "\(list.stdout)")
        let status = try await dq(["status"], env)
        #expect(status.stdout.contains("last error: \(proxyDead)") && !status.stdout.contains(serverDead), "\(status.stdout)")
        for output in [flush.stderr, list.stdout, status.stdout] { #expect(!output.contains("pr0xy-s3cret")) }
    }
}
