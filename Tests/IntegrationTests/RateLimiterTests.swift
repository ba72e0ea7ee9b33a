import Foundation
import Testing

@testable import FHIRDataQueueServer

/// The receiver's rate limit on `register` and `oauth` (one decision each: what an address is counted as, and how the
/// table stays bounded). That a 429 with `Retry-After` is answered end to end is ServeTests' part.
@Suite("The receiver's rate limit per source address")
struct RateLimiterTests {
    let start = ContinuousClock.now

    @Test("An IPv6 address is counted by its /64, an IPv4-mapped one as its IPv4 address, anything else as itself")
    func buckets() {
        #expect(RateLimiter.bucket("2001:db8:0:1:aaaa::1") == "2001:db8:0:1::/64")
        #expect(RateLimiter.bucket("2001:0db8:0000:0001:ffff:1:2:3") == "2001:db8:0:1::/64")
        #expect(RateLimiter.bucket("2001:db8:0:2::1") == "2001:db8:0:2::/64")
        #expect(RateLimiter.bucket("::ffff:203.0.113.5") == "203.0.113.5")
        #expect(RateLimiter.bucket("203.0.113.5") == "203.0.113.5")
        #expect(RateLimiter.bucket("unknown") == "unknown")
        #expect(RateLimiter.bucket("fe80::1:zz") == "fe80::1:zz", "not an address: itself")
    }

    @Test("Addresses of one /64 share one budget; another /64 has its own")
    func onePrefixOneBudget() {
        let limiter = RateLimiter(perMinute: 2)
        #expect(limiter.refuse("2001:db8:0:1::1", now: start) == nil)
        #expect(limiter.refuse("2001:db8:0:1::2", now: start) == nil)
        #expect(limiter.refuse("2001:db8:0:1::3", now: start) != nil, "a third address of the same /64 is refused")
        #expect(limiter.refuse("2001:db8:0:2::1", now: start) == nil)
        #expect(limiter.refuse("2001:db8:0:1::4", now: start + .seconds(61)) == nil, "a new minute, a new budget")
    }

    @Test("Past its capacity, new addresses share one window; those already counted keep theirs")
    func bounded() {
        let limiter = RateLimiter(perMinute: 2, capacity: 100)
        for index in 0..<100 { #expect(limiter.refuse("198.51.100.\(index)", now: start) == nil) }
        #expect(limiter.count == 100)
        #expect(limiter.refuse("203.0.113.1", now: start) == nil)
        #expect(limiter.refuse("203.0.113.2", now: start) == nil)
        #expect(limiter.refuse("203.0.113.3", now: start) != nil, "the third new address in the full table: the shared window is spent")
        #expect(limiter.count == 101, "the 100 and the shared window")
        #expect(limiter.refuse("198.51.100.7", now: start) == nil, "an address already counted has its own window")
    }

    @Test("Windows over a minute old are swept once the table is large, at most once a second")
    func swept() {
        let limiter = RateLimiter(perMinute: 5)
        for index in 0...RateLimiter.sweepAbove { _ = limiter.refuse("10.\(index >> 16).\((index >> 8) & 255).\(index & 255)", now: start) }
        #expect(limiter.count == RateLimiter.sweepAbove + 1)
        _ = limiter.refuse("203.0.113.9", now: start + .seconds(61))
        #expect(limiter.count == 1, "only the new window is left")
    }

    @Test(
        "Wrong secrets per client id: five go at once, then each waits twice the last (capped); a success clears the id; an old failure is forgotten"
    )
    func failureBackoff() {
        let backoff = FailureBackoff()
        for index in 0..<FailureBackoff.free {
            #expect(backoff.refuse("c1", now: start) == nil, "\(index)")
            backoff.failed("c1", now: start)
        }
        #expect(backoff.refuse("c1", now: start) == 2, "1 s after the fifth failure (rounded up, at least 1)")
        #expect(backoff.refuse("c2", now: start) == nil, "another id is not touched")
        #expect(backoff.refuse("c1", now: start + .seconds(1)) == nil)
        backoff.failed("c1", now: start + .seconds(1))
        #expect(backoff.refuse("c1", now: start + .seconds(2)) != nil, "2 s after the sixth")
        #expect(backoff.refuse("c1", now: start + .seconds(3)) == nil)
        #expect(FailureBackoff.wait(afterFailures: 4) == .zero)
        #expect(FailureBackoff.wait(afterFailures: 7) == .seconds(4))
        #expect(FailureBackoff.wait(afterFailures: 40) == FailureBackoff.longest)
        backoff.succeeded("c1")
        #expect(backoff.refuse("c1", now: start + .seconds(2)) == nil, "a success clears it")
        for _ in 0..<20 { backoff.failed("c3", now: start) }
        #expect(backoff.refuse("c3", now: start + .seconds(60)) != nil)
        #expect(backoff.refuse("c3", now: start + FailureBackoff.forgetAfter) == nil, "forgotten after a quiet while")
    }

    @Test("Connections: per address (an IPv6 /64 as one), in all, a trusted proxy counted in all only; a closed one gives its place back")
    func connectionGuard() {
        let guarded = ConnectionGuard(.init(perAddress: 2, total: 5, exempt: ["10.0.0.1"]))
        let a1 = guarded.admit("192.0.2.1"), a2 = guarded.admit("192.0.2.1")
        #expect(a1 != nil && a2 != nil)
        #expect(guarded.admit("192.0.2.1") == nil, "a third from one address")
        #expect(guarded.admit("2001:db8:0:1::1") != nil)
        #expect(guarded.admit("2001:db8:0:1::2") != nil)
        #expect(guarded.admit("2001:db8:0:1::3") == nil, "one /64 is one address")
        #expect(guarded.openConnections == 4)
        #expect(guarded.admit("10.0.0.1") != nil, "the proxy: not per address")
        #expect(guarded.admit("10.0.0.1") == nil, "but within the total of 5")
        #expect(guarded.admit("198.51.100.7") == nil, "the total holds for everyone")
        if let a1 { guarded.release(a1) }
        #expect(guarded.openConnections == 4)
        #expect(guarded.admit("192.0.2.1") != nil, "its place given back")
    }
}
