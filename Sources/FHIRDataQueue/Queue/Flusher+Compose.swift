import Foundation
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore

extension Flusher {
    // MARK: - Fetching and composing

    /// Fetches until `count` items are prefetched (or the queue, `through` or the byte limit is reached), then starts
    /// the read-ahead when it may help; not after a failed read (the flush is ending, and would open batches only to
    /// drop them).
    func refill(to count: Int) async throws {
        try await fill(to: count)
        startReadAhead()
    }

    func fill(to count: Int) async throws {
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
    static func fetchOpened(_ context: FlushContext, after sequence: Int64, maxCount: Int) async throws -> Fetched {
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
    func startReadAhead() {
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
    func cancelReadAhead() {
        readAhead?.cancel()
        readAhead = nil
    }

    /// Adds the envelopes the keyring opened since the last batch to the store's counts per key and day (one write
    /// per batch; ``KeyOpenLog``). Counts that cannot be written are given back to be written with the next batch:
    /// a count is no reason to stop delivering.
    func countKeyOpens() async {
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
    static func opened(
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
    static func opened(_ stored: StoredItem, keyring: EnvelopeKeyring, policy: WritePolicy) -> StoredItem {
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
    func compose(maximum: Int) async throws -> [Prepared] {
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
    func mayBeConditioned(_ stored: StoredItem) -> Bool {
        stored.unreadable == nil && stored.conditionalCreate && stored.info.method == .post && !stored.info.encrypted
            && (try? context.endpoints.url(for: stored.info)) != nil
    }

    /// The request of one item as it goes now: its URL from the configured endpoint, the condition of a
    /// conditional create (idempotent or automatic mode), and (later) its references.
    func prepare(_ stored: StoredItem) throws -> Prepared {
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
    func sourceCondition(for stored: StoredItem) -> String? {
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
    func resolveReferences(_ run: [Prepared]) async throws -> [Prepared] {
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
    func effectiveBatchSize() async throws -> Int {
        let support = try await capabilities(needed: context.configuration.batchSize == nil)
        let learnt = support.batchLimit ?? Int.max
        if let explicit = context.configuration.batchSize { return max(1, min(explicit, learnt)) }
        return support.transactions == true ? max(1, min(DataQueue.Configuration.defaultBatchSize, learnt)) : 1
    }

    /// What is known of the server: from the store, and (when `needed` and not read within
    /// ``DataQueue/Configuration/capabilityLifetime``) from its CapabilityStatement, read at most once per flush.
    func capabilities(needed: Bool) async throws -> BundleSupport {
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
    func readCapability() async -> (transactions: Bool, conditionalCreate: Set<String>)? {
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
}
