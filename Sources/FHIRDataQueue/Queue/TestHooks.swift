import Synchronization

/// Seams that let a test force an interleaving that timing alone would make rare. Inert unless set.
final class TestHooks: Sendable {
    private let journalCommit = Mutex<(@Sendable () -> Void)?>(nil)
    private let envelopeOpening = Mutex<(@Sendable () -> Void)?>(nil)
    private let journalCounting = Mutex<(@Sendable () -> Void)?>(nil)

    /// Runs (on a thread of its own) before each commit of deliveries (e.g. a sleep, to make the
    /// commit late).
    var beforeJournalCommit: (@Sendable () -> Void)? {
        get { journalCommit.withLock { $0 } }
        set { journalCommit.withLock { $0 = newValue } }
    }

    /// Runs each time the queue's status counts the delivery journal (a read as long as the journal).
    var countingJournal: (@Sendable () -> Void)? {
        get { journalCounting.withLock { $0 } }
        set { journalCounting.withLock { $0 = newValue } }
    }

    /// Runs on the thread that opens an envelope, before it opens it (e.g. to read that thread's priority).
    var openingEnvelope: (@Sendable () -> Void)? {
        get { envelopeOpening.withLock { $0 } }
        set { envelopeOpening.withLock { $0 = newValue } }
    }
}
