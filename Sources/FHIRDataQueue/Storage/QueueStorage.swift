import Foundation

/// The storage seam of a ``DataQueue``: items in per-server order, the delivery journal, parking, backoff
/// state, and who may flush a server's queue.
///
/// ``SQLiteQueueStore`` (SQLite) is the store dq ships with. The storage conformance tests state each method's
/// contract against `any QueueStorage`, so that another store (a shared database for several instances) can
/// stand behind the seam and be held to the same contract.
///
/// Writes a flusher makes on the outcome of a send (``markDelivered(_:owner:)``, ``park(_:url:status:error:outcome:owner:)``,
/// ``recordFailure(queue:item:status:error:nextAttemptAt:owner:)``) name the ``FlushOwnership`` they act
/// under: a store where ownership can be lost while a flusher still runs (a lease that expired) must refuse
/// them then.
protocol QueueStorage: AnyObject, Sendable {
    /// Throws when the store's file is no longer the one it opened (SQLite: deleted or replaced). The default
    /// does nothing.
    func checkFileIdentity() throws

    // MARK: Enqueue

    /// Stores `items` in one transaction, in order; returns their sequence numbers (per server, rising in
    /// commit order).
    func insert(_ items: [NewItem]) async throws -> [Int64]

    /// Stores one item, committing together with others that arrive meanwhile (group commit); durable when
    /// it returns.
    nonisolated(nonsending) func insertGrouped(_ item: NewItem) async throws -> Int64

    /// Stores `chunks` chunks of items in one transaction, in order, taking each from `take` as it is made
    /// (nil: an input was bad, nothing is stored); refuses a `fullUrl` declared twice or already known, and a
    /// reference to one that is not. A store that can write while later chunks are still being made does so.
    func insert(chunks: Int, take: @escaping @Sendable (Int) -> [NewItem]?) async throws -> [Int64]

    /// What is done to each new item before it is stored (sealing, in a sealed queue), for a bulk enqueue to
    /// run on the threads that make its items rather than on the writer's; nil when items are stored as made.
    /// ``insert(chunks:take:)`` takes items prepared by it (and prepares any that were not).
    func preparation() async throws -> (any ItemPreparation)?

    /// Which of `fullURLs` are already known (queued or delivered).
    func knownFullURLs(_ fullURLs: Set<String>) async throws -> Set<String>

    // MARK: Flushing

    /// The exclusive right to flush (or change) the queue of `queue`, waiting until `deadline`; nil when
    /// another flusher holds it still.
    func acquireFlush(queue: String, until deadline: ContinuousClock.Instant) async throws -> (any FlushOwnership)?

    /// Throws when a row of `queue` is damaged (an unknown state or method), before anything is sent.
    func checkStates(queue: String) async throws

    /// The server's backoff state.
    func serverState(queue: String) async throws -> (failures: Int, nextAttemptAt: Date?, lastError: String?)

    /// The next pending items after sequence `after`, at most `maxCount` and (but for the first) `maxBytes`.
    func pendingBatch(queue: String, after: Int64, maxCount: Int, maxBytes: Int) async throws -> [StoredItem]

    /// Moves delivered items to the journal in one transaction and clears the server's backoff (called by
    /// ``DeliveryRecorder``'s group commit).
    func markDelivered(_ deliveries: [CompletedDelivery], owner: any FlushOwnership) async -> Result<Void, DataQueueError>

    /// Parks an item the server rejected, with its answer, and journals it.
    func park(_ item: QueuedItem, url: String, status: Int?, error: String, outcome: String?, owner: any FlushOwnership)
        async throws

    /// Records a failed attempt: the server's backoff, and the item's attempt count when one was sent.
    func recordFailure(
        queue: String, item: QueuedItem?, status: Int?, error: String, nextAttemptAt: Date?, owner: any FlushOwnership
    ) async throws

    /// What the server was found to support for Bundles.
    func bundleSupport(queue: String) async throws -> BundleSupport

    /// Records what the server supports for Bundles (nil: unchanged).
    func recordBundleSupport(queue: String, transactions: Bool?, batchLimit: Int?, conditionalCreate: Set<String>?) async throws

    /// The server locations of delivered items by their producer `fullUrl`.
    func deliveredLocations(fullURLs: [String]) async throws -> [String: String]

    /// The items among `fullURLs`' newest deliveries whose server did not say where it stored them (no
    /// server id in the journal), by `fullUrl`.
    func unlocatedDeliveries(fullURLs: [String]) async throws -> [String: UUID]

