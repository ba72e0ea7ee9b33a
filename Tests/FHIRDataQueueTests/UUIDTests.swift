import Foundation
import Testing

@testable import FHIRDataQueue

@Suite("Item identifiers")
struct UUIDTests {
    @Test("Item UUIDs are version 7 with the RFC 9562 variant, distinct, ordered by time, and carry the clock")
    func timeOrdered() throws {
        var seen = Set<UUID>()
        var previousPrefix = ""
        let before = UInt64(Date().timeIntervalSince1970 * 1000)
        for _ in 0..<10_000 {
            let id = UUID.timeOrdered()
            let text = id.lowercasedString
            #expect(Array(text)[14] == "7", "version nibble of \(text)")
            #expect("89ab".contains(Array(text)[19]), "variant of \(text)")
            // The 60 bits of time (milliseconds and the sub-millisecond fraction) never go back.
            let prefix = String(text.prefix(18))
            #expect(prefix >= previousPrefix, "\(prefix) after \(previousPrefix)")
            previousPrefix = prefix
            seen.insert(id)
        }
        #expect(seen.count == 10_000)
        let millisecondsHex = String(UUID.timeOrdered().lowercasedString.replacingOccurrences(of: "-", with: "").prefix(12))
        let milliseconds = try #require(UInt64(millisecondsHex, radix: 16))
        #expect(milliseconds >= before && milliseconds <= UInt64(Date().timeIntervalSince1970 * 1000) + 1)
    }

    @Test("The lowercase form equals Foundation's uuidString, lowercased")
    func lowercased() throws {
        for _ in 0..<1_000 {
            let id = UUID()
            #expect(id.lowercasedString == id.uuidString.lowercased())
        }
        let fixed = try #require(UUID(uuidString: "00FF10A0-B1C2-4D3E-8F40-123456789ABC"))
        #expect(fixed.lowercasedString == "00ff10a0-b1c2-4d3e-8f40-123456789abc")
    }

    @Test("Hex digits: two lowercase digits per byte, as String(format: \"%02x\") writes them")
    func hex() {
        #expect([UInt8]().hexString == "")
        #expect([0x00, 0x0F, 0xA0, 0xFF].hexString == "000fa0ff")
        let bytes = (0..<256).map { UInt8($0) }
        #expect(bytes.hexString == bytes.map { String(format: "%02x", $0) }.joined())
    }
}
