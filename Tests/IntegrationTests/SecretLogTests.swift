import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// No secret in any line dq writes (issue 42): every secret setting is given a marker of its own, and the output
/// of `dq run -v` (text and JSON), `dq flush -v`, `dq doctor -v`, a reload that validates and one that does not,
/// and errors (a server that refuses the token, a proxy that does not answer, a refused database password) is
/// searched for each. Each output must also hold the lines that printed the settings before (swift-service-
/// lifecycle's "Starting service" names each service by its description), so that a run that logs nothing fails.
@Suite("No secret in dq's log lines, errors or descriptions", .serialized, .enabled(if: Peers.enabled))
struct SecretLogTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    /// A marker: a value no output may contain.
    static func marker(_ name: String) -> String {
        "M4RK\(name)" + UUID().uuidString.replacingOccurrences(of: "-", with: "").prefix(16)
    }

    /// The secret settings of one configuration, each with a distinct marker (what dq.json, the files it names
    /// and the environment hold).
    struct Secrets {
        var bearerToken = SecretLogTests.marker("bearer")
        var clientSecret = SecretLogTests.marker("client")
        var proxyPassword = SecretLogTests.marker("proxy")
        var environmentProxyPassword = SecretLogTests.marker("envproxy")
        var registrationHeader = SecretLogTests.marker("header")
        /// The PostgreSQL password (the test server's own: it must open the database), or a marker with SQLite
        /// (then the file is not used, and the settings keep what it holds).
        var databasePassword = SecretLogTests.marker("dbpassword")
        /// The at-rest key: its file's base64 and the key's hex.
        var atRestKey: [String] = []
        /// Tokens a reload rotated in.
        var rotated: [String] = []

        var all: [String] {
            [bearerToken, clientSecret, proxyPassword, environmentProxyPassword, registrationHeader, databasePassword]
                + atRestKey + rotated
        }
    }

    /// What `dq` is run with: the config file, the environment, and the secrets in them.
    struct Setup {
        var config: String
        var environment: [String: String]
        var secrets: Secrets
    }

    /// Writes `dq.json`, its secret files (mode 0600) and the environment for a queue of `server` in `database`
    /// (nil: SQLite).
    func makeSetup(server: String, database: String?, databasePassword: String?) async throws -> Setup {
        var secrets = Secrets()
        if let databasePassword { secrets.databasePassword = databasePassword }
        let credentials = work.file("credentials")
        try FileManager.default.createDirectory(atPath: credentials, withIntermediateDirectories: true)
        func secretFile(_ name: String, _ text: String) throws {
            let path = credentials + "/" + name
            try? FileManager.default.removeItem(atPath: path)
            #expect(FileManager.default.createFile(atPath: path, contents: Data(text.utf8), attributes: [.posixPermissions: 0o600]))
        }
        try secretFile("token", secrets.bearerToken + "\n")
        try secretFile("pgpass", secrets.databasePassword + "\n")
        let keyFile = work.file("at-rest.key")
        if !FileManager.default.fileExists(atPath: keyFile) {
            let made = try await dq(["keygen", "--at-rest", "--out", keyFile], ["HOME": work.path])
            #expect(made.status == 0, "\(made.stderr)")
        }
        let keyText = try String(contentsOfFile: keyFile, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
        let base64 = String(keyText.dropFirst("dq-at-rest-v1:".count))
        let bytes = try #require(Data(base64Encoded: base64))
        secrets.atRestKey = [base64, bytes.map { String(format: "%02x", $0) }.joined()]
        let proxy = "http://dq:\(secrets.proxyPassword)@127.0.0.1:9"
        let object: [String: Any] = [
            "server": server,
            "database": database ?? work.file("queue.sqlite"),
            "database_password_file": "pgpass",
            "proxy": proxy,
            "no_proxy": "127.0.0.1,localhost",
            "auth": [
                "bearer_token_file": "token", "client_id": "dq-client", "client_secret": secrets.clientSecret,
                "registration_headers": ["Antispam": secrets.registrationHeader],
                // Not a secret to dq config (which shows it), so no marker; descriptions show none of its values.
                "registration_fields": ["software_statement": "a-statement"],
            ],
            "at_rest": ["key_file": keyFile],
            "retry": ["initial_seconds": 0.1, "maximum_seconds": 0.3],
        ]
        let config = work.file("dq.json")
        let data = try JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])
        try? FileManager.default.removeItem(atPath: config)
        #expect(FileManager.default.createFile(atPath: config, contents: data, attributes: [.posixPermissions: 0o600]))
        let environment = [
            "HOME": work.path, "CREDENTIALS_DIRECTORY": credentials,
            "HTTPS_PROXY": "http://env:\(secrets.environmentProxyPassword)@127.0.0.1:9",
            "HTTP_PROXY": "http://env:\(secrets.environmentProxyPassword)@127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
        ]
        return Setup(config: config, environment: environment, secrets: secrets)
    }

    /// Records an issue for every marker in `output`, naming the marker's setting and the run.
    func expectNoSecret(_ output: String, _ secrets: Secrets, _ what: String, sourceLocation: SourceLocation = #_sourceLocation) {
        for marker in secrets.all where output.contains(marker) {
            let line = output.split(separator: "\n").first { $0.contains(marker) }.map(String.init) ?? ""
            Issue.record("\(what): a secret was printed: \(line.prefix(600))", sourceLocation: sourceLocation)
        }
    }

    /// `dq run -v` with `extra` arguments until it has logged its services and delivered `count` Observations;
    /// then `during` (reloads), then SIGTERM. Returns everything it wrote.
    func run(
        _ setup: Setup, _ extra: [String] = [], server: FHIRServer, count: Int,
        during: (ChildProcess, () -> String) async throws -> Void = { _, _ in }
    ) async throws -> String {
        let process = try ChildProcess(
            Peers.dqBinary, ["run", "-v", "--config", setup.config, "--poll-interval", "0.1"] + extra, environment: setup.environment)
        let log = { (try? String(contentsOfFile: process.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { log().contains("Starting service lifecycle") }, "\(log())")
        #expect(
            try await eventually { (try await server.values("Observation", system: resources.system)).count == count },
            "\(log())")
        try await during(process, log)
        process.kill(SIGTERM)
        let result = await process.wait(timeout: .seconds(60))
        #expect(result.status == 0, "\(result.stderr)")
        return result.stdout + result.stderr
    }

    /// Queues Observation `index` with `dq enqueue`.
    func enqueue(_ setup: Setup, _ index: Int) async throws {
        let file = try work.write("\(index).json", resources.observation(index))
        let result = try await dq(["enqueue", "--config", setup.config, file], setup.environment)
        #expect(result.status == 0, "\(result.stderr)")
    }

    /// The database URL and password for `storage` (none for SQLite); nil when the PostgreSQL case cannot run here.
    static func database(for storage: String) async throws -> (url: String?, password: String?)? {
        guard storage == "postgres" else { return (nil, nil) }
        guard let (url, secret) = try await postgres() else {
            print("SecretLogTests: no PostgreSQL (DQ_TEST_POSTGRES_URL): the postgres case is skipped")
            return nil
        }
        return (url, secret)
    }

    /// A new database on the test PostgreSQL (without its password), and the password; nil without one.
    static func postgres() async throws -> (url: String, password: String)? {
        guard Peers.environment["DQ_TEST_POSTGRES_URL"] != nil || Peers.required else { return nil }
        let url = try await PostgresTests.freshDatabase()
        return (url, Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "")
    }

    @Test(
        "Every secret setting has a marker: dq run -v (text, JSON), dq flush -v, dq doctor -v, a reload and a refused reload print none",
        arguments: ["sqlite", "postgres"])
    func noSecretInDebugLogs(storage: String) async throws {
        guard let (database, password) = try await Self.database(for: storage) else { return }
        let server = try await FHIRServer.start()
        var setup = try await makeSetup(server: server.base, database: database, databasePassword: password)
        var outputs: [(String, String)] = []

        let first = try work.write("first.ndjson", resources.ndjson(0..<2))
        let enqueued = try await dq(["enqueue", "-v", "--config", setup.config, "--ndjson", first], setup.environment)
        #expect(enqueued.status == 0, "\(enqueued.stderr)")
        outputs.append(("dq enqueue -v", enqueued.stdout + enqueued.stderr))

        // dq run -v: ServiceGroup logs each service by its description, several times.
        let text = try await run(setup, server: server, count: 2)
        #expect(text.contains("Starting service lifecycle") && text.contains("Starting service"), "\(text)")
        #expect(text.contains("DataQueueService"), "the delivery service is named: \(text)")
        outputs.append(("dq run -v", text))

        // The same in JSON.
        try await enqueue(setup, 2)
        let json = try await run(setup, ["--log-format", "json"], server: server, count: 3)
        #expect(json.contains("Starting service lifecycle") && json.contains("{"), "\(json)")
        outputs.append(("dq run -v --log-format json", json))

        // dq flush -v.
        try await enqueue(setup, 3)
        let flush = try await dq(["flush", "-v", "--config", setup.config], setup.environment)
        #expect(flush.status == 0, "\(flush.stderr)")
        #expect(flush.stderr.contains("delivered"), "\(flush.stderr)")
        outputs.append(("dq flush -v", flush.stdout + flush.stderr))

        // dq doctor -v (every route direct: no_proxy names the server's host).
        let doctor = try await dq(["doctor", "-v", "--config", setup.config], setup.environment)
        #expect(doctor.status == 0, "\(doctor.stdout)\(doctor.stderr)")
        #expect(doctor.stdout.contains("direct"), "\(doctor.stdout)")
        outputs.append(("dq doctor -v", doctor.stdout + doctor.stderr))
        let doctorJSON = try await dq(["doctor", "-v", "--json", "--config", setup.config], setup.environment)
        outputs.append(("dq doctor -v --json", doctorJSON.stdout + doctorJSON.stderr))

        // dq config (each secret "(set)").
        let shown = try await dq(["config", "--config", setup.config], setup.environment)
        outputs.append(("dq config", shown.stdout + shown.stderr))

        // A reload that validates (a rotated token: named, never shown), then one that does not (a proxy URL with
        // its password and a port out of range).
        try await enqueue(setup, 4)
        let rotated = Self.marker("rotated")
        setup.secrets.rotated.append(rotated)
        let config = setup.config
        let reloads = try await run(setup, server: server, count: 5) { process, log in
            let token = work.file("credentials") + "/token"
            try Data(rotated.utf8).write(to: URL(fileURLWithPath: token))
            process.kill(SIGHUP)
            #expect(try await eventually { log().contains("configuration reloaded") }, "\(log())")
            #expect(log().contains("changed=auth.bearer_token"), "the rotated secret is named: \(log())")
            // The next round has started (its services logged again).
            #expect(
                try await eventually { log().components(separatedBy: "Starting service lifecycle").count >= 3 }, "\(log())")
            let text = try String(contentsOfFile: config, encoding: .utf8)
            let broken = text.replacingOccurrences(of: "@127.0.0.1:9\"", with: "@127.0.0.1:99999\"")
            #expect(broken != text)
            try Data(broken.utf8).write(to: URL(fileURLWithPath: config))
            process.kill(SIGHUP)
            #expect(try await eventually { log().contains("reload refused") }, "\(log())")
            #expect(process.isRunning)
        }
        #expect(reloads.contains("configuration reloaded") && reloads.contains("reload refused"), "\(reloads)")
        outputs.append(("dq run -v with a reload and a refused reload", reloads))

        for (what, output) in outputs { expectNoSecret(output, setup.secrets, what) }
    }

    @Test(
        "Errors print no secret: a server that refuses the token, a proxy that does not answer, a refused database password",
        arguments: ["sqlite", "postgres"])
    func noSecretInErrors(storage: String) async throws {
        guard let (database, password) = try await Self.database(for: storage) else { return }
        // A server that wants another token: the flush is refused, dq run logs that delivery stopped.
        let server = try await FHIRServer.start(tokens: ["some-other-token"])
        let setup = try await makeSetup(server: server.base, database: database, databasePassword: password)
        var outputs: [(String, String)] = []
        try await enqueue(setup, 0)
        let refused = try await dq(["flush", "-v", "--config", setup.config], setup.environment)
        #expect(refused.status != 0 && !refused.stderr.isEmpty, "\(refused.stderr)")
        outputs.append(("dq flush -v refused", refused.stdout + refused.stderr))

        let process = try ChildProcess(
            Peers.dqBinary, ["run", "-v", "--config", setup.config, "--poll-interval", "0.1"], environment: setup.environment)
        let log = { (try? String(contentsOfFile: process.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { log().contains("delivery stopped") }, "\(log())")
        #expect(log().contains("Starting service lifecycle"), "\(log())")
        process.kill(SIGTERM)
        let run = await process.wait(timeout: .seconds(60))
        outputs.append(("dq run -v refused", run.stdout + run.stderr))

        // The proxy is used (no_proxy gone from the file and the environment): nothing listens there.
        let text = try String(contentsOfFile: setup.config, encoding: .utf8)
        let proxied = try work.write("proxied.json", text.replacingOccurrences(of: "127.0.0.1,localhost", with: "example.invalid"))
        chmod(proxied, 0o600)
        var environment = setup.environment
        environment["NO_PROXY"] = nil
        let unreachable = try await dq(["flush", "-v", "--now", "--config", proxied], environment)
        #expect(unreachable.status != 0 && unreachable.stderr.contains("proxy"), "\(unreachable.stderr)")
        outputs.append(("dq flush -v through a proxy that does not answer", unreachable.stdout + unreachable.stderr))
        let doctor = try await dq(["doctor", "-v", "--config", proxied], environment)
        #expect(doctor.status != 0, "\(doctor.stdout)\(doctor.stderr)")
        outputs.append(("dq doctor -v through a proxy that does not answer", doctor.stdout + doctor.stderr))

        // A database password the server refuses (a marker in database_password_file).
        if database != nil {
            var wrong = setup.secrets
            wrong.databasePassword = Self.marker("wrongdb")
            let pgpass = work.file("credentials") + "/pgpass"
            try Data((wrong.databasePassword + "\n").utf8).write(to: URL(fileURLWithPath: pgpass))
            let denied = try await dq(["flush", "-v", "--config", setup.config], setup.environment)
            #expect(denied.status == 77, "\(denied.stderr)")
            expectNoSecret(denied.stdout + denied.stderr, wrong, "dq flush -v with a refused database password")
        }

        for (what, output) in outputs { expectNoSecret(output, setup.secrets, what) }
    }
}
