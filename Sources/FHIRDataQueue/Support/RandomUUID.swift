import Foundation

extension UUID {
    /// A time-ordered UUID (version 7, RFC 9562 §5.7): 48 bits of Unix time in milliseconds, 12 bits of
    /// sub-millisecond time (§6.2, method 3), then 62 random bits from the kernel's generator (``RandomBytes``).
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
        let high = milliseconds << 16 | 0x7000 | fraction
        let low = RandomBytes.uint64() & ~(0xC0 << 56) | (0x80 << 56)  // variant 10xx
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
        String(unsafeUninitializedCapacity: 36) { buffer in
            writeLowercased(to: buffer.baseAddress!)
            return 36
        }
    }

    /// Appends the canonical lowercase form's 36 bytes to `bytes`.
    func appendLowercased(to bytes: inout [UInt8]) {
        let start = bytes.count
        bytes.append(contentsOf: repeatElement(0, count: 36))
        bytes.withUnsafeMutableBufferPointer { writeLowercased(to: $0.baseAddress! + start) }
    }

    /// Writes the canonical lowercase form's 36 bytes at `out`.
    private func writeLowercased(to out: UnsafeMutablePointer<UInt8>) {
        let digits: StaticString = "0123456789abcdef"
        withUnsafeBytes(of: uuid) { raw in
            var position = 0
            for (index, byte) in raw.enumerated() {
                if index == 4 || index == 6 || index == 8 || index == 10 {
                    out[position] = UInt8(ascii: "-")
                    position += 1
                }
                out[position] = digits.utf8Start[Int(byte >> 4)]
                out[position + 1] = digits.utf8Start[Int(byte & 0x0F)]
                position += 2
            }
        }
    }
}
