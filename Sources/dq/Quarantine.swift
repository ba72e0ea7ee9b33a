import ArgumentParser
import FHIRDataQueue
import Foundation

extension DQ {
    /// `dq quarantine`: the envelopes `dq serve` took but could not open (an unknown `key_id`, a key that does not
    /// unwrap, a message that does not decrypt or holds no FHIR resource). The device had its 202 and went on;
    /// they wait here, parked, never sent, until an operator replays them (after adding the missing key) or drops
    /// them.
    struct Quarantine: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "quarantine",
            abstract: "List, show, replay or drop the envelopes dq serve could not open.",
            subcommands: [List.self, Show.self, Replay.self, Drop.self])

        /// The quarantined items of the queue, in order.
        static func quarantined(_ queue: DataQueue, limit: Int = 100_000) async throws -> [QueuedItem] {
            try await queue.items(state: .parked, limit: limit).filter {
                $0.lastError?.hasPrefix(DataQueue.quarantinePrefix) == true
            }
        }

        /// Why an item is quarantined: its last error after the quarantine prefix.
        static func reason(_ item: QueuedItem) -> String? {
            item.lastError.map { String($0.dropFirst(DataQueue.quarantinePrefix.count)) }
        }

        /// The quarantined item `reference` names; a parked item of another kind is not one.
        static func quarantinedItem(_ queue: DataQueue, _ reference: String) async throws -> (QueuedItem, Data) {
            let (item, body) = try await queue.item(reference)
            guard item.state == .parked, item.lastError?.hasPrefix(DataQueue.quarantinePrefix) == true else {
                throw DataQueueError(.notFound, "item \(item.id.uuidString.lowercased()) is not quarantined (see dq show)")
            }
            return (item, body)
        }

        struct List: AsyncParsableCommand {
            static let configuration = CommandConfiguration(commandName: "list", abstract: "List quarantined envelopes in order.")
            @OptionGroup var queueOptions: QueueOptions
            @Flag(help: "Print as JSON.") var json = false

            func run() async throws {
                try await withQueue(queueOptions, readOnly: true) { queue in
                    let items = try await quarantined(queue)
                    if json { try printJSON(items); return }
                    if items.isEmpty { print("no quarantined envelopes"); return }
                    print("SEQ\tID\tENQUEUED\tCLIENT\tREASON")
                    for item in items {
                        let reason = Quarantine.reason(item) ?? "-"
                        print(
                            "\(item.sequence)\t\(item.id.uuidString.lowercased())\t\(formatDate(item.enqueuedAt))\t\(item.clientID ?? "-")\t\(reason)"
                        )
                    }
                }
            }
        }

        struct Show: AsyncParsableCommand {
            static let configuration = CommandConfiguration(
                commandName: "show", abstract: "Show one quarantined envelope: why, when, its key id and version (never its content).")
            @OptionGroup var queueOptions: QueueOptions
            @Argument(help: "The item's id, a unique prefix or suffix of it, or its sequence number (#N).") var id: String
            @Flag(help: "Print as JSON.") var json = false

            struct Shown: Encodable {
                var item: QueuedItem
                var reason: String
                var keyID: String?
                var version: String?
            }

            func run() async throws {
                try await withQueue(queueOptions, readOnly: true) { queue in
                    let (item, body) = try await quarantinedItem(queue, id)
                    let envelope = (try? JSONSerialization.jsonObject(with: body)) as? [String: Any]
                    let shown = Shown(
                        item: item, reason: Quarantine.reason(item) ?? "",
                        keyID: envelope?["key_id"] as? String, version: envelope?["version"] as? String)
                    if json { try printJSON(shown); return }
                    print("id:        \(item.id.uuidString.lowercased())")
                    print("sequence:  \(item.sequence)")
                    print("enqueued:  \(formatDate(item.enqueuedAt))")
                    print("reason:    \(shown.reason)")
                    print("key_id:    \(shown.keyID.map { $0.isEmpty ? "(empty: the default key)" : $0 } ?? "-")")
                    print("version:   \(shown.version ?? "-")")
                    print("size:      \(item.size) bytes")
                }
            }
        }

        /// Which quarantined items a bulk action takes: every one, or those matching each filter given.
        struct Selection: ParsableArguments {
            @Argument(help: "The item's id, a unique prefix or suffix of it, or its sequence number (#N).") var id: String?
            @Flag(help: "Every quarantined envelope (with the filters below, every one that matches them).") var all = false
            @Option(help: "Those whose reason contains this text (e.g. \"unknown_key\", \"key_id k2\", \"write policy\").")
            var reason: String?
            @Option(help: "Those the client with this id sent.") var client: String?
            @Option(help: "Those enqueued more than this many days ago.") var olderThanDays: Double?

            var filtered: Bool { all || reason != nil || client != nil || olderThanDays != nil }

            func validate() throws {
                if (id == nil) == !filtered {
                    throw ValidationError("give an item id, or --all, --reason, --client or --older-than-days (not both)")
                }
                if let days = olderThanDays, !(days >= 0) { throw ValidationError("--older-than-days must be 0 or more") }
            }

            /// The quarantined items selected, in order.
            func items(_ queue: DataQueue) async throws -> [QueuedItem] {
                guard filtered else { return [try await quarantinedItem(queue, id ?? "").0] }
                let cutoff = olderThanDays.map { Date().addingTimeInterval(-$0 * 86_400) }
                return try await quarantined(queue).filter { item in
                    (reason.map { Quarantine.reason(item)?.contains($0) == true } ?? true)
                        && (client.map { item.clientID == $0 } ?? true) && (cutoff.map { item.enqueuedAt < $0 } ?? true)
                }
            }
        }

        struct Replay: AsyncParsableCommand {
            static let configuration = CommandConfiguration(
                commandName: "replay",
                abstract: "Put quarantined envelopes back in line (after adding the missing key): the next flush opens them.")
            @OptionGroup var queueOptions: QueueOptions
            @OptionGroup var selection: Selection
            @Flag(help: "Print what was put back as JSON.") var json = false

            func run() async throws {
                try await withQueue(queueOptions) { queue in
                    let items = try await selection.items(queue)
                    for item in items { _ = try await queue.retry("#\(item.sequence)", conditionalCreate: nil) }
                    let names = items.map { $0.id.uuidString.lowercased() }
                    if json {
                        try printJSON(["replayed": names])
                    } else {
                        print("\(names.count) quarantined envelope(s) back in line")
                    }
                }
            }
        }

        struct Drop: AsyncParsableCommand {
            static let configuration = CommandConfiguration(
                commandName: "drop",
                abstract: "Remove quarantined envelopes without sending them (each recorded in the journal).",
                discussion: """
                    One by id, or all that match --all, --reason, --client and --older-than-days in one run. The space \
                    they held is reused by the database; --vacuum also gives it back to the file system (SQLite's \
                    VACUUM: it needs room for a copy of the file, and waits for a running dq serve's writes).
                    """)
            @OptionGroup var queueOptions: QueueOptions
            @OptionGroup var selection: Selection
            @Flag(help: "Give the space back to the file system afterwards (SQLite VACUUM; nothing to do on PostgreSQL).")
            var vacuum = false
            @Flag(help: "Print the dropped items as JSON.") var json = false

            func run() async throws {
                try await withQueue(queueOptions) { queue in
                    let items = try await selection.items(queue)
                    var dropped: [String] = []
                    for item in items {
                        _ = try await queue.drop("#\(item.sequence)")
                        dropped.append(item.id.uuidString.lowercased())
                    }
                    if vacuum && !dropped.isEmpty { try await queue.vacuum() }
                    if json {
                        if selection.filtered {
                            try printJSON(["dropped": dropped])
                        } else {
                            try printJSON(["dropped": dropped.first ?? ""])
                        }
                    } else if selection.filtered {
                        print("dropped \(dropped.count) quarantined envelope(s)" + (vacuum && !dropped.isEmpty ? "; space given back" : ""))
                    } else {
                        print("dropped quarantined envelope \(dropped.first ?? "")")
                    }
                }
            }
        }
    }
}
