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
/// With `--c3pro-antispam FILE` the gateway also mounts the C3-PRO receiver (``C3PROReceiver``, the routes `dq serve`
/// runs) under `/c3pro`: apps register with one of the file's `Antispam` secrets (one per line; `#` starts a
/// comment), get a bearer token (`POST /c3pro/oauth`), and post plain resources (`POST /c3pro/fhir/{type}`) and
/// encrypted envelopes (`POST /c3pro/encfhir/{type}`), into the same queue and the same delivery as
/// `POST /Observation`. `--c3pro-keys DIR` gives the private keys envelopes are opened with before they are sent
/// (`DIR/<key_id>/private-c3pro.der` or `DIR/<key_id>.pem`, as `serve.keys_dir`); without it an envelope is
/// quarantined (`dq quarantine`) until a keyring is there. Clients and tokens are kept in the queue's database.
/// Plain resources are PHI: set `at_rest` in the settings so that the queue seals them on disk.
///
/// Usage: `Gateway [--host 127.0.0.1] [--port 8080] [--config dq.json] [--poll-interval 1]
/// [--c3pro-antispam FILE [--c3pro-keys DIR]]`; dq's settings come from the config file and `DQ_*` environment
/// variables, as for the `dq` command. `--port 0` takes a free port; the gateway prints `listening on HOST:PORT`
/// on standard output once it accepts connections.
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

        var settings = try await DataQueueSettings.load(config: options.configPath, environment: ProcessInfo.processInfo.environment)
        // The keyring goes into the queue's configuration before it opens: envelopes are opened when they are sent.
        if let keys = options.c3proKeys {
            let keyring = EnvelopeKeyring(directory: keys)
            do {
                if try keyring.check().isEmpty { logger.warning("no key in --c3pro-keys: every envelope will be quarantined") }
            } catch {
                FileHandle.standardError.write(Data("Gateway: --c3pro-keys: \(error)\n".utf8))
                exit(64)
            }
            settings.envelopeKeyring = keyring
        }
        let queue = try await settings.makeQueue(logger: logger)

        let delivery = DataQueueService(
            queues: [queue], configuration: .init(pollInterval: options.pollInterval), logger: logger)
        // The receiver limits registration per source address: the context carries it.
        let router = Router(context: ReceiverRequestContext.self)
        router.add(middleware: MetricsMiddleware())
        router.post("Observation") { request, _ in
            do {
                let resource = try await FHIRExchange.resource(from: request, maximumBytes: 1 << 20, types: ["Observation"])
                return try await FHIRExchange.create(resource, in: queue)
            } catch let refusal as FHIRExchange.Refusal {
                return refusal.response
            }
        }
        if let antispamSecrets = options.c3proAntispamSecrets {
            let receiver = try C3PROReceiver(
                queue: queue, configuration: .init(pathPrefix: "/c3pro", antispamSecrets: antispamSecrets), logger: logger)
            // Its bodies' limits: a request with no valid token is answered without its body being kept.
            router.add(middleware: receiver.bodyLimitMiddleware())
            receiver.addRoutes(to: router)
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
    /// The `Antispam` secrets of `--c3pro-antispam FILE`; set, the C3-PRO routes are served under `/c3pro`.
    var c3proAntispamSecrets: [String]?
    /// `--c3pro-keys`: the directory of the private keys C3-PRO envelopes are opened with.
    var c3proKeys: String?

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
            case "--c3pro-antispam": c3proAntispamSecrets = try Self.antispamSecrets(value)
            case "--c3pro-keys":
                var isDirectory: ObjCBool = false
                guard FileManager.default.fileExists(atPath: value, isDirectory: &isDirectory), isDirectory.boolValue else {
                    throw UsageError("--c3pro-keys \(value) is not a directory")
                }
                c3proKeys = value
            default: throw UsageError("unknown option \(flag)")
            }
        }
        if c3proKeys != nil, c3proAntispamSecrets == nil {
            throw UsageError("--c3pro-keys opens C3-PRO envelopes: it needs --c3pro-antispam, which serves their routes")
        }
    }

    /// The `Antispam` secrets of `file`: its non-empty lines, trimmed, but those that start with `#`.
    static func antispamSecrets(_ file: String) throws -> [String] {
        guard let data = FileManager.default.contents(atPath: file) else {
            throw UsageError("--c3pro-antispam \(file) cannot be read")
        }
        let secrets = String(decoding: data, as: UTF8.self).split(whereSeparator: \.isNewline)
            .map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty && !$0.hasPrefix("#") }
        guard !secrets.isEmpty else { throw UsageError("--c3pro-antispam \(file) holds no secret") }
        return secrets
    }
}

struct UsageError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}
