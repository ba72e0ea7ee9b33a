import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

/// Records deliveries in the journal in the background while the flush sends the next items, grouping the
/// deliveries that wait into one commit (``GroupCommit``), so the flush is not held to one fsync per item.
///
/// ``record(_:)`` only appends under a lock, so the flush loop does not wait for the journal. A commit that
/// fails stops the recording: the deliveries it carried and every one recorded after are kept, in order, for
/// ``takeUnrecorded()`` (the server has them; they must be journaled before anything more is sent).
final class DeliveryRecorder: Sendable {
    private let engine: GroupCommit<CompletedDelivery, Void>

    /// - Parameter beforeCommit: a test seam run before each commit.
    init(store: any QueueStorage, owner: any FlushOwnership, beforeCommit: (@Sendable () -> Void)? = nil) {
        engine = GroupCommit(
            maximumBatch: .max, stopsAtFailure: true,
            committer: .async { deliveries in
                // The seam may block (a sleep): on a thread of its own, so that the flush goes on meanwhile.
                if let beforeCommit { _ = try? await OwnThread.run("dq-test-seam") { beforeCommit() } }
                return await store.markDelivered(deliveries, owner: owner).map { _ in deliveries.map { _ in () } }
            })
    }

    /// How many deliveries wait for their commit.
    var backlog: Int { engine.waitingCount }

    /// Queues a delivery for the journal; throws the error of an earlier failed commit (the delivery is then
    /// kept among the unrecorded ones: the server has it).
    func record(_ delivery: CompletedDelivery) throws {
        append(delivery)
        try check()
    }

    /// Throws the error of a failed commit, if one failed.
    func check() throws {
        if let failure = engine.stoppedBy { throw failure }
    }

    /// Queues a delivery for the journal and never drops it: after a failed commit it waits among the
    /// unrecorded ones (``takeUnrecorded()``), so that a loop over several accepted deliveries (a Bundle's
    /// entries) keeps them all; ``check()`` after the loop says whether to stop.
    func append(_ delivery: CompletedDelivery) {
        engine.add(delivery)
    }

    /// After a failed commit: every delivery that did not reach the journal, in order (none otherwise).
    func takeUnrecorded() -> [CompletedDelivery] {
        engine.takeHeld()
    }

    /// Waits until every recorded delivery is committed; throws the first commit error.
    func finish() async throws {
        await engine.waitUntilIdle()
        try check()
    }
}
