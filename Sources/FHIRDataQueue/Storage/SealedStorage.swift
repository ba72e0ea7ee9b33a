import Crypto
import Foundation
import Logging
import NIOConcurrencyHelpers

/// A store whose items are sealed at rest: every value that comes from a resource (body, request path, resource
/// id, `fullUrl`, the server's answer to a parked item) is sealed before it reaches the store it wraps and opened
/// when read back (see ``Sealer``). What orders and schedules items (sequence, state, attempts, times, the
/// resource type, sizes) stays readable; so does the delivery journal, which holds no resource content.
///
/// One wrapper for every store: SQLite and PostgreSQL keep storing bytes and text, and the seal key table
/// (``QueueStorage/sealKeys()``) says that a queue is sealed and under which keys.
final class SealedStorage: QueueStorage {
    let inner: any QueueStorage
    private let keys: AtRestKeys?
    private let readOnly: Bool
    private let logger: Logger
    /// How the queue is sealed, found on first use (see ``state()``).
    private let found = NIOLockedValueBox<Task<State, any Error>?>(nil)
    /// The state once found: read without a suspension (an enqueue does not hop executors for it).
    private let known = NIOLockedValueBox<State?>(nil)

    /// How the store is sealed, and what this process can do with it.
    struct State: Sendable {
        /// Nil for a plain queue opened without keys (every call passes through), and for a sealed queue
        /// opened read-only without its key (counts and the journal can be read, no content, nothing written).
        var sealer: Sealer?
        /// The at-rest keys of the store's seal key table (empty: a plain queue).
        var keyIDs: [String]
    }

    private init(inner: any QueueStorage, keys: AtRestKeys?, readOnly: Bool, logger: Logger) {
        self.inner = inner
        self.keys = keys
        self.readOnly = readOnly
        self.logger = logger
    }

    /// The store to use for `inner` with the at-rest `keys` configured (nil: none).
    ///
    /// A sealed queue opened (for writing) without a key that opens it is a configuration error naming the key
    /// ids it needs, and nothing is changed; a plain queue opened with a key becomes sealed, its items sealed
    /// in batches. Unless `lazily`, this is found out now (and a plain queue without keys gets `inner` itself);
    /// `lazily` (a host's PostgreSQL client, which may not run yet) defers it to the first call.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when the keys do not fit the queue.
    static func open(_ inner: any QueueStorage, keys: AtRestKeys?, readOnly: Bool, lazily: Bool, logger: Logger) async throws
        -> any QueueStorage
    {
        let store = SealedStorage(inner: inner, keys: keys, readOnly: readOnly, logger: logger)
        if lazily { return store }
        let state = try await store.state()
        return state.sealer == nil && state.keyIDs.isEmpty ? inner : store
    }

    static func keyNeeded(_ ids: [String]) -> DataQueueError {
        DataQueueError(
            .invalidConfiguration,
            "configuration: the queue is sealed at rest under key \(ids.joined(separator: ", ")); "
                + "set \"at_rest.key_file\" (or DQ_AT_REST_KEY_FILE) to that key")
    }

    /// How the queue is sealed: found once; a failure (the database unreachable) is tried again next time.
    nonisolated(nonsending) func state() async throws -> State {
        if let state = known.withLockedValue({ $0 }) { return state }
        let task = found.withLockedValue { current -> Task<State, any Error> in
            if let current { return current }
            let made = Task { try await self.findState() }
            current = made
            return made
        }
        do {
            let state = try await task.value
            known.withLockedValue { $0 = state }
            return state
        } catch {
            found.withLockedValue { if $0 == task { $0 = nil } }
            throw error
        }
    }

    /// The sealer; nil for a plain queue without keys.
    ///
    /// - Throws: the error naming the key a sealed queue needs, when none of the configured keys opens it.
    nonisolated(nonsending) func sealerIfSealed() async throws -> Sealer? {
        let state = try await state()
        if state.sealer == nil && !state.keyIDs.isEmpty { throw Self.keyNeeded(state.keyIDs) }
        return state.sealer
    }

