import Foundation
import Logging

/// A ``DataQueue`` that encrypts chosen resources for a C3-PRO style receiver before they touch the disk.
///
/// A policy decides per resource whether it is encrypted (the original's delegate). Encrypted resources
/// are sealed into an envelope (see ``EnvelopeFormat``) with a fresh AES key each, queued as the envelope
/// only, and sent as `POST {encryptedBaseURL}/{resourceType}` with `Content-Type: application/json`. The
/// others go to the FHIR endpoint exactly as ``DataQueue`` sends them. Both kinds share one queue, so
/// their order is kept.
///
/// ```swift
/// let queue = try EncryptedDataQueue(
///     baseURL: URL(string: "https://example.org/fhir")!,
///     encryptedBaseURL: URL(string: "https://example.org/c3pro/encfhir")!,
///     sealer: EnvelopeSealer(recipient: try RecipientKey(contentsOfFile: "server.crt"), keyID: "key-1"),
///     shouldEncrypt: { $0.resourceType != "Binary" })
/// ```
///
/// A 2xx answer whose body is an error (`{'error':…}`, as the C3-PRO servlet sends) is never counted as
/// delivered; an empty 200 or a bare `"OK"` is.
public final class EncryptedDataQueue: DataQueue, @unchecked Sendable {
    /// Where envelopes are posted, e.g. `https://example.org/c3pro/encfhir`.
    public let encryptedBaseURL: URL
    /// Seals resources for the receiver.
    public let sealer: EnvelopeSealer
    private let shouldEncrypt: @Sendable (FHIRResource) -> Bool

    /// Opens the queue.
    ///
    /// - Parameters:
    ///   - baseURL: the plain FHIR endpoint (also the queue's name).
    ///   - encryptedBaseURL: the encrypted endpoint.
    ///   - sealer: the receiver's key and the envelope settings.
    ///   - shouldEncrypt: whether a resource is encrypted. The default encrypts every resource.
    ///   - configuration, authorization, logger: as for ``DataQueue``.
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` for a bad URL.
    public init(
        baseURL: URL, encryptedBaseURL: URL, sealer: EnvelopeSealer,
        shouldEncrypt: @escaping @Sendable (FHIRResource) -> Bool = { _ in true },
        configuration: Configuration = Configuration(), authorization: (any AuthorizationProvider)? = nil,
        logger: Logger = Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
    ) throws {
        guard let scheme = encryptedBaseURL.scheme?.lowercased(), scheme == "http" || scheme == "https",
            encryptedBaseURL.host != nil
        else {
            throw DataQueueError(.invalidConfiguration, "encryption.endpoint: must be an http or https URL with a host")
        }
        self.encryptedBaseURL = encryptedBaseURL
        self.sealer = sealer
        self.shouldEncrypt = shouldEncrypt
        try super.init(baseURL: baseURL, configuration: configuration, authorization: authorization, logger: logger)
        if sealer.recipient.isExpired {
            logger.warning(
                "the encryption certificate has expired; encrypting anyway",
                metadata: ["notValidAfter": "\(sealer.recipient.notValidAfter.map { "\($0)" } ?? "-")"])
        }
    }

    /// Encrypts resources the policy selects and routes them to the encrypted endpoint.
    public override func prepareRequest(for resource: FHIRResource, method: FHIRMethod, itemID: UUID) throws
        -> PreparedRequest
    {
        guard shouldEncrypt(resource) else {
            return try super.prepareRequest(for: resource, method: method, itemID: itemID)
        }
        let envelope = try sealer.seal(resource.data)
        return PreparedRequest(
            method: .post, url: Self.queueName(for: encryptedBaseURL) + "/" + resource.resourceType,
            contentType: "application/json", body: envelope, resourceType: resource.resourceType,
            resourceID: resource.id, encrypted: true)
    }
}
