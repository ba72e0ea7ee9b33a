import Foundation
import GRDB

// A receiver's repeats (``ReceiptStore``), in the queue's file: the client column of `item`, tables `dq_receipts`
// (`Idempotency-Key` requests) and `dq_digests` (delivered resources by client and plaintext digest), migration
// "v8-receipts". Times are seconds since 1970, as the queue's other times.
extension SQLiteQueueStore: ReceiptStore {
    static func registerReceiptsMigration(_ migrator: inout DatabaseMigrator) {
        migrator.registerMigration("v8-receipts") { db in
            try db.execute(
                sql: """
                    ALTER TABLE item ADD COLUMN client_id TEXT;
                    CREATE TABLE dq_receipts (
                      client_id TEXT NOT NULL,
                      idempotency_key TEXT NOT NULL,
                      fingerprint TEXT NOT NULL,
                      item_uuid TEXT NOT NULL,
                      status INTEGER,
                      location TEXT,
                      content_type TEXT,
                      body BLOB,
                      created_at REAL NOT NULL,
                      PRIMARY KEY (client_id, idempotency_key)
                    );
                    CREATE INDEX dq_receipts_by_age ON dq_receipts(created_at);
                    CREATE TABLE dq_digests (
                      client_id TEXT NOT NULL,
                      digest TEXT NOT NULL,
                      item_uuid TEXT NOT NULL,
                      delivered_at REAL NOT NULL,
                      PRIMARY KEY (client_id, digest)
                    );
                    CREATE INDEX dq_digests_by_age ON dq_digests(delivered_at);
                    """)
        }
    }

    func insert(_ item: NewItem, receipt: Receipt?, expiredBefore: Date) async throws -> ReceiptInsert {
        try await immediate("enqueue") { db in
            if let receipt {
                try db.execute(
                    sql: "DELETE FROM dq_receipts WHERE client_id = ? AND idempotency_key = ? AND created_at < ?",
                    arguments: [receipt.clientID, receipt.key, expiredBefore.timeIntervalSince1970])
                if let taken = try Self.receipt(clientID: receipt.clientID, key: receipt.key, since: expiredBefore, db: db) {
                    return .taken(taken)
                }
            }
            // One immediate transaction at a time holds the writer: of two requests with one key, the second finds
            // the first's receipt above (or, were it not so, fails on the primary key and stores nothing).
            guard let sequence = try Self.insert([item], db: db).first else {
                throw DataQueueError(.storage, "cannot enqueue: no sequence number was given")
            }
            if let receipt {
                try db.execute(
                    sql: """
                        INSERT INTO dq_receipts (client_id, idempotency_key, fingerprint, item_uuid, status, location,
                                                 content_type, body, created_at)
                        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                        """,
                    arguments: [
                        receipt.clientID, receipt.key, receipt.fingerprint, receipt.itemID.lowercasedString, receipt.status,
                        receipt.location, receipt.contentType, receipt.body, receipt.createdAt.timeIntervalSince1970,
                    ])
            }
            return .stored(sequence)
        }
    }

    func receipt(clientID: String, key: String, since: Date) async throws -> Receipt? {
        try await read("read a receipt") { db in try Self.receipt(clientID: clientID, key: key, since: since, db: db) }
    }

    static func receipt(clientID: String, key: String, since: Date, db: Database) throws -> Receipt? {
        guard
            let row = try Row.fetchOne(
                db, sql: "SELECT * FROM dq_receipts WHERE client_id = ? AND idempotency_key = ? AND created_at >= ?",
                arguments: [clientID, key, since.timeIntervalSince1970])
        else { return nil }
        let uuid: String = row["item_uuid"]
        guard let itemID = UUID(uuidString: uuid) else {
            throw DataQueueError(.storage, "dq_receipts row of client \(clientID) is damaged (item_uuid); delete that row")
        }
        return Receipt(
            clientID: row["client_id"], key: row["idempotency_key"], fingerprint: row["fingerprint"], itemID: itemID,
            status: row["status"], location: row["location"], contentType: row["content_type"], body: row["body"],
            createdAt: Date(timeIntervalSince1970: row["created_at"]))
    }

    func recordAnswer(_ receipt: Receipt) async throws {
        try await immediate("record an answer") { db in
            try db.execute(
                sql: """
                    UPDATE dq_receipts SET status = ?, location = ?, content_type = ?, body = ?
                    WHERE client_id = ? AND idempotency_key = ? AND item_uuid = ? AND status IS NULL
                    """,
                arguments: [
                    receipt.status, receipt.location, receipt.contentType, receipt.body, receipt.clientID, receipt.key,
                    receipt.itemID.lowercasedString,
                ])
        }
    }

    func deliveredDigests(_ digests: Set<ContentDigest>, since: Date) async throws -> [ContentDigest: UUID] {
        guard !digests.isEmpty else { return [:] }
        return try await read("read the delivered digests") { db in
            var found: [ContentDigest: UUID] = [:]
            let statement = try db.cachedStatement(
                sql: "SELECT item_uuid FROM dq_digests WHERE client_id = ? AND digest = ? AND delivered_at >= ?")
            for digest in digests {
                if let uuid = try String.fetchOne(
                    statement, arguments: [digest.clientID, digest.digest, since.timeIntervalSince1970]),
                    let id = UUID(uuidString: uuid)
                {
                    found[digest] = id
                }
            }
            return found
        }
    }

    /// Records the digests of delivered receiver items, in the journal's transaction (the newest delivery of a
    /// digest is the one kept).
    static func recordDigests(_ deliveries: [CompletedDelivery], db: Database) throws {
        guard deliveries.contains(where: { $0.digest != nil }) else { return }
        let statement = try db.cachedStatement(
            sql: """
                INSERT INTO dq_digests (client_id, digest, item_uuid, delivered_at) VALUES (?, ?, ?, ?)
                ON CONFLICT (client_id, digest) DO UPDATE SET item_uuid = excluded.item_uuid, delivered_at = excluded.delivered_at
                """)
        for delivery in deliveries {
            guard let digest = delivery.digest else { continue }
            try statement.execute(arguments: [
                digest.clientID, digest.digest, delivery.item.id.lowercasedString, delivery.answeredAt.timeIntervalSince1970,
            ])
        }
    }

    func recordDuplicate(_ item: QueuedItem, url: String, note: String, owner: any FlushOwnership) async throws {
        try await immediate("record a duplicate") { db in
            try db.execute(sql: "DELETE FROM item WHERE seq = ?", arguments: [item.sequence])
            guard db.changesCount == 1 else { return }
            try Self.journalEvent(
                .duplicate, item: item, url: url, status: nil, note: note, attempts: item.attempts,
                at: Date().timeIntervalSince1970, db: db)
        }
    }

    func pruneReceipts(before cutoff: Date) async throws -> Int {
        try await immediate("forget old receipts") { db in
            try db.execute(sql: "DELETE FROM dq_receipts WHERE created_at < ?", arguments: [cutoff.timeIntervalSince1970])
            var count = db.changesCount
            try db.execute(sql: "DELETE FROM dq_digests WHERE delivered_at < ?", arguments: [cutoff.timeIntervalSince1970])
            count += db.changesCount
            return count
        }
    }
}
