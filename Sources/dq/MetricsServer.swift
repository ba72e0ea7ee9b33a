import FHIRDataQueue
import Foundation
import NIOCore
import NIOHTTP1
import NIOPosix
import Prometheus
import ServiceLifecycle

/// The `dq run --metrics-address` endpoint: `GET /metrics` (Prometheus text), `GET /healthz` (liveness: 200
/// while the delivery loops come round, else 503 naming the stuck one) and `GET /readyz` (readiness: 200, or 503
/// with the reasons as JSON), on a small
/// NIO HTTP/1.1 server that stops with the service group.
final class MetricsServer: Service {
    let port: Int
    private let channel: any Channel

    /// `HOST:PORT`, `[IPv6]:PORT` or a bare `PORT` (then loopback).
    static func parse(_ text: String) -> (host: String, port: Int)? { DataQueueSettings.metricsAddress(text) }

    private init(channel: any Channel, port: Int) {
        self.channel = channel
        self.port = port
    }

    static func start(
        host: String, port: Int, registry: PrometheusCollectorRegistry,
        readiness: @escaping @Sendable () async -> DataQueueService.Readiness,
        liveness: @escaping @Sendable () -> DataQueueService.Liveness
    ) async throws -> MetricsServer {
        let bootstrap = ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            .childChannelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.configureHTTPServerPipeline()
                    try channel.pipeline.syncOperations.addHandler(
                        MetricsHandler(registry: registry, readiness: readiness, liveness: liveness))
                }
            }
        let channel: any Channel
        do {
            channel = try await bootstrap.bind(host: host, port: port).get()
        } catch let error as IOError {
            let reason =
                switch error.errnoCode {
                case EADDRINUSE: "the address is in use (another dq run, or another exporter?)"
                case EACCES: "permission denied (ports below 1024 need privileges)"
                case EADDRNOTAVAIL: "this machine has no such address"
                default: String(cString: strerror(error.errnoCode))
                }
            throw DataQueueError(.invalidConfiguration, "cannot serve metrics on \(host):\(port): \(reason)")
        } catch {
            throw DataQueueError(.invalidConfiguration, "cannot serve metrics on \(host):\(port): \(error)")
        }
        return MetricsServer(channel: channel, port: channel.localAddress?.port ?? port)
    }

    /// Serves until graceful shutdown or cancellation, then closes the listening socket.
    func run() async throws {
        try? await gracefulShutdown()
        await close()
    }

    /// Closes the listening socket (`dq run` keeps it across its rounds and closes it when it ends).
    func close() async {
        try? await channel.close()
    }
}

/// Answers one request per connection turn: the metrics text, the health check, or 404.
private final class MetricsHandler: ChannelInboundHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let registry: PrometheusCollectorRegistry
    private let readiness: @Sendable () async -> DataQueueService.Readiness
    private let liveness: @Sendable () -> DataQueueService.Liveness
    private var head: HTTPRequestHead?

    init(
        registry: PrometheusCollectorRegistry, readiness: @escaping @Sendable () async -> DataQueueService.Readiness,
        liveness: @escaping @Sendable () -> DataQueueService.Liveness
    ) {
        self.registry = registry
        self.readiness = readiness
        self.liveness = liveness
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head(let head): self.head = head
        case .body: break
        case .end:
            guard let head else { return }
            self.head = nil
            let path = head.uri.split(separator: "?").first.map(String.init) ?? head.uri
            if head.method == .GET && path == "/readyz" {
                // The check reads the queue's storage: off the event loop, answered back on it.
                let promise = context.eventLoop.makePromise(of: DataQueueService.Readiness.self)
                promise.completeWithTask { [readiness] in await readiness() }
                promise.futureResult.assumeIsolated().whenSuccess { readiness in
                    let body: [UInt8] = (try? JSONEncoder().encode(readiness)).map { [UInt8]($0) + [0x0A] } ?? []
                    self.respond(
                        context: context, head: head, status: readiness.ready ? .ok : .serviceUnavailable,
                        contentType: "application/json", body: body)
                }
                return
            }
            let (status, contentType, body): (HTTPResponseStatus, String, [UInt8])
            switch (head.method, path) {
            case (.GET, "/metrics"):
                (status, contentType, body) = (.ok, "text/plain; version=0.0.4; charset=utf-8", Exposition.emit(registry))
            case (.GET, "/healthz"):
                let liveness = liveness()
                (status, contentType, body) =
                    liveness.alive
                    ? (.ok, "text/plain; charset=utf-8", Array("ok\n".utf8))
                    : (.serviceUnavailable, "text/plain; charset=utf-8", Array((liveness.reasons.joined(separator: "\n") + "\n").utf8))
            default:
                (status, contentType, body) = (.notFound, "text/plain; charset=utf-8", Array("not found\n".utf8))
            }
            respond(context: context, head: head, status: status, contentType: contentType, body: body)
        }
    }

    private func respond(
        context: ChannelHandlerContext, head: HTTPRequestHead, status: HTTPResponseStatus, contentType: String, body: [UInt8]
    ) {
        var headers = HTTPHeaders()
        headers.add(name: "Content-Type", value: contentType)
        headers.add(name: "Content-Length", value: String(body.count))
        if !head.isKeepAlive { headers.add(name: "Connection", value: "close") }
        context.write(wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: status, headers: headers))), promise: nil)
        context.write(wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(bytes: body)))), promise: nil)
        let written = context.writeAndFlush(wrapOutboundOut(.end(nil)))
        if !head.isKeepAlive {
            written.assumeIsolated().whenComplete { _ in context.close(promise: nil) }
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }
}
