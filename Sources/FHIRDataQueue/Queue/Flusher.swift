import Foundation
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore

/// One flush of one queue, once its lock is held: the loop that sends items in order, alone or as the entries
/// of transaction Bundles, records what the server answered, and stops at the first transient failure.
///
/// A Bundle is a contiguous run of pending plain items. It closes before a second write to the same resource
/// (two updates of one id, two creates with one condition, two items declaring one fullUrl), before an
/// encrypted item or a Bundle queued as an item (both go alone), and at the size limits. A Bundle refused as
/// a whole for one bad entry is split in halves until that entry is alone, and only it is parked. A 413 halves
/// the size for the server, and a server that refuses transactions gets single requests; both are remembered.
///
/// Used by one task at a time (the flush's own), which is why its mutable state needs no lock.
final class Flusher: @unchecked Sendable {  // unchecked: mutable state used by the flush task alone, which the compiler cannot see
    private let context: FlushContext
    private let lock: any FlushOwnership
    private let recorder: DeliveryRecorder
    private let limit: Int?
    private let through: Int64?
    private let tracking: Int64?
    private let progress: (@Sendable (FlushReport.Progress) -> Void)?
    /// The last item an earlier flush of this queue was sending when it stopped (its in-flight note): a pending item
    /// up to it was sent then (its answer or its journal line lost), and may be on the server already.
    private let resentThrough: Int64?
    /// Whether every pending item up to ``resentThrough`` is behind this flush (the head is past it, or the queue
    /// is empty): until then the in-flight note keeps naming it, so that a second stop before they are sent again
    /// leaves them marked for the next flush.
    private var resentPassed: Bool
    /// Whether the last request ended without an answer (its note must stay for the next flush).
    private var unanswered = false

    private(set) var report = FlushReport()
    private(set) var tracked: SendOutcome?
    /// Pending items after the last one handled, in order; fetched ahead (a ring: the handled ones leave
    /// its head without moving the rest).
    private var prefetched = CircularBuffer<StoredItem>()
    /// How many items one read fetches ahead at least: a read waits while a journal commit holds the
    /// database, so fewer reads are fewer waits.
    static let prefetchCount = 256
    private var lastFetched: Int64 = 0
    private var exhausted = false
    /// The batches after the prefetched ones, read and opened while they are sent (started only after a batch
    /// that held envelopes: opening is the CPU work of a drain, and it then overlaps the requests and the journal).
    private var readAhead: ReadAhead<Fetched>?
    /// How many batches the read-ahead keeps ready.
    static let readAheadDepth = 2
    /// Whether the last batch fetched held envelopes.
    private var fetchedEnvelopes = false

    /// A batch read from the store, its envelopes opened.
    struct Fetched: Sendable {
        var items: [StoredItem]
        var hadEnvelopes: Bool
    }
    /// The items of the current step that were delivered or parked (they leave the prefetched ones).
    private var handled: Set<Int64> = []
    private var batchSize = 1
    /// Whether the encrypted endpoint still takes envelope batches (``DataQueue/Configuration/envelopeBatches``):
    /// after a refusal, one envelope per request for the rest of the flush.
    private var batchesEnvelopes = true
    /// Where this flush's deliveries with a fullUrl went (`Type/id`): their journal commits may still be on
    /// the way when a later item references them.
    private var deliveredHere: [String: String] = [:]
    /// This flush's deliveries with a fullUrl whose server did not say where it stored them.
    private var unlocatedHere: [String: UUID] = [:]
    /// What is known of the server (read once per flush).
    private var support: BundleSupport?
    private var capabilityRead = false
    /// The items of deliveries an earlier flush could not journal (already named in the log).
    private var heldBefore: Set<UUID> = []
    /// Types whose conditional create the server does not declare, already warned about in this flush.
    private var warnedConditional: Set<String> = []
    /// Receiver items' digests known delivered (by this flush, or within the dedupe window by the store), with the
    /// item that was: a later item with one is a repeat (see ``skipDuplicate()``).
    private var deliveredDigests: [ContentDigest: UUID] = [:]
    /// Digests looked up in the store already.
    private var checkedDigests: Set<ContentDigest> = []
    /// Whether items with digests were prefetched since the last look-up.
    private var digestsToCheck = false

    /// One item ready to send.
    struct Prepared {
        var stored: StoredItem
        /// The request as it goes now: the URL from the configured endpoint, idempotent mode's condition,
        /// references rewritten.
        var request: OutgoingRequest
        /// Why it cannot be sent (it is parked with this reason), if so.
        var failure: String?
        var item: QueuedItem { stored.info }
        var url: String { request.url }
        var ifNoneExist: String? { request.ifNoneExist }
        var body: Data {
            get { request.body }
            set { request.body = newValue }
        }
    }

    /// What one step of the loop ended with.
    private enum Step {
        case next
        case stop
    }

    init(
        context: FlushContext, lock: any FlushOwnership, limit: Int?, through: Int64?, tracking: Int64?,
        progress: (@Sendable (FlushReport.Progress) -> Void)?, resentThrough: Int64? = nil
    ) {
        self.resentThrough = resentThrough
        self.resentPassed = resentThrough == nil
        self.context = context
        self.lock = lock
        self.limit = limit
        self.through = through
        self.tracking = tracking
        self.progress = progress
        // Journal commits run while the next items are on the wire, several deliveries per commit.
        self.recorder = DeliveryRecorder(store: context.store, owner: lock, beforeCommit: context.hooks.beforeJournalCommit)
    }

    /// Sends until the queue (or the `through` item, or the limit) is reached or a failure stops it.
    func run() async throws {
        defer { cancelReadAhead() }
        do {
            try await recordHeldDeliveries()
            try await loop()
            try await recorder.finish()
            // The note of the stop before this flush is settled once all it named is behind it.
            if resentThrough != nil, resentPassed, !unanswered { try await lock.clearInFlight() }
        } catch {
            // Whatever stopped the flush, deliveries already made reach the journal first; those that cannot
            // (the database stopped taking writes) are held for the next flush of this process.
            try? await recorder.finish()
            let unrecorded = recorder.takeUnrecorded()
            if !unrecorded.isEmpty {
                context.heldDeliveries.hold(unrecorded)
                // Named once, when first held (not again at each retry of the write).
                let new = unrecorded.filter { !heldBefore.contains($0.item.id) }
                if !new.isEmpty {
                    context.logger.error(
                        "the server has items whose delivery could not be journaled; they are written before the next send",
                        metadata: ["items": "\(new.map(\.item.id.lowercasedString).joined(separator: ","))"])
                }
            }
            throw error
        }
    }