    /// What an insert of a plain item into a sealed queue is told (the store refused it: see
    /// ``QueueStorage/refusePlainItems()``).
    static var plainItemRefused: DataQueueError {
        DataQueueError(
            .invalidConfiguration,
            "configuration: the queue is sealed at rest (since this process opened it, or the items come from a plain "
                + "queue) and takes only sealed items; nothing was queued: set \"at_rest.key_file\" (or DQ_AT_REST_KEY_FILE) "
                + "to its key")
    }

    /// What sealing without an at-rest key configured is told.
    static var noKeyToSealUnder: DataQueueError {
        DataQueueError(.invalidConfiguration, "configuration: \"at_rest.key_file\" is not set: there is no key to seal under")
    }

    /// The sealer of a queue that must be sealed (a rekey).
    var sealer: Sealer {
        get async throws {
            guard let sealer = try await sealerIfSealed() else {
                throw Self.noKeyToSealUnder
            }
            return sealer
        }
    }

    private func findState() async throws -> State {
        let records = try await inner.sealKeys()
        let ids = records.map(\.id)
        guard let keys else {
            // Read-only without the key: status and the journal, never content.
            guard records.isEmpty || readOnly else { throw Self.keyNeeded(ids) }
            return State(sealer: nil, keyIDs: ids)
        }
        var indexKey: SymmetricKey?
        for record in records {
            if let key = keys.key(id: record.id), let unwrapped = Sealer.unwrap(record.wrappedIndexKey, under: key) {
                indexKey = unwrapped
                break
            }
        }
        if indexKey == nil && !records.isEmpty {
            throw DataQueueError(
                .invalidConfiguration,
                "configuration: the queue is sealed at rest under key \(ids.joined(separator: ", ")); the configured "
                    + "at-rest key\(keys.ids.count > 1 ? "s are" : " is") \(keys.ids.joined(separator: ", ")): "
                    + "set \"at_rest.key_file\" (or \"at_rest.old_key_files\") to the key that sealed it")
        }
        // A plain queue read without writing stays plain.
        if readOnly && records.isEmpty { return State(sealer: nil, keyIDs: []) }
        let sealer = Sealer(keys: keys, indexKey: indexKey ?? SymmetricKey(size: .bits256))
        if !readOnly {
            if !records.contains(where: { $0.id == keys.current.id }) {
                let record = SealKeyRecord(
                    id: keys.current.id, wrappedIndexKey: Sealer.wrap(indexKey: sealer.indexKey, under: keys.current))
                if records.isEmpty {
                    // The queue's first key, recorded only while it still has none: a process sealing it at this
                    // moment under another key would otherwise record an index key of its own beside this one (and
                    // their fullUrl hashes would differ). Lost to another: what it recorded decides, as for a queue
                    // sealed before.
                    guard try await inner.addFirstSealKey(record) else { return try await findState() }
                } else {
                    // A new key of a sealed queue wraps the index key it has (unwrapped above): whichever process
                    // records it, the index key stays the same.
                    try await inner.addSealKey(record)
                }
            }
            // From here on the store itself refuses plain items, from whichever process: one that opened the queue
            // while it was plain, without a key, would otherwise go on adding readable rows.
            try await inner.refusePlainItems()
            if let plain = try await inner.sealedCounts()[""], plain > 0 {
                logger.notice("sealing the items queued before at_rest was set", metadata: ["items": "\(plain)"])
                let sealed = try await sealAll(sealer, only: .plain) { [logger] done in
                    logger.info("sealed items", metadata: ["done": "\(done)", "of": "\(plain)"])
                }
                try await scrub()
                logger.notice("sealed the items queued before at_rest was set", metadata: ["items": "\(sealed)"])
            }
            // Also after an open that stopped half-way: the look-up for plain ones is one probe of an index.
            if try await sealJournal(sealer) > 0 { try await scrub() }
        }
        return State(sealer: sealer, keyIDs: Array(Set(ids + [keys.current.id])).sorted())
    }

    /// Which items ``sealAll(only:progress:)`` seals.
    enum Unsealed {
        /// Plain items (a queue that at_rest was just turned on for).
        case plain
        /// Plain items and those sealed under another key than the current one (a rekey).
        case notUnderCurrentKey
    }

