import Foundation
import NIOConcurrencyHelpers

/// Progress of a long command on a terminal: one line on standard error, rewritten at most ten times a second,
/// with what is done (of how many, when that is known), the rate and the time left. Nothing when standard error
/// is not a terminal (a cron job's mail, a log), or with `--json` or `-q`.
final class TerminalProgress: Sendable {
    private let label: String
    private let start = ContinuousClock.now
    /// When the line was last drawn, and whether it was drawn at all.
    private let drawn = NIOLockedValueBox<(at: ContinuousClock.Instant?, any: Bool)>((nil, false))

    /// `nil` unless `enabled` and standard error is a terminal.
    init?(_ label: String, enabled: Bool = true) {
        guard enabled, standardErrorIsTerminal else { return nil }
        self.label = label
    }

    /// Draws `done` of `total` (when known), with `detail` after the counts; skipped when the line was drawn
    /// less than 0.1 s ago, unless all is done.
    func update(_ done: Int, of total: Int?, detail: String = "") {
        let now = ContinuousClock.now
        let draw = drawn.withLockedValue { drawn in
            if let last = drawn.at, now - last < .milliseconds(100), done != total { return false }
            drawn = (now, true)
            return true
        }
        guard draw else { return }
        let elapsed = max((now - start) / .seconds(1), 0.001)
        let rate = Double(done) / elapsed
        var line = "\r\(label): \(done)"
        if let total { line += "/\(total)" }
        if !detail.isEmpty { line += ", " + detail }
        line += ", \(Int(rate.rounded()))/s"
        if let total, rate > 0 { line += ", " + Self.duration(Double(max(total - done, 0)) / rate) + " left" }
        FileHandle.standardError.write(Data((line + "   ").utf8))
    }

    /// Ends the line, if one was drawn, so that what is printed next starts on a line of its own.
    func finish() {
        if drawn.withLockedValue({ $0.any }) { FileHandle.standardError.write(Data("\n".utf8)) }
    }

    /// `42s`, `3m05s`, `2h07m`.
    static func duration(_ seconds: Double) -> String {
        let whole = Int(seconds.rounded())
        if whole >= 3600 { return "\(whole / 3600)h\(String(format: "%02d", whole % 3600 / 60))m" }
        if whole >= 60 { return "\(whole / 60)m\(String(format: "%02d", whole % 60))s" }
        return "\(whole)s"
    }
}
