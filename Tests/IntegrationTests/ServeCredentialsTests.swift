import Foundation
import Testing

/// `dq serve import-credentials`: the clients of a C3-PRO server, from a CSV export of its `Users` table hashed as
/// its Java receiver hashed (SHA-1, then Base64: here by Python's hashlib, independent of dq), in SQLite and in
/// PostgreSQL.
extension ServeTrustSuite {
    /// Clients as C3-PRO's `RegisterServer` made them (a UUID and the Base64 of 64 random bytes, which holds `+`, `/`
    /// and `=`), and a CSV of their `Users` rows as an export writes it: a header and every field quoted. The rows
    /// after the good ones are malformed: a hash that is not Base64, one that is not 20 bytes, a row with one
    /// column, an empty username.
    func c3proUsers(count: Int, file: String) async throws -> [(id: String, secret: String)] {
        let script = """
            import base64, csv, hashlib, json, os, sys, uuid
            clients = []
            while len(clients) < \(count):
                secret = base64.b64encode(os.urandom(64)).decode()
                if "+" not in secret or "/" not in secret:
                    continue
                clients.append({"id": str(uuid.uuid4()), "secret": secret})
            with open(sys.argv[1], "w", newline="") as f:
                writer = csv.writer(f, quoting=csv.QUOTE_ALL)
                writer.writerow(["USERNAME", "PASSWD"])
                for c in clients:
                    writer.writerow([c["id"], base64.b64encode(hashlib.sha1(c["secret"].encode()).digest()).decode()])
                writer.writerow([str(uuid.uuid4()), "not base64 at all!"])
                writer.writerow([str(uuid.uuid4()), base64.b64encode(hashlib.sha256(b"x").digest()).decode()])
                writer.writerow([str(uuid.uuid4())])
                writer.writerow(["", base64.b64encode(hashlib.sha1(b"x").digest()).decode()])
            json.dump(clients, sys.stdout)
            """
        let result = try await ChildProcess("/usr/bin/env", ["python3", "-c", script, file]).wait()
        #expect(result.status == 0, "\(result.stderr)")
        let clients = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [[String: String]])
        return clients.map { ($0["id"] ?? "", $0["secret"] ?? "") }
    }

    /// The stored secret hash of each client id, read from the database with sqlite3 or psql.
    func storedHashes(database: String) async throws -> [String: String] {
        let query = "SELECT client_id || '|' || secret_hash FROM dq_clients;"
        let result: ProcessResult
        if database.hasPrefix("postgres") {
            let components = try #require(URLComponents(string: database))
            result = try await ChildProcess(
                "/usr/bin/psql",
                [
                    "-h", components.host ?? "127.0.0.1", "-p", String(components.port ?? 5432), "-U", components.user ?? "dq", "-d",
                    String(components.path.dropFirst()), "-tAc", query,
                ],
                environment: ["PGPASSWORD": Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "", "PATH": "/usr/bin:/bin"]
            ).wait()
        } else {
            result = try await ChildProcess("/usr/bin/sqlite3", [database], stdin: Data(".timeout 5000\n\(query)\n".utf8)).wait()
        }
        #expect(result.status == 0, "\(result.stderr)")
        var hashes: [String: String] = [:]
        for line in result.stdout.split(separator: "\n") {
            let parts = line.split(separator: "|", maxSplits: 1)
            if parts.count == 2 { hashes[String(parts[0])] = String(parts[1]) }
        }
        return hashes
    }

    /// `dq.json` for the queue in SQLite (`queue.sqlite`) or in a fresh PostgreSQL database: the file, the database
    /// (a path or a URL) and the environment dq needs for it.
    func configure(server: String, store: String, serve extra: [String: Any?] = [:]) async throws -> (
        config: String, database: String, environment: [String: String]
    ) {
        var config = try await configure(server: server, serve: extra)
        var database = work.file("queue.sqlite")
        var environment = ["HOME": work.path]
        if store == "postgres" {
            database = try await PostgresTests.freshDatabase()
            environment["PGPASSWORD"] = Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""
            var root = try #require(
                try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: config))) as? [String: Any])
            root["database"] = database
            config = try work.write("dq-postgres.json", String(decoding: try JSONSerialization.data(withJSONObject: root), as: UTF8.self))
        }
        return (config, database, environment)
    }

    @Test(
        "dq serve import-credentials takes a C3-PRO Users CSV (SHA-1/Base64, header, quoting) into SQLite or PostgreSQL: refuses malformed rows by line, the old secret gets a token (raw and form-encoded) and its hash is upgraded, a wrong secret is refused, a second import skips all and overwrites nothing",
        arguments: ["sqlite", "postgres"])
    func importCredentials(store: String) async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let (config, database, environment) = try await configure(server: server.base, store: store)
        let csv = work.file("users.csv")
        let clients = try await c3proUsers(count: 3, file: csv)
        func importing(_ file: String) async throws -> (ProcessResult, [String: Any]) {
            let result = try await dq(
                ["serve", "import-credentials", file, "--json", "--config", config], environment, directory: work.path)
            return (result, (try? JSONSerialization.jsonObject(with: Data(result.stdout.utf8))) as? [String: Any] ?? [:])
        }

        let (first, report) = try await importing(csv)
        #expect(first.status == 0, "\(first.stdout) \(first.stderr)")
        #expect(report["taken"] as? Int == 3 && report["skipped"] as? Int == 0 && report["refused"] as? Int == 4, "\(first.stdout)")
        let refusals = report["refusals"] as? [[String: Any]] ?? []
        #expect(refusals.map { $0["line"] as? Int ?? 0 } == [5, 6, 7, 8], "the lines of the bad rows (1 is the header): \(refusals)")
        for client in clients {
            #expect(!first.stdout.contains(client.secret) && !first.stderr.contains(client.secret), "no secret printed")
        }
        var hashes = try await storedHashes(database: database)
        #expect(hashes.count == 3, "only the good rows: \(hashes.keys.sorted())")
        for client in clients { #expect(hashes[client.id]?.hasPrefix("sha1b64$") == true, "\(hashes)") }

        let receiver = try await start(config, environment: environment)
        let answers = try await self.client(
            receiver.base,
            [
                tokenRequest(clients[0]), tokenRequest(clients[1], formEncoded: true), tokenRequest(clients[0], formEncoded: true),
                tokenRequest((clients[2].id, clients[2].secret + "x")), tokenRequest((clients[2].id, clients[0].secret)),
            ])
        #expect(answers.map(\.status) == [200, 200, 200, 401, 401], "\(answers)")
        hashes = try await storedHashes(database: database)
        #expect(hashes[clients[0].id]?.hasPrefix("scrypt$") == true, "upgraded on first use: \(hashes)")
        #expect(hashes[clients[1].id]?.hasPrefix("scrypt$") == true, "upgraded on first use: \(hashes)")
        #expect(hashes[clients[2].id]?.hasPrefix("sha1b64$") == true, "a wrong secret upgrades nothing: \(hashes)")
        // The token is one: an envelope posted with it reaches the server.
        let token = try #require(answers.first?.object["access_token"] as? String, "\(answers)")
        let posted = try await self.client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("ic0"), certificate: keys.certificate, keyID: "k1", token: token)])
        #expect(posted.first?.status == 202, "\(posted)")
        #expect(try await eventually { try await values(server) == ["ic0"] }, "\(receiver.log.suffix(2000))")

        // Again: all skipped, the upgraded hashes left as they are.
        let (second, again) = try await importing(csv)
        #expect(second.status == 0, "\(second.stderr)")
        #expect(again["taken"] as? Int == 0 && again["skipped"] as? Int == 3, "\(second.stdout)")
        #expect(try await storedHashes(database: database) == hashes, "an import overwrites nothing")
        let later = try await self.client(receiver.base, [tokenRequest(clients[1])])
        #expect(later.map(\.status) == [200], "\(later)")
        #expect(await receiver.stop().status == 0)

        // Every row refused: 65; a file that cannot be read: 66; the text output names lines, never a secret.
        let bad = try work.write("bad.csv", "username,passwd\r\nabc,???\r\n\"unclosed,x\n")
        let (refused, _) = try await importing(bad)
        #expect(refused.status == 65, "\(refused.stdout) \(refused.stderr)")
        let text = try await dq(["serve", "import-credentials", bad, "--config", config], environment, directory: work.path)
        #expect(text.status == 65 && text.stderr.contains("bad.csv:2:") && text.stderr.contains("bad.csv:3:"), "\(text.stderr)")
        let (missing, _) = try await importing(work.file("absent.csv"))
        #expect(missing.status == 66, "\(missing.stderr)")
        #expect(try await storedHashes(database: database) == hashes, "nothing stored by the refused imports")
    }
}
