import CSQLite
import FHIRDataQueueCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#endif

/// Reads the status of a SQLite queue file with SQLite's C API, read-only, in one read transaction: the
/// checks and queries of the library's store (``StatusQueries``), without GRDB or the rest of the library.
///
/// Returns nil, never throws, for anything it does not find exactly as the library expects (no file, an
/// empty file, another schema, a damaged row, a busy or failing read): the engine then runs the command and
/// says what is wrong in its own words.
final class SQLiteStatusReader {
    private let db: OpaquePointer

    /// Opens `path` read-only: nil when it is not a dq queue of the current schema.
    init?(path: String) {
        var info = stat()
        guard stat(path, &info) == 0, info.st_size > 0 else { return nil }
        var handle: OpaquePointer?
        guard sqlite3_open_v2(path, &handle, SQLITE_OPEN_READONLY, nil) == SQLITE_OK, let handle else {
            sqlite3_close(handle)
            return nil
        }
        // The library's store waits up to 30 s for a lock, as here.
        sqlite3_busy_timeout(handle, 30_000)
        guard sqlite3_exec(handle, "BEGIN", nil, nil, nil) == SQLITE_OK else {
            sqlite3_close(handle)
            return nil
        }
        db = handle
        guard let tables = strings("SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ('item', 'grdb_migrations')"),
            Set(tables) == ["item", "grdb_migrations"],
            let migrations = strings("SELECT identifier FROM grdb_migrations"),
            Set(migrations) == Set(QueueSchema.migrations), migrations.count == QueueSchema.migrations.count
        else { return nil }
    }

    deinit {
        _ = execute("COMMIT")
        sqlite3_close(db)
    }

    /// Every queue of the database with its status, in the order of their names.
    func allStatuses() -> [QueueStatus]? {
        guard let queues = strings(StatusQueries.queues) else { return nil }
        var statuses: [QueueStatus] = []
        for queue in queues {
            guard let status = status(queue: queue) else { return nil }
            statuses.append(status)
        }
        return statuses
    }

    /// One queue's status; nil when a row of it is in a state dq does not know.
    func status(queue: String) -> QueueStatus? {
        guard let pending = integer(StatusQueries.pending, queue), let parked = integer(StatusQueries.parked, queue),
            let delivered = integer(StatusQueries.delivered, queue),
            let damaged = rows(StatusQueries.damaged, queue, columns: 2), damaged.isEmpty,
            let oldest = rows(StatusQueries.oldestPending, queue, columns: 1),
            let server = rows(StatusQueries.serverState, queue, columns: 3)
        else { return nil }
        let state = server.first
        return QueueStatus(
            queue: queue, pending: Int(pending), parked: Int(parked), delivered: Int(delivered),
            oldestPendingAt: oldest.first?[0].double.map(Date.init(timeIntervalSince1970:)),
            consecutiveFailures: Int(state?[0].integer ?? 0),
            nextAttemptAt: state?[1].double.map(Date.init(timeIntervalSince1970:)),
            lastError: state?[2].text)
    }

    // MARK: - SQLite

    /// One column's value.
    private enum Value {
        case null, integer(Int64), double(Double), text(String)

        var integer: Int64? {
            switch self {
            case .integer(let value): value
            case .double(let value): Int64(exactly: value.rounded(.towardZero))
            default: nil
            }
        }
        var double: Double? {
            switch self {
            case .integer(let value): Double(value)
            case .double(let value): value
            default: nil
            }
        }
        var text: String? {
            if case .text(let value) = self { return value }
            return nil
        }
    }

    private func execute(_ sql: String) -> Bool {
        sqlite3_exec(db, sql, nil, nil, nil) == SQLITE_OK
    }

    /// The rows of `sql` with `argument` bound to its one parameter (if any); nil on any error.
    private func rows(_ sql: String, _ argument: String? = nil, columns: Int32) -> [[Value]]? {
        var statement: OpaquePointer?
        guard sqlite3_prepare_v2(db, sql, -1, &statement, nil) == SQLITE_OK, let statement else { return nil }
        defer { sqlite3_finalize(statement) }
        if let argument {
            // SQLITE_TRANSIENT: SQLite copies the text.
            let transient = unsafeBitCast(-1, to: sqlite3_destructor_type.self)
            guard sqlite3_bind_text(statement, 1, argument, -1, transient) == SQLITE_OK else { return nil }
        }
        var result: [[Value]] = []
        while true {
            switch sqlite3_step(statement) {
            case SQLITE_ROW:
                result.append(
                    (0..<columns).map { column in
                        switch sqlite3_column_type(statement, column) {
                        case SQLITE_INTEGER: .integer(sqlite3_column_int64(statement, column))
                        case SQLITE_FLOAT: .double(sqlite3_column_double(statement, column))
                        case SQLITE_TEXT: .text(String(cString: sqlite3_column_text(statement, column)))
                        default: .null
                        }
                    })
            case SQLITE_DONE:
                return result
            default:
                return nil
            }
        }
    }

    private func integer(_ sql: String, _ argument: String) -> Int64? {
        rows(sql, argument, columns: 1)?.first?.first?.integer
    }

    private func strings(_ sql: String) -> [String]? {
        guard let rows = rows(sql, columns: 1) else { return nil }
        let texts = rows.compactMap { $0[0].text }
        return texts.count == rows.count ? texts : nil
    }
}
