import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

// What operators see and do: status, items, retry, drop, journal, integrity, pruning.
extension SQLiteQueueStore {
    /// Throws for a row of `queue` in no known state: it would be neither counted nor sent, and sending the
    /// items after it could overtake it.
    static func checkStates(queue: String, db: Database) throws {
        if let row = try Row.fetchOne(db, sql: StatusQueries.damaged, arguments: [queue]) {
            throw damaged("item", row, "unknown state")
        }
    }

    /// Checks that every row of `queue` is in a known state (see ``checkStates(queue:db:)``).
    func checkStates(queue: String) async throws {
        try await read("read the queue") { db in try Self.checkStates(queue: queue, db: db) }
    }

    func status(queue: String, countingJournal: Bool) async throws -> QueueStatus {
        try await read("read the queue status") { db in
            let pending = try Int.fetchOne(db, sql: StatusQueries.pending, arguments: [queue]) ?? 0
            let parked = try Int.fetchOne(db, sql: StatusQueries.parked, arguments: [queue]) ?? 0
            let delivered = countingJournal ? try Int.fetchOne(db, sql: StatusQueries.delivered, arguments: [queue]) ?? 0 : 0
            let duplicates = countingJournal ? try Int.fetchOne(db, sql: StatusQueries.duplicates, arguments: [queue]) ?? 0 : 0
            let possible =
                countingJournal ? try Int.fetchOne(db, sql: StatusQueries.possibleDuplicates, arguments: [queue]) ?? 0 : 0
            try Self.checkStates(queue: queue, db: db)
            let oldest = try Double.fetchOne(db, sql: StatusQueries.oldestPending, arguments: [queue])
            let server = try Row.fetchOne(db, sql: StatusQueries.serverState, arguments: [queue])
            let next: Double? = server?["next_attempt_at"]
            let lastDelivery = try Double.fetchOne(db, sql: StatusQueries.lastDelivery, arguments: [queue])
            return QueueStatus(
                queue: queue, pending: pending, parked: parked, delivered: delivered,
                oldestPendingAt: oldest.map(Date.init(timeIntervalSince1970:)),
                consecutiveFailures: server?["failures"] ?? 0,
                nextAttemptAt: next.map(Date.init(timeIntervalSince1970:)),
                lastError: server?["last_error"], lastDeliveryAt: lastDelivery.map(Date.init(timeIntervalSince1970:)),
                duplicates: duplicates, possibleDuplicates: possible)
        }
    }

    /// All queue names that hold items or deliveries.
    func queues() async throws -> [String] {
        try await read("list queues") { db in try String.fetchAll(db, sql: StatusQueries.queues) }
    }

    func items(queue: String?, state: QueuedItem.State?, limit: Int) async throws -> [QueuedItem] {
        try await read("list the queue") { db in
            var sql =
                "SELECT seq, uuid, queue, method, url, resource_type, resource_id, encrypted, state, attempts, enqueued_at, last_attempt_at, last_status, last_error, outcome, length(body) AS size, client_id FROM item WHERE 1"
            var arguments: StatementArguments = []
            if let queue { sql += " AND queue = ?"; arguments += [queue] }
            if let state { sql += " AND state = ?"; arguments += [state.rawValue] }
            sql += " ORDER BY seq LIMIT ?"
            arguments += [limit]
            return try Row.fetchAll(db, sql: sql, arguments: arguments).map(Self.queuedItem)
        }
    }

