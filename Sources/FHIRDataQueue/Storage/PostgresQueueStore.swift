import Foundation
import Logging
import NIOSSL
import PostgresNIO
import Synchronization

/// The queue in PostgreSQL, shared by several dq instances: the same contract as the SQLite store
/// (``QueueStorage``), with a lease instead of a file lock for the right to flush.
///
/// - Sequences come from one counter row updated in the enqueue transaction, so they rise in commit order
///   (a bare sequence's values can commit out of order).
/// - The right to flush a server is a lease row (``PostgresLease``): an expiry on the database's clock and a
///   fencing token that grows on every takeover. Every write a flusher makes on an outcome runs in a
///   transaction that first locks the lease row and checks its token, so a flusher that lost its lease
///   cannot write.
/// - The schema is created under a transaction-scoped advisory lock, so that instances starting together
///   are safe (and PgBouncer in transaction mode keeps working).
final class PostgresQueueStore: QueueStorage {
    let client: PostgresClient
    /// The URL without its password, for messages.
    let displayURL: String
    /// How long a lease lasts unless renewed, in seconds.
    let leaseSeconds: Double
    /// How long an operation may wait for the database (a connection included), in seconds.
    let operationTimeout: Double
    let logger: Logger
    private let runTask: Task<Void, Never>
    private let migration = Mutex<Task<Void, any Error>?>(nil)
    private let readOnly: Bool
    /// One connection of its own, made before the first operation: the pool retries a refused connection
    /// silently until the deadline, where this one names the cause at once.
    private let probeConfiguration: PostgresConnection.Configuration
    private let grouper: AsyncGroupCommit
    /// Whether the enqueue statements are prepared (planned once per connection).
    let statements: PreparedStatements
    /// Who holds leases from this store (host and process, for operators reading `dq_lease`).
    let holder: String

    /// Whether `database` names a PostgreSQL database (`postgres://` or `postgresql://`).
    static func isURL(_ database: String) -> Bool {
        QueuePaths.isPostgresURL(database)
    }

    /// Connects (lazily: the pool connects on the first query) and creates or migrates the schema in the
    /// background; every operation waits for that first.
    ///
    /// - Parameters:
    ///   - url: `postgres://user[:password]@host[:port]/database[?sslmode=...&sslrootcert=...]`; without a
    ///     password in the URL, `PGPASSWORD`.
    ///   - readOnly: create nothing (a missing schema is an error).
    init(
        url: String, readOnly: Bool = false, leaseSeconds: Double = 30,
        environment: [String: String] = ProcessInfo.processInfo.environment, logger: Logger
    ) throws {
        // postgres-nio logs its protocol at debug and trace: the SCRAM exchange (enough for an offline guess of
        // the password) and row bytes (resource bodies). Nothing of it below info reaches dq's log.
        var logger = logger
        if logger.logLevel < .info { logger.logLevel = .info }
        let (configuration, display, prepared, probe) = try Self.configuration(url: url, environment: environment)
        self.probeConfiguration = probe
        self.displayURL = display
        let statements = PreparedStatements(enabled: prepared, logger: logger)
        self.statements = statements
        self.operationTimeout = Double(configuration.options.connectTimeout.components.seconds) + 5
        self.leaseSeconds = leaseSeconds
        self.logger = logger
        self.holder = "\(ProcessInfo.processInfo.hostName):\(getpid())"
        let client = PostgresClient(configuration: configuration, backgroundLogger: logger)
        self.client = client
        runTask = Task { await client.run() }
        self.readOnly = readOnly
        let insertLogger = logger
        grouper = AsyncGroupCommit { items in
            try await Self.insert(items, client: client, statements: statements, logger: insertLogger)
        }
    }

    deinit { runTask.cancel() }

    /// Closes the pool: waits for its connections to close, at most 5 seconds (a connection to a server
    /// that stopped answering is left to the process's exit).
    func shutdown() async {
        runTask.cancel()
        let run = runTask
        _ = try? await Self.withDeadline(seconds: 5, what: "close the connections") { await run.value }
    }

    /// LISTEN on `dq_enqueue` (each enqueue transaction notifies its server's queue name), reconnecting after
    /// a lost connection; after each (re)connect every queue is reported once, since notifications sent while
    /// disconnected are lost. Behind PgBouncer in transaction mode LISTEN delivers nothing: readers poll anyway.
    func watchEnqueues(_ enqueued: @escaping @Sendable (String) -> Void) async {
        while !Task.isCancelled {
            do {
                try await schemaReady()
                try await client.withConnection { connection in
                    try await connection.listen(on: "dq_enqueue") { notifications in
                        enqueued("")  // listening: catch up on what was missed
                        for try await notification in notifications { enqueued(notification.payload) }
                    }
                }
            } catch {
                if Task.isCancelled { return }
                logger.debug("LISTEN dq_enqueue stopped; listening again", metadata: ["error": "\(type(of: error))"])
            }
            try? await Task.sleep(for: .seconds(1))
        }
    }

    // MARK: - Configuration

    /// The client's configuration, the URL without its password, and whether statements may be prepared
    /// (`prepared_statements=off` says no).
    static func configuration(
        url text: String, environment: [String: String]
    ) throws -> (PostgresClient.Configuration, String, Bool, PostgresConnection.Configuration) {
        // What the URL leaves out comes from libpq's environment, as psql would take it: PGHOST, PGPORT, PGUSER,
        // PGPASSWORD (else the password file), PGDATABASE, PGSSLMODE, PGSSLROOTCERT, PGAPPNAME.
        guard let components = URLComponents(string: text), let scheme = components.scheme,
            scheme == "postgres" || scheme == "postgresql",
            let host = components.host.flatMap({ $0.isEmpty ? nil : $0 }) ?? environment["PGHOST"].flatMap({ $0.isEmpty ? nil : $0 })
        else {
            throw DataQueueError(
                .invalidConfiguration, "database URL must be postgres://user@host[:port]/database (or set PGHOST for postgres:///database)")
        }
        guard !host.hasPrefix("/") else {
            throw DataQueueError(.invalidConfiguration, "database host \(host): Unix-socket connections are not supported; use a TCP host")
        }
        let port = components.port ?? environment["PGPORT"].flatMap(Int.init) ?? 5432
        let user = components.percentEncodedUser.flatMap { $0.removingPercentEncoding } ?? environment["PGUSER"] ?? "postgres"
        var database = String(components.path.drop(while: { $0 == "/" })).removingPercentEncoding ?? ""
        if database.isEmpty { database = environment["PGDATABASE"] ?? "" }
        guard !database.isEmpty else {
            throw DataQueueError(.invalidConfiguration, "database URL names no database (postgres://user@host/DATABASE, or PGDATABASE)")
        }
        let password =
            components.percentEncodedPassword.flatMap { $0.removingPercentEncoding } ?? environment["PGPASSWORD"]
            ?? PasswordFile.password(host: host, port: port, database: database, user: user, environment: environment)
        var display = URLComponents()
        display.scheme = scheme
        display.user = user
        display.host = host
        display.port = port == 5432 ? nil : port
        display.path = "/" + database
        let options = Dictionary((components.queryItems ?? []).map { ($0.name, $0.value ?? "") }, uniquingKeysWith: { $1 })
        for name in options.keys
        where !["sslmode", "sslrootcert", "application_name", "connect_timeout", "prepared_statements"].contains(name) {
            throw DataQueueError(.invalidConfiguration, "database URL option \"\(name)\" is not supported")
        }
        let prepared: Bool
        switch options["prepared_statements"] ?? "on" {
        case "on", "true", "1": prepared = true
        case "off", "false", "0": prepared = false
        case let other:
            throw DataQueueError(.invalidConfiguration, "database URL prepared_statements \"\(other)\" is not on or off")
        }
        var tls = TLSConfiguration.makeClientConfiguration()
        if let root = options["sslrootcert"] ?? environment["PGSSLROOTCERT"] {
            guard FileManager.default.isReadableFile(atPath: root) else {
                throw DataQueueError(.invalidConfiguration, "database URL sslrootcert \(root) cannot be read")
            }
            tls.trustRoots = .file(root)
        }
        let mode: PostgresClient.Configuration.TLS
        let required: Bool?  // nil: no TLS
        switch options["sslmode"] ?? environment["PGSSLMODE"] ?? "prefer" {
        case "disable":
            mode = .disable
            required = nil
        case "allow", "prefer":
            tls.certificateVerification = .none  // libpq: encryption if offered, no verification
            mode = .prefer(tls)
            required = false
        case "require":
            tls.certificateVerification = (options["sslrootcert"] ?? environment["PGSSLROOTCERT"]) == nil ? .none : .noHostnameVerification
            mode = .require(tls)
            required = true
        case "verify-ca":
            tls.certificateVerification = .noHostnameVerification
            mode = .require(tls)
            required = true
        case "verify-full":
            tls.certificateVerification = .fullVerification
            mode = .require(tls)
            required = true
        case let other:
            throw DataQueueError(
                .invalidConfiguration,
                "database URL sslmode \"\(other)\" is not one of disable, allow, prefer, require, verify-ca, verify-full")
        }
        var configuration = PostgresClient.Configuration(
            host: host, port: port, username: user, password: password, database: database, tls: mode)
        configuration.options.maximumConnections = 16
        configuration.options.connectTimeout = .seconds(Int64(options["connect_timeout"].flatMap(Int.init) ?? 10))
        if let name = options["application_name"] ?? environment["PGAPPNAME"] {
            configuration.options.additionalStartupParameters = [("application_name", name)]
        }
        let probeTLS: PostgresConnection.Configuration.TLS
        do {
            switch required {
            case nil: probeTLS = .disable
            case false?: probeTLS = .prefer(try NIOSSLContext(configuration: tls))
            case true?: probeTLS = .require(try NIOSSLContext(configuration: tls))
            }
        } catch {
            throw DataQueueError(.invalidConfiguration, "database URL: TLS cannot be set up (\(error))")
        }
        var probe = PostgresConnection.Configuration(
            host: host, port: port, username: user, password: password, database: database, tls: probeTLS)
        probe.options.connectTimeout = .seconds(configuration.options.connectTimeout.components.seconds)
        return (configuration, display.string ?? "postgres://\(host)/\(database)", prepared, probe)
    }

