import Foundation
import Metrics

/// The metrics of one queue, made once with fixed dimensions (`destination` = the queue's name, which never
/// holds credentials: a base URL with a user or password is refused).
///
/// Names follow Prometheus conventions; with no metrics backend bootstrapped they cost nothing.
struct QueueMetrics: Sendable {
    let enqueued: Counter
    let delivered: Counter
    let parked: Counter
    /// Deliveries that may have put a second copy on the server (``QueueStatus/possibleDuplicates``).
    let possibleDuplicates: Counter
    /// Failed requests by cause: `network` (no answer), `server` (5xx), `throttled` (429, 408),
    /// `authentication` (401/403 after a fresh credential).
    let failed: [String: Counter]
    let depth: Gauge
    let oldestPendingAge: Gauge
    /// Parked items now (the counter counts this process's parkings).
    let parkedNow: Gauge
    /// When the journal last recorded a delivery of this queue, by any process (Unix seconds; 0: never).
    let lastDelivery: Gauge
    /// Until when the server is backed off (Unix seconds; 0 when it is not).
    let backoffUntil: Gauge
    let requestDuration: Metrics.Timer
    let bundleSize: Recorder
    /// Flushes that ended with an error (not a server's answer): `storage`, `storage_full`, `configuration`,
    /// `other`.
    let flushErrors: [String: Counter]

    init(destination: String) {
        let dimensions = [("destination", destination)]
        enqueued = Counter(label: "dq_items_enqueued_total", dimensions: dimensions)
        delivered = Counter(label: "dq_items_delivered_total", dimensions: dimensions)
        parked = Counter(label: "dq_items_parked_total", dimensions: dimensions)
        possibleDuplicates = Counter(label: "dq_items_possible_duplicates_total", dimensions: dimensions)
        failed = Dictionary(
            uniqueKeysWithValues: ["network", "server", "throttled", "authentication"].map { cause in
                (cause, Counter(label: "dq_requests_failed_total", dimensions: dimensions + [("cause", cause)]))
            })
        depth = Gauge(label: "dq_queue_depth", dimensions: dimensions)
        oldestPendingAge = Gauge(label: "dq_oldest_pending_age_seconds", dimensions: dimensions)
        parkedNow = Gauge(label: "dq_items_parked", dimensions: dimensions)
        lastDelivery = Gauge(label: "dq_last_delivery_timestamp_seconds", dimensions: dimensions)
        backoffUntil = Gauge(label: "dq_backoff_until_timestamp_seconds", dimensions: dimensions)
        requestDuration = Metrics.Timer(label: "dq_request_duration_seconds", dimensions: dimensions)
        bundleSize = Recorder(label: "dq_bundle_size", dimensions: dimensions)
        flushErrors = Dictionary(
            uniqueKeysWithValues: ["storage", "storage_full", "damaged", "configuration", "other"].map { kind in
                (kind, Counter(label: "dq_flush_errors_total", dimensions: dimensions + [("kind", kind)]))
            })
    }

    /// Counts a flush that ended with `error`.
    func flushError(_ error: any Error) {
        let kind: String
        switch (error as? DataQueueError)?.code {
        case .storage?: kind = "storage"
        case .storageFull?: kind = "storage_full"
        case .damaged?: kind = "damaged"
        case .invalidConfiguration?: kind = "configuration"
        default: kind = "other"
        }
        flushErrors[kind]?.increment()
    }

    /// Counts a failed request by its cause.
    func failure(status: Int?, authentication: Bool = false) {
        let cause: String
        if authentication {
            cause = "authentication"
        } else if let status {
            cause = status == 429 || status == 408 ? "throttled" : "server"
        } else {
            cause = "network"
        }
        failed[cause]?.increment()
    }

    /// The depth and the age of the oldest pending item, from the queue's counts.
    func update(from status: QueueStatus) {
        depth.record(status.pending)
        oldestPendingAge.record(status.oldestPendingAt.map { max(0, Date().timeIntervalSince($0)) } ?? 0)
        parkedNow.record(status.parked)
        lastDelivery.record(status.lastDeliveryAt?.timeIntervalSince1970 ?? 0)
        let backoff = status.nextAttemptAt.map(\.timeIntervalSince1970) ?? 0
        backoffUntil.record(backoff > Date().timeIntervalSince1970 ? backoff : 0)
    }

    /// A delivery that may be a second copy.
    func possibleDuplicate() { possibleDuplicates.increment() }

    /// A delivery now: counted, and its time kept.
    func deliveredOne() {
        delivered.increment()
        lastDelivery.record(Date().timeIntervalSince1970)
    }
}
