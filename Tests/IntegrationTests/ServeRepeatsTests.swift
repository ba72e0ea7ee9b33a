import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Repeats a device cannot avoid (a C3-PRO app wraps its AES key anew on each retry, so the same envelope comes back
/// with another `symmetric_key`): with an `Idempotency-Key` the second answer is the first and nothing is stored
/// twice; without one the queue journals the repeat as a duplicate and does not send it; in SQLite and PostgreSQL.
///
/// The queue's idempotent mode is off in these tests, so sekmet's conditional create cannot hide a second send: one
/// copy on sekmet is dq's doing.
extension ServeHarness {
    /// `dq.json` for the queue in SQLite (`queue.sqlite`) or a fresh PostgreSQL database, idempotent mode off: the
    /// file, the database (a path or a URL), and the environment dq needs for it.
    func configureRepeats(server: String, store: String, serve: [String: Any?] = [:]) async throws -> (
        config: String, database: String, environment: [String: String]
    ) {
        let written = try await configure(server: server, serve: serve)
        var root = try #require(try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: written))) as? [String: Any])
        root["idempotent"] = false
        var database = work.file("queue.sqlite")
        var environment = ["HOME": work.path]
        if store == "postgres" {
            database = try await PostgresTests.freshDatabase()
            environment["PGPASSWORD"] = Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""
            root["database"] = database
        }
        let config = try work.write("dq-repeats.json", String(decoding: try JSONSerialization.data(withJSONObject: root), as: UTF8.self))
        return (config, database, environment)
    }

    /// The journal (`dq log --json`), oldest first.
    func journal(_ config: String, _ environment: [String: String] = [:]) async throws -> [[String: Any]] {
        let result = try await dq(
            ["log", "--json", "--limit", "1000", "--config", config], ["HOME": work.path].merging(environment) { $1 },
            directory: work.path)
        #expect(result.status == 0, "\(result.stderr)")
        return try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [[String: Any]], "\(result.stdout)")
    }

    /// Pending, delivered and duplicate items of the queue (`dq status --json` with the store's environment).
    func queueCounts(_ config: String, _ environment: [String: String]) async throws -> (
        pending: Int, delivered: Int, duplicates: Int
    ) {
        let status = try await dq(["status", "--json", "--config", config], environment, directory: work.path)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any], "\(status.stderr)")
        return (object["pending"] as? Int ?? -1, object["delivered"] as? Int ?? -1, object["duplicates"] as? Int ?? -1)
    }

    /// A step with an `Idempotency-Key` header (a Structured Field string, as the draft writes it).
    func keyed(_ step: Step, _ key: String) -> Step {
        var step = step
        step["headers"] = ["Idempotency-Key": "\"\(key)\""]
        return step
    }

    /// Runs SQL on the queue's database: `sqlite3` on the file, `psql` on PostgreSQL (while dq serve runs).
    func runSQL(_ sql: String, database: String) async throws {
        if database.hasPrefix("postgres") {
            try await PostgresTests.psql(database, sql)
        } else {
            let result = try await ChildProcess("/usr/bin/sqlite3", ["-cmd", ".timeout 10000", database, sql]).wait(timeout: .seconds(60))
            try #require(result.status == 0, "sqlite3: \(result.stderr)")
        }
    }

}

