import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// The queue in PostgreSQL (the server `make test` starts from Debian's packages), through the `dq` command
/// line, against sekmet-fhir.
@Suite("One queue in PostgreSQL shared by several dq processes", .serialized, .enabled(if: Peers.enabled))
struct PostgresTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    /// A new database on the test server.
    static func freshDatabase() async throws -> String {
        let environment = Peers.environment
        let base = try #require(environment["DQ_TEST_POSTGRES_URL"], "no PostgreSQL for the tests: run make test")
        var components = try #require(URLComponents(string: base))
        let name = "dq_it_" + UUID().uuidString.prefix(12).lowercased().replacingOccurrences(of: "-", with: "")
        try await psql(base, "CREATE DATABASE \(name)")
        components.path = "/" + name
        components.query = "sslmode=disable"
        return components.string!
    }

    /// Runs `sql` with `psql` on the test server's database `url`, waiting without holding a thread of the
    /// cooperative pool.
    static func psql(_ url: String, _ sql: String) async throws {
        let components = try #require(URLComponents(string: url))
        let arguments = [
            "-h", components.host ?? "127.0.0.1", "-p", String(components.port ?? 5432), "-U", components.user ?? "dq", "-d",
            String(components.path.dropFirst()), "-v", "ON_ERROR_STOP=1", "-qc", sql,
        ]
        let result = try await ChildProcess(
            "/usr/bin/psql", arguments,
            environment: ["PGPASSWORD": Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "", "PATH": "/usr/bin:/bin"]
        ).wait()
        try #require(result.status == 0, "psql failed: \(sql.prefix(80)): \(result.stderr.prefix(300))")
    }

    @Test("A PostgreSQL that cannot be used is named at once: a refused password 77, TLS the server lacks 78, nothing listening 75")
    func connectionFailuresNamed() async throws {
        let database = try await Self.freshDatabase()
        let file = try work.write("o.json", resources.observation(0))
        var env = environment("http://127.0.0.1:9/fhir", database: database)
        env["PGPASSWORD"] = "not-the-password"
        let refused = try await dq(["enqueue", file], env)
        #expect(refused.status == 77, "\(refused.stderr)")
        #expect(refused.stderr.contains("refused the login (28P01"), "\(refused.stderr)")
        #expect(!refused.stderr.contains("not-the-password"))

        let tls = try await dq(
            ["enqueue", file],
            environment("http://127.0.0.1:9/fhir", database: database.replacingOccurrences(of: "sslmode=disable", with: "sslmode=require")))
        #expect(tls.status == 78 && tls.stderr.contains("does not offer TLS"), "\(tls.stderr)")

        var components = try #require(URLComponents(string: database))
        components.port = Peers.freePort()
        let down = try await dq(["enqueue", file], environment("http://127.0.0.1:9/fhir", database: components.string!))
        #expect(down.status == 75 && down.stderr.contains("connection refused"), "\(down.stderr)")
        // Each was named by its own connection attempt (the pool alone said "did not answer within 15 s").
        for result in [refused, tls, down] { #expect(!result.stderr.contains("did not answer")) }

        // dq run, a daemon, waits for a database that does not answer (a failover, a server not up yet) instead of
        // ending (a runner restarted during a failover died with 75 and stayed down); a refused login still ends it.
        var waitingEnvironment = environment("http://127.0.0.1:9/fhir", database: components.string!)
        waitingEnvironment["DQ_LOG_LEVEL"] = "notice"
        let waiting = try ChildProcess(Peers.dqBinary, ["run"], environment: waitingEnvironment)
        let said = try await eventually(timeout: .seconds(30)) {
            ((try? String(contentsOfFile: waiting.stderrPath, encoding: .utf8)) ?? "").contains("trying again until it answers")
        }
        #expect(said, "\((try? String(contentsOfFile: waiting.stderrPath, encoding: .utf8)) ?? "")")
        try await Task.sleep(for: .seconds(2))
        #expect(waiting.isRunning, "still waiting, not ended")
        // SIGTERM while it waits for the database: it stops there, cleanly (the default action ended it with 15).
        waiting.kill(SIGTERM)
        let stopped = await waiting.wait(timeout: .seconds(60))
        #expect(stopped.status == 0 && stopped.stderr.contains("stopped before delivery began"), "\(stopped.stderr)")
        let refusedRun = try await ChildProcess(Peers.dqBinary, ["run"], environment: env).wait(timeout: .seconds(60))
        #expect(refusedRun.status == 77, "\(refusedRun.stderr)")
    }

    @Test(
        "libpq's environment and password file: postgres:/// with PGHOST, PGPORT, PGUSER, PGDATABASE and ~/.pgpass; a .pgpass others can read is not used"
    )
    func libpqEnvironment() async throws {
        let database = try #require(URLComponents(string: try await Self.freshDatabase()))
        let password = Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""
        let pgpass = work.file(".pgpass")
        let line = "\(database.host ?? ""):\(database.port ?? 5432):*:\(database.user ?? ""):\(password)\n"
        _ = FileManager.default.createFile(
            atPath: pgpass, contents: Data(("# dq test\nother:1:x:y:z\n" + line).utf8), attributes: [.posixPermissions: 0o600])
        let env = [
            "DQ_SERVER": "http://127.0.0.1:9/fhir", "DQ_DATABASE": "postgres:///?sslmode=disable", "HOME": work.path,
            "PGHOST": database.host ?? "", "PGPORT": String(database.port ?? 5432), "PGUSER": database.user ?? "",
            "PGDATABASE": String(database.path.dropFirst()),
        ]
        let file = try work.write("o.json", resources.observation(0))
        let queued = try await dq(["enqueue", file], env)
        #expect(queued.status == 0, "\(queued.stderr)")
        let status = try await dq(["status", "--json"], env)
        #expect(
            status.status == 0 && (status.stdout.contains(#""pending" : 1"#) || status.stdout.contains(#""pending":1"#)),
            "\(status.stdout)\(status.stderr)")
        #expect(!status.stdout.contains(password) && !status.stderr.contains(password))

        chmod(pgpass, 0o644)
        let ignored = try await dq(["status"], env)
        #expect(ignored.status == 77, "a password file others can read is not used, as libpq: \(ignored.stderr)")
    }

    @Test("At trace level no authentication exchange and no body of PostgreSQL's protocol reaches the log")
    func traceLogsNoSecrets() async throws {
        let database = try await Self.freshDatabase()
        var env = environment("http://127.0.0.1:9/fhir", database: database)
        env["DQ_LOG_LEVEL"] = "trace"
        let marker = "secret-body-\(UUID().uuidString.prefix(8))"
        let file = try work.write("o.json", resources.observation(0, extra: marker))
        let result = try await dq(["enqueue", file], env)
        #expect(result.status == 0, "\(result.stderr)")
        let text = result.stdout + result.stderr
        for secret in ["Sasl", "SASL", "sasl", marker, Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "-"] {
            #expect(!text.contains(secret), "\(secret) in the log")
        }
    }

    func environment(_ server: String, database: String) -> [String: String] {
        [
            "DQ_SERVER": server, "DQ_DATABASE": database, "DQ_IDEMPOTENT": "true", "HOME": work.path,
            "PGPASSWORD": Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "",
        ]
    }

    @Test("enqueue, flush, status, list, show, retry, drop and log work on a PostgreSQL queue; the password is never shown")
    func commands() async throws {
        let server = try await FHIRServer.start()
        let database = try await Self.freshDatabase()
        let env = environment(server.base, database: database)
        for index in 0..<3 {
            let queued = try await dq(["enqueue", try work.write("o\(index).json", resources.observation(index))], env)
            #expect(queued.status == 0, "\(queued.stderr)")
        }
        let bad = try await dq(["enqueue", try work.write("bad.json", resources.invalid(3))], env)
        #expect(bad.status == 0)
        let listed = try await dq(["list"], env)
        #expect(listed.status == 0 && listed.stdout.split(separator: "\n").count >= 4, "\(listed.stdout)")
        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 65, "one item rejected and parked: \(flushed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2"])
        let status = try await dq(["status", "--json"], env)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(object["delivered"] as? Int == 3 && object["parked"] as? Int == 1 && object["pending"] as? Int == 0)
        let parked = try await dq(["list", "--parked", "--json"], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [[String: Any]])
        let id = try #require(items.first?["id"] as? String)
        #expect(try await dq(["show", id], env).status == 0)
        #expect(try await dq(["retry", id], env).status == 0)
        #expect(try await dq(["drop", id], env).status == 0)
        let log = try await dq(["log"], env)
        #expect(log.stdout.contains("dropped") && log.stdout.contains("parked"), "\(log.stdout)")
        let all = try await dq(["status", "--all"], ["DQ_DATABASE": database, "HOME": work.path, "PGPASSWORD": env["PGPASSWORD"]!])
        #expect(all.status == 0 && all.stdout.contains(server.base), "\(all.stderr)")
        let password = env["PGPASSWORD"]!
        let withPassword = database.replacingOccurrences(of: "postgres://dq@", with: "postgres://dq:\(password)@")
        var secretEnv = env
        secretEnv["DQ_DATABASE"] = withPassword
        secretEnv["PGPASSWORD"] = nil
        let shown = try await dq(["status"], secretEnv)
        #expect(shown.status == 0, "\(shown.stderr)")
        #expect(!(shown.stdout + shown.stderr).contains(password), "the password never appears")
    }

    /// A database an earlier dq made has only the v1 enqueue procedures (no client column in them): dq adds its
    /// v2 procedures at start, leaves v1 for that earlier dq, and enqueues (single and many) work on it.
    @Test("A queue made before the v2 enqueue procedures gets them at start, keeps v1, and enqueues one and many")
    func enqueueProceduresUpgraded() async throws {
        let database = try await Self.freshDatabase()
        let env = environment("http://127.0.0.1:9/fhir", database: database)
        #expect(try await dq(["enqueue", try work.write("o0.json", resources.observation(0))], env).status == 0)
        // As an earlier dq left it: its own procedure (v1, made here as that dq made it), none of the v2.
        try await Self.psql(
            database,
            """
            DROP PROCEDURE dq_enqueue_one_v2(uuid,text,text,text,text,text,bool,text,bytea,text,text,double precision,bigint);
            DROP PROCEDURE dq_enqueue_many_v2(bigint,uuid[],text[],text[],text[],text[],text[],bool[],text[],bytea[],text[],text[],double precision,bigint);
            CREATE PROCEDURE dq_enqueue_one_v1(p_uuid uuid, p_queue text, p_method text, p_url text, p_type text, p_id text,
              p_encrypted bool, p_content_type text, p_body bytea, p_full_url text, p_at double precision,
              INOUT o_first bigint DEFAULT NULL)
            LANGUAGE plpgsql AS $proc$
            BEGIN
              UPDATE dq_meta SET next_seq = next_seq + 1 WHERE id = 1 RETURNING next_seq INTO o_first;
              INSERT INTO dq_item (seq, uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body,
                                   full_url, enqueued_at)
              VALUES (o_first, p_uuid, p_queue, p_method, p_url, p_type, NULLIF(p_id, ''), p_encrypted, p_content_type, p_body,
                      NULLIF(p_full_url, ''), p_at);
              COMMIT;
            END $proc$
            """)
        // The earlier dq's enqueue still works beside the new one's.
        try await Self.psql(
            database,
            "CALL dq_enqueue_one_v1(gen_random_uuid(), 'q-old', 'POST', 'Observation', 'Observation', '', false, 'application/fhir+json', '{}'::bytea, '', 0, NULL)"
        )
        let one = try await dq(["enqueue", try work.write("o1.json", resources.observation(1))], env)
        #expect(one.status == 0, "\(one.stderr)")
        let many = try await dq(["enqueue", "--ndjson", try work.write("many.ndjson", resources.ndjson(2..<5))], env)
        #expect(many.status == 0, "\(many.stderr)")
        let procedures = try await Self.psqlValue(
            database, "SELECT string_agg(proname, ',' ORDER BY proname) FROM pg_proc WHERE proname LIKE 'dq_enqueue_%'")
        #expect(procedures == "dq_enqueue_many_v2,dq_enqueue_one_v1,dq_enqueue_one_v2")
        #expect(try await Self.psqlValue(database, "SELECT count(*) FROM dq_item") == "6")
    }

    /// The one value `sql` selects on `url`, as `psql -tA` prints it.
    static func psqlValue(_ url: String, _ sql: String) async throws -> String {
        let components = try #require(URLComponents(string: url))
        let result = try await ChildProcess(
            "/usr/bin/psql",
            [
                "-h", components.host ?? "127.0.0.1", "-p", String(components.port ?? 5432), "-U", components.user ?? "dq", "-d",
                String(components.path.dropFirst()), "-v", "ON_ERROR_STOP=1", "-tAc", sql,
            ],
            environment: ["PGPASSWORD": Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "", "PATH": "/usr/bin:/bin"]
        ).wait()
        try #require(result.status == 0, "psql failed: \(sql.prefix(80)): \(result.stderr.prefix(300))")
        return result.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
    }
    /// The server answers a statement outside a transaction block (CommandComplete) before it commits it,
    /// and a synchronous standby's acknowledgement comes later still: a commit refused after that answer
    /// (here by deferred constraint triggers; in the failover torture run by a primary stopped while it
    /// waited for its standby) must be a failure, never a success. Each step reported success before the
    /// fix: the enqueue exited 0 and was not stored, the lease was "taken" and an item sent under a token
    /// the database never kept, the retry said done and the item stayed parked. (The enqueue's procedure
    /// commits before it answers, so the refusal is its own error; the others lose their connection.)
    @Test("A commit PostgreSQL refuses after answering the statement is a failure: enqueue, the flush lease and retry")
    func refusedCommit() async throws {
        let server = try await FHIRServer.start()
        let database = try await Self.freshDatabase()
        let env = environment(server.base, database: database)
        #expect(try await dq(["send", try work.write("o0.json", resources.observation(0))], env).status == 0)
        #expect(try await dq(["send", try work.write("bad.json", resources.invalid(1))], env).status == 65)
        #expect(try await dq(["enqueue", try work.write("o2.json", resources.observation(2))], env).status == 0)
        let parked = try await dq(["list", "--parked", "--json"], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(parked.stdout.utf8)) as? [[String: Any]])
        try #require(items.count == 1)
        let id = try #require(items[0]["id"] as? String)
        try await Self.psql(
            database,
            """
            CREATE FUNCTION dq_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'refused at commit'; END$$;
            CREATE CONSTRAINT TRIGGER refuse_item AFTER INSERT OR UPDATE ON dq_item
              DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION dq_test_refuse();
            CREATE CONSTRAINT TRIGGER refuse_lease AFTER INSERT OR UPDATE ON dq_lease
              DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION dq_test_refuse();
            """)

        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 75, "the lease was not taken: \(flushed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0"], "nothing sent without a lease")
        let queued = try await dq(["enqueue", try work.write("o3.json", resources.observation(3))], env)
        #expect(queued.status == 74 && queued.stderr.contains("refused at commit"), "not stored, so not acknowledged: \(queued.stderr)")
        let retried = try await dq(["retry", id], env)
        #expect(retried.status == 75, "\(retried.stderr)")
        let status = try await dq(["status", "--json"], env)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(object["pending"] as? Int == 1 && object["parked"] as? Int == 1, "\(status.stdout)")

        try await Self.psql(database, "DROP TRIGGER refuse_item ON dq_item; DROP TRIGGER refuse_lease ON dq_lease")
        #expect(try await dq(["enqueue", try work.write("o4.json", resources.observation(4))], env).status == 0)
        let after = try await dq(["flush"], env)
        #expect(after.status == 0, "\(after.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "2", "4"])
    }

    @Test("two dq run processes and three producers on one PostgreSQL queue: every item exactly once, each producer's in order")
    func sharedQueue() async throws {
        let server = try await FHIRServer.start()
        let database = try await Self.freshDatabase()
        let env = environment(server.base, database: database)
        var runners: [ChildProcess] = []
        var ports: [Int] = []
        for _ in 0..<2 {
            ports.append(Peers.freePort())
            runners.append(
                try ChildProcess(
                    Peers.dqBinary, ["run", "--poll-interval", "0.3", "--metrics-address", "127.0.0.1:\(ports.last!)"],
                    environment: env))
        }
        let perProducer = 15
        try await withThrowingTaskGroup(of: Void.self) { group in
            for producer in 0..<3 {
                group.addTask {
                    for index in 0..<perProducer {
                        let value = producer * 1000 + index
                        let file = try work.write("p\(value).json", resources.observation(value))
                        let result = try await dq(["enqueue", file], env)
                        try #require(result.status == 0, "\(result.stderr)")
                    }
                }
            }
            try await group.waitForAll()
        }
        let arrived = try await eventually(timeout: .seconds(60)) {
            (try await server.values("Observation", system: resources.system)).count >= 3 * perProducer
        }
        #expect(arrived)
        // SIGTERM once each runner's service group runs (its /readyz no longer says it is starting): the
        // deliveries prove only that one of them runs, and the test is of runners that deliver.
        for port in ports {
            #expect(try await serviceGroupRuns(metricsPort: port), "the runner with metrics on \(port) traps SIGTERM")
        }
        for runner in runners { runner.kill(SIGTERM) }
        for runner in runners {
            let result = await runner.wait(timeout: .seconds(30))
            #expect(result.status == 0, "\(result.stderr.suffix(1000))")
        }
        let values = try await server.values("Observation", system: resources.system).compactMap(Int.init)
        #expect(values.count == 3 * perProducer, "exactly once: \(values.count)")
        #expect(Set(values).count == values.count)
        for producer in 0..<3 {
            let mine = values.filter { $0 / 1000 == producer }
            #expect(mine.count == perProducer)
            #expect(mine == mine.sorted(), "producer \(producer) in order")
        }
    }

    @Test("Behind PgBouncer in transaction mode: enqueues, dq run (woken by polling alone) and status work; order holds")
    func behindPgBouncer() async throws {
        let server = try await FHIRServer.start()
        let bouncer = try #require(
            Peers.environment["DQ_TEST_PGBOUNCER_URL"].flatMap(URLComponents.init(string:)), "no PgBouncer: run make test")
        var components = try #require(URLComponents(string: try await Self.freshDatabase()))
        components.port = bouncer.port
        let database = try #require(components.string)
        let env = environment(server.base, database: database)
        for index in 0..<3 {
            let queued = try await dq(["enqueue", try work.write("o\(index).json", resources.observation(index))], env)
            #expect(queued.status == 0, "\(queued.stderr)")
        }
        let runner = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.3"], environment: env)
        for index in 3..<6 {
            let queued = try await dq(["enqueue", try work.write("o\(index).json", resources.observation(index))], env)
            #expect(queued.status == 0, "\(queued.stderr)")
        }
        let arrived = try await eventually(timeout: .seconds(30)) {
            (try await server.values("Observation", system: resources.system)).count >= 6
        }
        #expect(arrived, "dq run delivered through PgBouncer")
        runner.kill(SIGTERM)
        let result = await runner.wait(timeout: .seconds(30))
        #expect(result.status == 0, "\(result.stderr.suffix(1000))")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2", "3", "4", "5"])
        let status = try await dq(["status", "--json"], env)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(object["delivered"] as? Int == 6 && object["pending"] as? Int == 0, "\(status.stdout)")
    }

    @Test("dq run wakes on another process's enqueue through LISTEN/NOTIFY, without waiting for its poll interval")
    func notifyWakesRun() async throws {
        let server = try await FHIRServer.start()
        let database = try await Self.freshDatabase()
        let env = environment(server.base, database: database)
        // The queue exists (schema and one delivered item) before the long-polling runner starts.
        #expect(try await dq(["send", try work.write("o0.json", resources.observation(0))], env).status == 0)
        let runner = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "600"], environment: env)
        try await Task.sleep(for: .seconds(2))  // it flushed once (nothing to do) and now waits
        let queued = try await dq(["enqueue", try work.write("o1.json", resources.observation(1))], env)
        #expect(queued.status == 0, "\(queued.stderr)")
        let arrived = try await eventually(timeout: .seconds(15)) {
            (try await server.values("Observation", system: resources.system)).count == 2
        }
        #expect(arrived, "delivered long before the 600 s poll: the notification woke the runner")
        runner.kill(SIGTERM)
        let result = await runner.wait(timeout: .seconds(30))
        #expect(result.status == 0, "\(result.stderr.suffix(1000))")
    }

    /// Runs dq on a pseudo-terminal (util-linux `script`), as a person at a shell would; stdout and stderr
    /// both arrive in `stdout`, with the terminal's line ends.
    func onTerminal(_ arguments: [String], _ environment: [String: String]) async throws -> ProcessResult {
        let command = ([Peers.dqBinary] + arguments).map { "'" + $0.replacingOccurrences(of: "'", with: "'\\''") + "'" }
        return try await ChildProcess("/usr/bin/script", ["-qfec", command.joined(separator: " "), "/dev/null"], environment: environment)
            .wait()
    }

    @Test(
        "On a terminal dq enqueue --ndjson, dq migrate, dq flush and dq prune each draw one rewritten progress line that ends at the total; piped, none"
    )
    func progressOnTerminal() async throws {
        let server = try await FHIRServer.start()
        let database = try await Self.freshDatabase()
        let pg = environment(server.base, database: database)
        var lite = pg
        lite["DQ_DATABASE"] = work.file("queue.sqlite")
        let count = 5000
        let lines = try work.write("many.ndjson", resources.ndjson(0..<count))
        let enqueued = try await onTerminal(["enqueue", "--ndjson", lines], lite)
        #expect(enqueued.status == 0, "\(enqueued.stdout.suffix(500))")
        #expect(enqueued.stdout.contains("\rchecked and written: \(count)/\(count), "), "\(enqueued.stdout.suffix(500))")
        #expect(enqueued.stdout.contains("queued \(count) resource(s)"))
        // Piped (a cron job, a log): no progress at all.
        let piped = try await dq(["enqueue", "--ndjson", try work.write("more.ndjson", resources.ndjson(count..<(2 * count)))], lite)
        #expect(piped.status == 0 && !piped.stderr.contains("\r") && !piped.stderr.contains("checked and written"), "\(piped.stderr)")

        let moved = try await onTerminal(["migrate", "--to", database], lite)
        #expect(moved.status == 0, "\(moved.stdout.suffix(500))")
        #expect(moved.stdout.contains("\rmoved: \(2 * count)/\(2 * count), "), "\(moved.stdout.suffix(500))")
        #expect(moved.stdout.contains("moved \(2 * count) item(s)"))

        let flushed = try await onTerminal(["flush"], pg)
        #expect(flushed.status == 0, "\(flushed.stdout.suffix(500))")
        #expect(
            flushed.stdout.contains("\rflush: \(2 * count)/\(2 * count), \(2 * count) delivered, 0 parked, "),
            "\(flushed.stdout.suffix(500))")
        #expect(try await server.values("Observation", system: resources.system) == (0..<(2 * count)).map(String.init))

        // dq prune: the journal lines deleted so far, after each of its short transactions.
        let pruned = try await onTerminal(["prune", "--journal-older-than", "0s"], pg)
        #expect(pruned.status == 0, "\(pruned.stdout.suffix(500))")
        #expect(pruned.stdout.contains("\rpruned: \(2 * count)"), "\(pruned.stdout.suffix(500))")
        #expect(pruned.stdout.contains("pruned \(2 * count) journal line(s)"), "\(pruned.stdout.suffix(500))")
    }

    @Test(
        "dq migrate into a PostgreSQL queue sealed at rest on its own is refused (78), nothing moved: its items would be refused or not found"
    )
    func migrateIntoSealedQueue() async throws {
        let database = try await Self.freshDatabase()
        let pg = environment("http://127.0.0.1:9/fhir", database: database)
        var lite = pg
        lite["DQ_DATABASE"] = work.file("queue.sqlite")
        let key = work.file("rest.key")
        #expect(try await dq(["keygen", "--at-rest", "--out", key], ["HOME": work.path]).status == 0)
        var sealed = pg
        sealed["DQ_AT_REST_KEY_FILE"] = key
        #expect(try await dq(["enqueue", try work.write("t.json", resources.observation(0))], sealed).status == 0)
        for index in 1..<3 {
            #expect(try await dq(["enqueue", try work.write("o\(index).json", resources.observation(index))], lite).status == 0)
        }
        let moved = try await dq(["migrate", "--to", database], lite)
        #expect(moved.status == 78, "\(moved.stderr)")
        #expect(moved.stderr.contains("sealed at rest already") && moved.stderr.contains("nothing was moved"), "\(moved.stderr)")
        let left = try JSONSerialization.jsonObject(with: Data(try await dq(["status", "--json"], lite).stdout.utf8)) as? [String: Any]
        #expect(left?["pending"] as? Int == 2, "the SQLite queue keeps its items")
        let target = try JSONSerialization.jsonObject(with: Data(try await dq(["status", "--json"], sealed).stdout.utf8)) as? [String: Any]
        #expect(target?["pending"] as? Int == 1 && target?["delivered"] as? Int == 0, "the target is as it was")

        // A sealed SQLite queue moves into a PostgreSQL queue that is not sealed, with its keys; run again, the
        // target's keys are the ones it brought: nothing more, and no refusal.
        let fresh = try await Self.freshDatabase()
        var sealedLite = sealed
        sealedLite["DQ_DATABASE"] = work.file("sealed.sqlite")
        #expect(try await dq(["enqueue", try work.write("s.json", resources.observation(5))], sealedLite).status == 0)
        let first = try await dq(["migrate", "--to", fresh], sealedLite)
        #expect(first.status == 0, "\(first.stderr)")
        let again = try await dq(["migrate", "--to", fresh], sealedLite)
        #expect(again.status == 0, "\(again.stderr)")
        var into = sealed
        into["DQ_DATABASE"] = fresh
        let shown = try JSONSerialization.jsonObject(with: Data(try await dq(["status", "--json"], into).stdout.utf8)) as? [String: Any]
        #expect(shown?["pending"] as? Int == 1, "\(String(describing: shown))")
    }

    @Test("dq migrate moves a SQLite queue into PostgreSQL in order, with its parked items and journal; running it again adds nothing")
    func migrate() async throws {
        let server = try await FHIRServer.start()
        let database = try await Self.freshDatabase()
        let pg = environment(server.base, database: database)
        var lite = pg
        lite["DQ_DATABASE"] = work.file("queue.sqlite")
        #expect(try await dq(["send", try work.write("o0.json", resources.observation(0))], lite).status == 0)
        #expect(try await dq(["send", try work.write("bad.json", resources.invalid(1))], lite).status == 65)
        for index in 2..<5 {
            #expect(try await dq(["enqueue", try work.write("o\(index).json", resources.observation(index))], lite).status == 0)
        }
        let moved = try await dq(["migrate", "--to", database, "--json"], lite)
        #expect(moved.status == 0, "\(moved.stderr)")
        let report = try #require(try JSONSerialization.jsonObject(with: Data(moved.stdout.utf8)) as? [String: Any])
        #expect(report["items"] as? Int == 4 && report["pending"] as? Int == 3 && report["parked"] as? Int == 1)
        #expect(report["journalLines"] as? Int == 2, "the delivery and the parking")
        let left = try await dq(["status", "--json"], lite)
        let leftObject = try #require(try JSONSerialization.jsonObject(with: Data(left.stdout.utf8)) as? [String: Any])
        #expect(leftObject["pending"] as? Int == 0 && leftObject["parked"] as? Int == 0, "the SQLite queue is empty")
        let status = try await dq(["status", "--json"], pg)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(object["pending"] as? Int == 3 && object["parked"] as? Int == 1 && object["delivered"] as? Int == 1)
        let again = try await dq(["migrate", "--to", database, "--json"], lite)
        let second = try #require(try JSONSerialization.jsonObject(with: Data(again.stdout.utf8)) as? [String: Any])
        #expect(again.status == 0 && second["items"] as? Int == 0 && second["journalLines"] as? Int == 0, "\(again.stdout)")
        #expect(try await dq(["flush"], pg).status == 0)
        #expect(try await server.values("Observation", system: resources.system) == ["0", "2", "3", "4"])
    }
}
