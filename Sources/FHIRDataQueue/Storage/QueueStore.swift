import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

/// A request to store, before it has a sequence number.
struct NewItem: Sendable {
    var id: UUID
    var queue: String
    var method: FHIRMethod
    var url: String
    var resourceType: String
    var resourceID: String?
    var encrypted: Bool
    var contentType: String
    var body: Data
    /// The producer's `fullUrl` for the resource (`urn:uuid:…`), which later items may reference.
    var fullURL: String? = nil
    /// The `urn:uuid` fullUrls the body references (lowercased, in order; none for an encrypted item), found
    /// once when the item is made: a bulk enqueue finds them on the threads that make items, not on the writer.
    var references: [String] = []
}

/// A stored item with what is needed to send it.
struct StoredItem: Sendable {
    var info: QueuedItem
    var contentType: String
    /// Whether idempotent mode may send it as a conditional create (an operator can turn it off per item).
    var conditionalCreate: Bool = true
    var body: Data
    /// The producer's `fullUrl`, if it gave one.
    var fullURL: String? = nil
}

/// The durable SQLite queue: items, the delivery journal and per-server backoff state.
///
/// The queue knows nothing of HTTP: it stores requests and records outcomes.
final class QueueStore: QueueStorage {
    let path: String
    let database: DatabaseQueue
    private let batcher: EnqueueBatcher
    /// The device and inode of the file opened (see ``checkFileIdentity()``).
    private let fileIdentity: (device: UInt64, inode: UInt64)?

