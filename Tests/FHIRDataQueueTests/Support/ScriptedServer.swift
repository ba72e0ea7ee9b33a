import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import NIOPosix

@testable import FHIRDataQueue

/// A real HTTP/1.1 server on 127.0.0.1 (kernel-chosen port) whose answers each test scripts.
///
/// Every request is recorded when its last byte arrives, before `handler` decides its fate: an answer, a stall (no
/// answer until `releaseStalled()` or `shutdown()`, which then close the connection), or an immediate close. A
/// connection carries one request at a time: NIO's pipelining assistance holds a pipelined request back until the
/// previous one is answered. The server uses nothing of the library but its event-loop task executor, so it also checks what goes on the wire.
final class ScriptedServer: Sendable {
    /// A request as it arrived.
    struct Request: Sendable {
        let method: String
        let uri: String
        let headers: [(name: String, value: String)]
        let body: Data

        /// The value of the first header named `name`, compared case-insensitively.
        func header(_ name: String) -> String? {
            let wanted = name.lowercased()
            return headers.first { $0.name.lowercased() == wanted }?.value
        }

        /// The URI without its query.
        var path: String { String(uri.prefix { $0 != "?" }) }

        /// The body decoded as UTF-8 (invalid bytes are replaced).
        var bodyText: String { String(decoding: body, as: UTF8.self) }
    }

    /// An answer. `Content-Length` is always set by the server from `body`, replacing any scripted one.
    struct Response: Sendable {
        var status: Int
        var headers: [(name: String, value: String)] = []
        var body: Data = Data()

        init(status: Int, headers: [(name: String, value: String)] = [], body: String = "") {
            self.status = status
            self.headers = headers
            self.body = Data(body.utf8)
        }

        init(status: Int, headers: [(name: String, value: String)] = [], data: Data) {
            self.status = status
            self.headers = headers
            self.body = data
        }

        /// 201 Created with a `Location` and the body `{}` as `application/fhir+json`.
        static func created(location: String) -> Response {
            Response(
                status: 201, headers: [("Location", location), ("Content-Type", "application/fhir+json")], body: "{}")
        }
    }

    /// What the server does with one request.
    enum Action: Sendable {
        /// Answers; the connection stays open when the request asked for keep-alive and the answer has no
        /// `Connection: close`.
        case respond(Response)
        /// Holds the request without answering until `releaseStalled()` or `shutdown()`, then closes the connection
        /// without an answer.
        case stall
        /// Closes the connection without any answer.
        case close
    }

    let port: Int
    var baseURL: String { "http://127.0.0.1:\(port)" }
    private let serverChannel: any Channel
    private let state: ScriptedServerState

    /// Starts listening. `handler` decides each request's fate; it may be called concurrently for different connections.
    init(handler: @escaping @Sendable (Request) async -> Action) async throws {
        let state = ScriptedServerState(Shared())
        let bootstrap = ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            .childChannelInitializer { channel in
                guard let id = state.opened(channel) else {
                    return channel.eventLoop.makeFailedFuture(ChannelError.ioOnClosedChannel)
                }
                channel.closeFuture.whenComplete { _ in state.closed(id) }
                return channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.configureHTTPServerPipeline()
                    try channel.pipeline.syncOperations.addHandler(
                        ScriptedConnectionHandler(id: id, state: state, handler: handler))
                }
            }
        let channel = try await bootstrap.bind(host: "127.0.0.1", port: 0).get()
        guard let port = channel.localAddress?.port else {
            try? await channel.close()
            throw ChannelError.unknownLocalAddress
        }
        self.port = port
        self.serverChannel = channel
        self.state = state
    }

    deinit {
        // Best effort for a test that forgot `shutdown()`: nothing may keep listening on the shared event loops.
        let channels = markShutDown()
        guard let channels else { return }
        serverChannel.close(promise: nil)
        for channel in channels { channel.close(promise: nil) }
    }

    /// Marks the server shut down and returns its open connections, or nil when it already was.
    private func markShutDown() -> [any Channel]? {
        state.withLockedValue { shared in
            if shared.isShutDown { return nil }
            shared.isShutDown = true
            shared.stalled.removeAll()
            return Array(shared.open.values)
        }
    }

    /// Every request received so far, in arrival order (recorded before the handler is called).
    var requests: [Request] { state.withLockedValue { $0.requests } }

    /// How many connections were opened so far.
    var connectionsOpened: Int { state.withLockedValue { $0.nextID } }

    /// How many requests are currently stalled. A stalled request whose client closes the connection no longer counts.
    var stalledCount: Int { state.withLockedValue { $0.stalled.count } }

    /// Closes the connections of stalled requests (they get no answer).
    func releaseStalled() {
        let channels: [any Channel] = state.withLockedValue { shared in
            let stalled = Array(shared.stalled.values)
            shared.stalled.removeAll()
            return stalled
        }
        for channel in channels { channel.close(promise: nil) }
    }

    /// Waits (polling every 10 ms) until `condition` holds for the recorded requests: true then, false if the task
    /// is cancelled first. No deadline of its own: how soon a request arrives on a loaded machine is not what a
    /// test checks (a 10 s one failed under AddressSanitizer's load), and a wait that never ends is stopped by the
    /// suite's time limit, which cancels the test.
    func waitFor(_ condition: @Sendable ([Request]) -> Bool) async -> Bool {
        while !Task.isCancelled {
            if condition(requests) { return true }
            try? await Task.sleep(for: .milliseconds(10))
        }
        return condition(requests)
    }

    /// Stops the server and closes all connections, stalled ones included; waits until they are closed. A second
    /// call does nothing.
    func shutdown() async throws {
        let channels = markShutDown()
        guard let channels else { return }
        var failure: (any Error)?
        do { try await serverChannel.close() } catch { failure = error }
        for channel in channels { channel.close(promise: nil) }
        for channel in channels { try? await channel.closeFuture.get() }
        if let failure { throw failure }
    }

    /// The state shared by the server, its connections and the tests.
    fileprivate struct Shared: Sendable {
        var requests: [Request] = []
        /// Open connections by id.
        var open: [Int: any Channel] = [:]
        /// Connections whose request is stalled, by id.
        var stalled: [Int: any Channel] = [:]
        var nextID = 0
        var isShutDown = false
    }
}

