import FHIRDataQueue
import FHIRDataQueueServer
import Foundation
import Hummingbird
import Logging
import NIOCore
import Prometheus
import ServiceLifecycle

/// The `dq run --metrics-address` endpoint: ``OperationsEndpoints`` (`/metrics`, `/healthz`, `/readyz`) on a
/// Hummingbird application of its own, which listens from ``start(host:port:registry:readiness:liveness:)`` until
/// ``close()``: `dq run` keeps it, and its clients' keep-alive connections, across its reload rounds.
final class MetricsServer: Sendable {
    /// The port it listens on (the one the system chose for port 0).
    let port: Int
    private let group: ServiceGroup
    private let running: Task<Void, any Error>

    /// `HOST:PORT`, `[IPv6]:PORT` or a bare `PORT` (then loopback).
    static func parse(_ text: String) -> (host: String, port: Int)? { ListenAddress.parse(text) }

    /// The largest request body taken (the endpoints take none): a larger one gets 413.
    static let maximumBodyBytes = 64 * 1024

    private init(port: Int, group: ServiceGroup, running: Task<Void, any Error>) {
        self.port = port
        self.group = group
        self.running = running
    }

    /// Listens on `host:port`; throws a configuration error naming the address when it cannot.
    static func start(
        host: String, port: Int, registry: PrometheusCollectorRegistry,
        readiness: @escaping @Sendable () async -> DataQueueService.Readiness,
        liveness: @escaping @Sendable () -> DataQueueService.Liveness
    ) async throws -> MetricsServer {
        let router = Router()
        router.add(middleware: BodyLimitMiddleware(maximumBytes: maximumBodyBytes))
        OperationsEndpoints(metrics: { Exposition.emit(registry) }, readiness: readiness, liveness: liveness)
            .addRoutes(to: router)
        let (listening, listened) = AsyncStream<Int>.makeStream(bufferingPolicy: .bufferingNewest(1))
        // Hummingbird's own log lines (one per request at debug, a failed connection at error) say nothing an
        // operator of dq needs; dq logs the address it serves on.
        let app = Application(
            router: router, configuration: .init(address: .hostname(host, port: port)),
            onServerRunning: { channel in
                listened.yield(channel.localAddress?.port ?? port)
                listened.finish()
            },
            logger: Logger(label: "dq.metrics", factory: { _ in SwiftLogNoOpLogHandler() }))
        let group = ServiceGroup(
            configuration: .init(
                services: [app], gracefulShutdownSignals: [],
                logger: Logger(label: "dq.metrics", factory: { _ in SwiftLogNoOpLogHandler() })))
        let running = Task {
            defer { listened.finish() }
            try await group.run()
        }
        for await bound in listening {
            return MetricsServer(port: bound, group: group, running: running)
        }
        // The application ended before it listened: the bind failed.
        do {
            try await running.value
            throw DataQueueError(.invalidConfiguration, "cannot serve metrics on \(host):\(port)")
        } catch let error as IOError {
            let reason =
                switch error.errnoCode {
                case EADDRINUSE: "the address is in use (another dq run, or another exporter?)"
                case EACCES: "permission denied (ports below 1024 need privileges)"
                case EADDRNOTAVAIL: "this machine has no such address"
                default: String(cString: strerror(error.errnoCode))
                }
            throw DataQueueError(.invalidConfiguration, "cannot serve metrics on \(host):\(port): \(reason)")
        } catch let error as DataQueueError {
            throw error
        } catch {
            throw DataQueueError(.invalidConfiguration, "cannot serve metrics on \(host):\(port): \(error)")
        }
    }

    /// Stops listening, lets the requests on the wire finish, closes idle connections, and waits for that.
    func close() async {
        await group.triggerGracefulShutdown()
        _ = await running.result
    }
}
