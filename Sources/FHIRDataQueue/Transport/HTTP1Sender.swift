import Foundation
import NIOCore
import NIOHTTP1
import NIOPosix
import NIOSSL
import NIOTLS

/// dq's own HTTP/1.1 client for the requests of a flush: one kept-alive connection per server, one request at
/// a time, the head and the body handed to the socket in one write.
///
/// A flush waits for each answer before the next request (order), so it needs none of a general client's
/// pooling, redirects or HTTP/2; what it pays per request is what decides how fast one-by-one delivery can be.
/// async-http-client spent about 200 µs of CPU per request here and wrote the head and the body in two system
/// calls (two packets the server must join). Requests other than a flush's (sign-in, the CapabilityStatement)
/// and every request of a queue given its own `HTTPClient` still go through async-http-client.
///
/// Everything mutable lives on ``loop`` (the flush's own event loop), which is what makes it safe.
final class HTTP1Sender: Sendable {
    /// Where a connection goes.
    struct Origin: Hashable, Sendable {
        var tls: Bool
        var host: String
        var port: Int
    }

    let loop: any EventLoop
    private let connectTimeout: TimeAmount
    private let tlsConfiguration: TLSConfiguration
    private let state = State()

    /// The open connections (with when each was last used) and the TLS context (made on first use): used only
    /// on ``loop``, the reason the `@unchecked Sendable` is sound.
    private final class State: @unchecked Sendable {
        /// Connections with no exchange under way, the most recently used last (encrypted items go several at a
        /// time, each on a connection of its own).
        var idle: [Origin: [(channel: any Channel, reuseBefore: NIODeadline)]] = [:]
        var tls: NIOSSLContext?
        /// Set by ``shutdown()``: an exchange that ends later closes its connection instead of keeping it.
        var shutDown = false
    }

    /// A connection idle longer than this is closed and a new one made: servers close idle connections after
    /// a few seconds to a minute, and a request written just as the server closes may or may not have been
    /// read (a delivery in doubt); dq's own limit (4 s by default) stays under theirs.
    let idleLimit: TimeAmount
    /// dq's idle limit: 4 s.
    static let defaultIdleLimit: TimeAmount = .seconds(4)

    init(loop: any EventLoop, connectTimeout: TimeAmount, tlsConfiguration: TLSConfiguration, idleLimit: TimeAmount = defaultIdleLimit) {
        self.loop = loop
        self.idleLimit = idleLimit
        self.connectTimeout = connectTimeout
        self.tlsConfiguration = tlsConfiguration
    }

    /// The origin and request target of an `http` or `https` URL, or nil for anything else.
    static func target(of url: String) -> (origin: Origin, target: String)? {
        guard let components = URLComponents(string: url), let scheme = components.scheme?.lowercased(),
            scheme == "http" || scheme == "https", let host = components.host, !host.isEmpty,
            components.user == nil, components.password == nil
        else { return nil }
        let tls = scheme == "https"
        var target = components.percentEncodedPath.isEmpty ? "/" : components.percentEncodedPath
        if let query = components.percentEncodedQuery { target += "?" + query }
        // An IPv6 address is written in brackets in a URL, and connected to without them.
        let bare = host.hasPrefix("[") && host.hasSuffix("]") ? String(host.dropFirst().dropLast()) : host
        return (Origin(tls: tls, host: bare, port: components.port ?? (tls ? 443 : 80)), target)
    }

