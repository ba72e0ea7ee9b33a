import Foundation

// What an operator sees and does with one queue: counts, items, retry, drop, the journal.
extension DataQueue {
    /// Counts for this queue (and the queue's gauges set from them).
    ///
    /// - Parameter countingJournal: count the delivery journal (``QueueStatus/delivered`` and
    ///   ``QueueStatus/duplicates``), which takes time in proportion to its length (a receiver keeps months of
    ///   deliveries). Without it both read 0, and the rest takes the same short time however long the journal is: what
    ///   a gauge or a probe needs.
    public func status(countingJournal: Bool = true) async throws -> QueueStatus {
        if countingJournal { hooks.countingJournal?() }
        let status = try await store.status(queue: queueName, countingJournal: countingJournal)
        metrics.update(from: status)
        return status
    }

    /// What dq last read of this queue's server from its CapabilityStatement (nil values: not read yet).
    public func serverCapabilities() async throws -> DataQueue.ServerCapabilities {
        let support = try await store.bundleSupport(queue: queueName)
        return DataQueue.ServerCapabilities(
            transactions: support.transactions,
            conditionalCreate: support.conditionalCreate.map { $0.filter { !$0.hasSuffix(Flusher.sourceSearchSuffix) }.sorted() },
            sourceSearch: support.conditionalCreate.map {
                $0.filter { $0.hasSuffix(Flusher.sourceSearchSuffix) }.map { String($0.dropLast(Flusher.sourceSearchSuffix.count)) }
                    .sorted()
            },
            readAt: support.checkedAt)
    }

    /// Items of this queue in order, optionally only those in `state`.
    public func items(state: QueuedItem.State? = nil, limit: Int = 1000) async throws -> [QueuedItem] {
        try await store.items(queue: queueName, state: state, limit: limit)
    }

    /// One item by UUID (or a unique prefix or suffix of at least 4 characters) or by sequence number, with its
    /// body. Digits alone are tried both ways and throw when they name two different items; `#42` is sequence 42.
    public func item(_ reference: String) async throws -> (QueuedItem, Data) {
        let stored = try await store.item(reference)
        if let reason = stored.unreadable {
            // Sealed at rest: without its key a configuration error, with a seal that does not verify damage.
            throw DataQueueError(reason.contains("at_rest.key_file") ? .invalidConfiguration : .damaged, reason)
        }
        return (stored.info, stored.body)
    }

    /// The state of an item, or nil when it is no longer queued (delivered or dropped: see the journal).
    public func state(of id: UUID) async throws -> QueuedItem.State? {
        do {
            return try await store.item(id.lowercasedString).info.state
        } catch let error as DataQueueError where error.code == .notFound {
            return nil
        }
    }

    /// Puts a parked item back in line (it keeps its place in the order).
    ///
    /// - Parameters:
    ///   - reference: the item's UUID, a unique prefix or suffix of it, or its sequence number.
    ///   - conditionalCreate: `false` sends the item as a plain create from now on, even in idempotent mode
    ///     (for a server that refuses its `If-None-Exist`); `true` lets idempotent mode apply to it again. The
    ///     default, nil, keeps the item's setting.
    /// - Throws: `.notFound` when no parked item matches.
    public func retry(_ reference: String, conditionalCreate: Bool? = nil) async throws -> QueuedItem {
        let stored = try await store.item(reference)
        guard try await store.retry(sequence: stored.info.sequence, conditionalCreate: conditionalCreate) else {
            throw DataQueueError(.notFound, "item \(stored.info.id.lowercasedString) is not parked")
        }
        return stored.info
    }

