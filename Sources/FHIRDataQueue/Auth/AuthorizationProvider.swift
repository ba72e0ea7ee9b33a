import Foundation
import Logging

/// Supplies the `Authorization` header for requests to a server.
///
/// dq asks for a header before each request. After a 401 or 403 it asks once more with
/// `forceRefresh: true` and retries; a second refusal counts as an authentication failure.
/// Implementations must be safe to call from many tasks at once.
public protocol AuthorizationProvider: Sendable {
    /// Returns the full `Authorization` header value (e.g. `Bearer abc`), or nil for none.
    ///
    /// - Parameters:
    ///   - forceRefresh: the last header was refused; obtain a new one.
    ///   - logger: where to log (never the credential itself).
    /// - Throws: ``DataQueueError`` with code ``DataQueueError/Code/authentication`` when credentials
    ///   are refused, or ``DataQueueError/Code/transport`` when the token endpoint is unreachable.
    func authorizationHeader(forceRefresh: Bool, logger: Logger) async throws -> String?

    /// Returns a header to use after the server refused `refused`: a new one, unless the current header
    /// is already another one (a concurrent sender renewed it), which is then returned as is.
    ///
    /// The default asks ``authorizationHeader(forceRefresh:logger:)`` with `forceRefresh: true`.
    func authorizationHeader(replacing refused: String, logger: Logger) async throws -> String?

    /// Releases what the provider holds (HTTP clients). ``DataQueue/shutdown()`` calls it. The default does
    /// nothing.
    func shutdown() async throws
}

extension AuthorizationProvider {
    /// Asks for a fresh header (`forceRefresh: true`).
    public func authorizationHeader(replacing refused: String, logger: Logger) async throws -> String? {
        try await authorizationHeader(forceRefresh: true, logger: logger)
    }

    /// Nothing to release.
    public func shutdown() async throws {}
}

/// A fixed bearer token, e.g. from the `DQ_TOKEN` environment variable.
///
/// ```swift
/// let queue = try await DataQueue(baseURL: url, authorization: StaticBearerToken("s3cr3t"))
/// ```
public struct StaticBearerToken: AuthorizationProvider, CustomStringConvertible {
    private let token: String

    /// Creates a provider that always sends `Authorization: Bearer <token>`.
    public init(_ token: String) { self.token = token }

    /// `Bearer <token>`, always the same.
    public func authorizationHeader(forceRefresh: Bool, logger: Logger) async throws -> String? {
        "Bearer \(token)"
    }

    /// Never shows the token.
    public var description: String { "StaticBearerToken(<redacted>)" }
}
