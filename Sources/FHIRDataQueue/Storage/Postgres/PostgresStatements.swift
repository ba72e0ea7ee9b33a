import Foundation
import Logging
import PostgresNIO
import Synchronization

/// Runs the store's hot statements (procedures that commit before they answer) as named prepared statements, which the server parses and plans once per
/// connection (an enqueue's CTE costs about as much to plan as to run), and falls back to unnamed ones for
/// good when they cannot work: with `prepared_statements=off` in the URL, or the first time the server says
/// a prepared statement is missing (26000) or already exists (42P05), as it does behind PgBouncer before
/// 1.21 in transaction mode, which hands a client's statements to different server connections. Neither
/// error runs the statement, so it is run again unprepared.
///
/// Statement names carry a hash of their SQL and parameter types, so two dq versions sharing server
/// connections (through a pooler, during an upgrade) never run each other's statement under one name.
final class PreparedStatements: Sendable {
    private let enabled: Atomic<Bool>
    private let logger: Logger

    init(enabled: Bool, logger: Logger) {
        self.enabled = Atomic(enabled)
        self.logger = logger
    }

    /// Whether statements are still prepared.
    var isEnabled: Bool { enabled.load(ordering: .relaxed) }

    /// The last row of `statement` (nil when it returns none), prepared when that is on.
    func single<Statement: PostgresPreparedStatement>(
        _ statement: Statement, client: PostgresClient, logger: Logger
    ) async throws -> Statement.Row? where Statement.Row: Sendable {
        if isEnabled {
            do {
                return try await client.withConnection { connection in
                    do {
                        var last: Statement.Row?
                        for try await row in try await connection.execute(statement, logger: logger) { last = row }
                        return last
                    } catch let error as PSQLError where error.code == .server && !Self.isPoolerRefusal(error) {
                        // postgres-nio keeps a failed preparation (a lock timeout while an operator alters the
                        // table, say) for the connection's life and answers every later use with it: the
                        // connection is closed, so that the pool replaces it.
                        try? await connection.close()
                        throw error
                    }
                }
            } catch let error as PSQLError where Self.isPoolerRefusal(error) {
                if enabled.exchange(false, ordering: .relaxed) {
                    self.logger.notice(
                        "PostgreSQL prepared statements do not work here (a pooler in transaction mode?); using unprepared ones (prepared_statements=off in the database URL says so at once)",
                        metadata: ["sqlstate": "\(error.serverInfo?[.sqlState] ?? "")"])
                }
            }
        }
        var last: Statement.Row?
        let query = PostgresQuery(unsafeSQL: Statement.sql, binds: try statement.makeBindings())
        for try await row in try await client.query(query, logger: logger) { last = try statement.decodeRow(row) }
        return last
    }

    /// Whether the server answered invalid_sql_statement_name (26000) or duplicate_prepared_statement (42P05).
    static func isPoolerRefusal(_ error: PSQLError) -> Bool {
        error.code == .server && ["26000", "42P05"].contains(error.serverInfo?[.sqlState] ?? "")
    }

    /// A statement name from `prefix` and a hash of `sql` and the parameter types (FNV-1a, 64 bits: stable
    /// across processes).
    static func name(_ prefix: String, sql: String, types: [PostgresDataType] = []) -> String {
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for byte in (sql + types.map { String($0.rawValue) }.joined(separator: ",")).utf8 {
            hash ^= UInt64(byte)
            hash = hash &* 0x100_0000_01b3
        }
        return prefix + "_" + String(hash, radix: 16)
    }
}

/// One item's enqueue: the counter row, the row and its server's notification, committed by the procedure
/// itself (`dq_enqueue_one_v2`, made with the schema) before it answers.
///
/// The commit inside the procedure is the point. For a statement outside `BEGIN`/`COMMIT` the server answers
/// (CommandComplete) before it commits, at the protocol's Sync, and postgres-nio counts a statement done at
/// that answer: a commit refused then, or a primary stopped while it waited for its synchronous standby (it
/// flushes the answer it holds as it dies), looked like success, and an enqueue reported stored could be
/// missing after a failover. A `CALL` answers after the procedure returns, so after its `COMMIT` (and the
/// standby's acknowledgement of it): one round trip, where confirming a plain statement costs a second one
/// (see ``PostgresNIO/PostgresConnection/confirmCommit(logger:)``). The counter row stays locked until that
/// commit, so sequences rise in commit order.
struct EnqueueOne: PostgresPreparedStatement {
    static let sql = "CALL dq_enqueue_one_v2($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, NULL)"
    static let bindingDataTypes: [PostgresDataType] = [
        .uuid, .text, .text, .text, .text, .text, .bool, .text, .bytea, .text, .text, .float8,
    ]
    static let name = PreparedStatements.name("dq_enqueue_one", sql: sql, types: bindingDataTypes)
    typealias Row = Int64

    var item: NewItem

    func makeBindings() throws -> PostgresBindings {
        var bindings = PostgresBindings(capacity: 12)
        bindings.append(item.id)
        bindings.append(item.queue)
        bindings.append(item.method.rawValue)
        bindings.append(item.url)
        bindings.append(item.resourceType)
        bindings.append(item.resourceID ?? "")
        bindings.append(item.encrypted)
        bindings.append(item.contentType)
        bindings.append(ByteBuffer(bytes: item.body))
        bindings.append(item.fullURL ?? "")
        bindings.append(item.clientID ?? "")
        bindings.append(Date().timeIntervalSince1970)
        return bindings
    }

    func decodeRow(_ row: PostgresRow) throws -> Int64 { try row.decode(Int64.self) }
}

/// Several items' enqueue (up to ``PostgresQueueStore/statementRows``): one array per column, numbered in
/// their order from the counter, and one notification per server, committed by the procedure
/// (`dq_enqueue_many_v2`) before it answers, as ``EnqueueOne`` is.
struct EnqueueMany: PostgresPreparedStatement {
    static let sql = "CALL dq_enqueue_many_v2($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, NULL)"
    static let bindingDataTypes: [PostgresDataType] = [
        .int8, .uuidArray, .textArray, .textArray, .textArray, .textArray, .textArray, .boolArray, .textArray, .byteaArray,
        .textArray, .textArray, .float8,
    ]
    static let name = PreparedStatements.name("dq_enqueue_many", sql: sql, types: bindingDataTypes)
    typealias Row = Int64

    var items: ArraySlice<NewItem>

    func makeBindings() throws -> PostgresBindings {
        var bindings = PostgresBindings(capacity: 13)
        bindings.append(Int64(items.count))
        PostgresQueueStore.appendItemColumns(items, to: &bindings)
        return bindings
    }

    func decodeRow(_ row: PostgresRow) throws -> Int64 { try row.decode(Int64.self) }
}