    /// Sends one request to `origin` and completes with the answer's head and the first `limit` bytes of its
    /// body (the rest is read and dropped), or fails: a connection that could not be made fails with the
    /// connect error, anything after that with the error that ended it; `deadline` ends the whole exchange.
    func send(
        origin: Origin, method: HTTPMethod, target: String, headers: HTTPHeaders, body: ByteBuffer?, limit: Int,
        deadline: NIODeadline
    ) -> EventLoopFuture<(HTTPResponseHead, ByteBuffer)> {
        loop.flatSubmit {
            self.connection(to: origin, deadline: deadline).flatMap { channel in
                var head = HTTPRequestHead(version: .http1_1, method: method, uri: target, headers: headers)
                let defaultPort = origin.tls ? 443 : 80
                let host = origin.host.utf8.contains(UInt8(ascii: ":")) ? "[\(origin.host)]" : origin.host
                head.headers.replaceOrAdd(name: "Host", value: origin.port == defaultPort ? host : "\(host):\(origin.port)")
                if let body { head.headers.replaceOrAdd(name: "Content-Length", value: String(body.readableBytes)) }
                let promise = self.loop.makePromise(of: (HTTPResponseHead, ByteBuffer).self)
                let handler: ExchangeHandler
                do {
                    handler = try channel.pipeline.syncOperations.handler(type: ExchangeHandler.self)
                } catch {
                    promise.fail(error)
                    return promise.futureResult
                }
                handler.start(promise: promise, limit: limit, deadline: deadline, channel: channel)
                // One flush: the head, the body and the end leave in one write.
                channel.write(HTTPClientRequestPart.head(head), promise: nil)
                if let body { channel.write(HTTPClientRequestPart.body(.byteBuffer(body)), promise: nil) }
                let written = self.loop.makePromise(of: Void.self)
                channel.writeAndFlush(HTTPClientRequestPart.end(nil), promise: written)
                let bound = NIOLoopBound(handler, eventLoop: self.loop)
                written.futureResult.whenComplete { write in
                    switch write {
                    case .success: bound.value.requestWritten = true
                    case .failure(let error): bound.value.fail(error)
                    }
                }
                return promise.futureResult.always { result in
                    // Kept for the next request only after a whole answer on a connection the server keeps open,
                    // and once the whole request is written (a server may answer before it read the body: the
                    // rest of the body must not sit in front of the next request).
                    if case .success = result, let keep = bound.value.reusable, bound.value.requestWritten, channel.isActive,
                        !self.state.shutDown
                    {
                        self.state.idle[origin, default: []].append((channel, .now() + min(self.idleLimit, keep)))
                    } else {
                        channel.close(promise: nil)
                    }
                }
            }
        }
    }

    /// The open connection to `origin`, or a new one.
    private func connection(to origin: Origin, deadline: NIODeadline) -> EventLoopFuture<any Channel> {
        loop.assertInEventLoop()
        let now = NIODeadline.now()
        while let open = state.idle[origin]?.popLast() {
            if open.channel.isActive && now < open.reuseBefore { return loop.makeSucceededFuture(open.channel) }
            open.channel.close(promise: nil)
        }
        let sslContext: NIOSSLContext?
        if origin.tls {
            do {
                if state.tls == nil { state.tls = try NIOSSLContext(configuration: tlsConfiguration) }
                sslContext = state.tls
            } catch {
                return loop.makeFailedFuture(HTTP1SenderError.notSent(TLSSetupFailure(underlying: error)))
            }
        } else {
            sslContext = nil
        }
        let timeout = min(connectTimeout, deadline - .now())
        let bootstrap = ClientBootstrap(group: loop)
            .connectTimeout(timeout)
            .channelOption(.socketOption(.tcp_nodelay), value: 1)
            .channelInitializer { channel in
                do {
                    let pipeline = channel.pipeline.syncOperations
                    if let sslContext {
                        // An IP address is checked against the certificate's IP entries, and is sent as no SNI.
                        let isAddress = (try? SocketAddress(ipAddress: origin.host, port: 0)) != nil
                        try pipeline.addHandler(
                            NIOSSLClientHandler(context: sslContext, serverHostname: isAddress ? nil : origin.host))
                    }
                    try pipeline.addHTTPClientHandlers()
                    try pipeline.addHandler(ExchangeHandler(awaitingHandshake: sslContext != nil))
                    return channel.eventLoop.makeSucceededVoidFuture()
                } catch {
                    return channel.eventLoop.makeFailedFuture(error)
                }
            }
        // No connection, no request: whatever ended the attempt, nothing reached the server.
        return bootstrap.connect(host: origin.host, port: origin.port).flatMapErrorThrowing { error in
            throw HTTP1SenderError.notSent(error)
        }
    }

    /// Closes every connection.
    func shutdown() -> EventLoopFuture<Void> {
        loop.flatSubmit {
            self.state.shutDown = true
            let channels = self.state.idle.values.flatMap { $0.map(\.channel) }
            self.state.idle = [:]
            let closed = channels.map { channel in channel.close().recover { _ in } }
            return EventLoopFuture.andAllComplete(closed, on: self.loop)
        }
    }
}

