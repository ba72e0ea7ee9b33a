/// The SQL that reads a SQLite queue's status.
enum StatusQueries {
    /// Pending items of a queue (`?` = the queue).
    static let pending = "SELECT count(*) FROM item WHERE queue = ? AND state = 'pending'"
    /// Parked items of a queue.
    static let parked = "SELECT count(*) FROM item WHERE queue = ? AND state = 'parked'"
    /// Journal lines of a queue that count as delivered.
    static let delivered = "SELECT count(*) FROM delivery WHERE queue = ? AND event IN ('delivered', 'already-present')"
    /// Journal lines of a queue that are a receiver's duplicates (not sent).
    static let duplicates = "SELECT count(*) FROM delivery WHERE queue = ? AND event = 'duplicate'"
    /// The first row of a queue in a state dq does not know (a damaged or edited row): `seq, state`.
    static let damaged = "SELECT seq, state FROM item WHERE queue = ? AND state NOT IN ('pending', 'parked') LIMIT 1"
    /// When the oldest pending item of a queue was enqueued.
    static let oldestPending = "SELECT enqueued_at FROM item WHERE queue = ? AND state = 'pending' ORDER BY seq LIMIT 1"
    /// When the newest delivery of a queue was journaled.
    static let lastDelivery =
        "SELECT at FROM delivery WHERE queue = ? AND event IN ('delivered', 'already-present') ORDER BY seq DESC LIMIT 1"
    /// A queue's backoff state: `failures, next_attempt_at, last_error`.
    static let serverState = "SELECT failures, next_attempt_at, last_error FROM server_state WHERE queue = ?"
    /// Every queue name that holds items, deliveries or a backoff state, in order.
    static let queues =
        "SELECT queue FROM item UNION SELECT queue FROM delivery UNION SELECT queue FROM server_state ORDER BY 1"
}
