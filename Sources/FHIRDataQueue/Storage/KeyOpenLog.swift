import Foundation

/// How many envelopes each receiver key opened per day, kept in the queue's database (table `dq_key_opens`) so that
/// `dq serve keys` can show an operator, across restarts and across receivers sharing one PostgreSQL database,
/// when a key stopped being used and can be retired.
///
/// A day is a UTC day, numbered from 1970-01-01 (``keyOpenDay(of:)``). A flush adds the counts of each batch it opened in
/// one write; an envelope opened again (sent again after a failure, replayed from quarantine) counts again.
package protocol KeyOpenLog: Sendable {
    /// Adds `counts` (key id to envelopes opened) to the day's counts.
    ///
    /// - Throws: ``DataQueueError`` (`.storage`) when the database fails; then nothing is added.
    func addKeyOpens(_ counts: [String: Int], day: Int) async throws

    /// The counts of the days from `firstDay` on: key id to day to envelopes opened.
    func keyOpens(since firstDay: Int) async throws -> [String: [Int: Int]]
}

/// The UTC day of `date`, in days since 1970-01-01 (the day of a ``KeyOpenLog`` row).
package func keyOpenDay(of date: Date) -> Int {
    Int((date.timeIntervalSince1970 / 86_400).rounded(.down))
}

/// The key-open log of a store, if it keeps one (the sealing wrapper leaves the counts alone: they are not PHI).
func keyOpenLog(of store: any QueueStorage) -> (any KeyOpenLog)? {
    ((store as? SealedStorage)?.inner ?? store) as? any KeyOpenLog
}

extension DataQueue {
    /// The envelopes opened per key and day, in this queue's own database (nil for a store that keeps none).
    package var keyOpenLog: (any KeyOpenLog)? { FHIRDataQueue.keyOpenLog(of: store) }
}
