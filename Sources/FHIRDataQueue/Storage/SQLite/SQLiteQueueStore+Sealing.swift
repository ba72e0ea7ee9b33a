import Foundation
import GRDB

// The seal key table, and the raw rows a seal or rekey rewrites (see ``SealedStorage``).
extension SQLiteQueueStore {
    func sealKeys() async throws -> [SealKeyRecord] {
        try await read("read the seal keys") { db in
            try Row.fetchAll(db, sql: "SELECT key_id, index_key FROM seal_key ORDER BY added_at, key_id").map {
                SealKeyRecord(id: $0["key_id"], wrappedIndexKey: $0["index_key"])
            }
        }
    }

    func addSealKey(_ record: SealKeyRecord) async throws {
        try await immediate("add a seal key") { db in
            try db.execute(
                sql: "INSERT OR IGNORE INTO seal_key (key_id, index_key, added_at) VALUES (?, ?, ?)",
                arguments: [record.id, record.wrappedIndexKey, Date().timeIntervalSince1970])
        }
    }

    func addFirstSealKey(_ record: SealKeyRecord) async throws -> Bool {
        try await immediate("add the first seal key") { db in
            try db.execute(
                sql: "INSERT INTO seal_key (key_id, index_key, added_at) SELECT ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM seal_key)",
                arguments: [record.id, record.wrappedIndexKey, Date().timeIntervalSince1970])
            return db.changesCount == 1
        }
    }

    /// Nothing to do: every insert of plain items looks at the seal key table in its own transaction (see
    /// ``insert(_:db:)``). A trigger would do the same for every row, sealed ones too: it made a sealed bulk
    /// enqueue of 100,000 a quarter slower.
    func refusePlainItems() async throws {}

    /// Whether the queue is sealed (holds a seal key), read inside the caller's transaction.
    static func isSealed(_ db: Database) throws -> Bool {
        try Bool.fetchOne(db.cachedStatement(sql: "SELECT EXISTS (SELECT 1 FROM seal_key)")) ?? false
    }

    func sealedCounts() async throws -> [String: Int] {
        try await read("count sealed items") { db in
            var counts: [String: Int] = [:]
            // A sealed body starts with `DQS1` and its key id (see ``Sealer``); anything else is plain.
            for row in try Row.fetchAll(
                db,
                sql: """
                    SELECT CASE WHEN substr(body, 1, 4) = X'44515331' THEN CAST(substr(body, 5, 16) AS TEXT) ELSE '' END AS k,
                           count(*) AS n
                    FROM item GROUP BY k
                    """)
            {
                counts[row["k"]] = row["n"]
            }
            return counts
        }
    }

    func rawItems(after: Int64, limit: Int) async throws -> [StoredItem] {
        try await exportBatch(after: after, limit: limit)
    }

    func replaceSealed(_ replacements: [SealedReplacement]) async throws -> Int {
        guard !replacements.isEmpty else { return 0 }
        return try await immediate("seal items") { db in
            // What the rows held before (plain values) is overwritten with zeros where it lay, not just freed.
            try db.execute(sql: "PRAGMA secure_delete = ON")
            defer { try? db.execute(sql: "PRAGMA secure_delete = OFF") }
            var changed = 0
            for replacement in replacements {
                // Only if the row is still as it was read: a flush may have delivered or parked it meanwhile.
                try db.execute(
                    sql: """
                        UPDATE item SET url = ?, resource_id = ?, body = ?, full_url = ?, outcome = ?
                        WHERE seq = ? AND body = ? AND outcome IS ?
                        """,
                    arguments: [
                        replacement.url, replacement.resourceID, replacement.body, replacement.fullURL, replacement.outcome,
                        replacement.sequence, replacement.expectedBody, replacement.expectedOutcome,
                    ])
                changed += db.changesCount
            }
            return changed
        }
    }

    func plainJournalFullURLs(limit: Int) async throws -> [String] {
        try await read("read the journal") { db in
            try String.fetchAll(
                db,
                sql: "SELECT DISTINCT full_url FROM delivery WHERE full_url IS NOT NULL AND full_url >= 'e' LIMIT ?",
                arguments: [limit])
        }
    }

    func replaceJournalFullURLs(_ hashes: [String: String]) async throws -> Int {
        guard !hashes.isEmpty else { return 0 }
        return try await immediate("seal the journal's fullUrls") { db in
            try db.execute(sql: "PRAGMA secure_delete = ON")
            defer { try? db.execute(sql: "PRAGMA secure_delete = OFF") }
            let update = try db.cachedStatement(sql: "UPDATE delivery SET full_url = ? WHERE full_url = ?")
            var changed = 0
            for (plain, hash) in hashes {
                try update.execute(arguments: [hash, plain])
                changed += db.changesCount
            }
            return changed
        }
    }

    /// Writes the WAL back into the file and empties it (truncated to zero bytes), so that no frame of an earlier
    /// (plain) version of a row stays on disk. A connection that reads holds it back: SQLite waits for it as for
    /// a lock (the busy timeout), then this returns false. A later checkpoint does not empty the file: new frames
    /// overwrite old ones from the start, and those beyond would stay.
    func scrubAfterSealing() async throws -> Bool {
        do {
            // One row: busy (1 when a reader or writer held it back), frames in the WAL, frames checkpointed.
            let busy = try await database.writeWithoutTransaction { db in
                try Row.fetchOne(db, sql: "PRAGMA wal_checkpoint(TRUNCATE)").map { ($0[0] as Int) != 0 } ?? false
            }
            return !busy
        } catch let error as DatabaseError where error.resultCode == .SQLITE_BUSY || error.resultCode == .SQLITE_LOCKED {
            return false
        } catch {
            throw SQLiteQueueStore.mapError(error, doing: "scrub the WAL")
        }
    }
}
