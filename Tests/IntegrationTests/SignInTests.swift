import Foundation
import Testing

/// `dq login` / `dq logout` against Canaille, a real OpenID Connect provider, behind a SMART front
/// (scripts/smart_gate.py) whose FHIR API accepts only Canaille's access tokens and forwards to sekmet-fhir.
/// The test plays the person with an HTTP client (scripts/sign_in.py) through Canaille's login, password
/// and consent forms.
@Suite("Sign in as a person (dq login) against Canaille", .serialized, .enabled(if: Peers.enabled))
struct SignInTests {
    let work: TemporaryDirectory
    let resources = Resources()
    static let person = ("alice", "correct-horse-battery")
    static let confidential = ("dq-conf", "conf-secret-8d1f2c")
    static let postClient = ("dq-post", "post-secret-5be91a")

    init() throws { work = try TemporaryDirectory() }

    struct Setup {
        let canaille: CanailleServer
        let fhir: FHIRServer
        let gate: SMARTGate
        var env: [String: String]
        let clientID: String
    }

    /// How the test answers the sign-in.
    enum Answer {
        /// Follow the redirect to dq's listener, as a browser does.
        case follow
        /// Stop at the redirect and paste it into `dq login --no-browser`, changed by the closure.
        case paste((String) -> String = { $0 })
        /// Do not sign in; paste what the closure makes of the authorization URL's parameters.
        case forge(([String: String]) -> String)
    }

    /// - Parameters:
    ///   - confidential: sign in as the client_secret_basic client.
    ///   - clientID: sign in as this client instead, with `auth` added to the auth object (`auth` may name
    ///     Canaille's own endpoints with the placeholder `CANAILLE`).
    ///   - keyClients: private_key_jwt clients to create in Canaille (id and public JWKS).
    ///   - gateHost: the name dq is given for the gate (its server, token endpoint and JWKS).
    func setUp(
        tokenLifetime: Int = 3600, refreshLifetime: Int? = nil, confidential: Bool = false, clientID other: String? = nil,
        auth extra: [String: String] = [:], keyClients: [String: String] = [:], gateHost: String = "127.0.0.1"
    ) async throws -> Setup {
        let canaille = try await CanailleServer(
            users: ["\(Self.person.0):\(Self.person.1)"],
            clients: [
                "dq-cli", "\(Self.confidential.0):\(Self.confidential.1)", "\(Self.postClient.0):\(Self.postClient.1):client_secret_post",
            ],
            keyClients: keyClients, tokenLifetime: tokenLifetime, refreshLifetime: refreshLifetime)
        let fhir = try await FHIRServer.start()
        let gate = try await SMARTGate(fhir: fhir, canaille: canaille, patient: "pat-42", publicHost: gateHost)
        let clientID = other ?? (confidential ? Self.confidential.0 : "dq-cli")
        var auth: [String: Any] = [
            "authorize_type": "authorization_code", "client_id": clientID, "credentials_dir": work.file("creds"),
            "scope": "launch/patient openid fhirUser offline_access patient/*.cruds",
        ]
        if confidential { auth["client_secret"] = Self.confidential.1 }
        for (key, value) in extra { auth[key] = value.replacingOccurrences(of: "CANAILLE", with: canaille.base) }
        let config = work.file("dq.json")
        try JSONSerialization.data(withJSONObject: [
            "server": gate.publicFHIRBase, "database": work.file("q.sqlite"), "auth": auth, "retry": ["initial_seconds": 1],
        ]).write(to: URL(fileURLWithPath: config))
        chmod(config, 0o600)
        return Setup(canaille: canaille, fhir: fhir, gate: gate, env: ["DQ_CONFIG": config, "HOME": work.path], clientID: clientID)
    }

