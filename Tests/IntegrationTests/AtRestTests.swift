import FHIRDataQueue
import Foundation
import GRDB
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Sealing at rest (`at_rest`): no byte of a queued resource readable in the queue's files or a `pg_dump`,
/// keys that must fit, damaged rows parked and named, and a rekey while `dq run` and producers go on; every
/// resource on sekmet-fhir as sent.
@Suite("Sealing the queue at rest", .serialized, .enabled(if: Peers.enabled))
struct AtRestTests {
    let work: TemporaryDirectory
    let resources = Resources()
    /// In every queued resource's content; must appear in no byte the queue stores.
    let marker = "MARKER" + UUID().uuidString.prefix(8).lowercased()

    init() throws { work = try TemporaryDirectory() }

    func environment(_ server: String, key: String?, database: String? = nil) -> [String: String] {
        var env = ["DQ_SERVER": server, "DQ_DATABASE": database ?? work.file("queue.sqlite"), "HOME": work.path]
        if let key { env["DQ_AT_REST_KEY_FILE"] = key }
        if database?.hasPrefix("postgres") == true { env["PGPASSWORD"] = Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "" }
        return env
    }

    /// Makes an at-rest key with `dq keygen --at-rest`; returns its file and key id.
    func keygen(_ name: String) async throws -> (file: String, id: String) {
        let file = work.file(name)
        let made = try await dq(["keygen", "--at-rest", "--out", file], ["HOME": work.path])
        #expect(made.status == 0, "\(made.stderr)")
        let id = try #require(made.stdout.split(separator: " ").dropFirst(2).first.map(String.init))
        #expect(id.count == 16 && id.allSatisfy(\.isHexDigit), "\(made.stdout)")
        let mode = try #require(try FileManager.default.attributesOfItem(atPath: file)[.posixPermissions] as? Int)
        #expect(mode & 0o777 == 0o600)
        #expect(!made.stdout.contains(try String(contentsOfFile: file, encoding: .utf8).dropFirst(14).prefix(20)), "the key is not printed")
        return (file, id)
    }

