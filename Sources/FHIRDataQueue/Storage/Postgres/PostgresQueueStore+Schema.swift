import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOSSL
import PostgresNIO

// The schema (tables, procedures), created or migrated under an advisory lock.
extension PostgresQueueStore {
    /// The signatures of the current enqueue procedures (``EnqueueOne``, ``EnqueueMany``).
    static let enqueueOneV2 = "dq_enqueue_one_v2(uuid,text,text,text,text,text,bool,text,bytea,text,text,double precision,bigint)"
    static let enqueueManyV2 =
        "dq_enqueue_many_v2(bigint,uuid[],text[],text[],text[],text[],text[],bool[],text[],bytea[],text[],text[],double precision,bigint)"

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
        // Sealing at rest: the at-rest keys the items are sealed under, each with the index key wrapped under it.
        """
        CREATE TABLE IF NOT EXISTS dq_seal_key (
          key_id text PRIMARY KEY, index_key bytea NOT NULL, added_at double precision NOT NULL)
        """,
        // A receiver's registered clients and the bearer tokens issued to them (see ``ClientRegistry``): hashes only.
        """
        CREATE TABLE IF NOT EXISTS dq_clients (
          client_id text PRIMARY KEY, secret_hash text NOT NULL, created_at double precision NOT NULL)
        """,
        """
        CREATE TABLE IF NOT EXISTS dq_tokens (
          token_hash text PRIMARY KEY, client_id text NOT NULL REFERENCES dq_clients (client_id) ON DELETE CASCADE,
          expires_at double precision NOT NULL)
        """,
        "CREATE INDEX IF NOT EXISTS dq_tokens_by_expiry ON dq_tokens (expires_at)",
        // Envelopes opened per receiver key and UTC day (see ``KeyOpenLog``).
        "CREATE TABLE IF NOT EXISTS dq_key_opens (key_id text NOT NULL, day bigint NOT NULL, count bigint NOT NULL, PRIMARY KEY (key_id, day))",
        // A receiver's repeats (see ``ReceiptStore``): the client an item came from, the receipts of requests with an
        // `Idempotency-Key`, and the digests of delivered resources by client (keyed hashes in a sealed queue).
        "ALTER TABLE dq_item ADD COLUMN IF NOT EXISTS client_id text",
        """
        CREATE TABLE IF NOT EXISTS dq_receipts (
          client_id text NOT NULL, idempotency_key text NOT NULL, fingerprint text NOT NULL, item_uuid uuid NOT NULL,
          status int, location text, content_type text, body bytea, created_at double precision NOT NULL,
          PRIMARY KEY (client_id, idempotency_key))
        """,
        "CREATE INDEX IF NOT EXISTS dq_receipts_by_age ON dq_receipts (created_at)",
        """
        CREATE TABLE IF NOT EXISTS dq_digests (
          client_id text NOT NULL, digest text NOT NULL, item_uuid uuid NOT NULL, delivered_at double precision NOT NULL,
          PRIMARY KEY (client_id, digest))
        """,
        "CREATE INDEX IF NOT EXISTS dq_digests_by_age ON dq_digests (delivered_at)",
        // Which client of a receiver wrote a resource (see ``ClientRegistry/claimResource(queue:target:clientID:at:)``).
        "CREATE TABLE IF NOT EXISTS dq_resource_claims (claim text PRIMARY KEY, client_id text NOT NULL, claimed_at double precision NOT NULL)",
        "CREATE INDEX IF NOT EXISTS dq_item_by_client ON dq_item (client_id) WHERE client_id IS NOT NULL",
        // The enqueue procedures (see ``EnqueueOne``): made once under their versioned names, never replaced, so
        // that a start does not rewrite the catalog and two dq versions sharing a database each call their own. v2
        // stores the client a receiver's item came from. v1 is not made here: a dq before v2 that shares the
        // database makes it in its own migration (its schema check finds it missing), and no v1 is ever dropped.
        """
        DO $do$ BEGIN
          IF to_regprocedure('\(enqueueOneV2)') IS NULL THEN
            CREATE PROCEDURE dq_enqueue_one_v2(p_uuid uuid, p_queue text, p_method text, p_url text, p_type text, p_id text,
              p_encrypted bool, p_content_type text, p_body bytea, p_full_url text, p_client text, p_at double precision,
              INOUT o_first bigint DEFAULT NULL)
            LANGUAGE plpgsql AS $proc$
            BEGIN
              UPDATE dq_meta SET next_seq = next_seq + 1 WHERE id = 1 RETURNING next_seq INTO o_first;
              INSERT INTO dq_item (\(itemInsertColumns))
              VALUES (o_first, p_uuid, p_queue, p_method, p_url, p_type, NULLIF(p_id, ''), p_encrypted, p_content_type, p_body,
                      NULLIF(p_full_url, ''), NULLIF(p_client, ''), p_at);
              PERFORM pg_notify('dq_enqueue', p_queue);
              COMMIT;
            END $proc$;
          END IF;
          IF to_regprocedure('\(enqueueManyV2)') IS NULL THEN
            CREATE PROCEDURE dq_enqueue_many_v2(p_count bigint, p_uuid uuid[], p_queue text[], p_method text[], p_url text[],
              p_type text[], p_id text[], p_encrypted bool[], p_content_type text[], p_body bytea[], p_full_url text[],
              p_client text[], p_at double precision, INOUT o_first bigint DEFAULT NULL)
            LANGUAGE plpgsql AS $proc$
            BEGIN
              UPDATE dq_meta SET next_seq = next_seq + p_count WHERE id = 1 RETURNING next_seq - p_count + 1 INTO o_first;
              INSERT INTO dq_item (\(itemInsertColumns))
              SELECT o_first + v.o - 1, v.uuid, v.queue, v.method, v.url, v.resource_type, NULLIF(v.resource_id, ''),
                     v.encrypted, v.content_type, v.body, NULLIF(v.full_url, ''), NULLIF(v.client_id, ''), p_at
              FROM unnest(p_uuid, p_queue, p_method, p_url, p_type, p_id, p_encrypted, p_content_type, p_body, p_full_url,
                          p_client)
                   WITH ORDINALITY AS v(uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body,
                                        full_url, client_id, o);
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
           AND to_regclass('dq_note') IS NOT NULL AND to_regclass('dq_seal_key') IS NOT NULL
           AND to_regclass('dq_clients') IS NOT NULL AND to_regclass('dq_tokens') IS NOT NULL
           AND to_regclass('dq_tokens_by_expiry') IS NOT NULL AND to_regclass('dq_key_opens') IS NOT NULL
           AND to_regclass('dq_receipts_by_age') IS NOT NULL AND to_regclass('dq_digests_by_age') IS NOT NULL
           AND to_regclass('dq_resource_claims') IS NOT NULL AND to_regclass('dq_item_by_client') IS NOT NULL
           AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('dq_item')
                       AND attname = 'client_id' AND NOT attisdropped)
           AND to_regprocedure('\(enqueueOneV2)') IS NOT NULL AND to_regprocedure('\(enqueueManyV2)') IS NOT NULL
           AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('dq_server_state')
                       AND attname = 'conditional_create' AND NOT attisdropped)
           AND NOT EXISTS (SELECT 1 FROM dq_lease l WHERE l.in_flight_seq IS NOT NULL
                           AND NOT EXISTS (SELECT 1 FROM dq_note n WHERE n.queue = l.queue))
        """

