import Foundation

/// Several envelopes in one request, from a `dq serve --role edge` to the `dq serve` inside that opens them
/// (``DataQueue/Configuration/envelopeBatches``): a JSON array of `{"origin", "type", "envelope"}` objects, in
/// queue order, sent with ``contentType`` to the encrypted endpoint. The receiver commits all of them or none, in
/// that order, before it answers, so one request (and one commit on each side) carries many envelopes and the
/// order holds. `envelope` is the envelope's JSON text as a string (its bytes unchanged), `type` the resource type
/// the device named, `origin` the client the edge took it from (the receiver keeps it, under the edge's own id, for
/// its repeat check).
package enum EnvelopeBatch {
    /// The media type of a batch.
    package static let contentType = "application/vnd.dq.envelope-batch+json"
    /// The most envelopes a receiver takes in one batch, and an edge sends (fewer when `batch_size` says so).
    package static let maximumEntries = 1000

    /// One envelope of a batch.
    package struct Entry: Sendable, Equatable {
        /// The client the edge took it from, if known.
        package var origin: String?
        /// The resource type the device named (``SealedEnvelope/unnamedType`` when it named none).
        package var type: String
        /// The envelope's JSON, as the device sent it.
        package var envelope: Data

        /// An entry.
        package init(origin: String?, type: String, envelope: Data) {
            self.origin = origin
            self.type = type
            self.envelope = envelope
        }
    }

    /// Whether a request's `Content-Type` is a batch's.
    package static func isBatch(contentType: String?) -> Bool {
        // Most requests are single envelopes (application/json): told apart without making strings.
        guard let contentType, contentType.utf8.count >= Self.contentType.utf8.count,
            !contentType.utf8.starts(with: "application/json".utf8)
        else { return false }
        return contentType.split(separator: ";").first?.trimmingCharacters(in: .whitespaces).lowercased() == Self.contentType
    }

    /// The request body of `entries`.
    package static func encode(_ entries: [Entry]) -> Data {
        let objects: [[String: String]] = entries.map { entry in
            var object = ["type": entry.type, "envelope": String(decoding: entry.envelope, as: UTF8.self)]
            if let origin = entry.origin { object["origin"] = origin }
            return object
        }
        return (try? JSONSerialization.data(withJSONObject: objects, options: [.sortedKeys, .withoutEscapingSlashes])) ?? Data("[]".utf8)
    }

    /// The entries of a request body.
    /// - Throws: ``DataQueueError`` with `.invalidResource` naming the first entry that is not as ``encode(_:)`` makes it.
    package static func decode(_ body: Data) throws(DataQueueError) -> [Entry] {
        guard let list = (try? JSONSerialization.jsonObject(with: body)) as? [Any] else {
            throw DataQueueError(.invalidResource, "an envelope batch must be a JSON array")
        }
        guard !list.isEmpty else { throw DataQueueError(.invalidResource, "the envelope batch is empty") }
        var entries: [Entry] = []
        entries.reserveCapacity(list.count)
        for (index, element) in list.enumerated() {
            guard let object = element as? [String: Any], let type = object["type"] as? String,
                let envelope = object["envelope"] as? String, object["origin"] == nil || object["origin"] is String
            else {
                throw DataQueueError(
                    .invalidResource,
                    "envelope batch entry \(index + 1) is not {\"type\", \"envelope\"} strings (and an optional \"origin\")")
            }
            entries.append(Entry(origin: object["origin"] as? String, type: type, envelope: Data(envelope.utf8)))
        }
        return entries
    }
}

extension DataQueue {
    /// Durably queues the envelopes of a batch an edge forwarded, in its order, all or none (one transaction), each
    /// with the client it came from, for the repeat check.
    ///
    /// - Throws: ``DataQueueError`` as ``enqueue(_:)->QueuedItem`` does; nothing is queued then.
    package func enqueue(forwarded envelopes: [(envelope: SealedEnvelope, clientID: String)]) async throws -> [QueuedItem] {
        var items: [NewItem] = []
        items.reserveCapacity(envelopes.count)
        for (index, forwarded) in envelopes.enumerated() {
            do {
                var item = try newItem(for: forwarded.envelope)
                item.clientID = forwarded.clientID
                items.append(item)
            } catch let error as DataQueueError {
                throw DataQueueError(error.code, "envelope \(index + 1): \(error.message)")
            }
        }
        let sequences = try await store.insert(items)
        metrics.enqueued.increment(by: items.count)
        wakeUp.signal()
        return zip(items, sequences).map { queuedItem($0, sequence: $1) }
    }
}
