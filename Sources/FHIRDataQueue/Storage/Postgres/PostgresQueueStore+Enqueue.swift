import Foundation
import Logging
import NIOSSL
import PostgresNIO

// Storing new items, single (grouped) and many.
extension PostgresQueueStore {
    func insert(_ items: [NewItem]) async throws -> [Int64] {
        try await run("enqueue") { [self] in try await Self.insert(items, client: client, statements: statements, logger: logger) }
    }

    nonisolated(nonsending) func insertGrouped(_ item: NewItem) async throws -> Int64 {
        try await run("enqueue") { [grouper] in try await grouper.submit(item) }
    }

    static let itemInsertColumns =
        "seq, uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body, full_url, client_id, enqueued_at"

    /// Reserves `count` sequence numbers from the counter row and returns the first. The row stays locked
    /// until the caller's transaction commits, so sequences rise in commit order.
    static func reserveSequences(_ count: Int, connection: PostgresConnection, logger: Logger) async throws -> Int64 {
        var last: Int64 = 0
        for try await value in try await connection.query(
            "UPDATE dq_meta SET next_seq = next_seq + \(Int64(count)) WHERE id = 1 RETURNING next_seq", logger: logger
        ).decode(Int64.self) {
            last = value
        }
        return last - Int64(count) + 1
    }

    /// Appends `items`' columns to `bindings` as one array each (eleven parameters) and then the enqueue time.
    /// `resource_id`, `full_url` and `client_id` travel as empty strings for NULL (none can be empty).
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
        bindings.append(items.map { $0.clientID ?? "" })
        bindings.append(Date().timeIntervalSince1970)
    }

    /// The `INSERT … SELECT` of items whose columns are the parameters after `base` (as
    /// ``appendItemColumns(_:to:)`` appends them), numbered from the sequence `first` (an SQL expression) in
    /// their order: one statement and twelve parameters however many items there are, so the server parses
    /// a short statement once.
    static func itemInsertSQL(base: Int, first: String) -> String {
        let arrays = (1...11).map { "$\(base + $0)" }.joined(separator: ", ")
        return """
            INSERT INTO dq_item (\(itemInsertColumns))
            SELECT \(first) + v.o - 1, v.uuid, v.queue, v.method, v.url, v.resource_type, NULLIF(v.resource_id, ''),
                   v.encrypted, v.content_type, v.body, NULLIF(v.full_url, ''), NULLIF(v.client_id, ''), $\(base + 12)
            FROM unnest(\(arrays)) WITH ORDINALITY
                 AS v(uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body, full_url, client_id, o)
            """
    }

    /// The most items one enqueue statement carries (its message stays a few megabytes).
    static let statementRows = 1000

    /// Stores `items` durably. Up to ``statementRows`` items are one statement (``EnqueueOne`` or
    /// ``EnqueueMany``), hence one round trip and one commit: the counter row (locked until that commit, so
    /// sequences rise in commit order), the rows, and a notification per server. More are one transaction of
    /// such inserts.
    static func insert(
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
                var bindings = PostgresBindings(capacity: 12)
                appendItemColumns(items[start..<min(start + statementRows, items.count)], to: &bindings)
                let insert = itemInsertSQL(base: 0, first: String(first + Int64(start)))
                try await connection.query(PostgresQuery(unsafeSQL: insert, binds: bindings), logger: logger)
                answered()
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
}
