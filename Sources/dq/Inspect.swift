import ArgumentParser
import FHIRDataQueue
import Foundation

extension DQ {
    struct Status: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "status", abstract: "Show counts of the queue and the server's backoff state.")
        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Print as JSON.") var json = false

        func run() async throws {
            try await withQueue(queueOptions, readOnly: true) { queue in
                let status = try await queue.status()
                if json { try printJSON(status); return }
                print("queue:      \(status.queue)")
                print("database:   \(queue.configuration.databasePath)")
                print("pending:    \(status.pending)")
                print("parked:     \(status.parked)")
                print("delivered:  \(status.delivered)")
                print("oldest:     \(formatDate(status.oldestPendingAt))")
                if status.consecutiveFailures > 0 {
                    print("failures:   \(status.consecutiveFailures) in a row; next try after \(formatDate(status.nextAttemptAt))")
                    print("last error: \(status.lastError ?? "-")")
                }
            }
        }
    }

    struct List: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "list", abstract: "List queued items in order.")
        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Only parked items (rejected by the server).") var parked = false
        @Flag(help: "Only pending items.") var pending = false
        @Option(parsing: .unconditional, help: "At most this many items.") var limit = 1000
        @Flag(help: "Print as JSON.") var json = false

        func validate() throws {
            if parked && pending { throw ValidationError("--parked and --pending exclude each other") }
            if limit < 1 { throw ValidationError("--limit must be at least 1") }
        }

        func run() async throws {
            try await withQueue(queueOptions, readOnly: true) { queue in
                let state: ItemState? = parked ? .parked : pending ? .pending : nil
                let items = try await queue.items(state: state, limit: limit)
                if json { try printJSON(items); return }
                if items.isEmpty { print("no items"); return }
                print("SEQ\tID\tSTATE\tMETHOD\tTYPE\tATTEMPTS\tENQUEUED\tLAST ERROR")
                for item in items {
                    print(
                        "\(item.sequence)\t\(item.id.uuidString.lowercased())\t\(item.state.rawValue)\t\(item.method.rawValue)\t\(item.resourceType)\t\(item.attempts)\t\(formatDate(item.enqueuedAt))\t\(item.lastError ?? "-")"
                    )
                }
            }
        }
    }

    struct Show: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "show", abstract: "Show one queued item and the server's last answer.")
        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The item's id (or a unique prefix of 4+ characters) or sequence number.") var id: String
        @Flag(help: "Also print the stored body (may contain PHI).") var body = false
        @Flag(help: "Print as JSON.") var json = false

        func run() async throws {
            try await withQueue(queueOptions, readOnly: true) { queue in
                let (item, data) = try await queue.item(id)
                if json {
                    struct Shown: Encodable { var item: QueuedItem; var body: String? }
                    try printJSON(Shown(item: item, body: body ? String(decoding: data, as: UTF8.self) : nil))
                    return
                }
                print("id:        \(item.id.uuidString.lowercased())")
                print("sequence:  \(item.sequence)")
                print("state:     \(item.state.rawValue)")
                print("request:   \(item.method.rawValue) \((try? queue.requestURL(for: item)) ?? item.url)")
                print("type:      \(item.resourceType)\(item.encrypted ? " (encrypted envelope)" : "")")
                print("size:      \(item.size) bytes")
                print("enqueued:  \(formatDate(item.enqueuedAt))")
                print("attempts:  \(item.attempts) (last \(formatDate(item.lastAttemptAt)))")
                print("last:      \(item.lastStatus.map(String.init) ?? "-") \(item.lastError ?? "")")
                if let outcome = item.outcome { print("outcome:   \(outcome)") }
                if body { print(String(decoding: data, as: UTF8.self)) }
            }
        }
    }

    struct Retry: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "retry", abstract: "Put parked items back in line for the next flush.")
        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The item's id or sequence number.") var id: String?
        @Flag(help: "Retry every parked item.") var allParked = false
        @Flag(
            inversion: .prefixedNo,
            help: "--no-conditional: send the item as a plain create from now on, even in idempotent mode (for a server that refuses its If-None-Exist); --conditional: let idempotent mode apply again."
        ) var conditional: Bool?

        func validate() throws {
            if (id == nil) == !allParked { throw ValidationError("give an item id or --all-parked (not both)") }
            if conditional != nil && allParked { throw ValidationError("--conditional/--no-conditional apply to one item") }
        }

        func run() async throws {
            try await withQueue(queueOptions) { queue in
                if allParked {
                    print("\(try await queue.retryAllParked()) parked item(s) back in line")
                } else if let id {
                    let item = try await queue.retry(id, conditionalCreate: conditional)
                    print("item \(item.id.uuidString.lowercased()) back in line")
                }
            }
        }
    }

    struct Drop: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "drop",
            abstract: "Remove an item without sending it (recorded in the journal).")
        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The item's id or sequence number.") var id: String

        func run() async throws {
            try await withQueue(queueOptions) { queue in
                let item = try await queue.drop(id)
                print("dropped item \(item.id.uuidString.lowercased()) (\(item.method.rawValue) \(item.resourceType))")
            }
        }
    }

    struct Log: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "log",
            abstract: "Show the delivery journal: when, where, status and the server's id of each item.")
        @OptionGroup var queueOptions: QueueOptions
        @Option(parsing: .unconditional, help: "The newest this many lines.") var limit = 100
        @Flag(help: "Print as JSON.") var json = false

        func validate() throws {
            if limit < 1 { throw ValidationError("--limit must be at least 1") }
        }

        func run() async throws {
            try await withQueue(queueOptions, readOnly: true) { queue in
                let records = try await queue.deliveries(limit: limit)
                if json { try printJSON(records); return }
                if records.isEmpty { print("no deliveries"); return }
                print("AT\tEVENT\tID\tMETHOD\tTYPE\tSTATUS\tLOCATION\tATTEMPTS")
                for record in records {
                    print(
                        "\(formatDate(record.at))\t\(record.event.rawValue)\t\(record.id.uuidString.lowercased())\t\(record.method.rawValue)\t\(record.resourceType)\t\(record.status.map(String.init) ?? "-")\t\(record.location ?? "-")\t\(record.attempts)"
                    )
                }
            }
        }
    }
}