    // MARK: - Schema

    static let schema: [String] = [
        """
        CREATE TABLE IF NOT EXISTS dq_meta (
          id int PRIMARY KEY CHECK (id = 1), schema_version int NOT NULL, next_seq bigint NOT NULL)
        """,
        "INSERT INTO dq_meta (id, schema_version, next_seq) VALUES (1, 1, 0) ON CONFLICT (id) DO NOTHING",
        """
        CREATE TABLE IF NOT EXISTS dq_item (
          seq bigint PRIMARY KEY, uuid uuid NOT NULL UNIQUE, queue text NOT NULL, method text NOT NULL,
          url text NOT NULL, resource_type text NOT NULL, resource_id text, encrypted bool NOT NULL,
          content_type text NOT NULL, body bytea NOT NULL, full_url text, state text NOT NULL DEFAULT 'pending',
          attempts int NOT NULL DEFAULT 0, enqueued_at double precision NOT NULL, last_attempt_at double precision,
          last_status int, last_error text, outcome text, conditional_create bool)
        """,
        "CREATE INDEX IF NOT EXISTS dq_item_by_queue ON dq_item (queue, state, seq)",
        "CREATE INDEX IF NOT EXISTS dq_item_by_full_url ON dq_item (full_url) WHERE full_url IS NOT NULL",
        """
        CREATE TABLE IF NOT EXISTS dq_delivery (
          seq bigserial PRIMARY KEY, item_seq bigint NOT NULL, uuid uuid NOT NULL, event text NOT NULL,
          queue text NOT NULL, method text NOT NULL, url text NOT NULL, resource_type text NOT NULL, status int,
          location text, server_id text, version_id text, attempts int NOT NULL, enqueued_at double precision NOT NULL,
          at double precision NOT NULL, note text, full_url text, bundle text, entries text)
        """,
        "CREATE INDEX IF NOT EXISTS dq_delivery_by_queue ON dq_delivery (queue, seq)",
        "CREATE INDEX IF NOT EXISTS dq_delivery_by_uuid ON dq_delivery (uuid)",
        "CREATE INDEX IF NOT EXISTS dq_delivery_by_full_url ON dq_delivery (full_url) WHERE full_url IS NOT NULL",
        """
        CREATE TABLE IF NOT EXISTS dq_server_state (
          queue text PRIMARY KEY, failures int NOT NULL DEFAULT 0, next_attempt_at double precision, last_error text,
          transactions bool, capability_at double precision, batch_limit int)
        """,
        "ALTER TABLE dq_server_state ADD COLUMN IF NOT EXISTS conditional_create text",
        """
        CREATE TABLE IF NOT EXISTS dq_lease (
          queue text PRIMARY KEY, holder text NOT NULL, token bigint NOT NULL, expires_at timestamptz NOT NULL,
          in_flight_seq bigint, in_flight_at double precision)
        """,
        // The in-flight note of the holder with `token` (a row of its own: the fenced writes lock the lease row).
        """
        CREATE TABLE IF NOT EXISTS dq_note (
          queue text PRIMARY KEY, token bigint NOT NULL, in_flight_seq bigint, in_flight_at double precision)
        """,
        // The enqueue procedures (see ``EnqueueOne``): made once under their versioned names, never replaced, so
        // that a start does not rewrite the catalog and two dq versions sharing a database each call their own.
        """
        DO $do$ BEGIN
          IF to_regprocedure('dq_enqueue_one_v1(uuid,text,text,text,text,text,bool,text,bytea,text,double precision,bigint)') IS NULL THEN
            CREATE PROCEDURE dq_enqueue_one_v1(p_uuid uuid, p_queue text, p_method text, p_url text, p_type text, p_id text,
              p_encrypted bool, p_content_type text, p_body bytea, p_full_url text, p_at double precision,
              INOUT o_first bigint DEFAULT NULL)
            LANGUAGE plpgsql AS $proc$
            BEGIN
              UPDATE dq_meta SET next_seq = next_seq + 1 WHERE id = 1 RETURNING next_seq INTO o_first;
              INSERT INTO dq_item (\(itemInsertColumns))
              VALUES (o_first, p_uuid, p_queue, p_method, p_url, p_type, NULLIF(p_id, ''), p_encrypted, p_content_type, p_body,
                      NULLIF(p_full_url, ''), p_at);
              PERFORM pg_notify('dq_enqueue', p_queue);
              COMMIT;
            END $proc$;
          END IF;
          IF to_regprocedure('dq_enqueue_many_v1(bigint,uuid[],text[],text[],text[],text[],text[],bool[],text[],bytea[],text[],double precision,bigint)') IS NULL THEN
            CREATE PROCEDURE dq_enqueue_many_v1(p_count bigint, p_uuid uuid[], p_queue text[], p_method text[], p_url text[],
              p_type text[], p_id text[], p_encrypted bool[], p_content_type text[], p_body bytea[], p_full_url text[],
              p_at double precision, INOUT o_first bigint DEFAULT NULL)
            LANGUAGE plpgsql AS $proc$
            BEGIN
              UPDATE dq_meta SET next_seq = next_seq + p_count WHERE id = 1 RETURNING next_seq - p_count + 1 INTO o_first;
              INSERT INTO dq_item (\(itemInsertColumns))
              SELECT o_first + v.o - 1, v.uuid, v.queue, v.method, v.url, v.resource_type, NULLIF(v.resource_id, ''),
                     v.encrypted, v.content_type, v.body, NULLIF(v.full_url, ''), p_at
              FROM unnest(p_uuid, p_queue, p_method, p_url, p_type, p_id, p_encrypted, p_content_type, p_body, p_full_url)
                   WITH ORDINALITY AS v(uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body, full_url, o);
              PERFORM pg_notify('dq_enqueue', q) FROM (SELECT DISTINCT unnest(p_queue) AS q) d;
              COMMIT;
            END $proc$;
          END IF;
        END $do$
        """,
        // Notes left in the lease row by dq before the note had its table.
        """
        INSERT INTO dq_note (queue, token, in_flight_seq, in_flight_at)
        SELECT queue, token, in_flight_seq, in_flight_at FROM dq_lease WHERE in_flight_seq IS NOT NULL
        ON CONFLICT (queue) DO NOTHING
        """,
    ]

    /// One statement that says whether the schema is complete and current: every object ``schema`` makes (a
    /// statement added there belongs here too), and no note left in a lease row to move. When it is, a store starts without the
    /// migration's transaction (its advisory lock, and the table locks that `CREATE INDEX IF NOT EXISTS` and
    /// `ADD COLUMN IF NOT EXISTS` take even when there is nothing to do: about twenty round trips, and a wait
    /// behind any open transaction on those tables).
    static let schemaIsCurrent = """
        SELECT EXISTS (SELECT 1 FROM dq_meta WHERE id = 1)
           AND to_regclass('dq_item') IS NOT NULL AND to_regclass('dq_item_by_queue') IS NOT NULL
           AND to_regclass('dq_item_by_full_url') IS NOT NULL AND to_regclass('dq_delivery') IS NOT NULL
           AND to_regclass('dq_delivery_by_queue') IS NOT NULL AND to_regclass('dq_delivery_by_uuid') IS NOT NULL
           AND to_regclass('dq_delivery_by_full_url') IS NOT NULL AND to_regclass('dq_lease') IS NOT NULL
           AND to_regclass('dq_note') IS NOT NULL
           AND to_regprocedure('dq_enqueue_one_v1(uuid,text,text,text,text,text,bool,text,bytea,text,double precision,bigint)') IS NOT NULL
           AND to_regprocedure('dq_enqueue_many_v1(bigint,uuid[],text[],text[],text[],text[],text[],bool[],text[],bytea[],text[],double precision,bigint)') IS NOT NULL
           AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('dq_server_state')
                       AND attname = 'conditional_create' AND NOT attisdropped)
           AND NOT EXISTS (SELECT 1 FROM dq_lease l WHERE l.in_flight_seq IS NOT NULL
                           AND NOT EXISTS (SELECT 1 FROM dq_note n WHERE n.queue = l.queue))
        """