    /// NDJSON of every shape of item, each with the marker in its content: `count` Observations (POST), Patients
    /// updated with an id (PUT), Patients with a `urn:uuid` fullUrl and Observations that reference them.
    func mixedInput(observations count: Int, linked: Int) throws -> (posts: String, puts: String, linked: String) {
        let posts = (0..<count).map { resources.observation($0, extra: " \(marker)") }.joined(separator: "\n")
        let puts = (0..<linked).map {
            #"{"resourceType":"Patient","id":"rest\#($0)x\#(marker.suffix(4))","identifier":[{"system":"\#(resources.system)","value":"p\#($0)"}],"name":[{"family":"\#(marker)"}]}"#
        }.joined(separator: "\n")
        var lines: [String] = []
        for index in 0..<linked {
            let fullURL = "urn:uuid:" + UUID().uuidString.lowercased()
            lines.append(
                #"{"fullUrl":"\#(fullURL)","resource":{"resourceType":"Patient","identifier":[{"system":"\#(resources.system)","value":"l\#(index)"}],"name":[{"family":"\#(marker)"}]}}"#
            )
            lines.append(
                resources.observation(10_000 + index, extra: " \(marker)")
                    .replacingOccurrences(of: #""status":"final","#, with: #""status":"final","subject":{"reference":"\#(fullURL)"},"#))
        }
        return (
            try work.write("posts.ndjson", posts), try work.write("puts.ndjson", puts),
            try work.write("linked.ndjson", lines.joined(separator: "\n"))
        )
    }

    /// A transaction Bundle queued as one item, with the marker in its entries.
    func transaction() throws -> String {
        let patient = "urn:uuid:" + UUID().uuidString.lowercased()
        return try work.write(
            "bundle.json",
            #"""
            {"resourceType":"Bundle","type":"transaction","entry":[
             {"fullUrl":"\#(patient)","resource":{"resourceType":"Patient","identifier":[{"system":"\#(resources.system)","value":"b0"}],"name":[{"family":"\#(marker)"}]},"request":{"method":"POST","url":"Patient"}},
             {"resource":{"resourceType":"Observation","status":"final","identifier":[{"system":"\#(resources.system)","value":"b1"}],"code":{"text":"\#(marker)"},"subject":{"reference":"\#(patient)"}},"request":{"method":"POST","url":"Observation"}}]}
            """#)
    }

    /// Whether `needle` is in any of the files (missing files hold nothing).
    func found(_ needle: String, in paths: [String]) -> [String] {
        paths.filter { path in
            guard let data = FileManager.default.contents(atPath: path) else { return false }
            return data.range(of: Data(needle.utf8)) != nil
        }
    }

    func queueFiles() -> [String] {
        let database = work.file("queue.sqlite")
        return [database, database + "-wal", database + "-shm"]
    }

    @Test(
        "A sealed SQLite queue: the marker of 1,001 resources (POST, PUT with id, urn:uuid references, a transaction Bundle) is in no byte of the file, WAL or SHM; all arrive as sent"
    )
    func sealedSQLite() async throws {
        let server = try await FHIRServer.start()
        let (key, keyID) = try await keygen("rest.key")
        let env = environment(server.base, key: key)
        // Another process holds the database open throughout the enqueues (a dq run for another server), so that
        // SQLite neither checkpoints nor removes the WAL when each enqueue closes: the WAL and SHM scanned below
        // hold the enqueues' own pages.
        let holderPort = Peers.freePort()
        let holder = try ChildProcess(
            Peers.dqBinary, ["run", "--metrics-address", "127.0.0.1:\(holderPort)"],
            environment: env.merging(["DQ_SERVER": "http://127.0.0.1:9/fhir"]) { $1 })
        #expect(try await eventually { (try? await HTTP.get("http://127.0.0.1:\(holderPort)/readyz").0) == 200 }, "the holder runs")
        let input = try mixedInput(observations: 700, linked: 100)
        #expect(try await dq(["enqueue", "--ndjson", input.posts], env).status == 0)
        let puts = try await dq(["enqueue", "--ndjson", "--method", "put", input.puts], env)
        #expect(puts.status == 0, "\(puts.stderr)")
        #expect(try await dq(["enqueue", "--ndjson", input.linked], env).status == 0)
        #expect(try await dq(["enqueue", try transaction()], env).status == 0)

        let walSize = (try? FileManager.default.attributesOfItem(atPath: work.file("queue.sqlite-wal"))[.size] as? Int) ?? 0
        #expect(walSize > 100_000, "the WAL holds the enqueues while the holder keeps the database open: \(walSize) bytes")
        #expect(FileManager.default.fileExists(atPath: work.file("queue.sqlite-shm")))
        #expect(found(marker, in: queueFiles()).isEmpty, "the marker is readable in \(found(marker, in: queueFiles()))")
        #expect(found("x" + marker.suffix(4), in: queueFiles()).isEmpty)
        holder.kill(SIGTERM)
        #expect(await holder.wait(timeout: .seconds(30)).status == 0)
        #expect(found(marker, in: queueFiles()).isEmpty, "the marker is readable in \(found(marker, in: queueFiles()))")
        // The PUTs' resource ids (in their paths) are sealed too.
        #expect(found("x" + marker.suffix(4), in: queueFiles()).isEmpty)
        let status = try await dq(["status", "--json"], env)
        let summary = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(summary["pending"] as? Int == 1001)
        let atRest = try #require(summary["at_rest"] as? [String: Any])
        #expect(atRest["keys"] as? [String] == [keyID])
        #expect((atRest["items"] as? [String: Int])?[keyID] == 1001 && atRest["plain"] as? Int == 0, "\(atRest)")
        // With the key, operators see the items as they are.
        let list = try await dq(["list", "--json"], env)
        #expect(list.stdout.contains("Patient/rest0x\(marker.suffix(4))"), "\(list.stdout.prefix(400))")
        let shown = try await dq(["show", "--body", "#1"], env)
        #expect(shown.status == 0 && shown.stdout.contains(marker), "the body opened with the key: \(shown.stdout.prefix(400))")
        let logged = try await dq(["log"], env)
        #expect(logged.status == 0, "dq log reads the journal of a sealed queue: \(logged.stderr)")

        let flush = try await dq(["flush"], env)
        #expect(flush.status == 0, "\(flush.stderr)")
        let observations = try await server.resources("Observation", system: resources.system)
        #expect(observations.count == 801)
        #expect(observations.map(\.0).prefix(700) == ArraySlice((0..<700).map(String.init)), "in order")
        for (value, observation) in observations {
            let text = (observation["code"] as? [String: Any])?["text"] as? String ?? ""
            #expect(text.contains(marker), "observation \(value) arrived as sent")
        }
        let patients = try await server.resources("Patient", system: resources.system)
        #expect(patients.count == 201)
        #expect(patients.filter { $0.0.hasPrefix("p") }.allSatisfy { ($0.1["id"] as? String)?.hasPrefix("rest") == true })
        // Every reference resolved to a Patient the server holds.
        let patientIDs = Set(patients.compactMap { $0.1["id"] as? String })
        for (value, observation) in observations where value.count == 5 {
            let reference = (observation["subject"] as? [String: Any])?["reference"] as? String ?? ""
            #expect(reference.hasPrefix("Patient/") && patientIDs.contains(String(reference.dropFirst(8))), "\(value): \(reference)")
        }
        // The journal holds no content either.
        #expect(found(marker, in: queueFiles()).isEmpty)
    }

    @Test(
        "Python's cryptography opens every sealed body and path with the key file (AES-256-GCM, the item's id and queue as associated data); no nonce repeats; a row's seal under another item's id fails"
    )
    func sealedFormatIndependent() async throws {
        let (key, _) = try await keygen("independent.key")
        let env = environment("http://127.0.0.1:9/fhir", key: key)
        let input = try mixedInput(observations: 600, linked: 20)
        #expect(try await dq(["enqueue", "--ndjson", input.posts], env).status == 0)
        #expect(try await dq(["enqueue", "--ndjson", "--method", "put", input.puts], env).status == 0)
        #expect(try await dq(["enqueue", "--ndjson", input.linked], env).status == 0)
        let script = #"""
            import base64, json, sqlite3, sys
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            line = open(sys.argv[2]).read().strip()
            assert line.startswith("dq-at-rest-v1:"), "key file"
            aes = AESGCM(base64.b64decode(line[len("dq-at-rest-v1:"):]))
            def ad(column, uuid, queue):
                return ("dq-at-rest-v1\0%s\0%s\0%s" % (column, uuid.lower(), queue)).encode()
            nonces, opened, paths, ids, swapped = set(), 0, 0, 0, 0
            rows = sqlite3.connect(sys.argv[1]).execute("SELECT uuid, queue, url, resource_id, body FROM item ORDER BY seq").fetchall()
            for uuid, queue, url, resource_id, body in rows:
                assert body[:4] == b"DQS1", "body magic"
                nonces.add(body[20:32])
                plain = aes.decrypt(body[20:32], body[32:], ad("body", uuid, queue))
                length = int.from_bytes(plain[:4], "big")
                resource = json.loads(plain[4 + length:])
                assert resource["resourceType"] in ("Observation", "Patient"), resource["resourceType"]
                opened += 1
                for column, value in (("url", url), ("resource_id", resource_id)):
                    if value is None:
                        continue
                    prefix, key_id, sealed = value.split(".", 2)
                    assert prefix == "dqs1" and len(key_id) == 16
                    raw = base64.b64decode(sealed)
                    nonces.add(raw[:12])
                    text = aes.decrypt(raw[:12], raw[12:], ad(column, uuid, queue)).decode()
                    if column == "url":
                        assert text.startswith(resource["resourceType"]), text
                        paths += 1
                    else:
                        assert text == resource["id"], text
                        ids += 1
                other = rows[0][0] if uuid != rows[0][0] else rows[1][0]
                try:
                    aes.decrypt(body[20:32], body[32:], ad("body", other, queue))
                except Exception:
                    swapped += 1
            print(len(rows), opened, paths, ids, swapped, len(nonces))
            """#
        let checker = try work.write("check.py", script)
        let result = try await ChildProcess(Peers.venv + "/bin/python", [checker, work.file("queue.sqlite"), key]).wait()
        #expect(result.status == 0, "\(result.stderr)")
        let counts = result.stdout.split(whereSeparator: \.isWhitespace).compactMap { Int($0) }
        // 600 + 20 + 40 rows; every body and path opened; 20 resource ids; every swapped seal refused; one nonce
        // per sealed value (a repeated nonce under one key would break AES-GCM).
        #expect(counts == [660, 660, 660, 20, 660, 1340], "\(result.stdout) \(result.stderr)")
    }

    @Test(
        "A sealed queue keeps no resource id in what it records of a failed attempt: a PUT that finds the server down stays queued, its path in no byte of the queue's files"
    )
    func failedAttemptKeepsNoPath() async throws {
        let (key, _) = try await keygen("rest.key")
        let port = Peers.freePort()  // nothing listens there: every attempt is refused
        let env = environment("http://127.0.0.1:\(port)/fhir", key: key)
        let input = try mixedInput(observations: 0, linked: 1)
        let put = try await dq(["enqueue", "--ndjson", "--method", "put", input.puts], env)
        #expect(put.status == 0, "\(put.stderr)")
        let id = "rest0x" + marker.suffix(4)
        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 75, "\(flushed.stderr)")
        #expect(flushed.stderr.contains("no answer from http://127.0.0.1:\(port)"), "\(flushed.stderr)")
        #expect(!flushed.stderr.contains(id) && !flushed.stdout.contains(id))
        // The attempt is recorded with the item (the error text dq keeps readable beside the sealed values)...
        let listed = try await dq(["list", "--json"], env)
        #expect(listed.stdout.contains("no answer from http://127.0.0.1:\(port)"), "\(listed.stdout.prefix(600))")
        // ... and names the server, not the request: the PUT's path holds the resource's id.
        #expect(found(id, in: queueFiles()).isEmpty, "the PUT's id is readable in \(found(id, in: queueFiles()))")
    }

    @Test(
        "A service that opened the queue while it was plain, without a key, adds no readable row once dq seals it: its enqueue is a configuration error, nothing is queued"
    )
    func plainWriterAfterSealing() async throws {
        let (key, _) = try await keygen("rest.key")
        let env = environment("http://127.0.0.1:9/fhir", key: key)
        let configuration = DataQueue.Configuration(databasePath: work.file("queue.sqlite"))
        let service = try await DataQueue(baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: configuration)
        _ = try await service.enqueue(try FHIRResource(json: Data(resources.observation(0, extra: " \(marker)").utf8)))
        #expect(!found(marker, in: queueFiles()).isEmpty, "plain so far")
        // dq, with the key, seals the queue (and the item in it) as it opens it to enqueue one more.
        let one = try work.write("one.json", resources.observation(1, extra: " \(marker)"))
        let sealing = try await dq(["enqueue", one], env)
        #expect(sealing.status == 0, "\(sealing.stderr)")
        do {
            _ = try await service.enqueue(try FHIRResource(json: Data(resources.observation(2, extra: " \(marker)").utf8)))
            Issue.record("the service queued a plain item into the sealed queue")
        } catch let error as DataQueueError {
            #expect(error.code == .invalidConfiguration && error.message.contains("sealed at rest"), "\(error)")
            #expect(!error.message.contains(marker))
        }
        try await service.shutdown()
        let status = try await dq(["status", "--json"], env)
        let summary = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(summary["pending"] as? Int == 2, "\(status.stdout)")
        #expect(found(marker, in: queueFiles()).isEmpty, "the marker is readable in \(found(marker, in: queueFiles()))")
    }

    @Test("The same queue without at_rest holds the marker readable: the scan above can fail")
    func plainQueueIsReadable() async throws {
        let env = environment("http://127.0.0.1:9/fhir", key: nil)
        let input = try mixedInput(observations: 3, linked: 1)
        #expect(try await dq(["enqueue", "--ndjson", input.posts], env).status == 0)
        #expect(!found(marker, in: queueFiles()).isEmpty)
        let status = try await dq(["status"], env)
        #expect(status.stdout.contains("at rest:    not sealed"), "\(status.stdout)")
    }

    @Test(
        "A key file others can read draws the warning secrets get; a file that is not a key is 78 naming the setting; no key byte is printed"
    )
    func keyFiles() async throws {
        let (key, keyID) = try await keygen("k.key")
        let secret = try String(contentsOfFile: key, encoding: .utf8)
        chmod(key, 0o644)
        let env = environment("http://127.0.0.1:9/fhir", key: key)
        let queued = try await dq(["enqueue", try work.write("o.json", resources.observation(0))], env)
        #expect(queued.status == 0, "\(queued.stderr)")
        #expect(queued.stderr.contains("the secret file \(key) is readable by others"), "\(queued.stderr)")
        let status = try await dq(["status"], env)
        #expect(status.stdout.contains("at rest:    sealed (AES-256-GCM); key \(keyID): 1 item(s)"), "\(status.stdout)")
        let notAKey = try work.write("not.key", "hello\n")
        let refused = try await dq(["status"], environment("http://127.0.0.1:9/fhir", key: notAKey))
        #expect(refused.status == 78 && refused.stderr.contains("\"at_rest.key_file\""), "\(refused.stderr)")
        let body = String(secret.dropFirst("dq-at-rest-v1:".count).prefix(24))
        for result in [queued, status, refused] { #expect(!(result.stdout + result.stderr).contains(body)) }
    }

    @Test(
        "No key, the wrong key: 78 naming the key the queue needs, nothing sent or changed; a flipped byte and a row copied over another are parked and named; the rest is delivered (65)"
    )
    func keysAndDamage() async throws {
        let server = try await FHIRServer.start()
        let (key, keyID) = try await keygen("a.key")
        let (other, otherID) = try await keygen("b.key")
        let env = environment(server.base, key: key)
        let file = try work.write("five.ndjson", (0..<5).map { resources.observation($0, extra: " \(marker)") }.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)

        for (name, attempt) in [("no key", environment(server.base, key: nil)), ("the wrong key", environment(server.base, key: other))] {
            let flush = try await dq(["flush"], attempt)
            #expect(flush.status == 78, "\(name): \(flush.stderr)")
            #expect(flush.stderr.contains(keyID), "\(name) names the key the queue needs: \(flush.stderr)")
            let enqueue = try await dq(["enqueue", try work.write("late.json", resources.observation(9))], attempt)
            #expect(enqueue.status == 78, "\(name): plain or foreign items are refused: \(enqueue.stderr)")
        }
        #expect(try await dq(["flush"], environment(server.base, key: other)).stderr.contains(otherID))
        #expect(try await server.values("Observation", system: resources.system).isEmpty, "nothing was sent")
        // Read without the key: the counts, not the content.
        let status = try await dq(["status", "--json"], environment(server.base, key: nil))
        #expect(status.status == 0, "\(status.stderr)")
        let counts = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(counts["pending"] as? Int == 5, "\(status.stdout)")
        let show = try await dq(["show", "--body", "#2"], environment(server.base, key: nil))
        #expect(show.status != 0 && show.stderr.contains(keyID), "\(show.stdout)\(show.stderr)")

        // A flipped byte in item 2's body; item 4 given item 3's sealed values (a row copied over another).
        let database = try DatabaseQueue(path: work.file("queue.sqlite"))
        try await database.write { db in
            let sequences = try Int64.fetchAll(db, sql: "SELECT seq FROM item ORDER BY seq")
            #expect(sequences.count == 5)
            try db.execute(
                sql: "UPDATE item SET body = substr(body, 1, 40) || X'00' || substr(body, 42) WHERE seq = ?", arguments: [sequences[1]])
            try db.execute(
                sql: """
                    UPDATE item SET body = (SELECT body FROM item WHERE seq = ?), url = (SELECT url FROM item WHERE seq = ?)
                    WHERE seq = ?
                    """, arguments: [sequences[2], sequences[2], sequences[3]])
        }
        try database.close()
        let flush = try await dq(["flush", "--json"], env)
        #expect(flush.status == 65, "\(flush.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "2", "4"])
        let parked = try await dq(["list", "--parked", "--json"], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [[String: Any]])
        #expect(items.count == 2)
        for item in items {
            #expect((item["lastError"] as? String ?? "").contains("does not verify"), "\(item)")
        }
    }

    @Test(
        "Turning at_rest on seals what is queued; dq rekey under a running dq run with producers: every item delivered once, in order, none left under the old key"
    )
    func rekeyUnderLoad() async throws {
        let server = try FHIRServer()  // down at first: items wait
        let (_, firstID) = try await keygen("first.key")
        let (_, secondID) = try await keygen("second.key")
        let database = work.file("queue.sqlite")
        let plainEnv = ["DQ_DATABASE": database, "HOME": work.path, "DQ_SERVER": server.base]
        // Queued before at_rest was set: sealed when a queue with a key opens it.
        let early = try work.write("early.ndjson", (0..<20).map { resources.observation($0, extra: " \(marker)") }.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", early], plainEnv).status == 0)
        #expect(!found(marker, in: queueFiles()).isEmpty)
        let config = try work.write(
            "dq.json",
            #"{"server": "\#(server.base)", "retry": {"initial_seconds": 0.1, "maximum_seconds": 0.3}, "at_rest": {"key_file": "first.key"}}"#
        )
        let env = ["DQ_DATABASE": database, "HOME": work.path, "DQ_LOG_LEVEL": "notice"]
        let status = try await dq(["status", "--json", "--config", config], env)
        let sealing = try #require(
            (try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])?["at_rest"] as? [String: Any])
        #expect(sealing["plain"] as? Int == 20, "read-only: not sealed yet: \(sealing)")
        #expect(try await dq(["enqueue", "--config", config, try work.write("one.json", resources.observation(20))], env).status == 0)
        #expect(found(marker, in: queueFiles()).isEmpty, "the queue opened with a key sealed the 20 early items")

        // dq run starts while the server is still down: what is queued waits, sealed under the first key.
        let run = try ChildProcess(Peers.dqBinary, ["run", "--config", config, "--poll-interval", "0.1"], environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        // Producers go on throughout (each enqueue reads the configuration when it starts).
        let producer = Task {
            var next = 21
            while !Task.isCancelled && next < 400 {
                let batch = (next..<next + 10).map { resources.observation($0, extra: " \(marker)") }.joined(separator: "\n")
                let file = try work.write("p\(next).ndjson", batch)
                let result = try await dq(["enqueue", "--config", config, "--ndjson", file], env)
                if result.status != 0 { throw TestFailure("enqueue failed: \(result.stderr)") }
                next += 10
            }
            return next
        }
        // dq run is up (its signal handlers too) once it has tried the server that is down.
        #expect(try await eventually { log().contains("delivery stopped") }, "\(log())")
        // The rotation: the new key seals, the old one opens; dq run reloads; then dq rekey reseals the rest.
        try Data(
            #"{"server": "\#(server.base)", "retry": {"initial_seconds": 0.1, "maximum_seconds": 0.3}, "at_rest": {"key_file": "second.key", "old_key_files": ["first.key"]}}"#
                .utf8
        ).write(to: URL(fileURLWithPath: config))
        run.kill(SIGHUP)
        #expect(try await eventually { log().contains("configuration reloaded") }, "\(log())")
        let rekey = try await dq(["rekey", "--config", config, "--json"], env)
        #expect(rekey.status == 0, "\(rekey.stderr)")
        let report = try #require(try JSONSerialization.jsonObject(with: Data(rekey.stdout.utf8)) as? [String: Any])
        #expect((report["resealed"] as? Int ?? 0) >= 21, "the items sealed under the first key were sealed again: \(report)")
        try await server.start()
        let produced = try await producer.value
        #expect(produced == 401)
        #expect(
            try await eventually(timeout: .seconds(120)) {
                try await server.values("Observation", system: resources.system).count >= produced
            }, "\(log().suffix(2000))")
        run.kill(SIGTERM)
        let result = await run.wait(timeout: .seconds(30))
        #expect(result.status == 0, "\(result.stderr.suffix(2000))")
        #expect(try await server.values("Observation", system: resources.system) == (0..<produced).map(String.init), "once each, in order")
        // Nothing is left under the first key: a rekey now names it as unused.
        let after = try await dq(["rekey", "--config", config], env)
        #expect(after.status == 0 && after.stdout.contains("key \(firstID) seals no item any more"), "\(after.stdout)\(after.stderr)")
        let final = try await dq(["status", "--json", "--config", config], env)
        let finalSealing = try #require(
            (try JSONSerialization.jsonObject(with: Data(final.stdout.utf8)) as? [String: Any])?["at_rest"] as? [String: Any])
        #expect((finalSealing["items"] as? [String: Int])?[firstID] == nil, "\(finalSealing)")
        #expect(Set(finalSealing["keys"] as? [String] ?? []) == [firstID, secondID], "\(finalSealing)")
        #expect(found(marker, in: queueFiles()).isEmpty)
    }

    /// A producer that reads a rotated configuration before dq run does seals under a key dq run does not hold
    /// yet. That is dq run's configuration lagging, not a damaged row: nothing is parked or sent, the flush says
    /// which key it needs, and the SIGHUP that brings the key delivers the item.
    @Test(
        "An item sealed under a key dq run does not hold yet (a rotation it has not reloaded) is neither parked nor sent; after SIGHUP it is delivered"
    )
    func keyNotYetReloaded() async throws {
        let server = try await FHIRServer.start()
        _ = try await keygen("old.key")
        let (_, newID) = try await keygen("new.key")
        let retry = #""retry": {"initial_seconds": 0.1, "maximum_seconds": 0.3}"#
        let config = try work.write("run.json", #"{"server": "\#(server.base)", \#(retry), "at_rest": {"key_file": "old.key"}}"#)
        let rotated = try work.write(
            "rotated.json", #"{"server": "\#(server.base)", \#(retry), "at_rest": {"key_file": "new.key", "old_key_files": ["old.key"]}}"#)
        let env = ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path, "DQ_LOG_LEVEL": "notice"]
        #expect(try await dq(["enqueue", "--config", config, try work.write("o0.json", resources.observation(0))], env).status == 0)
        let port = Peers.freePort()
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--config", config, "--poll-interval", "0.1", "--metrics-address", "127.0.0.1:\(port)"],
            environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { try await server.values("Observation", system: resources.system) == ["0"] }, "\(log())")
        /// `dq_flush_errors_total` of `kind`, from dq run's /metrics.
        func flushErrors(_ kind: String) async -> Double {
            guard let (_, body) = try? await HTTP.get("http://127.0.0.1:\(port)/metrics") else { return 0 }
            let line = String(decoding: body, as: UTF8.self).split(separator: "\n")
                .first { $0.hasPrefix("dq_flush_errors_total{") && $0.contains("kind=\"\(kind)\"") }
            return line.flatMap { $0.split(separator: " ").last.flatMap { Double($0) } } ?? 0
        }

        // The producer has the rotated configuration already; dq run has not.
        #expect(try await dq(["enqueue", "--config", rotated, try work.write("o1.json", resources.observation(1))], env).status == 0)
        #expect(try await eventually { log().contains("which is not configured") }, "\(log())")
        #expect(log().contains(newID), "the key it needs is named: \(log())")
        #expect(await flushErrors("configuration") >= 1, "counted as a configuration error of the flush")
        #expect((try? await HTTP.get("http://127.0.0.1:\(port)/readyz").0) == 503, "not ready until the key is configured")
        let parked = try await dq(["status", "--json", "--config", rotated], env)
        let counts = try #require(try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [String: Any])
        #expect(counts["parked"] as? Int == 0 && counts["pending"] as? Int == 1, "\(parked.stdout)")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])
        // A one-shot flush without the key says the same, exit 78, and changes nothing. It waits for the lock: dq run
        // takes it for each of its own tries (a flush that found it taken exited 75, "another flush is running").
        let oneShot = try await dq(["flush", "--config", config, "--now", "--wait", "60"], env)
        #expect(oneShot.status == 78 && oneShot.stderr.contains(newID), "\(oneShot.status) \(oneShot.stderr)")

        try FileManager.default.removeItem(atPath: config)
        try FileManager.default.copyItem(atPath: rotated, toPath: config)
        run.kill(SIGHUP)
        #expect(
            try await eventually { try await server.values("Observation", system: resources.system) == ["0", "1"] }, "\(log())")
        run.kill(SIGTERM)
        #expect(await run.wait(timeout: .seconds(30)).status == 0)
        let after = try await dq(["status", "--json", "--config", config], env)
        let final = try #require(try JSONSerialization.jsonObject(with: Data(after.stdout.utf8)) as? [String: Any])
        #expect(final["parked"] as? Int == 0 && final["pending"] as? Int == 0, "\(after.stdout)")
    }

    @Test(
        "A SIGHUP while dq run opens the queue (sealing 20,000 items queued before at_rest) does not end it and is not lost: the configuration is read again once the service runs; all arrive"
    )
    func hangupWhileOpening() async throws {
        let server = try await FHIRServer.start()
        let (key, _) = try await keygen("open.key")
        let count = 20_000
        let lines = try work.write("many.ndjson", resources.ndjson(0..<count))
        #expect(try await dq(["enqueue", "--ndjson", lines], environment(server.base, key: nil)).status == 0)
        var env = environment(server.base, key: key)
        env["DQ_LOG_LEVEL"] = "notice"
        let run = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.1"], environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { log().contains("sealing the items queued before at_rest was set") }, "\(log())")
        #expect(!log().contains("sealed the items queued"), "the SIGHUP below comes while the queue opens")
        run.kill(SIGHUP)
        // Until the queue is empty, looked at once a second (reading the server's history of 20,000 resources in a
        // tight loop would starve the tests that run beside this one).
        var drained = false
        for _ in 0..<240 where !drained && run.isRunning {
            try await Task.sleep(for: .seconds(1))
            let status = try await dq(["status", "--json"], env)
            let counts = try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any]
            drained = counts?["pending"] as? Int == 0 && counts?["parked"] as? Int == 0
        }
        #expect(drained, "\(log().suffix(1000))")
        #expect(run.isRunning, "a SIGHUP before the reload service listens is not the end of dq run")
        #expect(log().contains("configuration reloaded"), "the SIGHUP that came while the queue opened was lost: \(log().suffix(1000))")
        run.kill(SIGTERM)
        #expect(await run.wait(timeout: .seconds(30)).status == 0)
        #expect(try await server.values("Observation", system: resources.system) == (0..<count).map(String.init))
    }

    @Test("A sealed PostgreSQL queue: the marker is in no byte of a pg_dump; every resource arrives; no key is 78")
    func sealedPostgres() async throws {
        let server = try await FHIRServer.start()
        let (key, keyID) = try await keygen("pg.key")
        let database = try await PostgresTests.freshDatabase()
        let env = environment(server.base, key: key, database: database)
        // 1,001 resources, as in the SQLite proof: 700 POSTs, 100 PUTs with an id, 100 Patients with a urn:uuid and
        // 100 Observations referencing them, one transaction Bundle.
        let input = try mixedInput(observations: 700, linked: 100)
        #expect(try await dq(["enqueue", "--ndjson", input.posts], env).status == 0)
        #expect(try await dq(["enqueue", "--ndjson", "--method", "put", input.puts], env).status == 0)
        #expect(try await dq(["enqueue", "--ndjson", input.linked], env).status == 0)
        #expect(try await dq(["enqueue", try transaction()], env).status == 0)

        // pg_dump writes bytea as hex: the marker is looked for as text and as hex.
        let hex = marker.utf8.map { String(format: "%02x", $0) }.joined()
        let dump = try await pgDump(database)
        #expect(dump.contains("dq_item"), "the dump holds the queue")
        #expect(!dump.contains(marker) && !dump.contains(hex), "the marker is readable in the dump")
        // The PUTs' resource ids (in their paths) are sealed too.
        let putID = "x" + marker.suffix(4)
        #expect(!dump.contains(putID) && !dump.contains(putID.utf8.map { String(format: "%02x", $0) }.joined()))
        // The same items in a plain queue are readable in its dump: the scan can fail.
        let plain = try await PostgresTests.freshDatabase()
        #expect(try await dq(["enqueue", "--ndjson", input.posts], environment(server.base, key: nil, database: plain)).status == 0)
        #expect(try await pgDump(plain).contains(hex))
        let refused = try await dq(["flush"], environment(server.base, key: nil, database: database))
        #expect(refused.status == 78 && refused.stderr.contains(keyID), "\(refused.stderr)")

        #expect(try await dq(["flush"], env).status == 0)
        let observations = try await server.resources("Observation", system: resources.system)
        #expect(observations.count == 801)
        #expect(observations.allSatisfy { (($0.1["code"] as? [String: Any])?["text"] as? String ?? "").contains(marker) })
        #expect(try await server.resources("Patient", system: resources.system).count == 201)
        let after = try await pgDump(database)
        #expect(!after.contains(marker) && !after.contains(hex))
    }

    /// `pg_dump` of the test server's database `url` (data and schema, as text).
    func pgDump(_ url: String) async throws -> String {
        let components = try #require(URLComponents(string: url))
        let result = try await ChildProcess(
            "/usr/bin/pg_dump",
            [
                "-h", components.host ?? "127.0.0.1", "-p", String(components.port ?? 5432), "-U", components.user ?? "dq", "-d",
                String(components.path.dropFirst()),
            ],
            environment: ["PGPASSWORD": Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "", "PATH": "/usr/bin:/bin"]
        ).wait()
        try #require(result.status == 0, "pg_dump failed: \(result.stderr.prefix(300))")
        return result.stdout
    }
}
