import CSQLite
import Foundation
import GRDB
import Logging
import NIOConcurrencyHelpers

#if canImport(Glibc)
    import Glibc
#endif

/// The durable SQLite queue: items, the delivery journal and per-server backoff state.
///
/// The queue knows nothing of HTTP: it stores requests and records outcomes.
final class SQLiteQueueStore: QueueStorage {
    let path: String
    let database: DatabaseQueue
    /// Single enqueues, committed in groups on a thread of their own (no commit or fsync on the caller's).
    let batcher: GroupCommit<NewItem, Int64>
    /// The device and inode of the file opened (see ``checkFileIdentity()``).
    let fileIdentity: (device: UInt64, inode: UInt64)?
    /// The device and inode of the `-wal` and `-shm` files beside the database while it is the one opened: what is
    /// moved aside when the database is found deleted or replaced (see ``checkFileIdentity()``).
    private let companions = NIOLockedValueBox<[String: FileIdentity]>([:])

    /// Opens or creates the database at `path` (mode 0600, directory 0700), migrating the schema under
    /// an exclusive file lock so that several processes may open a new file at once.
    ///
    /// A new database is made under a temporary name and renamed into place once its schema is complete,
    /// so a file at `path` is always a whole dq queue: an existing file that is empty or not a dq queue is
    /// refused, never initialised over.
    ///
    /// - Parameter readOnly: open an existing queue for reading only: no directory or file is created,
    ///   nothing is written, and a missing file is an error.
    /// - Parameter logger: where moving aside the files of a deleted database is reported.
    init(
        path: String, durability: DataQueue.Durability, readOnly: Bool = false, busyTimeout: TimeInterval = 30,
        logger: Logger? = nil
    ) throws {
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
                // A WAL or shared-memory file without its database is a deleted database's: SQLite would apply its
                // frames to the new file (inherited rows and state, or a malformed database).
                for moved in try Self.moveAside(Self.companionSuffixes.map { path + $0 }, reason: "orphaned") {
                    logger?.warning(
                        "moved aside a file left by a deleted queue database before creating a new one",
                        metadata: ["file": "\(moved)"])
                }
                try Self.create(path, configuration: configuration)
            }
            database = try Self.openExisting(path, configuration: configuration, readOnly: false)
        }
        batcher = GroupCommit(
            spinsBeforeSleep: 200,
            committer: .thread(name: "dq-enqueue") { [database] items in
                SQLiteQueueStore.immediateNow(database, "enqueue") { db in try SQLiteQueueStore.insert(items, db: db) }
            })
        fileIdentity = FileIdentity(path).map { ($0.device, $0.inode) }
    }

    /// Refuses to go on with a file that is no longer the one at `path`: deleted, or replaced (a restore, a
    /// `mv`). A long-running process would otherwise keep writing to the unlinked file while what is queued
    /// into the new one is never sent.
    ///
    /// Found deleted or replaced, its `-wal` and `-shm` (when still the ones this process uses) are moved aside, and
    /// this connection will not checkpoint or remove them when it closes: the next process that creates or opens a
    /// database at `path` must not replay the old one's frames, and must not have its own WAL removed by name.
    func checkFileIdentity() throws {
        guard let fileIdentity else { return }
        let now = FileIdentity(path)
        if let now, now.device == fileIdentity.device && now.inode == fileIdentity.inode {
            companions.withLockedValue { known in
                for suffix in Self.companionSuffixes where known[suffix] == nil {
                    known[suffix] = FileIdentity(path + suffix)
                }
            }
            return
        }
        let ours = companions.withLockedValue { known in
            Self.companionSuffixes.filter { suffix in known[suffix].map { FileIdentity(path + suffix) == $0 } ?? false }
        }
        database.writeWithoutTransaction { db in _ = dq_sqlite3_no_checkpoint_on_close(db.sqliteConnection, 1) }
        // A file that cannot be moved is named (its error says to move it by hand): left there, the next database
        // opened at the path would replay it.
        let aside: String
        do {
            let moved = try Self.moveAside(ours.map { path + $0 }, reason: now == nil ? "deleted" : "replaced")
            aside = moved.isEmpty ? "" : "; its \(moved.count == 1 ? "file" : "files") \(moved.joined(separator: ", ")) moved aside"
        } catch {
            aside = "; \((error as? DataQueueError)?.message ?? "\(error)")"
        }
        if now == nil {
            throw DataQueueError(.storage, "the queue database \(path) was deleted while dq had it open\(aside); restart dq")
        }
        throw DataQueueError(
            .storage, "the queue database \(path) was replaced by another file while dq had it open\(aside); restart dq to open it")
    }

    /// The files SQLite keeps beside a database in WAL mode.
    static let companionSuffixes = ["-wal", "-shm"]

    /// Renames each of `files` that exists to `<file>.<reason>-<UTC time>`; the new names.
    ///
    /// - Throws: ``DataQueueError`` (`.storage`) when one cannot be moved: a database must not be made beside it.
    static func moveAside(_ files: [String], reason: String) throws -> [String] {
        let stamp = Date().formatted(.iso8601.year().month().day().time(includingFractionalSeconds: false))
            .replacingOccurrences(of: ":", with: "")
        var moved: [String] = []
        for file in files {
            var info = stat()
            guard lstat(file, &info) == 0 else { continue }
            let aside = "\(file).\(reason)-\(stamp)"
            guard rename(file, aside) == 0 else {
                throw DataQueueError(
                    .storage,
                    "\(file) is left by a queue database that is gone and cannot be moved aside (\(String(cString: strerror(errno)))): move or remove it by hand"
                )
            }
            moved.append(aside)
        }
        return moved
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
        let lock = try FileLock(path: DataQueue.flushLockPath(database: path, queue: queue), guardsDeletion: true)
        return try await lock.lock(until: deadline) ? lock : nil
    }
}

/// A file's device and inode: which file a path named when it was looked at.
struct FileIdentity: Equatable, Sendable {
    var device: UInt64
    var inode: UInt64

    /// The file at `path` now; nil when there is none.
    init?(_ path: String) {
        var info = stat()
        guard stat(path, &info) == 0 else { return nil }
        device = UInt64(info.st_dev)
        inode = UInt64(info.st_ino)
    }
}
