#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#endif

/// The SQL that reads a SQLite queue's status: one text for the library's store and the `dq` front, so that
/// the two can never count differently.
package enum StatusQueries {
    /// Pending items of a queue (`?` = the queue).
    package static let pending = "SELECT count(*) FROM item WHERE queue = ? AND state = 'pending'"
    /// Parked items of a queue.
    package static let parked = "SELECT count(*) FROM item WHERE queue = ? AND state = 'parked'"
    /// Journal lines of a queue that count as delivered.
    package static let delivered = "SELECT count(*) FROM delivery WHERE queue = ? AND event IN ('delivered', 'already-present')"
    /// The first row of a queue in a state dq does not know (a damaged or edited row): `seq, state`.
    package static let damaged = "SELECT seq, state FROM item WHERE queue = ? AND state NOT IN ('pending', 'parked') LIMIT 1"
    /// When the oldest pending item of a queue was enqueued.
    package static let oldestPending = "SELECT enqueued_at FROM item WHERE queue = ? AND state = 'pending' ORDER BY seq LIMIT 1"
    /// A queue's backoff state: `failures, next_attempt_at, last_error`.
    package static let serverState = "SELECT failures, next_attempt_at, last_error FROM server_state WHERE queue = ?"
    /// Every queue name that holds items, deliveries or a backoff state, in order.
    package static let queues =
        "SELECT queue FROM item UNION SELECT queue FROM delivery UNION SELECT queue FROM server_state ORDER BY 1"
}

/// The schema a SQLite queue must have to be read: GRDB's migration identifiers, in order.
package enum QueueSchema {
    /// The migrations of the current schema (the store registers exactly these).
    package static let migrations = ["v1", "v2", "v3", "v4"]
}

/// How `dq status` prints, for the command line and its fast front alike.
package enum StatusReport {
    /// `2026-11-23T12:41:13Z`: UTC to the second, by `gmtime_r` (an ISO8601DateFormatter loads the time-zone
    /// database, a few milliseconds of every `dq status`); `-` for none.
    package static func formatDate(_ date: Date?) -> String {
        guard let date else { return "-" }
        var seconds = time_t(date.timeIntervalSince1970.rounded(.down))
        var parts = tm()
        guard gmtime_r(&seconds, &parts) != nil else { return "-" }
        func two(_ value: Int32) -> String { value < 10 ? "0\(value)" : "\(value)" }
        return "\(parts.tm_year + 1900)-\(two(parts.tm_mon + 1))-\(two(parts.tm_mday))T"
            + "\(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec))Z"
    }

    /// The lines of one queue's status.
    package static func lines(_ status: QueueStatus) -> [String] {
        var lines = [
            "queue:      \(status.queue)",
            "pending:    \(status.pending)",
            "parked:     \(status.parked)",
            "delivered:  \(status.delivered)",
            "oldest:     \(formatDate(status.oldestPendingAt))",
        ]
        if status.consecutiveFailures > 0 {
            lines.append("failures:   \(status.consecutiveFailures) in a row; next try after \(formatDate(status.nextAttemptAt))")
            lines.append("last error: \(status.lastError ?? "-")")
        }
        return lines
    }

    /// The line under a queue's status naming its database.
    package static func databaseLine(_ database: String) -> String {
        "database:   \(QueuePaths.displayDatabase(database))"
    }

    /// The line for another queue of the same database that holds items.
    package static func elsewhereLine(_ other: QueueStatus) -> String {
        "elsewhere:  \(other.queue): \(other.pending) pending, \(other.parked) parked (dq status --all)"
    }

    /// Whether another queue is worth an `elsewhere` line: it is not `queue` and holds items.
    package static func isElsewhere(_ other: QueueStatus, of queue: String) -> Bool {
        other.queue != queue && other.pending + other.parked > 0
    }

    /// The whole of `dq status --all` as text.
    package static func allLines(database: String, statuses: [QueueStatus]) -> [String] {
        var lines = ["database: \(QueuePaths.displayDatabase(database))"]
        if statuses.isEmpty { lines.append("no queues") }
        for status in statuses { lines.append(""); lines += Self.lines(status) }
        return lines
    }

    /// The encoder of every `--json` output: pretty, sorted keys, ISO 8601 dates.
    package static func jsonEncoder() -> JSONEncoder {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        return encoder
    }
}
