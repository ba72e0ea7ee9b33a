import Foundation
import Testing

@testable import FHIRDataQueueServer

/// The receiver's memory of valid bearer tokens (one decision each: what it answers from memory, and when it asks the
/// database again). That a token is accepted and an expired one refused end to end is ServeTests' part.
@Suite("Bearer tokens remembered by the receiver")
struct TokenCacheTests {
    let now = Date(timeIntervalSince1970: 1_800_000_000)

    @Test("A token is answered from memory until its expiry, and never after it")
    func untilExpiry() {
        let cache = TokenCache()
        #expect(cache.client(tokenHash: "h", now: now) == nil, "an unknown token is asked of the database")
        cache.remember(tokenHash: "h", clientID: "c1", expiresAt: now + 60, now: now)
        #expect(cache.client(tokenHash: "h", now: now + 59) == "c1")
        #expect(cache.client(tokenHash: "h", now: now + 60) == nil, "expired at its expiry, as the database says")
        #expect(cache.client(tokenHash: "h", now: now + 30) == nil, "an expired entry is forgotten")
    }

    @Test("A long-lived token is trusted from memory for at most TokenCache.longest, then read again")
    func atMostLongest() {
        let cache = TokenCache()
        cache.remember(tokenHash: "h", clientID: "c1", expiresAt: now + 86_400, now: now)
        #expect(cache.client(tokenHash: "h", now: now + TokenCache.longest - 1) == "c1")
        #expect(cache.client(tokenHash: "h", now: now + TokenCache.longest) == nil)
    }

    @Test("Past its capacity the cache drops the expired first, and stays bounded")
    func bounded() {
        let cache = TokenCache()
        for index in 0..<TokenCache.capacity {
            cache.remember(tokenHash: "old\(index)", clientID: "c", expiresAt: now + 10, now: now)
        }
        cache.remember(tokenHash: "fresh", clientID: "c2", expiresAt: now + 600, now: now + 20)
        #expect(cache.client(tokenHash: "fresh", now: now + 21) == "c2")
        #expect(cache.client(tokenHash: "old0", now: now + 5) == nil, "the expired were dropped to make room")
        #expect(cache.count == 1)
    }
}
