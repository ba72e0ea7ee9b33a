import Foundation
import Logging
import NIOSSL
import PostgresNIO

// What operators see and do.
extension PostgresQueueStore {
    func status(queue: String, countingJournal: Bool) async throws -> QueueStatus {
        try await checkStates(queue: queue)
        return try await run("read the queue status") { [self] in
            var pending = 0
            var parked = 0
            var delivered = 0
            var oldest: Double?
            var lastDelivery: Double?
            var duplicates = 0
            var possible = 0
            for try await (p, k, d, o, l, u, m) in try await client.query(
                """
                SELECT (SELECT count(*) FROM dq_item WHERE queue = \(queue) AND state = 'pending'),
                       (SELECT count(*) FROM dq_item WHERE queue = \(queue) AND state = 'parked'),
                       (SELECT count(*) FROM dq_delivery
                        WHERE \(countingJournal) AND queue = \(queue) AND event IN ('delivered', 'already-present')),
                       (SELECT enqueued_at FROM dq_item WHERE queue = \(queue) AND state = 'pending' ORDER BY seq LIMIT 1),
                       (SELECT at FROM dq_delivery WHERE queue = \(queue) AND event IN ('delivered', 'already-present')
                        ORDER BY seq DESC LIMIT 1),
                       (SELECT count(*) FROM dq_delivery WHERE \(countingJournal) AND queue = \(queue) AND event = 'duplicate'),
                       (SELECT count(*) FROM dq_delivery WHERE \(countingJournal) AND queue = \(queue) AND event = 'delivered'
                        AND note LIKE 'possible duplicate: %')
                """, logger: logger
            ).decode((Int, Int, Int, Double?, Double?, Int, Int).self) {
                (pending, parked, delivered, oldest, lastDelivery, duplicates, possible) = (p, k, d, o, l, u, m)
            }
            let state = try await serverState(queue: queue)
            return QueueStatus(
                queue: queue, pending: pending, parked: parked, delivered: delivered,
                oldestPendingAt: oldest.map(Date.init(timeIntervalSince1970:)), consecutiveFailures: state.failures,
                nextAttemptAt: state.nextAttemptAt, lastError: state.lastError,
                lastDeliveryAt: lastDelivery.map(Date.init(timeIntervalSince1970:)), duplicates: duplicates,
                possibleDuplicates: possible)
        }
    }

    func queues() async throws -> [String] {
        try await run("list queues") { [self] in
            var names: [String] = []
            for try await name in try await client.query(
                // The names in dq_item and dq_delivery by skipping along their (queue, …) indexes, one seek per name:
                // the journal keeps months of deliveries, which a scan would read whole.
                """
                WITH RECURSIVE items(name) AS (
                  (SELECT queue FROM dq_item ORDER BY queue LIMIT 1)
                  UNION ALL SELECT (SELECT queue FROM dq_item WHERE queue > items.name ORDER BY queue LIMIT 1)
                  FROM items WHERE items.name IS NOT NULL
                ), journal(name) AS (
                  (SELECT queue FROM dq_delivery ORDER BY queue LIMIT 1)
                  UNION ALL SELECT (SELECT queue FROM dq_delivery WHERE queue > journal.name ORDER BY queue LIMIT 1)
                  FROM journal WHERE journal.name IS NOT NULL
                )
                SELECT name FROM items WHERE name IS NOT NULL UNION SELECT name FROM journal WHERE name IS NOT NULL
                UNION SELECT queue FROM dq_server_state ORDER BY 1
                """,
                logger: logger
            ).decode(String.self) {
                names.append(name)
            }
            return names
        }
    }

    func items(queue: String?, state: QueuedItem.State?, limit: Int) async throws -> [QueuedItem] {
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

    func allStatuses(countingJournal: Bool) async throws -> [QueueStatus] {
        var statuses: [QueueStatus] = []
        for queue in try await queues() { statuses.append(try await status(queue: queue, countingJournal: countingJournal)) }
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

    func pruneJournal(before cutoff: Date, progress: @Sendable (Int) -> Void) async throws -> Int {
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
            progress(removed)
            if !more { return removed }
        }
    }
}
