import Foundation
import Logging

/// What `dq doctor` checks of the network before a flush needs it: the TLS files, read as the HTTP clients read
/// them, and whether an endpoint answers over the route a flush takes (the same shared clients, trust, proxy,
/// `no_proxy` and deadlines). Nothing is sent but a GET, with no credential.
package enum EndpointCheck {
    /// A GET that got no answer.
    package struct Failure: Error, Sendable {
        /// Where it failed: the proxy, the server, the TLS handshake.
        package var cause: TransportFailureCause
        /// PHI-free words naming who did not answer (the proxy, when the connection to it failed).
        package var message: String
    }

    /// Reads the CA bundle, client certificate and key of `network` as dq's HTTP clients do.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming a file that cannot be read or holds no PEM
    ///   certificate or key.
    package static func readTLSFiles(_ network: NetworkConfiguration) throws {
        _ = try HTTPClients.tlsConfiguration(network)
    }

    /// `GET url` over the route a flush takes, without credentials: the status of the answer (any answer means
    /// the endpoint, and the proxy on the way, are there).
    ///
    /// - Throws: ``Failure`` when no answer came; ``DataQueueError`` (`.invalidConfiguration`) for a proxy URL or
    ///   TLS file dq cannot use.
    package static func get(
        _ url: URL, network: NetworkConfiguration, timeout: TimeInterval, connectTimeout: TimeInterval, logger: Logger
    ) async throws -> Int {
        let transport = try FHIRTransport(timeout: timeout, connectTimeout: connectTimeout, network: network)
        do {
            return try await transport.get(url.absoluteString, authorization: nil, logger: logger).status
        } catch let failure as TransportFailure {
            throw Failure(cause: failure.cause, message: failure.message)
        }
    }
}
