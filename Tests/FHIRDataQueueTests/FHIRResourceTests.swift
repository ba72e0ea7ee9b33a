import Foundation
import Testing

@testable import FHIRDataQueue

@Suite("FHIRResource validation")
struct FHIRResourceTests {
    @Test("A valid resource keeps its bytes and exposes type, id and identifier")
    func valid() throws {
        let json =
            #"{"resourceType":"Observation","id":"o-1","identifier":[{"value":"no-system"},{"system":"urn:s","value":"v"}],"valueQuantity":{"value":1.50}}"#
        let resource = try FHIRResource(json: Data(json.utf8))
        #expect(resource.data == Data(json.utf8))
        #expect(resource.resourceType == "Observation")
        #expect(resource.id == "o-1")
        #expect(resource.identifier?.system == "urn:s" && resource.identifier?.value == "v")
    }

    @Test(
        "Invalid inputs are refused with a specific reason",
        arguments: [
            ("", "empty"),
            ("  \n", "empty"),
            ("{", "not valid JSON"),
            ("[]", "not an object"),
            ("42", "not an object"),
            (#"{"id":"a"}"#, "no \"resourceType\""),
            (#"{"resourceType":7}"#, "not a FHIR type name"),
            (#"{"resourceType":"lowercase"}"#, "not a FHIR type name"),
            (#"{"resourceType":"Patient","id":"bad id"}"#, "not a valid FHIR id"),
            (#"{"resourceType":"Patient","id":5}"#, "not a valid FHIR id"),
        ])
    func invalid(input: String, reason: String) {
        #expect {
            try FHIRResource(json: Data(input.utf8))
        } throws: { error in
            guard let error = error as? DataQueueError else { return false }
            return error.code == .invalidResource && error.message.contains(reason)
        }
    }

    @Test("Invalid UTF-8 and oversize inputs are refused")
    func bytesLevel() {
        #expect(throws: DataQueueError.self) { try FHIRResource(json: Data([0x7B, 0xFF, 0x7D])) }
        let big = Data(#"{"resourceType":"Patient","x":"\#(String(repeating: "a", count: 100))"}"#.utf8)
        #expect {
            try FHIRResource(json: big, maximumSize: 50)
        } throws: { ($0 as? DataQueueError)?.message.contains("over the limit of 50 bytes") == true }
    }

    @Test("UTF-8 is checked at every position, past the eight-byte ASCII steps too; valid non-ASCII text is kept")
    func utf8Check() throws {
        let resource = { (text: [UInt8]) in Data(#"{"resourceType":"Patient","text":""#.utf8 + text + #""}"#.utf8) }
        let bad: [[UInt8]] = [[0xFF], [0xC3], [0xC0, 0x80], [0xED, 0xA0, 0x80], [0xF4, 0x90, 0x80, 0x80], [0x80]]
        for bytes in bad {
            #expect(!FHIRResource.isValidUTF8(Data(bytes)), "\(bytes)")
            for prefix in 0..<17 {
                let data = resource(Array(repeating: UInt8(ascii: "a"), count: prefix) + bytes)
                #expect(!FHIRResource.isValidUTF8(data), "\(bytes) after \(prefix)")
                #expect {
                    try FHIRResource(json: data)
                } throws: { ($0 as? DataQueueError)?.message == "input is not valid UTF-8" }
            }
        }
        for prefix in 0..<17 {
            let text = Array(repeating: UInt8(ascii: "a"), count: prefix) + Array("é ✓ 🩺".utf8)
            let data = resource(text)
            #expect(FHIRResource.isValidUTF8(data))
            #expect(try FHIRResource(json: data).data == data)
        }
        for length in 0..<20 { #expect(FHIRResource.isValidUTF8(Data(repeating: 0x7B, count: length))) }
    }

    @Test("Nesting deeper than 512 levels is refused as invalid, naming the limit; 512 levels are accepted")
    func deepNesting() throws {
        /// A Patient with `arrays` nested arrays in one member: the resource's own object is one more level.
        func nested(_ arrays: Int) -> Data {
            Data(
                (#"{"resourceType":"Patient","x":"# + String(repeating: "[", count: arrays)
                    + String(repeating: "]", count: arrays) + "}").utf8)
        }
        let limit = 512
        let atLimit = try FHIRResource(json: nested(limit - 1))
        #expect(atLimit.resourceType == "Patient")
        for arrays in [limit, 100_000] {
            let error = #expect(throws: DataQueueError.self, "\(arrays + 1) levels") { try FHIRResource(json: nested(arrays)) }
            #expect(error?.code == .invalidResource, "\(arrays + 1) levels")
            #expect(error?.message.contains("nested deeper than \(limit) levels") == true, "\(String(describing: error))")
        }
    }
}
