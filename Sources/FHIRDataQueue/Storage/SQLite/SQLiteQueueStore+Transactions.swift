import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

// Transactions on the queue's connection, and SQLite's errors in dq's words.
extension SQLiteQueueStore {
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
    func immediate<T: Sendable>(_ what: String, _ body: @escaping @Sendable (Database) throws -> T) async throws -> T {
        do {
            return try await database.writeWithoutTransaction { db in try Self.inImmediateTransaction(db, body) }
        } catch let error as CancellationError {
            // A cancelled task is not a storage failure: the caller sees the cancellation itself.
            throw error
        } catch {
            throw SQLiteQueueStore.mapError(error, doing: what)
        }
    }

    /// ``immediate(_:_:)`` for the writer threads, which may block: a synchronous write transaction.
    static func immediateNow<T>(
        _ database: DatabaseQueue, _ what: String, _ body: (Database) throws -> T
    ) -> Result<T, DataQueueError> {
        Result { try database.writeWithoutTransaction { db in try inImmediateTransaction(db, body) } }
            .mapError { SQLiteQueueStore.mapError($0, doing: what) }
    }

    /// `BEGIN IMMEDIATE`, `body`, `COMMIT` through statements prepared once per connection (GRDB's
    /// `inTransaction` prepares both anew each time); on any error, a rollback if a transaction is still open.
    static func inImmediateTransaction<T>(_ db: Database, _ body: (Database) throws -> T) throws -> T {
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
    static func filesRefuseWrites(_ error: DatabaseError) -> Bool {
        [.SQLITE_IOERR, .SQLITE_FULL, .SQLITE_READONLY, .SQLITE_CANTOPEN, .SQLITE_PERM].contains(error.resultCode)
    }

    func read<T: Sendable>(_ what: String, _ body: @escaping @Sendable (Database) throws -> T) async throws -> T {
        do {
            return try await database.read(body)
        } catch let error as CancellationError {
            throw error
        } catch {
            throw SQLiteQueueStore.mapError(error, doing: what)
        }
    }
}