    func resealUnderCurrentKey(progress: (Int) -> Void) async throws -> Int {
        let resealed = try await sealAll(try await sealer, only: .notUnderCurrentKey, progress: progress)
        try await scrub()
        return resealed
    }

    /// ``QueueStorage/scrubAfterSealing()``, with a warning when another connection kept it from being done.
    private func scrub() async throws {
        if try await !inner.scrubAfterSealing() {
            logger.warning(
                """
                the queue's write-ahead log still holds pages written before sealing: another process kept reading \
                the queue; run dq rekey once it has stopped to remove them
                """)
        }
    }

    /// Seals items again under the current key, in batches, each batch in one transaction, while producers
    /// and a flush go on: a row that changed since it was read (delivered, parked) is left to them. An item whose
    /// seal does not open is left as it is (a flush parks it, named). Returns how many were sealed.
    func sealAll(only which: Unsealed, progress: (Int) -> Void) async throws -> Int {
        try await sealAll(try await sealer, only: which, progress: progress)
    }

    private func sealAll(_ sealer: Sealer, only which: Unsealed, progress: (Int) -> Void) async throws -> Int {
        var after: Int64 = 0
        var total = 0
        while true {
            let batch = try await inner.rawItems(after: after, limit: 256)
            guard let last = batch.last else { break }
            after = last.info.sequence
            var replacements: [SealedReplacement] = []
            for raw in batch {
                let key = Sealer.keyID(ofBody: raw.body)
                let current = sealer.keys.current.id
                let outcomeKey = raw.info.outcome.map { Sealer.keyID(ofText: $0) ?? "" }
                if key == current && (outcomeKey == nil || outcomeKey == current) { continue }
                if which == .plain && key != nil { continue }
                let opened: StoredItem
                if key == nil {
                    // Plain only when nothing of it is sealed; a sealed path with a body that is not is damage, left
                    // for a flush to park.
                    guard Sealer.keyID(ofText: raw.info.url) == nil else { continue }
                    opened = raw
                } else {
                    let candidate = Self.open(raw, sealer, keyIDs: [])
                    if candidate.unreadable != nil { continue }
                    opened = candidate
                }
                let item = opened.info
                replacements.append(
                    SealedReplacement(
                        sequence: item.sequence, url: sealer.seal(text: item.url, .url, item: item.id, queue: item.queue),
                        resourceID: item.resourceID.map { sealer.seal(text: $0, .resourceID, item: item.id, queue: item.queue) },
                        body: sealer.seal(body: opened.body, fullURL: opened.fullURL, item: item.id, queue: item.queue),
                        fullURL: opened.fullURL.map(sealer.index),
                        outcome: item.outcome.map { sealer.seal(text: $0, .outcome, item: item.id, queue: item.queue) },
                        expectedBody: raw.body, expectedOutcome: raw.info.outcome))
            }
            if !replacements.isEmpty {
                total += try await inner.replaceSealed(replacements)
                progress(total)
            }
            Heartbeat.beat()
        }
        return total
    }

    /// Journal lines written before the queue was sealed name fullUrls as given: they are stored as their keyed
    /// hashes, as later lines are, so that a reference to one is found by the store's own checks (a bulk
    /// enqueue's). Returns how many fullUrls were hashed.
    private func sealJournal(_ sealer: Sealer) async throws -> Int {
        var total = 0
        while true {
            let plain = try await inner.plainJournalFullURLs(limit: 1000)
            guard !plain.isEmpty else { return total }
            let changed = try await inner.replaceJournalFullURLs(Dictionary(plain.map { ($0, sealer.index($0)) }) { first, _ in first })
            // None changed would mean the store cannot change them: never loop on that.
            guard changed > 0 else { return total }
            total += changed
            Heartbeat.beat()
        }
    }

    // MARK: Opening

