import ArgumentParser
import FHIRDataQueue
import Foundation
import Logging
import Metrics
import Prometheus
import ServiceLifecycle
import UnixSignals

#if canImport(Glibc)
    import Glibc
#endif

extension DQ {
    struct Run: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "run",
            abstract: "Deliver in the foreground until SIGTERM or SIGINT (for systemd or a container).",
            discussion: """
                Flushes whenever there is something to send: at once for items this process queues, every \
                --poll-interval for items other processes queue, honouring the server's backoff. SIGTERM or \
                SIGINT stop it gracefully: the request on the wire finishes (at most --drain-timeout), the journal \
                is committed, and dq exits 0. With NOTIFY_SOCKET set it tells systemd READY=1 and STOPPING=1. \
                --metrics-address serves Prometheus text on /metrics, liveness on /healthz (200 while the process \
                runs) and readiness on /readyz (503 with a JSON reason while storage fails, flushes fail with an \
                error of their own or the server refuses the credentials, or an item waits longer than --ready-max-age).
                """)

        @OptionGroup var queueOptions: QueueOptions
        @OptionGroup var sending: SendingOptions

        @Option(
            help: "Serve /metrics (Prometheus text), /healthz and /readyz at HOST:PORT, e.g. 127.0.0.1:9464 (a bare port means loopback)."
        )
        var metricsAddress: String?
        @Option(parsing: .unconditional, help: "Seconds between looks for items queued by other processes.")
        var pollInterval: Double = 1
        @Option(parsing: .unconditional, help: "Seconds a graceful stop waits for the request on the wire.")
        var drainTimeout: Double = 10
        @Option(
            parsing: .unconditional,
            help: "/readyz fails while a pending item is older than this many seconds. Overrides \"ready_max_age_seconds\".")
        var readyMaxAge: Double?

        func validate() throws {
            try checkFlagSeconds(pollInterval, name: "--poll-interval", allowZero: false)
            try checkFlagSeconds(drainTimeout, name: "--drain-timeout", allowZero: true)
            if let readyMaxAge { try checkFlagSeconds(readyMaxAge, name: "--ready-max-age", allowZero: false) }
            if let metricsAddress, MetricsServer.parse(metricsAddress) == nil {
                throw ValidationError("--metrics-address must be HOST:PORT or PORT")
            }
        }

        func run() async throws {
            let registry = PrometheusCollectorRegistry()
            MetricsSystem.bootstrap(PrometheusMetricsFactory(registry: registry))
            recordBuildInfo()
            try await withQueue(queueOptions, sending: sending) { queue, settings in
                let logger = Logger(label: "dq")
                let maximumAge = readyMaxAge ?? settings.readyMaxAgeSeconds
                if let maximumAge {
                    try DataQueue.Configuration.checkSeconds(maximumAge, name: "\"ready_max_age_seconds\"", allowZero: false)
                }
                let service = DataQueueService(
                    queues: [queue],
                    configuration: .init(
                        pollInterval: .milliseconds(Int64(pollInterval * 1000)),
                        drainTimeout: .milliseconds(Int64(drainTimeout * 1000)),
                        readyMaximumAge: maximumAge.map { .milliseconds(Int64($0 * 1000)) },
                        journalRetention: try settings.journalRetention().map { .seconds($0) }),
                    logger: logger)
                var services: [any Service] = [service]
                if let metricsAddress, let (host, port) = MetricsServer.parse(metricsAddress) {
                    let started = try await MetricsServer.start(
                        host: host, port: port, registry: registry, readiness: { await service.readiness() })
                    services.append(started)
                    logger.info("serving metrics", metadata: ["address": "\(host):\(started.port)"])
                }
                // Last: it starts once the group traps the signals (READY=1), and hears the stop first.
                services.append(SystemdNotify(status: "delivering to \(queue.queueName)"))
                let group = ServiceGroup(
                    configuration: ServiceGroupConfiguration(
                        services: services.map { .init(service: $0) }, gracefulShutdownSignals: [.sigterm, .sigint, .sighup],
                        logger: logger))
                try await group.run()
            }
        }
    }
}

/// systemd's notification protocol (sd_notify), as the last service of the group: READY=1 once the group
/// runs (its signal handlers are in place), STOPPING=1 when graceful shutdown begins. One datagram to
/// `$NOTIFY_SOCKET` each; nothing when it is unset.
struct SystemdNotify: Service {
    let status: String

    func run() async throws {
        Self.send("READY=1\nSTATUS=\(status)")
        try? await gracefulShutdown()
        Self.send("STOPPING=1")
    }

    static func send(_ state: String) {
        guard var path = ProcessInfo.processInfo.environment["NOTIFY_SOCKET"], !path.isEmpty else { return }
        let abstract = path.hasPrefix("@")
        if abstract { path.removeFirst() }
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue), 0)
        guard fd >= 0 else { return }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard bytes.count < capacity else { return }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            let offset = abstract ? 1 : 0
            for (index, byte) in bytes.enumerated() { raw[index + offset] = byte }
        }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + bytes.count + (abstract ? 1 : 0))
        let message = Array(state.utf8)
        _ = withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { socketAddress in
                message.withUnsafeBytes { sendto(fd, $0.baseAddress, $0.count, 0, socketAddress, length) }
            }
        }
    }
}

/// `dq_build_info{version="…"} 1`, the usual way to put a version on a dashboard.
func recordBuildInfo() {
    Gauge(label: "dq_build_info", dimensions: [("version", DQVersion.current)]).record(1)
}