    /// Opens or creates the database at `path` (mode 0600, directory 0700), migrating the schema under
    /// an exclusive file lock so that several processes may open a new file at once.
    ///
    /// A new database is made under a temporary name and renamed into place once its schema is complete,
    /// so a file at `path` is always a whole dq queue: an existing file that is empty or not a dq queue is
    /// refused, never initialised over.
    ///
    /// - Parameter readOnly: open an existing queue for reading only: no directory or file is created,
    ///   nothing is written, and a missing file is an error.
    init(path: String, durability: Durability, readOnly: Bool = false, busyTimeout: TimeInterval = 30) throws {
        self.path = path
        var configuration = Configuration()
        // WAL is set here rather than with GRDB's `.wal`, which writes a table into the WAL file on every open
        // (for DatabasePool readers): two fsyncs for each `dq status`. The mode is persistent in the file.
        configuration.journalMode = .default
        configuration.busyMode = .timeout(busyTimeout)
        configuration.label = "dq"
        configuration.readonly = readOnly
        let synchronous = durability == .full ? "FULL" : "NORMAL"
        if !readOnly {
            configuration.prepareDatabase { db in
                if try String.fetchOne(db, sql: "PRAGMA journal_mode") != "wal" {
                    guard try String.fetchOne(db, sql: "PRAGMA journal_mode = WAL") == "wal" else {
                        throw DataQueueError(.storage, "cannot switch the queue database to WAL mode")
                    }
                }
                try db.execute(sql: "PRAGMA synchronous = \(synchronous)")
            }
        }
        if readOnly {
            guard FileManager.default.fileExists(atPath: path) else {
                throw DataQueueError(
                    .storage, "no queue database at \(path) (nothing was queued there; check --database or \"database\")")
            }
            database = try Self.openExisting(path, configuration: configuration, readOnly: true)
        } else {
            let directory = (path as NSString).deletingLastPathComponent
            if !directory.isEmpty {
                do {
                    try FileManager.default.createDirectory(
                        atPath: directory, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
                } catch {
                    throw DataQueueError(
                        .storage, "cannot create the database directory \(directory): \(error.localizedDescription)")
                }
            }
            let migrationLock = try FileLock(path: path + ".lock")
            try migrationLock.lock()
            defer { migrationLock.unlock() }
            if !FileManager.default.fileExists(atPath: path) {
                try Self.create(path, configuration: configuration)
            }
            database = try Self.openExisting(path, configuration: configuration, readOnly: false)
        }
        batcher = EnqueueBatcher { [database] items in
            QueueStore.immediateNow(database, "enqueue") { db in try QueueStore.insert(items, db: db) }
        }
        var info = stat()
        fileIdentity = stat(path, &info) == 0 ? (UInt64(info.st_dev), UInt64(info.st_ino)) : nil
    }

    /// Refuses to go on with a file that is no longer the one at `path`: deleted, or replaced (a restore, a
    /// `mv`). A long-running process would otherwise keep writing to the unlinked file while what is queued
    /// into the new one is never sent.
    func checkFileIdentity() throws {
        guard let fileIdentity else { return }
        var info = stat()
        guard stat(path, &info) == 0 else {
            throw DataQueueError(.storage, "the queue database \(path) was deleted while dq had it open; restart dq")
        }
        guard UInt64(info.st_dev) == fileIdentity.device && UInt64(info.st_ino) == fileIdentity.inode else {
            throw DataQueueError(
                .storage, "the queue database \(path) was replaced by another file while dq had it open; restart dq to open it")
        }
    }

    // MARK: - Moving to another store (dq migrate)

    /// Items of every queue and state after sequence `after`, in order, with their bodies.
    func exportBatch(after: Int64, limit: Int) async throws -> [StoredItem] {
        try await read("read the queue") { db in
            try Row.fetchAll(db, sql: "SELECT * FROM item WHERE seq > ? ORDER BY seq LIMIT ?", arguments: [after, limit])
                .map(Self.storedItem)
        }
    }

    /// Deletes items that were moved to another store (no journal line: they were not sent or dropped).
    func deleteMoved(_ sequences: [Int64]) async throws {
        try await immediate("remove moved items") { db in
            for sequence in sequences { try db.execute(sql: "DELETE FROM item WHERE seq = ?", arguments: [sequence]) }
        }
    }

    /// Nothing to release: SQLite closes with the last reference.
    func shutdown() async {}

    /// SQLite cannot tell other processes' enqueues: readers poll.
    func watchEnqueues(_ enqueued: @escaping @Sendable (String) -> Void) async {}

    /// The flush lock of `queue`: a `flock` on a file beside the database, which the kernel releases when
    /// the holder dies; it also holds the in-flight note.
    func acquireFlush(queue: String, until deadline: ContinuousClock.Instant) async throws -> (any FlushOwnership)? {
        // A new descriptor per flush: flock excludes other flushes in this process too.
        let lock = try FileLock(path: DataQueue.flushLockPath(database: path, queue: queue))
        return try await lock.lock(until: deadline) ? lock : nil
    }

    /// Makes a new queue database at `path`: created 0600 under a temporary name, migrated, then renamed
    /// into place, so a crash leaves either no file or a whole queue.
    private static func create(_ path: String, configuration: Configuration) throws {
        let temporary = path + ".new"
        unlink(temporary)
        unlink(temporary + "-wal")
        unlink(temporary + "-shm")
        let fd = open(temporary, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
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
            throw QueueStore.mapError(error, doing: "create the queue database \(path)")
        }
        guard rename(temporary, path) == 0 else {
            let reason = String(cString: strerror(errno))
            unlink(temporary)
            throw DataQueueError(.storage, "cannot create database \(path): \(reason)")
        }
    }

    /// Opens a file that must already be a dq queue, migrating an older schema when writing is allowed.
    private static func openExisting(_ path: String, configuration: Configuration, readOnly: Bool) throws -> DatabaseQueue {
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
            throw QueueStore.mapError(error, doing: "open the queue database \(path)")
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

    static func mapError(_ error: any Error, doing what: String) -> DataQueueError {
        if let error = error as? DataQueueError { return error }
        if let dbError = error as? DatabaseError {
            switch dbError.resultCode {
            case .SQLITE_READONLY:
                return DataQueueError(.storage, "cannot \(what): the queue database was opened for reading only")
            case .SQLITE_FULL:
                return DataQueueError(.storageFull, "cannot \(what): the disk or the file-size limit is full; nothing was written")
            case .SQLITE_IOERR where dbError.extendedResultCode == .SQLITE_IOERR_WRITE:
                // EFBIG and ENOSPC during a write surface as SQLITE_IOERR_WRITE; the transaction is rolled back.
                return DataQueueError(
                    .storageFull, "cannot \(what): a write failed (disk full, file-size limit or I/O error); nothing was written")
            case .SQLITE_BUSY, .SQLITE_LOCKED:
                return DataQueueError(.busy, "cannot \(what): the database is locked by another process")
            case .SQLITE_CORRUPT, .SQLITE_NOTADB:
                return DataQueueError(
                    .damaged,
                    "cannot \(what): the queue database is damaged (SQLite: \(dbError.message ?? "database disk image is malformed"))\(doctorHint)"
                )
            default:
                // The SQLite message names the failure, never row content (statement arguments are not public).
                return DataQueueError(
                    .storage, "cannot \(what): SQLite error \(dbError.resultCode.rawValue) (\(dbError.message ?? "unknown"))")
            }
        }
        return DataQueueError(.storage, "cannot \(what): \(error)")
    }

    /// Runs `body` in a `BEGIN IMMEDIATE` transaction on GRDB's writer queue (async: the caller's thread
    /// is not blocked).
    private func immediate<T: Sendable>(_ what: String, _ body: @escaping @Sendable (Database) throws -> T) async throws -> T {
        do {
            return try await database.writeWithoutTransaction { db in try Self.inImmediateTransaction(db, body) }
        } catch let error as CancellationError {
            // A cancelled task is not a storage failure: the caller sees the cancellation itself.
            throw error
        } catch {
            throw QueueStore.mapError(error, doing: what)
        }
    }

    /// ``immediate(_:_:)`` for the writer threads, which may block: a synchronous write transaction.
    static func immediateNow<T>(
        _ database: DatabaseQueue, _ what: String, _ body: (Database) throws -> T
    ) -> Result<T, DataQueueError> {
        Result { try database.writeWithoutTransaction { db in try inImmediateTransaction(db, body) } }
            .mapError { QueueStore.mapError($0, doing: what) }
    }

    /// `BEGIN IMMEDIATE`, `body`, `COMMIT` through statements prepared once per connection (GRDB's
    /// `inTransaction` prepares both anew each time); on any error, a rollback if a transaction is still open.
    private static func inImmediateTransaction<T>(_ db: Database, _ body: (Database) throws -> T) throws -> T {
        do {
            try db.cachedStatement(sql: "BEGIN IMMEDIATE").execute()
            let result = try body(db)
            try db.cachedStatement(sql: "COMMIT").execute()
            // Writes work (again): the connection checkpoints when it closes, as usual.
            _ = dq_sqlite3_no_checkpoint_on_close(db.sqliteConnection, 0)
            return result
        } catch {
            if db.isInsideTransaction { try? db.cachedStatement(sql: "ROLLBACK").execute() }
            if let error = error as? DatabaseError, Self.filesRefuseWrites(error) {
                // The files stopped taking writes (a full disk, a file-size limit, an immutable or read-only file):
                // no checkpoint when the connection closes. SQLite's checkpoint on close of a WAL whose files
                // cannot be written ended in SIGBUS (an immutable -shm); the WAL stays valid, and the next open
                // recovers from it as after any crash.
                _ = dq_sqlite3_no_checkpoint_on_close(db.sqliteConnection, 1)
            }
            throw error
        }
    }

    /// Whether a failed write says the files no longer take writes (as opposed to a busy database or a bad row).
    private static func filesRefuseWrites(_ error: DatabaseError) -> Bool {
        [.SQLITE_IOERR, .SQLITE_FULL, .SQLITE_READONLY, .SQLITE_CANTOPEN, .SQLITE_PERM].contains(error.resultCode)
    }

    private func read<T: Sendable>(_ what: String, _ body: @escaping @Sendable (Database) throws -> T) async throws -> T {
        do {
            return try await database.read(body)
        } catch let error as CancellationError {
            throw error
        } catch {
            throw QueueStore.mapError(error, doing: what)
        }
    }

    // MARK: - Enqueue

    /// Stores `items` in one transaction: all of them or none. Returns their sequence numbers.
    func insert(_ items: [NewItem]) async throws -> [Int64] {
        try await immediate("enqueue") { db in try Self.insert(items, db: db) }
    }

    /// Stores the items of `chunks` chunks in one transaction, in order, inserting each as soon as `take`
    /// hands it over (`take(k)` may block until chunk `k` is made; nil means an input was bad and stops the
    /// enqueue), then checks the references of all of them on the same connection before the commit: all or
    /// none. The chunks after the first are made while the earlier ones are written.
    func insert(chunks: Int, take: @escaping @Sendable (Int) -> [NewItem]?) async throws -> [Int64] {
        try await immediate("enqueue") { db in
            var sequences: [Int64] = []
            var check = ReferenceCheck()
            for chunk in 0..<chunks {
                guard let items = take(chunk) else { throw DataQueueError(.invalidResource, "an input is bad; nothing was queued") }
                for item in items { check.add(item, index: check.added) }
                sequences += try Self.insert(items, db: db)
            }
            try check.refuseDeclaredTwice()
            try check.refuse(existing: try Self.knownFullURLs(check.lookups, db: db, before: sequences.first ?? .max))
            return sequences
        }
    }

    /// Transactions the grouped enqueues have committed (for tests of the grouping).
    var groupedCommits: Int { batcher.commits }

    /// Stores one item, sharing a commit with other enqueues that wait at the same moment.
    nonisolated(nonsending) func insertGrouped(_ item: NewItem) async throws -> Int64 {
        try await batcher.submit(item)
    }

    static func insert(_ items: [NewItem], db: Database) throws -> [Int64] {
        let now = Date().timeIntervalSince1970
        let statement = try db.cachedStatement(
            sql: """
                INSERT INTO item (uuid, queue, method, url, resource_type, resource_id, encrypted, content_type,
                                  body, enqueued_at, full_url, seq)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """)
        // The transaction's first number, read once and given to the first row; SQLite gives each later row
        // the number after the newest (a row given its number costs SQLite a lookup that a new one does not).
        let first = try Self.nextSequence(db)
        // Bound and stepped through SQLite's C API: GRDB's StatementArguments box each value of each row (an
        // array of existentials per row), which took a fifth of a bulk enqueue's writer thread.
        let handle = statement.sqliteStatement
        guard let connection = db.sqliteConnection else { throw DatabaseError(resultCode: .SQLITE_MISUSE, message: "closed") }
        defer {
            sqlite3_reset(handle)
            sqlite3_clear_bindings(handle)
        }
        var sequences: [Int64] = []
        sequences.reserveCapacity(items.count)
        // A row's text values, one after another in one reused buffer, bound where they lie (SQLITE_STATIC,
        // lengths given): no C string made per value, no strlen, no copy into SQLite's own buffers.
        var texts: [UInt8] = []
        texts.reserveCapacity(1024)
        var spans = [Range<Int>?](repeating: nil, count: 12)
        func append(_ column: Int, _ value: String?) {
            guard var value else { return spans[column] = nil }
            let start = texts.count
            value.withUTF8 { texts.append(contentsOf: $0) }
            spans[column] = start..<texts.count
        }
        for item in items {
            texts.removeAll(keepingCapacity: true)
            let start = texts.count
            item.id.appendLowercased(to: &texts)
            spans[1] = start..<texts.count
            append(2, item.queue)
            append(3, item.method.rawValue)
            append(4, item.url)
            append(5, item.resourceType)
            append(6, item.resourceID)
            append(8, item.contentType)
            append(11, item.fullURL)
            let code = item.body.withUnsafeBytes { body -> Int32 in
                texts.withUnsafeBufferPointer { texts -> Int32 in
                    var bound = SQLITE_OK
                    func check(_ code: Int32) { if bound == SQLITE_OK { bound = code } }
                    func text(_ index: Int32) {
                        guard let span = spans[Int(index)] else { return check(sqlite3_bind_null(handle, index)) }
                        // A zero-length value still needs a non-null pointer, or SQLite stores NULL.
                        let base = texts.baseAddress.map { UnsafeRawPointer($0 + span.lowerBound) } ?? UnsafeRawPointer(handle)
                        check(sqlite3_bind_text(handle, index, base.assumingMemoryBound(to: CChar.self), Int32(span.count), nil))
                    }
                    text(1)
                    text(2)
                    text(3)
                    text(4)
                    text(5)
                    text(6)
                    text(8)
                    text(11)
                    check(sqlite3_bind_int(handle, 7, item.encrypted ? 1 : 0))
                    // The bytes stay where they are (SQLITE_STATIC) until the step below has read them.
                    if let base = body.baseAddress, body.count > 0 {
                        check(sqlite3_bind_blob64(handle, 9, base, sqlite3_uint64(body.count), nil))
                    } else {
                        check(sqlite3_bind_zeroblob(handle, 9, 0))
                    }
                    check(sqlite3_bind_double(handle, 10, now))
                    check(sequences.isEmpty ? sqlite3_bind_int64(handle, 12, first) : sqlite3_bind_null(handle, 12))
                    guard bound == SQLITE_OK else { return bound }
                    let stepped = sqlite3_step(handle)
                    // Reset for the next row's bindings (after a failure, once its message was read: see `defer`).
                    if stepped == SQLITE_DONE { sqlite3_reset(handle) }
                    return stepped
                }
            }
            guard code == SQLITE_DONE else {
                throw DatabaseError(
                    resultCode: ResultCode(rawValue: code), message: String(cString: sqlite3_errmsg(connection)),
                    sql: statement.sql)
            }
            sequences.append(sqlite3_last_insert_rowid(connection))
        }
        return sequences
    }

    // MARK: - Flush bookkeeping

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

    /// Moves delivered items to the journal in one transaction and clears the server's backoff, on the
    /// calling thread (the journal's writer thread, see ``DeliveryRecorder``).
    func markDelivered(_ deliveries: [CompletedDelivery], owner: any FlushOwnership) -> Result<Void, DataQueueError> {
        guard let queue = deliveries.first?.item.queue else { return .success(()) }
        return Self.immediateNow(database, "record a delivery") { db in try Self.journal(deliveries, queue: queue, db: db) }
    }

    private static func journal(_ deliveries: [CompletedDelivery], queue: String, db: Database) throws {
        let now = Date().timeIntervalSince1970
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
                item.attempts + 1, item.enqueuedAt.timeIntervalSince1970, now, delivery.fullURL, delivery.bundle,
                delivery.entries, delivery.note,
            ])
        }
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
    private static func journalEvent(
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

    /// What is known of a server's Bundle support: whether its CapabilityStatement declares transactions
    /// (and when it was read), and the largest Bundle it took after refusing a larger one.
    struct BundleSupport: Sendable, Equatable {
        var transactions: Bool?
        var checkedAt: Date?
        var batchLimit: Int?
        /// The resource types whose conditional create the CapabilityStatement declares; nil when not read.
        var conditionalCreate: Set<String>? = nil
    }

    /// The JSON list stored for a set of conditional-create types.
    static func encodeTypes(_ types: Set<String>) -> String {
        String(decoding: (try? JSONEncoder().encode(types.sorted())) ?? Data("[]".utf8), as: UTF8.self)
    }

    static func decodeTypes(_ text: String?) -> Set<String>? {
        text.flatMap { try? JSONDecoder().decode([String].self, from: Data($0.utf8)) }.map(Set.init)
    }

    func bundleSupport(queue: String) async throws -> BundleSupport {
        try await read("read the server state") { db in
            guard let row = try Row.fetchOne(db, sql: "SELECT * FROM server_state WHERE queue = ?", arguments: [queue])
            else { return BundleSupport() }
            let transactions: Int? = row["transactions"]
            let checked: Double? = row["capability_at"]
            return BundleSupport(
                transactions: transactions.map { $0 != 0 }, checkedAt: checked.map(Date.init(timeIntervalSince1970:)),
                batchLimit: row["batch_limit"], conditionalCreate: Self.decodeTypes(row["conditional_create"]))
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
                    arguments: [Self.encodeTypes(conditionalCreate), queue])
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
    private func newestDeliveries(_ fullURLs: [String]) async throws
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

    // MARK: - Operator views

    /// Throws for a row of `queue` in no known state: it would be neither counted nor sent, and sending the
    /// items after it could overtake it.
    private static func checkStates(queue: String, db: Database) throws {
        if let row = try Row.fetchOne(db, sql: StatusQueries.damaged, arguments: [queue]) {
            throw damaged("item", row, "unknown state")
        }
    }

    /// Checks that every row of `queue` is in a known state (see ``checkStates(queue:db:)``).
    func checkStates(queue: String) async throws {
        try await read("read the queue") { db in try Self.checkStates(queue: queue, db: db) }
    }

    func status(queue: String) async throws -> QueueStatus {
        try await read("read the queue status") { db in
            let pending = try Int.fetchOne(db, sql: StatusQueries.pending, arguments: [queue]) ?? 0
            let parked = try Int.fetchOne(db, sql: StatusQueries.parked, arguments: [queue]) ?? 0
            let delivered = try Int.fetchOne(db, sql: StatusQueries.delivered, arguments: [queue]) ?? 0
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
                lastError: server?["last_error"], lastDeliveryAt: lastDelivery.map(Date.init(timeIntervalSince1970:)))
        }
    }

    /// All queue names that hold items or deliveries.
    func queues() async throws -> [String] {
        try await read("list queues") { db in try String.fetchAll(db, sql: StatusQueries.queues) }
    }

    func items(queue: String?, state: ItemState?, limit: Int) async throws -> [QueuedItem] {
        try await read("list the queue") { db in
            var sql =
                "SELECT seq, uuid, queue, method, url, resource_type, resource_id, encrypted, state, attempts, enqueued_at, last_attempt_at, last_status, last_error, outcome, length(body) AS size FROM item WHERE 1"
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
    func allStatuses() async throws -> [QueueStatus] {
        var statuses: [QueueStatus] = []
        for queue in try await queues() { statuses.append(try await status(queue: queue)) }
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
            throw QueueStore.mapError(error, doing: "check the database")
        }
    }

    func pruneJournal(before cutoff: Date) async throws -> Int {
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
            if !more { return removed }
        }
    }

    /// Gives the space of deleted rows back to the file system (`VACUUM`); needs room for a copy of the file.
    func vacuum() async throws {
        do {
            try await database.writeWithoutTransaction { db in try db.execute(sql: "VACUUM") }
        } catch {
            throw QueueStore.mapError(error, doing: "vacuum the queue database")
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

    // MARK: - Row mapping

    /// A row dq cannot read is named and refused, never guessed at (and never sent).
    static func damaged(_ table: String, _ row: Row, _ what: String) -> DataQueueError {
        let seq: Int64? = row["seq"]
        return DataQueueError(
            .storage,
            "\(table) row \(seq.map(String.init) ?? "?") of the queue database is damaged (\(what)); "
                + "inspect it with sqlite3, then fix or delete that row")
    }

    /// A text column read as what dq writes there, or the row named as damaged.
    private static func column<T>(_ row: Row, _ name: String, of table: String, _ parse: (String) -> T?) throws -> T {
        let text: String? = row[name]
        guard let text, let value = parse(text) else { throw damaged(table, row, "unknown \(name)") }
        return value
    }

    private static func queuedItem(_ row: Row) throws -> QueuedItem {
        let uuid = try column(row, "uuid", of: "item") { UUID(uuidString: $0) }
        let method = try column(row, "method", of: "item") { FHIRMethod(rawValue: $0) }
        let state = try column(row, "state", of: "item") { ItemState(rawValue: $0) }
        let lastAttempt: Double? = row["last_attempt_at"]
        let size: Int? = row["size"]
        let body: Data? = size == nil ? row["body"] : nil
        return QueuedItem(
            sequence: row["seq"], id: uuid, queue: row["queue"], method: method, url: row["url"],
            resourceType: row["resource_type"], resourceID: row["resource_id"], encrypted: row["encrypted"], state: state,
            attempts: row["attempts"], enqueuedAt: Date(timeIntervalSince1970: row["enqueued_at"]),
            lastAttemptAt: lastAttempt.map(Date.init(timeIntervalSince1970:)), lastStatus: row["last_status"],
            lastError: row["last_error"], outcome: row["outcome"], size: size ?? body?.count ?? 0)
    }

    private static func storedItem(_ row: Row) throws -> StoredItem {
        let conditional: Int? = row["conditional_create"]
        return StoredItem(
            info: try queuedItem(row), contentType: row["content_type"], conditionalCreate: conditional != 0,
            body: row["body"], fullURL: row["full_url"])
    }

    private static func deliveryRecord(_ row: Row) throws -> DeliveryRecord {
        let uuid = try column(row, "uuid", of: "delivery") { UUID(uuidString: $0) }
        let method = try column(row, "method", of: "delivery") { FHIRMethod(rawValue: $0) }
        let event = try column(row, "event", of: "delivery") { DeliveryRecord.Event(rawValue: $0) }
        return DeliveryRecord(
            sequence: row["seq"], id: uuid, event: event, queue: row["queue"], method: method, url: row["url"],
            resourceType: row["resource_type"], status: row["status"], location: row["location"],
            serverID: row["server_id"], versionID: row["version_id"], attempts: row["attempts"],
            enqueuedAt: Date(timeIntervalSince1970: row["enqueued_at"]), at: Date(timeIntervalSince1970: row["at"]),
            note: row["note"], fullURL: row["full_url"], bundle: row["bundle"],
            entryLocations: (row["entries"] as String?).flatMap {
                try? JSONDecoder().decode([String?].self, from: Data($0.utf8))
            })
    }
}

/// Group commit for single enqueues, on a writer thread of its own: an enqueue hands its item over and waits
/// (suspended, holding no thread) for the commit that carries it. The thread commits whatever waits, up to
/// ``maximumBatch`` items in one transaction, for as long as enqueues keep arriving, and exits after
/// ``idleTimeout`` without work. No thread of Swift's cooperative pool ever runs a commit or waits in its
/// `fsync`: in a service with two pool threads, a durable commit on one of them stalled everything else that
/// process did (HTTP answers, PostgreSQL round trips) for as long as the disk took. One commit runs at a time;
/// each caller returns only after the commit that holds its item.
final class EnqueueBatcher: @unchecked Sendable {  // state guarded by `condition`
    private struct Waiter {
        let item: NewItem
        let continuation: CheckedContinuation<Int64, any Error>
    }

    private let condition = NSCondition()
    // Guarded by `condition`.
    private var threadRunning = false
    private var waiting: [Waiter] = []
    private var commitCount = 0
    private let commit: @Sendable ([NewItem]) -> Result<[Int64], DataQueueError>
    /// The largest number of items one commit carries.
    let maximumBatch = 512
    /// How long the writer thread waits for more work before it exits.
    let idleTimeout: TimeInterval = 0.5

    /// - Parameter commit: stores a batch in one transaction, synchronously (called on the writer thread).
    init(commit: @escaping @Sendable ([NewItem]) -> Result<[Int64], DataQueueError>) {
        self.commit = commit
    }

    /// Enqueues waiting for a commit (for tests of the grouping).
    var waitingCount: Int {
        condition.lock()
        defer { condition.unlock() }
        return waiting.count
    }

    /// Transactions committed so far (for tests of the grouping).
    var commits: Int {
        condition.lock()
        defer { condition.unlock() }
        return commitCount
    }

    /// Stores `item` in the next commit of the writer thread and returns its sequence number.
    func submit(_ item: NewItem) async throws -> Int64 {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Int64, any Error>) in
            condition.lock()
            waiting.append(Waiter(item: item, continuation: continuation))
            if threadRunning {
                condition.signal()
            } else {
                threadRunning = true
                let thread = Thread { [self] in self.writerLoop() }
                thread.name = "dq-enqueue"
                thread.start()
            }
            condition.unlock()
        }
    }

    private func writerLoop() {
        condition.lock()
        while true {
            if !waiting.isEmpty {
                let group = Array(waiting.prefix(maximumBatch))
                waiting.removeFirst(group.count)
                condition.unlock()
                let result = commit(group.map(\.item))
                condition.lock()
                commitCount += 1  // counted before the callers return, so that they see their commit counted
                condition.unlock()
                for (index, waiter) in group.enumerated() {
                    switch result {
                    case .success(let sequences): waiter.continuation.resume(returning: sequences[index])
                    case .failure(let error): waiter.continuation.resume(throwing: error)
                    }
                }
                condition.lock()
                continue
            }
            // A producer that enqueues one item at a time submits its next within microseconds of being resumed:
            // look for it briefly before sleeping, so that its commit does not wait for this thread's wake-up.
            var spins = 0
            while waiting.isEmpty && spins < 200 {
                condition.unlock()
                sched_yield()
                spins += 1
                condition.lock()
            }
            if !waiting.isEmpty { continue }
            if !condition.wait(until: Date(timeIntervalSinceNow: idleTimeout)) && waiting.isEmpty {
                threadRunning = false
                condition.unlock()
                return
            }
        }
    }
}

/// Records deliveries in the journal in the background while the flush sends the next items, grouping the
/// deliveries that wait into one commit (group commit), so the flush is not held to one fsync per item.
///
/// Commits run on a writer thread of their own (as the grouped ones of ``EnqueueBatcher``); ``record(_:)`` only appends
/// under a lock, so the flush loop does not hop threads to journal a delivery.
final class DeliveryRecorder: @unchecked Sendable {
    private let store: any QueueStorage
    private let owner: any FlushOwnership
    private let condition = NSCondition()
    // Guarded by `condition`.
    private var waiting: [CompletedDelivery] = []
    private var committing = false
    private var running = false
    private var failure: DataQueueError?
    /// The deliveries of the commit that failed (those still waiting stay in `waiting`).
    private var failed: [CompletedDelivery] = []
    private var idle: [CheckedContinuation<Void, Never>] = []
    private let beforeCommit: (@Sendable () -> Void)?