    /// Records where the server stored the delivered item `itemID` (an operator's `dq resolve`), on its newest
    /// delivery line when that line has no server id yet; returns whether a line changed.
    func resolveLocation(itemID: UUID, location: String, serverID: String, versionID: String?, note: String) async throws -> Bool

    // MARK: Operators

    /// Counts and backoff of one server's queue. Without `countingJournal`, `delivered` and `duplicates` read 0 and
    /// the journal is not counted: what a flush's report, a gauge or a readiness probe needs, in a time that does not
    /// grow with the journal (a receiver keeps months of deliveries, and counting them took 0.17 s per million rows
    /// each time).
    func status(queue: String, countingJournal: Bool) async throws -> QueueStatus

    /// Every server with a queue here.
    func queues() async throws -> [String]

    /// Items in order, of one server or all, pending or parked or both.
    func items(queue: String?, state: QueuedItem.State?, limit: Int) async throws -> [QueuedItem]

    /// One item by id, unique prefix or suffix, or sequence.
    func item(_ reference: String) async throws -> StoredItem

    /// Puts a parked item back in line; false when it was not parked.
    func retry(sequence: Int64, conditionalCreate: Bool?) async throws -> Bool

    /// Puts every parked item of `queue` back in line; returns how many.
    func retryAllParked(queue: String) async throws -> Int

    /// Removes an item unsent, journaling it.
    func drop(_ item: QueuedItem, url: String) async throws

    /// The journal line of an item no longer queued.
    func journalLine(_ reference: String) async throws -> DeliveryRecord?

    /// Counts of every server's queue (the journal counted or not, as ``status(queue:countingJournal:)``).
    func allStatuses(countingJournal: Bool) async throws -> [QueueStatus]

    /// Problems an integrity check finds (empty: sound).
    func integrityCheck() async throws -> [String]

    /// The journal: the newest `limit` lines, oldest first.
    func deliveries(queue: String?, limit: Int) async throws -> [DeliveryRecord]

    /// Deletes the journal lines (of every queue) written before `cutoff`, oldest first, in short
    /// transactions; returns how many, and tells `progress` how many so far after each transaction. Lines are
    /// appended in time order, so it stops at the first newer one.
    func pruneJournal(before cutoff: Date, progress: @Sendable (Int) -> Void) async throws -> Int

    /// Gives the space of deleted rows back to the file system. The default does nothing (a database server
    /// that vacuums on its own).
    func vacuum() async throws

    // MARK: Sealing at rest (see ``SealedStorage``)

    /// The seal key table: the at-rest keys items were sealed under (empty: a plain queue).
    func sealKeys() async throws -> [SealKeyRecord]

    /// Adds a seal key (nothing when its id is there).
    func addSealKey(_ record: SealKeyRecord) async throws

    /// Adds the queue's first seal key, only while it has none, atomically with that check; false when another
    /// process recorded one first (under the same key or another).
    func addFirstSealKey(_ record: SealKeyRecord) async throws -> Bool

    /// Makes the store refuse, from now on, every item whose body is not sealed: also those of a process that
    /// opened the queue while it was plain and has no key (its cached view says "plain"). An insert of one fails
    /// with ``DataQueueError/Code/invalidConfiguration`` and queues nothing. Cheap once done (a look-up).
    /// SQLite has nothing to install (each insert of plain items looks at the seal key table in its
    /// transaction); PostgreSQL, where several dq versions may share the tables, gets a trigger.
    func refusePlainItems() async throws

    /// How many items (of every queue) each at-rest key seals, by key id; `""` counts plain items.
    func sealedCounts() async throws -> [String: Int]

    /// Items of every queue after sequence `after`, pending and parked, as stored: at most `limit`.
    func rawItems(after: Int64, limit: Int) async throws -> [StoredItem]

    /// Replaces the stored values of items, each only while its body and outcome are still the expected ones;
    /// returns how many changed.
    func replaceSealed(_ replacements: [SealedReplacement]) async throws -> Int

    /// After items were sealed: removes what the store keeps of their earlier values beyond the rows (SQLite:
    /// the WAL's frames). False when it could not (another connection kept reading throughout). The default
    /// does nothing and returns true.
    @discardableResult
    func scrubAfterSealing() async throws -> Bool

    /// Seals every item under the current at-rest key: those sealed under an older key and any plain one, in
    /// batches, while producers and flushes go on; returns how many were sealed again. A store without at-rest
    /// keys (the default) throws the configuration error that says so.
    func resealUnderCurrentKey(progress: (Int) -> Void) async throws -> Int

