import FHIRDataQueue
import FHIRDataQueueServer
import Foundation
import Hummingbird
import Logging
import Metrics
import Prometheus
import ServiceLifecycle

/// A device gateway in miniature: devices `POST` FHIR Observations here, the gateway makes each one durable in
/// dq's queue and tries to deliver it at once (`DataQueue.create`), and `DataQueueService` delivers whatever
/// could not go at once (server down, backing off) in the background, in order, from the same ServiceGroup.
///
/// Answers: `201 Created` with the FHIR server's `Location` when the server took it during the request,
/// `202 Accepted` with the queued item's id when it is safely queued for later, `422` when the server rejected
/// it for good (dq parked it for an operator), `400` for anything that is not one JSON Observation.
/// `GET /metrics` serves dq's metrics (and Hummingbird's) as Prometheus text, `GET /healthz` and `GET /readyz`
/// the delivery's liveness and readiness (``OperationsEndpoints``).
///
/// Usage: `Gateway [--host 127.0.0.1] [--port 8080] [--config dq.json] [--poll-interval 1]`; dq's settings come
/// from the config file and `DQ_*` environment variables, as for the `dq` command. `--port 0` takes a free
/// port; the gateway prints `listening on HOST:PORT` on standard output once it accepts connections.
@main
struct Gateway {
    static func main() async throws {
        let options: Options
        do {
            options = try Options(CommandLine.arguments.dropFirst())
        } catch {
            FileHandle.standardError.write(Data("Gateway: \(error)\n".utf8))
            exit(64)
        }
        var logger = Logger(label: "gateway")
        logger.logLevel = .info

        let registry = PrometheusCollectorRegistry()
        MetricsSystem.bootstrap(PrometheusMetricsFactory(registry: registry))

        let settings = try await DataQueueSettings.load(config: options.configPath, environment: ProcessInfo.processInfo.environment)
        let queue = try await settings.makeQueue(logger: logger)

        let delivery = DataQueueService(
            queues: [queue], configuration: .init(pollInterval: options.pollInterval), logger: logger)
        let router = Router()
        router.add(middleware: MetricsMiddleware())
        router.post("Observation") { request, _ in
            do {
                let resource = try await FHIRExchange.resource(from: request, maximumBytes: 1 << 20, types: ["Observation"])
                return try await FHIRExchange.create(resource, in: queue)
            } catch let refusal as FHIRExchange.Refusal {
                return refusal.response
            }
        }
        OperationsEndpoints(
            metrics: { registry.emitToBuffer() }, readiness: { await delivery.readiness() },
            liveness: { delivery.liveness() }
        ).addRoutes(to: router)

        let app = Application(
            router: router,
            configuration: .init(address: .hostname(options.host, port: options.port), serverName: "dq-gateway"),
            services: [delivery],
            onServerRunning: { channel in
                let port = channel.localAddress?.port ?? options.port
                FileHandle.standardOutput.write(Data("listening on \(options.host):\(port)\n".utf8))
            },
            logger: logger)
        // The Application runs its own ServiceGroup (the HTTP server and the delivery service) and stops both
        // gracefully on SIGTERM or SIGINT: the request on the wire finishes, the journal is committed.
        try await app.runService()
        try await queue.shutdown()
    }
}

/// The gateway's few flags.
struct Options {
    var host = "127.0.0.1"
    var port = 8080
    var configPath: String?
    var pollInterval = Duration.seconds(1)

    init<Arguments: Collection<String>>(_ arguments: Arguments) throws {
        var rest = arguments[...]
        while let flag = rest.popFirst() {
            guard let value = rest.popFirst() else { throw UsageError("\(flag) needs a value") }
            switch flag {
            case "--host": host = value
            case "--port":
                guard let number = Int(value), (0...65535).contains(number) else {
                    throw UsageError("--port must be 0...65535")
                }
                port = number
            case "--config": configPath = value
            case "--poll-interval":
                guard let seconds = Double(value), seconds.isFinite, seconds > 0, seconds <= 86_400 else {
                    throw UsageError("--poll-interval must be seconds in (0, 86400]")
                }
                pollInterval = .milliseconds(Int64(seconds * 1000))
            default: throw UsageError("unknown option \(flag)")
            }
        }
    }
}

struct UsageError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}