extension ServeRepeatsSuite {
    @Test(
        "With an Idempotency-Key, the same QuestionnaireResponse posted twice with fresh key wraps (and a plain Observation posted twice) is answered the same byte for byte and stored once; the key with another body is 422",
        arguments: ["sqlite", "postgres"])
    func idempotencyKey(store: String) async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .der)
        let (config, _, environment) = try await configureRepeats(server: server.base, store: store)
        let receiver = try await start(config, environment: environment)
        let token = try await self.token(receiver.base, try await register(receiver.base))
        let response = questionnaireResponse("i1")
        let envelope = sealed("/c3pro/encfhir/QuestionnaireResponse", response, certificate: keys.certificate, keyID: "k1", token: token)
        let plainStep = plain("/c3pro/fhir/Observation", observation("i2"), token: token)
        // One Python session: one AES key, so `message` is the same and `symmetric_key` wrapped anew each time.
        let answers = try await client(
            receiver.base,
            [
                keyed(envelope, "qr-1"), keyed(envelope, "qr-1"), keyed(plainStep, "obs-1"), keyed(plainStep, "obs-1"),
                keyed(plain("/c3pro/fhir/Observation", observation("other"), token: token), "obs-1"),
                keyed(
                    sealed(
                        "/c3pro/encfhir/QuestionnaireResponse", questionnaireResponse("x"), certificate: keys.certificate, keyID: "k1",
                        token: token), "qr-1"),
                [
                    "path": "/c3pro/encfhir/QuestionnaireResponse", "bearer": token,
                    "headers": ["Idempotency-Key": String(repeating: "k", count: 300)],
                    "seal": ["resource": response, "cert": keys.certificate, "key_id": "k1", "version": "3.0.0"],
                ],
            ])
        #expect(answers.count == 7)
        #expect(answers[0].status == 202, "\(answers[0])")
        for (first, second) in [(0, 1), (2, 3)] {
            let (a, b) = (answers[first], answers[second])
            #expect(
                a.status == b.status && a.body == b.body && a.contentType == b.contentType && a.location == b.location,
                "the repeat is answered as the first was: \(a) | \(b)")
        }
        #expect([201, 202].contains(answers[2].status), "\(answers[2])")
        #expect(answers[4].status == 422 && answers[5].status == 422, "the key with another request: \(answers[4]) \(answers[5])")
        #expect(answers[6].status == 400, "a key longer than 255 characters: \(answers[6])")
        // A new session seals the same resource anew (another AES key and IV: no byte of `message` in common) under the
        // same key, as an app's retry does: the first request again, not 422 (which stopped the device's queue for good).
        let resealed = try await client(receiver.base, [keyed(envelope, "qr-1")])
        #expect(
            resealed.first.map { $0.status == answers[0].status && $0.body == answers[0].body } == true,
            "a re-sealed retry is answered as the first: \(resealed) | \(answers[0])")

        let arrived = try await eventually(timeout: .seconds(60)) { try await values(server).count >= 2 }
        #expect(arrived, "\(receiver.log.suffix(2000))")
        #expect(try await eventually { try await queueCounts(config, environment).pending == 0 })
        #expect(try await values(server) == ["i1", "i2"], "once each")
        let lines = try await journal(config, environment)
        #expect(lines.count == 2 && lines.allSatisfy { $0["event"] as? String == "delivered" }, "nothing stored twice: \(lines)")
        let stopped = await receiver.stop()
        #expect(stopped.status == 0, "\(stopped.stderr.suffix(2000))")
        #expect(!stopped.stderr.contains("qr-1") && !stopped.stderr.contains("answer i1"), "no key or content in the log")
    }

    @Test(
        "Without an Idempotency-Key, a repeat from the same client within serve.dedupe_window_days is journaled as a duplicate and not sent; the same plaintext from another client is delivered; a repeat after the window is delivered again",
        arguments: ["sqlite", "postgres"])
    func repeatsWithoutKey(store: String) async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .der)
        // A window of 2 days (not the default 7): the repeat 3 days later below is delivered only if it is honoured.
        let (config, database, environment) = try await configureRepeats(
            server: server.base, store: store, serve: ["dedupe_window_days": 2])
        let receiver = try await start(config, environment: environment)
        let first = try await self.token(receiver.base, try await register(receiver.base))
        let second = try await self.token(receiver.base, try await register(receiver.base))
        func envelope(_ value: String, _ token: String) -> Step {
            sealed(
                "/c3pro/encfhir/QuestionnaireResponse", questionnaireResponse(value), certificate: keys.certificate, keyID: "k1",
                token: token)
        }
        // (b) The app's retry: the same session sends the envelope again, re-wrapped; a plain one twice as well.
        let answers = try await client(
            receiver.base,
            [
                envelope("d1", first), envelope("d1", first), plain("/c3pro/fhir/Observation", observation("d2"), token: first),
                plain("/c3pro/fhir/Observation", observation("d2"), token: first),
            ])
        #expect(answers.map(\.status).prefix(2) == [202, 202], "\(answers)")
        #expect(answers.allSatisfy { [201, 202].contains($0.status) }, "\(answers)")
        #expect(
            try await eventually(timeout: .seconds(60)) { try await queueCounts(config, environment).pending == 0 },
            "\(receiver.log.suffix(2000))")
        #expect(try await values(server) == ["d1", "d2"], "one copy of each on sekmet")
        var lines = try await journal(config, environment)
        #expect(lines.map { $0["event"] as? String ?? "" } == ["delivered", "duplicate", "delivered", "duplicate"], "\(lines)")
        let delivered = lines.filter { $0["event"] as? String == "delivered" }.map { $0["id"] as? String ?? "?" }
        #expect(
            lines[1]["note"] as? String == "a repeat of item \(delivered[0]), delivered within the dedupe window",
            "the duplicate names the item delivered: \(lines[1])")
        let counted = try await queueCounts(config, environment)
        #expect(counted.delivered == 2 && counted.duplicates == 2, "dq status: \(counted)")
        let text = try await dq(["status", "--config", config], environment, directory: work.path)
        #expect(text.stdout.contains("duplicates: 2 (repeats of delivered resources, not sent: dq log)"), "\(text.stdout)")

        // (c) The same plaintext from another client is its own resource.
        let other = try await client(receiver.base, [envelope("d1", second)])
        #expect(other.first?.status == 202, "\(other)")
        #expect(
            try await eventually(timeout: .seconds(60)) { try await values(server) == ["d1", "d2", "d1"] }, "\(receiver.log.suffix(2000))")

        // (d) After the window (the delivery's time moved back 3 days in the database), a repeat is delivered again.
        try await runSQL("UPDATE dq_digests SET delivered_at = delivered_at - 3 * 86400", database: database)
        let late = try await client(receiver.base, [envelope("d1", first)])
        #expect(late.first?.status == 202, "\(late)")
        #expect(
            try await eventually(timeout: .seconds(60)) { try await values(server) == ["d1", "d2", "d1", "d1"] },
            "\(receiver.log.suffix(2000))")
        lines = try await journal(config, environment)
        #expect(lines.filter { $0["event"] as? String == "duplicate" }.count == 2, "\(lines)")
        let stopped = await receiver.stop()
        #expect(stopped.status == 0, "\(stopped.stderr.suffix(2000))")
    }

    @Test(
        "Requests with one Idempotency-Key sent at once store one item: each is answered 202 (or 409 while the first is answered), one resource on sekmet, one journal line",
        arguments: ["sqlite", "postgres"])
    func concurrentKey(store: String) async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .der)
        let (config, _, environment) = try await configureRepeats(server: server.base, store: store)
        let receiver = try await start(config, environment: environment)
        let token = try await self.token(receiver.base, try await register(receiver.base))
        let script = try work.write("concurrent.py", Self.concurrentScript)
        let result = try await ChildProcess(
            Peers.venv + "/bin/python",
            [script, receiver.base + "/c3pro/encfhir/QuestionnaireResponse", token, keys.certificate, questionnaireResponse("c1"), "16"]
        ).wait(timeout: .seconds(120))
        let statuses = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [Int], "\(result.stderr)")
        #expect(statuses.count == 16 && statuses.allSatisfy { $0 == 202 || $0 == 409 }, "\(statuses)")
        #expect(statuses.contains(202))
        #expect(try await eventually(timeout: .seconds(60)) { try await values(server).count >= 1 }, "\(receiver.log.suffix(2000))")
        #expect(try await eventually { try await queueCounts(config, environment).pending == 0 })
        #expect(try await values(server) == ["c1"])
        let lines = try await journal(config, environment)
        #expect(lines.count == 1 && lines.first?["event"] as? String == "delivered", "stored once: \(lines)")
        _ = await receiver.stop()
    }

    @Test(
        "serve.dedupe_window_days must be a whole number in 1...365 (0, 366, 1.5 and \"7\"), and serve.delivery_wait_seconds one in 0...300: stop dq serve (78) naming the key"
    )
    func dedupeWindowChecked() async throws {
        let dedupe = #""serve.dedupe_window_days" must be a whole number in 1...365"#
        // The answer's wait for a plain delivery, in seconds: 0 to 300.
        let wait = #""serve.delivery_wait_seconds" must be a whole number in 0...300"#
        let cases: [(key: String, value: Any, message: String)] =
            [0, 366, 1.5, "7"].map { ("dedupe_window_days", $0, dedupe) } + [-1, 301, 2.5].map { ("delivery_wait_seconds", $0, wait) }
        for (key, value, message) in cases {
            let config = try await configure(server: "http://127.0.0.1:9/fhir", serve: [key: value])
            let result = try await ChildProcess(
                Peers.dqBinary, ["serve", "--config", config, "--listen", "127.0.0.1:\(Peers.freePort())"],
                environment: ["HOME": work.path], directory: work.path
            ).wait(timeout: .seconds(60))
            #expect(result.status == 78, "\(key) \(value): \(result.status) \(result.stderr.suffix(1000))")
            #expect(result.stderr.contains(message), "\(key) \(value): \(result.stderr.suffix(1000))")
        }
    }

    /// Posts one resource `count` times at once, each sealed anew with one AES key (one app session), all with the
    /// same `Idempotency-Key`; prints the statuses.
    static let concurrentScript = #"""
        import base64, json, os, sys, threading
        import requests
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, padding
        from cryptography.hazmat.primitives.asymmetric import padding as asym
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        url, token, cert, resource, count = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
        AES_KEY = os.urandom(32)
        with open(cert, "rb") as f:
            public_key = x509.load_pem_x509_certificate(f.read()).public_key()
        padder = padding.PKCS7(128).padder()
        padded = padder.update(resource.encode()) + padder.finalize()
        encryptor = Cipher(algorithms.AES(AES_KEY), modes.CBC(b"\0" * 16)).encryptor()
        message = base64.b64encode(encryptor.update(padded) + encryptor.finalize()).decode()

        def body():
            wrapped = public_key.encrypt(
                AES_KEY, asym.OAEP(mgf=asym.MGF1(algorithm=hashes.SHA1()), algorithm=hashes.SHA1(), label=None))
            return json.dumps({"key_id": "k1", "symmetric_key": base64.b64encode(wrapped).decode(), "message": message,
                               "version": "3.0.0"}).encode()

        bodies = [body() for _ in range(count)]
        statuses = [0] * count
        start = threading.Barrier(count)

        def post(index):
            with requests.Session() as session:
                session.trust_env = False
                start.wait()
                r = session.post(url, data=bodies[index], timeout=60, headers={
                    "Authorization": "Bearer " + token, "Content-Type": "application/json",
                    "Idempotency-Key": '"same-key"'})
                statuses[index] = r.status_code

        threads = [threading.Thread(target=post, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        json.dump(statuses, sys.stdout)
        """#
}
