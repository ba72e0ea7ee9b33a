import ArgumentParser
import FHIRDataQueue
import FHIRDataQueueServer
import Foundation
import Logging
import Metrics
import NIOConcurrencyHelpers
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
                is committed, and dq exits 0. SIGHUP reads the configuration and its secret files again: one that \
                validates replaces the running one once the request on the wire is answered; one that does not is \
                refused and logged. With NOTIFY_SOCKET set it tells systemd READY=1, RELOADING=1 and STOPPING=1, \
                and WATCHDOG=1 when WATCHDOG_USEC asks. \
                --metrics-address serves Prometheus text on /metrics, liveness on /healthz (200 while the process \
                runs) and readiness on /readyz (503 with a JSON reason while storage fails, flushes fail with an \
                error of their own or the server refuses the credentials, or an item waits longer than --ready-max-age).
                """)

        @OptionGroup var queueOptions: QueueOptions
        @OptionGroup var sending: SendingOptions

        @Option(
            help:
                "Serve /metrics (Prometheus text), /healthz and /readyz at HOST:PORT, e.g. 127.0.0.1:9464 (a bare port means loopback). Overrides \"metrics_address\"."
        )
        var metricsAddress: String?
        @Option(
            parsing: .unconditional,
            help: "Seconds between looks for items queued by other processes (default 1). Overrides \"poll_interval_seconds\".")
        var pollInterval: Double?
        @Option(
            parsing: .unconditional,
            help: "Seconds a graceful stop waits for the request on the wire (default 10). Overrides \"drain_timeout_seconds\".")
        var drainTimeout: Double?
        @Option(
            parsing: .unconditional,
            help: "/readyz fails while a pending item is older than this many seconds. Overrides \"ready_max_age_seconds\".")
        var readyMaxAge: Double?

        func validate() throws {
            if let pollInterval { try checkFlagSeconds(pollInterval, name: "--poll-interval", allowZero: false) }
            if let drainTimeout { try checkFlagSeconds(drainTimeout, name: "--drain-timeout", allowZero: true) }
            if let readyMaxAge { try checkFlagSeconds(readyMaxAge, name: "--ready-max-age", allowZero: false) }
            if let metricsAddress, MetricsServer.parse(metricsAddress) == nil {
                throw ValidationError("--metrics-address is \(metricsAddress): \(ListenAddress.form)")
            }
        }

        func run() async throws {
            // SIGHUP, SIGTERM and SIGINT are trapped once, for the whole run, before the queue opens. A SIGHUP that
            // comes while the queue opens, while a round's services start or between two rounds is kept for the
            // round that listens next (its default action would end dq run; a handler set up by each round's
            // reload service would miss it). A SIGTERM or SIGINT ends dq run wherever it comes: a round drains and
            // none follows, even one a reload had validated (a group's own trap, set up each round, took a stop
            // that came while a round drained for a reload, and the next round started: dq run went on).
            signal(SIGHUP, SIG_IGN)
            let hangups = HangupSignals()
            let trapped = await UnixSignalsSequence(trapping: .sighup)
            let forwarding = Task {
                for await _ in trapped { hangups.arrived() }
            }
            defer { forwarding.cancel() }
            let stops = StopSignals()
            let trappedStops = await UnixSignalsSequence(trapping: .sigterm, .sigint)
            let stopping = Task {
                for await signal in trappedStops {
                    stops.arrived()
                    // Said once the stop is taken: from here no round starts (what an operator, or a test, waits for).
                    Logger(label: "dq").notice("stopping on \(signal): the round in progress drains, no other starts")
                }
            }
            defer { stopping.cancel() }
            let registry = PrometheusCollectorRegistry()
            MetricsSystem.bootstrap(Exposition.factory(registry))
            recordBuildInfo()
            let work = Task { [queueOptions, sending] in
                try await withQueue(queueOptions, sending: sending, waitsForDatabase: true) { first, firstSettings, firstDaemon in
                    // The metrics endpoint outlives the rounds: a reload swaps the service it reports on and keeps
                    // the listening socket and its clients' connections (its address changes at the next start).
                    let round = CurrentRound()
                    let metrics = try await serveMetrics(daemon: firstDaemon, registry: registry, round: round)
                    // Closed on every path, awaited.
                    do {
                        // SIGHUP: a configuration that validates replaces the running one once the group has drained
                        // (the request on the wire answered, the journal committed); one that does not is refused.
                        var (queue, settings, daemon) = (first, firstSettings, firstDaemon)
                        while stops.beginRound() {
                            let reload = ReloadRequest()
                            defer { stops.endRound() }
                            try await deliver(
                                queue: queue, settings: settings, daemon: daemon, round: round, reload: reload, hangups: hangups,
                                stops: stops)
                            let next = reload.take()
                            if stops.requested {
                                // A reload had ended the round (so no STOPPING=1 was sent): the stop came as it drained.
                                if let (unused, _, _) = next {
                                    SystemdNotify.send("STOPPING=1")
                                    try? await unused.shutdown()
                                }
                                break
                            }
                            guard let (nextQueue, nextSettings, nextDaemon) = next else { break }
                            if queue !== first { try? await queue.shutdown() }
                            (queue, settings, daemon) = (nextQueue, nextSettings, nextDaemon)
                        }
                        if queue !== first { try? await queue.shutdown() }
                    } catch {
                        await metrics?.close()
                        throw error
                    }
                    await metrics?.close()
                }
            }
            // A stop between rounds (the queue opening, a database awaited) cancels the work: nothing is sent then.
            stops.whenOutsideRounds { work.cancel() }
            do {
                try await withTaskCancellationHandler {
                    try await work.value
                } onCancel: {
                    work.cancel()
                }
            } catch is CancellationError where stops.requested {
                Logger(label: "dq").notice("stopped before delivery began")
            }
        }

        /// The metrics endpoint (`--metrics-address`, else `metrics_address`), listening before the first round's
        /// group runs (an address in use fails the start); nil when none is asked for.
        private func serveMetrics(
            daemon: DaemonSettings, registry: PrometheusCollectorRegistry, round: CurrentRound
        ) async throws -> MetricsServer? {
            guard let address = metricsAddress ?? daemon.metricsAddress, let (host, port) = MetricsServer.parse(address)
            else { return nil }
            let started = try await MetricsServer.start(
                host: host, port: port, registry: registry, readiness: { await round.readiness() },
                liveness: { round.liveness() })
            Logger(label: "dq").info("serving metrics", metadata: ["address": "\(host):\(started.port)"])
            return started
        }

        /// One configuration's service group: delivery, readiness, systemd notifications, reload.
        private func deliver(
            queue: DataQueue, settings: DataQueueSettings, daemon: DaemonSettings, round: CurrentRound, reload: ReloadRequest,
            hangups: HangupSignals, stops: StopSignals
        ) async throws {
            let logger = Logger(label: "dq")
            let maximumAge = readyMaxAge ?? daemon.readyMaxAgeSeconds
            if let maximumAge {
                try DataQueue.Configuration.checkSeconds(maximumAge, name: "\"ready_max_age_seconds\"", allowZero: false)
            }
            let service = DataQueueService(
                queues: [queue],
                configuration: .init(
                    pollInterval: .milliseconds(Int64((pollInterval ?? daemon.pollIntervalSeconds ?? 1) * 1000)),
                    drainTimeout: .milliseconds(Int64((drainTimeout ?? daemon.drainTimeoutSeconds ?? 10) * 1000)),
                    readyMaximumAge: maximumAge.map { .milliseconds(Int64($0 * 1000)) },
                    journalRetention: try settings.journalRetention().map { .seconds($0) },
                    watchdog: SystemdNotify.watchdog()),
                logger: logger)
            var services: [ServiceGroupConfiguration.ServiceConfiguration] = [.init(service: service)]
            // Until the group traps SIGTERM, /readyz says it is starting, so that nothing takes it as up and stops it
            // then; between rounds, that it is reloading.
            let trapping = GroupStarted()
            round.begin(service, started: trapping)
            defer { round.end() }
            // A reload that validated ends this group gracefully, as SIGTERM would.
            let shutdown = GroupShutdown()
            services.append(
                .init(
                    service: ReloadOnHangup(
                        current: settings, currentDaemon: daemon, currentTLSFiles: settings.tlsFiles(), options: queueOptions,
                        sending: sending,
                        request: reload, hangups: hangups, shutdown: shutdown, logger: logger),
                    successTerminationBehavior: .gracefullyShutdownGroup))
            // SIGTERM or SIGINT (trapped for the whole run) ends this group gracefully; at once if one came before.
            services.append(
                .init(service: StopOnSignal(stops: stops, shutdown: shutdown), successTerminationBehavior: .gracefullyShutdownGroup))
            // Last: it starts once the group runs (READY=1), and hears the stop first.
            services.append(
                .init(
                    service: SystemdNotify(
                        status: "delivering to \(queue.queueName)", reload: reload, stops: stops, started: trapping)))
            let group = ServiceGroup(
                configuration: ServiceGroupConfiguration(services: services, gracefulShutdownSignals: [], logger: logger))
            shutdown.set(group)
            try await group.run()
        }
    }
}

/// `dq_build_info{version="…"} 1`, the usual way to put a version on a dashboard.
func recordBuildInfo() {
    Gauge(label: "dq_build_info", dimensions: [("version", DQVersion.current)]).record(1)
}

/// The round of `dq run` that runs now, for the metrics endpoint that outlives rounds: readiness and liveness of
/// its service, "starting" until its group traps its signals, "reloading" between two rounds.
final class CurrentRound: Sendable {
    private let state = NIOLockedValueBox<(service: DataQueueService, started: GroupStarted)?>(nil)

    func begin(_ service: DataQueueService, started: GroupStarted) { state.withLockedValue { $0 = (service, started) } }
    func end() { state.withLockedValue { $0 = nil } }

    func readiness() async -> DataQueueService.Readiness {
        guard let (service, started) = state.withLockedValue({ $0 }) else {
            return DataQueueService.Readiness(reasons: ["reloading: the next configuration's delivery is starting"])
        }
        guard started.isSet else {
            return DataQueueService.Readiness(reasons: ["starting: the service group is not running yet"])
        }
        return await service.readiness()
    }

    /// Alive between rounds: the process is switching configurations, not stuck.
    func liveness() -> DataQueueService.Liveness {
        state.withLockedValue { $0 }?.service.liveness() ?? DataQueueService.Liveness(reasons: [])
    }
}
