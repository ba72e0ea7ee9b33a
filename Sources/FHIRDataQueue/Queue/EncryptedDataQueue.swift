import AsyncHTTPClient
import Foundation
import Logging

/// A ``DataQueue`` that encrypts chosen resources for a C3-PRO style receiver before they touch the disk.
///
/// A policy decides per resource whether it is encrypted (the original's delegate). Encrypted resources
/// are sealed into an envelope (see ``EnvelopeSealer/Format``) with a fresh AES key each, queued as the envelope
/// only, and sent as `POST {encryptedBaseURL}/{resourceType}` with `Content-Type: application/json`. The
/// others go to the FHIR endpoint exactly as ``DataQueue`` sends them. Both kinds share one queue, so
/// their order is kept.
///
/// ```swift
/// let queue = try await EncryptedDataQueue(
///     baseURL: URL(string: "https://example.org/fhir")!,
///     encryptedBaseURL: URL(string: "https://example.org/c3pro/encfhir")!,
///     sealer: EnvelopeSealer(recipient: try RecipientKey(contentsOfFile: "server.crt"), keyID: "key-1"),
///     shouldEncrypt: { $0.resourceType != "Binary" })
/// ```
///
/// A 2xx answer whose body is an error (`{'error':…}`, as the C3-PRO servlet sends) is never counted as
/// delivered; an empty 200 or a bare `"OK"` is.
public final class EncryptedDataQueue: DataQueue, @unchecked Sendable {  // unchecked: inherited from DataQueue; adds only lets
    /// Where envelopes are posted, e.g. `https://example.org/c3pro/encfhir`.
    public let encryptedBaseURL: URL
    /// Seals resources for the receiver.
    public let sealer: EnvelopeSealer
    /// The encrypted endpoint in its normal form.
    private let encryptedEndpoint: String
    private let shouldEncrypt: @Sendable (FHIRResource) -> Bool

    /// Opens the queue.
    ///
    /// - Parameters:
    ///   - baseURL: the plain FHIR endpoint (also the queue's name).
    ///   - encryptedBaseURL: the encrypted endpoint.
    ///   - sealer: the receiver's key and the envelope settings.
    ///   - shouldEncrypt: whether a resource is encrypted. The default encrypts every resource.
    ///   - configuration: storage, sending and retry settings, as for ``DataQueue``.
    ///   - authorization: supplies the `Authorization` header of both endpoints, as for ``DataQueue``.
    ///   - httpClient: an HTTP client of the caller's, as for ``DataQueue``.
    ///   - logger: where the queue logs, as for ``DataQueue``.
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` for a bad URL.
    public init(
        baseURL: URL, encryptedBaseURL: URL, sealer: EnvelopeSealer,
        shouldEncrypt: @escaping @Sendable (FHIRResource) -> Bool = { _ in true },
        configuration: Configuration = Configuration(), authorization: (any AuthorizationProvider)? = nil,
        httpClient: HTTPClient? = nil, logger: Logger = Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
    ) async throws {
        self.encryptedEndpoint = try DataQueue.queueName(for: encryptedBaseURL, setting: "encryption.endpoint")
        self.encryptedBaseURL = encryptedBaseURL
        self.sealer = sealer
        self.shouldEncrypt = shouldEncrypt
        try await super.init(
            baseURL: baseURL, configuration: configuration, authorization: authorization, httpClient: httpClient,
            logger: logger)
        if sealer.recipient.isExpired {
            logger.warning(
                "the encryption certificate has expired; encrypting anyway",
                metadata: ["notValidAfter": "\(sealer.recipient.notValidAfter.map { "\($0)" } ?? "-")"])
        }
    }

    /// `POST` for what this queue encrypts (envelopes are always created), else as ``DataQueue``.
    public override func defaultMethod(for resource: FHIRResource) -> FHIRMethod {
        shouldEncrypt(resource) ? .post : super.defaultMethod(for: resource)
    }

    /// Encrypts resources the policy selects and routes them to the encrypted endpoint.
    ///
    /// An encrypted resource is always posted: the receiver takes envelopes, not updates. An update of a
    /// resource the policy encrypts (``DataQueue/update(_:)``) therefore throws rather than silently sending a create.
    ///
    /// - Throws: ``DataQueueError`` with `.invalidResource` for a `PUT` of a resource to encrypt, and as
    ///   ``DataQueue/prepareRequest(for:method:itemID:)`` otherwise.
    public override func prepareRequest(for resource: FHIRResource, method: FHIRMethod, itemID: UUID) throws
        -> DataQueue.PreparedRequest
    {
        guard shouldEncrypt(resource) else {
            return try super.prepareRequest(for: resource, method: method, itemID: itemID)
        }
        guard method == .post else {
            throw DataQueueError(
                .invalidResource,
                "an encrypted resource cannot be sent as an update (PUT): the encrypted endpoint only takes new envelopes (POST); use create"
            )
        }
        let envelope = try sealer.seal(resource.data)
        return DataQueue.PreparedRequest(
            method: .post, path: resource.resourceType, contentType: "application/json", body: envelope,
            resourceType: resource.resourceType, resourceID: resource.id, encrypted: true)
    }

    /// The encrypted endpoint for envelopes, the base URL otherwise.
    public override func endpoint(encrypted: Bool) throws -> String {
        encrypted ? encryptedEndpoint : try super.endpoint(encrypted: false)
    }
}