    /// Creates the schema under a transaction-scoped advisory lock (one instance at a time; the others find
    /// it made), unless it is complete and current already (``schemaIsCurrent``).
    static func migrate(_ client: PostgresClient, readOnly: Bool, display: String, logger: Logger) async throws {
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
    /// dq gives up when PostgreSQL has not answered for ``operationTimeout`` instead, without waiting for the
    /// stuck work (the operation may still complete on the server: an enqueue that timed out may be stored).
    /// The deadline is per answer, not per operation: a long operation of many statements (a large enqueue,
    /// a migration) that calls ``answered()`` after each goes on as long as each comes within it.
    func run<T: Sendable>(_ what: String, _ body: @escaping @Sendable () async throws -> T) async throws -> T {
        do {
            return try await Self.withDeadline(seconds: operationTimeout, what: what) { [self] in
                try await schemaReady()
                return try await body()
            }
        } catch {
            throw Self.map(error, doing: what)
        }
    }

    /// `body`'s result, or a `.transport` error once `seconds` pass with no answer (the start, or the last
    /// ``answered()`` in `body`); `body` runs in a task of its own that is cancelled, not awaited, then.
    static func withDeadline<T: Sendable>(
        seconds: Double, what: String, _ body: @escaping @Sendable () async throws -> T
    ) async throws -> T {
        let race = DeadlineRace<T>()
        let answers = AnswerClock()
        return try await withCheckedThrowingContinuation { continuation in
            race.continuation.withLockedValue { $0 = continuation }
            // The timer is in place before the work starts, so that the work's end always cancels it.
            let limit = Duration.milliseconds(Int64(seconds * 1000))
            race.timer.withLockedValue {
                $0 = Task {
                    while let due = answers.due(limit: limit) {
                        try await Task.sleep(until: due)
                    }
                    race.work.withLockedValue { $0 }?.cancel()
                    race.finish(.failure(DataQueueError(.transport, "cannot \(what): PostgreSQL did not answer within \(Int(seconds)) s")))
                }
            }
            race.work.withLockedValue {
                $0 = Task {
                    do {
                        race.finish(.success(try await $answers.withValue(answers) { try await body() }))
                    } catch {
                        race.finish(.failure(error))
                    }
                }
            }
        }
    }

    /// When PostgreSQL last answered in the operation ``withDeadline(seconds:what:_:)`` runs (a task-local
    /// value: the operation's own task and what it awaits).
    @TaskLocal static var answers: AnswerClock?

    /// Tells the running operation's deadline that PostgreSQL answered (a statement of several finished): its
    /// time starts again. Nothing outside an operation.
    static func answered() {
        answers?.touch()
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
    func schemaReady() async throws {
        let task = migration.withLockedValue { current -> Task<Void, any Error> in
            if let current { return current }
            let made = Task { [client, readOnly, displayURL, logger, probeConfiguration] in
                if let probeConfiguration { try await Self.probe(probeConfiguration, display: displayURL, logger: logger) }
                try await Self.migrate(client, readOnly: readOnly, display: displayURL, logger: logger)
            }
            current = made
            return made
        }
        do {
            try await task.value
        } catch {
            migration.withLockedValue { if $0 == task { $0 = nil } }
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
            case .server where state == PostgresQueueStore.plainItemRefusal:
                return SealedStorage.plainItemRefused
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
}
