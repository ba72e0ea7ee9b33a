import HTTPTypes
import Metrics
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import NIOHTTPTypes
import NIOHTTPTypesHTTP1

/// What a receiver lets connections hold: how many one address and all together may open, and how long a connection
/// is kept after an answer that closes it (a lingering close, as nginx's `lingering_time` and `lingering_timeout`).
///
/// Mount it on Hummingbird's HTTP/1 server as additional channel handlers:
/// ```swift
/// let guard = ConnectionGuard(.init(perAddress: 64, total: 4096))
/// let http1 = HTTP1Channel.Configuration(additionalChannelHandlers: guard.channelHandlers())
/// ```
///
/// - A connection past ``Configuration/perAddress`` from one address (an IPv6 address by its /64), or past
///   ``Configuration/total``, is closed as it is accepted. Addresses in ``Configuration/exempt`` (a TLS proxy in
///   front, through which every device comes) count only towards the total.
/// - After an answer that says `Connection: close` (a 413 from the head, a 408, a refusal whose body was not read),
///   the connection's output is closed at once, so the client reads its answer and sees the end; what it still sends
///   is read and thrown away until it closes, for at most ``Configuration/lingeringTimeout`` between reads and
///   ``Configuration/lingeringTime`` in all; then the connection is closed. A client that declares 100 GiB and
///   trickles it holds the connection that long, not for good.
///
/// Counted in `dq_serve_connections` (open now) and `dq_serve_connections_refused_total{reason}` (`per_address`,
/// `total`).
public final class ConnectionGuard: Sendable {
    /// The limits.
    public struct Configuration: Sendable, Equatable {
        /// The most connections open from one address (an IPv6 /64); 0: no limit per address.
        public var perAddress: Int
        /// The most connections open in all; 0: no limit.
        public var total: Int
        /// Addresses whose connections count only towards ``total`` (the receiver's trusted proxies).
        public var exempt: Set<String>
        /// How long a connection closing after its answer is read from, at most.
        public var lingeringTime: Duration
        /// How long such a connection may send nothing before it is closed.
        public var lingeringTimeout: Duration

        /// Limits with defaults: 256 connections per address, 4,096 in all, lingering 30 s at most and 5 s between reads.
        public init(
            perAddress: Int = 256, total: Int = 4096, exempt: Set<String> = [], lingeringTime: Duration = .seconds(30),
            lingeringTimeout: Duration = .seconds(5)
        ) {
            self.perAddress = perAddress
            self.total = total
            self.exempt = exempt
            self.lingeringTime = lingeringTime
            self.lingeringTimeout = lingeringTimeout
        }
    }

    /// The limits in force.
    public let configuration: Configuration
    private let open = NIOLockedValueBox<(byAddress: [String: Int], total: Int)>(([:], 0))

    /// A guard with `configuration`'s limits.
    public init(_ configuration: Configuration = .init()) {
        self.configuration = configuration
    }

    /// The handlers to add to each connection's pipeline after the HTTP codec (Hummingbird's
    /// `HTTP1Channel.Configuration(additionalChannelHandlers:)`).
    public func channelHandlers() -> [any RemovableChannelHandler] { [ConnectionGuardHandler(guard: self)] }

    /// How many connections are open now.
    public var openConnections: Int { open.withLockedValue { $0.total } }

    /// Takes a connection from `address` if the limits allow it; the key it is counted under, or nil (refused).
    func admit(_ address: String?) -> String?? {
        let ip = address ?? "unknown"
        let key = configuration.exempt.contains(ip) ? nil : RateLimiter.bucket(ip)
        let refusal: String? = open.withLockedValue { open in
            if configuration.total > 0 && open.total >= configuration.total { return "total" }
            if let key, configuration.perAddress > 0, open.byAddress[key, default: 0] >= configuration.perAddress {
                return "per_address"
            }
            open.total += 1
            if let key { open.byAddress[key, default: 0] += 1 }
            return nil
        }
        if let refusal {
            Counter(label: "dq_serve_connections_refused_total", dimensions: [("reason", refusal)]).increment()
            return nil
        }
        Gauge(label: "dq_serve_connections").record(openConnections)
        return .some(key)
    }

    /// Gives back a connection `admit` took under `key`.
    func release(_ key: String?) {
        open.withLockedValue { open in
            open.total -= 1
            if let key {
                let left = open.byAddress[key, default: 1] - 1
                open.byAddress[key] = left > 0 ? left : nil
            }
        }
        Gauge(label: "dq_serve_connections").record(openConnections)
    }
}

