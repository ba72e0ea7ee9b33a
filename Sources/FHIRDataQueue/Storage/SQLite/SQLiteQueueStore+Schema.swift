import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

// Creating a queue file, opening one, and the schema's migrations.
extension SQLiteQueueStore {
    /// Makes a new queue database at `path`: created 0600 (0660 in a directory shared with a group, see
    /// ``QueuePaths/fileMode(forFileIn:)``) under a temporary name, migrated, then renamed into place, so a crash
    /// leaves either no file or a whole queue.
    static func create(_ path: String, configuration: Configuration) throws {
        let temporary = path + ".new"
        unlink(temporary)
        unlink(temporary + "-wal")
        unlink(temporary + "-shm")
        let mode = QueuePaths.fileMode(forFileIn: QueuePaths.directory(of: path))
        let fd = QueuePaths.openCreating(temporary, O_RDWR | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode: mode)
        if fd < 0 {
            throw DataQueueError(.storage, "cannot create database \(path): \(String(cString: strerror(errno)))")
        }
        close(fd)
        do {
            // Closed at the end of the scope: SQLite checkpoints and removes the new file's WAL.
            let database = try DatabaseQueue(path: SQLiteFileName.location(for: temporary), configuration: configuration)
            try migrator.migrate(database)
            try database.close()
        } catch {
            unlink(temporary)
            throw SQLiteQueueStore.mapError(error, doing: "create the queue database \(path)")
        }
        guard rename(temporary, path) == 0 else {
            let reason = String(cString: strerror(errno))
            unlink(temporary)
            throw DataQueueError(.storage, "cannot create database \(path): \(reason)")
        }
    }

    /// Opens a file that must already be a dq queue, migrating an older schema when writing is allowed.
    static func openExisting(_ path: String, configuration: Configuration, readOnly: Bool) throws -> DatabaseQueue {
        // stat(2), not FileManager's attributes, which also look up the owner's and group's names.
        var info = stat()
        let size = stat(path, &info) == 0 ? Int(info.st_size) : 0
        guard size > 0 else {
            throw DataQueueError(
                .storage,
                "\(path) is empty (0 bytes), not a dq queue: it was truncated or made by something else; restore it from a backup or move it away"
            )
        }
        let database: DatabaseQueue
        do {
            database = try DatabaseQueue(path: SQLiteFileName.location(for: path), configuration: configuration)
            let migrator = Self.migrator
            let (isQueue, complete, newer) = try database.read { db -> (Bool, Bool, Bool) in
                let isQueue = try db.tableExists("item") && db.tableExists("grdb_migrations")
                return (isQueue, try isQueue && migrator.hasCompletedMigrations(db), try isQueue && migrator.hasBeenSuperseded(db))
            }
            guard isQueue else {
                throw DataQueueError(.storage, "\(path) is a SQLite database but not a dq queue; refusing to change it")
            }
            guard !newer else {
                // Its schema has changes this dq does not know (how it numbers items, say): writing or reading
                // it with the older rules could break them.
                throw DataQueueError(
                    .storage, "the queue database \(path) was made or upgraded by a newer dq; use that dq (or newer) with it")
            }
            if !complete {
                if readOnly {
                    throw DataQueueError(
                        .storage, "the queue database \(path) has an older schema: run a writing command (dq flush) once to upgrade it")
                }
                // Only a file from an older dq needs the write transaction a migration takes.
                try migrator.migrate(database)
            }
        } catch let error as DataQueueError {
            throw error
        } catch let error as DatabaseError where error.resultCode == .SQLITE_NOTADB {
            throw DataQueueError(.storage, "\(path) is not a SQLite database (not a dq queue); refusing to change it")
        } catch {
            throw SQLiteQueueStore.mapError(error, doing: "open the queue database \(path)")
        }
        return database
    }

