import Crypto
import Foundation
import _CryptoExtras

extension EnvelopeSealer {
    /// The encrypted message format sent to a C3-PRO style receiver.
    ///
    /// Both formats are a JSON object of standard base64 strings:
    /// `{"key_id": …, "symmetric_key": …, "message": …, "version": …}`.
    public enum Format: String, Sendable, Codable, CaseIterable {
        /// The C3-PRO format, byte-compatible with deployed consumers: a fresh 32-byte AES key per message,
        /// AES-256-CBC with PKCS#7 padding and an all-zero IV (not sent), the key wrapped with RSA-OAEP
        /// (SHA-1, MGF1-SHA-1, empty label).
        ///
        /// > Important: CBC without a MAC is not authenticated. It is kept for compatibility; prefer
        /// > ``authenticated`` where the receiver supports it.
        case c3pro
        /// dq's authenticated format: AES-256-GCM with a random 12-byte nonce, `message` = nonce ‖ ciphertext ‖
        /// 16-byte tag, the key wrapped with RSA-OAEP-SHA-256 (MGF1-SHA-256), and `"alg": "A256GCM+RSA-OAEP-256"`
        /// in the envelope. An old C3-PRO consumer fails to unwrap the key and refuses it rather than misreading it.
        case authenticated

        /// The value of the `alg` member that marks the authenticated format.
        public static let authenticatedMarker = "A256GCM+RSA-OAEP-256"
    }
}

/// Seals resources into envelopes for one receiver key.
///
/// ```swift
/// let sealer = EnvelopeSealer(recipient: try RecipientKey(contentsOfFile: "server.crt"), keyID: "c3pro-2024")
/// let envelope = try sealer.seal(resource.data)
/// ```
public struct EnvelopeSealer: Sendable {
    /// The receiver's public key.
    public let recipient: RecipientKey
    /// Names the receiver's key pair (the consumer loads `<key_id>/private-c3pro.der`).
    public let keyID: String
    /// The FHIR version of the resources. The default is `1.0.2`, as the original sent.
    public let fhirVersion: String
    /// The format. The default is ``EnvelopeSealer/Format/c3pro``.
    public let format: EnvelopeSealer.Format

