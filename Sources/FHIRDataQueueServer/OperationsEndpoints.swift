import FHIRDataQueue
import Foundation
import HTTPTypes
import Hummingbird
import NIOCore

/// The endpoints an operator's tools read: `GET /metrics` (Prometheus text), `GET /healthz` (liveness: 200 while
/// the delivery loops come round, else 503 naming the stuck one) and `GET /readyz` (readiness: 200, or 503 with
/// the reasons as JSON). `HEAD` answers as `GET` without the body; another method on these paths gets 405 with
/// `Allow`.
///
/// `dq run` and `dq serve` serve them; a host that embeds dq adds them to its own router:
/// ```swift
/// let router = Router()
/// OperationsEndpoints(
///     metrics: { registry.emitToBuffer() }, readiness: { await service.readiness() },
///     liveness: { service.liveness() }
/// ).addRoutes(to: router)
/// ```
public struct OperationsEndpoints: Sendable {
    /// The Prometheus text exposition of the process's metrics.
    public var metrics: @Sendable () -> [UInt8]
    /// The delivery's readiness, read when `/readyz` is asked.
    public var readiness: @Sendable () async -> DataQueueService.Readiness
    /// The delivery's liveness, read when `/healthz` is asked.
    public var liveness: @Sendable () -> DataQueueService.Liveness

    /// The paths these endpoints answer.
    public static let paths = ["/metrics", "/healthz", "/readyz"]

    /// Endpoints that read the metrics, readiness and liveness from these closures when asked.
    public init(
        metrics: @escaping @Sendable () -> [UInt8],
        readiness: @escaping @Sendable () async -> DataQueueService.Readiness,
        liveness: @escaping @Sendable () -> DataQueueService.Liveness
    ) {
        self.metrics = metrics
        self.readiness = readiness
        self.liveness = liveness
    }

    /// Adds `GET` and `HEAD` routes for the three paths, and 405 for any other method on them.
    public func addRoutes<Context: RequestContext>(to router: some RouterMethods<Context>) {
        for (path, answer) in [("metrics", answerMetrics), ("healthz", answerHealth), ("readyz", answerReadiness)] {
            router.get(RouterPath(path)) { _, _ in
                let (status, type, body) = await answer()
                return Response(status: status, headers: [.contentType: type], body: .init(byteBuffer: body))
            }
            // The headers a GET would get, its length included, and no body (RFC 9110 9.3.2).
            router.head(RouterPath(path)) { _, _ in
                let (status, type, body) = await answer()
                return Response(
                    status: status, headers: [.contentType: type, .contentLength: String(body.readableBytes)], body: .init())
            }
            for method in [HTTPRequest.Method.post, .put, .delete, .patch, .options] {
                router.on(RouterPath(path), method: method) { _, _ in
                    Response(
                        status: .methodNotAllowed,
                        headers: [.allow: "GET, HEAD", .contentType: "text/plain; charset=utf-8"],
                        body: .init(byteBuffer: ByteBuffer(string: "method not allowed\n")))
                }
            }
        }
    }

    private typealias Answer = @Sendable () async -> (HTTPResponse.Status, String, ByteBuffer)

    private var answerMetrics: Answer {
        { [metrics] in (.ok, "text/plain; version=0.0.4; charset=utf-8", ByteBuffer(bytes: metrics())) }
    }

    private var answerHealth: Answer {
        { [liveness] in
            let liveness = liveness()
            let text = liveness.alive ? "ok\n" : liveness.reasons.joined(separator: "\n") + "\n"
            return (liveness.alive ? .ok : .serviceUnavailable, "text/plain; charset=utf-8", ByteBuffer(string: text))
        }
    }

    private var answerReadiness: Answer {
        { [readiness] in
            let readiness = await readiness()
            var body = ByteBuffer(bytes: (try? JSONEncoder().encode(readiness)) ?? Data())
            body.writeString("\n")
            return (readiness.ready ? .ok : .serviceUnavailable, "application/json", body)
        }
    }
}