    static var migrator: DatabaseMigrator {
        var migrator = DatabaseMigrator()
        migrator.registerMigration("v1") { db in
            try db.execute(
                sql: """
                    CREATE TABLE item (
                      seq INTEGER PRIMARY KEY AUTOINCREMENT,
                      uuid TEXT NOT NULL UNIQUE,
                      queue TEXT NOT NULL,
                      method TEXT NOT NULL,
                      url TEXT NOT NULL,
                      resource_type TEXT NOT NULL,
                      resource_id TEXT,
                      encrypted INTEGER NOT NULL DEFAULT 0,
                      content_type TEXT NOT NULL,
                      if_none_exist TEXT,
                      body BLOB NOT NULL,
                      state TEXT NOT NULL DEFAULT 'pending',
                      attempts INTEGER NOT NULL DEFAULT 0,
                      enqueued_at REAL NOT NULL,
                      last_attempt_at REAL,
                      last_status INTEGER,
                      last_error TEXT,
                      outcome TEXT
                    );
                    CREATE INDEX item_by_queue ON item(queue, state, seq);
                    CREATE TABLE delivery (
                      seq INTEGER PRIMARY KEY AUTOINCREMENT,
                      item_seq INTEGER NOT NULL,
                      uuid TEXT NOT NULL,
                      event TEXT NOT NULL,
                      queue TEXT NOT NULL,
                      method TEXT NOT NULL,
                      url TEXT NOT NULL,
                      resource_type TEXT NOT NULL,
                      status INTEGER,
                      location TEXT,
                      server_id TEXT,
                      version_id TEXT,
                      attempts INTEGER NOT NULL,
                      enqueued_at REAL NOT NULL,
                      at REAL NOT NULL
                    );
                    CREATE INDEX delivery_by_queue ON delivery(queue, seq);
                    CREATE TABLE server_state (
                      queue TEXT PRIMARY KEY,
                      failures INTEGER NOT NULL DEFAULT 0,
                      next_attempt_at REAL,
                      last_error TEXT
                    );
                    """)
        }
        migrator.registerMigration("v2") { db in
            // `conditional_create`: NULL follows the queue's idempotent setting when the item is sent; 0 sends a
            // plain create (an operator's choice for a server that refuses conditional create).
            try db.execute(sql: "ALTER TABLE item ADD COLUMN conditional_create INTEGER")
            // `note`: why an item was parked or what it last failed with when dropped (PHI-free).
            try db.execute(sql: "ALTER TABLE delivery ADD COLUMN note TEXT")
            // Item URLs become paths relative to the configured endpoint, so that a row can never send a
            // resource (or credentials) to a host of its own; queue names take their normal form.
            let rows = try Row.fetchAll(db, sql: "SELECT seq, queue, url, resource_type, encrypted FROM item")
            for row in rows {
                let queue: String = row["queue"]
                let url: String = row["url"]
                let type: String = row["resource_type"]
                let encrypted: Bool = row["encrypted"]
                var path: String?
                if encrypted {
                    if url.hasSuffix("/" + type) { path = type }
                } else if url == queue {
                    path = ""
                } else if url.hasPrefix(queue + "/") {
                    path = String(url.dropFirst(queue.count + 1))
                }
                // A URL that does not fit stays absolute, and is refused (never sent) when its turn comes.
                if let path {
                    try db.execute(sql: "UPDATE item SET url = ? WHERE seq = ?", arguments: [path, row["seq"] as Int64])
                }
            }
            for table in ["item", "delivery", "server_state"] {
                for name in try String.fetchAll(db, sql: "SELECT DISTINCT queue FROM \(table)") {
                    guard let url = URL(string: name), let normal = try? DataQueue.queueName(for: url), normal != name
                    else { continue }
                    try db.execute(sql: "UPDATE OR REPLACE \(table) SET queue = ? WHERE queue = ?", arguments: [normal, name])
                }
            }
        }
        migrator.registerMigration("v3") { db in
            // Bundles: an item's own fullUrl (given by its producer, `urn:uuid:…`), what each server's
            // CapabilityStatement said about transactions (cached), and the Bundle size a server can take.
            try db.execute(
                sql: """
                    ALTER TABLE item ADD COLUMN full_url TEXT;
                    CREATE INDEX item_by_full_url ON item(full_url) WHERE full_url IS NOT NULL;
                    ALTER TABLE delivery ADD COLUMN full_url TEXT;
                    ALTER TABLE delivery ADD COLUMN bundle TEXT;
                    ALTER TABLE delivery ADD COLUMN entries TEXT;
                    CREATE INDEX delivery_by_full_url ON delivery(full_url) WHERE full_url IS NOT NULL;
                    ALTER TABLE server_state ADD COLUMN transactions INTEGER;
                    ALTER TABLE server_state ADD COLUMN capability_at REAL;
                    ALTER TABLE server_state ADD COLUMN batch_limit INTEGER;
                    """)
        }
        migrator.registerMigration("v4") { db in
            // Sequence numbers without AUTOINCREMENT, which updated `sqlite_sequence` (a b-tree of its own, one
            // more page in the WAL) in every enqueue's commit: one enqueue per commit is 1.11x as fast with
            // `durability: normal` without it. A number is still never used twice (`dq show 42`, the journal's
            // `item_seq` and `dq migrate`'s cursor rely on it): the trigger keeps the highest number deleted, and
            // an enqueue takes the next after it and after every item still queued (``nextSequence(_:)``).
            // The table is copied (SQLite cannot drop AUTOINCREMENT in place), in the migration's transaction.
            let floor = try Int64.fetchOne(db, sql: "SELECT seq FROM sqlite_sequence WHERE name = 'item'") ?? 0
            let columns = """
                seq, uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, if_none_exist, body, \
                state, attempts, enqueued_at, last_attempt_at, last_status, last_error, outcome, conditional_create, full_url
                """
            try db.execute(
                sql: """
                    CREATE TABLE item_v4 (
                      seq INTEGER PRIMARY KEY,
                      uuid TEXT NOT NULL UNIQUE,
                      queue TEXT NOT NULL,
                      method TEXT NOT NULL,
                      url TEXT NOT NULL,
                      resource_type TEXT NOT NULL,
                      resource_id TEXT,
                      encrypted INTEGER NOT NULL DEFAULT 0,
                      content_type TEXT NOT NULL,
                      if_none_exist TEXT,
                      body BLOB NOT NULL,
                      state TEXT NOT NULL DEFAULT 'pending',
                      attempts INTEGER NOT NULL DEFAULT 0,
                      enqueued_at REAL NOT NULL,
                      last_attempt_at REAL,
                      last_status INTEGER,
                      last_error TEXT,
                      outcome TEXT,
                      conditional_create INTEGER,
                      full_url TEXT
                    );
                    INSERT INTO item_v4 (\(columns)) SELECT \(columns) FROM item ORDER BY seq;
                    DROP TABLE item;
                    ALTER TABLE item_v4 RENAME TO item;
                    CREATE INDEX item_by_queue ON item(queue, state, seq);
                    CREATE INDEX item_by_full_url ON item(full_url) WHERE full_url IS NOT NULL;
                    DELETE FROM sqlite_sequence WHERE name = 'item';
                    CREATE TABLE item_sequence_floor (floor INTEGER NOT NULL);
                    CREATE TRIGGER item_sequence_kept AFTER DELETE ON item
                    WHEN old.seq > coalesce((SELECT max(seq) FROM item), 0)
                    BEGIN
                      UPDATE item_sequence_floor SET floor = old.seq WHERE floor < old.seq;
                    END;
                    """)
            try db.execute(sql: "INSERT INTO item_sequence_floor (floor) VALUES (?)", arguments: [floor])
        }
        migrator.registerMigration("v5") { db in
            // The resource types whose conditional create the server's CapabilityStatement declares (a JSON
            // list; NULL: not read): idempotent mode trusts a 200 to a conditional create only for those.
            try db.execute(sql: "ALTER TABLE server_state ADD COLUMN conditional_create TEXT")
        }
        migrator.registerMigration("v6") { db in
            // Sealing at rest: the at-rest keys the queue's items are sealed under, each with the queue's index
            // key wrapped under it (see ``Sealer``). A queue with a row here is sealed; a dq older than this
            // migration refuses the file (it would send sealed bytes).
            try db.execute(
                sql: """
                    CREATE TABLE seal_key (
                      key_id TEXT PRIMARY KEY,
                      index_key BLOB NOT NULL,
                      added_at REAL NOT NULL
                    )
                    """)
        }
        migrator.registerMigration("v7") { db in
            // A receiver's registered clients and the bearer tokens issued to them (see ``ClientRegistry``): hashes
            // only, not sealed (not PHI).
            try db.execute(
                sql: """
                    CREATE TABLE dq_clients (
                      client_id TEXT PRIMARY KEY,
                      secret_hash TEXT NOT NULL,
                      created_at REAL NOT NULL
                    );
                    CREATE TABLE dq_tokens (
                      token_hash TEXT PRIMARY KEY,
                      client_id TEXT NOT NULL REFERENCES dq_clients(client_id) ON DELETE CASCADE,
                      expires_at REAL NOT NULL
                    );
                    CREATE INDEX dq_tokens_by_expiry ON dq_tokens(expires_at);
                    """)
        }
        registerKeyOpensMigration(&migrator)
        registerReceiptsMigration(&migrator)
        migrator.registerMigration("v9-claims") { db in
            // Which client of a receiver wrote a resource (see ``ClientRegistry/claimResource(queue:target:clientID:at:)``):
            // the SHA-256 of the queue and `Type/id`, never the id itself.
            try db.execute(
                sql: """
                    CREATE TABLE dq_resource_claims (claim TEXT PRIMARY KEY, client_id TEXT NOT NULL, claimed_at REAL NOT NULL);
                    CREATE INDEX item_by_client ON item(client_id) WHERE client_id IS NOT NULL;
                    """)
        }
        return migrator
    }

    /// The sequence number of an item being inserted: one past both the newest item queued and the newest
    /// ever deleted, so that no number is used twice, while an enqueue writes no page beyond the item's own
    /// and its indexes' (the floor changes only when the newest item is deleted).
    static func nextSequence(_ db: Database) throws -> Int64 {
        // Prepared once per connection and stepped through the C API: this runs in every enqueue's transaction.
        let statement = try db.cachedStatement(
            sql: "SELECT max(coalesce((SELECT max(seq) FROM item), 0), coalesce((SELECT floor FROM item_sequence_floor), 0)) + 1")
        let handle = statement.sqliteStatement
        defer { sqlite3_reset(handle) }
        let code = sqlite3_step(handle)
        guard code == SQLITE_ROW else {
            throw DatabaseError(resultCode: ResultCode(rawValue: code), message: "cannot read the next sequence number", sql: statement.sql)
        }
        return sqlite3_column_int64(handle, 0)
    }
}