    /// Creates the schema under a transaction-scoped advisory lock (one instance at a time; the others find
    /// it made), unless it is complete and current already (``schemaIsCurrent``).
    private static func migrate(_ client: PostgresClient, readOnly: Bool, display: String, logger: Logger) async throws {
        do {
            if readOnly {
                let found = try await client.query("SELECT to_regclass('dq_item') IS NOT NULL", logger: logger).decode(Bool.self)
                for try await exists in found where !exists {
                    throw DataQueueError(.storage, "no dq queue in \(display) (nothing was queued there)")
                }
                return
            }
            // A schema that is not there yet makes the check fail (dq_lease is missing): then it is made.
            let complete = try? await { () async throws -> Bool in
                for try await value in try await client.query(PostgresQuery(unsafeSQL: schemaIsCurrent), logger: logger)
                    .decode(Bool.self)
                {
                    return value
                }
                return false
            }()
            if complete == true { return }
            try await client.withTransaction(logger: logger) { connection in
                _ = try await connection.query("SELECT pg_advisory_xact_lock(7163046517)", logger: logger).collect()
                for statement in schema {
                    try await connection.query(PostgresQuery(unsafeSQL: statement), logger: logger)
                }
            }
        } catch {
            throw map(error, doing: "prepare the queue in \(display)")
        }
    }

    /// Waits for the schema, then runs `body`, mapping errors. The pool waits for a connection without a
    /// deadline while the server is unreachable, and a query on a connection that hangs is not cancellable;
    /// dq gives up after ``operationTimeout`` instead, without waiting for the stuck work (the operation may
    /// still complete on the server: an enqueue that timed out may be stored).
    fileprivate func run<T: Sendable>(_ what: String, _ body: @escaping @Sendable () async throws -> T) async throws -> T {
        do {
            return try await Self.withDeadline(seconds: operationTimeout, what: what) { [self] in
                try await schemaReady()
                return try await body()
            }
        } catch {
            throw Self.map(error, doing: what)
        }
    }

    /// `body`'s result, or a `.transport` error after `seconds`; `body` runs in a task of its own that is
    /// cancelled, not awaited, when the deadline passes.
    static func withDeadline<T: Sendable>(
        seconds: Double, what: String, _ body: @escaping @Sendable () async throws -> T
    ) async throws -> T {
        let race = DeadlineRace<T>()
        return try await withCheckedThrowingContinuation { continuation in
            race.continuation.withLock { $0 = continuation }
            let work = Task {
                do {
                    race.finish(.success(try await body()))
                } catch {
                    race.finish(.failure(error))
                }
            }
            let timer = Task {
                try await Task.sleep(for: .milliseconds(Int64(seconds * 1000)))
                work.cancel()
                race.finish(.failure(DataQueueError(.transport, "cannot \(what): PostgreSQL did not answer within \(Int(seconds)) s")))
            }
            race.timer.withLock { $0 = timer }
        }
    }

    /// Connects once on a connection of its own and closes it: the cause of a failure, named (the pool would
    /// retry it silently until the deadline). A refused login is `.authentication`; a TLS mismatch or a missing
    /// database `.invalidConfiguration`; an unreachable server `.transport`.
    static func probe(_ configuration: PostgresConnection.Configuration, display: String, logger: Logger) async throws {
        let connection: PostgresConnection
        do {
            connection = try await PostgresConnection.connect(configuration: configuration, id: 0, logger: logger)
        } catch {
            throw connectionFailure(error, display: display)
        }
        try? await connection.close()
    }

    static func connectionFailure(_ error: any Error, display: String) -> DataQueueError {
        let prefix = "cannot connect to PostgreSQL at \(display)"
        if let error = error as? PSQLError {
            let state = error.serverInfo?[.sqlState] ?? ""
            let message = error.serverInfo?[.message].map { ": " + $0.prefix(200) } ?? ""
            switch error.code {
            case .server where state.hasPrefix("28"):
                return DataQueueError(.authentication, "\(prefix): the server refused the login (\(state)\(message))")
            case .server where state == "3D000":
                return DataQueueError(.invalidConfiguration, "\(prefix): the database does not exist (\(state))")
            case .server where state == "53300":
                return DataQueueError(.transport, "\(prefix): the server has too many connections (\(state))")
            case .server where state.hasPrefix("57P") || state.hasPrefix("08"):
                return DataQueueError(.transport, "\(prefix): the server is not available (\(state)\(message))")
            case .server:
                return DataQueueError(.invalidConfiguration, "\(prefix): \(state)\(message)")
            case .sslUnsupported:
                return DataQueueError(.invalidConfiguration, "\(prefix): the server does not offer TLS, which sslmode=require needs")
            case .failedToAddSSLHandler, .receivedUnencryptedDataAfterSSLRequest:
                return DataQueueError(.invalidConfiguration, "\(prefix): TLS with the server failed")
            case .authMechanismRequiresPassword:
                return DataQueueError(
                    .authentication, "\(prefix): the server wants a password (PGPASSWORD, ~/.pgpass with mode 0600, or the URL)")
            case .unsupportedAuthMechanism, .saslError:
                return DataQueueError(.authentication, "\(prefix): the login failed (\(error.code))")
            default:
                if let underlying = error.underlying { return connectionFailure(underlying, display: display) }
                return DataQueueError(.transport, "\(prefix) (\(error.code))")
            }
        }
        if error is NIOSSLError || String(describing: type(of: error)).contains("SSL") {
            return DataQueueError(
                .invalidConfiguration,
                "\(prefix): TLS with the server failed (\(FHIRTransport.describeTLS(String(reflecting: error)) ?? "handshake"))")
        }
        let text = String(reflecting: error)
        if text.contains("connectionRefused") || text.contains("Connection refused") || text.contains("ECONNREFUSED") {
            return DataQueueError(.transport, "\(prefix): connection refused (is the server running?)")
        }
        if text.contains("connectTimeout") || text.contains("timeout") {
            return DataQueueError(.transport, "\(prefix): the connection timed out")
        }
        return DataQueueError(.transport, "\(prefix): \(String(describing: error).prefix(200))")
    }

    /// The schema, made once per store; after a failure (the server down at start) the next operation tries again.
    private func schemaReady() async throws {
        let task = migration.withLock { current -> Task<Void, any Error> in
            if let current { return current }
            let made = Task { [client, readOnly, displayURL, logger, probeConfiguration] in
                try await Self.probe(probeConfiguration, display: displayURL, logger: logger)
                try await Self.migrate(client, readOnly: readOnly, display: displayURL, logger: logger)
            }
            current = made
            return made
        }
        do {
            try await task.value
        } catch {
            migration.withLock { if $0 == task { $0 = nil } }
            throw error
        }
    }

    /// A dq error for any error of the database: a lost connection or a server that is restarting is
    /// temporary (`.transport`: try again), the rest is `.storage`.
    static func map(_ error: any Error, doing what: String) -> DataQueueError {
        if let error = error as? DataQueueError { return error }
        if let error = error as? PostgresTransactionError {
            if let inner = error.closureError ?? error.beginError ?? error.commitError { return map(inner, doing: what) }
        }
        if error is CommitNotConfirmed {
            return DataQueueError(.transport, "cannot \(what): the connection to PostgreSQL was lost before it confirmed the commit")
        }
        if let error = error as? PSQLError {
            let state = error.serverInfo?[.sqlState] ?? ""
            switch error.code {
            case .connectionError, .serverClosedConnection, .clientClosedConnection, .uncleanShutdown:
                return DataQueueError(.transport, "cannot \(what): the connection to PostgreSQL was lost")
            case .server where state.hasPrefix("08") || ["40001", "40P01", "57P01", "57P02", "57P03", "53300"].contains(state):
                return DataQueueError(.transport, "cannot \(what): PostgreSQL is unavailable (\(state))")
            case .server where state.hasPrefix("28"):
                return DataQueueError(.authentication, "cannot \(what): PostgreSQL refused the login (\(state))")
            case .server:
                let message = error.serverInfo?[.message].map { ": " + $0.prefix(200) } ?? ""
                return DataQueueError(.storage, "cannot \(what): PostgreSQL error \(state)\(message)")
            default:
                return DataQueueError(.transport, "cannot \(what): PostgreSQL connection failed (\(error.code))")
            }
        }
        if String(describing: type(of: error)).contains("ConnectionPoolError") {
            return DataQueueError(.transport, "cannot \(what): PostgreSQL cannot be reached")
        }
        return DataQueueError(.storage, "cannot \(what): \(error)")
    }

    // MARK: - Enqueue

    func insert(_ items: [NewItem]) async throws -> [Int64] {
        try await run("enqueue") { [self] in try await Self.insert(items, client: client, statements: statements, logger: logger) }
    }

    nonisolated(nonsending) func insertGrouped(_ item: NewItem) async throws -> Int64 {
        try await run("enqueue") { [grouper] in try await grouper.submit(item) }
    }

    static let itemInsertColumns =
        "seq, uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body, full_url, enqueued_at"

    /// Reserves `count` sequence numbers from the counter row and returns the first. The row stays locked
    /// until the caller's transaction commits, so sequences rise in commit order.
    private static func reserveSequences(_ count: Int, connection: PostgresConnection, logger: Logger) async throws -> Int64 {
        var last: Int64 = 0
        for try await value in try await connection.query(
            "UPDATE dq_meta SET next_seq = next_seq + \(Int64(count)) WHERE id = 1 RETURNING next_seq", logger: logger
        ).decode(Int64.self) {
            last = value
        }
        return last - Int64(count) + 1
    }

    /// Appends `items`' columns to `bindings` as one array each (ten parameters) and then the enqueue time.
    /// `resource_id` and `full_url` travel as empty strings for NULL (neither can be empty in FHIR).
    static func appendItemColumns(_ items: ArraySlice<NewItem>, to bindings: inout PostgresBindings) {
        bindings.append(items.map(\.id))
        bindings.append(items.map(\.queue))
        bindings.append(items.map(\.method.rawValue))
        bindings.append(items.map(\.url))
        bindings.append(items.map(\.resourceType))
        bindings.append(items.map { $0.resourceID ?? "" })
        bindings.append(items.map(\.encrypted))
        bindings.append(items.map(\.contentType))
        bindings.append(items.map { ByteBuffer(bytes: $0.body) })
        bindings.append(items.map { $0.fullURL ?? "" })
        bindings.append(Date().timeIntervalSince1970)
    }

