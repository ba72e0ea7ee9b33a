import AsyncHTTPClient
import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import NIOSSL

/// One HTTP request as dq sends it.
struct OutgoingRequest: Sendable {
    var method: FHIRMethod
    var url: String
    var contentType: String
    var ifNoneExist: String?
    var body: Data
}

/// What came back from the server.
struct TransportResponse: Sendable {
    var status: Int
    var location: String?
    var retryAfter: TimeInterval?
    var body: Data
}

/// The HTTP side of dq: sends requests with a deadline and reports the answer; knows nothing of SQLite.
final class FHIRTransport: Sendable {
    /// Made on first use, so commands that only read the queue start no event loop.
    private let box = NIOLockedValueBox<HTTPClient?>(nil)
    private let configuration: HTTPClient.Configuration
    let timeout: TimeAmount
    /// The largest response body read; the rest is discarded (responses are only summarized).
    let maximumResponseBytes = 1 << 20

    init(timeout: TimeInterval, connectTimeout: TimeInterval, caBundlePath: String?) throws {
        var configuration = HTTPClient.Configuration()
        configuration.timeout = .init(
            connect: .milliseconds(Int64(connectTimeout * 1000)), read: .milliseconds(Int64(timeout * 1000)))
        configuration.redirectConfiguration = .disallow
        // dq retries with its own backoff; the pool must not spin on a refused connection until the deadline.
        configuration.connectionPool.retryConnectionEstablishment = false
        configuration.decompression = .enabled(limit: .ratio(100))
        if let caBundlePath {
            var tls = TLSConfiguration.makeClientConfiguration()
            tls.trustRoots = .file(caBundlePath)
            configuration.tlsConfiguration = tls
        }
        self.configuration = configuration
        self.timeout = .milliseconds(Int64(timeout * 1000))
    }

    private var client: HTTPClient {
        box.withLockedValue { client in
            if let client { return client }
            let made = HTTPClient(eventLoopGroupProvider: .singleton, configuration: configuration)
            client = made
            return made
        }
    }

    func shutdown() async throws {
        let client = box.withLockedValue { client in
            defer { client = nil }
            return client
        }
        try await client?.shutdown()
    }

    /// Sends `request`; throws ``DataQueueError`` with code `.transport` when no answer came.
    func send(_ request: OutgoingRequest, authorization: String?, logger: Logger) async throws -> TransportResponse {
        var http = HTTPClientRequest(url: request.url)
        http.method = request.method == .post ? .POST : .PUT
        http.headers.add(name: "Content-Type", value: request.contentType)
        http.headers.add(name: "Accept", value: "application/fhir+json, application/json;q=0.9, */*;q=0.1")
        http.headers.add(name: "User-Agent", value: "dq/\(DQVersion.current)")
        if let ifNoneExist = request.ifNoneExist { http.headers.add(name: "If-None-Exist", value: ifNoneExist) }
        if let authorization { http.headers.add(name: "Authorization", value: authorization) }
        http.body = .bytes(ByteBuffer(data: request.body))
        do {
            let response = try await client.execute(http, timeout: timeout, logger: logger)
            var collected = ByteBuffer()
            for try await var chunk in response.body {
                if collected.readableBytes < maximumResponseBytes {
                    let take = min(chunk.readableBytes, maximumResponseBytes - collected.readableBytes)
                    if let slice = chunk.readSlice(length: take) { collected.writeImmutableBuffer(slice) }
                }
            }
            return TransportResponse(
                status: Int(response.status.code),
                location: response.headers.first(name: "Location") ?? response.headers.first(name: "Content-Location"),
                retryAfter: ResponseClassification.parseRetryAfter(response.headers.first(name: "Retry-After")),
                body: Data(buffer: collected))
        } catch {
            throw DataQueueError(.transport, "no answer from \(Self.redacted(request.url)): \(Self.describe(error))")
        }
    }

    /// The URL without query or user info, safe to log.
    static func redacted(_ url: String) -> String {
        guard var components = URLComponents(string: url) else { return "the server" }
        components.user = nil
        components.password = nil
        components.query = nil
        return components.string ?? "the server"
    }

    static func describe(_ error: any Error) -> String {
        if let error = error as? HTTPClientError {
            switch error {
            case .deadlineExceeded: return "timed out"
            case .connectTimeout: return "connect timed out"
            case .remoteConnectionClosed: return "connection closed by the server"
            case .readTimeout: return "read timed out"
            default: return "\(error)"
            }
        }
        let text = "\(error)"
        if text.contains("connectionRefused") || text.contains("Connection refused") { return "connection refused" }
        return text.count > 200 ? String(text.prefix(200)) : text
    }
}

/// The version of dq.
public enum DQVersion {
    /// The version string, e.g. `0.1.0`.
    public static let current = "0.1.0"
}
