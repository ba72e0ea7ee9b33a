import Foundation
import Testing

@testable import FHIRDataQueue

@Suite("Item identifiers")
struct UUIDTests {
    @Test("Random UUIDs are version 4, RFC 9562 variant, and distinct")
    func random() {
        var seen = Set<UUID>()
        for _ in 0..<10_000 {
            let id = UUID.random()
            let text = id.uuidString
            #expect(Array(text)[14] == "4", "version nibble of \(text)")
            #expect("89AB".contains(Array(text)[19]), "variant of \(text)")
            seen.insert(id)
        }
        #expect(seen.count == 10_000)
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
}