    /// Journals the deliveries an earlier flush could not, before anything is sent: while the database refuses
    /// writes this fails, and nothing goes out (sending would deliver the first of them again).
    private func recordHeldDeliveries() async throws {
        let held = context.heldDeliveries.takeAll()
        guard !held.isEmpty else { return }
        heldBefore = Set(held.map(\.item.id))
        for delivery in held { recorder.append(delivery) }
        try await recorder.finish()
        context.logger.notice("journaled deliveries an earlier flush could not write", metadata: ["count": "\(held.count)"])
    }

    private func loop() async throws {
        var sizeKnown = false
        while true {
            try Task.checkCancellation()
            let left = limit.map { $0 - report.delivered - report.parked } ?? Int.max
            if left <= 0 {
                report.stop = .limit
                return
            }
            try await refill(to: max(batchSize, 1))
            if !resentPassed, let resentThrough, prefetched.first.map({ $0.info.sequence > resentThrough }) ?? true {
                resentPassed = true
            }
            guard let head = prefetched.first else { return }
            if support == nil && context.configuration.idempotent == .always {
                // Idempotent mode trusts a 200 only where the server declares conditional create.
                _ = try await capabilities(needed: true)
            } else if context.configuration.idempotent == .automatic, !capabilityRead, support?.checkedAt == nil,
                prefetched.contains(where: mayBeConditioned)
            {
                // Automatic mode conditions the creates of the types the server declares: read before the first
                // create that could be conditioned (not for an update, an envelope, or a row that cannot go).
                _ = try await capabilities(needed: true)
            }
            if !sizeKnown && !head.info.encrypted && !head.info.url.isEmpty {
                // Only once an item that could share a Bundle is next: what the server takes (one read per flush).
                batchSize = try await effectiveBatchSize()
                sizeKnown = true
                try await refill(to: batchSize)
            }
            if try await skipDuplicate() { continue }
            if case .stop = try await claimWriteTargets() { return }
            handled = []
            let step: Step
            if head.info.encrypted && context.configuration.envelopeBatches && batchesEnvelopes {
                step = try await sendEnvelopeBatch(
                    maximum: min(context.configuration.batchSize ?? 100, EnvelopeBatch.maximumEntries, left))
            } else if head.info.encrypted && context.configuration.encryptedInFlight > 1 {
                step = try await sendEnvelopes(maximum: min(context.configuration.encryptedInFlight, left))
            } else {
                let run = try await compose(maximum: min(batchSize, left))
                step = run.count == 1 ? try await sendSingle(run[0]) : try await sendBundle(run)
            }
            // The handled items are the head, save after a split Bundle.
            let leading = prefetched.prefix { handled.contains($0.info.sequence) }.count
            prefetched.removeFirst(leading)
            if leading < handled.count { prefetched.removeAll { handled.contains($0.info.sequence) } }
            if case .stop = step { return }
        }
    }

    // MARK: - Repeats

    /// Journals the head as a duplicate, and removes it unsent, when it is a receiver's item whose client sent the
    /// same plaintext before and dq delivered that within the dedupe window; returns whether it did.
    ///
    /// Only a delivery recorded in the journal counts (its digest commits in the journal's transaction), never an
    /// attempt: an item that failed and waits to be sent again is not its own repeat, and after a crash between a
    /// send and its journal line nothing marks the resource delivered, so the next flush sends it again. That can
    /// put a rare second copy on the server, which beats dropping a resource that was never delivered.
    private func skipDuplicate() async throws -> Bool {
        guard let head = prefetched.first, let receipts = context.store as? any ReceiptStore else { return false }
        // One look-up for the receiver items prefetched since the last, before the first step that may take one (a
        // Bundle ends before an item whose digest is not looked up: not only when the head's is new, or a Bundle would
        // end where the last batch fetched ends), and not again at every step.
        let headUnchecked = head.digest.map { !checkedDigests.contains($0) } ?? false
        let unchecked = digestsToCheck || headUnchecked ? Set(prefetched.compactMap(\.digest)).subtracting(checkedDigests) : []
        digestsToCheck = false
        if !unchecked.isEmpty {
            let found = try await receipts.deliveredDigests(
                unchecked, since: Date().addingTimeInterval(-context.configuration.duplicateWindow))
            checkedDigests.formUnion(unchecked)
            deliveredDigests.merge(found) { here, _ in here }
        }
        guard let digest = head.digest, head.unreadable == nil, let original = deliveredDigests[digest], original != head.info.id
        else { return false }
        // The original's journal line (with its digest) commits before its repeat leaves the queue.
        try await recorder.finish()
        let url = (try? context.endpoints.url(for: head.info)) ?? context.queueName
        try await receipts.recordDuplicate(
            head.info, url: url, note: "a repeat of item \(original.lowercasedString), delivered within the dedupe window",
            owner: lock)
        prefetched.removeFirst()
        context.logger.info(
            "a repeat of a delivered resource was not sent again",
            metadata: ["item": "\(head.info.id.lowercasedString)", "original": "\(original.lowercasedString)"])
        return true
    }

    // MARK: - Write policy

    /// The receiver's write policy on an item of `clientID`'s: nil when allowed (its `PUT` targets, if any, left
    /// for ``claimWriteTargets()``), else the quarantine reason. Counted in `dq_write_policy_refusals_total`.
    static func applyPolicy(
        _ policy: WritePolicy, to item: inout StoredItem, resource: FHIRResource, method: FHIRMethod, pathType: String?
    ) -> String? {
        item.policyApplied = true
        switch policy.evaluate(resource, method: method, pathType: pathType) {
        case .allowed(let targets):
            item.writeTargets = targets
            return nil
        case .refused(let why):
            Counter(label: "dq_write_policy_refusals_total").increment()
            return DataQueue.quarantinePrefix + WritePolicy.refusalPrefix + why
        }
    }

    /// Checks the head's `PUT` targets (``WritePolicy/Target``) before it is sent: each must be the client's own
    /// (claimed by it before) or new on the server, and is then claimed for it. A target another client wrote, or
    /// that is on the server and no client wrote, quarantines the head (parked by the step, never sent). A server
    /// that cannot say stops the flush as a failed send does (the head is sent later, in order).
    private func claimWriteTargets() async throws -> Step? {
        guard var head = prefetched.first, !head.writeTargets.isEmpty, head.unreadable == nil, let client = head.clientID
        else { return nil }
        func refuse(_ why: String) -> Step? {
            Counter(label: "dq_write_policy_refusals_total").increment()
            head.unreadable = DataQueue.quarantinePrefix + WritePolicy.refusalPrefix + why
            head.writeTargets = []
            prefetched[prefetched.startIndex] = head
            return nil
        }
        let base = (context.store as? SealedStorage)?.inner ?? context.store
        guard let registry = base as? any ClientRegistry else {
            return refuse("this queue's store keeps no record of who wrote what")
        }
        for target in head.writeTargets {
            let owner = try await registry.resourceOwner(queue: context.queueName, target: target.path)
            if let owner, owner != client { return refuse("\(target.path) was written by another client") }
            if owner == client && target.mayUpdate { continue }
            switch await context.delivery.existence(of: context.endpoints.plain + "/" + target.path) {
            case .absent:
                guard target.mayCreate else { return refuse("devices may not create \(target.type) resources") }
            case .present:
                return refuse(
                    owner == client
                        ? "devices may not update \(target.type) resources"
                        : "\(target.path) is on the server and was not written by this client")
            case .deleted:
                return refuse("\(target.path) was deleted on the server")
            case .authentication(let status, let message):
                try await recordAuthentication(head.info, status: status, message: message)
                return .stop
            case .unknown(let status, let message):
                try await recordTransient(head.info, status: status, message: message, retryAfter: nil)
                return .stop
            }
            report.requests += 1
            let holder = try await registry.claimResource(queue: context.queueName, target: target.path, clientID: client, at: Date())
            if holder != client { return refuse("\(target.path) was written by another client") }
        }
        head.writeTargets = []
        prefetched[prefetched.startIndex] = head
        return nil
    }

