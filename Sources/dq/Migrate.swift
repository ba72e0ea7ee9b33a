import ArgumentParser
import FHIRDataQueue
import Foundation
import Logging

extension DQ {
    struct Migrate: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "migrate",
            abstract: "Move the SQLite queue into PostgreSQL, in order (for a deployment that grows to several instances).",
            discussion: """
                Stop the producers, dq run and cron flushes that use the SQLite queue first. The journal is copied, then \
                every item (pending and parked, with its attempts and last answer), in order; each batch is committed in \
                PostgreSQL before it leaves the SQLite file, so a migration that stopped can be run again. Then set \
                "database" to the PostgreSQL URL. The password comes from PGPASSWORD (a URL on the command line shows in ps).
                """)
        @OptionGroup var queueOptions: QueueOptions
        @Option(help: "The PostgreSQL database: postgres://user@host[:port]/database[?sslmode=...].") var to: String
        @Flag(help: "Print the counts as JSON.") var json = false

        func run() async throws {
            do {
                let (settings, daemon) = try await DaemonSettings.load(options: queueOptions)
                try bootstrapLogging(queueOptions, daemon)
                let logger = Logger(label: "dq")
                warnAboutCommandLineSecrets(database: to, proxy: nil, flag: "--to")
                let source = settings.database ?? DataQueue.defaultDatabasePath()
                let display = TerminalProgress("moved", enabled: !json)
                let report = try await QueueAdministration.migrate(from: source, to: settings.withDatabasePassword(to), logger: logger) {
                    moved, total in
                    display?.update(moved, of: total)
                }
                display?.finish()
                if json {
                    try printJSON(report)
                } else {
                    print(
                        "moved \(report.items) item(s) (\(report.pending) pending, \(report.parked) parked) and "
                            + "\(report.journalLines) journal line(s) from \(source) to \(QueueAdministration.displayDatabase(to))")
                    if report.alreadyThere > 0 {
                        print("\(report.alreadyThere) item(s) were there already (an earlier run) and were not added again")
                    }
                    print("next: set \"database\" to the PostgreSQL URL (or DQ_DATABASE) for every instance")
                }
                if report.leftBehind > 0 {
                    printError(
                        "dq: \(report.leftBehind) item(s) were queued in SQLite while migrating; stop the producers and run dq migrate again"
                    )
                    throw ExitCode(Exit.temporaryFailure)
                }
            } catch let error as DataQueueError {
                printError("dq: \(error.message)")
                throw ExitCode(Exit.code(for: error))
            }
        }
    }
}
