import Foundation

/// How long a server that failed is left alone before the next try.
///
/// The delay doubles with each consecutive failure, from ``initialDelay`` up to ``maximumDelay``, and is
/// spread by jitter so that many clients do not return at once. A `Retry-After` from the server is
/// honoured when it asks for longer.
///
/// ```swift
/// let policy = RetryPolicy(initialDelay: 5, maximumDelay: 900)
/// ```
public struct RetryPolicy: Sendable, Codable, Hashable {
    /// The delay after the first failure, in seconds. The default is 5.
    public var initialDelay: TimeInterval
    /// The longest delay, in seconds. The default is 900 (15 minutes).
    public var maximumDelay: TimeInterval
    /// The share of each delay that is random, from 0 (none) to 1. The default is 0.5.
    public var jitter: Double

    /// Creates a policy. Every parameter has the default stated on its property.
    public init(initialDelay: TimeInterval = 5, maximumDelay: TimeInterval = 900, jitter: Double = 0.5) {
        self.initialDelay = initialDelay
        self.maximumDelay = maximumDelay
        self.jitter = min(max(jitter, 0), 1)
    }

    /// The delay after `failures` consecutive failures (1 for the first).
    public func delay(afterFailures failures: Int, retryAfter: TimeInterval? = nil) -> TimeInterval {
        let exponent = Double(min(max(failures - 1, 0), 30))
        let base = min(maximumDelay, initialDelay * pow(2, exponent))
        let spread = base * jitter * Double.random(in: 0...1)
        let computed = base - spread
        if let retryAfter { return max(computed, min(retryAfter, 24 * 3600)) }
        return computed
    }
}