    /// Runs `dq login`, answers as told, and returns dq's result, the redirect pasted (if any) and the
    /// person's output.
    func login(_ setup: Setup, _ answer: Answer) async throws -> (result: ProcessResult, pasted: String?, person: String) {
        var paste = false
        if case .follow = answer {} else { paste = true }
        let child = try ChildProcess(
            Peers.dqBinary, ["login", "--timeout", "60"] + (paste ? ["--no-browser"] : []), environment: setup.env,
            keepStdinOpen: paste)
        var address: String?
        _ = try await eventually(timeout: .seconds(30)) {
            address = child.outputSoFar.split(separator: "\n").first { $0.hasPrefix("http") }.map(String.init)
            return address != nil || !child.isRunning
        }
        guard let address else {
            let result = await child.stop()
            throw TestFailure("dq login printed no address: \(result.stderr)")
        }
        var pasted: String?
        var personOutput = ""
        if case .forge(let make) = answer {
            let items = URLComponents(string: address)?.queryItems ?? []
            pasted = make(Dictionary(items.map { ($0.name, $0.value ?? "") }, uniquingKeysWith: { a, _ in a }))
        } else {
            let script = Peers.packageRoot.appendingPathComponent("scripts/sign_in.py").path
            let person = try await ChildProcess(
                Peers.venv + "/bin/python",
                [script, address, "--user", Self.person.0, "--password", Self.person.1] + (paste ? ["--stop-at-redirect"] : [])
            ).wait(timeout: .seconds(60))
            #expect(person.status == 0, "the person's sign-in: \(person.stderr)")
            personOutput = person.stdout + person.stderr
            if case .paste(let change) = answer {
                pasted = change(person.stdout.trimmingCharacters(in: .whitespacesAndNewlines))
            }
        }
        if let pasted { child.writeStdin(Data((pasted + "\n").utf8)) }
        let result = await child.wait(timeout: .seconds(60))
        child.closeStdin()
        return (result, pasted, personOutput)
    }

    var signInDirectory: String { work.file("creds") }

    /// The path of the sign-in file (not the lock file beside it), or nil when there is none.
    func signInFile() throws -> String? {
        let files = ((try? FileManager.default.contentsOfDirectory(atPath: signInDirectory)) ?? []).filter {
            $0.hasPrefix("login-") && $0.hasSuffix(".json")
        }
        guard !files.isEmpty else { return nil }
        try #require(files.count == 1, "one sign-in file: \(files)")
        return signInDirectory + "/" + files[0]
    }

