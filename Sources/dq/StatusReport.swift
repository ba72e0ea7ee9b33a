import FHIRDataQueue
import Logging

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#endif

/// How `dq status` prints.
enum StatusReport {
    /// `2026-11-23T12:41:13Z`: UTC to the second, by `gmtime_r` (an ISO8601DateFormatter loads the time-zone
    /// database, a few milliseconds of every `dq status`); `-` for none.
    static func formatDate(_ date: Date?) -> String {
        guard let date else { return "-" }
        var seconds = time_t(date.timeIntervalSince1970.rounded(.down))
        var parts = tm()
        guard gmtime_r(&seconds, &parts) != nil else { return "-" }
        func two(_ value: Int32) -> String { value < 10 ? "0\(value)" : "\(value)" }
        return "\(parts.tm_year + 1900)-\(two(parts.tm_mon + 1))-\(two(parts.tm_mday))T"
            + "\(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec))Z"
    }

    /// The lines of one queue's status.
    static func lines(_ status: QueueStatus) -> [String] {
        var lines = [
            "queue:      \(status.queue)",
            "pending:    \(status.pending)",
            "parked:     \(status.parked)",
            "delivered:  \(status.delivered)",
            "oldest:     \(formatDate(status.oldestPendingAt))",
        ]
        if status.possibleDuplicates > 0 {
            lines.insert(
                "possible duplicates: \(status.possibleDuplicates) (sent again after a stop while on the way, with no condition the server could check: dq log --possible-duplicates)",
                at: 4)
        }
        if status.duplicates > 0 {
            lines.insert("duplicates: \(status.duplicates) (repeats of delivered resources, not sent: dq log)", at: 4)
        }
        if status.consecutiveFailures > 0 {
            lines.append("failures:   \(status.consecutiveFailures) in a row; next try after \(formatDate(status.nextAttemptAt))")
            lines.append("last error: \(status.lastError ?? "-")")
        }
        return lines
    }

    /// The line under a queue's status naming its database.
    /// What the server declared, and what idempotent mode can trust of it.
    static func capabilitiesLine(_ capabilities: DataQueue.ServerCapabilities, idempotent: DataQueue.Idempotence) -> String {
        guard let transactions = capabilities.transactions, let conditional = capabilities.conditionalCreate else {
            return "server:     capabilities not read yet (the next flush reads them)"
        }
        var line = "server:     transactions \(transactions ? "yes" : "no"), conditional create "
        line += conditional.isEmpty ? "declared for no type" : "for \(conditional.count) type(s)"
        if idempotent == .always && conditional.isEmpty {
            line += " (idempotent mode cannot prevent a duplicate after a lost answer)"
        }
        return line
    }

    /// The line saying that creates to this server cannot be delivered exactly once, and why: the server
    /// declares conditional create for no type, or `idempotent` is `false`. Nil while its CapabilityStatement
    /// has not been read, or when conditional creates protect the creates of the declared types.
    static func exactlyOnceLine(_ capabilities: DataQueue.ServerCapabilities, idempotent: DataQueue.Idempotence) -> String? {
        guard capabilities.transactions != nil, let conditional = capabilities.conditionalCreate else { return nil }
        let lost = "a create whose answer was lost (dq killed, the connection cut) is stored again when it is sent again"
        if conditional.isEmpty {
            return "delivery:   at least once, not exactly once: the server declares conditional create for no type, so \(lost)"
        }
        if idempotent == .never {
            return "delivery:   at least once, not exactly once: idempotent is false, so \(lost) "
                + "(\"auto\", the default, prevents it for the \(conditional.count) type(s) the server declares)"
        }
        return nil
    }

    /// `dq doctor`'s ``exactlyOnceLine(_:idempotent:)``, from what the queue's database (opened read-only) keeps
    /// of the configured server's CapabilityStatement; nil without a server, a queue to read, or anything to say.
    static func doctorDeliveryLine(_ settings: DataQueueSettings) async -> String? {
        guard settings.server != nil,
            let queue = try? await settings.makeQueue(
                readOnly: true, logger: Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() }))
        else { return nil }
        let capabilities = (try? await queue.serverCapabilities()) ?? DataQueue.ServerCapabilities()
        try? await queue.shutdown()
        return exactlyOnceLine(capabilities, idempotent: queue.configuration.idempotent)
    }

    /// How the database is sealed at rest: not at all, or under which keys, with how many items each seals.
    static func sealingLine(_ sealing: DataQueue.SealingSummary) -> String {
        guard !sealing.keys.isEmpty || !sealing.items.isEmpty else { return "at rest:    not sealed (items are stored as given)" }
        var parts = sealing.items.sorted { $0.key < $1.key }.map { "key \($0.key): \($0.value) item(s)" }
        parts += sealing.keys.filter { sealing.items[$0] == nil }.sorted().map { "key \($0): 0 items" }
        if sealing.plain > 0 { parts.append("\(sealing.plain) item(s) not sealed yet") }
        return "at rest:    sealed (AES-256-GCM); " + parts.joined(separator: ", ")
    }

    static func databaseLine(_ database: String) -> String {
        "database:   \(QueuePaths.displayDatabase(database))"
    }

    /// The line for another queue of the same database that holds items.
    static func elsewhereLine(_ other: QueueStatus) -> String {
        "elsewhere:  \(other.queue): \(other.pending) pending, \(other.parked) parked (dq status --all)"
    }

    /// Whether another queue is worth an `elsewhere` line: it is not `queue` and holds items.
    static func isElsewhere(_ other: QueueStatus, of queue: String) -> Bool {
        other.queue != queue && other.pending + other.parked > 0
    }

    /// The whole of `dq status --all` as text.
    static func allLines(database: String, statuses: [QueueStatus]) -> [String] {
        var lines = ["database: \(QueuePaths.displayDatabase(database))"]
        if statuses.isEmpty { lines.append("no queues") }
        for status in statuses { lines.append(""); lines += Self.lines(status) }
        return lines
    }

    /// The encoder of every `--json` output: pretty, sorted keys, ISO 8601 dates.
    static func jsonEncoder() -> JSONEncoder {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        return encoder
    }
}
