import ArgumentParser
import FHIRDataQueue
import Foundation

extension DQ {
    struct Prune: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "prune",
            abstract: "Delete old delivery journal lines (never a queued item); --vacuum gives the space back.",
            discussion: """
                dq run and dq flush already apply "journal_retention_days" (90 by default). This is the one-off: \
                dq prune --journal-older-than 30d. Past the retention, dq show and dq log no longer find those \
                deliveries, and references to a delivered item's fullUrl no longer resolve.
                """)
        @OptionGroup var queueOptions: QueueOptions
        @Option(help: "Delete journal lines older than this (90s, 15m, 2h, 30d).") var journalOlderThan: String
        @Flag(help: "Then give the freed space back to the file system (SQLite VACUUM; needs room for a copy of the file).")
        var vacuum = false
        @Flag(help: "Print as JSON.") var json = false

        func validate() throws {
            guard parseDuration(journalOlderThan) != nil else {
                throw ValidationError("--journal-older-than must be a duration like 90s, 15m, 2h or 30d")
            }
        }

        func run() async throws {
            let age = parseDuration(journalOlderThan) ?? 0
            try await withQueue(queueOptions) { queue in
                let display = TerminalProgress("pruned", enabled: !json)
                let removed = try await queue.pruneJournal(olderThan: age) { done in display?.update(done, of: nil) }
                // The last count, whatever the redraw limit skipped: the line ends at what was deleted.
                display?.update(removed, of: removed)
                display?.finish()
                if vacuum { try await queue.vacuum() }
                if json {
                    struct Pruned: Encodable { var journalLines: Int; var vacuumed: Bool }
                    try printJSON(Pruned(journalLines: removed, vacuumed: vacuum))
                } else {
                    print("pruned \(removed) journal line(s) older than \(journalOlderThan)\(vacuum ? "; vacuumed" : "")")
                }
            }
        }
    }
}
