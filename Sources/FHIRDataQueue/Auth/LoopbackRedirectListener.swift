import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import NIOPosix

/// The one-shot HTTP listener of a native app's sign-in (RFC 8252 7.3): it listens on `127.0.0.1` on a
/// port the system picks, takes the first request to `/callback` that carries `code` or `error`, and
/// answers the browser with a short page. Other paths (a browser's `/favicon.ico`) get 404; later
/// callbacks get 409.
package final class LoopbackRedirectListener: Sendable {
    /// The redirect URI to register and send: `http://127.0.0.1:<port>/callback`.
    package let redirectURI: String
    private let channel: any Channel
    private let redirects: AsyncStream<String>

    private init(channel: any Channel, redirects: AsyncStream<String>, port: Int) {
        self.channel = channel
        self.redirects = redirects
        self.redirectURI = "http://127.0.0.1:\(port)/callback"
    }

    /// Starts listening on `127.0.0.1:port` (0: a free port the system picks).
    package static func start(port: Int = 0) async throws -> LoopbackRedirectListener {
        let (stream, continuation) = AsyncStream<String>.makeStream(bufferingPolicy: .bufferingNewest(1))
        let received = NIOLockedValueBox(false)
        let bootstrap = ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .childChannelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.configureHTTPServerPipeline()
                    try channel.pipeline.syncOperations.addHandler(CallbackHandler(redirects: continuation, received: received))
                }
            }
        do {
            let channel = try await bootstrap.bind(host: "127.0.0.1", port: port).get()
            return LoopbackRedirectListener(channel: channel, redirects: stream, port: channel.localAddress?.port ?? port)
        } catch {
            throw DataQueueError(.transport, "cannot listen on 127.0.0.1:\(port) for the sign-in redirect: \(error)")
        }
    }

    /// The full redirect URL of the first callback (`http://127.0.0.1:<port>/callback?code=…&state=…`), or
    /// nil when the listener was closed or the task cancelled first.
    package func redirect() async -> URL? {
        for await target in redirects {
            return URL(string: "http://127.0.0.1" + target)
        }
        return nil
    }

    /// Stops listening.
    package func close() async {
        try? await channel.close()
    }
}

private final class CallbackHandler: ChannelInboundHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let redirects: AsyncStream<String>.Continuation
    private let received: NIOLockedValueBox<Bool>
    private var head: HTTPRequestHead?

    init(redirects: AsyncStream<String>.Continuation, received: NIOLockedValueBox<Bool>) {
        self.redirects = redirects
        self.received = received
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head(let head): self.head = head
        case .body: break
        case .end:
            guard let head else { return }
            self.head = nil
            let components = URLComponents(string: head.uri)
            let names = Set((components?.queryItems ?? []).map(\.name))
            let status: HTTPResponseStatus
            let page: String
            if head.method == .GET, components?.path == "/callback", names.contains("code") || names.contains("error") {
                let first = received.withLockedValue { done in
                    defer { done = true }
                    return !done
                }
                if first {
                    redirects.yield(head.uri)
                    redirects.finish()
                    (status, page) = (.ok, "dq received the answer of the sign-in. Return to the terminal to see whether it succeeded.")
                } else {
                    (status, page) = (.conflict, "dq already received an answer for this sign-in.")
                }
            } else {
                (status, page) = (.notFound, "Not found.")
            }
            let body = "<!doctype html><meta charset=utf-8><title>dq</title><p>\(page)</p>\n"
            var headers = HTTPHeaders()
            headers.add(name: "Content-Type", value: "text/html; charset=utf-8")
            headers.add(name: "Content-Length", value: String(body.utf8.count))
            headers.add(name: "Cache-Control", value: "no-store")
            headers.add(name: "Connection", value: "close")
            context.write(wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: status, headers: headers))), promise: nil)
            context.write(wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(string: body)))), promise: nil)
            context.writeAndFlush(wrapOutboundOut(.end(nil))).assumeIsolated().whenComplete { _ in context.close(promise: nil) }
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }
}