/// Refuses a request whose body is larger than a limit with `413 Content Too Large`, before any route sees it, and
/// one whose body does not arrive within a deadline with `408 Request Timeout` (a client that sends a byte a second
/// holds one connection, not the receiver); a body within both is collected for the route.
///
/// Two optional checks come before the body is kept: `limit` gives a request a smaller limit than `maximumBytes` (an
/// endpoint whose bodies are small), and `admit` may answer a request from its head alone (a bearer token that is not
/// valid). A request `admit` answers has its body read and thrown away (within the same limit and deadline), not
/// kept: an unauthenticated client cannot make the receiver hold `maximumBytes` for it, and the answer still reaches
/// a client that is sending its body (closing with the body unread would reset the connection under it).
public struct BodyLimitMiddleware<Context: RequestContext>: RouterMiddleware {
    /// The largest body taken, in bytes.
    public let maximumBytes: Int
    /// How long the whole body may take to arrive; nil: no limit.
    public let deadline: Duration?
    /// Told of each answer given here (413, 408, or what `admit` answered) before it is sent, with the request and
    /// its context (its route resolved): where a host counts them with the answers of its routes.
    public let refused: (@Sendable (Request, Context, HTTPResponse.Status) -> Void)?
    /// A request's own limit, when smaller than ``maximumBytes``; nil: the maximum.
    public let limit: (@Sendable (Request, Context) -> Int?)?
    /// The answer to a request refused from its head (its body is then read and thrown away); nil: it goes on.
    public let admit: (@Sendable (Request, Context) async -> Response?)?
    /// As `admit`, and may set what it found on the context the routes get (the client a bearer token names, so
    /// that they do not check it again). Used instead of `admit` when given.
    public let authenticate: (@Sendable (Request, inout Context) async -> Response?)?

    /// Refuses bodies larger than `maximumBytes` (or a request's own `limit`), or slower than `deadline`, telling
    /// `refused` of each; answers what `admit` refuses without keeping its body.
    public init(
        maximumBytes: Int, deadline: Duration? = nil, refused: (@Sendable (Request, Context, HTTPResponse.Status) -> Void)? = nil,
        limit: (@Sendable (Request, Context) -> Int?)? = nil, admit: (@Sendable (Request, Context) async -> Response?)? = nil,
        authenticate: (@Sendable (Request, inout Context) async -> Response?)? = nil
    ) {
        self.maximumBytes = maximumBytes
        self.deadline = deadline
        self.refused = refused
        self.limit = limit
        self.admit = admit
        self.authenticate = authenticate
    }

    /// Answers 413 to a body over the limit, declared or sent, and 408 to one that takes too long; answers what
    /// `admit` refuses once its body is read; passes others on with the body collected.
    public func handle(
        _ request: Request, context: Context, next: (Request, Context) async throws -> Response
    ) async throws -> Response {
        // RFC 9112 3.2: a request with no Host, or more than one, is answered 400 (the HTTP/2 `:authority` counts as one).
        if request.head.authority == nil || request.headers[values: Self.host].count > 0 {
            return refusal(.badRequest, "the request must have exactly one Host header", request, context)
        }
        let maximum = min(maximumBytes, limit?(request, context) ?? maximumBytes)
        if let declared = request.headers[.contentLength].flatMap({ Int($0) }), declared > maximum {
            return refusal(.contentTooLarge, "the request body is larger than \(maximum) bytes", request, context)
        }
        var context = context
        let answer: Response?
        if let authenticate {
            answer = await authenticate(request, &context)
        } else {
            answer = await admit?(request, context)
        }
        var request = request
        do {
            guard let body = try await Self.read(request, upTo: maximum, keep: answer == nil, deadline: deadline) else {
                return refusal(
                    .requestTimeout, "the request body did not arrive within \(deadline?.components.seconds ?? 0) s", request, context)
            }
            if let answer {
                refused?(request, context, answer.status)
                return answer
            }
            request.body = .init(buffer: body)
        } catch is NIOTooManyBytesError {
            return refusal(.contentTooLarge, "the request body is larger than \(maximum) bytes", request, context)
        }
        return try await next(request, context)
    }

    /// The body, read within `deadline` (nil when it ran out); kept, or read and dropped (an empty buffer).
    /// - Throws: `NIOTooManyBytesError` past `maximum` bytes.
    private static func read(_ request: Request, upTo maximum: Int, keep: Bool, deadline: Duration?) async throws -> ByteBuffer? {
        @Sendable func body() async throws -> ByteBuffer {
            var request = request
            if keep { return try await request.collectBody(upTo: maximum) }
            var seen = 0
            for try await part in request.body {
                seen += part.readableBytes
                if seen > maximum { throw NIOTooManyBytesError(maxBytes: maximum) }
            }
            return ByteBuffer()
        }
        guard let deadline else { return try await body() }
        return try await withThrowingTaskGroup(of: ByteBuffer?.self) { group in
            group.addTask { try await body() }
            group.addTask {
                try await Task.sleep(for: deadline)
                return nil
            }
            defer { group.cancelAll() }
            return try await group.next() ?? nil
        }
    }

    /// A `Host` field beyond the first (the first is the request's authority).
    private static var host: HTTPField.Name { HTTPField.Name("Host")! }

    private func refusal(_ status: HTTPResponse.Status, _ text: String, _ request: Request, _ context: Context) -> Response {
        refused?(request, context, status)
        return Response(
            status: status, headers: [.contentType: "text/plain; charset=utf-8", .connection: "close"],
            body: .init(byteBuffer: ByteBuffer(string: text + "\n")))
    }
}
