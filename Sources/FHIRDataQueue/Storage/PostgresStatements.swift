import Foundation
import Logging
import PostgresNIO
import Synchronization

/// Runs the store's hot statements (each its own transaction, confirmed by
/// ``PostgresNIO/PostgresConnection/confirmCommit(logger:)``) as named prepared statements, which the server parses and plans once per
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
                        try await connection.confirmCommit(logger: logger)
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
        let query = PostgresQuery(unsafeSQL: Statement.sql, binds: try statement.makeBindings())
        return try await client.withConnection { connection in
            var last: Statement.Row?
            for try await row in try await connection.query(query, logger: logger) { last = try statement.decodeRow(row) }
            try await connection.confirmCommit(logger: logger)
            return last
        }
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

/// One item's enqueue: the counter row, the row and its server's notification in one statement. The
/// counter row stays locked until the commit, so sequences rise in commit order.
struct EnqueueOne: PostgresPreparedStatement {
    static let sql = """
        WITH counter AS (UPDATE dq_meta SET next_seq = next_seq + 1 WHERE id = 1 RETURNING next_seq AS first),
        stored AS (
          INSERT INTO dq_item (\(PostgresQueueStore.itemInsertColumns))
          SELECT first, $1, $2, $3, $4, $5, NULLIF($6, ''), $7, $8, $9, NULLIF($10, ''), $11 FROM counter)
        SELECT first, (SELECT count(pg_notify('dq_enqueue', $2))) FROM counter
        """
    static let bindingDataTypes: [PostgresDataType] = [
        .uuid, .text, .text, .text, .text, .text, .bool, .text, .bytea, .text, .float8,
    ]
    static let name = PreparedStatements.name("dq_enqueue_one", sql: sql, types: bindingDataTypes)
    typealias Row = Int64

    var item: NewItem

    func makeBindings() throws -> PostgresBindings {
        var bindings = PostgresBindings(capacity: 11)
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
        bindings.append(Date().timeIntervalSince1970)
        return bindings
    }

    func decodeRow(_ row: PostgresRow) throws -> Int64 { try row.decode((Int64, Int64).self).0 }
}

/// Several items' enqueue (up to ``PostgresQueueStore/statementRows``): one array per column, numbered in
/// their order from the counter, and one notification per server.
struct EnqueueMany: PostgresPreparedStatement {
    static let sql = """
        WITH counter AS (UPDATE dq_meta SET next_seq = next_seq + $1 WHERE id = 1 RETURNING next_seq - $1 + 1 AS first),
        stored AS (\(PostgresQueueStore.itemInsertSQL(base: 1, first: "(SELECT first FROM counter)")) RETURNING queue)
        SELECT counter.first, (SELECT count(pg_notify('dq_enqueue', q)) FROM (SELECT DISTINCT queue AS q FROM stored) d)
        FROM counter
        """
    static let bindingDataTypes: [PostgresDataType] = [
        .int8, .uuidArray, .textArray, .textArray, .textArray, .textArray, .textArray, .boolArray, .textArray, .byteaArray,
        .textArray, .float8,
    ]
    static let name = PreparedStatements.name("dq_enqueue_many", sql: sql, types: bindingDataTypes)
    typealias Row = Int64

    var items: ArraySlice<NewItem>

    func makeBindings() throws -> PostgresBindings {
        var bindings = PostgresBindings(capacity: 12)
        bindings.append(Int64(items.count))
        PostgresQueueStore.appendItemColumns(items, to: &bindings)
        return bindings
    }

    func decodeRow(_ row: PostgresRow) throws -> Int64 { try row.decode((Int64, Int64).self).0 }
}
