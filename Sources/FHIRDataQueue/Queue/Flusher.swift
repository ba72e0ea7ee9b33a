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
    let context: FlushContext
    let lock: any FlushOwnership
    let recorder: DeliveryRecorder
    let limit: Int?
    let through: Int64?
    let tracking: Int64?
    let progress: (@Sendable (FlushReport.Progress) -> Void)?
    /// The last item an earlier flush of this queue was sending when it stopped (its in-flight note): a pending item
    /// up to it was sent then (its answer or its journal line lost), and may be on the server already.
    let resentThrough: Int64?
    /// Whether every pending item up to ``resentThrough`` is behind this flush (the head is past it, or the queue
    /// is empty): until then the in-flight note keeps naming it, so that a second stop before they are sent again
    /// leaves them marked for the next flush.
    var resentPassed: Bool
    /// Whether the last request ended without an answer (its note must stay for the next flush).
    var unanswered = false

    var report = FlushReport()
    var tracked: SendOutcome?
    /// Pending items after the last one handled, in order; fetched ahead (a ring: the handled ones leave
    /// its head without moving the rest).
    var prefetched = CircularBuffer<StoredItem>()
    /// How many items one read fetches ahead at least: a read waits while a journal commit holds the
    /// database, so fewer reads are fewer waits.
    static let prefetchCount = 256
    var lastFetched: Int64 = 0
    var exhausted = false
    /// The batches after the prefetched ones, read and opened while they are sent (started only after a batch
    /// that held envelopes: opening is the CPU work of a drain, and it then overlaps the requests and the journal).
    var readAhead: ReadAhead<Fetched>?
    /// How many batches the read-ahead keeps ready.
    static let readAheadDepth = 2
    /// Whether the last batch fetched held envelopes.
    var fetchedEnvelopes = false

    /// A batch read from the store, its envelopes opened.
    struct Fetched: Sendable {
        var items: [StoredItem]
        var hadEnvelopes: Bool
    }
    /// The items of the current step that were delivered or parked (they leave the prefetched ones).
    var handled: Set<Int64> = []
    var batchSize = 1
    /// Whether the encrypted endpoint still takes envelope batches (``DataQueue/Configuration/envelopeBatches``):
    /// after a refusal, one envelope per request for the rest of the flush.
    var batchesEnvelopes = true
    /// Where this flush's deliveries with a fullUrl went (`Type/id`): their journal commits may still be on
    /// the way when a later item references them.
    var deliveredHere: [String: String] = [:]
    /// This flush's deliveries with a fullUrl whose server did not say where it stored them.
    var unlocatedHere: [String: UUID] = [:]
    /// What is known of the server (read once per flush).
    var support: BundleSupport?
    var capabilityRead = false
    /// The items of deliveries an earlier flush could not journal (already named in the log).
    var heldBefore: Set<UUID> = []
    /// Types whose conditional create the server does not declare, already warned about in this flush.
    var warnedConditional: Set<String> = []
    /// Receiver items' digests known delivered (by this flush, or within the dedupe window by the store), with the
    /// item that was: a later item with one is a repeat (see ``skipDuplicate()``).
    var deliveredDigests: [ContentDigest: UUID] = [:]
    /// Digests looked up in the store already.
    var checkedDigests: Set<ContentDigest> = []
    /// Whether items with digests were prefetched since the last look-up.
    var digestsToCheck = false

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
    enum Step {
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
    func recordHeldDeliveries() async throws {
        let held = context.heldDeliveries.takeAll()
        guard !held.isEmpty else { return }
        heldBefore = Set(held.map(\.item.id))
        for delivery in held { recorder.append(delivery) }
        try await recorder.finish()
        context.logger.notice("journaled deliveries an earlier flush could not write", metadata: ["count": "\(held.count)"])
    }

    func loop() async throws {
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
    func skipDuplicate() async throws -> Bool {
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
    func claimWriteTargets() async throws -> Step? {
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
}