    /// The `INSERT … SELECT` of items whose columns are the parameters after `base` (as
    /// ``appendItemColumns(_:to:)`` appends them), numbered from the sequence `first` (an SQL expression) in
    /// their order: one statement and eleven parameters however many items there are, so the server parses
    /// a short statement once.
    static func itemInsertSQL(base: Int, first: String) -> String {
        let arrays = (1...10).map { "$\(base + $0)" }.joined(separator: ", ")
        return """
            INSERT INTO dq_item (\(itemInsertColumns))
            SELECT \(first) + v.o - 1, v.uuid, v.queue, v.method, v.url, v.resource_type, NULLIF(v.resource_id, ''),
                   v.encrypted, v.content_type, v.body, NULLIF(v.full_url, ''), $\(base + 11)
            FROM unnest(\(arrays)) WITH ORDINALITY
                 AS v(uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body, full_url, o)
            """
    }

    /// The most items one enqueue statement carries (its message stays a few megabytes).
    static let statementRows = 1000

    /// Stores `items` durably. Up to ``statementRows`` items are one statement (``EnqueueOne`` or
    /// ``EnqueueMany``), hence one round trip and one commit: the counter row (locked until that commit, so
    /// sequences rise in commit order), the rows, and a notification per server. More are one transaction of
    /// such inserts.
    fileprivate static func insert(
        _ items: [NewItem], client: PostgresClient, statements: PreparedStatements, logger: Logger
    ) async throws -> [Int64] {
        guard !items.isEmpty else { return [] }
        guard items.count > statementRows else {
            let first =
                items.count == 1
                ? try await statements.single(EnqueueOne(item: items[0]), client: client, logger: logger)
                : try await statements.single(EnqueueMany(items: items[...]), client: client, logger: logger)
            guard let first else { throw DataQueueError(.storage, "cannot enqueue: the queue's counter row is missing") }
            return (0..<Int64(items.count)).map { first + $0 }
        }
        return try await client.withTransaction(logger: logger) { connection in
            let first = try await reserveSequences(items.count, connection: connection, logger: logger)
            for start in stride(from: 0, to: items.count, by: statementRows) {
                var bindings = PostgresBindings(capacity: 11)
                appendItemColumns(items[start..<min(start + statementRows, items.count)], to: &bindings)
                let insert = itemInsertSQL(base: 0, first: String(first + Int64(start)))
                try await connection.query(PostgresQuery(unsafeSQL: insert, binds: bindings), logger: logger)
            }
            for queue in Set(items.map(\.queue)) {
                _ = try await connection.query("SELECT pg_notify('dq_enqueue', \(queue))", logger: logger).collect()
            }
            return (0..<Int64(items.count)).map { first + $0 }
        }
    }

    func knownFullURLs(_ fullURLs: Set<String>) async throws -> Set<String> {
        guard !fullURLs.isEmpty else { return [] }
        let list = Array(fullURLs)
        return try await run("read the queue") { [self] in
            var known: Set<String> = []
            let rows = try await client.query(
                """
                SELECT full_url FROM dq_item WHERE full_url = ANY(\(list))
                UNION SELECT full_url FROM dq_delivery WHERE full_url = ANY(\(list))
                """, logger: logger)
            for try await value in rows.decode(String.self) { known.insert(value) }
            return known
        }
    }

    // MARK: - Flushing

    func acquireFlush(queue: String, until deadline: ContinuousClock.Instant) async throws -> (any FlushOwnership)? {
        try await run("take the flush lease") { [self] in
            var delay = Duration.milliseconds(20)
            while true {
                if let lease = try await PostgresLease.take(store: self, queue: queue) { return lease }
                if ContinuousClock.now >= deadline { return nil }
                try await Task.sleep(for: min(delay, deadline - ContinuousClock.now))
                delay = min(delay * 2, .milliseconds(250))
            }
        }
    }

    func checkStates(queue: String) async throws {
        try await run("read the queue") { [self] in
            for try await (seq, state) in try await client.query(
                "SELECT seq, state FROM dq_item WHERE queue = \(queue) AND state NOT IN ('pending', 'parked') LIMIT 1",
                logger: logger
            ).decode((Int64, String).self) {
                throw Self.damaged(seq, "unknown state \(state.prefix(32))")
            }
        }
    }

    func serverState(queue: String) async throws -> (failures: Int, nextAttemptAt: Date?, lastError: String?) {
        try await run("read the server state") { [self] in
            for try await (failures, next, error) in try await client.query(
                "SELECT failures, next_attempt_at, last_error FROM dq_server_state WHERE queue = \(queue)", logger: logger
            ).decode((Int, Double?, String?).self) {
                return (failures, next.map(Date.init(timeIntervalSince1970:)), error)
            }
            return (0, nil, nil)
        }
    }

    static let itemColumns =
        "seq, uuid, queue, method, url, resource_type, resource_id, encrypted, state, attempts, enqueued_at, last_attempt_at, last_status, last_error, outcome, length(body) AS size"
    static let storedColumns = itemColumns + ", content_type, conditional_create, body, full_url"

    func pendingBatch(queue: String, after: Int64, maxCount: Int, maxBytes: Int) async throws -> [StoredItem] {
        try await run("read the queue") { [self] in
            let rows = try await client.query(
                PostgresQuery(
                    unsafeSQL:
                        "SELECT \(Self.storedColumns) FROM dq_item WHERE queue = $1 AND state = 'pending' AND seq > $2 ORDER BY seq LIMIT $3",
                    binds: Self.binds(queue, after, Int64(maxCount))),
                logger: logger)
            var items: [StoredItem] = []
            var bytes = 0
            for try await row in rows {
                let item = try Self.storedItem(row)
                items.append(item)
                bytes += item.body.count
                if bytes >= maxBytes { break }
            }
            return items
        }
    }

    func markDelivered(_ deliveries: [CompletedDelivery], owner: any FlushOwnership) -> Result<Void, DataQueueError> {
        guard let queue = deliveries.first?.item.queue else { return .success(()) }
        // The journal's writer thread waits here: it is not a thread of the cooperative pool.
        final class Outcome: Sendable {
            let result = Mutex<Result<Void, DataQueueError>>(.success(()))
            let done = DispatchSemaphore(value: 0)
        }
        let outcome = Outcome()
        Task {
            do {
                try await self.fenced(owner, queue: queue, "record a delivery") { [self] connection in
                    try await self.journal(deliveries, queue: queue, connection: connection)
                }
            } catch {
                outcome.result.withLock { $0 = .failure(Self.map(error, doing: "record a delivery")) }
            }
            outcome.done.signal()
        }
        outcome.done.wait()
        return outcome.result.withLock { $0 }
    }

    /// Moves `deliveries` to the journal in three statements whatever their number: one delete, one insert
    /// of the lines (in delivery order, for the items the delete found), and the backoff's reset.
    private func journal(_ deliveries: [CompletedDelivery], queue: String, connection: PostgresConnection) async throws {
        let now = Date().timeIntervalSince1970
        var deleted = Set<Int64>()
        for try await seq in try await connection.query(
            "DELETE FROM dq_item WHERE seq = ANY(\(deliveries.map(\.item.sequence))) RETURNING seq", logger: logger
        ).decode(Int64.self) {
            deleted.insert(seq)
        }
        let lines = deliveries.filter { deleted.remove($0.item.sequence) != nil }  // once each, in delivery order
        for start in stride(from: 0, to: lines.count, by: 1000) {
            var bindings = PostgresBindings(capacity: 18 * min(1000, lines.count - start))
            var rows: [String] = []
            for delivery in lines[start..<min(start + 1000, lines.count)] {
                let item = delivery.item
                let base = bindings.count
                rows.append("(" + (1...18).map { "$\(base + $0)" }.joined(separator: ", ") + ")")
                bindings.append(item.sequence)
                bindings.append(item.id)
                bindings.append(delivery.event.rawValue)
                bindings.append(item.queue)
                bindings.append(item.method.rawValue)
                bindings.append(delivery.url)
                bindings.append(item.resourceType)
                bindings.append(delivery.status)
                bindings.append(delivery.location)
                bindings.append(delivery.serverID)
                bindings.append(delivery.versionID)
                bindings.append(item.attempts + 1)
                bindings.append(item.enqueuedAt.timeIntervalSince1970)
                bindings.append(now)
                bindings.append(delivery.fullURL)
                bindings.append(delivery.bundle)
                bindings.append(delivery.entries)
                bindings.append(delivery.note)
            }
            try await connection.query(
                PostgresQuery(
                    unsafeSQL: """
                        INSERT INTO dq_delivery (item_seq, uuid, event, queue, method, url, resource_type, status, location,
                                                 server_id, version_id, attempts, enqueued_at, at, full_url, bundle, entries, note)
                        VALUES \(rows.joined(separator: ", "))
                        """, binds: bindings),
                logger: logger)
        }
        try await connection.query(
            "UPDATE dq_server_state SET failures = 0, next_attempt_at = NULL, last_error = NULL WHERE queue = \(queue) AND failures > 0",
            logger: logger)
    }

