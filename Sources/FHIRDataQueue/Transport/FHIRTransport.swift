import AsyncHTTPClient
import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import NIOPosix
import NIOSSL

/// One HTTP request as dq sends it.
struct OutgoingRequest: Sendable {
    var method: FHIRMethod
    var url: String
    var contentType: String
    var ifNoneExist: String?
    var body: Data
    /// A transaction Bundle: asks for a minimal answer and reads more of it (one entry per item).
    var isBundle = false
}

/// What came back from the server.
struct TransportResponse: Sendable {
    var status: Int
    /// The `Location` header.
    var location: String?
    /// The `Content-Location` header (some servers name a created resource only there).
    var contentLocation: String? = nil
    /// The `ETag` header (`W/"1"`).
    var etag: String? = nil
    var retryAfter: TimeInterval?
    var body: Data
}

/// A request that got no answer: why, and whether it may have reached the server.
struct TransportFailure: Error, Sendable {
    /// A PHI-free description.
    var message: String
    /// False only when the request certainly never left (connection refused, name not resolved, connect
    /// timeout, TLS handshake refused): then no orphaned request can be at the server.
    var mayHaveArrived: Bool
    /// Who did not answer, as far as dq can tell.
    var cause: TransportFailureCause = .other
}

/// Where a request without an answer failed (what `dq doctor` suggests depends on it).
package enum TransportFailureCause: Sendable, Equatable {
    /// No connection to the proxy the request goes through (refused, unreachable, not resolved, timed out).
    case proxyConnection
    /// The proxy answered but would not pass the request on (407, a refused tunnel, no answer in time).
    case proxyRefused
    /// No connection to the server itself (refused, unreachable, not resolved, timed out).
    case connection
    /// The TLS handshake with the server failed (its certificate, or dq's).
    case tls
    /// Anything else: a connection closed, a deadline passed.
    case other
}

/// The HTTP side of dq: sends requests with a deadline through async-http-client and reports the answer, and
/// whether a request that got none may have reached the server; knows nothing of SQLite.
final class FHIRTransport: Sendable {
    /// A client the caller owns (never shut down here), or nil for the process's shared ones.
    private let external: HTTPClient?
    /// The process's clients for this network configuration (nil with a caller's client).
    private let clients: HTTPClients?
    let timeout: TimeAmount
    /// The largest response body read; the rest is discarded (responses are only summarized).
    let maximumResponseBytes = 1 << 20
    /// dq's own event loop and the task executor on it, chosen on first use: taking one from the shared group
    /// starts the group's threads, which commands that only read the queue never need.
    private let loop = NIOLockedValueBox<(any EventLoop, EventLoopTaskExecutor)?>(nil)

    /// The event loop a flush's requests run on.
    var eventLoop: any EventLoop { ownLoop.0 }

    /// Runs a flush's code on ``eventLoop`` too (see ``EventLoopTaskExecutor``); nil with a caller's client.
    var taskExecutor: EventLoopTaskExecutor? { external == nil ? ownLoop.1 : nil }

    private var ownLoop: (any EventLoop, EventLoopTaskExecutor) {
        loop.withLockedValue { chosen in
            if let chosen { return chosen }
            let next = clients?.eventLoop ?? external?.eventLoopGroup.next() ?? MultiThreadedEventLoopGroup.singleton.next()
            let made = (next, EventLoopTaskExecutor(next))
            chosen = made
            return made
        }
    }