    /// Records where the server stored a delivered item whose answer did not say (no `Location`,
    /// `Content-Location` or resource id), so that the items referencing its `fullUrl` can be sent: retry them
    /// after this.
    ///
    /// - Parameters:
    ///   - reference: the delivered item's UUID, a unique prefix or suffix of it, or its sequence number.
    ///   - location: `Type/id` or `Type/id/_history/version`, of the item's resource type.
    /// - Returns: the journal line, updated.
    /// - Throws: `.notFound` when no delivered item matches; `.invalidResource` when `location` is not of that form
    ///   or type, or the journal already knows where the item is.
    public func resolveLocation(of reference: String, at location: String) async throws -> DeliveryRecord {
        guard let record = try await store.journalLine(reference), [.delivered, .alreadyPresent].contains(record.event) else {
            throw DataQueueError(.notFound, "no delivered item matches \(reference)")
        }
        let parts = location.split(separator: "/", omittingEmptySubsequences: false).map(String.init)
        guard parts.count == 2 || (parts.count == 4 && parts[2] == "_history" && FHIRResource.isValidID(parts[3])),
            parts[0] == record.resourceType, FHIRResource.isValidID(parts[1])
        else {
            throw DataQueueError(
                .invalidResource, "the location must be \(record.resourceType)/ID or \(record.resourceType)/ID/_history/VERSION")
        }
        if let known = record.serverID {
            throw DataQueueError(
                .invalidResource, "the journal already has item \(record.id.lowercasedString) at \(record.resourceType)/\(known)")
        }
        guard
            try await store.resolveLocation(
                itemID: record.id, location: location, serverID: parts[1], versionID: parts.count == 4 ? parts[3] : nil,
                note: "location given by an operator (dq resolve)")
        else {
            throw DataQueueError(.notFound, "no delivered item matches \(reference)")
        }
        guard let updated = try await store.journalLine(record.id.lowercasedString) else {
            throw DataQueueError(.notFound, "no delivered item matches \(reference)")
        }
        logger.notice("location given by an operator", metadata: ["item": "\(record.id.lowercasedString)"])
        return updated
    }

    /// Puts every parked item of this queue back in line. Returns how many.
    public func retryAllParked() async throws -> Int {
        try await store.retryAllParked(queue: queueName)
    }

    /// Removes an item without sending it; the journal records the drop.
    ///
    /// Takes the flush lock (waiting up to ``Configuration/lockWait``), so an item is never dropped while a
    /// flush is sending it.
    /// - Throws: `.notFound`, or `.busy` when a flush holds the lock longer.
    public func drop(_ reference: String) async throws -> QueuedItem {
        guard
            let lock = try await store.acquireFlush(
                queue: queueName, until: .now + .milliseconds(Int64(configuration.lockWait * 1000)))
        else {
            throw DataQueueError(.busy, "a flush of this queue is running; try again when it ends")
        }
        do {
            let stored = try await store.item(reference)
            try await store.drop(stored.info, url: (try? requestURL(for: stored.info)) ?? stored.info.url)
            await lock.release()
            return stored.info
        } catch {
            await lock.release()
            throw error
        }
    }

    /// The newest journal line of an item that is no longer queued (delivered, already present or dropped),
    /// or its parking: by UUID, a unique prefix or suffix, or sequence number. Nil when the journal has none.
    public func journalRecord(_ reference: String) async throws -> DeliveryRecord? {
        try await store.journalLine(reference)
    }

    /// Every queue in this queue's database with its counts (servers other than this one included), so that
    /// an operator sees all that is pending whatever server they name.
    ///
    /// - Parameter countingJournal: as for ``status(countingJournal:)``: without it, `delivered` and `duplicates` read
    ///   0 and the time does not grow with the journal (what a flush that points out other queues' pending items needs).
    public func allQueueStatuses(countingJournal: Bool = true) async throws -> [QueueStatus] {
        if countingJournal { hooks.countingJournal?() }
        return try await store.allStatuses(countingJournal: countingJournal)
    }

    /// The delivery journal of this queue, oldest first (the newest `limit` lines).
    public func deliveries(limit: Int = 1000) async throws -> [DeliveryRecord] {
        try await store.deliveries(queue: queueName, limit: limit)
    }

    /// Deletes the journal lines older than `age` seconds, of every queue in the database (never a queued
    /// item); returns how many. A delivered item's line is what resolves later references to its `fullUrl`
    /// and what `dq show` finds once it has left the queue: past the retention both are gone. `progress` is
    /// told how many lines are deleted so far, after each short transaction.
    ///
    /// A receiver's `Idempotency-Key` receipts and delivered digests older than ``Configuration/duplicateWindow``
    /// go too (they count for that window only).
    public func pruneJournal(olderThan age: TimeInterval, progress: @Sendable (Int) -> Void = { _ in }) async throws -> Int {
        let removed = try await store.pruneJournal(before: Date().addingTimeInterval(-age), progress: progress)
        _ = try await receiptStore?.pruneReceipts(before: Date().addingTimeInterval(-duplicateWindow))
        return removed
    }

    /// Gives the space of deleted journal lines and items back to the file system (SQLite's `VACUUM`, which
    /// needs free space for a copy of the file). PostgreSQL's autovacuum does this on its own: a no-op there.
    public func vacuum() async throws {
        try await store.vacuum()
    }
}