    // MARK: - Fetching and composing

    /// Fetches until `count` items are prefetched (or the queue, `through` or the byte limit is reached), then starts
    /// the read-ahead when it may help; not after a failed read (the flush is ending, and would open batches only to
    /// drop them).
    private func refill(to count: Int) async throws {
        try await fill(to: count)
        startReadAhead()
    }

    private func fill(to count: Int) async throws {
        var bytes = prefetched.reduce(0) { $0 + $1.body.count }
        while prefetched.count < count && !exhausted && (prefetched.isEmpty || bytes < context.configuration.batchMaxBytes) {
            var fetched = Fetched(items: [], hadEnvelopes: false)
            if let ahead = readAhead {
                if let next = await ahead.next() {
                    fetched = try next.get()
                } else {
                    readAhead = nil
                }
                if fetched.items.isEmpty { cancelReadAhead() }
            }
            if fetched.items.isEmpty {
                // Also when the read-ahead found nothing: what was queued since is this flush's to send. A queue that
                // opens envelopes fetches, until this flush has sent something, only what its first step needs: a
                // flush whose server is down stops at its first request, and would open a prefetch for nothing at
                // every attempt.
                let started = report.delivered + report.parked > 0 || context.configuration.envelopeKeyring == nil
                fetched = try await Self.fetchOpened(
                    context, after: lastFetched,
                    maxCount: started ? max(Self.prefetchCount, count - prefetched.count) : count - prefetched.count)
            }
            let opened = fetched.items
            fetchedEnvelopes = fetched.hadEnvelopes
            guard let last = opened.last else {
                exhausted = true
                return
            }
            lastFetched = last.info.sequence
            await countKeyOpens()
            for var item in opened {
                if let through, item.info.sequence > through {
                    exhausted = true
                    return
                }
                if !item.policyApplied, item.clientID != nil, !item.info.encrypted, item.unreadable == nil {
                    // A receiver's plain item: the receiver refused what the policy refuses, so this finds its `PUT` targets.
                    if let resource = try? FHIRResource(json: item.body) {
                        item.unreadable = Self.applyPolicy(
                            context.configuration.writePolicy, to: &item, resource: resource, method: item.info.method,
                            pathType: item.info.url.isEmpty ? nil : item.info.resourceType)
                    }
                }
                // Creates only: an update sent again (A, B, then A) is a change, not a repeat.
                if item.digest == nil, let client = item.clientID, !item.info.encrypted, item.unreadable == nil,
                    item.info.method == .post
                {
                    item.digest = ContentDigest(clientID: client, plaintext: item.body)
                }
                if item.digest != nil { digestsToCheck = true }
                prefetched.append(item)
                bytes += item.body.count
            }
        }
    }

    /// Up to `maxCount` pending items after `sequence` (within the byte limit), their envelopes opened.
    private static func fetchOpened(_ context: FlushContext, after sequence: Int64, maxCount: Int) async throws -> Fetched {
        let batch = try await context.store.pendingBatch(
            queue: context.queueName, after: sequence, maxCount: maxCount,
            maxBytes: max(4 << 20, context.configuration.batchMaxBytes))
        return Fetched(
            items: await opened(
                batch, keyring: context.configuration.envelopeKeyring, policy: context.configuration.writePolicy, hooks: context.hooks),
            hadEnvelopes: batch.contains { $0.info.encrypted && $0.unreadable == nil })
    }

    /// Starts reading and opening the next batches when the last one fetched held envelopes and more may follow. What
    /// it reads is what a larger prefetch would have read: the items after the last fetched, in order, batch after
    /// batch while fewer than ``readAheadDepth`` are ready; it stops after a batch without envelopes or past `through`.
    private func startReadAhead() {
        guard readAhead == nil, !exhausted, fetchedEnvelopes, report.delivered > 0, context.configuration.envelopeKeyring != nil
        else { return }
        let context = self.context
        let through = self.through
        // At least a step's worth (a Bundle of batchSize), so that a refill takes a batch whole and opens nothing itself.
        let count = max(Self.prefetchCount, batchSize)
        readAhead = ReadAhead(
            after: lastFetched, depth: Self.readAheadDepth,
            fetch: { after in try await Self.fetchOpened(context, after: after, maxCount: count) },
            continuation: { fetched in
                guard fetched.hadEnvelopes, let last = fetched.items.last?.info.sequence, through.map({ last < $0 }) ?? true
                else { return nil }
                return last
            })
    }

    /// Ends the read-ahead of a flush that is over (what it opened is opened again by the next flush, and counted
    /// again in the opens per key: a count that may run up to ``readAheadDepth`` batches high per flush, never low).
    private func cancelReadAhead() {
        readAhead?.cancel()
        readAhead = nil
    }

    /// Adds the envelopes the keyring opened since the last batch to the store's counts per key and day (one write
    /// per batch; ``KeyOpenLog``). Counts that cannot be written are given back to be written with the next batch:
    /// a count is no reason to stop delivering.
    private func countKeyOpens() async {
        guard let keyring = context.configuration.envelopeKeyring, let log = keyOpenLog(of: context.store) else { return }
        let counts = keyring.takeOpenCounts()
        guard !counts.isEmpty else { return }
        do {
            try await log.addKeyOpens(counts, day: keyOpenDay(of: Date()))
        } catch {
            keyring.restoreOpenCounts(counts)
            context.logger.warning(
                "cannot count the envelopes opened per key; tried again with the next batch",
                metadata: ["error": "\((error as? DataQueueError)?.message ?? "\(error)")"])
        }
    }