    /// - Parameters:
    ///   - network: proxies, trust and the client certificate.
    ///   - client: a client of the caller's (its own configuration applies), or nil for dq's.
    ///   - idleLimit: how long an idle connection is kept (tests of reuse on a loaded machine give more).
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) for a certificate, key or CA bundle that cannot be read.
    init(
        timeout: TimeInterval, connectTimeout: TimeInterval, network: NetworkConfiguration = NetworkConfiguration(),
        client: HTTPClient? = nil, idleLimit: TimeAmount = .seconds(4)
    ) throws {
        external = client
        clients =
            client == nil
            ? try HTTPClients.shared(
                for: network, connectTimeout: .milliseconds(Int64(connectTimeout * 1000)), idleLimit: idleLimit) : nil
        self.timeout = .milliseconds(Int64(timeout * 1000))
        clients?.noteTimeout(self.timeout)
    }

    /// The shared clients stay for the process; a caller's client is the caller's to shut down.
    func shutdown() async throws {}

    /// The client for `url`: the caller's, or the shared one for its proxy.
    private func client(for url: String) throws -> HTTPClient {
        if let external { return external }
        guard let clients, let parsed = URL(string: url) else { throw HTTPClientError.invalidURL }
        return try clients.client(for: parsed)
    }

    /// Sends `request`; throws ``TransportFailure`` when no answer came.
    func send(_ request: OutgoingRequest, authorization: String?, logger: Logger) async throws -> TransportResponse {
        var headers = HTTPHeaders()
        headers.add(name: "Content-Type", value: request.contentType)
        headers.add(name: "Accept", value: "application/fhir+json, application/json;q=0.9, */*;q=0.1")
        headers.add(name: "User-Agent", value: "dq/\(DQVersion.current)")
        if let ifNoneExist = request.ifNoneExist { headers.add(name: "If-None-Exist", value: ifNoneExist) }
        if request.isBundle { headers.add(name: "Prefer", value: "return=minimal") }
        if let authorization { headers.add(name: "Authorization", value: authorization) }
        let method: HTTPMethod = request.method == .post ? .POST : .PUT
        let limit = request.isBundle ? 16 * maximumResponseBytes : maximumResponseBytes
        return try await execute(url: request.url, method: method, headers: headers, body: request.body, limit: limit, logger: logger)
    }

    private static func response(_ head: HTTPResponseHead, _ body: ByteBuffer) -> TransportResponse {
        TransportResponse(
            status: Int(head.status.code),
            location: head.headers.first(name: "Location"), contentLocation: head.headers.first(name: "Content-Location"),
            etag: head.headers.first(name: "ETag"),
            retryAfter: ResponseClassification.parseRetryAfter(head.headers.first(name: "Retry-After")),
            body: Data(buffer: body))
    }

    /// `GET url` (the CapabilityStatement): the answer, or ``TransportFailure``.
    func get(_ url: String, authorization: String?, logger: Logger) async throws -> TransportResponse {
        var headers = HTTPHeaders()
        headers.add(name: "Accept", value: "application/fhir+json, application/json;q=0.9")
        headers.add(name: "User-Agent", value: "dq/\(DQVersion.current)")
        if let authorization { headers.add(name: "Authorization", value: authorization) }
        return try await execute(url: url, method: .GET, headers: headers, body: nil, limit: 4 * maximumResponseBytes, logger: logger)
    }

    /// One exchange with the event-loop API and a delegate that keeps the head and the first `limit` bytes of
    /// the body (one hand-over to the caller per request) and knows whether the request head was written.
    ///
    /// What the server may have seen decides what a failure means: before the head was written (no
    /// connection, a refused proxy tunnel, a TLS handshake that did not complete) nothing was sent; after it,
    /// the request may have arrived. An answer whose status line came counts even when the connection then
    /// fails: the server decided.
    private func execute(
        url: String, method: HTTPMethod, headers: HTTPHeaders, body: Data?, limit: Int, logger: Logger
    ) async throws -> TransportResponse {
        // On the requests' event loop (a flush is there already: no hop): the answer resumes this code after the
        // client has put its connection back in the pool, so the next request reuses it instead of opening
        // another while the first is still being released.
        guard let executor = taskExecutor else {
            return try await exchange(url: url, method: method, headers: headers, body: body, limit: limit, logger: logger)
        }
        return try await withTaskExecutorPreference(executor) {
            try await exchange(url: url, method: method, headers: headers, body: body, limit: limit, logger: logger)
        }
    }

    private func exchange(
        url: String, method: HTTPMethod, headers: HTTPHeaders, body: Data?, limit: Int, logger: Logger
    ) async throws -> TransportResponse {
        let delegate = ResponseSummary(limit: limit)
        let started = ContinuousClock.now
        let sentBytes = body?.count ?? 0
        do {
            let client = try client(for: url)
            let http = try HTTPClient.Request(
                url: url, method: method, headers: headers, body: body.map { .byteBuffer(ByteBuffer(data: $0)) })
            let task = client.execute(
                request: http, delegate: delegate, eventLoop: .delegate(on: eventLoop), deadline: .now() + timeout,
                logger: Self.silent)
            let (head, body) = try await task.futureResult.get()
            // Answered before its body was all sent (a 401 or 413 for a large body): the client closes that
            // connection, but its pool can stay held by the unsent body when the server reads no more; the
            // next request gets a client of its own.
            if !delegate.requestSent {
                task.cancel()
                clients?.retire(client)
            }
            // Sizes and timings only: never a body byte, never the path (an update's holds the resource's id).
            logger.trace(
                "HTTP exchange",
                metadata: [
                    "method": "\(method.rawValue)", "server": "\(Self.origin(url))", "status": "\(head.status.code)",
                    "sent_bytes": "\(sentBytes)", "received_bytes": "\(body.readableBytes)",
                    "elapsed": "\(ContinuousClock.now - started)",
                ])
            return Self.response(head, body)
        } catch let error as DataQueueError {
            throw error
        } catch {
            if let (head, body) = delegate.partial { return Self.response(head, body) }
            let network = clients?.network
            let cause = Self.cause(of: error, url: url, network: network)
            throw TransportFailure(
                message: Self.noAnswer(error, url: url, server: Self.origin(url), network: network, cause: cause),
                mayHaveArrived: delegate.requestHeadSent && !Self.neverSent(error), cause: cause)
        }
    }

    /// Whether `error` by itself means the request never left this machine (no connection was made).
    static func neverSent(_ error: any Error) -> Bool {
        if let error = error as? HTTPClientError {
            return [
                .connectTimeout, .invalidURL, .emptyHost, .proxyAuthenticationRequired, .invalidProxyResponse,
                .httpProxyHandshakeTimeout, .socksHandshakeTimeout,
            ].contains(error)
        }
        if error is NIOConnectionError { return true }
        if let error = error as? IOError {
            return [ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EADDRNOTAVAIL].contains(error.errnoCode)
        }
        if let error = error as? ChannelError, case .connectTimeout = error { return true }
        return false
    }

    /// The HTTP client's own request logs, never shown: at trace level async-http-client prints the first and
    /// last bytes of every body part (a resource's PHI) and the request's URL (an update's holds the resource's
    /// id). dq logs each request's size and timing itself.
    static let silent = Logger(label: "dq.http", factory: { _ in SwiftLogNoOpLogHandler() })

    /// The scheme, host and port of `url`: how a failure of a request to a FHIR server names that server. Not
    /// its path, which for an update holds the resource's id: the text is logged and kept with the item, readable
    /// even in a queue sealed at rest.
    static func origin(_ url: String) -> String {
        guard let components = URLComponents(string: url), let scheme = components.scheme, let host = components.host
        else { return "the server" }
        return "\(scheme)://\(host.contains(":") && !host.hasPrefix("[") ? "[\(host)]" : host)\(components.port.map { ":\($0)" } ?? "")"
    }

    /// The URL without query or user info, safe to log.
    static func redacted(_ url: String) -> String {
        guard var components = URLComponents(string: url) else { return "the server" }
        components.user = nil
        components.password = nil
        components.query = nil
        return components.string ?? "the server"
    }

    /// `error` of a request to `url` in words, naming the proxy it went through where it is the proxy's doing.
    func describe(_ error: any Error, url: String) -> String {
        Self.describe(error, url: url, network: clients?.network)
    }

    /// The words of a request to `url` that got no answer: `no answer from <server>: <why>`, or, when the
    /// connection that failed was the one to the proxy `network` sends `url` through (`no_proxy` considered),
    /// `no answer from the proxy http://host:port (for <server>): <why>`, without the proxy's credentials.
    /// `server` is how the caller names the endpoint (a FHIR server by its origin, never a path); `cause`, when the
    /// caller has worked it out already (``cause(of:url:network:)``).
    static func noAnswer(
        _ error: any Error, url: String, server: String, network: NetworkConfiguration?, cause known: TransportFailureCause? = nil
    ) -> String {
        guard (known ?? cause(of: error, url: url, network: network)) == .proxyConnection,
            let proxy = URL(string: url).flatMap({ network?.proxy(for: $0) })
        else { return "no answer from \(server): \(describe(error, url: url, network: network))" }
        var reason = describe(error)
        if reason == Self.unresolvedHost { reason = "the proxy's host name could not be resolved" }
        return "no answer from the proxy \(NetworkConfiguration.origin(ofProxy: proxy)) (for \(server)): \(reason)"
    }

    /// Where a request to `url` that failed with `error` failed: at the proxy `network` sends it through, at the
    /// server, in the TLS handshake, or elsewhere.
    ///
    /// Through a proxy, every connection dq opens is one to the proxy (an http:// server is reached by CONNECT
    /// too): a connection that cannot be made at all is the proxy's absence; a server the proxy cannot reach is
    /// the proxy's answer to CONNECT (a refused tunnel).
    static func cause(of error: any Error, url: String, network: NetworkConfiguration?) -> TransportFailureCause {
        let proxied = URL(string: url).flatMap { network?.proxy(for: $0) } != nil
        if let error = error as? HTTPClientError,
            [.proxyAuthenticationRequired, .invalidProxyResponse, .httpProxyHandshakeTimeout, .socksHandshakeTimeout].contains(error)
        {
            return .proxyRefused
        }
        if isConnectFailure(error) { return proxied ? .proxyConnection : .connection }
        if describeTLS(String(reflecting: error), clientCertificate: network?.clientCertificatePath != nil) != nil { return .tls }
        return .other
    }

    /// Whether `error` is a connection that could not be made at all: refused, unreachable, a name not resolved,
    /// or the connect deadline passed.
    static func isConnectFailure(_ error: any Error) -> Bool {
        if let error = error as? HTTPClientError { return error == .connectTimeout }
        if error is NIOConnectionError { return true }
        if let error = error as? ChannelError, case .connectTimeout = error { return true }
        if let error = error as? IOError {
            return [ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EADDRNOTAVAIL].contains(error.errnoCode)
        }
        let text = String(reflecting: error)
        let words = ["connectionRefused", "Connection refused", "getaddrinfo", "NXDOMAIN", "unknownHost", "UnknownHost"]
        return words.contains { text.contains($0) }
    }

    /// ``describe(_:url:network:)``'s words for a host name that did not resolve.
    static let unresolvedHost = "the server's host name could not be resolved"

    /// `error` of a request to `url` in words; `network` names the proxy that request went through (the one for
    /// its scheme, unless `no_proxy` sends it around) and says whether dq has a client certificate.
    static func describe(_ error: any Error, url: String? = nil, network: NetworkConfiguration? = nil) -> String {
        let proxy = url.flatMap(URL.init(string:)).flatMap { network?.proxy(for: $0) }
        let proxyName = proxy.map { "the proxy \(NetworkConfiguration.redacted($0))" } ?? "the proxy"
        let clientCertificate = network?.clientCertificatePath != nil
        if let error = error as? HTTPClientError {
            switch error {
            case .deadlineExceeded: return "timed out"
            case .connectTimeout: return "connect timed out"
            case .remoteConnectionClosed: return "connection closed by the server"
            case .readTimeout: return "read timed out"
            case .proxyAuthenticationRequired: return "\(proxyName) wants credentials (407; give them in the proxy URL)"
            case .invalidProxyResponse: return "\(proxyName) refused the tunnel (CONNECT was not answered 200)"
            case .httpProxyHandshakeTimeout, .socksHandshakeTimeout: return "\(proxyName) did not answer in time"
            default: break
            }
        }
        if let error = error as? IOError, [ECONNRESET, EPIPE].contains(error.errnoCode) {
            return "connection closed by the server (reset)"
        }
        let text = String(reflecting: error)
        if let tls = describeTLS(text, clientCertificate: clientCertificate) { return tls }
        if text.contains("connectionRefused") || text.contains("Connection refused") { return "connection refused" }
        if text.contains("getaddrinfo") || text.contains("NXDOMAIN") || text.contains("unknownHost") || text.contains("UnknownHost") {
            return unresolvedHost
        }
        let plain = "\(error)"
        return plain.count > 200 ? String(plain.prefix(200)) + "…" : plain
    }

    /// A certificate or TLS failure in words: what is wrong and what to do.
    ///
    /// dq treats these as temporary (the item stays queued and the server backs off): an expired or wrong
    /// certificate is fixed at the server, without any change on dq's side. The words tell the operator.
    static func describeTLS(_ text: String, clientCertificate: Bool = false) -> String? {
        let lowered = text.lowercased()
        if lowered.contains("certificate_required") || lowered.contains("certificate required")
            || (!clientCertificate && lowered.contains("sslv3_alert_handshake_failure"))
        {
            return clientCertificate
                ? "TLS: the server refused dq's client certificate"
                : "TLS: the server wants a client certificate (set \"tls.client_certificate\" and \"tls.client_key\")"
        }
        if lowered.contains("bad_certificate") || lowered.contains("unknown_ca") && clientCertificate {
            return "TLS: the server refused dq's client certificate"
        }
        if lowered.contains("failedtovalidatehostname") || lowered.contains("hostname mismatch")
            || (lowered.contains("couldn't find") && lowered.contains("in certificate"))
        {
            return "TLS: the server's certificate does not name this host (name mismatch)"
        }
        if lowered.contains("certificate has expired") || lowered.contains("certificate_expired") {
            return "TLS: the server's certificate has expired"
        }
        if lowered.contains("not yet valid") {
            return "TLS: the server's certificate is not valid yet (check the clocks)"
        }
        if lowered.contains("self signed") || lowered.contains("self-signed") || lowered.contains("unable to get local issuer")
            || lowered.contains("certificate_verify_failed") || lowered.contains("unknown ca")
        {
            return "TLS: the server's certificate is not from a trusted issuer (for a private CA set \"ca_bundle\")"
        }
        if lowered.contains("nisslerror") || lowered.contains("handshakefailed") || lowered.contains("boringssl") {
            return "TLS: the handshake with the server failed"
        }
        return nil
    }
}