    /// A stored item with its values opened (`sealer` nil: the queue's key is not configured); one that does
    /// not open is marked ``StoredItem/unreadable`` and holds no content.
    static func open(_ stored: StoredItem, _ sealer: Sealer?, keyIDs: [String]) -> StoredItem {
        let item = stored.info
        do {
            guard let sealer else { throw Sealer.Failure(message: keyNeeded(keyIDs).message) }
            let (body, fullURL) = try sealer.open(body: stored.body, item: item.id, queue: item.queue)
            var opened = stored
            opened.info = try open(item, sealer)
            opened.body = body
            opened.fullURL = fullURL
            return opened
        } catch {
            var unreadable = stored
            unreadable.info = replacing(item, url: "", resourceID: nil, outcome: nil)
            unreadable.body = Data()
            unreadable.fullURL = nil
            unreadable.unreadable = "the item cannot be read: " + ((error as? Sealer.Failure)?.message ?? "\(error)")
            return unreadable
        }
    }

    /// An item's listed values opened (path, resource id, the server's answer).
    static func open(_ item: QueuedItem, _ sealer: Sealer) throws -> QueuedItem {
        // The server's answer is for the operator: one that does not open says why, and the item still goes.
        let outcome = item.outcome.map { text in
            (try? sealer.open(text: text, .outcome, item: item.id, queue: item.queue)) ?? "(the sealed answer cannot be read)"
        }
        return replacing(
            item, url: try sealer.open(text: item.url, .url, item: item.id, queue: item.queue),
            resourceID: try item.resourceID.map { try sealer.open(text: $0, .resourceID, item: item.id, queue: item.queue) },
            outcome: outcome)
    }

    /// For an operator's list: an item that does not open is shown with the reason in place of its path.
    private static func openForListing(_ item: QueuedItem, _ sealer: Sealer?) -> QueuedItem {
        do {
            guard let sealer else { throw Sealer.Failure(message: "sealed at rest; no key configured") }
            return try open(item, sealer)
        } catch {
            let reason = (error as? Sealer.Failure)?.message ?? "\(error)"
            return replacing(item, url: "(unreadable: \(reason))", resourceID: nil, outcome: nil)
        }
    }

    static func replacing(_ item: QueuedItem, url: String, resourceID: String?, outcome: String?) -> QueuedItem {
        QueuedItem(
            sequence: item.sequence, id: item.id, queue: item.queue, method: item.method, url: url, resourceType: item.resourceType,
            resourceID: resourceID, encrypted: item.encrypted, state: item.state, attempts: item.attempts, enqueuedAt: item.enqueuedAt,
            lastAttemptAt: item.lastAttemptAt, lastStatus: item.lastStatus, lastError: item.lastError, outcome: outcome,
            size: item.size, clientID: item.clientID)
    }

    /// The stored forms of `fullURLs` to look for: each one's keyed hash, and the value itself (journal lines
    /// and items written before the queue was sealed hold it plain).
    fileprivate static func lookups(_ fullURLs: some Sequence<String>, _ sealer: Sealer) -> [String: String] {
        var forms: [String: String] = [:]
        for url in fullURLs {
            forms[sealer.index(url)] = url
            forms[url] = url
        }
        return forms
    }

    // MARK: Enqueue

    func insert(_ items: [NewItem]) async throws -> [Int64] {
        guard let sealer = try await sealerIfSealed() else { return try await inner.insert(items) }
        return try await inner.insert(items.map(sealer.seal))
    }

    nonisolated(nonsending) func insertGrouped(_ item: NewItem) async throws -> Int64 {
        guard let sealer = try await sealerIfSealed() else { return try await inner.insertGrouped(item) }
        return try await inner.insertGrouped(sealer.seal(item))
    }

    func insert(chunks: Int, take: @escaping @Sendable (Int) -> [NewItem]?) async throws -> [Int64] {
        guard let sealer = try await sealerIfSealed() else { return try await inner.insert(chunks: chunks, take: take) }
        // Items a bulk enqueue sealed on its own threads pass as they are; any other is sealed here.
        let preparation = Sealing(sealer: sealer)
        do {
            return try await inner.insert(chunks: chunks) { chunk in take(chunk)?.map(preparation.prepare) }
        } catch let error as DataQueueError {
            throw preparation.explain(error)
        }
    }

    func preparation() async throws -> (any ItemPreparation)? {
        try await sealerIfSealed().map { Sealing(sealer: $0) }
    }

