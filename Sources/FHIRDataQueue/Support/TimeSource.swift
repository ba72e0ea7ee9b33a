import Foundation

/// Where dq reads the time: the wall clock, for what is stored or compared with stored times (a token's expiry, a
/// registration, what is pruned), and a monotonic instant, for windows and intervals (rate limits, backoff, how
/// often a table is pruned).
///
/// Injected through the configuration types so that a test moves time instead of sleeping: a receiver given a
/// source whose time a test advances sees a token expire, or a rate-limit window pass, at once. What measures real
/// elapsed time for metrics, and real waits (a request's deadline), keep the system's clocks.
///
/// ```swift
/// var configuration = C3PROReceiver.Configuration(antispamSecrets: [secret])
/// configuration.time = .system  // the default
/// ```
public struct TimeSource: Sendable {
    /// The wall-clock time now.
    public var now: @Sendable () -> Date
    /// The monotonic instant now.
    public var instant: @Sendable () -> ContinuousClock.Instant

    /// A source that reads `now` and `instant`.
    public init(now: @escaping @Sendable () -> Date, instant: @escaping @Sendable () -> ContinuousClock.Instant) {
        self.now = now
        self.instant = instant
    }

    /// The system's clocks: `Date()` and `ContinuousClock.now`.
    public static let system = TimeSource(now: { Date() }, instant: { ContinuousClock.now })
}