/// The version of dq.
package enum DQVersion {
    /// The version string, e.g. `0.1.0`.
    package static let current = "0.1.0"
}

/// Keeps a response's head and the first `limit` bytes of its body; the rest is read and discarded, so
/// that a large answer to a delivered item is never taken for a failure.
///
/// Every callback runs on the request's event loop, one after the other, which is what makes the
/// mutable state safe.
private final class ResponseSummary: HTTPClientResponseDelegate, @unchecked Sendable {
    typealias Response = (HTTPResponseHead, ByteBuffer)

    private let limit: Int
    private var head: HTTPResponseHead?
    private var body = ByteBuffer()
    /// Read by the caller after the exchange ended, from another thread.
    private let outcome = NIOLockedValueBox<(headSent: Bool, sent: Bool, head: HTTPResponseHead?)>((false, false, nil))

    init(limit: Int) { self.limit = limit }

    /// Whether the request head was written to the connection (after which the request may have arrived).
    var requestHeadSent: Bool { outcome.withLockedValue { $0.headSent } }

    /// The head and the body so far of an answer whose connection failed after its status line came.
    var partial: Response? {
        outcome.withLockedValue { $0.head }.map { ($0, body) }
    }

    /// Whether the whole request (head and body) was written.
    var requestSent: Bool { outcome.withLockedValue { $0.sent } }

