import ArgumentParser
import FHIRDataQueue
import Foundation

enum FlushCommandSupport {
    static func describe(_ stop: FlushStop) -> String {
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
            discussion:
                "Exit 0 when nothing pending remains, 75 when items stay queued (transient failure, backoff, another flusher, --limit), 77 on an authentication failure."
        )

        @OptionGroup var queueOptions: QueueOptions

        @Option(parsing: .unconditional, help: "Handle at most this many items.") var limit: Int?
        @Flag(help: "Try now even if the server is backing off after failures.") var now = false
        @Option(parsing: .unconditional, help: "Seconds to wait for another flusher of this queue.") var wait: Double = 0
        @Flag(help: "Print the summary as JSON.") var json = false

        func validate() throws {
            if let limit, limit < 1 { throw ValidationError("--limit must be at least 1") }
            try checkFlagSeconds(wait, name: "--wait", allowZero: true)
        }

        func run() async throws {
            let code: Int32 = try await withQueue(queueOptions) { queue in
                let terminal = standardErrorIsTerminal && !json
                let report = try await queue.flush(limit: limit, force: now, lockWait: wait) { progress in
                    if terminal {
                        FileHandle.standardError.write(
                            Data("\rdelivered \(progress.delivered), parked \(progress.parked)".utf8))
                    }
                }
                if terminal && report.delivered + report.parked > 0 { FileHandle.standardError.write(Data("\n".utf8)) }
                let stopText = report.stop.map(FlushCommandSupport.describe)
                if json {
                    struct Summary: Encodable {
                        var queue: String
                        var delivered, parked, remaining, parkedTotal: Int
                        var stopped: String?
                    }
                    try printJSON(
                        Summary(
                            queue: queue.queueName, delivered: report.delivered, parked: report.parked,
                            remaining: report.remaining, parkedTotal: report.parkedTotal, stopped: stopText))
                } else {
                    print(
                        "flushed \(queue.queueName): \(report.delivered) delivered, \(report.parked) parked, \(report.remaining) pending, \(report.parkedTotal) parked in total"
                    )
                    if let stopText { printError("dq: \(stopText)") }
                    if report.parkedTotal > 0 { printError("dq: parked items need an operator: dq list --parked") }
                }
                if case .authentication = report.stop { return Exit.permissionDenied }
                return report.remaining > 0 ? Exit.temporaryFailure : Exit.ok
            }
            if code != 0 { throw ExitCode(code) }
        }
    }
}
