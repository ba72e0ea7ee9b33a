import FHIRDataQueue
import Foundation
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
public struct BodyLimitMiddleware<Context: RequestContext>: RouterMiddleware {
    /// The largest body taken, in bytes.
    public let maximumBytes: Int
    /// How long the whole body may take to arrive; nil: no limit.
    public let deadline: Duration?
    /// Told of each refusal (413 or 408) before it is answered, with the request and its context (its route
    /// resolved): where a host counts them with the answers of its routes.
    public let refused: (@Sendable (Request, Context, HTTPResponse.Status) -> Void)?

    /// Refuses bodies larger than `maximumBytes`, or slower than `deadline`, telling `refused` of each.
    public init(
        maximumBytes: Int, deadline: Duration? = nil, refused: (@Sendable (Request, Context, HTTPResponse.Status) -> Void)? = nil
    ) {
        self.maximumBytes = maximumBytes
        self.deadline = deadline
        self.refused = refused
    }

    /// Answers 413 to a body over the limit, declared or sent, and 408 to one that takes too long; passes others on
    /// with the body collected.
    public func handle(
        _ request: Request, context: Context, next: (Request, Context) async throws -> Response
    ) async throws -> Response {
        if let declared = request.headers[.contentLength].flatMap({ Int($0) }), declared > maximumBytes {
            return refusal(.contentTooLarge, "the request body is larger than \(maximumBytes) bytes", request, context)
        }
        var request = request
        do {
            guard let deadline else {
                _ = try await request.collectBody(upTo: maximumBytes)
                return try await next(request, context)
            }
            let reading = request
            let maximum = maximumBytes
            let body: ByteBuffer? = try await withThrowingTaskGroup(of: ByteBuffer?.self) { group in
                group.addTask {
                    var request = reading
                    return try await request.collectBody(upTo: maximum)
                }
                group.addTask {
                    try await Task.sleep(for: deadline)
                    return nil
                }
                defer { group.cancelAll() }
                return try await group.next() ?? nil
            }
            guard let body else {
                return refusal(
                    .requestTimeout, "the request body did not arrive within \(deadline.components.seconds) s", request, context)
            }
            request.body = .init(buffer: body)
        } catch is NIOTooManyBytesError {
            return refusal(.contentTooLarge, "the request body is larger than \(maximumBytes) bytes", request, context)
        }
        return try await next(request, context)
    }

    private func refusal(_ status: HTTPResponse.Status, _ text: String, _ request: Request, _ context: Context) -> Response {
        refused?(request, context, status)
        return Response(
            status: status, headers: [.contentType: "text/plain; charset=utf-8", .connection: "close"],
            body: .init(byteBuffer: ByteBuffer(string: text + "\n")))
    }
}
