extension Sequence<UInt8> {
    /// The bytes as lowercase hexadecimal digits, two per byte (a key id, a digest in a file name, a keyed
    /// hash), without the `String(format:)` call per byte that costs a microsecond each.
    package var hexString: String {
        let digits: [UInt8] = Array("0123456789abcdef".utf8)
        var text: [UInt8] = []
        text.reserveCapacity(underestimatedCount * 2)
        for byte in self {
            text.append(digits[Int(byte >> 4)])
            text.append(digits[Int(byte & 0x0F)])
        }
        return String(decoding: text, as: UTF8.self)
    }
}
