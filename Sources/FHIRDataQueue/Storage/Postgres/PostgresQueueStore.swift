import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOSSL
import PostgresNIO

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
    /// The task that runs the client dq made (nil for a host's client, which the host runs).
    let runTask: Task<Void, Never>?
    let migration = NIOLockedValueBox<Task<Void, any Error>?>(nil)
    let readOnly: Bool
    /// One connection of its own, made before the first operation: the pool retries a refused connection
    /// silently until the deadline, where this one names the cause at once.
    /// (Nil for a host's client, whose configuration dq does not see.)
    let probeConfiguration: PostgresConnection.Configuration?
    /// Single enqueues, committed in groups.
    let grouper: GroupCommit<NewItem, Int64>
    /// Whether the enqueue statements are prepared (planned once per connection).
    let statements: PreparedStatements
    /// Who holds leases from this store (host and process, for operators reading `dq_lease`).
    let holder: String

    /// This machine's name as gethostname(2) has it, for the lease's holder. (Not ProcessInfo's hostName, which
    /// may ask DNS for the canonical name: seconds at each start where DNS is slow or down.)
    static let machineName: String = {
        var buffer = [CChar](repeating: 0, count: 256)
        guard gethostname(&buffer, buffer.count - 1) == 0 else { return "localhost" }
        return String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }()

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
        self.holder = "\(Self.machineName):\(getpid())"
        let client = PostgresClient(configuration: configuration, backgroundLogger: logger)
        self.client = client
        runTask = Task { await client.run() }
        self.readOnly = readOnly
        let insertLogger = logger
        grouper = Self.groupCommit(client: client, statements: statements, logger: insertLogger)
    }

    /// Uses a client the host made and runs (`client.run()` in the host's own `ServiceGroup` or task), as
    /// postgres-nio intends: the store neither starts nor closes it.
    ///
    /// - Parameters:
    ///   - preparedStatements: whether enqueue statements may be prepared (not behind PgBouncer in
    ///     transaction mode before 1.21).
    init(client: PostgresClient, preparedStatements: Bool = true, readOnly: Bool = false, leaseSeconds: Double = 30, logger: Logger) {
        var logger = logger
        if logger.logLevel < .info { logger.logLevel = .info }
        self.client = client
        self.runTask = nil
        self.probeConfiguration = nil
        self.displayURL = "the host's PostgreSQL client"
        let statements = PreparedStatements(enabled: preparedStatements, logger: logger)
        self.statements = statements
        self.operationTimeout = 15
        self.leaseSeconds = leaseSeconds
        self.logger = logger
        self.holder = "\(Self.machineName):\(getpid())"
        self.readOnly = readOnly
        let insertLogger = logger
        grouper = Self.groupCommit(client: client, statements: statements, logger: insertLogger)
    }

    deinit { runTask?.cancel() }

    /// Group commit of single enqueues: the first that finds none running commits alone, in its own task.
    private static func groupCommit(client: PostgresClient, statements: PreparedStatements, logger: Logger)
        -> GroupCommit<NewItem, Int64>
    {
        GroupCommit(
            committer: .async { items in
                do {
                    return .success(try await Self.insert(items, client: client, statements: statements, logger: logger))
                } catch {
                    return .failure(Self.map(error, doing: "enqueue"))
                }
            })
    }

    /// Closes the pool dq made: waits for its connections to close, at most 5 seconds (a connection to a
    /// server that stopped answering is left to the process's exit). A host's client is left running.
    func shutdown() async {
        guard let run = runTask else { return }
        run.cancel()
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
}