    /// Finds an item by UUID (full, a unique prefix or suffix) or by sequence number (see ``ItemReference``).
    func item(_ reference: String) async throws -> StoredItem {
        let parsed = ItemReference(reference)
        let found = try await read("find an item") { db -> [StoredItem] in
            var rows: [Row] = []
            if let sequence = parsed.sequence {
                rows = try Row.fetchAll(db, sql: "SELECT * FROM item WHERE seq = ?", arguments: [sequence])
            }
            if let part = parsed.idPart {
                // A prefix (from the index), else a suffix: item ids are time-ordered (UUIDv7), so ids queued
                // together share their first characters and differ in their last ones.
                var byID = try Row.fetchAll(
                    db, sql: "SELECT * FROM item WHERE uuid >= ? AND uuid < ? LIMIT 2", arguments: [part, part + "~"])
                if byID.isEmpty {
                    byID = try Row.fetchAll(
                        db, sql: "SELECT * FROM item WHERE substr(uuid, -?) = ? LIMIT 2", arguments: [part.count, part])
                }
                rows += byID.filter { row in !rows.contains { $0["seq"] as Int64 == row["seq"] as Int64 } }
            }
            return try rows.map(Self.storedItem)
        }
        guard found.count == 1 else {
            if found.count > 1 { throw ItemReference.ambiguous(reference, bySequence: parsed.sequence != nil) }
            throw DataQueueError(.notFound, "no queued item \(reference)")
        }
        return found[0]
    }

    /// Puts a parked item back in the pending queue (keeping its place in the order).
    ///
    /// - Parameter conditionalCreate: `false` sends the item as a plain create even in idempotent mode;
    ///   `true` lets idempotent mode apply again; nil keeps the item's setting.
    func retry(sequence: Int64, conditionalCreate: Bool?) async throws -> Bool {
        try await immediate("retry an item") { db in
            try db.execute(
                sql: "UPDATE item SET state = 'pending', outcome = NULL WHERE seq = ? AND state = 'parked'",
                arguments: [sequence])
            guard db.changesCount == 1 else { return false }
            if let conditionalCreate {
                try db.execute(
                    sql: "UPDATE item SET conditional_create = ? WHERE seq = ?",
                    arguments: [conditionalCreate ? nil : 0, sequence])
            }
            return true
        }
    }

    /// Puts every parked item of `queue` back in the pending queue.
    func retryAllParked(queue: String) async throws -> Int {
        try await immediate("retry parked items") { db in
            try db.execute(
                sql: "UPDATE item SET state = 'pending', outcome = NULL WHERE queue = ? AND state = 'parked'",
                arguments: [queue])
            return db.changesCount
        }
    }

    /// Removes an item without sending it, recording the drop in the journal.
    func drop(_ item: QueuedItem, url: String) async throws {
        try await immediate("drop an item") { db in
            // The row as it is now: its last status and error stay in the journal line.
            let row = try Row.fetchOne(db, sql: "SELECT last_status, last_error FROM item WHERE seq = ?", arguments: [item.sequence])
            try db.execute(sql: "DELETE FROM item WHERE seq = ?", arguments: [item.sequence])
            guard db.changesCount == 1 else { return }
            try Self.journalEvent(
                .dropped, item: item, url: url, status: row?["last_status"], note: row?["last_error"], attempts: item.attempts,
                at: Date().timeIntervalSince1970, db: db)
        }
    }

    /// The newest journal line of the item `reference` names (UUID, unique prefix or suffix, or sequence
    /// number: see ``ItemReference``), or nil when the journal has none.
    func journalLine(_ reference: String) async throws -> DeliveryRecord? {
        let parsed = ItemReference(reference)
        return try await read("read the delivery journal") { db in
            var uuids: [String] = []
            if let sequence = parsed.sequence {
                uuids = try String.fetchAll(db, sql: "SELECT uuid FROM delivery WHERE item_seq = ? LIMIT 1", arguments: [sequence])
            }
            if let part = parsed.idPart {
                let byID = try String.fetchAll(
                    db, sql: "SELECT DISTINCT uuid FROM delivery WHERE uuid LIKE ? OR uuid LIKE ? LIMIT 2",
                    arguments: [part + "%", "%" + part])
                uuids += byID.filter { !uuids.contains($0) }
            }
            guard uuids.count == 1 else {
                if uuids.count > 1 { throw ItemReference.ambiguous(reference, bySequence: parsed.sequence != nil) }
                return nil
            }
            let rows = try Row.fetchAll(
                db, sql: "SELECT * FROM delivery WHERE uuid = ? ORDER BY seq DESC LIMIT 1", arguments: [uuids[0]])
            return try rows.first.map(Self.deliveryRecord)
        }
    }

