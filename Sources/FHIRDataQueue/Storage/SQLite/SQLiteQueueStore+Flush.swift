import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

// What a flush reads and records: pending batches, the delivery journal, parking, backoff, Bundle support.
extension SQLiteQueueStore {
    /// The next pending items of `queue` after sequence `after`, in order: at most `maxCount`, and no more
    /// once their bodies reach `maxBytes` (at least one item when any is pending).
    func pendingBatch(queue: String, after: Int64, maxCount: Int, maxBytes: Int) async throws -> [StoredItem] {
        try await read("read the queue") { db in
            let cursor = try Row.fetchCursor(
                db, sql: "SELECT * FROM item WHERE queue = ? AND state = 'pending' AND seq > ? ORDER BY seq LIMIT ?",
                arguments: [queue, after, maxCount])
            var items: [StoredItem] = []
            var bytes = 0
            while let row = try cursor.next() {
                let item = try Self.storedItem(row)
                items.append(item)
                bytes += item.body.count
                if bytes >= maxBytes { break }
            }
            return items
        }
    }

    /// Moves delivered items to the journal in one transaction and clears the server's backoff (called by the
    /// group commit of ``DeliveryRecorder``).
    func markDelivered(_ deliveries: [CompletedDelivery], owner: any FlushOwnership) async -> Result<Void, DataQueueError> {
        guard let queue = deliveries.first?.item.queue else { return .success(()) }
        do {
            // On GRDB's writer queue: the commit's fsync holds no thread of the cooperative pool.
            try await immediate("record a delivery") { db in try Self.journal(deliveries, queue: queue, db: db) }
            return .success(())
        } catch {
            return .failure(Self.mapError(error, doing: "record a delivery"))
        }
    }

    static func journal(_ deliveries: [CompletedDelivery], queue: String, db: Database) throws {
        let delete = try db.cachedStatement(sql: "DELETE FROM item WHERE seq = ?")
        let insert = try db.cachedStatement(
            sql: """
                INSERT INTO delivery (item_seq, uuid, event, queue, method, url, resource_type, status, location,
                                      server_id, version_id, attempts, enqueued_at, at, full_url, bundle, entries, note)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """)
        for delivery in deliveries {
            let item = delivery.item
            try delete.execute(arguments: [item.sequence])
            guard db.changesCount == 1 else { continue }
            try insert.execute(arguments: [
                item.sequence, item.id.lowercasedString, delivery.event.rawValue, item.queue, item.method.rawValue, delivery.url,
                item.resourceType, delivery.status, delivery.location, delivery.serverID, delivery.versionID,
                item.attempts + 1, item.enqueuedAt.timeIntervalSince1970, delivery.answeredAt.timeIntervalSince1970, delivery.fullURL,
                delivery.bundle,
                delivery.entries, delivery.note,
            ])
        }
        try recordDigests(deliveries, db: db)
        try db.cachedStatement(
            sql: "UPDATE server_state SET failures = 0, next_attempt_at = NULL, last_error = NULL WHERE queue = ? AND failures > 0"
        ).execute(arguments: [queue])
    }

    /// Parks an item the server rejected permanently, keeping the server's answer.
    /// The journal records the parking as an event (with the reason, never the body): `dq log` shows it.
    func park(_ item: QueuedItem, url: String, status: Int?, error: String, outcome: String?, owner: any FlushOwnership)
        async throws
    {
        try await immediate("park an item") { db in
            let now = Date().timeIntervalSince1970
            try db.execute(
                sql: """
                    UPDATE item SET state = 'parked', attempts = attempts + 1, last_attempt_at = ?, last_status = ?,
                                    last_error = ?, outcome = ? WHERE seq = ?
                    """,
                arguments: [now, status, error, outcome, item.sequence])
            guard db.changesCount == 1 else { return }
            try Self.journalEvent(
                .parked, item: item, url: url, status: status, note: error, attempts: item.attempts + 1, at: now, db: db)
        }
    }

    /// A journal line for an event other than a delivery.
    static func journalEvent(
        _ event: DeliveryRecord.Event, item: QueuedItem, url: String, status: Int?, note: String?, attempts: Int,
        at: Double, db: Database
    ) throws {
        try db.execute(
            sql: """
                INSERT INTO delivery (item_seq, uuid, event, queue, method, url, resource_type, status, location,
                                      server_id, version_id, attempts, enqueued_at, at, note)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, NULL, ?, ?, ?, ?)
                """,
            arguments: [
                item.sequence, item.id.lowercasedString, event.rawValue, item.queue, item.method.rawValue, url,
                item.resourceType, status, attempts, item.enqueuedAt.timeIntervalSince1970, at, note,
            ])
    }

    /// Records a transient failure of `item` (if any) and the server's next allowed attempt.
    func recordFailure(
        queue: String, item: QueuedItem?, status: Int?, error: String, nextAttemptAt: Date?, owner: any FlushOwnership
    ) async throws {
        try await immediate("record a failure") { db in
            let now = Date().timeIntervalSince1970
            if let item {
                try db.execute(
                    sql: """
                        UPDATE item SET attempts = attempts + 1, last_attempt_at = ?, last_status = ?, last_error = ?
                        WHERE seq = ?
                        """,
                    arguments: [now, status, error, item.sequence])
            }
            try db.execute(
                sql: """
                    INSERT INTO server_state (queue, failures, next_attempt_at, last_error) VALUES (?, 1, ?, ?)
                    ON CONFLICT(queue) DO UPDATE SET failures = failures + 1, next_attempt_at = excluded.next_attempt_at,
                                                     last_error = excluded.last_error
                    """,
                arguments: [queue, nextAttemptAt?.timeIntervalSince1970, error])
        }
    }