/// The end of a connection's pipeline: one exchange at a time, its answer collected into a promise.
private final class ExchangeHandler: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPClientResponsePart

    private var promise: EventLoopPromise<(HTTPResponseHead, ByteBuffer)>?
    private var head: HTTPResponseHead?
    private var body = ByteBuffer()
    private var limit = 0
    private var timer: Scheduled<Void>?
    /// How long the connection may wait for its next request, when the last exchange ended with a whole answer
    /// and the server keeps the connection open (its `Keep-Alive: timeout=`, less a margin, when it gives one).
    private(set) var reusable: TimeAmount?
    /// Whether the whole request of the exchange was handed to the socket.
    var requestWritten = false
    /// Whether the connection's TLS handshake has yet to complete. Until it does, the TLS handler holds the
    /// request back (no early data), so an exchange that ends then (a certificate refused, a name mismatch,
    /// a server that never answers the handshake) sent nothing.
    private var awaitingHandshake: Bool

    init(awaitingHandshake: Bool) {
        self.awaitingHandshake = awaitingHandshake
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if case .handshakeCompleted = event as? TLSUserEvent { awaitingHandshake = false }
        context.fireUserInboundEventTriggered(event)
    }

    func start(
        promise: EventLoopPromise<(HTTPResponseHead, ByteBuffer)>, limit: Int, deadline: NIODeadline, channel: any Channel
    ) {
        self.promise = promise
        self.limit = limit
        reusable = nil
        requestWritten = false
        head = nil
        // A large answer's buffer is not kept for the connection's next, usually small, one.
        if body.capacity > 1 << 16 { body = ByteBuffer() } else { body.clear() }
        timer = channel.eventLoop.assumeIsolated().scheduleTask(deadline: deadline) { [weak self] in
            // Only the exchange it was set for: a timer that fires after its exchange ended (cancelled too late)
            // must not end the connection's next one.
            guard let self, self.promise?.futureResult === promise.futureResult else { return }
            self.fail(HTTP1SenderError.timedOut)
            channel.close(promise: nil)
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        // An answer nobody asked for (a server's 408 on an idle connection) leaves the connection out of step.
        guard promise != nil else {
            context.close(promise: nil)
            return
        }
        switch unwrapInboundIn(data) {
        case .head(let received):
            head = received
        case .body(var part):
            let take = min(part.readableBytes, limit - body.readableBytes)
            if take > 0, let slice = part.readSlice(length: take) { body.writeImmutableBuffer(slice) }
        case .end:
            guard let head, let promise else {
                fail(HTTP1SenderError.closedByServer)
                context.close(promise: nil)
                return
            }
            reusable = head.isKeepAlive ? HTTP1Sender.keepAliveLimit(head.headers) : nil
            finish()
            promise.succeed((head, body))
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        fail(HTTP1SenderError.closedByServer)
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        fail(error)
        context.close(promise: nil)
    }

    /// Ends the exchange under way, if any, that `error` cut short. Once the answer's status line has come, the
    /// server has decided, and that answer is what counts (with the part of the body that came, and a connection
    /// that is not reused): a 201 whose body was cut by a reset was still created, and saying "no answer" would
    /// send it again.
    func fail(_ error: any Error) {
        guard let promise else { return }
        if let head {
            reusable = nil
            finish()
            promise.succeed((head, body))
            return
        }
        finish()
        promise.fail(awaitingHandshake ? HTTP1SenderError.notSent(error) : error)
    }

    private func finish() {
        timer?.cancel()
        timer = nil
        promise = nil
    }
}

extension HTTP1Sender {
    /// How long a connection may be kept idle for a server that sends `Keep-Alive: timeout=N`: N less a second
    /// (so that a request does not meet its close), nil (not kept) when that leaves nothing; an hour, so that the
    /// sender's own limit holds, when the server says nothing.
    static func keepAliveLimit(_ headers: HTTPHeaders) -> TimeAmount? {
        for value in headers["Keep-Alive"] {
            for parameter in value.split(separator: ",") {
                let pair = parameter.split(separator: "=", maxSplits: 1).map { $0.trimmingCharacters(in: .whitespaces) }
                guard pair.count == 2, pair[0].lowercased() == "timeout", let seconds = Int(pair[1]), seconds >= 0 else { continue }
                return seconds > 1 ? .seconds(Int64(seconds - 1)) : nil
            }
        }
        return .hours(1)
    }
}

/// How an exchange of ``HTTP1Sender`` ended without an answer.
enum HTTP1SenderError: Error, Sendable {
    case timedOut
    case closedByServer
    /// The exchange ended, with `underlying`, before any of the request could reach the server: no connection
    /// was made, or its TLS handshake did not complete.
    case notSent(any Error)
}

/// The TLS settings could not be loaded (the CA bundle missing or not a PEM file).
struct TLSSetupFailure: Error {
    let underlying: any Error
}