    /// Every queue of the database with its counts, in name order.
    func allStatuses(countingJournal: Bool) async throws -> [QueueStatus] {
        var statuses: [QueueStatus] = []
        for queue in try await queues() { statuses.append(try await status(queue: queue, countingJournal: countingJournal)) }
        return statuses
    }

    /// The end of a damaged-database error: where to look next.
    static let doctorHint = "; dq doctor says how to recover it"

    /// Whether SQLite can read the file's schema table (its first page and those it points to).
    static func schemaIsReadable(path: String) -> Bool {
        var configuration = Configuration()
        configuration.readonly = true
        guard let database = try? DatabaseQueue(path: SQLiteFileName.location(for: path), configuration: configuration) else {
            return false
        }
        defer { try? database.close() }
        return (try? database.read { db in try Int.fetchOne(db, sql: "SELECT count(*) FROM sqlite_master") }) != nil
    }

    /// The result of SQLite's `PRAGMA integrity_check`: `["ok"]` for a sound file, else the problems found.
    func integrityCheck() async throws -> [String] {
        do {
            return try await database.read { db in try String.fetchAll(db, sql: "PRAGMA integrity_check") }
        } catch let error as DatabaseError where error.resultCode == .SQLITE_CORRUPT || error.resultCode == .SQLITE_NOTADB {
            // Damage bad enough that the check itself cannot run is a finding, not a failure to check.
            return ["SQLite: \(error.message ?? "database disk image is malformed")"]
        } catch {
            throw SQLiteQueueStore.mapError(error, doing: "check the database")
        }
    }

    func pruneJournal(before cutoff: Date, progress: @Sendable (Int) -> Void) async throws -> Int {
        // Most calls find nothing old: a read, and no write transaction.
        let oldest = try await read("read the delivery journal") { db in
            try Double.fetchOne(db, sql: "SELECT at FROM delivery ORDER BY seq LIMIT 1")
        }
        guard let oldest, oldest < cutoff.timeIntervalSince1970 else { return 0 }
        var removed = 0
        while true {
            let (deleted, more) = try await immediate("prune the delivery journal") { db -> (Int, Bool) in
                let head = try Row.fetchAll(db, sql: "SELECT seq, at FROM delivery ORDER BY seq LIMIT 1000")
                let old = head.prefix { ($0["at"] as Double) < cutoff.timeIntervalSince1970 }
                guard let last = old.last else { return (0, false) }
                try db.execute(sql: "DELETE FROM delivery WHERE seq <= ?", arguments: [last["seq"] as Int64])
                return (db.changesCount, old.count == head.count && head.count == 1000)
            }
            removed += deleted
            progress(removed)
            if !more { return removed }
        }
    }

    /// Gives the space of deleted rows back to the file system (`VACUUM`); needs room for a copy of the file.
    func vacuum() async throws {
        do {
            try await database.writeWithoutTransaction { db in try db.execute(sql: "VACUUM") }
        } catch {
            throw SQLiteQueueStore.mapError(error, doing: "vacuum the queue database")
        }
    }

    /// The delivery journal, oldest first (or the newest `limit` lines).
    func deliveries(queue: String?, limit: Int) async throws -> [DeliveryRecord] {
        try await read("read the delivery journal") { db in
            var sql = "SELECT * FROM delivery"
            var arguments: StatementArguments = []
            if let queue { sql += " WHERE queue = ?"; arguments += [queue] }
            sql += " ORDER BY seq DESC LIMIT ?"
            arguments += [limit]
            return try Row.fetchAll(db, sql: sql, arguments: arguments).reversed().map(Self.deliveryRecord)
        }
    }
}
