import Foundation
import Hummingbird
import NIOConcurrencyHelpers
import NIOCore

extension C3PROReceiver {
    /// The address a request is limited by: the peer's, or, from a trusted proxy, the rightmost address of
    /// `X-Forwarded-For` that is not a trusted proxy itself ("unknown" without a peer address).
    func clientAddress(_ request: Request, peer: SocketAddress?) -> String {
        let address = peer?.ipAddress ?? "unknown"
        let trusted = configuration.trustedProxies
        guard trusted.contains(address) else { return address }
        let forwarded = request.headers[values: .init("X-Forwarded-For")!].flatMap { $0.split(separator: ",") }
            .map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
        return forwarded.last { !trusted.contains($0) } ?? forwarded.first ?? address
    }
}

/// A fixed window per source address: at most `perMinute` requests in each minute.
///
/// An IPv6 address is counted by its /64 (what one host or subscriber is given: counting each address would give
/// it 2^64 budgets), an IPv4-mapped one as its IPv4 address. The table is bounded: windows over a minute old are
/// swept at most once a second once it holds more than ``sweepAbove``, and past ``capacity`` addresses a new one
/// shares one window with every other new one (under a flood from many addresses, new addresses are limited
/// together rather than the table growing, and the addresses already counted keep their own windows).
final class RateLimiter: Sendable {
    /// The most addresses with their own window.
    static let capacity = 100_000
    /// The size above which expired windows are swept (at most once a second).
    static let sweepAbove = 10_000
    /// The window new addresses share once the table is full.
    static let overflow = "(overflow)"

    private struct State {
        var windows: [String: (start: ContinuousClock.Instant, count: Int)] = [:]
        var swept: ContinuousClock.Instant?
    }

    private let perMinute: Int
    private let capacity: Int
    private let state = NIOLockedValueBox(State())

    init(perMinute: Int, capacity: Int = RateLimiter.capacity) {
        self.perMinute = perMinute
        self.capacity = capacity
    }

    /// How many addresses have a window now (for tests).
    var count: Int { state.withLockedValue { $0.windows.count } }

    /// Nil when a request from `address` (a client address) may go at `now`; else the seconds to wait.
    func refuse(_ address: String, now: ContinuousClock.Instant = .now) -> Int? {
        guard perMinute > 0 else { return nil }
        var key = Self.bucket(address)
        return state.withLockedValue { state in
            if state.windows.count > min(Self.sweepAbove, capacity), state.swept.map({ now - $0 >= .seconds(1) }) ?? true {
                state.windows = state.windows.filter { now - $0.value.start < .seconds(60) }
                state.swept = now
            }
            if state.windows[key] == nil, state.windows.count >= capacity { key = Self.overflow }
            var window = state.windows[key] ?? (now, 0)
            if now - window.start >= .seconds(60) { window = (now, 0) }
            window.count += 1
            state.windows[key] = window
            guard window.count > perMinute else { return nil }
            return max(1, Int((window.start + .seconds(60) - now).components.seconds) + 1)
        }
    }

    /// What `address` is counted as: an IPv6 address's /64 (`2001:db8:0:1::/64`), an IPv4-mapped IPv6 address's
    /// IPv4 address, anything else itself.
    static func bucket(_ address: String) -> String {
        var bytes = [UInt8](repeating: 0, count: 16)
        guard address.contains(":"), inet_pton(AF_INET6, address, &bytes) == 1 else { return address }
        if bytes[0..<10].allSatisfy({ $0 == 0 }) && bytes[10] == 0xff && bytes[11] == 0xff {
            return bytes[12...].map(String.init).joined(separator: ".")
        }
        let groups = stride(from: 0, to: 8, by: 2).map { String(UInt16(bytes[$0]) << 8 | UInt16(bytes[$0 + 1]), radix: 16) }
        return groups.joined(separator: ":") + "::/64"
    }
}