    /// With the queue's keyring, the batch's envelopes opened, on every core and off the cooperative pool (an RSA
    /// private-key operation each: a batch of them would hold one of its few threads for a good part of a second,
    /// while a receiver's requests wait for one). Without a keyring, or without envelopes, the batch as it is.
    ///
    /// The opening threads run at a background priority: a drain is CPU work that can wait, while the receiver's
    /// requests and a FHIR server or database on the same machine (the requests the flush waits on) should not. With
    /// nothing else running the opening still has every core.
    private static func opened(
        _ batch: [StoredItem], keyring: EnvelopeKeyring?, policy: WritePolicy, hooks: TestHooks
    ) async -> [StoredItem] {
        guard let keyring, batch.contains(where: { $0.info.encrypted && $0.unreadable == nil }) else { return batch }
        let results = NIOLockedValueBox([StoredItem?](repeating: nil, count: batch.count))
        let hook = hooks.openingEnvelope
        do {
            try await OwnThread.run("dq-envelopes", priority: .background) {
                ParallelWork.forEach(batch.count) { index in
                    hook?()
                    let item = opened(batch[index], keyring: keyring, policy: policy)
                    results.withLockedValue { $0[index] = item }
                }
            }
        } catch {
            // OwnThread.run rethrows only what its body throws, and this body throws nothing.
        }
        return results.withLockedValue { $0 }.enumerated().map { $0.element ?? batch[$0.offset] }
    }

    /// An envelope as the plain create of the resource inside (opened in memory; the stored row stays the envelope),
    /// which then travels as any plain item does; one that does not open, quarantined: parked with the reason,
    /// nothing sent.
    private static func opened(_ stored: StoredItem, keyring: EnvelopeKeyring, policy: WritePolicy) -> StoredItem {
        guard stored.info.encrypted, stored.unreadable == nil else { return stored }
        var opened = stored
        do {
            let (resource, keyID) = try keyring.openNamingKey(stored.body)
            let info = stored.info
            // As a queue sends a resource it is given (DataQueue.defaultMethod): one with an id is an update (C3-PRO's
            // consumer PUT a Patient; an edge seals a device's PUT), a transaction or batch Bundle goes to the base,
            // any other is a create (conditional, so a repeat finds the first).
            let bundle = resource.isTransactionOrBatch
            let update = resource.id != nil && !bundle
            opened.info = QueuedItem(
                sequence: info.sequence, id: info.id, queue: info.queue, method: update ? .put : .post,
                url: bundle ? "" : update ? "\(resource.resourceType)/\(resource.id ?? "")" : resource.resourceType,
                resourceType: resource.resourceType, resourceID: update ? resource.id : nil, encrypted: false, state: info.state,
                attempts: info.attempts, enqueuedAt: info.enqueuedAt, lastAttemptAt: info.lastAttemptAt,
                lastStatus: info.lastStatus, lastError: info.lastError, outcome: info.outcome, size: resource.data.count,
                clientID: info.clientID)
            opened.body = resource.data
            // Creates only, as for plain items (prefetch): an update sent again (A, B, then A) is a change, not a repeat.
            opened.digest = update ? nil : stored.clientID.map { ContentDigest(clientID: $0, plaintext: resource.data) }
            opened.contentType = "application/fhir+json"
            opened.conditionalCreate = !update && !bundle
            // What a device may write: known only now that the envelope is open. The path's type is the sender's word,
            // which must name what it sealed (an unnamed path names nothing).
            if stored.clientID != nil {
                let named = info.resourceType == SealedEnvelope.unnamedType ? nil : info.resourceType
                if let refusal = applyPolicy(policy, to: &opened, resource: resource, method: update ? .put : .post, pathType: named) {
                    Counter(label: "dq_envelopes_quarantined_total", dimensions: [("key_id", keyID), ("reason", "write_policy")])
                        .increment()
                    opened.unreadable = refusal
                }
            }
        } catch {
            opened.unreadable = DataQueue.quarantinePrefix + error.description
        }
        return opened
    }

    /// The items of the next request, from the head of the prefetched ones: one, or a run for a Bundle.
    private func compose(maximum: Int) async throws -> [Prepared] {
        var run: [Prepared] = []
        var identities: Set<String> = []
        var declared: Set<String> = []
        var digests: Set<ContentDigest> = []
        var bytes = 0
        for stored in prefetched {
            if run.count >= maximum { break }
            if let digest = stored.digest, !run.isEmpty {
                // A receiver's item that may be a repeat (of one before it here, of one delivered, or not looked up
                // yet) waits to be the head, where ``skipDuplicate()`` decides after the earlier one's answer.
                if digests.contains(digest) || deliveredDigests[digest] != nil || !checkedDigests.contains(digest) { break }
            }
            // Its `PUT` targets are checked when it is the head (``claimWriteTargets()``).
            if !stored.writeTargets.isEmpty && !run.isEmpty { break }
            if let digest = stored.digest { digests.insert(digest) }
            let batchable = maximum > 1 && !stored.info.encrypted && !stored.info.url.isEmpty
            if !batchable && !run.isEmpty { break }
            let prepared = try prepare(stored)
            if prepared.failure != nil || !batchable {
                if run.isEmpty { run.append(prepared) }
                break
            }
            // A second write to one resource waits for the next Bundle: inside one, order is the server's.
            let identity =
                prepared.item.method == .put
                ? "PUT " + prepared.item.url : prepared.ifNoneExist.map { "POST " + prepared.item.url + "?" + $0 }
            if let identity, identities.contains(identity) { break }
            if let fullURL = stored.fullURL, declared.contains(fullURL) { break }
            let size = prepared.body.count + 120 + prepared.item.url.utf8.count + (prepared.ifNoneExist?.utf8.count ?? 0)
            if !run.isEmpty && bytes + size > context.configuration.batchMaxBytes { break }
            run.append(prepared)
            if let identity { identities.insert(identity) }
            if let fullURL = stored.fullURL { declared.insert(fullURL) }
            bytes += size
        }
        return try await resolveReferences(run)
    }

    /// Whether automatic mode could send `stored` as a conditional create: a plain create that can be sent.
    private func mayBeConditioned(_ stored: StoredItem) -> Bool {
        stored.unreadable == nil && stored.conditionalCreate && stored.info.method == .post && !stored.info.encrypted
            && (try? context.endpoints.url(for: stored.info)) != nil
    }

