import NIOConcurrencyHelpers

/// Seams that let a test force an interleaving that timing alone would make rare. Inert unless set.
final class TestHooks: Sendable {
    private let journalCommit = NIOLockedValueBox<(@Sendable () -> Void)?>(nil)
    private let envelopeOpening = NIOLockedValueBox<(@Sendable () -> Void)?>(nil)
    private let journalCounting = NIOLockedValueBox<(@Sendable () -> Void)?>(nil)

    /// Runs (on a thread of its own) before each commit of deliveries (e.g. a sleep, to make the
    /// commit late).
    var beforeJournalCommit: (@Sendable () -> Void)? {
        get { journalCommit.withLockedValue { $0 } }
        set { journalCommit.withLockedValue { $0 = newValue } }
    }

    /// Runs each time the queue's status counts the delivery journal (a read as long as the journal).
    var countingJournal: (@Sendable () -> Void)? {
        get { journalCounting.withLockedValue { $0 } }
        set { journalCounting.withLockedValue { $0 = newValue } }
    }

    /// Runs on the thread that opens an envelope, before it opens it (e.g. to read that thread's priority).
    var openingEnvelope: (@Sendable () -> Void)? {
        get { envelopeOpening.withLockedValue { $0 } }
        set { envelopeOpening.withLockedValue { $0 = newValue } }
    }
}