    /// Up to `limit` distinct `fullUrl`s of journal lines stored as given (written before the queue was sealed).
    /// Cheap when there are none: a plain fullUrl starts with `urn:` and a keyed hash with `dqx1.`, so every
    /// plain one sorts from `e` on (in any collation), a range of the fullUrl index.
    func plainJournalFullURLs(limit: Int) async throws -> [String]

    /// Stores each journal `fullUrl` that is a key of `hashes` as its value (its keyed hash), in one transaction;
    /// returns how many lines changed.
    func replaceJournalFullURLs(_ hashes: [String: String]) async throws -> Int

    /// Releases connections (a database server's); the SQLite store has nothing to release.
    func shutdown() async

    /// Calls `enqueued` with the server's queue name whenever another process enqueues into this store, until
    /// the task is cancelled. A store that cannot tell returns at once (its readers poll).
    func watchEnqueues(_ enqueued: @escaping @Sendable (String) -> Void) async
}

/// The exclusive right to flush one server's queue, and the note of a request on the wire that outlives
/// the flusher (so that the next one lets the server settle it before sending again).
///
/// A store whose ownership can lapse (a lease) throws from ``markInFlight(sequence:)`` once it has: nothing
/// more is sent.
protocol FlushOwnership: AnyObject, Sendable {
    /// Notes that the item `sequence` is being sent now; the note is kept before this returns.
    func markInFlight(sequence: Int64) async throws
    /// Clears the note: the answer came. A store may clear it lazily (on the next send or on ``release()``):
    /// a stale note costs the next flusher a settle delay, never a resource.
    func clearInFlight() async throws
    /// The note a flusher left: the item it was sending and when.
    func inFlight() async throws -> (sequence: Int64, sentAt: Date)?
    /// Gives up the right.
    func release() async
}

/// What a flush holder last wrote to its in-flight note (the SQLite lock file's marker, PostgreSQL's `dq_note`
/// row), so that a flush writes the note about once per window rather than twice per request.
///
/// A written note covers every send until the end of its window. An answer clears the note only here
/// (lazily): the next send inside the window makes it current again, and ``release()`` says whether the
/// stored note must still be cleared.
struct InFlightNoteWindow: Sendable {
    /// The note written covers sends until then.
    private var coveredUntil: ContinuousClock.Instant?
    /// The answer came: the stored note is stale, and is cleared on release unless a send renews it.
    private(set) var cleared = false

    /// Whether the note already written covers a send at `now`; if so, that send makes it current again.
    mutating func covers(_ now: ContinuousClock.Instant) -> Bool {
        guard let until = coveredUntil, now < until else { return false }
        cleared = false
        return true
    }

    /// A note was written for a send at `start`, covering sends for `window` after it (nil: only that send).
    mutating func wrote(at start: ContinuousClock.Instant, covering window: Duration?) {
        coveredUntil = window.map { start + $0 }
        cleared = false
    }

    /// The answer came (or the request was given up).
    mutating func clear() { cleared = true }

    /// Forgets the window; returns whether the stored note must still be cleared.
    mutating func release() -> Bool {
        defer { self = InFlightNoteWindow() }
        return cleared
    }
}

/// What an operator's item reference (`dq show 1f3a`, `dq show 42`, `dq show '#42'`) can name.
///
/// Digits alone are ambiguous by nature: `0042` is a sequence number and also the end of any id that ends in
/// those digits. Such a reference is looked up both ways, and a store that finds two different items says the
/// reference is ambiguous rather than pick one (a drop or retry must never reach the wrong item). `#42` names
/// the sequence only.
struct ItemReference: Sendable, Equatable {
    /// The sequence number the reference may name.
    var sequence: Int64?
    /// The part of an item id it may name: lowercased, at least 4 characters of hex digits and dashes
    /// (nothing else can match, and nothing else reaches a query).
    var idPart: String?

    init(_ reference: String) {
        if reference.hasPrefix("#") {
            let digits = reference.dropFirst()
            sequence = digits.allSatisfy(\.isASCII) ? Int64(digits) : nil
            idPart = nil
            return
        }
        sequence = reference.allSatisfy({ $0.isASCII && $0.isNumber }) ? Int64(reference) : nil
        let part = reference.lowercased()
        idPart = part.count >= 4 && part.allSatisfy({ $0.isHexDigit || $0 == "-" }) ? part : nil
    }

