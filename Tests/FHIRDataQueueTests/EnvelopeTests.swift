import Crypto
import Foundation
import Testing
import _CryptoExtras

@testable import FHIRDataQueue

@Suite("Envelope crypto")
struct EnvelopeTests {
    /// The whole ciphertext of the chunked CBC that sealing uses.
    static func cbcEncrypt(_ plaintext: Data, key: SymmetricKey) throws -> Data {
        var ciphertext = Data()
        try EnvelopeCrypto.cbcEncryptChunks(plaintext, key: key) { ciphertext.append($0) }
        return ciphertext
    }

    @Test("Known-answer vectors of C3-PRO's AES-CBC with the zero IV (checked with openssl)")
    func knownAnswers() throws {
        let aes128 = try Self.cbcEncrypt(
            Data("Let's encrypt!".utf8), key: SymmetricKey(data: Data("why-is-this-here".utf8)))
        #expect(aes128.base64EncodedString() == "Iy8Mbj2ye1fI0yUWvyzwWw==")
        let aes256 = try Self.cbcEncrypt(
            Data(#"{"resourceType":"Patient"}"#.utf8), key: SymmetricKey(data: Data((0..<32).map { UInt8($0) })))
        #expect(aes256.base64EncodedString() == "jnb1eT1yOHdUWnfEqwmJ4Jw7z0Vxjxkj7/rc9SqJnrs=")
        let back = try EnvelopeCrypto.cbcDecrypt(aes256, key: SymmetricKey(data: Data((0..<32).map { UInt8($0) })))
        #expect(back == Data(#"{"resourceType":"Patient"}"#.utf8))
    }

    static func keyPair(bits: _RSA.Signing.KeySize = .bits2048) throws -> (RecipientKey, EnvelopeOpener) {
        let privateKey = try _RSA.Encryption.PrivateKey(keySize: bits)
        let recipient = try RecipientKey(data: Data(privateKey.publicKey.pemRepresentation.utf8))
        return (recipient, try EnvelopeOpener(privateKeyPEM: privateKey.pemRepresentation))
    }

    @Test(
        "CBC in chained chunks gives the bytes of one pass, at and around the chunk boundaries",
        arguments: [0, 1, 15, 16, 47, 48, 49_151, 49_152, 49_153, 98_304, 150_000])
    func chunkedCBC(size: Int) throws {
        var generator = try SeededGenerator(for: "EnvelopeTests.chunkedCBC(size: \(size))")
        let plaintext = Data((0..<size).map { _ in UInt8.random(in: 0...255, using: &generator) })
        let key = SymmetricKey(data: Data((0..<32).map { _ in UInt8.random(in: 0...255, using: &generator) }))
        let chunked = try Self.cbcEncrypt(plaintext, key: key)
        let onePass = try AES._CBC.encrypt(plaintext, using: key, iv: try AES._CBC.IV(ivBytes: EnvelopeCrypto.zeroIV))
        #expect(chunked == onePass, "seed \(generator.seed)")
        #expect(try EnvelopeCrypto.cbcDecrypt(chunked, key: key) == plaintext, "seed \(generator.seed)")
    }

    @Test("Base64 written in place equals Foundation's, for every length up to 200")
    func base64() {
        for length in 0...200 {
            let input = Data((0..<length).map { UInt8(truncatingIfNeeded: $0 &* 37 &+ length) })
            var output = [UInt8](repeating: 0, count: Base64Writer.encodedCount(length))
            let written = input.withUnsafeBytes { source in
                output.withUnsafeMutableBytes { Base64Writer.encode(source, into: $0) }
            }
            #expect(written == output.count)
            #expect(String(decoding: output, as: UTF8.self) == input.base64EncodedString(), "length \(length)")
        }
    }

    @Test("Both formats round-trip; every message gets a fresh key", arguments: EnvelopeSealer.Format.allCases)
    func roundTrip(format: EnvelopeSealer.Format) throws {
        let (recipient, opener) = try Self.keyPair()
        let sealer = EnvelopeSealer(recipient: recipient, keyID: "k/1", fhirVersion: "4.0.1", format: format)
        let plaintext = Data(#"{"resourceType":"Patient","name":[{"family":"Ümlaut"}]}"#.utf8)
        let first = try sealer.seal(plaintext)
        let second = try sealer.seal(plaintext)
        #expect(try opener.open(first) == plaintext)
        let a = try #require(JSONSerialization.jsonObject(with: first) as? [String: String])
        let b = try #require(JSONSerialization.jsonObject(with: second) as? [String: String])
        #expect(a["message"] != b["message"], "a fresh AES key per message")
        #expect(a["key_id"] == "k/1" && a["version"] == "4.0.1")
        #expect(
            Set(a.keys)
                == (format == .c3pro
                    ? ["key_id", "symmetric_key", "message", "version"]
                    : ["key_id", "symmetric_key", "message", "version", "alg"]))
        #expect(String(decoding: first, as: UTF8.self).contains("\\/") == false)
    }

    @Test("A tampered authenticated message fails; a wrong key fails; garbage fails")
    func corruptEnvelopes() throws {
        let (recipient, opener) = try Self.keyPair()
        let (_, otherOpener) = try Self.keyPair()
        let sealed = try EnvelopeSealer(recipient: recipient, keyID: "k", format: .authenticated).seal(Data("{}".utf8))
        var object = try #require(JSONSerialization.jsonObject(with: sealed) as? [String: String])
        var message = try #require(Data(base64Encoded: object["message"]!))
        message[message.count - 1] ^= 1
        object["message"] = message.base64EncodedString()
        let tampered = try JSONSerialization.data(withJSONObject: object)
        #expect(throws: DataQueueError.self) { try opener.open(tampered) }
        #expect(throws: DataQueueError.self) { try otherOpener.open(sealed) }
        for garbage in ["", "[]", "{}", #"{"key_id":"k","symmetric_key":"%%%","message":"","version":"1"}"#] {
            #expect(throws: DataQueueError.self) { try opener.open(Data(garbage.utf8)) }
        }
    }

    @Test("Keys under 2048 bits are refused with the size named")
    func smallKeys() throws {
        // 1024-bit RSA SubjectPublicKeyInfo (a public key, made with openssl for this test).
        let pem = """
            -----BEGIN PUBLIC KEY-----
            MIGfMA0GCSqGSIb3DQEBAQUAA4GNADCBiQKBgQDZpoHCA/Ovkc3i7ffb2hLSXkYv
            w2Mca+/wmsT0oG+U+iU3ugE9TP/lZ5qzX/hu00pjdcVgx0cIFwUV0unzm7gDUx7t
            GaVbAEspe+mLDaCsoS5Z8lpjMau2mqNBHyIGnIoukSOGdovzkLLJCrdXDPV5b5Yl
            xWAzEUoHNVwHP6C+9QIDAQAB
            -----END PUBLIC KEY-----
            """
        #expect {
            try RecipientKey(data: Data(pem.utf8))
        } throws: { ($0 as? DataQueueError)?.message.contains("1024 bits; at least 2048") == true }
    }
}