    /// The request of one item as it goes now: its URL from the configured endpoint, the condition of a
    /// conditional create (idempotent or automatic mode), and (later) its references.
    private func prepare(_ stored: StoredItem) throws -> Prepared {
        if let reason = stored.unreadable {
            // Nothing of it can be trusted: it is parked with the reason, and nothing is sent.
            let url = (try? context.endpoints.endpoint(encrypted: stored.info.encrypted)) ?? context.queueName
            let request = OutgoingRequest(method: stored.info.method, url: url, contentType: stored.contentType, body: Data())
            return Prepared(stored: stored, request: request, failure: reason)
        }
        // A row whose path dq did not write is refused here, before anything is sent.
        let url = try context.endpoints.url(for: stored.info)
        do {
            var request = try context.delivery.outgoingRequest(for: stored, url: url, declared: support?.conditionalCreate)
            request.isBundle = stored.info.url.isEmpty  // a Bundle queued as one item
            if request.ifNoneExist == nil, let source = sourceCondition(for: stored),
                let stamped = ConditionalCreate.stampingSource(request.body, source: source)
            {
                request.body = stamped
                request.ifNoneExist = "_source=" + source
            }
            return Prepared(stored: stored, request: request)
        } catch let error as DataQueueError where error.code == .invalidResource {
            let request = OutgoingRequest(method: stored.info.method, url: url, contentType: stored.contentType, body: stored.body)
            return Prepared(stored: stored, request: request, failure: error.message)
        }
    }

    /// The `meta.source` that makes a receiver's create exactly once (`urn:uuid:<item id>`, with `If-None-Exist:
    /// _source=…`): for a create a receiver queued with its client, when idempotent mode is on and the server declares
    /// both conditional create and the `_source` search for its type. A create sent again after a stop while it was
    /// on the wire then finds the first (200, journaled as already present) instead of making a second copy. Nil
    /// otherwise.
    private func sourceCondition(for stored: StoredItem) -> String? {
        guard stored.clientID != nil, stored.conditionalCreate, stored.info.method == .post, !stored.info.url.isEmpty,
            !stored.info.encrypted, context.configuration.idempotent != .never,
            let declared = support?.conditionalCreate, declared.contains(stored.info.resourceType),
            declared.contains(stored.info.resourceType + Self.sourceSearchSuffix)
        else { return nil }
        return "urn:uuid:" + stored.info.id.lowercasedString
    }

    /// How the types whose `_source` search the server declares are kept among its conditional-create types.
    static let sourceSearchSuffix = "?_source"

    /// References to `urn:uuid` fullUrls that the same request does not declare are rewritten to where the
    /// server put those resources (from the journal). An item whose reference points to a resource that was
    /// not delivered cannot go: alone, it is parked with the reason; in a run, the run ends before it.
    private func resolveReferences(_ run: [Prepared]) async throws -> [Prepared] {
        let declared = Set(run.count > 1 ? run.compactMap(\.stored.fullURL) : [])
        var wanted: Set<String> = []
        var referencesOf: [[String]] = []
        for prepared in run {
            let external = TransactionBundle.externalReferences(in: prepared.body, isBundle: prepared.item.url.isEmpty)
                .filter { !declared.contains($0) }
            referencesOf.append(external)
            wanted.formUnion(external)
        }
        guard !wanted.isEmpty else { return run }
        var locations = deliveredHere.filter { wanted.contains($0.key) }
        let rest = wanted.subtracting(locations.keys)
        if !rest.isEmpty {
            locations.merge(try await context.store.deliveredLocations(fullURLs: Array(rest).sorted())) { here, _ in here }
        }
        var unlocated: [String: UUID] = [:]
        let missing = Array(wanted.subtracting(locations.keys)).sorted()
        if !missing.isEmpty {
            unlocated = unlocatedHere.filter { missing.contains($0.key) }
            let rest = missing.filter { unlocated[$0] == nil }
            if !rest.isEmpty { unlocated.merge(try await context.store.unlocatedDeliveries(fullURLs: rest)) { here, _ in here } }
        }
        var resolved: [Prepared] = []
        for (index, var prepared) in run.enumerated() {
            if prepared.failure == nil, let missing = referencesOf[index].first(where: { locations[$0] == nil }) {
                if !resolved.isEmpty { break }
                if let delivered = unlocated[missing] {
                    prepared.failure =
                        "it references \(missing), but the server did not say where it stored item \(delivered.lowercasedString) "
                        + "(no Location, Content-Location or resource id in its answer), so the reference cannot be resolved; "
                        + "give it with dq resolve \(delivered.lowercasedString) TYPE/ID, then dq retry this item"
                } else {
                    prepared.failure =
                        "it references \(missing), whose item was not delivered (parked or dropped); retry that item first, then this one"
                }
            } else if !referencesOf[index].isEmpty {
                prepared.body = TransactionBundle.rewritingReferences(prepared.body, locations)
            }
            resolved.append(prepared)
            if prepared.failure != nil { break }
        }
        return resolved
    }

    // MARK: - Bundle size

    /// The Bundle size for this flush: the configured one, or from the server's CapabilityStatement (cached
    /// for ``DataQueue/Configuration/capabilityLifetime``), never above what the server was seen to take.
    private func effectiveBatchSize() async throws -> Int {
        let support = try await capabilities(needed: context.configuration.batchSize == nil)
        let learnt = support.batchLimit ?? Int.max
        if let explicit = context.configuration.batchSize { return max(1, min(explicit, learnt)) }
        return support.transactions == true ? max(1, min(DataQueue.Configuration.defaultBatchSize, learnt)) : 1
    }

    /// What is known of the server: from the store, and (when `needed` and not read within
    /// ``DataQueue/Configuration/capabilityLifetime``) from its CapabilityStatement, read at most once per flush.
    private func capabilities(needed: Bool) async throws -> BundleSupport {
        if let support, support.checkedAt != nil || !needed { return support }
        var support = try await context.store.bundleSupport(queue: context.queueName)
        let stale = support.checkedAt.map { Date().timeIntervalSince($0) > context.configuration.capabilityLifetime } ?? true
        if needed, !capabilityRead, support.transactions == nil || support.conditionalCreate == nil || stale {
            capabilityRead = true
            if let read = await readCapability() {
                support.transactions = read.transactions
                support.conditionalCreate = read.conditionalCreate
                support.checkedAt = Date()
                try await context.store.recordBundleSupport(
                    queue: context.queueName, transactions: read.transactions, batchLimit: nil, conditionalCreate: read.conditionalCreate)
            }
        }
        self.support = support
        return support
    }