    /// Seals new items (once: an item already sealed is left as it is), remembering the fullUrls they name, so that an
    /// error of the store (which knows their keyed hashes) can name them.
    private final class Sealing: ItemPreparation {
        let sealer: Sealer
        private let named = NIOLockedValueBox<[String: String]>([:])

        init(sealer: Sealer) { self.sealer = sealer }

        func prepare(_ item: NewItem) -> NewItem {
            guard !item.sealed else { return item }
            let linked = item.references + (item.fullURL.map { [$0] } ?? [])
            if !linked.isEmpty {
                let forms = SealedStorage.lookups(linked, sealer)
                named.withLockedValue { $0.merge(forms) { first, _ in first } }
            }
            return sealer.seal(item)
        }

        func explain(_ error: DataQueueError) -> DataQueueError {
            guard error.message.contains(Sealer.indexPrefix) else { return error }
            var message = error.message
            for (hash, url) in named.withLockedValue({ $0 }) where hash != url {
                message = message.replacingOccurrences(of: hash, with: url)
            }
            return DataQueueError(error.code, message)
        }
    }

    func knownFullURLs(_ fullURLs: Set<String>) async throws -> Set<String> {
        guard let sealer = try await sealerIfSealed() else { return try await inner.knownFullURLs(fullURLs) }
        let forms = Self.lookups(fullURLs, sealer)
        return Set(try await inner.knownFullURLs(Set(forms.keys)).compactMap { forms[$0] })
    }

    // MARK: Flushing

    func checkFileIdentity() throws { try inner.checkFileIdentity() }

    func acquireFlush(queue: String, until deadline: ContinuousClock.Instant) async throws -> (any FlushOwnership)? {
        _ = try await sealerIfSealed()
        return try await inner.acquireFlush(queue: queue, until: deadline)
    }

    func checkStates(queue: String) async throws { try await inner.checkStates(queue: queue) }

    func serverState(queue: String) async throws -> (failures: Int, nextAttemptAt: Date?, lastError: String?) {
        try await inner.serverState(queue: queue)
    }

    func pendingBatch(queue: String, after: Int64, maxCount: Int, maxBytes: Int) async throws -> [StoredItem] {
        let batch = try await inner.pendingBatch(queue: queue, after: after, maxCount: maxCount, maxBytes: maxBytes)
        guard let sealer = try await sealerIfSealed() else { return batch }
        // A key this process does not hold, but the queue knows (a process that sealed under it registered it), is
        // this process's configuration lagging, not the row's fault: a key rotated in after it read its settings
        // (dq run until its SIGHUP), or an old key that left the list too early. Nothing from that item on is sent
        // or parked: the items before it go, and the flush then stops until the key is configured. An id the queue
        // never knew is a damaged row, parked as any seal that does not open.
        let unknown = batch.indices.filter { Sealer.keyID(ofBody: batch[$0].body).map { !sealer.holds($0) } ?? false }
        if !unknown.isEmpty {
            let known = Set(try await inner.sealKeys().map(\.id))
            if let lagging = unknown.first(where: { known.contains(Sealer.keyID(ofBody: batch[$0].body) ?? "") }) {
                guard lagging == batch.startIndex else {
                    return batch[..<lagging].map { Self.open($0, sealer, keyIDs: []) }
                }
                let stored = batch[lagging]
                throw DataQueueError(
                    .invalidConfiguration,
                    "configuration: item #\(stored.info.sequence) is sealed at rest under key \(Sealer.keyID(ofBody: stored.body) ?? "?"), "
                        + "which is not configured; nothing was sent or changed (set \"at_rest.key_file\" or "
                        + "\"at_rest.old_key_files\" to it; dq run takes it on SIGHUP)")
            }
        }
        return batch.map { Self.open($0, sealer, keyIDs: []) }
    }

    func markDelivered(_ deliveries: [CompletedDelivery], owner: any FlushOwnership) async -> Result<Void, DataQueueError> {
        let sealer: Sealer?
        do {
            sealer = try await sealerIfSealed()
        } catch {
            return .failure(error as? DataQueueError ?? DataQueueError(.storage, "\(error)"))
        }
        guard let sealer else { return await inner.markDelivered(deliveries, owner: owner) }
        return await inner.markDelivered(
            deliveries.map { delivery in
                var indexed = delivery
                indexed.fullURL = delivery.fullURL.map(sealer.index)
                indexed.digest = delivery.digest.map { ContentDigest(clientID: $0.clientID, digest: sealer.index($0.digest)) }
                return indexed
            }, owner: owner)
    }