    /// The sequence number `sequence` as a reference that names nothing else.
    static func sequence(_ sequence: Int64) -> String { "#\(sequence)" }

    /// The error for a reference that matched more than one item.
    static func ambiguous(_ reference: String, bySequence: Bool) -> DataQueueError {
        let hint = bySequence ? "write #\(reference) for the sequence number, or give more of the id" : "give more of the id"
        return DataQueueError(.notFound, "item reference \(reference) is ambiguous; \(hint)")
    }
}

/// What a store does to a new item before storing it, safe to run on several threads at once.
protocol ItemPreparation: Sendable {
    /// The item as it is to be stored.
    func prepare(_ item: NewItem) -> NewItem

    /// `error` of an insert of prepared items, in the words of the items as given (a fullUrl, not its hash).
    func explain(_ error: DataQueueError) -> DataQueueError
}

/// New stored values of one item (sealed, or sealed under another key), replacing what was read.
struct SealedReplacement: Sendable {
    var sequence: Int64
    var url: String
    var resourceID: String?
    var body: Data
    var fullURL: String?
    var outcome: String?
    /// The body and outcome as read: the replacement is made only if they are unchanged.
    var expectedBody: Data
    var expectedOutcome: String?
}

/// A delivery to record in the journal.
struct CompletedDelivery: Sendable {
    var item: QueuedItem
    /// `.delivered`, or `.alreadyPresent` when a conditional create found the resource on the server.
    var event: DeliveryRecord.Event = .delivered
    /// The URL it was sent to.
    var url: String
    var status: Int
    var location: String?
    var serverID: String?
    var versionID: String?
    /// Where the server id came from when not from `Location`, or that the server did not say (PHI-free).
    var note: String? = nil
    /// The item's producer-given fullUrl (so later references to it can be rewritten).
    var fullURL: String? = nil
    /// The id of the Bundle request it travelled in, when it did.
    var bundle: String? = nil
    /// When the server's answer came (the journal line's time): made as the answer is read, not when the line is
    /// written, which a refused journal write and its retry can put much later.
    var answeredAt = Date()
    /// For a Bundle queued as one item: its entries' locations from the transaction-response (JSON array).
    var entries: String? = nil
    /// The client and plaintext digest of a receiver's item, recorded with the delivery (in the journal's
    /// transaction) so that a repeat of it is recognised (see ``ReceiptStore``).
    var digest: ContentDigest? = nil
}

extension QueueStorage {
    func checkFileIdentity() throws {}

    func vacuum() async throws {}

    func scrubAfterSealing() async throws -> Bool { true }

    func resealUnderCurrentKey(progress: (Int) -> Void) async throws -> Int {
        throw SealedStorage.noKeyToSealUnder
    }

    func preparation() async throws -> (any ItemPreparation)? { nil }

    /// Takes every chunk first, checks the references against the store, then stores all in one transaction.
    func insert(chunks: Int, take: @escaping @Sendable (Int) -> [NewItem]?) async throws -> [Int64] {
        // `take` waits for chunks still being made: on a thread of its own, not one of the cooperative pool.
        let items = try await OwnThread.run("dq-bulk") {
            var items: [NewItem] = []
            for chunk in 0..<chunks {
                guard let made = take(chunk) else { throw DataQueueError(.invalidResource, "an input is bad; nothing was queued") }
                items += made
            }
            return items
        }
        var check = ReferenceCheck()
        for (index, item) in items.enumerated() { check.add(item, index: index) }
        try check.refuseDeclaredTwice()
        try check.refuse(existing: try await knownFullURLs(check.lookups))
        return try await insert(items)
    }
}

/// What is known of a server's Bundle support: whether its CapabilityStatement declares transactions
/// (and when it was read), and the largest Bundle it took after refusing a larger one.
struct BundleSupport: Sendable, Equatable {
    var transactions: Bool?
    var checkedAt: Date?
    var batchLimit: Int?
    /// The resource types whose conditional create the CapabilityStatement declares; nil when not read.
    var conditionalCreate: Set<String>? = nil

    /// The JSON list stored for a set of conditional-create types.
    static func encodeTypes(_ types: Set<String>) -> String {
        String(decoding: (try? JSONEncoder().encode(types.sorted())) ?? Data("[]".utf8), as: UTF8.self)
    }

    static func decodeTypes(_ text: String?) -> Set<String>? {
        text.flatMap { try? JSONDecoder().decode([String].self, from: Data($0.utf8)) }.map(Set.init)
    }
}
