import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Key states in `keys_dir` (`key-states.json`) and `dq serve keys`, with envelopes made by the Python client
/// (`cryptography`), in SQLite and in PostgreSQL.
extension ServeTrustSuite {
    /// The fingerprint openssl gives the key: SHA-256 of its public key as DER SubjectPublicKeyInfo.
    func opensslFingerprint(_ keys: TestKeys) async throws -> String {
        let der = keys.directory.file("public.der")
        try await TestKeys.openssl(["pkey", "-in", keys.privateKey, "-pubout", "-outform", "DER", "-out", der])
        let digest = try await TestKeys.openssl(["dgst", "-sha256", "-r", der])
        return String(digest.stdout.prefix { $0 != " " })
    }

    /// `dq serve keys --json`, by key id.
    func listedKeys(_ config: String, _ environment: [String: String]) async throws -> [String: [String: Any]] {
        let result = try await dq(["serve", "keys", "--json", "--config", config], environment, directory: work.path)
        #expect(result.status == 0, "\(result.stderr)")
        let keys = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [[String: Any]], "\(result.stdout)")
        return Dictionary(keys.map { ($0["id"] as? String ?? "", $0) }) { first, _ in first }
    }

    @Test(
        "Key states: a bad key-states.json is refused by dq serve, dq doctor and dq serve keys; an envelope under a retired key is quarantined with that reason and delivered after the key is made decrypt-only (SIGHUP) and replayed; the active key opens an empty key_id; dq serve keys counts what each key opened",
        arguments: ["sqlite", "postgres"])
    func keyStates(store: String) async throws {
        let server = try await FHIRServer.start()
        let old = try await TestKeys()
        let new = try await TestKeys()
        try await install(old, as: "k1", layout: .pem)
        try await install(new, as: "k2", layout: .der)
        let (config, _, environment) = try await configure(server: server.base, store: store, serve: ["default_key_id": nil])
        let states = work.file("keys/key-states.json")

        // Refused: a state that is none, two active keys, a key the directory does not hold, not an object.
        for (text, named) in [
            (#"{"k1": "gone"}"#, "must be one of"), (#"{"k1": "active", "k2": "active"}"#, "at most one key may be active"),
            (#"{"k9": "retired"}"#, "k9"), (#"["k1"]"#, "JSON object"),
        ] {
            try text.write(toFile: states, atomically: true, encoding: .utf8)
            let port = Peers.freePort()
            let started = try await ChildProcess(
                Peers.dqBinary, ["serve", "--config", config, "--listen", "127.0.0.1:\(port)"], environment: environment,
                directory: work.path
            ).wait(timeout: .seconds(60))
            #expect(started.status == 78, "\(text): \(started.status) \(started.stderr.suffix(1000))")
            #expect(started.stderr.contains("key-states.json") && started.stderr.contains(named), "\(text): \(started.stderr.suffix(1000))")
            let doctor = try await dq(["doctor", "--offline", "--config", config], environment, directory: work.path)
            #expect(
                doctor.status != 0 && (doctor.stdout + doctor.stderr).contains("key-states.json"),
                "\(text): \(doctor.stdout) \(doctor.stderr)")
            let listed = try await dq(["serve", "keys", "--config", config], environment, directory: work.path)
            #expect(listed.status == 78 && listed.stderr.contains("key-states.json"), "\(text): \(listed.stderr)")
        }

        try #"{"k1": "retired", "k2": "active"}"#.write(toFile: states, atomically: true, encoding: .utf8)
        let receiver = try await start(config, environment: environment.merging(["DQ_LOG_LEVEL": "notice"]) { $1 })
        let device = try await register(receiver.base)
        let token = try await self.token(receiver.base, device)
        func sealedUnder(_ keys: TestKeys, _ id: String, _ value: String) -> Step {
            sealed("/c3pro/encfhir/Observation", observation(value), certificate: keys.certificate, keyID: id, token: token)
        }
        let answers = try await client(
            receiver.base,
            [
                sealedUnder(old, "k1", "r0"), sealedUnder(new, "k2", "a0"), sealedUnder(new, "k2", "a1"), sealedUnder(old, "k1", "r1"),
                sealedUnder(new, "k2", "a2"), sealedUnder(new, "", "a3"),
            ])
        #expect(answers.map(\.status) == [202, 202, 202, 202, 202, 202], "\(answers)")
        let arrived = try await eventually(timeout: .seconds(60)) { try await values(server).count >= 4 }
        #expect(arrived, "\(receiver.log.suffix(2000))")
        #expect(try await values(server) == ["a0", "a1", "a2", "a3"], "the retired key's envelopes are not opened")
        func quarantined() async throws -> [[String: Any]] {
            let list = try await dq(["quarantine", "list", "--json", "--config", config], environment, directory: work.path)
            return try #require(try JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [[String: Any]], "\(list.stderr)")
        }
        #expect(try await eventually { try await quarantined().count == 2 })
        for item in try await quarantined() {
            #expect((item["lastError"] as? String ?? "").hasSuffix("key k1 is retired"), "\(item)")
        }

        var keys = try await listedKeys(config, environment)
        #expect(keys.count == 2, "\(keys)")
        #expect(keys["k1"]?["state"] as? String == "retired" && keys["k2"]?["state"] as? String == "active", "\(keys)")
        #expect(keys["k1"]?["openedLast7Days"] as? Int == 0 && keys["k1"]?["openedLast30Days"] as? Int == 0, "\(keys)")
        #expect(keys["k2"]?["openedLast7Days"] as? Int == 4 && keys["k2"]?["openedLast30Days"] as? Int == 4, "\(keys)")
        #expect(keys["k2"]?["answersEmptyKeyID"] as? Bool == true && keys["k1"]?["answersEmptyKeyID"] as? Bool == false, "\(keys)")
        #expect(keys["k1"]?["spkiSHA256"] as? String == (try await opensslFingerprint(old)), "\(keys)")
        #expect(keys["k2"]?["spkiSHA256"] as? String == (try await opensslFingerprint(new)), "\(keys)")
        let k2File = keys["k2"]?["file"] as? String ?? ""
        #expect(k2File.hasSuffix("keys/k2/private-c3pro.der"), "\(keys)")

        // A state file that no longer reads: the reload is refused and the running states stay.
        try #"{"k1": "expired"}"#.write(toFile: states, atomically: true, encoding: .utf8)
        receiver.process.kill(SIGHUP)
        #expect(try await eventually { receiver.log.contains("reload refused") }, "\(receiver.log.suffix(2000))")
        let still = try await client(receiver.base, [sealedUnder(old, "k1", "r2")])
        #expect(still.first?.status == 202, "\(still)")
        #expect(try await eventually { try await quarantined().count == 3 }, "still retired: \(receiver.log.suffix(2000))")
        // A file that reads but names a key the directory does not hold: refused on SIGHUP as it is at start.
        try #"{"k1": "retired", "k2": "active", "k9": "retired"}"#.write(toFile: states, atomically: true, encoding: .utf8)
        receiver.process.kill(SIGHUP)
        let refusedTwice = try await eventually { receiver.log.components(separatedBy: "reload refused").count == 3 }
        #expect(refusedTwice, "\(receiver.log.suffix(2000))")

        // k1 made decrypt-only (no longer named), SIGHUP, and the quarantine replayed: delivered, and counted.
        try #"{"k2": "active"}"#.write(toFile: states, atomically: true, encoding: .utf8)
        receiver.process.kill(SIGHUP)
        #expect(try await eventually { receiver.log.contains("configuration reloaded") }, "\(receiver.log.suffix(2000))")
        let replayed = try await dq(["quarantine", "replay", "--all", "--json", "--config", config], environment, directory: work.path)
        #expect(replayed.status == 0, "\(replayed.stderr)")
        let delivered = try await eventually(timeout: .seconds(60)) { try await values(server).count >= 7 }
        #expect(delivered, "\(receiver.log.suffix(2000))")
        #expect(try await values(server) == ["a0", "a1", "a2", "a3", "r0", "r1", "r2"], "each once, in order")
        #expect(try await quarantined().isEmpty)
        keys = try await listedKeys(config, environment)
        #expect(keys["k1"]?["state"] as? String == "decrypt-only", "\(keys)")
        #expect(keys["k1"]?["openedLast7Days"] as? Int == 3 && keys["k2"]?["openedLast30Days"] as? Int == 4, "\(keys)")
        #expect(await receiver.stop().status == 0)
        // Durable: read again after dq serve stopped.
        keys = try await listedKeys(config, environment)
        #expect(keys["k1"]?["openedLast30Days"] as? Int == 3 && keys["k2"]?["openedLast7Days"] as? Int == 4, "\(keys)")
    }
}