    /// Runs `body` in a transaction that first locks the lease row of `queue` and checks that `owner` still
    /// holds it (the fence): a flusher whose lease was taken over writes nothing.
    private func fenced(
        _ owner: any FlushOwnership, queue: String, _ what: String,
        _ body: @escaping @Sendable (PostgresConnection) async throws -> Void
    ) async throws {
        guard let lease = owner as? PostgresLease, lease.queue == queue else {
            throw DataQueueError(.storage, "cannot \(what): the flush right does not belong to this queue")
        }
        try await run(what) { [self] in
            try await client.withTransaction(logger: logger) { connection in
                var token: Int64?
                for try await value in try await connection.query(
                    "SELECT token FROM dq_lease WHERE queue = \(queue) FOR UPDATE", logger: logger
                ).decode(Int64.self) {
                    token = value
                }
                guard token == lease.token else {
                    lease.lost()
                    throw DataQueueError(
                        .busy, "cannot \(what): another dq instance took over the flush of \(queue); this one stops")
                }
                try await body(connection)
            }
        }
    }

    func park(_ item: QueuedItem, url: String, status: Int?, error: String, outcome: String?, owner: any FlushOwnership)
        async throws
    {
        try await fenced(owner, queue: item.queue, "park an item") { [self] connection in
            let now = Date().timeIntervalSince1970
            var changed = false
            for try await _ in try await connection.query(
                """
                UPDATE dq_item SET state = 'parked', attempts = attempts + 1, last_attempt_at = \(now),
                                   last_status = \(status), last_error = \(error), outcome = \(outcome)
                WHERE seq = \(item.sequence) RETURNING seq
                """, logger: logger)
            {
                changed = true
            }
            guard changed else { return }
            try await self.journalEvent(
                .parked, item: item, url: url, status: status, note: error, attempts: item.attempts + 1, at: now,
                connection: connection)
        }
    }

    private func journalEvent(
        _ event: DeliveryRecord.Event, item: QueuedItem, url: String, status: Int?, note: String?, attempts: Int, at: Double,
        connection: PostgresConnection
    ) async throws {
        try await connection.query(
            """
            INSERT INTO dq_delivery (item_seq, uuid, event, queue, method, url, resource_type, status, attempts,
                                     enqueued_at, at, note)
            VALUES (\(item.sequence), \(item.id), \(event.rawValue), \(item.queue), \(item.method.rawValue), \(url),
                    \(item.resourceType), \(status), \(attempts), \(item.enqueuedAt.timeIntervalSince1970), \(at), \(note))
            """, logger: logger)
    }

    func recordFailure(
        queue: String, item: QueuedItem?, status: Int?, error: String, nextAttemptAt: Date?, owner: any FlushOwnership
    ) async throws {
        try await fenced(owner, queue: queue, "record a failure") { [self] connection in
            let now = Date().timeIntervalSince1970
            if let item {
                try await connection.query(
                    """
                    UPDATE dq_item SET attempts = attempts + 1, last_attempt_at = \(now), last_status = \(status),
                                       last_error = \(error) WHERE seq = \(item.sequence)
                    """, logger: logger)
            }
            let next = nextAttemptAt?.timeIntervalSince1970
            try await connection.query(
                """
                INSERT INTO dq_server_state (queue, failures, next_attempt_at, last_error) VALUES (\(queue), 1, \(next), \(error))
                ON CONFLICT (queue) DO UPDATE SET failures = dq_server_state.failures + 1,
                  next_attempt_at = EXCLUDED.next_attempt_at, last_error = EXCLUDED.last_error
                """, logger: logger)
        }
    }

    func bundleSupport(queue: String) async throws -> QueueStore.BundleSupport {
        try await run("read the server state") { [self] in
            for try await (transactions, checked, limit, types) in try await client.query(
                "SELECT transactions, capability_at, batch_limit, conditional_create FROM dq_server_state WHERE queue = \(queue)",
                logger: logger
            ).decode((Bool?, Double?, Int?, String?).self) {
                return QueueStore.BundleSupport(
                    transactions: transactions, checkedAt: checked.map(Date.init(timeIntervalSince1970:)), batchLimit: limit,
                    conditionalCreate: QueueStore.decodeTypes(types))
            }
            return QueueStore.BundleSupport()
        }
    }