    /// Creates a sealer. Every parameter has the default stated on its property.
    public init(recipient: RecipientKey, keyID: String, fhirVersion: String = "1.0.2", format: EnvelopeSealer.Format = .c3pro) {
        self.recipient = recipient
        self.keyID = keyID
        self.fhirVersion = fhirVersion
        self.format = format
        head = Array(#"{"key_id":"#.utf8) + Array(EnvelopeCrypto.jsonString(keyID).utf8) + Array(#","symmetric_key":""#.utf8)
        var tail = Array(#"","version":"#.utf8) + Array(EnvelopeCrypto.jsonString(fhirVersion).utf8)
        if format == .authenticated {
            tail += Array(#","alg":""#.utf8) + Array(EnvelopeSealer.Format.authenticatedMarker.utf8) + [UInt8(ascii: "\"")]
        }
        self.tail = tail + [UInt8(ascii: "}")]
    }

    /// The envelope's fixed bytes before the wrapped key, and after the message.
    private let head: [UInt8]
    private let tail: [UInt8]
    private static let middle = Array(#"","message":""#.utf8)

    /// Encrypts `plaintext` with a fresh random AES-256 key and returns the envelope's JSON bytes.
    public func seal(_ plaintext: Data) throws -> Data {
        let key = SymmetricKey(size: .bits256)
        let keyBytes = key.withUnsafeBytes { Data($0) }
        // The C3-PRO message is encrypted chunk by chunk straight into the envelope (see below); the
        // authenticated one in one piece.
        var sealed: Data?
        let messageCount: Int
        let wrapped: Data
        do {
            switch format {
            case .c3pro:
                messageCount = (plaintext.count / 16 + 1) * 16
                wrapped = try recipient.wrap(keyBytes, sha256: false)
            case .authenticated:
                guard let combined = try AES.GCM.seal(plaintext, using: key).combined else {
                    throw DataQueueError(.encryption, "AES-GCM produced no sealed box")
                }
                sealed = combined
                messageCount = combined.count
                wrapped = try recipient.wrap(keyBytes, sha256: true)
            }
        } catch let error as DataQueueError {
            throw error
        } catch {
            throw DataQueueError(.encryption, "cannot encrypt the resource: \(error)")
        }
        // Built as bytes in one buffer of the exact size: the message is most of the envelope and is
        // base64-encoded straight into place.
        let count =
            head.count + Base64Writer.encodedCount(wrapped.count) + Self.middle.count
            + Base64Writer.encodedCount(messageCount) + tail.count
        var json = Data(count: count)
        try json.withUnsafeMutableBytes { (out: UnsafeMutableRawBufferPointer) in
            var offset = 0
            func put(_ bytes: [UInt8]) {
                bytes.withUnsafeBytes { out.baseAddress!.advanced(by: offset).copyMemory(from: $0.baseAddress!, byteCount: $0.count) }
                offset += bytes.count
            }
            func encode(_ data: Data) {
                offset += data.withUnsafeBytes { input in
                    Base64Writer.encode(input, into: UnsafeMutableRawBufferPointer(rebasing: out[offset...]))
                }
            }
            put(head)
            encode(wrapped)
            put(Self.middle)
            if let sealed {
                encode(sealed)
            } else {
                // CBC in chunks of whole blocks, each chained to the last ciphertext block of the one
                // before (the same bytes as one pass), so that the ciphertext of a megabyte resource never
                // exists as a whole: each chunk is base64-encoded into place while it is still in the cache.
                // The chunk size is a multiple of 48, so every chunk but the last encodes without padding.
                do {
                    try EnvelopeCrypto.cbcEncryptChunks(plaintext, key: key) { encode($0) }
                } catch {
                    throw DataQueueError(.encryption, "cannot encrypt the resource: \(error)")
                }
            }
            put(tail)
            precondition(offset == count)
        }
        return json
    }
}

/// Opens envelopes with the receiver's private key, in either format (what `dq decrypt` does).
public struct EnvelopeOpener: Sendable {
    /// The parsed key, kept (parsing it for each envelope would cost a good part of an RSA operation).
    // unchecked: immutable after init; BoringSSL's RSA decrypt takes a const key and locks its own blinding cache.
    private final class ParsedKey: @unchecked Sendable {
        let key: _RSA.Encryption.PrivateKey
        init(_ key: _RSA.Encryption.PrivateKey) { self.key = key }
    }
    private let parsed: ParsedKey
    private var key: _RSA.Encryption.PrivateKey { parsed.key }
    /// The key size in bits.
    public let keySizeInBits: Int

    /// Reads an RSA private key (PEM, PKCS#1 or PKCS#8).
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` when it is not a readable RSA private key.
    public init(privateKeyPEM: String) throws {
        do {
            parsed = ParsedKey(try _RSA.Encryption.PrivateKey(unsafePEMRepresentation: privateKeyPEM))
        } catch {
            throw DataQueueError(.invalidConfiguration, "the private key is not a readable RSA private key (PEM)")
        }
        keySizeInBits = parsed.key.keySizeInBits
    }

    /// Reads an RSA private key in DER (PKCS#8, as the C3-PRO consumer's `private-c3pro.der`, or PKCS#1).
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` when it is not a readable RSA private key.
    public init(privateKeyDER: Data) throws {
        do {
            parsed = ParsedKey(try _RSA.Encryption.PrivateKey(unsafeDERRepresentation: privateKeyDER))
        } catch {
            throw DataQueueError(.invalidConfiguration, "the private key is not a readable RSA private key (DER)")
        }
        keySizeInBits = parsed.key.keySizeInBits
    }

    /// Decrypts an envelope and returns the resource bytes.
    /// - Throws: ``DataQueueError`` with `.encryption` naming what is wrong with the envelope.
    public func open(_ envelope: Data) throws -> Data {
        func corrupt(_ why: String) -> DataQueueError { DataQueueError(.encryption, "envelope: \(why)") }
        guard let object = (try? JSONSerialization.jsonObject(with: envelope, options: [.fragmentsAllowed])) as? [String: Any] else {
            throw corrupt("not a JSON object")
        }
        for field in ["key_id", "symmetric_key", "message", "version"] {
            guard object[field] is String else { throw corrupt("\"\(field)\" is missing or not a string") }
        }
        let authenticated: Bool
        switch object["alg"] {
        case nil: authenticated = false
        case let alg as String where alg == EnvelopeSealer.Format.authenticatedMarker: authenticated = true
        default: throw corrupt("unknown \"alg\"")
        }
        guard let wrapped = Data(base64Encoded: object["symmetric_key"] as! String) else {
            throw corrupt("\"symmetric_key\" is not base64")
        }
        guard let message = Data(base64Encoded: object["message"] as! String) else {
            throw corrupt("\"message\" is not base64")
        }
        let keyBytes: Data
        do {
            keyBytes = try key.decrypt(wrapped, padding: authenticated ? .PKCS1_OAEP_SHA256 : .PKCS1_OAEP)
        } catch {
            throw corrupt("the symmetric key cannot be unwrapped with this private key")
        }
        guard keyBytes.count == 32 || (!authenticated && keyBytes.count == 16) else {
            throw corrupt("the symmetric key has \(keyBytes.count) bytes")
        }
        let key = SymmetricKey(data: keyBytes)
        do {
            if authenticated {
                return try AES.GCM.open(try AES.GCM.SealedBox(combined: message), using: key)
            }
            return try EnvelopeCrypto.cbcDecrypt(message, key: key)
        } catch {
            throw corrupt(authenticated ? "the message fails authentication" : "the message cannot be decrypted (bad padding)")
        }
    }
}

/// The primitives of the C3-PRO format.
enum EnvelopeCrypto {
    static let zeroIV = [UInt8](repeating: 0, count: 16)

    /// AES-CBC with PKCS#7 padding and the all-zero IV (C3-PRO's `AES/CBC/PKCS5Padding`), delivered to
    /// `body` in pieces of ``cbcChunk`` bytes (the last one with the padding).
    static func cbcEncryptChunks(_ plaintext: Data, key: SymmetricKey, _ body: (Data) throws -> Void) throws {
        var iv = try AES._CBC.IV(ivBytes: zeroIV)
        var start = plaintext.startIndex
        while plaintext.endIndex - start > cbcChunk {
            let chunk = try AES._CBC.encrypt(plaintext[start..<start + cbcChunk], using: key, iv: iv, noPadding: true)
            try body(chunk)
            iv = try AES._CBC.IV(ivBytes: chunk.suffix(16))
            start += cbcChunk
        }
        try body(try AES._CBC.encrypt(plaintext[start...], using: key, iv: iv))
    }

    /// 48 KiB: whole AES blocks, whole base64 groups, and small enough to stay in the cache.
    static let cbcChunk = 48 * 1024

    static func cbcDecrypt(_ ciphertext: Data, key: SymmetricKey) throws -> Data {
        guard !ciphertext.isEmpty, ciphertext.count % 16 == 0 else { throw DataQueueError(.encryption, "bad length") }
        return try AES._CBC.decrypt(ciphertext, using: key, iv: try AES._CBC.IV(ivBytes: zeroIV))
    }

    /// A JSON string literal.
    static func jsonString(_ text: String) -> String {
        let data = (try? JSONSerialization.data(withJSONObject: [text], options: [.withoutEscapingSlashes])) ?? Data("[\"\"]".utf8)
        let array = String(decoding: data, as: UTF8.self)
        return String(array.dropFirst().dropLast())
    }
}
