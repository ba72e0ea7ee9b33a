import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOSSL
import PostgresNIO

/// The commit of a statement run outside a transaction block was not confirmed: the connection closed
/// before the server said it was ready for the next query (see ``PostgresNIO/PostgresConnection/confirmCommit(logger:)``).
struct CommitNotConfirmed: Error {}

extension PostgresConnection {
    /// Returns once the server has committed the statement just run on this connection outside a
    /// transaction block, and throws if it did not.
    ///
    /// postgres-nio ends a statement's rows at its CommandComplete message, and for a statement outside
    /// `BEGIN`/`COMMIT` the server sends that *before* it commits: the commit, and a synchronous standby's
    /// acknowledgement of it, come at the protocol's Sync, answered by ReadyForQuery. A commit that fails
    /// then (a deferred constraint), or a server stopped while it waits for its standby (it flushes the
    /// CommandComplete it holds as it dies), would look like success: an enqueue reported as stored could
    /// be missing after a failover. The next query on a connection runs only after that ReadyForQuery, and
    /// an error or a lost connection before it fails the query, so one `SELECT 1` settles it. (A `COMMIT`
    /// statement needs none of this: the server commits before it answers.)
    ///
    /// postgres-nio never answers a query written to a connection that has just closed (it drops the write),
    /// so the close is watched too: it fails the confirmation, which can then no longer come.
    func confirmCommit(logger: Logger) async throws {
        if isClosed { throw CommitNotConfirmed() }
        let race = DeadlineRace<Void>()
        try await withCheckedThrowingContinuation { continuation in
            race.continuation.withLockedValue { $0 = continuation }
            // The watcher is in place before the query starts, so that the query's end always cancels it.
            race.timer.withLockedValue {
                $0 = Task {
                    while true {
                        try await Task.sleep(for: .milliseconds(20))
                        if self.isClosed { return race.finish(.failure(CommitNotConfirmed())) }
                    }
                }
            }
            Task {
                do {
                    _ = try await self.query("SELECT 1", logger: logger).collect()
                    race.finish(.success(()))
                } catch {
                    race.finish(.failure(error))
                }
            }
        }
    }
}

/// When PostgreSQL last answered within one operation (see ``PostgresQueueStore/answered()``).
final class AnswerClock: Sendable {
    private let instant: NIOLockedValueBox<ContinuousClock.Instant>

    init(start: ContinuousClock.Instant = .now) { instant = NIOLockedValueBox(start) }

    var last: ContinuousClock.Instant { instant.withLockedValue { $0 } }

    func touch(at now: ContinuousClock.Instant = .now) { instant.withLockedValue { $0 = max($0, now) } }

    /// When the operation's time runs out if no answer comes before: `limit` after the last answer, or nil
    /// when that time has passed at `now`.
    func due(limit: Duration, now: ContinuousClock.Instant = .now) -> ContinuousClock.Instant? {
        let due = last + limit
        return due > now ? due : nil
    }
}

/// The one continuation of ``PostgresQueueStore/withDeadline(seconds:what:_:)`` (and of
/// ``PostgresNIO/PostgresConnection/confirmCommit(logger:)``): the first result wins.
final class DeadlineRace<T: Sendable>: Sendable {
    let continuation = NIOLockedValueBox<CheckedContinuation<T, any Error>?>(nil)
    /// The deadline's timer, cancelled when the work finishes first (so that no sleeping task outlives it).
    let timer = NIOLockedValueBox<Task<Void, any Error>?>(nil)
    /// The work the deadline watches (``PostgresQueueStore/withDeadline(seconds:what:_:)``), cancelled when the
    /// deadline passes first.
    let work = NIOLockedValueBox<Task<Void, Never>?>(nil)

    func finish(_ result: Result<T, any Error>) {
        guard let continuation = continuation.withLockedValue({ $0.take() }) else { return }
        timer.withLockedValue { $0.take() }?.cancel()
        continuation.resume(with: result)
    }
}
