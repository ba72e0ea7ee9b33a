import Synchronization

/// Seams that let a test force an interleaving that timing alone would make rare. Inert unless set.
final class TestHooks: Sendable {
    private let journalCommit = Mutex<(@Sendable () -> Void)?>(nil)

    /// Runs (on a thread of its own) before each commit of deliveries (e.g. a sleep, to make the
    /// commit late).
    var beforeJournalCommit: (@Sendable () -> Void)? {
        get { journalCommit.withLock { $0 } }
        set { journalCommit.withLock { $0 = newValue } }
    }
}
