import Foundation

extension UUID {
    /// A time-ordered UUID (version 7, RFC 9562 §5.7): 48 bits of Unix time in milliseconds, 12 bits of
    /// sub-millisecond time (§6.2, method 3), then 62 random bits from the system's cryptographic generator.
    ///
    /// Items enqueued later get larger identifiers, so the queue's unique index grows at its right edge
    /// instead of taking random inserts all over the tree: a bulk enqueue of 100,000 resources spends about
    /// half as long in SQLite. (`UUID()` on Linux also opens `/dev/urandom` on every call.) The identifier
    /// reveals when the item was enqueued, to the millisecond, which the delivery journal records anyway.
    static func timeOrdered() -> UUID {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        let milliseconds = UInt64(now.tv_sec) * 1000 + UInt64(now.tv_nsec) / 1_000_000
        let fraction = UInt64(now.tv_nsec % 1_000_000) * 4096 / 1_000_000
        var generator = SystemRandomNumberGenerator()
        let high = milliseconds << 16 | 0x7000 | fraction
        let low = (generator.next() as UInt64) & ~(0xC0 << 56) | (0x80 << 56)  // variant 10xx
        var bytes = (high.bigEndian, low.bigEndian)
        return withUnsafeBytes(of: &bytes) { raw in
            UUID(uuid: raw.load(as: uuid_t.self))
        }
    }
}

extension UUID {
    /// The canonical lowercase form (`xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`), as dq stores and prints it.
    ///
    /// Equal to `uuidString.lowercased()`, without the `sprintf` and the second string that it costs.
    var lowercasedString: String {
        let digits: StaticString = "0123456789abcdef"
        return withUnsafeBytes(of: uuid) { raw in
            String(unsafeUninitializedCapacity: 36) { buffer in
                var out = 0
                for (index, byte) in raw.enumerated() {
                    if index == 4 || index == 6 || index == 8 || index == 10 {
                        buffer[out] = UInt8(ascii: "-")
                        out += 1
                    }
                    buffer[out] = digits.utf8Start[Int(byte >> 4)]
                    buffer[out + 1] = digits.utf8Start[Int(byte & 0x0F)]
                    out += 2
                }
                return out
            }
        }
    }
}
