import Crypto
import Foundation
import X509
import _CryptoExtras

/// The receiver's RSA public key that wraps each message key, read from an X.509 certificate (PEM or DER)
/// or a bare SubjectPublicKeyInfo public key (PEM `PUBLIC KEY` or DER).
///
/// > Important: keys under 2048 bits are refused.
public struct RecipientKey: Sendable {
    /// The SubjectPublicKeyInfo DER of the key.
    let spkiDER: Data
    /// The parsed key, kept so each message does not parse it again.
    private let box: KeyBox
    /// The key size in bits.
    public let keySizeInBits: Int
    /// When the certificate expires, if the key came from a certificate.
    public let notValidAfter: Date?

    /// Whether the certificate has expired (dq still encrypts, but warns).
    public var isExpired: Bool { notValidAfter.map { $0 < Date() } ?? false }

    /// Reads a certificate or public key file.
    ///
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` naming the problem: unreadable file,
    ///   not a certificate or key, not RSA, under 2048 bits.
    public init(contentsOfFile path: String) throws {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw DataQueueError(.invalidConfiguration, "encryption: cannot read the certificate file \(path)")
        }
        try self.init(data: data, source: path)
    }

    /// Reads a certificate or public key from PEM or DER bytes.
    public init(data: Data, source: String = "certificate") throws {
        func fail(_ why: String) -> DataQueueError {
            DataQueueError(.invalidConfiguration, "encryption: \(source): \(why)")
        }
        let text = String(decoding: data, as: UTF8.self)
        var spki: Data?
        var expiry: Date?
        if text.contains("-----BEGIN CERTIFICATE-----") || !text.contains("-----BEGIN") {
            let certificate: Certificate?
            if text.contains("-----BEGIN CERTIFICATE-----") {
                certificate = try? Certificate(pemEncoded: text)
            } else {
                certificate = try? Certificate(derEncoded: Array(data))
            }
            if let certificate {
                guard let rsa = _RSA.Signing.PublicKey(certificate.publicKey) else {
                    throw fail("the certificate's key is not an RSA key")
                }
                spki = rsa.derRepresentation
                expiry = certificate.notValidAfter
            } else if !text.contains("-----BEGIN") && data.first == 0x30 {
                spki = data  // a bare DER SubjectPublicKeyInfo
            } else if !text.contains("-----BEGIN") {
                throw fail("not an X.509 certificate or a PUBLIC KEY (PEM or DER)")
            } else {
                throw fail("not a readable X.509 certificate (or its RSA key is under 2048 bits)")
            }
        } else if text.contains("-----BEGIN PUBLIC KEY-----") {
            let body = text.components(separatedBy: "-----BEGIN PUBLIC KEY-----")[1]
                .components(separatedBy: "-----END PUBLIC KEY-----")[0]
                .components(separatedBy: .whitespacesAndNewlines).joined()
            guard let der = Data(base64Encoded: body) else { throw fail("the PUBLIC KEY block is not base64") }
            spki = der
        } else {
            throw fail("not an X.509 certificate or a PUBLIC KEY (PEM or DER)")
        }
        guard let spki else { throw fail("no public key found") }
        let key: _RSA.Encryption.PublicKey
        do {
            key = try _RSA.Encryption.PublicKey(unsafeDERRepresentation: spki)
        } catch {
            throw fail("not an RSA public key (or under 1024 bits)")
        }
        guard key.keySizeInBits >= 2048 else {
            throw fail("the RSA key has \(key.keySizeInBits) bits; at least 2048 are required")
        }
        self.spkiDER = spki
        self.box = KeyBox(key)
        self.keySizeInBits = key.keySizeInBits
        self.notValidAfter = expiry
    }

    /// Wraps `keyBytes` with RSA-OAEP.
    func wrap(_ keyBytes: Data, sha256: Bool) throws -> Data {
        try box.key.encrypt(keyBytes, padding: sha256 ? .PKCS1_OAEP_SHA256 : .PKCS1_OAEP)
    }
}

/// Holds an RSA public key. `_RSA.Encryption.PublicKey` is not marked `Sendable` in swift-crypto 4.5.2, but
/// it is immutable and BoringSSL's public-key operations are safe to run from several threads at once.
private final class KeyBox: @unchecked Sendable {  // unchecked: swift-crypto's key type is not marked Sendable (see above)
    let key: _RSA.Encryption.PublicKey
    init(_ key: _RSA.Encryption.PublicKey) { self.key = key }
}