    func bundleSupport(queue: String) async throws -> BundleSupport {
        try await read("read the server state") { db in
            guard let row = try Row.fetchOne(db, sql: "SELECT * FROM server_state WHERE queue = ?", arguments: [queue])
            else { return BundleSupport() }
            let transactions: Int? = row["transactions"]
            let checked: Double? = row["capability_at"]
            return BundleSupport(
                transactions: transactions.map { $0 != 0 }, checkedAt: checked.map(Date.init(timeIntervalSince1970:)),
                batchLimit: row["batch_limit"], conditionalCreate: BundleSupport.decodeTypes(row["conditional_create"]))
        }
    }

    /// Records what the CapabilityStatement said (`transactions`) and when, or a Bundle size limit learnt
    /// from a refusal (`batchLimit`; 1 means the server takes no transactions).
    func recordBundleSupport(queue: String, transactions: Bool?, batchLimit: Int?, conditionalCreate: Set<String>?) async throws {
        try await immediate("record what the server supports") { db in
            try db.execute(
                sql: "INSERT INTO server_state (queue, failures) VALUES (?, 0) ON CONFLICT(queue) DO NOTHING",
                arguments: [queue])
            if let conditionalCreate {
                try db.execute(
                    sql: "UPDATE server_state SET conditional_create = ? WHERE queue = ?",
                    arguments: [BundleSupport.encodeTypes(conditionalCreate), queue])
            }
            if let transactions {
                try db.execute(
                    sql: "UPDATE server_state SET transactions = ?, capability_at = ? WHERE queue = ?",
                    arguments: [transactions, Date().timeIntervalSince1970, queue])
            }
            if let batchLimit {
                try db.execute(sql: "UPDATE server_state SET batch_limit = ? WHERE queue = ?", arguments: [batchLimit, queue])
            }
        }
    }

    /// Where items delivered earlier with these fullUrls now live on the server (`Type/id`), by fullUrl;
    /// fullUrls not delivered are absent.
    func deliveredLocations(fullURLs: [String]) async throws -> [String: String] {
        try await newestDeliveries(fullURLs).compactMapValues { line in line.serverID.map { line.resourceType + "/" + $0 } }
    }

    func unlocatedDeliveries(fullURLs: [String]) async throws -> [String: UUID] {
        try await newestDeliveries(fullURLs).compactMapValues { line in line.serverID == nil ? UUID(uuidString: line.uuid) : nil }
    }

    /// The newest delivery line (delivered or already present) of each of `fullURLs` that has one.
    func newestDeliveries(_ fullURLs: [String]) async throws
        -> [String: (uuid: String, resourceType: String, serverID: String?)]
    {
        guard !fullURLs.isEmpty else { return [:] }
        return try await read("read the delivery journal") { db in
            var found: [String: (uuid: String, resourceType: String, serverID: String?)] = [:]
            for fullURL in fullURLs {
                if let row = try Row.fetchOne(
                    db,
                    sql: """
                        SELECT uuid, resource_type, server_id FROM delivery
                        WHERE full_url = ? AND event IN ('delivered', 'already-present') ORDER BY seq DESC LIMIT 1
                        """,
                    arguments: [fullURL])
                {
                    found[fullURL] = (row["uuid"], row["resource_type"], row["server_id"])
                }
            }
            return found
        }
    }

    func resolveLocation(itemID: UUID, location: String, serverID: String, versionID: String?, note: String) async throws -> Bool {
        try await immediate("record a location") { db in
            try db.execute(
                sql: """
                    UPDATE delivery SET location = ?, server_id = ?, version_id = ?, note = ?
                    WHERE seq = (SELECT max(seq) FROM delivery WHERE uuid = ? AND event IN ('delivered', 'already-present'))
                      AND server_id IS NULL
                    """,
                arguments: [location, serverID, versionID, note, itemID.lowercasedString])
            return db.changesCount == 1
        }
    }

    /// Which of `fullURLs` some item declares: queued (any state) or in the journal.
    func knownFullURLs(_ fullURLs: Set<String>) async throws -> Set<String> {
        guard !fullURLs.isEmpty else { return [] }
        return try await read("read the queue") { db in try Self.knownFullURLs(fullURLs, db: db) }
    }

    /// Of `fullURLs`, those a queued or delivered item declares, read on `db`; only items before sequence
    /// `before` count when it is given (the items of the running transaction are not yet "queued").
    static func knownFullURLs(_ fullURLs: Set<String>, db: Database, before: Int64 = .max) throws -> Set<String> {
        var known: Set<String> = []
        for fullURL in fullURLs {
            let queued = try Bool.fetchOne(
                db, sql: "SELECT 1 FROM item WHERE full_url = ? AND seq < ? LIMIT 1", arguments: [fullURL, before])
            let journaled = try Bool.fetchOne(db, sql: "SELECT 1 FROM delivery WHERE full_url = ? LIMIT 1", arguments: [fullURL])
            if queued != nil || journaled != nil { known.insert(fullURL) }
        }
        return known
    }

    /// The number of consecutive failures and the backoff deadline of a server.
    func serverState(queue: String) async throws -> (failures: Int, nextAttemptAt: Date?, lastError: String?) {
        try await read("read the server state") { db in
            guard let row = try Row.fetchOne(db, sql: "SELECT * FROM server_state WHERE queue = ?", arguments: [queue])
            else { return (0, nil, nil) }
            let next: Double? = row["next_attempt_at"]
            return (row["failures"], next.map(Date.init(timeIntervalSince1970:)), row["last_error"])
        }
    }
}
