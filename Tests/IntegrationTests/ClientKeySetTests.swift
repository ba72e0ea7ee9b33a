import Crypto
import Foundation
import Testing
import _CryptoExtras

@testable import FHIRDataQueueServer

/// An edge's key set (`serve.edges`) is checked key by key when it is read: a key that cannot check an assertion is
/// named then, never dropped in silence (its edge's token requests would all be refused later, with no reason given).
/// That a good key set gets tokens end to end is ServeSplitTests.edgeWithKeySet's part.
@Suite("Edge key sets checked when read")
struct ClientKeySetTests {
    static func base64URL(_ data: Data) -> String {
        data.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    static func ecKey(_ key: P256.Signing.PublicKey, kid: String = "k1", breakPoint: Bool = false) -> String {
        var point = [UInt8](key.x963Representation)
        if breakPoint { point[64] ^= 0x01 }  // y's last byte: no longer on the curve
        let x = base64URL(Data(point[1...32]))
        let y = base64URL(Data(point[33...64]))
        return #"{"kty":"EC","crv":"P-256","kid":"\#(kid)","x":"\#(x)","y":"\#(y)"}"#
    }

    func refusal(_ keys: String) -> String? {
        do {
            _ = try ClientAssertionVerifier(keySets: ["edge-1": #"{"keys":[\#(keys)]}"#])
            return nil
        } catch {
            return error.description
        }
    }

    @Test("A good EC and RSA key set is taken")
    func goodKeys() throws {
        let rsa = try _RSA.Signing.PrivateKey(keySize: .bits2048).publicKey.getKeyPrimitives()
        let rsaKey = #"{"kty":"RSA","kid":"r1","n":"\#(Self.base64URL(rsa.modulus))","e":"\#(Self.base64URL(rsa.publicExponent))"}"#
        let refused = refusal(Self.ecKey(P256.Signing.PrivateKey().publicKey) + "," + rsaKey)
        #expect(refused == nil, "\(refused ?? "")")
    }

    @Test("An EC point off its curve, a private key, an unknown kty or curve, and a short RSA key are refused by name")
    func badKeys() {
        let good = Self.ecKey(P256.Signing.PrivateKey().publicKey, kid: "good")
        let offCurve = Self.ecKey(P256.Signing.PrivateKey().publicKey, kid: "bent", breakPoint: true)
        let offCurveRefusal = refusal(good + "," + offCurve)
        #expect(offCurveRefusal?.contains("key bent of client edge-1") == true, "\(offCurveRefusal ?? "taken")")
        #expect(offCurveRefusal?.contains("not a point on P-256") == true)
        #expect(refusal(#"{"kty":"EC","crv":"P-256","kid":"p","x":"AA","y":"AA","d":"AA"}"#)?.contains("private key") == true)
        #expect(refusal(#"{"kty":"oct","kid":"s","k":"AAAA"}"#)?.contains("other than RSA or EC") == true)
        #expect(refusal(#"{"kty":"EC","crv":"P-521","kid":"c","x":"AA","y":"AA"}"#)?.contains("P-256 or P-384") == true)
        // A 512-bit modulus (n of 64 bytes) with e = 65537.
        let n = Self.base64URL(Data([0xC1] + [UInt8](repeating: 0x5A, count: 62) + [0x01]))
        let short = refusal(#"{"kty":"RSA","kid":"r","n":"\#(n)","e":"AQAB"}"#)
        #expect(short?.contains("2048 bits or more") == true, "\(short ?? "taken")")
        // A key marked for encryption only is not a signing key: a set of only that holds none.
        #expect(refusal(#"{"kty":"oct","use":"enc","kid":"e"}"#)?.contains("holds no signing key") == true)
    }
}