    func recordBundleSupport(queue: String, transactions: Bool?, batchLimit: Int?, conditionalCreate: Set<String>?) async throws {
        try await run("record what the server supports") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                try await connection.query(
                    "INSERT INTO dq_server_state (queue, failures) VALUES (\(queue), 0) ON CONFLICT (queue) DO NOTHING",
                    logger: logger)
                if let conditionalCreate {
                    try await connection.query(
                        "UPDATE dq_server_state SET conditional_create = \(QueueStore.encodeTypes(conditionalCreate)) WHERE queue = \(queue)",
                        logger: logger)
                }
                if let transactions {
                    try await connection.query(
                        "UPDATE dq_server_state SET transactions = \(transactions), capability_at = \(Date().timeIntervalSince1970) WHERE queue = \(queue)",
                        logger: logger)
                }
                if let batchLimit {
                    try await connection.query(
                        "UPDATE dq_server_state SET batch_limit = \(batchLimit) WHERE queue = \(queue)", logger: logger)
                }
            }
        }
    }

    func deliveredLocations(fullURLs: [String]) async throws -> [String: String] {
        guard !fullURLs.isEmpty else { return [:] }
        return try await run("read the delivery journal") { [self] in
            var found: [String: String] = [:]
            for try await (fullURL, type, id) in try await client.query(
                """
                SELECT DISTINCT ON (full_url) full_url, resource_type, server_id FROM dq_delivery
                WHERE full_url = ANY(\(fullURLs)) AND event IN ('delivered', 'already-present') AND server_id IS NOT NULL
                ORDER BY full_url, seq DESC
                """, logger: logger
            ).decode((String, String, String).self) {
                found[fullURL] = type + "/" + id
            }
            return found
        }
    }

    func unlocatedDeliveries(fullURLs: [String]) async throws -> [String: UUID] {
        guard !fullURLs.isEmpty else { return [:] }
        return try await run("read the delivery journal") { [self] in
            var found: [String: UUID] = [:]
            for try await (fullURL, id, serverID) in try await client.query(
                """
                SELECT DISTINCT ON (full_url) full_url, uuid, server_id FROM dq_delivery
                WHERE full_url = ANY(\(fullURLs)) AND event IN ('delivered', 'already-present')
                ORDER BY full_url, seq DESC
                """, logger: logger
            ).decode((String, UUID, String?).self) where serverID == nil {
                found[fullURL] = id
            }
            return found
        }
    }

    func resolveLocation(itemID: UUID, location: String, serverID: String, versionID: String?, note: String) async throws -> Bool {
        try await run("record a location") { [self] in
            var changed = false
            try await client.withConnection { connection in
                for try await _ in try await connection.query(
                    """
                    UPDATE dq_delivery SET location = \(location), server_id = \(serverID), version_id = \(versionID), note = \(note)
                    WHERE seq = (SELECT max(seq) FROM dq_delivery WHERE uuid = \(itemID) AND event IN ('delivered', 'already-present'))
                      AND server_id IS NULL
                    RETURNING seq
                    """, logger: logger)
                {
                    changed = true
                }
                try await connection.confirmCommit(logger: logger)
            }
            return changed
        }
    }

    // MARK: - Operators

    func status(queue: String) async throws -> QueueStatus {
        try await checkStates(queue: queue)
        return try await run("read the queue status") { [self] in
            var pending = 0
            var parked = 0
            var delivered = 0
            var oldest: Double?
            var lastDelivery: Double?
            for try await (p, k, d, o, l) in try await client.query(
                """
                SELECT (SELECT count(*) FROM dq_item WHERE queue = \(queue) AND state = 'pending'),
                       (SELECT count(*) FROM dq_item WHERE queue = \(queue) AND state = 'parked'),
                       (SELECT count(*) FROM dq_delivery WHERE queue = \(queue) AND event IN ('delivered', 'already-present')),
                       (SELECT enqueued_at FROM dq_item WHERE queue = \(queue) AND state = 'pending' ORDER BY seq LIMIT 1),
                       (SELECT at FROM dq_delivery WHERE queue = \(queue) AND event IN ('delivered', 'already-present')
                        ORDER BY seq DESC LIMIT 1)
                """, logger: logger
            ).decode((Int, Int, Int, Double?, Double?).self) {
                (pending, parked, delivered, oldest, lastDelivery) = (p, k, d, o, l)
            }
            let state = try await serverState(queue: queue)
            return QueueStatus(
                queue: queue, pending: pending, parked: parked, delivered: delivered,
                oldestPendingAt: oldest.map(Date.init(timeIntervalSince1970:)), consecutiveFailures: state.failures,
                nextAttemptAt: state.nextAttemptAt, lastError: state.lastError,
                lastDeliveryAt: lastDelivery.map(Date.init(timeIntervalSince1970:)))
        }
    }

    func queues() async throws -> [String] {
        try await run("list queues") { [self] in
            var names: [String] = []
            for try await name in try await client.query(
                "SELECT queue FROM dq_item UNION SELECT queue FROM dq_delivery UNION SELECT queue FROM dq_server_state ORDER BY 1",
                logger: logger
            ).decode(String.self) {
                names.append(name)
            }
            return names
        }
    }

    func items(queue: String?, state: ItemState?, limit: Int) async throws -> [QueuedItem] {
        try await run("list the queue") { [self] in
            var sql = "SELECT \(Self.itemColumns) FROM dq_item WHERE true"
            var bindings = PostgresBindings()
            if let queue {
                bindings.append(queue)
                sql += " AND queue = $\(bindings.count)"
            }
            if let state {
                bindings.append(state.rawValue)
                sql += " AND state = $\(bindings.count)"
            }
            bindings.append(Int64(limit))
            sql += " ORDER BY seq LIMIT $\(bindings.count)"
            return try await rows(PostgresQuery(unsafeSQL: sql, binds: bindings), Self.queuedItem)
        }
    }

    func item(_ reference: String) async throws -> StoredItem {
        let parsed = ItemReference(reference)
        let found = try await run("find an item") { [self] () -> [StoredItem] in
            var found: [StoredItem] = []
            if let sequence = parsed.sequence {
                found = try await rows(
                    PostgresQuery(unsafeSQL: "SELECT \(Self.storedColumns) FROM dq_item WHERE seq = $1", binds: Self.binds(sequence)),
                    Self.storedItem)
            }
            if let part = parsed.idPart {
                let query = PostgresQuery(
                    unsafeSQL:
                        "SELECT \(Self.storedColumns) FROM dq_item WHERE uuid::text LIKE $1 || '%' OR right(uuid::text, $2::int) = $3 LIMIT 2",
                    binds: Self.binds(part, Int64(part.count), part))
                let byID = try await rows(query, Self.storedItem)
                found += byID.filter { item in !found.contains { $0.info.sequence == item.info.sequence } }
            }
            return found
        }
        guard found.count == 1 else {
            if found.count > 1 { throw ItemReference.ambiguous(reference, bySequence: parsed.sequence != nil) }
            throw DataQueueError(.notFound, "no queued item \(reference)")
        }
        return found[0]
    }

    func retry(sequence: Int64, conditionalCreate: Bool?) async throws -> Bool {
        try await run("retry an item") { [self] in
            let plain: Bool? = conditionalCreate.map { $0 ? nil : false } ?? nil
            let keep = conditionalCreate == nil
            return try await client.withConnection { connection in
                var changed = false
                for try await _ in try await connection.query(
                    """
                    UPDATE dq_item SET state = 'pending', outcome = NULL,
                      conditional_create = CASE WHEN \(keep) THEN conditional_create ELSE \(plain)::bool END
                    WHERE seq = \(sequence) AND state = 'parked' RETURNING seq
                    """, logger: logger)
                {
                    changed = true
                }
                try await connection.confirmCommit(logger: logger)
                return changed
            }
        }
    }

    func retryAllParked(queue: String) async throws -> Int {
        try await run("retry parked items") { [self] in
            try await client.withConnection { connection in
                var count = 0
                for try await _ in try await connection.query(
                    "UPDATE dq_item SET state = 'pending', outcome = NULL WHERE queue = \(queue) AND state = 'parked' RETURNING seq",
                    logger: logger)
                {
                    count += 1
                }
                try await connection.confirmCommit(logger: logger)
                return count
            }
        }
    }

    func drop(_ item: QueuedItem, url: String) async throws {
        try await run("drop an item") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                var last: (Int?, String?)?
                for try await row in try await connection.query(
                    "DELETE FROM dq_item WHERE seq = \(item.sequence) RETURNING last_status, last_error", logger: logger
                ).decode((Int?, String?).self) {
                    last = row
                }
                guard let last else { return }
                try await self.journalEvent(
                    .dropped, item: item, url: url, status: last.0, note: last.1, attempts: item.attempts,
                    at: Date().timeIntervalSince1970, connection: connection)
            }
        }
    }

    func journalLine(_ reference: String) async throws -> DeliveryRecord? {
        let parsed = ItemReference(reference)
        return try await run("read the delivery journal") { [self] () -> DeliveryRecord? in
            var uuids: [UUID] = []
            if let sequence = parsed.sequence {
                for try await uuid in try await client.query(
                    "SELECT uuid FROM dq_delivery WHERE item_seq = \(sequence) LIMIT 1", logger: logger
                ).decode(UUID.self) {
                    uuids.append(uuid)
                }
            }
            if let part = parsed.idPart {
                for try await uuid in try await client.query(
                    "SELECT DISTINCT uuid FROM dq_delivery WHERE uuid::text LIKE \(part) || '%' OR uuid::text LIKE '%' || \(part) LIMIT 2",
                    logger: logger
                ).decode(UUID.self) where !uuids.contains(uuid) {
                    uuids.append(uuid)
                }
            }
            guard uuids.count == 1 else {
                if uuids.count > 1 { throw ItemReference.ambiguous(reference, bySequence: parsed.sequence != nil) }
                return nil
            }
            let query = PostgresQuery(
                unsafeSQL: "SELECT * FROM dq_delivery WHERE uuid = $1 ORDER BY seq DESC LIMIT 1", binds: Self.binds(uuids[0]))
            return try await rows(query, Self.deliveryRecord).first
        }
    }

    func allStatuses() async throws -> [QueueStatus] {
        var statuses: [QueueStatus] = []
        for queue in try await queues() { statuses.append(try await status(queue: queue)) }
        return statuses
    }

    /// PostgreSQL checks its own pages; dq checks that every row is in a state it knows.
    func integrityCheck() async throws -> [String] {
        try await run("check the queue") { [self] in
            var problems: [String] = []
            for try await (seq, state) in try await client.query(
                "SELECT seq, state FROM dq_item WHERE state NOT IN ('pending', 'parked') ORDER BY seq LIMIT 100", logger: logger
            ).decode((Int64, String).self) {
                problems.append("item row \(seq): unknown state \(state.prefix(32))")
            }
            return problems.isEmpty ? ["ok"] : problems
        }
    }

    func deliveries(queue: String?, limit: Int) async throws -> [DeliveryRecord] {
        try await run("read the delivery journal") { [self] in
            var bindings = PostgresBindings()
            var sql = "SELECT * FROM dq_delivery"
            if let queue {
                bindings.append(queue)
                sql += " WHERE queue = $1"
            }
            bindings.append(Int64(limit))
            sql += " ORDER BY seq DESC LIMIT $\(bindings.count)"
            return try await rows(PostgresQuery(unsafeSQL: sql, binds: bindings), Self.deliveryRecord).reversed()
        }
    }

    func pruneJournal(before cutoff: Date) async throws -> Int {
        var removed = 0
        while true {
            let (deleted, more) = try await run("prune the delivery journal") { [self] () -> (Int, Bool) in
                let head = try await rows(
                    "SELECT seq, at FROM dq_delivery ORDER BY seq LIMIT 1000"
                ) { row in try row.decode((Int64, Double).self) }
                let old = head.prefix { $0.1 < cutoff.timeIntervalSince1970 }
                guard let last = old.last else { return (0, false) }
                _ = try await client.withTransaction(logger: logger) { connection in
                    try await connection.query("DELETE FROM dq_delivery WHERE seq <= \(last.0)", logger: logger)
                }
                return (old.count, old.count == head.count && head.count == 1000)
            }
            removed += deleted
            if !more { return removed }
        }
    }

    // MARK: - Moving in from SQLite (dq migrate)

    /// Stores items moved from another store, in their order, keeping their id, state, attempts and last
    /// answer; an item whose id is already here is skipped (a migration run again after a crash). Returns
    /// how many were added.
    func importItems(_ items: [StoredItem]) async throws -> Int {
        guard !items.isEmpty else { return 0 }
        return try await run("move items in") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                let first = try await Self.reserveSequences(items.count, connection: connection, logger: logger)
                var added = 0
                for (offset, stored) in items.enumerated() {
                    let item = stored.info
                    let conditional: Bool? = stored.conditionalCreate ? nil : false
                    for try await _ in try await connection.query(
                        """
                        INSERT INTO dq_item (seq, uuid, queue, method, url, resource_type, resource_id, encrypted, content_type,
                                             body, full_url, state, attempts, enqueued_at, last_attempt_at, last_status,
                                             last_error, outcome, conditional_create)
                        VALUES (\(first + Int64(offset)), \(item.id), \(item.queue), \(item.method.rawValue), \(item.url),
                                \(item.resourceType), \(item.resourceID), \(item.encrypted), \(stored.contentType), \(stored.body),
                                \(stored.fullURL), \(item.state.rawValue), \(item.attempts), \(item.enqueuedAt.timeIntervalSince1970),
                                \(item.lastAttemptAt?.timeIntervalSince1970), \(item.lastStatus), \(item.lastError), \(item.outcome),
                                \(conditional))
                        ON CONFLICT (uuid) DO NOTHING RETURNING seq
                        """, logger: logger)
                    {
                        added += 1
                    }
                }
                return added
            }
        }
    }

    /// Adds journal lines moved from another store, skipping those already here (same id, event and time).
    func importJournal(_ records: [DeliveryRecord]) async throws -> Int {
        guard !records.isEmpty else { return 0 }
        return try await run("move the journal in") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                var added = 0
                for record in records {
                    let entries = record.entryLocations.flatMap { try? JSONEncoder().encode($0) }.map {
                        String(decoding: $0, as: UTF8.self)
                    }
                    let at = record.at.timeIntervalSince1970
                    for try await _ in try await connection.query(
                        """
                        INSERT INTO dq_delivery (item_seq, uuid, event, queue, method, url, resource_type, status, location,
                                                 server_id, version_id, attempts, enqueued_at, at, note, full_url, bundle, entries)
                        SELECT 0, \(record.id), \(record.event.rawValue), \(record.queue), \(record.method.rawValue), \(record.url),
                               \(record.resourceType), \(record.status), \(record.location), \(record.serverID), \(record.versionID),
                               \(record.attempts), \(record.enqueuedAt.timeIntervalSince1970), \(at), \(record.note), \(record.fullURL),
                               \(record.bundle), \(entries)
                        WHERE NOT EXISTS (SELECT 1 FROM dq_delivery WHERE uuid = \(record.id) AND event = \(record.event.rawValue) AND at = \(at))
                        RETURNING seq
                        """, logger: logger)
                    {
                        added += 1
                    }
                }
                return added
            }
        }
    }

    // MARK: - Rows

    /// Every row `query` returns, each made into a value by `decode`.
    private func rows<T>(_ query: PostgresQuery, _ decode: (PostgresRow) throws -> T) async throws -> [T] {
        var values: [T] = []
        for try await row in try await client.query(query, logger: logger) { values.append(try decode(row)) }
        return values
    }

    static func binds(_ values: any PostgresEncodable...) -> PostgresBindings {
        var bindings = PostgresBindings()
        for value in values { try? bindings.append(value) }
        return bindings
    }

    static func damaged(_ seq: Int64?, _ what: String) -> DataQueueError {
        DataQueueError(
            .storage,
            "item row \(seq.map(String.init) ?? "?") of the queue database is damaged (\(what)); inspect it with psql, then fix or delete that row"
        )
    }

    static func queuedItem(_ row: PostgresRow) throws -> QueuedItem {
        let cells = row.makeRandomAccess()
        let seq = try cells["seq"].decode(Int64.self)
        guard let method = FHIRMethod(rawValue: try cells["method"].decode(String.self)) else { throw damaged(seq, "unknown method") }
        guard let state = ItemState(rawValue: try cells["state"].decode(String.self)) else { throw damaged(seq, "unknown state") }
        return QueuedItem(
            sequence: seq, id: try cells["uuid"].decode(UUID.self), queue: try cells["queue"].decode(String.self),
            method: method, url: try cells["url"].decode(String.self), resourceType: try cells["resource_type"].decode(String.self),
            resourceID: try cells["resource_id"].decode(String?.self), encrypted: try cells["encrypted"].decode(Bool.self),
            state: state, attempts: try cells["attempts"].decode(Int.self),
            enqueuedAt: Date(timeIntervalSince1970: try cells["enqueued_at"].decode(Double.self)),
            lastAttemptAt: try cells["last_attempt_at"].decode(Double?.self).map(Date.init(timeIntervalSince1970:)),
            lastStatus: try cells["last_status"].decode(Int?.self), lastError: try cells["last_error"].decode(String?.self),
            outcome: try cells["outcome"].decode(String?.self), size: try cells["size"].decode(Int.self))
    }

    static func storedItem(_ row: PostgresRow) throws -> StoredItem {
        let cells = row.makeRandomAccess()
        return StoredItem(
            info: try queuedItem(row), contentType: try cells["content_type"].decode(String.self),
            conditionalCreate: try cells["conditional_create"].decode(Bool?.self) != false, body: try cells["body"].decode(Data.self),
            fullURL: try cells["full_url"].decode(String?.self))
    }

    static func deliveryRecord(_ row: PostgresRow) throws -> DeliveryRecord {
        let cells = row.makeRandomAccess()
        let seq = try cells["seq"].decode(Int64.self)
        guard let method = FHIRMethod(rawValue: try cells["method"].decode(String.self)),
            let event = DeliveryRecord.Event(rawValue: try cells["event"].decode(String.self))
        else {
            throw DataQueueError(.storage, "delivery row \(seq) of the queue database is damaged (unknown method or event)")
        }
        return DeliveryRecord(
            sequence: seq, id: try cells["uuid"].decode(UUID.self), event: event, queue: try cells["queue"].decode(String.self),
            method: method, url: try cells["url"].decode(String.self), resourceType: try cells["resource_type"].decode(String.self),
            status: try cells["status"].decode(Int?.self), location: try cells["location"].decode(String?.self),
            serverID: try cells["server_id"].decode(String?.self), versionID: try cells["version_id"].decode(String?.self),
            attempts: try cells["attempts"].decode(Int.self),
            enqueuedAt: Date(timeIntervalSince1970: try cells["enqueued_at"].decode(Double.self)),
            at: Date(timeIntervalSince1970: try cells["at"].decode(Double.self)), note: try cells["note"].decode(String?.self),
            fullURL: try cells["full_url"].decode(String?.self), bundle: try cells["bundle"].decode(String?.self),
            entryLocations: try cells["entries"].decode(String?.self).flatMap {
                try? JSONDecoder().decode([String?].self, from: Data($0.utf8))
            })
    }
}