    /// What `[base]/metadata` declares: the `transaction` interaction, and the resource types whose
    /// `conditionalCreate` is true; nil when no answer came. An answer that is not a CapabilityStatement
    /// declares neither (capabilities unknown, said once).
    private func readCapability() async -> (transactions: Bool, conditionalCreate: Set<String>)? {
        guard let response = await context.delivery.capabilityStatement(base: context.queueName) else { return nil }
        report.requests += 1
        // Not an answer about the server (it is down, busy, or wants other credentials): nothing is remembered.
        if response.status >= 500 || [401, 403, 407, 408, 429].contains(response.status) { return nil }
        guard response.status == 200,
            let object = (try? JSONSerialization.jsonObject(with: response.body)) as? [String: Any],
            object["resourceType"] as? String == "CapabilityStatement",
            let rest = object["rest"] as? [[String: Any]]
        else {
            context.logger.notice(
                "the server's /metadata is not a CapabilityStatement: its capabilities are unknown (one request per item; no conditional create trusted)",
                metadata: ["status": "\(response.status)"])
            return (false, [])
        }
        let server = rest.filter { ($0["mode"] as? String ?? "server") == "server" }
        let transactions = server.contains { part in
            (part["interaction"] as? [[String: Any]] ?? []).contains { $0["code"] as? String == "transaction" }
        }
        var conditional: Set<String> = []
        for part in server {
            // `_source` searchable on every type (the rest's own search parameters) or on the type.
            func searches(_ object: [String: Any]) -> Bool {
                (object["searchParam"] as? [[String: Any]] ?? []).contains { $0["name"] as? String == "_source" }
            }
            let everywhere = searches(part)
            for resource in part["resource"] as? [[String: Any]] ?? [] where resource["conditionalCreate"] as? Bool == true {
                guard let type = resource["type"] as? String else { continue }
                conditional.insert(type)
                if everywhere || searches(resource) { conditional.insert(type + Self.sourceSearchSuffix) }
            }
        }
        context.logger.debug(
            "read the CapabilityStatement", metadata: ["transaction": "\(transactions)", "conditionalCreate": "\(conditional.count) types"])
        return (transactions, conditional)
    }

    // MARK: - Sending

    private func sendSingle(_ prepared: Prepared) async throws -> Step {
        if let failure = prepared.failure {
            try await park(prepared, status: nil, message: failure, outcome: nil, sent: false)
            return .next
        }
        let request = prepared.request
        let result = try await send(request, first: prepared.item, encrypted: prepared.item.encrypted)
        switch result {
        case .delivered(let response, let conditional):
            // A Bundle queued as one item: its entries' locations, from the transaction-response.
            var entries: String?
            if prepared.item.url.isEmpty, let answers = TransactionBundle.parseResponse(response.body),
                let json = try? JSONEncoder().encode(answers.map(\.location))
            {
                entries = String(decoding: json, as: UTF8.self)
            }
            record(
                prepared, status: response.status, location: response.location, contentLocation: response.contentLocation,
                etag: response.etag, answer: prepared.item.url.isEmpty ? nil : response.body, conditional: conditional,
                bundle: nil, entries: entries)
            // A journal commit that failed stops the flush before the next send.
            try recorder.check()
            return .next
        case .rejected(let status, let message, let outcome):
            try await park(prepared, status: status, message: message, outcome: outcome)
            return .next
        case .transient(let status, let message, let retryAfter, _):
            try await recordTransient(prepared.item, status: status, message: message, retryAfter: retryAfter)
            return .stop
        case .authentication(let status, let message):
            try await recordAuthentication(prepared.item, status: status, message: message)
            return .stop
        }
    }

    /// Sends a run as transaction Bundles: the whole run, or (after a refusal for one bad entry) halves of it,
    /// in order, until every item is delivered or parked or a failure stops the flush.
    private func sendBundle(_ run: [Prepared]) async throws -> Step {
        var parts: [ArraySlice<Prepared>] = [run[...]]
        while let part = parts.popLast() {
            if part.count == 1 {
                if case .stop = try await sendSingle(part[part.startIndex]) { return .stop }
                continue
            }
            let bundleID = UUID().lowercasedString
            let entries = part.map { prepared in
                TransactionBundle.Entry(
                    method: prepared.item.method, path: prepared.item.url,
                    fullURL: prepared.item.method == .put
                        ? prepared.url : (prepared.stored.fullURL ?? "urn:uuid:\(prepared.item.id.lowercasedString)"),
                    ifNoneExist: prepared.ifNoneExist, body: prepared.body)
            }
            let request = OutgoingRequest(
                method: .post, url: context.queueName, contentType: "application/fhir+json",
                body: TransactionBundle.build(entries), isBundle: true)
            let first = part[part.startIndex].item
            let result = try await send(request, first: first, through: part[part.endIndex - 1].item.sequence, encrypted: false)
            report.bundleEntries += part.count
            context.metrics.bundleSize.record(part.count)
            switch result {
            case .delivered(let response, _):
                let answers = TransactionBundle.parseResponse(response.body)
                let matched = answers?.count == part.count ? answers : nil
                if matched == nil {
                    context.logger.warning(
                        "the transaction-response does not match the Bundle entry for entry; journaling without locations",
                        metadata: ["entries": "\(part.count)", "answers": "\(answers?.count ?? 0)"])
                }
                // Every entry the server accepted is kept, even after a failed journal commit (held for the next
                // flush); the failure stops the flush once all are in.
                for (index, prepared) in part.enumerated() {
                    let answer = matched?[index]
                    record(
                        prepared, status: answer?.status ?? response.status, location: answer?.location, contentLocation: nil,
                        etag: answer?.etag, answer: answer?.resource, conditional: prepared.ifNoneExist != nil && answer != nil,
                        bundle: bundleID, entries: nil)
                }
                try recorder.check()
                context.logger.debug("delivered a Bundle", metadata: ["entries": "\(part.count)", "bundle": "\(bundleID)"])
            case .rejected(let status, let message, let outcome):
                let body = Data((outcome ?? "").utf8)
                if status == 413 {
                    // Too large for this server: half the size from now on, remembered.
                    let smaller = max(1, part.count / 2)
                    try await context.store.recordBundleSupport(
                        queue: context.queueName, transactions: nil, batchLimit: smaller, conditionalCreate: nil)
                    batchSize = min(batchSize, smaller)
                    context.logger.notice("the server refused a Bundle as too large", metadata: ["entries": "\(smaller)"])
                    return .next
                }
                if let status, TransactionBundle.refusesTransactions(status: status, body: body) {
                    try await context.store.recordBundleSupport(
                        queue: context.queueName, transactions: nil, batchLimit: 1, conditionalCreate: nil)
                    batchSize = 1
                    context.logger.notice("the server refuses transaction Bundles; sending one request per item")
                    return .next
                }
                // One bad entry fails the transaction: split until it is alone (log2 of the size extra requests).
                context.logger.debug("a Bundle was refused; splitting it", metadata: ["entries": "\(part.count)", "reason": "\(message)"])
                let middle = part.startIndex + part.count / 2
                parts.append(part[middle...])
                parts.append(part[..<middle])
            case .transient(let status, let message, let retryAfter, _):
                try await recordTransient(first, status: status, message: message, retryAfter: retryAfter)
                return .stop
            case .authentication(let status, let message):
                try await recordAuthentication(first, status: status, message: message)
                return .stop
            }
        }
        return .next
    }