/// One connection's side of ``ConnectionGuard``: counted while it is open, lingering after an answer that closes it.
final class ConnectionGuardHandler: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPRequestPart
    typealias InboundOut = HTTPRequestPart
    typealias OutboundIn = HTTPResponsePart
    typealias OutboundOut = HTTPResponsePart

    private let limits: ConnectionGuard
    /// Whether the connection was admitted, and the key it counts under.
    private var admitted: String??
    /// Whether the answer being written closes the connection.
    private var closing = false
    /// Whether the answer that closes it has been written: what comes in is dropped.
    private var lingering = false
    private var idle: Scheduled<Void>?
    private var whole: Scheduled<Void>?

    init(guard limits: ConnectionGuard) { self.limits = limits }

    /// Whether the request being answered asked for the connection to end with its answer: `Connection: close`, or
    /// HTTP/1.0 without keep-alive (its version is known only before the HTTP codec: ``KeepAliveSniffer`` says).
    fileprivate var requestCloses = false

    func handlerAdded(context: ChannelHandlerContext) {
        admitted = limits.admit(context.channel.remoteAddress?.ipAddress)
        if admitted == nil {
            context.close(promise: nil)
            return
        }
        if let codec = try? context.pipeline.syncOperations.handler(type: HTTP1ToHTTPServerCodec.self) {
            try? context.pipeline.syncOperations.addHandler(KeepAliveSniffer(self), position: .before(codec))
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        if let key = admitted {
            limits.release(key)
            admitted = nil
        }
        idle?.cancel()
        whole?.cancel()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard lingering else {
            context.fireChannelRead(data)
            return
        }
        // Read and thrown away: the client that is still sending gets to the end of its send and reads the answer.
        armIdle(context)
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        if lingering {
            context.read()
        } else {
            context.fireChannelReadComplete()
        }
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let part = unwrapOutboundIn(data)
        switch part {
        case .head(let head):
            closing = requestCloses || head.headerFields[values: .connection].contains { $0.lowercased().contains("close") }
            context.write(data, promise: promise)
        case .body:
            context.write(data, promise: promise)
        case .end:
            guard closing, !lingering else {
                context.write(data, promise: promise)
                return
            }
            let written = context.eventLoop.makePromise(of: Void.self)
            written.futureResult.cascade(to: promise)
            context.writeAndFlush(data, promise: written)
            written.futureResult.assumeIsolated().whenSuccess { [self] in startLingering(context) }
        }
    }

    /// The answer is out: its end is told to the client (the output closed), and from here what arrives is dropped.
    private func startLingering(_ context: ChannelHandlerContext) {
        guard !lingering, context.channel.isActive else { return }
        lingering = true
        let channel = context.channel
        // A channel that cannot close its output alone (a TLS stack that does not) is closed when the lingering ends.
        context.close(mode: .output, promise: nil)
        whole = context.eventLoop.scheduleTask(in: TimeAmount(limits.configuration.lingeringTime)) { channel.close(promise: nil) }
        armIdle(context)
        context.read()
    }

    private func armIdle(_ context: ChannelHandlerContext) {
        idle?.cancel()
        let channel = context.channel
        idle = context.eventLoop.scheduleTask(in: TimeAmount(limits.configuration.lingeringTimeout)) { channel.close(promise: nil) }
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        // The client closed its side while the connection lingers: nothing more to read, the connection is done.
        if lingering, event as? ChannelEvent == .inputClosed {
            context.close(promise: nil)
            return
        }
        context.fireUserInboundEventTriggered(event)
    }
}

/// Before the HTTP codec: tells ``ConnectionGuardHandler`` whether each request asks to end the connection with its
/// answer (HTTP/1.0 without `keep-alive`, or `Connection: close`), which the version-less HTTP types after the codec
/// cannot say. An HTTP/1.0 client waits for the end of the connection: it gets it with its answer, not at the idle
/// timeout.
final class KeepAliveSniffer: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias InboundOut = HTTPServerRequestPart

    private let connection: ConnectionGuardHandler

    init(_ connection: ConnectionGuardHandler) { self.connection = connection }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        if case .head(let head) = unwrapInboundIn(data) { connection.requestCloses = !head.isKeepAlive }
        context.fireChannelRead(data)
    }
}

extension TimeAmount {
    init(_ duration: Duration) {
        let (seconds, attoseconds) = duration.components
        self = .nanoseconds(seconds * 1_000_000_000 + attoseconds / 1_000_000_000)
    }
}