    /// - Parameter beforeCommit: a test seam run on the writer thread before each commit.
    init(store: any QueueStorage, owner: any FlushOwnership, beforeCommit: (@Sendable () -> Void)? = nil) {
        self.store = store
        self.owner = owner
        self.beforeCommit = beforeCommit
    }

    /// How many deliveries wait for their commit.
    var backlog: Int {
        condition.lock()
        defer { condition.unlock() }
        return waiting.count
    }

    /// Queues a delivery for the journal; throws the error of an earlier failed commit (the delivery is then
    /// kept among the unrecorded ones: the server has it).
    func record(_ delivery: CompletedDelivery) throws {
        append(delivery)
        try check()
    }

    /// Throws the error of a failed commit, if one failed.
    func check() throws {
        if let failure = condition.withLock({ failure }) { throw failure }
    }

    /// Queues a delivery for the journal and never drops it: after a failed commit it waits among the
    /// unrecorded ones (``takeUnrecorded()``), so that a loop over several accepted deliveries (a Bundle's
    /// entries) keeps them all; ``check()`` after the loop says whether to stop.
    func append(_ delivery: CompletedDelivery) {
        condition.lock()
        defer { condition.unlock() }
        waiting.append(delivery)
        if failure != nil { return }
        if running {
            condition.signal()
        } else {
            running = true
            let thread = Thread { [self] in self.writerLoop() }
            thread.name = "dq-journal"
            thread.start()
        }
    }