/// The right to flush one server's queue from PostgreSQL: a lease row with an expiry on the database's
/// clock and a fencing token that grows on every takeover.
///
/// The holder renews it every third of its lifetime; on this host it counts as held only until 90% of the
/// lifetime after the start of the last successful renewal (a monotonic deadline, immune to clock jumps), and
/// ``markInFlight(sequence:)`` refuses to let anything be sent past that. The store's writes check the token.
final class PostgresLease: FlushOwnership {
    let queue: String
    let token: Int64
    private let store: PostgresQueueStore
    private let validUntil: Mutex<ContinuousClock.Instant>
    private let renewer: Mutex<Task<Void, Never>?>
    /// What this holder last wrote to the note row (see ``markInFlight(sequence:)`` and ``clearInFlight()``).
    private let note = Mutex(InFlightNoteWindow())

    private init(store: PostgresQueueStore, queue: String, token: Int64, since start: ContinuousClock.Instant) {
        self.store = store
        self.queue = queue
        self.token = token
        self.validUntil = Mutex(start + .milliseconds(Int64(store.leaseSeconds * 900)))
        self.renewer = Mutex(nil)
    }

    /// Takes the lease of `queue` if it is free (never held, released, or expired on the database's clock).
    static func take(store: PostgresQueueStore, queue: String) async throws -> PostgresLease? {
        let start = ContinuousClock.now
        let taken = try await store.client.withConnection { connection -> Int64? in
            var taken: Int64?
            for try await token in try await connection.query(
                """
                WITH taken AS (
                  INSERT INTO dq_lease (queue, holder, token, expires_at)
                  VALUES (\(queue), \(store.holder), 1, now() + make_interval(secs => \(store.leaseSeconds)))
                  ON CONFLICT (queue) DO UPDATE SET holder = EXCLUDED.holder, token = dq_lease.token + 1,
                    expires_at = EXCLUDED.expires_at
                  WHERE dq_lease.expires_at <= now()
                  RETURNING token),
                fenced AS (
                  INSERT INTO dq_note (queue, token) SELECT \(queue), token FROM taken
                  ON CONFLICT (queue) DO UPDATE SET token = EXCLUDED.token)
                SELECT token FROM taken
                """, logger: store.logger
            ).decode(Int64.self) {
                taken = token
            }
            // A token whose commit is not confirmed could be handed out again after a failover: two holders.
            try await connection.confirmCommit(logger: store.logger)
            return taken
        }
        guard let taken else { return nil }
        let lease = PostgresLease(store: store, queue: queue, token: taken, since: start)
        lease.startRenewing()
        return lease
    }

    private func startRenewing() {
        let task = Task { [weak self] in
            while !Task.isCancelled {
                guard let interval = self.map({ $0.store.leaseSeconds / 3 }) else { return }
                try? await Task.sleep(for: .milliseconds(Int64(interval * 1000)))
                guard let self, !Task.isCancelled else { return }
                let start = ContinuousClock.now
                do {
                    let renewed = try await store.client.withConnection { connection in
                        var renewed = false
                        for try await _ in try await connection.query(
                            """
                            UPDATE dq_lease SET expires_at = now() + make_interval(secs => \(store.leaseSeconds))
                            WHERE queue = \(queue) AND token = \(token) RETURNING token
                            """, logger: store.logger)
                        {
                            renewed = true
                        }
                        try await connection.confirmCommit(logger: store.logger)
                        return renewed
                    }
                    if !renewed {
                        lost()
                        return
                    }
                    validUntil.withLock { $0 = start + .milliseconds(Int64(store.leaseSeconds * 900)) }
                } catch {
                    // Not renewed this time: the deadline stands; the next round tries again.
                    store.logger.warning("cannot renew the flush lease", metadata: ["queue": "\(queue)"])
                }
            }
        }
        renewer.withLock { $0 = task }
    }

    /// The lease was taken over: nothing more may be sent.
    func lost() {
        validUntil.withLock { $0 = ContinuousClock.now - .seconds(1) }
    }

    private func checkHeld() throws {
        guard ContinuousClock.now < validUntil.withLock({ $0 }) else {
            throw DataQueueError(
                .busy, "the flush lease on \(queue) expired or was taken over by another dq instance; this flush stops")
        }
    }

    /// How long one note covers sends: a second, or a tenth of the lease when that is shorter.
    var noteWindow: Duration { .milliseconds(Int64(noteWindowSeconds * 1000)) }
    private var noteWindowSeconds: Double { min(1, store.leaseSeconds / 10) }

