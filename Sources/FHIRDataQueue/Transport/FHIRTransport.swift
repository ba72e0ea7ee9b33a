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
}

/// The HTTP side of dq: sends requests with a deadline and reports the answer; knows nothing of SQLite.
final class FHIRTransport: Sendable {
    /// Made on first use, so commands that only read the queue start no event loop.
    private let box = NIOLockedValueBox<HTTPClient?>(nil)
    private let configuration: HTTPClient.Configuration
    /// A client the caller owns (never shut down here), or nil for dq's own.
    private let external: HTTPClient?
    let timeout: TimeAmount
    /// The largest response body read; the rest is discarded (responses are only summarized).
    let maximumResponseBytes = 1 << 20
    /// dq's own event loop and the task executor on it, chosen on first use: taking one from the shared group
    /// starts the group's threads, which commands that only read the queue never need.
    private let loop = NIOLockedValueBox<(any EventLoop, EventLoopTaskExecutor)?>(nil)

    /// The event loop dq's own client runs on.
    var eventLoop: any EventLoop { ownLoop.0 }

    /// Runs a flush's code on ``eventLoop`` too (see ``EventLoopTaskExecutor``); nil with a caller's client.
    var taskExecutor: EventLoopTaskExecutor? { external == nil ? ownLoop.1 : nil }

    private var ownLoop: (any EventLoop, EventLoopTaskExecutor) {
        loop.withLockedValue { chosen in
            if let chosen { return chosen }
            let next = MultiThreadedEventLoopGroup.singleton.next()
            let made = (next, EventLoopTaskExecutor(next))
            chosen = made
            return made
        }
    }

    /// - Parameter idleLimit: how long dq's own client keeps an idle connection (tests of reuse on a loaded
    ///   machine give more than the default).
    init(
        timeout: TimeInterval, connectTimeout: TimeInterval, caBundlePath: String?, client: HTTPClient? = nil,
        idleLimit: TimeAmount = HTTP1Sender.defaultIdleLimit
    ) throws {
        external = client
        self.idleLimit = idleLimit
        var configuration = HTTPClient.Configuration()
        configuration.timeout = .init(
            connect: .milliseconds(Int64(connectTimeout * 1000)), read: .milliseconds(Int64(timeout * 1000)))
        configuration.redirectConfiguration = .disallow
        // dq retries with its own backoff; the pool must not spin on a refused connection until the deadline.
        configuration.connectionPool.retryConnectionEstablishment = false
        configuration.decompression = .enabled(limit: .ratio(100))
        var tls = TLSConfiguration.makeClientConfiguration()
        if let caBundlePath {
            tls.trustRoots = .file(caBundlePath)
            configuration.tlsConfiguration = tls
        }
        self.configuration = configuration
        self.tlsConfiguration = tls
        self.connectTimeout = .milliseconds(Int64(connectTimeout * 1000))
        self.timeout = .milliseconds(Int64(timeout * 1000))
    }

    private let tlsConfiguration: TLSConfiguration
    private let connectTimeout: TimeAmount
    private let idleLimit: TimeAmount
    /// The flush's own HTTP/1.1 client (see ``HTTP1Sender``), made on first use; nil with a caller's client.
    private let senderBox = NIOLockedValueBox<HTTP1Sender?>(nil)

    private var sender: HTTP1Sender? {
        guard external == nil else { return nil }
        return senderBox.withLockedValue { sender in
            if let sender { return sender }
            let made = HTTP1Sender(
                loop: eventLoop, connectTimeout: connectTimeout, tlsConfiguration: tlsConfiguration, idleLimit: idleLimit)
            sender = made
            return made
        }
    }

    private var client: HTTPClient {
        if let external { return external }
        return box.withLockedValue { client in
            if let client { return client }
            // One event loop of the shared group, not the group: a flush sends one request at a time, and
            // with the whole group each request hopped between loop threads (a wake-up per hop).
            let made = HTTPClient(eventLoopGroup: eventLoop, configuration: configuration)
            client = made
            return made
        }
    }