    private func writerLoop() {
        condition.lock()
        while true {
            if waiting.isEmpty || failure != nil {
                for waiter in idle { waiter.resume() }
                idle.removeAll()
                if !condition.wait(until: Date(timeIntervalSinceNow: 0.5)) && (waiting.isEmpty || failure != nil) {
                    running = false
                    condition.unlock()
                    return
                }
                continue
            }
            let batch = waiting
            waiting.removeAll()
            committing = true
            condition.unlock()
            beforeCommit?()
            let result = store.markDelivered(batch, owner: owner)
            condition.lock()
            committing = false
            if case .failure(let error) = result {
                failure = error
                failed = batch
            }
        }
    }

    /// After a failed commit: every delivery that did not reach the journal, in order (none otherwise).
    func takeUnrecorded() -> [CompletedDelivery] {
        condition.lock()
        defer { condition.unlock() }
        guard failure != nil else { return [] }
        defer {
            failed.removeAll()
            waiting.removeAll()
        }
        return failed + waiting
    }

    /// Waits until every recorded delivery is committed; throws the first commit error.
    func finish() async throws {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            condition.lock()
            if (waiting.isEmpty && !committing) || failure != nil {
                condition.unlock()
                continuation.resume()
            } else {
                idle.append(continuation)
                condition.signal()
                condition.unlock()
            }
        }
        if let failure = condition.withLock({ failure }) { throw failure }
    }
}
