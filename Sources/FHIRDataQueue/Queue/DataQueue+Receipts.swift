import Foundation

/// What a receiver's request with an `Idempotency-Key` asks to be stored with its item.
package struct IdempotentRequest: Sendable {
    /// The `Idempotency-Key` value.
    package var key: String
    /// The hex SHA-256 of what the request asked for (see ``Receipt/fingerprint``).
    package var fingerprint: String
    /// The answer, when it is known before the commit (an envelope's 202), so that it commits with the item.
    package var answer: (status: Int, contentType: String?, body: Data)?

    /// A request's key and fingerprint, and its answer when known up front.
    package init(key: String, fingerprint: String, answer: (status: Int, contentType: String?, body: Data)? = nil) {
        self.key = key
        self.fingerprint = fingerprint
        self.answer = answer
    }
}

/// What a receiver's enqueue did.
package enum ReceivedEnqueue: Sendable {
    /// Committed (with its receipt, when the request had a key).
    case queued(QueuedItem)
    /// The key was used already: nothing was stored; the first request's receipt.
    case repeated(Receipt)
}

// The receiving side (`dq serve`): items that carry the client that sent them, and `Idempotency-Key` receipts.
extension DataQueue {
    /// How long a receiver's repeats are recognised: a receipt's key, and a delivered resource's digest (see
    /// ``Configuration/duplicateWindow``).
    package var duplicateWindow: TimeInterval { configuration.duplicateWindow }

    /// Durably queues an envelope a receiver took from `clientID`, with the request's receipt when it had a key.
    ///
    /// - Throws: as ``enqueue(_:)->QueuedItem``; ``DataQueueError`` (`.invalidConfiguration`) when the queue's store
    ///   keeps no receipts.
    package func enqueue(_ envelope: SealedEnvelope, from clientID: String, idempotency: IdempotentRequest?) async throws
        -> ReceivedEnqueue
    {
        try await received(try newItem(for: envelope), from: clientID, idempotency: idempotency)
    }

    /// Durably queues a plain resource a receiver took from `clientID`, with the request's receipt when it had a key.
    ///
    /// - Throws: as ``enqueue(_:method:fullURL:)``, and as the envelope's.
    package func enqueue(_ resource: FHIRResource, method: FHIRMethod, from clientID: String, idempotency: IdempotentRequest?)
        async throws -> ReceivedEnqueue
    {
        try await received(try newItem(for: resource, method: method), from: clientID, idempotency: idempotency)
    }

    /// The receipt of `key` from `clientID` within the window, if any.
    package func receipt(clientID: String, key: String) async throws -> Receipt? {
        try await receipts().receipt(clientID: clientID, key: key, since: Date().addingTimeInterval(-duplicateWindow))
    }

    /// Records the answer given to a receipt's first request (a plain resource's, made after its commit).
    package func recordAnswer(_ receipt: Receipt) async throws {
        try await receipts().recordAnswer(receipt)
    }

    private func receipts() throws -> any ReceiptStore {
        guard let receipts = receiptStore else {
            throw DataQueueError(.invalidConfiguration, "this queue's store cannot keep a receiver's receipts")
        }
        return receipts
    }

    private func received(_ made: NewItem, from clientID: String, idempotency: IdempotentRequest?) async throws
        -> ReceivedEnqueue
    {
        var item = made
        item.clientID = clientID
        let receipts = try receipts()
        let now = Date()
        let sequence: Int64
        if let idempotency {
            let receipt = Receipt(
                clientID: clientID, key: idempotency.key, fingerprint: idempotency.fingerprint, itemID: item.id,
                status: idempotency.answer?.status, contentType: idempotency.answer?.contentType, body: idempotency.answer?.body,
                createdAt: now)
            // Its own transaction: the receipt's insert refuses a key taken already, and that refusal must not fail
            // the other enqueues a grouped commit would carry.
            switch try await receipts.insert(item, receipt: receipt, expiredBefore: now.addingTimeInterval(-duplicateWindow)) {
            case .taken(let first): return .repeated(first)
            case .stored(let stored): sequence = stored
            }
        } else {
            sequence = try await store.insertGrouped(item)
        }
        metrics.enqueued.increment()
        wakeUp.signal()
        return .queued(queuedItem(item, sequence: sequence))
    }
}