    /// A queue released without ``DataQueue/shutdown()``: its own client is shut down in the background rather
    /// than left to crash the process in its own deinit.
    deinit {
        let client = box.withLockedValue { client in
            defer { client = nil }
            return client
        }
        client?.shutdown(queue: .global()) { _ in }
    }

    func shutdown() async throws {
        let client = box.withLockedValue { client in
            defer { client = nil }
            return client
        }
        let sender = senderBox.withLockedValue { sender in
            defer { sender = nil }
            return sender
        }
        try? await sender?.shutdown().get()
        try await client?.shutdown()
    }

    /// Sends `request`; throws ``TransportFailure`` when no answer came.
    ///
    /// It uses the client's event-loop API with a delegate that keeps the head and the first
    /// ``maximumResponseBytes`` of the body on the event loop: one hand-over to the caller per request,
    /// where the async API costs a task, a scheduled timeout and a hop per body chunk.
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
        if let sender, let (origin, target) = target(of: request.url) {
            do {
                let (head, body) = try await sender.send(
                    origin: origin, method: method, target: target, headers: headers, body: ByteBuffer(data: request.body),
                    limit: limit, deadline: .now() + timeout
                ).get()
                return Self.response(head, body)
            } catch {
                throw TransportFailure(
                    message: "no answer from \(Self.redacted(request.url)): \(Self.describe(error))",
                    mayHaveArrived: !Self.neverSent(error))
            }
        }
        return try await execute(url: request.url, method: method, headers: headers, body: request.body, limit: limit, logger: logger)
    }

    /// The URL parsed last, up to its last `/`, with its origin and request target up to there: a flush's URLs
    /// differ only after the base (`base/Type`, `base/Type/id`), so the rest of them is not parsed again.
    private let lastParsed = NIOLockedValueBox<(prefix: String, origin: HTTP1Sender.Origin, target: String)?>(nil)

    /// ``HTTP1Sender/target(of:)``, without parsing the part of `url` it shares with the URL parsed last when what
    /// follows is plain (letters, digits, `-`, `.`, `_`, `/`: nothing a parser would encode or read as more).
    func target(of url: String) -> (origin: HTTP1Sender.Origin, target: String)? {
        // Byte for byte: `hasPrefix` would also take a canonically equivalent prefix of another length.
        if let last = lastParsed.withLockedValue({ $0 }), url.utf8.starts(with: last.prefix.utf8) {
            let rest = url.utf8.dropFirst(last.prefix.utf8.count)
            if rest.allSatisfy(Self.isPlain) { return (last.origin, last.target + String(Substring(rest))) }
        }
        guard let parsed = HTTP1Sender.target(of: url) else { return nil }
        // Remember the base when a "/" follows the authority, the part after the last one is plain and the
        // target ends with that part unchanged.
        if let authority = url.range(of: "://")?.upperBound, let slash = url[authority...].lastIndex(of: "/") {
            let prefix = String(url[...slash])
            let rest = url[url.index(after: slash)...]
            if rest.utf8.allSatisfy(Self.isPlain), parsed.target.hasSuffix("/" + rest) {
                let base = String(parsed.target.dropLast(rest.count))
                lastParsed.withLockedValue { $0 = (prefix, parsed.origin, base) }
            }
        }
        return parsed
    }

    private static func isPlain(_ byte: UInt8) -> Bool {
        switch byte {
        case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "0")...UInt8(ascii: "9"),
            UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"), UInt8(ascii: "/"):
            return true
        default:
            return false
        }
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

    private func execute(
        url: String, method: HTTPMethod, headers: HTTPHeaders, body: Data?, limit: Int, logger: Logger
    ) async throws -> TransportResponse {
        do {
            let http = try HTTPClient.Request(
                url: url, method: method, headers: headers, body: body.map { .byteBuffer(ByteBuffer(data: $0)) })
            let delegate = ResponseSummary(limit: limit)
            let (head, body) = try await client.execute(
                request: http, delegate: delegate, deadline: .now() + timeout,
                logger: logger.logLevel <= .trace ? logger : Self.silent
            ).futureResult.get()
            return Self.response(head, body)
        } catch {
            throw TransportFailure(
                message: "no answer from \(Self.redacted(url)): \(Self.describe(error))",
                mayHaveArrived: !Self.neverSent(error))
        }
    }

    /// Whether `error` means the request never left this machine: no connection was made, or (for the flush's
    /// own client) the connection's TLS handshake did not complete.
    static func neverSent(_ error: any Error) -> Bool {
        if case HTTP1SenderError.notSent = error { return true }
        if let error = error as? HTTPClientError {
            return error == .connectTimeout || error == .invalidURL || error == .emptyHost
        }
        if error is NIOConnectionError { return true }
        // A refused handshake: no request bytes were written (a TLS error later in the exchange may be after).
        if let error = error as? NIOSSLError, case .handshakeFailed = error { return true }
        if let error = error as? IOError {
            return [ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EADDRNOTAVAIL].contains(error.errnoCode)
        }
        if let error = error as? ChannelError, case .connectTimeout = error { return true }
        let text = String(describing: error)
        return text.contains("connectionRefused") || text.contains("Connection refused")
            || text.contains("NIOConnectionError")
    }

    /// The HTTP client's own request logs are internals: shown only at trace level.
    static let silent = Logger(label: "dq.http", factory: { _ in SwiftLogNoOpLogHandler() })

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
            default: break
            }
        }
        if let error = error as? HTTP1SenderError {
            switch error {
            case .timedOut: return "timed out"
            case .closedByServer: return "connection closed by the server"
            case .notSent(HTTP1SenderError.timedOut): return "timed out before the TLS handshake completed (nothing was sent)"
            case .notSent(HTTP1SenderError.closedByServer):
                return "connection closed by the server during the TLS handshake (nothing was sent)"
            case .notSent(let setup as TLSSetupFailure):
                if case NIOSSLError.noSuchFilesystemObject = setup.underlying { return "TLS: the CA bundle (\"ca_bundle\") does not exist" }
                return "TLS: the CA bundle (\"ca_bundle\") could not be loaded (not a PEM certificate file?)"
            case .notSent(let underlying): return describe(underlying)
            }
        }
        if let error = error as? IOError, [ECONNRESET, EPIPE].contains(error.errnoCode) {
            return "connection closed by the server (reset)"
        }
        let text = String(reflecting: error)
        if let tls = describeTLS(text) { return tls }
        if text.contains("connectionRefused") || text.contains("Connection refused") { return "connection refused" }
        if text.contains("getaddrinfo") || text.contains("NXDOMAIN") || text.contains("unknownHost") {
            return "the server's host name could not be resolved"
        }
        let plain = "\(error)"
        return plain.count > 200 ? String(plain.prefix(200)) + "…" : plain
    }

    /// A certificate or TLS failure in words: what is wrong and what to do.
    ///
    /// dq treats these as temporary (the item stays queued and the server backs off): an expired or wrong
    /// certificate is fixed at the server, without any change on dq's side. The words tell the operator.
    static func describeTLS(_ text: String) -> String? {
        let lowered = text.lowercased()
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
public enum DQVersion {
    /// The version string, e.g. `0.1.0`.
    public static let current = "0.1.0"
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

    init(limit: Int) { self.limit = limit }

    func didReceiveHead(task: HTTPClient.Task<Response>, _ head: HTTPResponseHead) -> EventLoopFuture<Void> {
        self.head = head
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
/// The flush never blocks: storage work goes to GRDB's queue and to the journal's writer thread.
final class EventLoopTaskExecutor: TaskExecutor, @unchecked Sendable {
    private let loop: any EventLoop

    init(_ loop: any EventLoop) { self.loop = loop }

    func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        loop.execute { job.runSynchronously(on: self.asUnownedTaskExecutor()) }
    }
}