    func park(_ item: QueuedItem, url: String, status: Int?, error: String, outcome: String?, owner: any FlushOwnership) async throws {
        let sealer = try await sealerIfSealed()
        let stored = sealer.map { sealer in outcome.map { sealer.seal(text: $0, .outcome, item: item.id, queue: item.queue) } } ?? outcome
        try await inner.park(item, url: url, status: status, error: error, outcome: stored, owner: owner)
    }

    func recordFailure(
        queue: String, item: QueuedItem?, status: Int?, error: String, nextAttemptAt: Date?, owner: any FlushOwnership
    ) async throws {
        try await inner.recordFailure(queue: queue, item: item, status: status, error: error, nextAttemptAt: nextAttemptAt, owner: owner)
    }

    func bundleSupport(queue: String) async throws -> BundleSupport { try await inner.bundleSupport(queue: queue) }

    func recordBundleSupport(queue: String, transactions: Bool?, batchLimit: Int?, conditionalCreate: Set<String>?) async throws {
        try await inner.recordBundleSupport(
            queue: queue, transactions: transactions, batchLimit: batchLimit, conditionalCreate: conditionalCreate)
    }

    func deliveredLocations(fullURLs: [String]) async throws -> [String: String] {
        try await byFullURL(fullURLs) { try await self.inner.deliveredLocations(fullURLs: $0) }
    }

    func unlocatedDeliveries(fullURLs: [String]) async throws -> [String: UUID] {
        try await byFullURL(fullURLs) { try await self.inner.unlocatedDeliveries(fullURLs: $0) }
    }

    /// What `find` (a journal lookup by stored fullUrl) says of `fullURLs`, looked up in their stored forms.
    private func byFullURL<Value>(
        _ fullURLs: [String], _ find: ([String]) async throws -> [String: Value]
    ) async throws -> [String: Value] {
        guard let sealer = try await sealerIfSealed() else { return try await find(fullURLs) }
        let forms = Self.lookups(fullURLs, sealer)
        var found: [String: Value] = [:]
        for (stored, value) in try await find(Array(forms.keys)) {
            if let url = forms[stored] { found[url] = value }
        }
        return found
    }

    func resolveLocation(itemID: UUID, location: String, serverID: String, versionID: String?, note: String) async throws -> Bool {
        try await inner.resolveLocation(itemID: itemID, location: location, serverID: serverID, versionID: versionID, note: note)
    }

    // MARK: Operators

    func status(queue: String, countingJournal: Bool) async throws -> QueueStatus {
        try await inner.status(queue: queue, countingJournal: countingJournal)
    }

    func queues() async throws -> [String] { try await inner.queues() }

    func items(queue: String?, state: QueuedItem.State?, limit: Int) async throws -> [QueuedItem] {
        let items = try await inner.items(queue: queue, state: state, limit: limit)
        let found = try await self.state()
        if found.keyIDs.isEmpty { return items }
        return items.map { Self.openForListing($0, found.sealer) }
    }

    func item(_ reference: String) async throws -> StoredItem {
        let item = try await inner.item(reference)
        let found = try await state()
        if found.keyIDs.isEmpty { return item }
        return Self.open(item, found.sealer, keyIDs: found.keyIDs)
    }

    func retry(sequence: Int64, conditionalCreate: Bool?) async throws -> Bool {
        _ = try await sealerIfSealed()
        return try await inner.retry(sequence: sequence, conditionalCreate: conditionalCreate)
    }

    func retryAllParked(queue: String) async throws -> Int {
        _ = try await sealerIfSealed()
        return try await inner.retryAllParked(queue: queue)
    }

    func drop(_ item: QueuedItem, url: String) async throws {
        _ = try await sealerIfSealed()
        try await inner.drop(item, url: url)
    }