    func didSendRequestHead(task: HTTPClient.Task<Response>, _ head: HTTPRequestHead) {
        outcome.withLockedValue { $0.headSent = true }
    }

    func didSendRequest(task: HTTPClient.Task<Response>) {
        outcome.withLockedValue { $0.sent = true }
    }

    func didReceiveHead(task: HTTPClient.Task<Response>, _ head: HTTPResponseHead) -> EventLoopFuture<Void> {
        self.head = head
        outcome.withLockedValue { $0.head = head }
        return task.eventLoop.makeSucceededVoidFuture()
    }

    func didReceiveBodyPart(task: HTTPClient.Task<Response>, _ buffer: ByteBuffer) -> EventLoopFuture<Void> {
        var buffer = buffer
        let take = min(buffer.readableBytes, limit - body.readableBytes)
        if take > 0, let slice = buffer.readSlice(length: take) { body.writeImmutableBuffer(slice) }
        return task.eventLoop.makeSucceededVoidFuture()
    }

    func didFinishRequest(task: HTTPClient.Task<Response>) throws -> Response {
        guard let head else { throw HTTPClientError.remoteConnectionClosed }
        return (head, body)
    }
}

/// Runs a task's jobs on one NIO event loop: with it as the task executor preference, a flush's code and
/// its HTTP client share a thread, so each answer resumes the flush without waking another thread.
///
/// The flush never blocks: storage work goes to GRDB's queue (SQLite) or is asynchronous (PostgreSQL).
final class EventLoopTaskExecutor: TaskExecutor, @unchecked Sendable {  // unchecked: TaskExecutor requires it; holds one let
    private let loop: any EventLoop

    init(_ loop: any EventLoop) { self.loop = loop }

    func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        loop.execute { job.runSynchronously(on: self.asUnownedTaskExecutor()) }
    }
}
