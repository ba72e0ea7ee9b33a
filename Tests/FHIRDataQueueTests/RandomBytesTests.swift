import Crypto
import Foundation
import Testing

@testable import FHIRDataQueue

@Suite("Random bytes and at-rest seals")
struct RandomBytesTests {
    @Test("Nonces and 64-bit values drawn across many refills of the pool are all distinct, and their bits balanced")
    func distinct() {
        var nonces = Set<Data>()
        for _ in 0..<10_000 { nonces.insert(RandomBytes.nonce().withUnsafeBytes { Data($0) }) }
        #expect(nonces.count == 10_000)
        var values = Set<UInt64>()
        var ones = [Int](repeating: 0, count: 64)
        for _ in 0..<10_000 {
            let value = RandomBytes.uint64()
            values.insert(value)
            for bit in 0..<64 where value & (1 << UInt64(bit)) != 0 { ones[bit] += 1 }
        }
        #expect(values.count == 10_000)
        // Each bit is set in about half of the values (binomial, n = 10,000: 4,500-5,500 is beyond 10 sigma).
        #expect(ones.allSatisfy { (4_500...5_500).contains($0) }, "\(ones)")
    }

    @Test(
        "A seal's associated data is the documented bytes (so items sealed by earlier versions still open), and each seal has a fresh nonce"
    )
    func sealFormat() throws {
        let (key, _) = AtRestKey.generate()
        let sealer = Sealer(keys: AtRestKeys(current: key), indexKey: SymmetricKey(size: .bits256))
        let item = UUID.timeOrdered()
        let queue = "https://fhir.example.org/r4"
        let first = sealer.seal(text: "Patient/123", .url, item: item, queue: queue)
        let second = sealer.seal(text: "Patient/123", .url, item: item, queue: queue)
        #expect(first != second)
        // Opened here with associated data built independently, as the format describes it.
        for (sealed, column) in [(first, "url"), (second, "url")] {
            let prefix = "dqs1.\(key.id)."
            #expect(sealed.hasPrefix(prefix))
            let box = try AES.GCM.SealedBox(combined: try #require(Data(base64Encoded: String(sealed.dropFirst(prefix.count)))))
            let ad = Data("dq-at-rest-v1\0\(column)\0\(item.uuidString.lowercased())\0\(queue)".utf8)
            #expect(try AES.GCM.open(box, using: key.key, authenticating: ad) == Data("Patient/123".utf8))
        }
        let body = sealer.seal(body: Data(#"{"resourceType":"Patient"}"#.utf8), fullURL: nil, item: item, queue: queue)
        let box = try AES.GCM.SealedBox(combined: body.dropFirst(Sealer.bodyHeaderCount))
        let ad = Data("dq-at-rest-v1\0body\0\(item.uuidString.lowercased())\0\(queue)".utf8)
        let plain = try AES.GCM.open(box, using: key.key, authenticating: ad)
        #expect(plain == Data([0, 0, 0, 0]) + Data(#"{"resourceType":"Patient"}"#.utf8))
        #expect(try sealer.open(text: first, .url, item: item, queue: queue) == "Patient/123")
    }
}