    func journalLine(_ reference: String) async throws -> DeliveryRecord? { try await inner.journalLine(reference) }

    func allStatuses(countingJournal: Bool) async throws -> [QueueStatus] {
        try await inner.allStatuses(countingJournal: countingJournal)
    }

    func integrityCheck() async throws -> [String] { try await inner.integrityCheck() }

    func deliveries(queue: String?, limit: Int) async throws -> [DeliveryRecord] {
        try await inner.deliveries(queue: queue, limit: limit)
    }

    func pruneJournal(before cutoff: Date, progress: @Sendable (Int) -> Void) async throws -> Int {
        try await inner.pruneJournal(before: cutoff, progress: progress)
    }

    func vacuum() async throws { try await inner.vacuum() }

    func shutdown() async { await inner.shutdown() }

    func watchEnqueues(_ enqueued: @escaping @Sendable (String) -> Void) async { await inner.watchEnqueues(enqueued) }

    // MARK: Sealing

    func sealKeys() async throws -> [SealKeyRecord] { try await inner.sealKeys() }

    func addSealKey(_ record: SealKeyRecord) async throws { try await inner.addSealKey(record) }

    func addFirstSealKey(_ record: SealKeyRecord) async throws -> Bool { try await inner.addFirstSealKey(record) }

    func refusePlainItems() async throws { try await inner.refusePlainItems() }

    func sealedCounts() async throws -> [String: Int] { try await inner.sealedCounts() }

    func rawItems(after: Int64, limit: Int) async throws -> [StoredItem] { try await inner.rawItems(after: after, limit: limit) }

    func replaceSealed(_ replacements: [SealedReplacement]) async throws -> Int { try await inner.replaceSealed(replacements) }

    func scrubAfterSealing() async throws -> Bool { try await inner.scrubAfterSealing() }

    func plainJournalFullURLs(limit: Int) async throws -> [String] { try await inner.plainJournalFullURLs(limit: limit) }

    func replaceJournalFullURLs(_ hashes: [String: String]) async throws -> Int { try await inner.replaceJournalFullURLs(hashes) }
}

// A receiver's repeats: the item sealed as any other, its receipt as it is (not PHI), and the digests of plaintexts
// stored as the queue's keyed index hash of them (a bare SHA-256 of a short resource could be confirmed by guessing).
extension SealedStorage: ReceiptStore {
    private var receipts: any ReceiptStore {
        get throws {
            guard let receipts = inner as? any ReceiptStore else {
                throw DataQueueError(.invalidConfiguration, "this queue's store cannot keep a receiver's receipts")
            }
            return receipts
        }
    }

    func insert(_ item: NewItem, receipt: Receipt?, expiredBefore: Date) async throws -> ReceiptInsert {
        let sealer = try await sealerIfSealed()
        return try await receipts.insert(sealer.map { $0.seal(item) } ?? item, receipt: receipt, expiredBefore: expiredBefore)
    }

    func receipt(clientID: String, key: String, since: Date) async throws -> Receipt? {
        try await receipts.receipt(clientID: clientID, key: key, since: since)
    }

    func recordAnswer(_ receipt: Receipt) async throws { try await receipts.recordAnswer(receipt) }

    func deliveredDigests(_ digests: Set<ContentDigest>, since: Date) async throws -> [ContentDigest: UUID] {
        guard let sealer = try await sealerIfSealed() else { return try await receipts.deliveredDigests(digests, since: since) }
        var forms: [ContentDigest: ContentDigest] = [:]
        for digest in digests { forms[ContentDigest(clientID: digest.clientID, digest: sealer.index(digest.digest))] = digest }
        let found = try await receipts.deliveredDigests(Set(forms.keys), since: since)
        return Dictionary(uniqueKeysWithValues: found.compactMap { key, id in forms[key].map { ($0, id) } })
    }

    func recordDuplicate(_ item: QueuedItem, url: String, note: String, owner: any FlushOwnership) async throws {
        try await receipts.recordDuplicate(item, url: url, note: note, owner: owner)
    }

    func pruneReceipts(before cutoff: Date) async throws -> Int { try await receipts.pruneReceipts(before: cutoff) }
}
