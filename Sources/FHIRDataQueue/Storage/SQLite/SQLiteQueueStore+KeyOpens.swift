import Foundation
import GRDB

// The envelopes opened per receiver key and day (``KeyOpenLog``): table `dq_key_opens` (migration v8-key-opens).
extension SQLiteQueueStore: KeyOpenLog {
    func addKeyOpens(_ counts: [String: Int], day: Int) async throws {
        guard !counts.isEmpty else { return }
        try await immediate("count the envelopes opened per key") { db in
            for (keyID, count) in counts {
                try db.execute(
                    sql: """
                        INSERT INTO dq_key_opens (key_id, day, count) VALUES (?, ?, ?)
                        ON CONFLICT (key_id, day) DO UPDATE SET count = dq_key_opens.count + excluded.count
                        """, arguments: [keyID, day, count])
            }
        }
    }

    func keyOpens(since firstDay: Int) async throws -> [String: [Int: Int]] {
        try await read("read the envelopes opened per key") { db in
            var opens: [String: [Int: Int]] = [:]
            for row in try Row.fetchAll(db, sql: "SELECT key_id, day, count FROM dq_key_opens WHERE day >= ?", arguments: [firstDay]) {
                opens[row["key_id"], default: [:]][row["day"]] = row["count"]
            }
            return opens
        }
    }

    /// The table of ``KeyOpenLog``; registered right after v7.
    static func registerKeyOpensMigration(_ migrator: inout DatabaseMigrator) {
        migrator.registerMigration("v8-key-opens") { db in
            try db.execute(
                sql: """
                    CREATE TABLE dq_key_opens (
                      key_id TEXT NOT NULL,
                      day INTEGER NOT NULL,
                      count INTEGER NOT NULL,
                      PRIMARY KEY (key_id, day)
                    )
                    """)
        }
    }
}
