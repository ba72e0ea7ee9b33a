/// Standard base64 (RFC 4648 §4, with padding) written straight into a caller's buffer.
///
/// The envelope is almost all base64; encoding in place saves a second buffer and a copy of a
/// megabyte-sized message, and runs about twice as fast as Foundation's encoder.
enum Base64Writer {
    private static let alphabet: [UInt8] = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".utf8)

    /// The encoded length of `count` bytes.
    static func encodedCount(_ count: Int) -> Int { (count + 2) / 3 * 4 }

    /// Encodes `input` at the start of `output` (which holds at least ``encodedCount(_:)`` bytes).
    /// - Returns: the number of bytes written.
    static func encode(_ input: UnsafeRawBufferPointer, into output: UnsafeMutableRawBufferPointer) -> Int {
        precondition(output.count >= encodedCount(input.count))
        guard let source = input.baseAddress?.assumingMemoryBound(to: UInt8.self), let target = output.baseAddress
        else { return 0 }
        let out = target.assumingMemoryBound(to: UInt8.self)
        return alphabet.withUnsafeBufferPointer { table in
            let table = table.baseAddress!
            var i = 0
            var o = 0
            let whole = input.count - input.count % 3
            while i < whole {
                let value = UInt32(source[i]) << 16 | UInt32(source[i + 1]) << 8 | UInt32(source[i + 2])
                out[o] = table[Int(value >> 18)]
                out[o + 1] = table[Int(value >> 12 & 0x3F)]
                out[o + 2] = table[Int(value >> 6 & 0x3F)]
                out[o + 3] = table[Int(value & 0x3F)]
                i += 3
                o += 4
            }
            switch input.count - whole {
            case 1:
                let value = UInt32(source[i]) << 16
                out[o] = table[Int(value >> 18)]
                out[o + 1] = table[Int(value >> 12 & 0x3F)]
                out[o + 2] = UInt8(ascii: "=")
                out[o + 3] = UInt8(ascii: "=")
                o += 4
            case 2:
                let value = UInt32(source[i]) << 16 | UInt32(source[i + 1]) << 8
                out[o] = table[Int(value >> 18)]
                out[o + 1] = table[Int(value >> 12 & 0x3F)]
                out[o + 2] = table[Int(value >> 6 & 0x3F)]
                out[o + 3] = UInt8(ascii: "=")
                o += 4
            default:
                break
            }
            return o
        }
    }
}
