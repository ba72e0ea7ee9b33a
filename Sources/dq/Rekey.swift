import ArgumentParser
import FHIRDataQueue
import Foundation
import Logging

extension DQ {
    struct Rekey: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "rekey",
            abstract: "Seal every queued item under a new at-rest key (or the configured one), while dq run goes on.",
            discussion: """
                With --to, FILE becomes the key that seals, and the configured "at_rest.key_file" and \
                "at_rest.old_key_files" open what is sealed now; without --to, items are sealed again under the \
                configured key. Items are sealed in batches while producers and flushes go on. Old keys that seal \
                nothing any more are named: they can leave "old_key_files". Set \
                "key_file" to the new key and move the old one to "old_key_files" (and reload dq run with SIGHUP), \
                first, so that what producers seal next is sealed under the new key too.
                """)
        @OptionGroup var queueOptions: QueueOptions
        @Option(help: "The new at-rest key file (made with dq keygen --at-rest).") var to: String?
        @Flag(help: "Print the result as JSON.") var json = false

        func run() async throws {
            try await withQueue(
                queueOptions,
                adjust: { settings in
                    guard let to else { return }
                    let path = to.hasPrefix("/") ? to : FileManager.default.currentDirectoryPath + "/" + to
                    // The flag's own file is named when it is the one that cannot be read or is no key.
                    _ = try AtRestKey(contentsOfFile: path, setting: "--to")
                    guard let current = settings.atRest?.keyFile else {
                        throw DataQueueError(
                            .invalidConfiguration, "configuration: \"at_rest.key_file\" is not set: the queue's key is needed to open it")
                    }
                    var atRest = settings.atRest ?? DataQueueSettings.AtRest()
                    atRest.oldKeyFiles = [current] + (atRest.oldKeyFiles ?? [])
                    atRest.keyFile = path
                    settings.atRest = atRest
                }
            ) { queue, _ in
                // On a terminal one rewritten line; in a log, a line per batch (each says how far it got).
                let display = TerminalProgress("resealed", enabled: !json)
                let report = try await queue.rekey { done in
                    if let display {
                        display.update(done, of: nil)
                    } else if !json {
                        printError("dq: sealed \(done) item(s) under the new key so far", level: .info)
                    }
                }
                display?.finish()
                if json { try printJSON(report); return }
                print("resealed \(report.resealed) item(s)")
                for (key, count) in report.summary.items.sorted(by: { $0.key < $1.key }) {
                    print("key \(key): \(count) item(s)")
                }
                for key in report.unused {
                    print("key \(key) seals no item any more: it can leave \"at_rest.old_key_files\"")
                }
            }
        }
    }
}
