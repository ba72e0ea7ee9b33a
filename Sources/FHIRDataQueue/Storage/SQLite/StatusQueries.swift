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
    /// Deliveries journaled as possible second copies (``DeliveryRecord/possibleDuplicateNote``).
    static let possibleDuplicates =
        "SELECT count(*) FROM delivery WHERE queue = ? AND event = 'delivered' AND note LIKE 'possible duplicate: %'"
    /// The first row of a queue in a state dq does not know (a damaged or edited row): `seq, state`.
    static let damaged = "SELECT seq, state FROM item WHERE queue = ? AND state NOT IN ('pending', 'parked') LIMIT 1"
    /// When the oldest pending item of a queue was enqueued.
    static let oldestPending = "SELECT enqueued_at FROM item WHERE queue = ? AND state = 'pending' ORDER BY seq LIMIT 1"
    /// When the newest delivery of a queue was journaled.
    static let lastDelivery =
        "SELECT at FROM delivery WHERE queue = ? AND event IN ('delivered', 'already-present') ORDER BY seq DESC LIMIT 1"
    /// A queue's backoff state: `failures, next_attempt_at, last_error`.
    static let serverState = "SELECT failures, next_attempt_at, last_error FROM server_state WHERE queue = ?"
    /// Every queue name that holds items, deliveries or a backoff state, in order. The names in `item` and `delivery`
    /// are found by skipping along their `(queue, …)` indexes, one seek per name, not by reading every row: the
    /// journal keeps months of deliveries (a scan took 0.15-0.75 s per million rows).
    static let queues = """
        WITH RECURSIVE items(name) AS (
          SELECT min(queue) FROM item
          UNION ALL SELECT (SELECT min(queue) FROM item WHERE queue > items.name) FROM items WHERE items.name IS NOT NULL
        ), journal(name) AS (
          SELECT min(queue) FROM delivery
          UNION ALL SELECT (SELECT min(queue) FROM delivery WHERE queue > journal.name) FROM journal WHERE journal.name IS NOT NULL
        )
        SELECT name FROM items WHERE name IS NOT NULL UNION SELECT name FROM journal WHERE name IS NOT NULL
        UNION SELECT queue FROM server_state ORDER BY 1
        """
}