private typealias ScriptedServerState = NIOLockedValueBox<ScriptedServer.Shared>

extension NIOLockedValueBox where Value == ScriptedServer.Shared {
    /// Registers a new connection and returns its id, or nil once the server is shut down.
    fileprivate func opened(_ channel: any Channel) -> Int? {
        withLockedValue { shared in
            if shared.isShutDown { return nil }
            shared.nextID += 1
            shared.open[shared.nextID] = channel
            return shared.nextID
        }
    }

    /// Forgets a closed connection.
    fileprivate func closed(_ id: Int) {
        withLockedValue { shared in
            shared.open[id] = nil
            shared.stalled[id] = nil
        }
    }
}

/// One connection's handler: gathers a request, records it, asks the test's handler and carries out its action.
///
/// Runs on the connection's event loop only. The scripted handler runs in a task; its action comes back through an
/// `EventLoopFuture` observed with `assumeIsolated()`, so the handler and its context never cross threads.
private final class ScriptedConnectionHandler: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let id: Int
    private let state: ScriptedServerState
    private let handler: @Sendable (ScriptedServer.Request) async -> ScriptedServer.Action
    private var head: HTTPRequestHead?
    private var body = ByteBuffer()

    init(
        id: Int, state: ScriptedServerState,
        handler: @escaping @Sendable (ScriptedServer.Request) async -> ScriptedServer.Action
    ) {
        self.id = id
        self.state = state
        self.handler = handler
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch unwrapInboundIn(data) {
        case .head(let head):
            self.head = head
            body = context.channel.allocator.buffer(capacity: 0)
        case .body(var chunk):
            body.writeBuffer(&chunk)
        case .end:
            guard let head else { return }
            self.head = nil
            let request = ScriptedServer.Request(
                method: head.method.rawValue, uri: head.uri, headers: Array(head.headers),
                body: Data(body.readableBytesView))
            body = ByteBuffer()
            state.withLockedValue { $0.requests.append(request) }
            let handler = self.handler
            // The handler runs on this connection's event loop, not on Swift's cooperative pool: the code under
            // test shares that pool, and a server whose answers wait for a free pool thread turns any stall of
            // the code under test into a timeout the test did not script.
            let promise = context.eventLoop.makePromise(of: ScriptedServer.Action.self)
            Task(executorPreference: EventLoopTaskExecutor(context.eventLoop)) { promise.succeed(await handler(request)) }
            promise.futureResult
                .assumeIsolated()
                .whenSuccess { action in self.perform(action, for: head, context: context) }
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }

    private func perform(_ action: ScriptedServer.Action, for head: HTTPRequestHead, context: ChannelHandlerContext) {
        switch action {
        case .respond(let response):
            respond(response, to: head, context: context)
        case .close:
            context.close(promise: nil)
        case .stall:
            // A connection the client already closed is not stalled: its close has been (or is being) recorded.
            guard context.channel.isActive else { return }
            let channel = context.channel
            let id = self.id
            let closeNow: Bool = state.withLockedValue { shared in
                if shared.isShutDown { return true }
                shared.stalled[id] = channel
                return false
            }
            if closeNow { context.close(promise: nil) }
        }
    }

    private func respond(_ response: ScriptedServer.Response, to head: HTTPRequestHead, context: ChannelHandlerContext) {
        var headers = HTTPHeaders(response.headers.map { ($0.name, $0.value) })
        headers.replaceOrAdd(name: "Content-Length", value: String(response.body.count))
        let keepAlive = head.isKeepAlive && !headers["connection"].contains { $0.lowercased() == "close" }
        if !keepAlive {
            headers.replaceOrAdd(name: "Connection", value: "close")
        } else if head.version == .http1_0 {
            headers.replaceOrAdd(name: "Connection", value: "keep-alive")
        }
        let responseHead = HTTPResponseHead(
            version: head.version, status: HTTPResponseStatus(statusCode: response.status), headers: headers)
        context.write(wrapOutboundOut(.head(responseHead)), promise: nil)
        if !response.body.isEmpty {
            var buffer = context.channel.allocator.buffer(capacity: response.body.count)
            buffer.writeBytes(response.body)
            context.write(wrapOutboundOut(.body(.byteBuffer(buffer))), promise: nil)
        }
        let written = context.writeAndFlush(wrapOutboundOut(.end(nil)))
        if !keepAlive {
            written.assumeIsolated().whenComplete { _ in context.close(promise: nil) }
        }
    }
}
