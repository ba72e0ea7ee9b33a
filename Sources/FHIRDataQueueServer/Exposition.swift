import Foundation
import Prometheus

/// How dq's metrics are exposed (`/metrics`, `dq flush --metrics-textfile`): the swift-metrics backend with
/// dq's histogram buckets, and `# HELP` lines before each family's `# TYPE` line of the Prometheus text.
///
/// The library records through swift-metrics, whose factory registers every family without help text; the
/// registry refuses a second, different help text for a family it knows, so the text is added here.
package enum Exposition {
    /// The backend for `registry`: request durations in buckets up to a day, the longest request timeout dq
    /// takes (so that every request's duration, however long its timeout, falls in a bucket of its own below
    /// `+Inf`), Bundle sizes up to 1,000 entries.
    package static func factory(_ registry: PrometheusCollectorRegistry) -> PrometheusMetricsFactory {
        var factory = PrometheusMetricsFactory(registry: registry)
        factory.durationHistogramBuckets["dq_request_duration_seconds"] = requestDurationBuckets
        factory.valueHistogramBuckets["dq_bundle_size"] = [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000]
        return factory
    }

    /// Request duration buckets, fine where requests usually end and coarse up to the longest timeout (a day).
    package static let requestDurationBuckets: [Duration] = [
        .milliseconds(5), .milliseconds(10), .milliseconds(25), .milliseconds(50), .milliseconds(100), .milliseconds(250),
        .milliseconds(500), .seconds(1), .milliseconds(2500), .seconds(5), .seconds(10), .seconds(30), .seconds(60),
        .seconds(120), .seconds(300), .seconds(900), .seconds(3600), .seconds(86_400),
    ]

    package static let texts: [String: String] = [
        "dq_items_enqueued_total": "Items this process queued.",
        "dq_items_delivered_total": "Items this process delivered (the server accepted them).",
        "dq_items_parked_total": "Items this process parked (the server rejected them for good).",
        "dq_requests_failed_total":
            "Requests that failed, by cause: network (no answer), server (5xx), throttled (429, 408), authentication.",
        "dq_queue_depth": "Items pending in the queue now.",
        "dq_oldest_pending_age_seconds": "Age of the oldest pending item (0 when none).",
        "dq_items_parked": "Items parked in the queue now, by any process.",
        "dq_last_delivery_timestamp_seconds": "When the journal last recorded a delivery of this queue (Unix time; 0: never).",
        "dq_backoff_until_timestamp_seconds": "Until when the server is backed off (Unix time; 0 when it is not).",
        "dq_request_duration_seconds": "Duration of requests to the FHIR server.",
        "dq_bundle_size": "Entries per transaction Bundle sent.",
        "dq_flush_errors_total":
            "Flushes that ended with an error of dq's own (storage, storage_full, damaged, configuration, other).",
        "dq_build_info": "The dq version (always 1).",
        "dq_envelopes_opened_total": "Envelopes opened with the receiver's keys (dq serve), by key id.",
        "dq_envelopes_quarantined_total":
            "Envelopes quarantined, by key id (unknown: not in keys_dir) and reason (one that does not open, write_policy).",
        "dq_items_possible_duplicates_total":
            "Items delivered again after a stop while they were on the way, with no condition the server could check.",
        "dq_write_policy_refusals_total": "Writes of dq serve's devices that the write policy refused (403 or quarantined).",
        "dq_serve_connections": "Connections dq serve holds open now.",
        "dq_serve_connections_refused_total": "Connections dq serve closed as accepted, by limit (per_address, total).",
        "dq_serve_quota_refusals_total": "Requests refused because the device has too much waiting, by limit (count, bytes).",
        "dq_serve_requests_total": "Requests dq serve answered, by endpoint and status.",
        "dq_serve_ingest_duration_seconds": "Time from a request's arrival to its answer after the commit (dq serve).",
    ]

    /// The registry's text with a `# HELP` line before each `# TYPE` line of a family that has none.
    package static func emit(_ registry: PrometheusCollectorRegistry) -> [UInt8] {
        let text = String(decoding: registry.emitToBuffer(), as: UTF8.self)
        var lines: [Substring] = []
        var previous: Substring = ""
        for line in text.split(separator: "\n", omittingEmptySubsequences: false) {
            if line.hasPrefix("# TYPE "), !previous.hasPrefix("# HELP ") {
                let name = line.dropFirst("# TYPE ".count).prefix { $0 != " " }
                if let help = texts[String(name)] {
                    // The exposition format escapes a backslash and a line break in help text.
                    let escaped = help.replacingOccurrences(of: "\\", with: "\\\\").replacingOccurrences(of: "\n", with: "\\n")
                    lines.append("# HELP \(name) \(escaped)")
                }
            }
            lines.append(line)
            previous = line
        }
        return Array(lines.joined(separator: "\n").utf8)
    }
}
