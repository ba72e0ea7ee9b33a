import NIOConcurrencyHelpers

/// Seams that let a test force an interleaving that timing alone would make rare. Inert unless set.
final class TestHooks: Sendable {
    private let journalCommit = NIOLockedValueBox<(@Sendable () -> Void)?>(nil)

    /// Runs on the journal's writer thread before each commit of deliveries (e.g. a sleep, to make the
    /// commit late).
    var beforeJournalCommit: (@Sendable () -> Void)? {
        get { journalCommit.withLockedValue { $0 } }
        set { journalCommit.withLockedValue { $0 = newValue } }
    }
}