    /// Notes `sequence` in `dq_note`, where the token still matches (a takeover raises it there too, so a
    /// lost lease stops here), with the end of a window (``noteWindow``) as its time: the note covers every
    /// send until then, so a flush writes it once per window, not once per request. A next holder lets the
    /// server settle requests until the settle delay has passed after that time, which is never earlier
    /// than after the last request the note covers.
    ///
    /// One statement whose commit does not wait for the disk (`synchronous_commit` off for that transaction
    /// alone): the note outlives a crash of dq at once, and a crash of PostgreSQL in the next few hundred
    /// milliseconds may lose it, as the SQLite store's marker (a write to the page cache) outlives dq but not
    /// the machine.
    func markInFlight(sequence: Int64) async throws {
        try checkHeld()
        let start = ContinuousClock.now
        if note.withLock({ $0.covers(start) }) { return }
        let window = noteWindow
        let coveredUntil = Date().addingTimeInterval(noteWindowSeconds)
        let (queue, token, client, logger) = (queue, token, store.client, store.logger)
        let held = try await store.run("note the item being sent") {
            var held = false
            for try await _ in try await client.query(
                """
                WITH asynchronous AS (SELECT set_config('synchronous_commit', 'off', true))
                INSERT INTO dq_note (queue, token, in_flight_seq, in_flight_at)
                SELECT \(queue), \(token), \(sequence), \(coveredUntil.timeIntervalSince1970) FROM asynchronous
                ON CONFLICT (queue) DO UPDATE SET token = EXCLUDED.token, in_flight_seq = EXCLUDED.in_flight_seq,
                  in_flight_at = EXCLUDED.in_flight_at
                WHERE dq_note.token <= EXCLUDED.token
                RETURNING token
                """, logger: logger)
            {
                held = true
            }
            return held
        }
        note.withLock { $0.wrote(at: start, covering: held ? window : nil) }
        if !held { lost() }
        try checkHeld()
    }

    /// Clears the note, lazily: the next ``markInFlight(sequence:)`` overwrites it and ``release()`` clears
    /// it, so a flush costs no round trip per answer for it. A flusher that dies between an answer and its
    /// next send leaves the answered item's note: the next holder waits out the rest of its settle delay,
    /// which costs time, never a resource.
    func clearInFlight() async throws {
        note.withLock { $0.clear() }
    }

    func inFlight() async throws -> (sequence: Int64, sentAt: Date)? {
        if note.withLock({ $0.cleared }) { return nil }
        let (queue, client, logger) = (queue, store.client, store.logger)
        return try await store.run("read the in-flight note") {
            for try await (sequence, at) in try await client.query(
                "SELECT in_flight_seq, in_flight_at FROM dq_note WHERE queue = \(queue)", logger: logger
            ).decode((Int64?, Double?).self) {
                if let sequence, let at { return (sequence, Date(timeIntervalSince1970: at)) }
            }
            return nil
        }
    }

    func release() async {
        renewer.withLock { $0?.cancel() }
        if note.withLock({ $0.release() }) {
            _ = try? await store.client.query(
                "UPDATE dq_note SET in_flight_seq = NULL, in_flight_at = NULL WHERE queue = \(queue) AND token = \(token)",
                logger: store.logger)
        }
        _ = try? await store.client.query(
            "UPDATE dq_lease SET expires_at = '-infinity' WHERE queue = \(queue) AND token = \(token)", logger: store.logger)
    }
}

/// The commit of a statement run outside a transaction block was not confirmed: the connection closed
/// before the server said it was ready for the next query (see ``PostgresNIO/PostgresConnection/confirmCommit(logger:)``).
struct CommitNotConfirmed: Error {}

extension PostgresConnection {
    /// Returns once the server has committed the statement just run on this connection outside a
    /// transaction block, and throws if it did not.
    ///
    /// postgres-nio ends a statement's rows at its CommandComplete message, and for a statement outside
    /// `BEGIN`/`COMMIT` the server sends that *before* it commits: the commit, and a synchronous standby's
    /// acknowledgement of it, come at the protocol's Sync, answered by ReadyForQuery. A commit that fails
    /// then (a deferred constraint), or a server stopped while it waits for its standby (it flushes the
    /// CommandComplete it holds as it dies), would look like success: an enqueue reported as stored could
    /// be missing after a failover. The next query on a connection runs only after that ReadyForQuery, and
    /// an error or a lost connection before it fails the query, so one `SELECT 1` settles it. (A `COMMIT`
    /// statement needs none of this: the server commits before it answers.)
    ///
    /// postgres-nio never answers a query written to a connection that has just closed (it drops the write),
    /// so the close is watched too: it fails the confirmation, which can then no longer come.
    func confirmCommit(logger: Logger) async throws {
        if isClosed { throw CommitNotConfirmed() }
        let race = DeadlineRace<Void>()
        try await withCheckedThrowingContinuation { continuation in
            race.continuation.withLock { $0 = continuation }
            // The watcher is in place before the query starts, so that the query's end always cancels it.
            race.timer.withLock {
                $0 = Task {
                    while true {
                        try await Task.sleep(for: .milliseconds(20))
                        if self.isClosed { return race.finish(.failure(CommitNotConfirmed())) }
                    }
                }
            }
            Task {
                do {
                    _ = try await self.query("SELECT 1", logger: logger).collect()
                    race.finish(.success(()))
                } catch {
                    race.finish(.failure(error))
                }
            }
        }
    }
}

/// The one continuation of ``PostgresQueueStore/withDeadline(seconds:what:_:)`` (and of
/// ``PostgresNIO/PostgresConnection/confirmCommit(logger:)``): the first result wins.
private final class DeadlineRace<T: Sendable>: Sendable {
    let continuation = Mutex<CheckedContinuation<T, any Error>?>(nil)
    /// The deadline's timer, cancelled when the work finishes first (so that no sleeping task outlives it).
    let timer = Mutex<Task<Void, any Error>?>(nil)

    func finish(_ result: Result<T, any Error>) {
        guard let continuation = continuation.withLock({ $0.take() }) else { return }
        timer.withLock { $0.take() }?.cancel()
        continuation.resume(with: result)
    }
}

/// Group commit for a store whose commits are asynchronous: an enqueue that finds no commit running commits
/// its item itself; those that arrive meanwhile join the next commit, up to 512 per transaction.
final class AsyncGroupCommit: Sendable {
    private struct Waiter {
        let item: NewItem
        let continuation: CheckedContinuation<Int64, any Error>
    }

    private struct State {
        var waiting: [Waiter] = []
        var running = false
    }

    private let state = Mutex(State())
    private let commit: @Sendable ([NewItem]) async throws -> [Int64]

    init(commit: @escaping @Sendable ([NewItem]) async throws -> [Int64]) { self.commit = commit }

    func submit(_ item: NewItem) async throws -> Int64 {
        let alone = state.withLock { state in
            if state.running { return false }
            state.running = true
            return true
        }
        guard alone else {
            return try await withCheckedThrowingContinuation { continuation in
                let lead = state.withLock { state in
                    state.waiting.append(Waiter(item: item, continuation: continuation))
                    if state.running { return false }
                    state.running = true
                    return true
                }
                if lead { Task { await self.drain() } }
            }
        }
        // No commit running: this enqueue commits its own item in its own task (no hand-off); those that
        // arrived meanwhile are committed by a task of their own.
        let result: Result<[Int64], any Error>
        do {
            result = .success(try await commit([item]))
        } catch {
            result = .failure(error)
        }
        let more = state.withLock { state in
            if state.waiting.isEmpty {
                state.running = false
                return false
            }
            return true
        }
        if more { Task { await self.drain() } }
        return try result.get()[0]
    }

    private func drain() async {
        while true {
            let batch = state.withLock { state -> [Waiter] in
                guard !state.waiting.isEmpty else {
                    state.running = false
                    return []
                }
                let batch = Array(state.waiting.prefix(512))
                state.waiting.removeFirst(batch.count)
                return batch
            }
            guard !batch.isEmpty else { return }
            do {
                let sequences = try await commit(batch.map(\.item))
                for (waiter, sequence) in zip(batch, sequences) { waiter.continuation.resume(returning: sequence) }
            } catch {
                for waiter in batch { waiter.continuation.resume(throwing: error) }
            }
        }
    }
}

/// libpq's password file: `$PGPASSFILE`, else `~/.pgpass`; lines `host:port:database:user:password`, `*`
/// matching anything, `\:` and `\\` escaped; the first matching line wins. Like libpq, a file others can
/// read or write is not used.
enum PasswordFile {
    static func password(host: String, port: Int, database: String, user: String, environment: [String: String]) -> String? {
        guard let path = environment["PGPASSFILE"] ?? environment["HOME"].map({ $0 + "/.pgpass" }),
            let attributes = try? FileManager.default.attributesOfItem(atPath: path),
            let mode = attributes[.posixPermissions] as? Int, mode & 0o077 == 0,
            let text = try? String(contentsOfFile: path, encoding: .utf8)
        else { return nil }
        for line in text.split(whereSeparator: \.isNewline) where !line.hasPrefix("#") {
            let fields = split(line)
            guard fields.count == 5 else { continue }
            let wanted = [host, String(port), database, user]
            if zip(fields.prefix(4), wanted).allSatisfy({ $0 == "*" || $0 == $1 }) { return fields[4] }
        }
        return nil
    }

    /// A line's fields: split at unescaped colons, with `\:` and `\\` unescaped.
    private static func split(_ line: Substring) -> [String] {
        var fields: [String] = []
        var current = ""
        var escaped = false
        for character in line {
            if escaped {
                current.append(character)
                escaped = false
            } else if character == "\\" {
                escaped = true
            } else if character == ":" && fields.count < 4 {
                fields.append(current)
                current = ""
            } else {
                current.append(character)
            }
        }
        fields.append(current)
        return fields
    }
}
