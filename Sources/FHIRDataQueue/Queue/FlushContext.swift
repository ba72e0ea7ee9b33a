import Foundation
import Logging
import NIOConcurrencyHelpers

/// What one flush works with, handed to its ``Flusher`` by the queue that runs it: the flusher reaches nothing
/// else of the queue.
struct FlushContext: Sendable {
    /// The queue's name: its server's base URL in normal form.
    let queueName: String
    /// The queue's settings (Bundle sizes, idempotent mode, retry policy, encrypted in-flight limit).
    let configuration: DataQueue.Configuration
    /// Where the items are.
    let store: any QueueStorage
    /// Sends one request and classifies its answer.
    let delivery: Delivery
    /// Where each item goes.
    let endpoints: Endpoints
    let logger: Logger
    let metrics: QueueMetrics
    /// Deliveries the server accepted that an earlier flush of this process could not journal.
    let heldDeliveries: HeldDeliveries
    /// Test seams.
    let hooks: TestHooks
}

/// The URLs a queue's items are sent to: the base URL, and the encrypted endpoint (for an
/// ``EncryptedDataQueue``), read once from the queue (whose ``DataQueue/endpoint(encrypted:)`` a subclass may
/// override).
struct Endpoints: Sendable {
    /// The base URL, for plain items.
    let plain: String
    /// The encrypted endpoint, or why there is none.
    let encrypted: Result<String, DataQueueError>

    /// The endpoint of plain or encrypted items.
    func endpoint(encrypted isEncrypted: Bool) throws -> String {
        isEncrypted ? try encrypted.get() : plain
    }

    /// The full URL of a queued item, built from the endpoint and the item's stored path.
    ///
    /// - Throws: ``DataQueueError`` with `.storage` when the stored path is not one dq writes (an edited or
    ///   damaged row): such an item is never sent.
    func url(for item: QueuedItem) throws -> String {
        guard DataQueue.isValidPath(item.url, method: item.method, encrypted: item.encrypted) else {
            throw DataQueueError(
                .storage,
                "item row \(item.sequence) of the queue database is damaged (its request path is not one dq writes); "
                    + "it is not sent: inspect it with sqlite3, then fix or drop it")
        }
        let base = try endpoint(encrypted: item.encrypted)
        return item.url.isEmpty ? base : base + "/" + item.url
    }
}

/// Deliveries the server accepted whose journal write failed (a full disk, a file that stopped taking writes):
/// the next flush in this process writes them before it sends anything, so that an item the server has is not
/// sent again while the database refuses writes.
final class HeldDeliveries: Sendable {
    private let held = NIOLockedValueBox<[CompletedDelivery]>([])

    /// Keeps `deliveries` for the next flush.
    func hold(_ deliveries: [CompletedDelivery]) {
        held.withLockedValue { $0.append(contentsOf: deliveries) }
    }

    /// Takes every held delivery (the caller journals them or holds them again).
    func takeAll() -> [CompletedDelivery] {
        held.withLockedValue { held in
            defer { held.removeAll() }
            return held
        }
    }

    /// The held deliveries, left held.
    var all: [CompletedDelivery] { held.withLockedValue { $0 } }
}
