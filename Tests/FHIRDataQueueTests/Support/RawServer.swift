import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix

/// A TCP server on 127.0.0.1 that answers each HTTP request with bytes a test writes out in full, for answers a
/// well-behaved HTTP server library would not produce (an unasked `100 Continue`, an HTTP/1.0 answer whose body
/// ends when the connection does).
///
/// A request is taken as complete at the end of its head plus `Content-Length` bytes. `answer` gets the request's
/// index on its connection and the connection's index, and returns the bytes to write and whether to close after.
/// With `answerEarly`, the first request of a connection is answered as soon as its head arrived, and nothing more
/// is read from that connection (a server that answers before it read the body, and stalls).
final class RawServer: Sendable {
    let port: Int
    var baseURL: String { "http://127.0.0.1:\(port)" }
    private let channel: any Channel
    private let counts = NIOLockedValueBox((connections: 0, requests: 0))

    /// How many connections were opened so far.
    var connectionsOpened: Int { counts.withLockedValue { $0.connections } }
    /// How many whole requests arrived so far.
    var requestsReceived: Int { counts.withLockedValue { $0.requests } }

    init(
        answerEarly: Bool = false, answer: @escaping @Sendable (_ request: Int, _ connection: Int) -> (bytes: String, close: Bool)
    ) async throws {
        let counts = self.counts
        let bootstrap = ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            .childChannelInitializer { channel in
                let connection = counts.withLockedValue { counts -> Int in
                    counts.connections += 1
                    return counts.connections - 1
                }
                return channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.addHandler(
                        RawConnectionHandler(connection: connection, counts: counts, answerEarly: answerEarly, answer: answer))
                }
            }
        channel = try await bootstrap.bind(host: "127.0.0.1", port: 0).get()
        guard let port = channel.localAddress?.port else { throw ChannelError.unknownLocalAddress }
        self.port = port
    }

    func shutdown() async throws { try await channel.close() }
}

private final class RawConnectionHandler: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let connection: Int
    private let counts: NIOLockedValueBox<(connections: Int, requests: Int)>
    private let answer: @Sendable (Int, Int) -> (bytes: String, close: Bool)
    private var pending = ByteBuffer()
    private var requests = 0
    private let answerEarly: Bool

    init(
        connection: Int, counts: NIOLockedValueBox<(connections: Int, requests: Int)>, answerEarly: Bool,
        answer: @escaping @Sendable (Int, Int) -> (bytes: String, close: Bool)
    ) {
        self.connection = connection
        self.counts = counts
        self.answerEarly = answerEarly
        self.answer = answer
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        var part = unwrapInboundIn(data)
        pending.writeBuffer(&part)
        while let text = pending.getString(at: pending.readerIndex, length: pending.readableBytes),
            let end = text.range(of: "\r\n\r\n")
        {
            let head = text[..<end.lowerBound].lowercased()
            let length =
                head.split(separator: "\r\n").first { $0.hasPrefix("content-length:") }
                .flatMap { Int($0.dropFirst("content-length:".count).trimmingCharacters(in: .whitespaces)) } ?? 0
            let headBytes = text.utf8.distance(from: text.utf8.startIndex, to: end.upperBound.samePosition(in: text.utf8)!)
            if answerEarly && requests == 0 {
                counts.withLockedValue { $0.requests += 1 }
                requests += 1
                context.writeAndFlush(wrapOutboundOut(ByteBuffer(string: answer(0, connection).bytes)), promise: nil)
                context.channel.setOption(ChannelOptions.autoRead, value: false).whenComplete { _ in }
                pending.clear()
                return
            }
            guard pending.readableBytes >= headBytes + length else { return }
            pending.moveReaderIndex(forwardBy: headBytes + length)
            counts.withLockedValue { $0.requests += 1 }
            let (bytes, close) = answer(requests, connection)
            requests += 1
            let written = context.writeAndFlush(wrapOutboundOut(ByteBuffer(string: bytes)))
            if close {
                let channel = context.channel
                written.whenComplete { _ in channel.close(promise: nil) }
                return
            }
        }
    }
}
