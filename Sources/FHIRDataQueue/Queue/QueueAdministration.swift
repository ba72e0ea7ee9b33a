import Foundation
import Logging

/// What the command line does with a queue database as a whole, without naming a server: every queue's counts,
/// an integrity check, a migration from SQLite to PostgreSQL. Each opens the database itself (read-only where it
/// only reads) and closes it.
package enum QueueAdministration {
    /// Every queue in the database at `databasePath` with its counts, read without naming a server: the
    /// database is opened read-only and nothing is created.
    /// - Throws: ``DataQueueError`` with `.storage` when there is no queue database there.
    package static func allQueueStatuses(databasePath: String) async throws -> [QueueStatus] {
        try await withReadOnlyStore(databasePath) { try await $0.allStatuses(countingJournal: true) }
    }

    /// Runs `body` on the store of `databasePath` opened read-only, then closes it.
    private static func withReadOnlyStore<T: Sendable>(
        _ databasePath: String, _ body: (any QueueStorage) async throws -> T
    ) async throws -> T {
        let store = try DataQueue.Storage(databasePath).open(durability: .full, readOnly: true, logger: nil)
        do {
            let result = try await body(store)
            await store.shutdown()
            return result
        } catch {
            await store.shutdown()
            throw error
        }
    }

    /// What ``migrate(from:to:lockWait:logger:)`` moved.
    package struct MigrationReport: Sendable, Encodable {
        /// Items added to PostgreSQL (pending and parked).
        package var items = 0
        /// Of them, pending.
        package var pending = 0
        /// Of them, parked.
        package var parked = 0
        /// Items already in PostgreSQL (a migration run again): removed from SQLite, not added twice.
        package var alreadyThere = 0
        /// Journal lines added.
        package var journalLines = 0
        /// Items that arrived in SQLite while the migration ran and stay there (producers still running).
        package var leftBehind = 0
    }

    /// Moves a SQLite queue into PostgreSQL, in order: the journal first (so that references to resources
    /// delivered earlier still resolve), then every item with its state, attempts and last answer, in
    /// batches; each batch is committed in PostgreSQL before it is removed from SQLite, and an item already
    /// there is not added twice, so a migration that stopped half-way can be run again. Every queue's flush
    /// lock is held meanwhile, so nothing is sent from the SQLite file while its items move.
    ///
    /// - Parameter progress: told after each batch how many items moved so far, and how many there were.
    /// - Throws: ``DataQueueError``: `.busy` when a flush of the SQLite queue runs longer than `lockWait`,
    ///   `.invalidConfiguration` for a source that is not a SQLite file or a target that is not PostgreSQL.
    package static func migrate(
        from path: String, to url: String, lockWait: TimeInterval = 10, logger: Logger,
        progress: (@Sendable (_ moved: Int, _ total: Int) -> Void)? = nil
    ) async throws -> MigrationReport {
        guard !PostgresQueueStore.isURL(path) else {
            throw DataQueueError(.invalidConfiguration, "dq migrate moves a SQLite queue; the configured database is PostgreSQL already")
        }
        guard PostgresQueueStore.isURL(url) else {
            throw DataQueueError(.invalidConfiguration, "the migration target must be a postgres:// URL")
        }
        guard FileManager.default.fileExists(atPath: path) else {
            throw DataQueueError(.storage, "no queue database at \(path): nothing to migrate")
        }
        let source = try SQLiteQueueStore(path: path, durability: .full)
        let target = try PostgresQueueStore(url: url, logger: logger)
        var locks: [any FlushOwnership] = []
        func releaseAll() async {
            for lock in locks { await lock.release() }
            await target.shutdown()
        }
        do {
            for queue in try await source.queues() {
                guard let lock = try await source.acquireFlush(queue: queue, until: .now + .milliseconds(Int64(lockWait * 1000))) else {
                    throw DataQueueError(.busy, "a flush of \(queue) is running; stop dq run and cron flushes, then migrate")
                }
                locks.append(lock)
            }
            // A sealed queue stays sealed: its items move as they are, with the keys that open them. Not into a
            // queue sealed on its own: that one refuses plain items, and its index key (see ``Sealer``) is not this
            // queue's, so the fullUrls of the items moved in would not be found. Its keys came from this queue
            // only when they are these very records (a migration run again).
            let sealKeys = try await source.sealKeys()
            let targetKeys = try await target.sealKeys()
            if !targetKeys.allSatisfy(sealKeys.contains) {
                throw DataQueueError(
                    .invalidConfiguration,
                    "the target queue is sealed at rest already (key \(targetKeys.map(\.id).joined(separator: ", "))): dq migrate "
                        + "moves a queue into a PostgreSQL queue that is not sealed (or one it moved this queue into before); "
                        + "nothing was moved")
            }
            for record in sealKeys { try await target.addSealKey(record) }
            var report = MigrationReport()
            let journal = try await source.deliveries(queue: nil, limit: Int(Int32.max))
            for start in stride(from: 0, to: journal.count, by: 1000) {
                report.journalLines += try await target.importJournal(Array(journal[start..<min(start + 1000, journal.count)]))
            }
            var total = 0
            for queue in try await source.queues() {
                let status = try await source.status(queue: queue, countingJournal: false)
                total += status.pending + status.parked
            }
            var after: Int64 = 0
            while true {
                let batch = try await source.exportBatch(after: after, limit: 500)
                guard let last = batch.last else { break }
                let added = try await target.importItems(batch)
                try await source.deleteMoved(batch.map(\.info.sequence))
                report.items += added
                report.alreadyThere += batch.count - added
                report.pending += batch.filter { $0.info.state == .pending }.count
                report.parked += batch.filter { $0.info.state == .parked }.count
                after = last.info.sequence
                logger.info("moved items", metadata: ["through": "\(after)", "total": "\(report.items)"])
                progress?(report.items + report.alreadyThere, max(total, report.items + report.alreadyThere))
            }
            report.leftBehind = try await source.exportBatch(after: 0, limit: Int(Int32.max)).count
            await releaseAll()
            return report
        } catch {
            await releaseAll()
            throw error
        }
    }

    /// `databasePath` as it may be shown: a PostgreSQL URL without its password.
    package static func displayDatabase(_ databasePath: String) -> String {
        QueuePaths.displayDatabase(databasePath)
    }

    /// Checks the database at `databasePath`, opened read-only: SQLite's `PRAGMA integrity_check`, or for
    /// PostgreSQL (which checks its own pages) that every row is in a state dq knows. `["ok"]` when it is
    /// sound, else the problems found.
    /// - Throws: ``DataQueueError`` with `.storage` when there is no queue database there or it cannot be read.
    package static func integrityCheck(databasePath: String) async throws -> [String] {
        do {
            return try await withReadOnlyStore(databasePath) { try await $0.integrityCheck() }
        } catch let error as DataQueueError where error.code == .damaged {
            // Damage that stops the file from opening (its schema pages) is a finding too.
            return [error.message.replacingOccurrences(of: SQLiteQueueStore.doctorHint, with: "")]
        }
    }

    /// Whether SQLite can still read a damaged queue file's schema: without it no SQLite tool can name the
    /// tables, and a dump recovers nothing. Always true for PostgreSQL.
    package static func schemaIsReadable(databasePath: String) -> Bool {
        if QueuePaths.isPostgresURL(databasePath) { return true }
        return SQLiteQueueStore.schemaIsReadable(path: databasePath)
    }
}
