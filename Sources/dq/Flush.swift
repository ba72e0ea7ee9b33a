import ArgumentParser
import FHIRDataQueue
import FHIRDataQueueServer
import Foundation
import Logging
import Metrics
import Prometheus

enum FlushCommandSupport {
    static func describe(_ stop: FlushReport.Stop) -> String {
        switch stop {
        case .transient(let message, let retryAt): return "stopped: \(message); next try after \(formatDate(retryAt))"
        case .authentication(let message): return "stopped: authentication failed: \(message)"
        case .backoff(let until): return "server is backing off after failures until \(formatDate(until)); use --now to try anyway"
        case .busy: return "another flush of this queue is running"
        case .limit: return "stopped at the --limit"
        }
    }
}

extension DQ {
    struct Flush: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "flush",
            abstract: "Send queued items in order (for cron).",
            discussion: """
                Exit 0 when nothing pending remains, 75 when items stay queued (a transient failure, backoff, \
                another flusher, --limit), 65 when items were parked in this run (rejected by the server, or held \
                back unsent because a reference cannot be resolved), 77 on an authentication failure; the first of 77, \
                75, 65 wins. A run with nothing to do prints nothing.
                """
        )

        @OptionGroup var queueOptions: QueueOptions
        @OptionGroup var sending: SendingOptions

        @Option(parsing: .unconditional, help: "Handle at most this many items.") var limit: Int?
        @Flag(help: "Try now even if the server is backing off after failures.") var now = false
        @Option(parsing: .unconditional, help: "Seconds to wait for another flusher of this queue.") var wait: Double = 0
        @Flag(name: [.short, .long], help: "Print errors only.") var quiet = false
        @Flag(help: "Print the summary as JSON.") var json = false
        @Option(
            help:
                "Write the queue's metrics (as dq run serves them) to this file for node_exporter's textfile collector, atomically (a temporary file renamed)."
        )
        var metricsTextfile: String?

        func validate() throws {
            if let limit, limit < 1 { throw ValidationError("--limit must be at least 1") }
            try checkFlagSeconds(wait, name: "--wait", allowZero: true)
            if quiet && queueOptions.verbose { throw ValidationError("--quiet and --verbose exclude each other") }
        }

        func run() async throws {
            let registry = metricsTextfile.map { _ in PrometheusCollectorRegistry() }
            if let registry {
                MetricsSystem.bootstrap(Exposition.factory(registry))
                recordBuildInfo()
            }
            let code: Int32 = try await withQueue(queueOptions, sending: sending) { queue, settings in
                defer {
                    if let registry, let metricsTextfile { writeTextfile(registry, to: metricsTextfile) }
                }
                let retention = try settings.journalRetention()
                let display = TerminalProgress("flush", enabled: !json && !quiet)
                let total = display == nil ? 0 : try await queue.status(countingJournal: false).pending
                let report = try await queue.flush(limit: limit, force: now, lockWait: wait) { progress in
                    display?.update(
                        progress.delivered + progress.parked, of: total,
                        detail: "\(progress.delivered) delivered, \(progress.parked) parked")
                }
                display?.finish()
                // The journal's retention (journal_retention_days): one read when nothing is old enough.
                if let retention { _ = try await queue.pruneJournal(olderThan: retention) }
                let stopText = report.stop.map(FlushCommandSupport.describe)
                var authenticationFailed = false
                if case .authentication = report.stop { authenticationFailed = true }
                let code = Exit.outcome(
                    authenticationFailed: authenticationFailed, pending: report.remaining > 0, rejected: report.parked > 0)
                if registry != nil { _ = try await queue.status(countingJournal: false) }  // the gauges, also after a flush that backed off
                let elsewhere = report.remaining == 0 ? try await otherQueuesPending(queue) : []
                if json {
                    struct Summary: Encodable {
                        var queue: String
                        var delivered, parked, rejected, held, remaining, parkedTotal: Int
                        var stopped: String?
                        var exitCode: Int32
                        var otherQueuesPending: [String: Int]
                        var requests: Int
                        var bundleEntries: Int
                    }
                    try printJSON(
                        Summary(
                            queue: queue.queueName, delivered: report.delivered, parked: report.parked,
                            rejected: report.rejected, held: report.held, remaining: report.remaining, parkedTotal: report.parkedTotal,
                            stopped: stopText, exitCode: code,
                            otherQueuesPending: Dictionary(uniqueKeysWithValues: elsewhere.map { ($0.queue, $0.pending) }),
                            requests: report.requests, bundleEntries: report.bundleEntries))
                    return code
                }
                let happened = report.delivered + report.parked + report.remaining > 0 || report.stop != nil
                if !quiet && (happened || queueOptions.verbose) {
                    let requests =
                        report.bundleEntries > 0
                        ? " (\(report.requests) requests, \(report.bundleEntries) item(s) as entries of transaction Bundles)" : ""
                    print(
                        "flushed \(queue.queueName): \(report.delivered) delivered, \(report.parked) parked, \(report.remaining) pending, \(report.parkedTotal) parked in total\(requests)"
                    )
                }
                if let stopText { printError("dq: \(stopText)") }
                if report.rejected > 0 { printError("dq: the server rejected \(report.rejected) item(s); see dq list --parked") }
                if report.held > 0 {
                    printError(
                        "dq: \(report.held) item(s) held back unsent: a reference cannot be resolved; see dq list --parked")
                }
                if report.parked == 0 && report.parkedTotal > 0 && !quiet {
                    printError("dq: \(report.parkedTotal) parked item(s) need an operator: dq list --parked", level: .warning)
                }
                for other in elsewhere {
                    printError(
                        "dq: nothing pending for \(queue.queueName), but \(other.pending) item(s) wait for \(other.queue) (dq status --all)",
                        level: .notice)
                }
                return code
            }
            if code != 0 { throw ExitCode(code) }
        }

        /// The registry's text at `path`, through a temporary file in the same directory and a rename, so that
        /// node_exporter never reads half a file. A failure is a warning: the flush itself went as it went.
        func writeTextfile(_ registry: PrometheusCollectorRegistry, to path: String) {
            let temporary = path + ".\(getpid()).tmp"
            let bytes = Data(Exposition.emit(registry))
            guard FileManager.default.createFile(atPath: temporary, contents: bytes, attributes: [.posixPermissions: 0o644]),
                rename(temporary, path) == 0
            else {
                try? FileManager.default.removeItem(atPath: temporary)
                printError("dq: warning: cannot write the metrics to \(path)")
                return
            }
        }

        /// Queues of the same database, other than this one, that hold pending items.
        func otherQueuesPending(_ queue: DataQueue) async throws -> [QueueStatus] {
            try await queue.allQueueStatuses(countingJournal: false).filter { $0.queue != queue.queueName && $0.pending > 0 }
        }
    }
}
