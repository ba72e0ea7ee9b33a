import Foundation
import Testing

/// SplitMix64: a small seeded generator, so a randomized test can be replayed with the seed it printed.
struct SeededGenerator: RandomNumberGenerator {
    let seed: UInt64
    private var state: UInt64

    init(seed: UInt64) {
        self.seed = seed
        state = seed
    }

    /// A generator seeded from `DQ_TEST_SEED` when it is set, otherwise from the clock; it prints its seed
    /// (with `name`, the test) so that a failure can be replayed.
    init(for name: String) throws {
        let seed: UInt64
        if let text = ProcessInfo.processInfo.environment["DQ_TEST_SEED"] {
            seed = try #require(UInt64(text), "DQ_TEST_SEED must be an unsigned 64-bit integer, not \"\(text)\"")
        } else {
            seed = UInt64(truncatingIfNeeded: Int64(Date().timeIntervalSince1970 * 1_000_000_000))
        }
        print("\(name) seed \(seed) (replay with DQ_TEST_SEED=\(seed))")
        self.init(seed: seed)
    }

    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
