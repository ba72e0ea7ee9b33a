import FHIRDataQueue
import Foundation
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import ServiceLifecycle

/// The one-shot HTTP listener of a native app's sign-in (RFC 8252 7.3), a small Hummingbird application: it
/// listens on `127.0.0.1` on a port the system picks, takes the first `GET /callback` that carries `code` or
/// `error`, and answers the browser with a short page. Other paths (a browser's `/favicon.ico`) get 404; later
/// callbacks get 409.
final class LoopbackRedirectListener: Sendable {
    /// The redirect URI to register and send: `http://127.0.0.1:<port>/callback`.
    let redirectURI: String
    private let redirects: AsyncStream<String>
    private let group: ServiceGroup
    private let running: Task<Void, any Error>

    private init(redirects: AsyncStream<String>, port: Int, group: ServiceGroup, running: Task<Void, any Error>) {
        self.redirects = redirects
        self.redirectURI = "http://127.0.0.1:\(port)/callback"
        self.group = group
        self.running = running
    }

    /// Starts listening on `127.0.0.1:port` (0: a free port the system picks).
    static func start(port: Int = 0) async throws -> LoopbackRedirectListener {
        let (stream, continuation) = AsyncStream<String>.makeStream(bufferingPolicy: .bufferingNewest(1))
        let received = NIOLockedValueBox(false)
        let router = Router()
        router.get("callback") { request, _ in
            let names = Set(request.uri.queryParameters.map { String($0.key) })
            guard names.contains("code") || names.contains("error") else { return page(.notFound, "Not found.") }
            let first = received.withLockedValue { done in
                defer { done = true }
                return !done
            }
            guard first else { return page(.conflict, "dq already received an answer for this sign-in.") }
            continuation.yield(request.uri.description)
            continuation.finish()
            return page(.ok, "dq received the answer of the sign-in. Return to the terminal to see whether it succeeded.")
        }
        let silent = Logger(label: "dq.login", factory: { _ in SwiftLogNoOpLogHandler() })
        let (listening, listened) = AsyncStream<Int>.makeStream(bufferingPolicy: .bufferingNewest(1))
        let app = Application(
            responder: NotFoundPage(router.buildResponder()),
            configuration: .init(address: .hostname("127.0.0.1", port: port)),
            onServerRunning: { channel in
                listened.yield(channel.localAddress?.port ?? port)
                listened.finish()
            },
            logger: silent)
        let group = ServiceGroup(configuration: .init(services: [app], gracefulShutdownSignals: [], logger: silent))
        let running = Task {
            defer { listened.finish() }
            try await group.run()
        }
        for await bound in listening {
            return LoopbackRedirectListener(redirects: stream, port: bound, group: group, running: running)
        }
        let reason: String
        do {
            try await running.value
            reason = "the listener stopped"
        } catch {
            reason = "\(error)"
        }
        throw DataQueueError(.transport, "cannot listen on 127.0.0.1:\(port) for the sign-in redirect: \(reason)")
    }

    /// The full redirect URL of the first callback (`http://127.0.0.1:<port>/callback?code=…&state=…`), or
    /// nil when the listener was closed or the task cancelled first.
    func redirect() async -> URL? {
        for await target in redirects {
            return URL(string: "http://127.0.0.1" + target)
        }
        return nil
    }

    /// Stops listening and waits for that.
    func close() async {
        await group.triggerGracefulShutdown()
        _ = await running.result
    }
}

/// The short HTML page the browser shows.
private func page(_ status: HTTPResponse.Status, _ text: String) -> Response {
    Response(
        status: status,
        headers: [.contentType: "text/html; charset=utf-8", .cacheControl: "no-store", .connection: "close"],
        body: .init(byteBuffer: ByteBuffer(string: "<!doctype html><meta charset=utf-8><title>dq</title><p>\(text)</p>\n")))
}

/// The router's responder, with the page for a path it does not know (its own 404 has no body).
private struct NotFoundPage<Inner: HTTPResponder>: HTTPResponder {
    let inner: Inner
    init(_ inner: Inner) { self.inner = inner }

    func respond(to request: Request, context: Inner.Context) async throws -> Response {
        do {
            return try await inner.respond(to: request, context: context)
        } catch let error as HTTPError where error.status == .notFound {
            return page(.notFound, "Not found.")
        }
    }
}
