#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

extension DataQueue {
    /// How hard an enqueue works to survive a power loss.
    public enum Durability: String, Sendable, Codable, CaseIterable {
        /// `synchronous=FULL`: an enqueue returns after the commit reached the disk (survives power loss).
        case full
        /// `synchronous=NORMAL`: survives a crash of dq, but the last commits may be lost on power loss.
        /// Several times faster per single enqueue.
        case normal
    }
}

/// Counts of a queue, for `dq status`.
public struct QueueStatus: Sendable, Codable, Hashable {
    /// The queue (server base URL).
    public let queue: String
    /// Items waiting to be sent.
    public let pending: Int
    /// Items permanently rejected, waiting for an operator.
    public let parked: Int
    /// Items in the delivery journal.
    public let delivered: Int
    /// When the oldest pending item was enqueued.
    public let oldestPendingAt: Date?
    /// Consecutive failed flush attempts against this server.
    public let consecutiveFailures: Int
    /// Until when flushes back off (unless forced).
    public let nextAttemptAt: Date?
    /// A PHI-free description of the last failure.
    public let lastError: String?
    /// When the journal last recorded a delivery of this queue (by any process).
    public let lastDeliveryAt: Date?
    /// A receiver's items journaled as duplicates: repeats of a resource delivered before, not sent again.
    public let duplicates: Int
    /// Deliveries that may have put a second copy on the server: items sent again after a stop while they (or
    /// their journal line) were on the way, with no condition that lets the server recognise them (the journal's
    /// note begins ``DeliveryRecord/possibleDuplicateNote``).
    public let possibleDuplicates: Int

    /// Creates a status from its counts.
    public init(
        queue: String, pending: Int, parked: Int, delivered: Int, oldestPendingAt: Date?, consecutiveFailures: Int,
        nextAttemptAt: Date?, lastError: String?, lastDeliveryAt: Date? = nil, duplicates: Int = 0, possibleDuplicates: Int = 0
    ) {
        self.lastDeliveryAt = lastDeliveryAt
        self.duplicates = duplicates
        self.possibleDuplicates = possibleDuplicates
        self.queue = queue
        self.pending = pending
        self.parked = parked
        self.delivered = delivered
        self.oldestPendingAt = oldestPendingAt
        self.consecutiveFailures = consecutiveFailures
        self.nextAttemptAt = nextAttemptAt
        self.lastError = lastError
    }
}

extension DataQueue {
    /// What a server's CapabilityStatement declared when dq last read it.
    public struct ServerCapabilities: Sendable, Codable, Hashable {
        /// Whether it takes transaction Bundles; nil when not read yet.
        public var transactions: Bool?
        /// The resource types whose conditional create (`If-None-Exist`) it declares, sorted; nil when not read yet.
        public var conditionalCreate: [String]?
        /// Those of ``conditionalCreate`` whose `_source` search it declares too, sorted: a receiver's creates of
        /// them are conditioned on the `meta.source` naming their queue item (exactly once without touching content).
        public var sourceSearch: [String]?
        /// When it was read.
        public var readAt: Date?

        /// Nothing read yet.
        public init(
            transactions: Bool? = nil, conditionalCreate: [String]? = nil, sourceSearch: [String]? = nil, readAt: Date? = nil
        ) {
            self.transactions = transactions
            self.conditionalCreate = conditionalCreate
            self.sourceSearch = sourceSearch
            self.readAt = readAt
        }
    }
}
