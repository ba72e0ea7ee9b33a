import Foundation
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore

extension Flusher {
    // MARK: - Sending

    func sendSingle(_ prepared: Prepared) async throws -> Step {
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
    func sendBundle(_ run: [Prepared]) async throws -> Step {
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
    func sendEnvelopeBatch(maximum: Int) async throws -> Step {
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
    static func acceptedCount(_ body: Data) -> Int? {
        ((try? JSONSerialization.jsonObject(with: body)) as? [String: Any])?["accepted"] as? Int
    }

    /// Sends the next encrypted items at once (`encryption.in_flight`), then records every answer in queue order:
    /// order is given up for the encrypted endpoint only, never for what is recorded.
    func sendEnvelopes(maximum: Int) async throws -> Step {
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
    func send(
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
    func markInFlight(through sequence: Int64) async throws {
        try await lock.markInFlight(sequence: resentPassed ? sequence : max(sequence, resentThrough ?? sequence))
    }

    /// Clears the note after a request that was answered (or never left), unless it must still name the items an
    /// earlier stop left unsettled; keeps it after one without an answer.
    func settleInFlight(answered: Bool) async throws {
        unanswered = !answered
        if answered && resentPassed { try await lock.clearInFlight() }
    }

    // MARK: - Recording

    /// Journals a delivery. The server id comes from `location`, else `contentLocation`, else the resource in
    /// `answer` (see ``Delivery/serverIdentity(location:contentLocation:etag:answer:resourceType:method:resourceID:)``);
    /// the journal line's note says when it did not come from `Location`.
    func record(
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
    func park(_ prepared: Prepared, status: Int?, message: String, outcome: String?, sent: Bool = true) async throws {
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

    func recordTransient(_ item: QueuedItem, status: Int?, message: String, retryAfter: TimeInterval?) async throws {
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
    func recordAuthentication(_ item: QueuedItem, status: Int?, message: String) async throws {
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