    /// Sends the next envelopes as one batch (``EnvelopeBatch``) to a `dq serve` that takes them: it commits all or
    /// none, in order, so one request (and one journal commit here) carries up to `maximum` of them, each with the
    /// client it came from. A refusal (a receiver that takes no batches, or one it cannot read) sends the head alone,
    /// and one envelope per request after it.
    private func sendEnvelopeBatch(maximum: Int) async throws -> Step {
        var group: [Prepared] = []
        var bytes = 0
        for stored in prefetched {
            guard group.count < maximum, stored.info.encrypted else { break }
            let prepared = try prepare(stored)
            if prepared.failure != nil {
                // It cannot go (its seal at rest does not open): parked alone, and the batch ends before it.
                if group.isEmpty { return try await sendSingle(prepared) }
                break
            }
            if !group.isEmpty && bytes + prepared.body.count > context.configuration.batchMaxBytes { break }
            bytes += prepared.body.count + 64
            group.append(prepared)
        }
        if group.count == 1 { return try await sendSingle(group[0]) }
        let body = EnvelopeBatch.encode(
            group.map { EnvelopeBatch.Entry(origin: $0.stored.clientID, type: $0.item.resourceType, envelope: $0.body) })
        let request = OutgoingRequest(
            method: .post, url: try context.endpoints.endpoint(encrypted: true), contentType: EnvelopeBatch.contentType,
            body: body)
        let first = group[0].item
        let result = try await send(request, first: first, through: group[group.count - 1].item.sequence, encrypted: true)
        switch result {
        case .delivered(let response, _) where Self.acceptedCount(response.body) == group.count:
            for prepared in group {
                record(
                    prepared, status: response.status, location: nil, contentLocation: nil, etag: nil, answer: nil,
                    conditional: false, bundle: nil, entries: nil)
            }
            try recorder.check()
            context.logger.debug("delivered an envelope batch", metadata: ["envelopes": "\(group.count)"])
            return .next
        case .delivered(let response, _):
            // A 2xx that does not count the batch's envelopes is no dq serve's answer (a receiver that takes one
            // envelope, a proxy): nothing of it is counted as delivered; one envelope per request from here.
            batchesEnvelopes = false
            context.logger.notice(
                "the encrypted endpoint answered an envelope batch without counting it; sending one envelope per request",
                metadata: ["status": "\(response.status)"])
            return .next
        case .rejected(let status, let message, _):
            batchesEnvelopes = false
            context.logger.notice(
                "the encrypted endpoint refused an envelope batch; sending one envelope per request",
                metadata: ["status": "\(status.map(String.init) ?? "-")", "reason": "\(message)"])
            return .next
        case .transient(let status, let message, let retryAfter, _):
            try await recordTransient(first, status: status, message: message, retryAfter: retryAfter)
            return .stop
        case .authentication(let status, let message):
            try await recordAuthentication(first, status: status, message: message)
            return .stop
        }
    }

    /// The `accepted` count of a receiver's answer to an envelope batch (`{"accepted": n}`), if it is one.
    private static func acceptedCount(_ body: Data) -> Int? {
        ((try? JSONSerialization.jsonObject(with: body)) as? [String: Any])?["accepted"] as? Int
    }

    /// Sends the next encrypted items at once (`encryption.in_flight`), then records every answer in queue order:
    /// order is given up for the encrypted endpoint only, never for what is recorded.
    private func sendEnvelopes(maximum: Int) async throws -> Step {
        var group: [Prepared] = []
        for stored in prefetched {
            guard group.count < maximum, stored.info.encrypted else { break }
            let prepared = try prepare(stored)
            if prepared.failure != nil {
                // It cannot go (its seal at rest does not open): parked alone, and the group ends before it.
                if group.isEmpty { return try await sendSingle(prepared) }
                break
            }
            group.append(prepared)
        }
        try await markInFlight(through: group[group.count - 1].item.sequence)
        let results = await withTaskGroup(of: (Int, Delivery.Outcome).self) { tasks in
            for (index, prepared) in group.enumerated() {
                let request = prepared.request
                tasks.addTask { [delivery = context.delivery] in (index, await delivery.deliver(request, encrypted: true)) }
            }
            var results = [Delivery.Outcome?](repeating: nil, count: group.count)
            for await (index, result) in tasks { results[index] = result }
            return results.compactMap { $0 }
        }
        report.requests += group.count
        var unsettled = false
        var stop: (QueuedItem, Int?, String, TimeInterval?)?
        var authentication: (QueuedItem, Int?, String)?
        // Every accepted envelope first, so that a failed journal commit (or park) cannot drop one the receiver has.
        for (prepared, result) in zip(group, results) {
            if case .delivered(let response, _) = result {
                record(
                    prepared, status: response.status, location: response.location, contentLocation: response.contentLocation,
                    etag: response.etag, answer: nil, conditional: false, bundle: nil, entries: nil)
            }
        }
        try recorder.check()
        for (prepared, result) in zip(group, results) {
            switch result {
            case .delivered: break
            case .rejected(let status, let message, let outcome):
                try await park(prepared, status: status, message: message, outcome: outcome)
            case .transient(let status, let message, let retryAfter, let mayHaveArrived):
                unsettled = unsettled || (status == nil && mayHaveArrived)
                if stop == nil { stop = (prepared.item, status, message, retryAfter) }
            case .authentication(let status, let message):
                if authentication == nil { authentication = (prepared.item, status, message) }
            }
        }
        try await settleInFlight(answered: !unsettled)
        if let (item, status, message) = authentication {
            try await recordAuthentication(item, status: status, message: message)
            return .stop
        }
        if let (item, status, message, retryAfter) = stop {
            try await recordTransient(item, status: status, message: message, retryAfter: retryAfter)
            return .stop
        }
        return .next
    }

    /// Sends one request with the in-flight marker set (naming the last of its items, `through`: after a stop, every
    /// pending item up to it may be on the server), and counts it.
    private func send(
        _ request: OutgoingRequest, first: QueuedItem, through: Int64? = nil, encrypted: Bool
    ) async throws -> Delivery.Outcome {
        try await markInFlight(through: max(through ?? first.sequence, first.sequence))
        let started = ContinuousClock.now
        let result = await context.delivery.deliver(request, encrypted: encrypted)
        context.metrics.requestDuration.record(duration: ContinuousClock.now - started)
        report.requests += 1
        switch result {
        case .transient(let status, _, _, _): context.metrics.failure(status: status)
        case .authentication(let status, _): context.metrics.failure(status: status, authentication: true)
        default: break
        }
        // Without an answer (connection lost, timeout) the request may still be at the server: the marker stays,
        // so that the next flush lets it settle first. A request that never left leaves nothing to settle.
        if case .transient(nil, _, _, mayHaveArrived: true) = result {
            try await settleInFlight(answered: false)
        } else {
            try await settleInFlight(answered: true)
        }
        return result
    }