    /// The stored sign-in (checked mode 0600), or nil.
    func storedSignIn() throws -> [String: Any]? {
        guard let path = try signInFile() else { return nil }
        let mode = try FileManager.default.attributesOfItem(atPath: path)[.posixPermissions] as? Int
        #expect(mode == 0o600)
        return try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: path))) as? [String: Any]
    }

    func expectNoSecrets(_ outputs: [String], _ secrets: [String?], sourceLocation: SourceLocation = #_sourceLocation) {
        for secret in secrets.compactMap({ $0 }) where secret.count >= 8 {
            for output in outputs {
                #expect(!output.contains(secret), "a secret appeared in the output", sourceLocation: sourceLocation)
            }
        }
    }

    func enqueue(_ setup: Setup, _ indexes: Range<Int>) async throws {
        for index in indexes {
            let result = try await dq(["enqueue", try work.write("o\(index).json", resources.observation(index))], setup.env)
            try #require(result.status == 0, "\(result.stderr)")
        }
    }

    /// Moves the stored sign-in's `issued_at` back by `seconds`, as if the token were that much older: dq renews
    /// at half-life by that date, so a test reaches half-life without waiting for it (a wait that, on a loaded
    /// machine, also let the first phase's flush pass half-life).
    func ageSignIn(by seconds: TimeInterval) throws {
        let path = try #require(try signInFile())
        var object = try #require(try storedSignIn())
        object["issued_at"] = ISO8601DateFormatter().string(from: try Self.date(object["issued_at"]).addingTimeInterval(-seconds))
        try JSONSerialization.data(withJSONObject: object).write(to: URL(fileURLWithPath: path))
    }

    static func date(_ value: Any?) throws -> Date {
        try #require((value as? String).flatMap { ISO8601DateFormatter().date(from: $0) })
    }

    @Test("a person signs in; the flush delivers with the token; it is renewed at half-life with rotation, and after a 401; logout revokes")
    func signInDeliverRefreshLogout() async throws {
        let setup = try await setUp(tokenLifetime: 3600)
        let (login, _, person) = try await login(setup, .follow)
        #expect(login.status == 0, "\(login.stderr)")
        #expect(login.stdout.contains("as subject alice"))
        #expect(login.stdout.contains("patient:       pat-42"))
        let first = try #require(try storedSignIn())
        let access1 = try #require(first["access_token"] as? String)
        let refresh1 = try #require(first["refresh_token"] as? String)
        #expect(first["patient"] as? String == "pat-42" && first["sub"] as? String == "alice")
        var outputs = [login.stdout, login.stderr, person]

        // Before half-life: the stored token is used as is.
        try await enqueue(setup, 0..<2)
        let flush1 = try await dq(["flush"], setup.env)
        outputs += [flush1.stdout, flush1.stderr]
        #expect(flush1.status == 0, "\(flush1.stderr)")
        #expect(try await setup.gate.stats().grants["refresh_token"] == nil)
        #expect(try storedSignIn()?["access_token"] as? String == access1)
        #expect(try await setup.fhir.values("Observation", system: resources.system) == ["0", "1"])

        // After half-life (the token aged by 1801 s of its 3600): renewed before use, the rotated refresh token
        // replaces the old one.
        try ageSignIn(by: 1801)
        try await enqueue(setup, 2..<3)
        let flush2 = try await dq(["flush"], setup.env)
        outputs += [flush2.stdout, flush2.stderr]
        #expect(flush2.status == 0, "\(flush2.stderr)")
        #expect(try await setup.gate.stats().grants["refresh_token"] == 1)
        let second = try #require(try storedSignIn())
        let refresh2 = try #require(second["refresh_token"] as? String)
        #expect(second["access_token"] as? String != access1)
        #expect(refresh2 != refresh1)
        #expect(second["refreshed_at"] != nil)
        let replay = try await setup.canaille.postForm(
            "/oauth/token", ["grant_type": "refresh_token", "refresh_token": refresh1, "client_id": setup.clientID])
        #expect(replay.0 == 400, "the rotated-out refresh token must be dead")
        #expect(try await setup.fhir.values("Observation", system: resources.system) == ["0", "1", "2"])

        // The server stops accepting the token: a 401, one refresh, the retry is delivered.
        try await setup.gate.control(["reject_issued_before_now": true])
        try await Task.sleep(for: .milliseconds(1100))  // token iat has whole seconds
        try await enqueue(setup, 3..<4)
        let flush3 = try await dq(["flush"], setup.env)
        outputs += [flush3.stdout, flush3.stderr]
        #expect(flush3.status == 0, "\(flush3.stderr)")
        let stats = try await setup.gate.stats()
        #expect(stats.grants["refresh_token"] == 2)
        #expect(stats.refused >= 1)
        #expect(try await setup.fhir.values("Observation", system: resources.system) == ["0", "1", "2", "3"])

        let status = try await dq(["status"], setup.env)
        #expect(status.status == 0)
        #expect(status.stdout.contains("signed in:  alice"))
        #expect(status.stdout.contains("patient:    pat-42"))
        let third = try #require(try storedSignIn())
        outputs += [status.stdout, status.stderr]

        let logout = try await dq(["logout"], setup.env)
        outputs += [logout.stdout, logout.stderr]
        #expect(logout.status == 0, "\(logout.stderr)")
        #expect(logout.stdout.contains("the server revoked the tokens"))
        #expect(try storedSignIn() == nil)
        let revoked = try await setup.canaille.postForm(
            "/oauth/token",
            ["grant_type": "refresh_token", "refresh_token": third["refresh_token"] as? String ?? "", "client_id": setup.clientID])
        #expect(revoked.0 == 400, "logout must revoke the refresh token at the server")
        let after = try await dq(["flush"], setup.env)
        #expect(after.status == 0, "nothing pending: \(after.stderr)")
        expectNoSecrets(outputs, [access1, refresh1, refresh2, second["access_token"] as? String, third["access_token"] as? String])
        // Every code, verifier and token the gate saw pass (the ID tokens too), in everything dq printed.
        let seen = try await setup.gate.secrets()
        #expect(seen.count >= 9, "codes, verifiers and tokens recorded: \(seen.count)")
        let dqOutputs = outputs.enumerated().filter { $0.offset != 2 }.map(\.element)  // not the person's own
        expectNoSecrets(dqOutputs + [after.stdout, after.stderr], seen)
    }

    @Test("two dq processes past half-life refresh once between them: the second takes the rotated token from the first")
    func concurrentRefreshAcrossProcesses() async throws {
        let setup = try await setUp(tokenLifetime: 8)
        let (login, _, _) = try await login(setup, .follow)
        #expect(login.status == 0, "\(login.stderr)")
        let renewAt = try Self.date(try storedSignIn()?["issued_at"]).addingTimeInterval(4)
        // A second queue database for the same server and person, as a cron flush beside `dq run` would have.
        var other = setup.env
        let config = try #require(setup.env["DQ_CONFIG"])
        var object = try #require(try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: config))) as? [String: Any])
        object["database"] = work.file("other.sqlite")
        let otherConfig = work.file("other.json")
        try JSONSerialization.data(withJSONObject: object).write(to: URL(fileURLWithPath: otherConfig))
        chmod(otherConfig, 0o600)
        other["DQ_CONFIG"] = otherConfig
        try await enqueue(setup, 0..<1)
        let queued = try await dq(["enqueue", try work.write("o1.json", resources.observation(1))], other)
        try #require(queued.status == 0, "\(queued.stderr)")

        try await Task.sleep(for: .seconds(max(0, renewAt.timeIntervalSinceNow) + 0.3))
        async let first = dq(["flush"], setup.env)
        async let second = dq(["flush"], other)
        let (a, b) = try await (first, second)
        #expect(a.status == 0, "\(a.stderr)")
        #expect(b.status == 0, "\(b.stderr)")
        #expect(try await setup.gate.stats().grants["refresh_token"] == 1)
        #expect(try await setup.fhir.values("Observation", system: resources.system).sorted() == ["0", "1"])
    }

    @Test("a confidential client signs in by pasting the redirect; a revoked refresh token stops the flush with 77, items kept")
    func pastedSignInAndRevokedRefreshToken() async throws {
        let setup = try await setUp(confidential: true)
        let (login, pasted, person) = try await login(setup, .paste())
        #expect(login.status == 0, "\(login.stderr)")
        let code = try #require(URLComponents(string: pasted ?? "")?.queryItems?.first { $0.name == "code" }?.value)
        let stored = try #require(try storedSignIn())
        let refresh = try #require(stored["refresh_token"] as? String)
        try await enqueue(setup, 0..<2)

        // An administrator revokes the refresh token; the server stops accepting the access token.
        let revoke = try await setup.canaille.postForm(
            "/oauth/revoke",
            ["token": refresh, "token_type_hint": "refresh_token", "client_id": Self.confidential.0, "client_secret": Self.confidential.1])
        #expect(revoke.0 == 200)
        try await setup.gate.control(["reject_issued_before_now": true])
        let flush = try await dq(["flush"], setup.env)
        #expect(flush.status == 77, "\(flush.stderr)")
        #expect(flush.stderr.contains("run `dq login` again"))
        let status = try await dq(["status", "--json"], setup.env)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(object["pending"] as? Int == 2)
        #expect(try await setup.fhir.values("Observation", system: resources.system) == [])
        // The person's own output holds the redirect they copied; dq's output must hold no secret.
        expectNoSecrets(
            [login.stdout, login.stderr, flush.stdout, flush.stderr, status.stdout],
            [code, refresh, stored["access_token"] as? String, Self.confidential.1])
        expectNoSecrets([person], [refresh, stored["access_token"] as? String, Self.confidential.1])
    }

    @Test("an expired refresh token stops the flush with 77 and \"run dq login again\"; the items stay queued")
    func expiredRefreshToken() async throws {
        let setup = try await setUp(tokenLifetime: 4, refreshLifetime: 6)
        let (login, _, _) = try await login(setup, .follow)
        #expect(login.status == 0, "\(login.stderr)")
        let expiresAt = try Self.date(try storedSignIn()?["issued_at"]).addingTimeInterval(6)
        try await enqueue(setup, 0..<2)
        try await Task.sleep(for: .seconds(max(0, expiresAt.timeIntervalSinceNow) + 1))
        let flush = try await dq(["flush"], setup.env)
        #expect(flush.status == 77, "\(flush.stderr)")
        #expect(flush.stderr.contains("refused the refresh token") && flush.stderr.contains("run `dq login` again"), "\(flush.stderr)")
        // Once: the CapabilityStatement read and the first send both need a token; a refusal is not asked twice.
        #expect(try await setup.gate.stats().grants["refresh_token"] == 1, "one refused refresh, one request")
        let status = try await dq(["status", "--json"], setup.env)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(object["pending"] as? Int == 2)
        #expect(try await setup.fhir.values("Observation", system: resources.system) == [])
        expectNoSecrets([login.stdout, login.stderr, flush.stdout, flush.stderr, status.stdout], try await setup.gate.secrets())
    }

    @Test(
        "refused sign-ins: wrong state, a replayed code, and ID tokens with a bad signature, wrong aud, wrong nonce or expired: exit 77, nothing stored"
    )
    func refusedSignIns() async throws {
        let setup = try await setUp()
        let (first, pasted, _) = try await login(setup, .paste())
        #expect(first.status == 0, "\(first.stderr)")
        var outputs = [first.stdout, first.stderr]
        let usedCode = try #require(URLComponents(string: pasted ?? "")?.queryItems?.first { $0.name == "code" }?.value)
        let path = try #require(try signInFile())
        let before = try Data(contentsOf: URL(fileURLWithPath: path))
        let exchanges = try await setup.gate.stats().grants["authorization_code"]
        #expect(exchanges == 1)

        // A redirect whose state is not the one dq sent: refused before any token request.
        let forgedState = try await login(setup, .paste { $0.replacingOccurrences(of: "state=", with: "state=forged") })
        #expect(forgedState.result.status == 77, "\(forgedState.result.stderr)")
        #expect(forgedState.result.stderr.contains("state does not match"))
        #expect(try await setup.gate.stats().grants["authorization_code"] == 1)
        #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == before)

        // An authorization code that was already exchanged, pasted into a new sign-in with its state.
        let replayed = try await login(
            setup,
            .forge { parameters in
                "\(parameters["redirect_uri"] ?? "")?code=\(usedCode)&state=\(parameters["state"] ?? "")"
            })
        #expect(replayed.result.status == 77, "\(replayed.result.stderr)")
        #expect(replayed.result.stderr.contains("refused the authorization code"))
        #expect(try await setup.gate.stats().grants["authorization_code"] == 2)
        #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == before)
        expectNoSecrets([replayed.result.stdout, replayed.result.stderr, forgedState.result.stderr], [usedCode])
        outputs += [forgedState.result.stdout, forgedState.result.stderr, replayed.result.stdout, replayed.result.stderr]

        // ID tokens changed by the gate: each refused with a message naming the check, nothing stored.
        try FileManager.default.removeItem(atPath: path)
        for (mode, message) in [
            ("bad-signature", "signature that does not verify"), ("wrong-aud", "another client (aud)"),
            ("wrong-nonce", "nonce dq sent"), ("expired", "has expired (exp)"),
        ] {
            try await setup.gate.control(["tamper": mode])
            let refused = try await login(setup, .follow)
            #expect(refused.result.status == 77, "\(mode): \(refused.result.stderr)")
            #expect(refused.result.stderr.contains(message), "\(mode): \(refused.result.stderr)")
            #expect(refused.result.stderr.contains("nothing was stored"))
            #expect(try storedSignIn() == nil, "\(mode) stored a sign-in")
            outputs += [refused.result.stdout, refused.result.stderr]
        }

        // The same gate signing a sound ID token with its ES256 key, with a fhirUser claim: accepted; the
        // launch context (patient and encounter from the token answer, fhirUser from the ID token) is shown.
        try await setup.gate.control(["tamper": "es256"])
        let es256 = try await login(setup, .follow)
        #expect(es256.result.status == 0, "\(es256.result.stderr)")
        let stored = try #require(try storedSignIn())
        #expect(stored["sub"] as? String == "alice")
        #expect(stored["fhir_user"] as? String == "Patient/pat-42" && stored["encounter"] as? String == "enc-7", "\(stored.keys)")
        try await enqueue(setup, 0..<1)  // status reads a queue that exists
        let status = try await dq(["status"], setup.env)
        #expect(status.stdout.contains("signed in:  Patient/pat-42") && status.stdout.contains("enc-7"), "\(status.stdout)")
        let json = try await dq(["status", "--json"], setup.env)
        #expect(json.stdout.contains("Patient/pat-42") && json.stdout.contains("enc-7"), "\(json.stdout)")

        // No code, verifier or token of any of these sign-ins in what dq printed.
        let seen = try await setup.gate.secrets()
        #expect(seen.count >= 10, "codes, verifiers and tokens recorded: \(seen.count)")
        expectNoSecrets(outputs + [es256.result.stdout, es256.result.stderr, status.stdout, json.stdout], seen)
    }

    @Test(
        "through a proxy that alone resolves the server's name: discovery, the code exchange, the JWKS and the refresh go through it"
    )
    func signInThroughTheProxy() async throws {
        chmod(work.path, 0o777)  // squid's workers write their logs here
        let squid = try await NetworkTests.Squid(in: work, names: ["gate.invalid"])
        var setup = try await setUp(tokenLifetime: 16, gateHost: "gate.invalid")
        try await setup.gate.control(["tamper": "es256"])  // ID tokens on refresh answers too, keys at the gate
        let direct = try await dq(["login", "--no-browser", "--timeout", "10"], setup.env)
        #expect(direct.status != 0 && !direct.stdout.contains("http"), "gate.invalid resolves only through the proxy: \(direct.stderr)")

        setup.env["HTTP_PROXY"] = squid.url
        let (login, _, _) = try await login(setup, .follow)
        #expect(login.status == 0, "\(login.stderr)")
        let served = try await setup.gate.jwksServed()
        #expect(served >= 1, "the ID token was checked with the gate's JWKS")
        let first = try #require(try storedSignIn())
        let renewAt = try Self.date(first["issued_at"]).addingTimeInterval(8)
        try await enqueue(setup, 0..<1)
        try await Task.sleep(for: .seconds(max(0, renewAt.timeIntervalSinceNow) + 0.5))
        let flush = try await dq(["flush"], setup.env)
        #expect(flush.status == 0, "\(flush.stderr)")
        #expect(try await setup.gate.stats().grants["refresh_token"] == 1)
        #expect(try await setup.gate.jwksServed() > served, "the refreshed ID token was checked with a JWKS fetched again")
        #expect(try await setup.fhir.values("Observation", system: resources.system) == ["0"])
        #expect(
            try await eventually(timeout: .seconds(10)) {
                try squid.accessLines().contains { $0.contains("CONNECT gate.invalid:\(setup.gate.port)") }
            }, "\((try? squid.accessLines()) ?? [])")
        let doctor = try await dq(["doctor"], setup.env)
        #expect(doctor.stdout.contains("through proxy \(squid.url)"), "\(doctor.stdout)")
        expectNoSecrets([login.stdout, login.stderr, flush.stdout, flush.stderr, doctor.stdout], try await setup.gate.secrets())
    }

    @Test(
        "the JWKS is out when a refreshed ID token must be checked: the rotated refresh token is kept, the flush waits (not 77) and goes through after"
    )
    func refreshWhileTheJWKSIsOut() async throws {
        // 16 s: the flush after the outage refreshes once and finishes well within the new token's half-life.
        let setup = try await setUp(tokenLifetime: 16)
        try await setup.gate.control(["tamper": "es256"])  // ID tokens on refresh answers too, keys at the gate
        let (login, _, _) = try await login(setup, .follow)
        #expect(login.status == 0, "\(login.stderr)")
        let first = try #require(try storedSignIn())
        let renewAt = try Self.date(first["issued_at"]).addingTimeInterval(8)
        let refresh1 = try #require(first["refresh_token"] as? String)
        try await enqueue(setup, 0..<2)
        try await Task.sleep(for: .seconds(max(0, renewAt.timeIntervalSinceNow) + 0.5))

        // The refresh goes through and rotates the refresh token; the new ID token cannot be checked.
        try await setup.gate.control(["jwks_down": true])
        let down = try await dq(["flush"], setup.env)
        #expect(down.status == 75, "a passing outage, not a refused sign-in: \(down.status) \(down.stderr)")
        #expect(down.stderr.contains("JWKS"), "\(down.stderr)")
        let spent = try await setup.gate.stats().grants["refresh_token"] ?? 0
        #expect(spent >= 1, "\(spent)")  // each refresh rotates, and each rotated token is kept
        let kept = try #require(try storedSignIn())
        #expect(kept["refresh_token"] as? String != refresh1, "the rotated refresh token is kept")
        #expect(kept["access_token"] as? String == first["access_token"] as? String, "the unchecked access token is not")
        #expect(try await setup.fhir.values("Observation", system: resources.system) == [])

        // Back: the kept refresh token renews (the old one is dead at the server), and both are delivered.
        try await setup.gate.control(["jwks_down": false])
        let up = try await dq(["flush", "--now"], setup.env)  // past the backoff the outage set
        #expect(up.status == 0, "\(up.stderr)")
        let renewed = try await setup.gate.stats().grants["refresh_token"] ?? 0
        #expect(renewed == spent + 1, "\(renewed)")
        #expect(try await setup.fhir.values("Observation", system: resources.system) == ["0", "1"])
        expectNoSecrets([login.stdout, login.stderr, down.stdout, down.stderr, up.stdout, up.stderr], try await setup.gate.secrets())
    }

    @Test(
        "confidential clients in the code flow: client_secret_post, and private_key_jwt (ES256, dq keygen) signing in, delivering and logging out"
    )
    func confidentialPostAndKeyClients() async throws {
        let key = work.file("client.pem")
        let keygen = try await dq(["keygen", "--alg", "ES256", "--out", key], [:])
        try #require(keygen.status == 0, "\(keygen.stderr)")
        // One after the other: each setup writes the test's config file and has its own FHIR server.
        let setups: [(String, () async throws -> Setup)] = [
            (
                "post",
                {
                    try await setUp(
                        clientID: Self.postClient.0,
                        auth: ["client_secret": Self.postClient.1, "token_endpoint_auth_method": "client_secret_post"])
                }
            ),
            // The assertion's audience is the token endpoint it goes to: Canaille's own (it checks aud).
            (
                "key",
                {
                    try await setUp(
                        clientID: "dq-key", auth: ["private_key": key, "token_uri": "CANAILLE/oauth/token"],
                        keyClients: ["dq-key": keygen.stdout.trimmingCharacters(in: .whitespacesAndNewlines)])
                }
            ),
        ]
        for (index, (name, make)) in setups.enumerated() {
            let setup = try await make()
            try? FileManager.default.removeItem(atPath: signInDirectory)
            let (login, _, _) = try await login(setup, .follow)
            #expect(login.status == 0, "\(name): \(login.stderr)")
            try #require(try storedSignIn() != nil, "\(name) signed in")
            try await enqueue(setup, (index * 10)..<(index * 10 + 1))
            let flush = try await dq(["flush"], setup.env)
            #expect(flush.status == 0, "\(name): \(flush.stderr)")
            #expect(try await setup.fhir.values("Observation", system: resources.system) == [String(index * 10)], "\(name)")
            let refresh = try #require(try storedSignIn()?["refresh_token"] as? String)
            let file = try #require(try signInFile())
            let saved = try Data(contentsOf: URL(fileURLWithPath: file))
            let logout = try await dq(["logout"], setup.env)
            #expect(logout.status == 0, "\(name): \(logout.stderr)")
            #expect(logout.stdout.contains("the server revoked the tokens"), "\(name): \(logout.stdout)")
            // Revoked at the server: the sign-in put back, dq's own refresh (with the client's own
            // authentication) is refused once the gate stops accepting the access token.
            try saved.write(to: URL(fileURLWithPath: file))
            try await setup.gate.control(["reject_issued_before_now": true])
            try await Task.sleep(for: .milliseconds(1100))  // token iat has whole seconds
            try await enqueue(setup, (index * 10 + 1)..<(index * 10 + 2))
            let revoked = try await dq(["flush"], setup.env)
            #expect(revoked.status == 77, "\(name): \(revoked.stderr)")
            #expect(revoked.stderr.contains("refused the refresh token"), "\(name): \(revoked.stderr)")
            expectNoSecrets(
                [login.stdout, login.stderr, flush.stdout, flush.stderr, logout.stdout, logout.stderr, revoked.stderr],
                try await setup.gate.secrets() + [refresh, Self.postClient.1])
        }
    }
}