    /// Notes the request about to go (naming its last item, and never less than ``resentThrough`` while items up to
    /// it wait to be sent again).
    private func markInFlight(through sequence: Int64) async throws {
        try await lock.markInFlight(sequence: resentPassed ? sequence : max(sequence, resentThrough ?? sequence))
    }

    /// Clears the note after a request that was answered (or never left), unless it must still name the items an
    /// earlier stop left unsettled; keeps it after one without an answer.
    private func settleInFlight(answered: Bool) async throws {
        unanswered = !answered
        if answered && resentPassed { try await lock.clearInFlight() }
    }

    // MARK: - Recording

    /// Journals a delivery. The server id comes from `location`, else `contentLocation`, else the resource in
    /// `answer` (see ``Delivery/serverIdentity(location:contentLocation:etag:answer:resourceType:method:resourceID:)``);
    /// the journal line's note says when it did not come from `Location`.
    private func record(
        _ prepared: Prepared, status: Int, location: String?, contentLocation: String?, etag: String?, answer: Data?,
        conditional: Bool, bundle: String?, entries: String?
    ) {
        let item = prepared.item
        let identity = Delivery.serverIdentity(
            location: location, contentLocation: contentLocation, etag: etag, answer: answer, resourceType: item.resourceType,
            method: item.method, resourceID: item.resourceID)
        let (serverID, versionID) = (identity.id, identity.version)
        let location = location ?? (identity.id != nil ? contentLocation : nil)
        if serverID == nil, let fullURL = prepared.stored.fullURL {
            unlocatedHere[fullURL] = item.id
            context.logger.warning(
                "the server did not say where it stored an item that others may reference",
                metadata: ["item": "\(item.id.lowercasedString)"])
        }
        // A conditional create answered 200 found the resource already there (an earlier attempt whose answer
        // was lost, or the same data sent before), where the server declares conditional create for the type; a
        // server that ignores If-None-Exist answers 200 to a plain create too.
        let declared = support?.conditionalCreate?.contains(item.resourceType) ?? false
        if conditional && !declared && warnedConditional.insert(item.resourceType).inserted {
            context.logger.warning(
                "the server does not declare conditional create for this type: idempotent mode cannot keep a retried create from making a duplicate",
                metadata: ["type": "\(item.resourceType)"])
        }
        let event: DeliveryRecord.Event = conditional && declared && status == 200 ? .alreadyPresent : .delivered
        var note = identity.note
        if event == .delivered, !(conditional && declared), let resentThrough, item.sequence <= resentThrough, !item.encrypted {
            // Sent before a stop (its answer or its journal line lost) and again now, with nothing the server could
            // recognise it by: said, counted and listed (dq status, dq log --possible-duplicates), never hidden.
            note =
                DeliveryRecord.possibleDuplicateNote
                + "sent again after a stop while it or its journal line was on the way; the server may hold it twice"
                + (identity.note.map { "; \($0)" } ?? "")
            context.metrics.possibleDuplicate()
            context.logger.warning(
                "delivered an item that an earlier flush may have delivered already (a possible second copy)",
                metadata: ["item": "\(item.id.lowercasedString)"])
        }
        recorder.append(
            CompletedDelivery(
                item: item, event: event, url: prepared.url, status: status, location: location, serverID: serverID,
                versionID: versionID, note: note, fullURL: prepared.stored.fullURL, bundle: bundle, entries: entries,
                digest: prepared.stored.digest))
        if let digest = prepared.stored.digest { deliveredDigests[digest] = item.id }
        handled.insert(item.sequence)
        report.delivered += 1
        context.metrics.deliveredOne()
        if let fullURL = prepared.stored.fullURL, let serverID {
            deliveredHere[fullURL] = item.resourceType + "/" + serverID
        }
        context.logger.debug("delivered", metadata: ["item": "\(item.id.lowercasedString)", "status": "\(status)"])
        if item.sequence == tracking {
            tracked = .delivered(
                DeliveryRecord(
                    sequence: 0, id: item.id, event: event, queue: item.queue, method: item.method, url: prepared.url,
                    resourceType: item.resourceType, status: status, location: location, serverID: serverID,
                    versionID: versionID, attempts: item.attempts + 1, enqueuedAt: item.enqueuedAt, at: Date(),
                    fullURL: prepared.stored.fullURL, bundle: bundle))
        }
        progress?(FlushReport.Progress(delivered: report.delivered, parked: report.parked, item: item))
    }

    /// Parks an item: one the server rejected, or (`sent: false`) one dq holds back without sending it.
    private func park(_ prepared: Prepared, status: Int?, message: String, outcome: String?, sent: Bool = true) async throws {
        // Earlier deliveries reach the journal before this item's state changes.
        try await recorder.finish()
        let item = prepared.item
        try await context.store.park(item, url: prepared.url, status: status, error: message, outcome: outcome, owner: lock)
        handled.insert(item.sequence)
        report.parked += 1
        if !sent { report.held += 1 }
        context.metrics.parked.increment()
        context.logger.warning("parked", metadata: ["item": "\(item.id.lowercasedString)", "reason": "\(message)"])
        if item.sequence == tracking { tracked = .parked(item, reason: message) }
        progress?(FlushReport.Progress(delivered: report.delivered, parked: report.parked, item: item))
    }

    private func recordTransient(_ item: QueuedItem, status: Int?, message: String, retryAfter: TimeInterval?) async throws {
        // The journal commit clears the backoff: it must land before the failure is recorded, or a late commit
        // would erase the backoff this failure starts.
        try await recorder.finish()
        let failures = (try await context.store.serverState(queue: context.queueName).failures) + 1
        let retryAt = Date().addingTimeInterval(
            context.configuration.retryPolicy.delay(afterFailures: failures, retryAfter: retryAfter))
        try await context.store.recordFailure(
            queue: context.queueName, item: item, status: status, error: message, nextAttemptAt: retryAt, owner: lock)
        report.stop = .transient(message, retryAt: retryAt)
        // The caller says it once (dq flush prints it; the service logs each change of state).
        context.logger.debug("flush stopped", metadata: ["reason": "\(message)"])
    }

    /// A refused credential backs off as a transient failure does: retrying it at once only repeats the refusal.
    private func recordAuthentication(_ item: QueuedItem, status: Int?, message: String) async throws {
        try await recorder.finish()
        let failures = (try await context.store.serverState(queue: context.queueName).failures) + 1
        let retryAt = Date().addingTimeInterval(context.configuration.retryPolicy.delay(afterFailures: failures, retryAfter: nil))
        // Recorded as a refusal, so that a flush inside the backoff says the credentials are refused (not "later").
        try await context.store.recordFailure(
            queue: context.queueName, item: item, status: status, error: FlushReport.Stop.refusedCredentials + message,
            nextAttemptAt: retryAt, owner: lock)
        report.stop = .authentication(message)
        context.logger.debug("authentication failed", metadata: ["reason": "\(message)"])
    }
}
