import Foundation
import Logging
import NIOConcurrencyHelpers
import ServiceLifecycle

/// Delivers in the background: a `ServiceLifecycle.Service` that flushes its queues whenever there is
/// something to send, for as long as its service group runs.
///
/// It wakes at once when this process enqueues (``DataQueue/enqueue(_:method:fullURL:)``, `create`, …), polls
/// for items other processes queued every ``Configuration/pollInterval``, and honours each server's backoff
/// and `Retry-After` (a flush during a backoff returns at once without sending). Two services, or a service
/// and a cron `dq flush`, on one database never send an item twice: the queue's flush lock decides who sends.
///
/// ```swift
/// let queue = try await DataQueue(baseURL: url, configuration: configuration)
/// let group = ServiceGroup(
///     services: [DataQueueService(queues: [queue]), httpServer],
///     gracefulShutdownSignals: [.sigterm, .sigint], logger: logger)
/// try await group.run()
/// ```
///
/// On graceful shutdown it stops starting flushes, lets a flush that is sending finish its request (bounded
/// by ``Configuration/drainTimeout``), commits the journal and returns. On cancellation it stops at once;
/// nothing is lost either way (what was not answered stays queued, and the next flush settles it first).
///
/// The queues of other servers in the same database are flushed only when given: credentials are per
/// server, and a queue never sends to a server it was not made for.
public struct DataQueueService: Service {
    /// How the service polls and drains.
    public struct Configuration: Sendable {
        /// How often to look for items queued by other processes. The default is 1 second.
        public var pollInterval: Duration
        /// How long graceful shutdown waits for a flush that is sending. The default is 10 seconds.
        public var drainTimeout: Duration
        /// ``DataQueueService/readiness()`` fails while a pending item is older than this. The default (nil)
        /// does not look at age.
        public var readyMaximumAge: Duration?
        /// A liveness signal from the delivery loop itself (systemd's `WatchdogSec=`): `beat` is called each
        /// round, for each item a flush handles, and at least every `interval` while the loop waits. A loop that
        /// stops calling it is wedged. The default (nil) sends nothing.
        public var watchdog: Watchdog?
        /// Delivery journal lines older than this are deleted once a day (of every queue in the database,
        /// never a queued item). The default is 90 days; nil keeps every line.
        public var journalRetention: Duration?
        /// How much longer than its longest legitimate wait a delivery loop may be quiet before
        /// ``DataQueueService/liveness()`` calls it stuck (a slow disk or database). The default is 60 seconds.
        public var livenessMargin: Duration = .seconds(60)

        /// Creates a configuration; every parameter has the default stated on its property.
        public init(
            pollInterval: Duration = .seconds(1), drainTimeout: Duration = .seconds(10), readyMaximumAge: Duration? = nil,
            journalRetention: Duration? = .seconds(90 * 86_400), watchdog: Watchdog? = nil
        ) {
            self.pollInterval = pollInterval
            self.drainTimeout = drainTimeout
            self.readyMaximumAge = readyMaximumAge
            self.journalRetention = journalRetention
            self.watchdog = watchdog
        }
    }

    /// A liveness signal: ``beat`` at least every ``interval`` while the delivery loop is alive.
    public struct Watchdog: Sendable {
        /// The longest the loop waits between two beats (a single request can take longer: keep the watchdog's
        /// timeout above the request timeout).
        public var interval: Duration
        /// Says "alive" (for systemd: `WATCHDOG=1` to `$NOTIFY_SOCKET`).
        public var beat: @Sendable () -> Void

        /// A watchdog that calls `beat` at least every `interval`.
        public init(interval: Duration, beat: @escaping @Sendable () -> Void) {
            self.interval = interval
            self.beat = beat
        }
    }

    /// Whether the service is doing its job, for a readiness probe (`dq run`'s `/readyz`).
    public struct Readiness: Sendable, Encodable {
        /// True when every reason below is absent.
        public var ready: Bool { reasons.isEmpty }
        /// What is wrong, one line per queue and problem (never a body or a secret).
        public var reasons: [String]

        /// A readiness with these reasons (none: ready).
        public init(reasons: [String]) {
            self.reasons = reasons
        }

        private enum CodingKeys: String, CodingKey { case ready, reasons }

        /// Encodes `ready` and `reasons`.
        public func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(ready, forKey: .ready)
            try container.encode(reasons, forKey: .reasons)
        }
    }

    /// Whether the service's delivery loops are alive, for a liveness probe (`dq run`'s `/healthz`): a loop that
    /// has not come round for longer than its longest legitimate wait is wedged, and restarting the process is
    /// the remedy. A server that is down, a backoff or a storage failure are not liveness failures (they are
    /// ``readiness()``'s): the loop goes on around them.
    public struct Liveness: Sendable, Encodable {
        /// True when every reason below is absent.
        public var alive: Bool { reasons.isEmpty }
        /// Which loop is stuck and for how long, one line per queue.
        public var reasons: [String]

        /// A liveness with these reasons (none: alive).
        public init(reasons: [String]) {
            self.reasons = reasons
        }

        private enum CodingKeys: String, CodingKey { case alive, reasons }

        /// Encodes `alive` and `reasons`.
        public func encode(to encoder: any Encoder) throws {
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encode(alive, forKey: .alive)
            try container.encode(reasons, forKey: .reasons)
        }
    }

    /// The queues this service flushes.
    public let queues: [DataQueue]
    /// Per queue, when its delivery loop last came round (each round, each item a flush handles, and every few
    /// seconds while it waits); shared by the copies of this value, as ``failures`` is.
    private let beats = NIOLockedValueBox<[String: ContinuousClock.Instant]>([:])
    /// The queues whose first flush has returned: only they are judged. A first flush may open the queue's store
    /// (PostgreSQL opens lazily: migrations, sealing a queue that was plain) in steps no limit can bound.
    private let judged = NIOLockedValueBox<Set<String>>([])
    /// How it polls and drains.
    public let configuration: Configuration
    private let logger: Logger
    /// Per queue, why its last flush failed with an error of its own (storage, a refused credential); shared by
    /// the copies of this value, so that ``readiness()`` sees what ``run()`` found.
    private let failures = NIOLockedValueBox<[String: String]>([:])

    /// A service that flushes `queues`.
    ///
    /// - Parameters:
    ///   - queues: the queues to deliver, one per server.
    ///   - configuration: polling and draining. The default is ``Configuration/init(pollInterval:drainTimeout:readyMaximumAge:journalRetention:watchdog:)``.
    ///   - logger: where the service logs state changes (server down → up), never per item. The default
    ///     discards everything.
    public init(
        queues: [DataQueue], configuration: Configuration = Configuration(),
        logger: Logger = Logger(label: "dq.service", factory: { _ in SwiftLogNoOpLogHandler() })
    ) {
        self.queues = queues
        self.configuration = configuration
        self.logger = logger
    }

    /// Ready unless a queue's storage does not answer, a queue's flushes have failed with an error of their
    /// own (a storage error, a full disk, a refused credential) since their last success, or, with
    /// ``Configuration/readyMaximumAge``, a queue's oldest pending item is older than that. A server that is
    /// down is not a readiness failure: waiting for it is the service's job (the age limit is how to say
    /// that it has been too long).
    public func readiness() async -> Readiness {
        var reasons: [String] = []
        let failed = failures.withLockedValue { $0 }
        for queue in queues {
            if let failure = failed[queue.queueName] { reasons.append("\(queue.queueName): \(failure)") }
            do {
                let status = try await queue.status(countingJournal: false)
                if let limit = configuration.readyMaximumAge, let oldest = status.oldestPendingAt {
                    let age = Date().timeIntervalSince(oldest)
                    let seconds = Double(limit.components.seconds) + Double(limit.components.attoseconds) / 1e18
                    if age > seconds {
                        reasons.append("\(queue.queueName): the oldest pending item waits \(Int(age)) s (limit \(Int(seconds)) s)")
                    }
                }
            } catch {
                let message = (error as? DataQueueError)?.message ?? "\(error)"
                if failed[queue.queueName] == nil { reasons.append("\(queue.queueName): storage: \(message)") }
            }
        }
        return Readiness(reasons: reasons)
    }

    /// Alive unless a queue's delivery loop, once started, has not come round for longer than it can wait
    /// legitimately: one request (its connect and request timeouts), the settle time of a request left on the wire,
    /// the poll interval, and ``Configuration/livenessMargin`` more (a minute) for a slow disk or database.
    public func liveness() -> Liveness {
        let now = ContinuousClock.now
        let seen = beats.withLockedValue { $0 }
        let started = judged.withLockedValue { $0 }
        var reasons: [String] = []
        for queue in queues {
            // Not started yet, or still in its first flush (see ``judged``).
            guard started.contains(queue.queueName), let last = seen[queue.queueName] else { continue }
            if let quiet = Self.stuck(since: last, now: now, limit: livenessLimit(queue)) {
                reasons.append("\(queue.queueName): the delivery loop has not come round for \(quiet.components.seconds) s")
            }
        }
        return Liveness(reasons: reasons)
    }

    /// How long `queue`'s loop may be quiet: see ``liveness()``.
    func livenessLimit(_ queue: DataQueue) -> Duration {
        let seconds = queue.configuration.requestTimeout + queue.configuration.connectTimeout + queue.configuration.settleDelay
        return .milliseconds(Int64(seconds * 1000)) + configuration.pollInterval + configuration.livenessMargin
    }

    /// How long a loop last seen at `last` has been quiet at `now`, when that is longer than `limit`; else nil.
    static func stuck(since last: ContinuousClock.Instant, now: ContinuousClock.Instant, limit: Duration) -> Duration? {
        let quiet = last.duration(to: now)
        return quiet > limit ? quiet : nil
    }

    /// `queue`'s loop comes round: recorded for ``liveness()``, and told to the watchdog.
    private func beat(_ queue: DataQueue) {
        let now = ContinuousClock.now
        beats.withLockedValue { $0[queue.queueName] = now }
        configuration.watchdog?.beat()
    }

    /// Delivers until graceful shutdown (returns) or cancellation (returns at once).
    public func run() async throws {
        // Enqueues by other processes into a shared store (PostgreSQL's LISTEN/NOTIFY) wake their queue at
        // once; the poll interval stays the fallback.
        let queues = self.queues
        // One group holds every queue's delivery loop and listener: they end with the service. A queue whose
        // database was deleted or replaced under it ends the service with that error (dq run exits 74 and systemd
        // starts it again on the file there now).
        let failure = await withTaskGroup(of: LoopEnd.self) { group -> (any Error)? in
            for queue in queues {
                group.addTask { .delivery(await self.deliver(queue)) }
                group.addTask {
                    await queue.store.watchEnqueues { name in
                        if name.isEmpty || name == queue.queueName { queue.wakeUp.signal() }
                    }
                    return .listener
                }
            }
            var delivering = queues.count
            for await end in group {
                // A listener ends early where the store has nothing to listen to (SQLite).
                guard case .delivery(let error) = end else { continue }
                delivering -= 1
                if error != nil || delivering == 0 {
                    group.cancelAll()
                    return error
                }
            }
            return nil
        }
        if let failure { throw failure }
    }

    /// How a task of ``run()``'s group ended.
    private enum LoopEnd: Sendable {
        /// A delivery loop, with the error that ended the service, if one did.
        case delivery((any Error)?)
        /// An enqueue listener.
        case listener
    }

    /// The loop of one queue: flush, then wait for an enqueue, the poll interval or shutdown.
    ///
    /// A flush that fails with an error of its own (storage, a full disk, a damaged row) is logged once per
    /// change of the error's kind (its code), counted (`dq_flush_errors_total`), and retried after a growing delay (the queue's
    /// retry policy) that an enqueue does not shorten: nothing is sent again until then.
    private func deliver(_ queue: DataQueue) async -> (any Error)? {
        var healthy: Bool?
        var lastError: String?
        var errors = 0
        var pruned: ContinuousClock.Instant?
        while !Task.isCancelled && !Task.isShuttingDownGracefully {
            beat(queue)
            do {
                try queue.store.checkFileIdentity()
            } catch {
                logger.critical(
                    "stopping", metadata: ["queue": "\(queue.queueName)", "error": "\((error as? DataQueueError)?.message ?? "\(error)")"])
                return error
            }
            // nil: shutdown did not wait for the flush (its drain timeout, or cancellation).
            guard let outcome = await flushDraining(queue) else { break }
            judged.withLockedValue { _ = $0.insert(queue.queueName) }
            if case .failure(let error) = outcome, Task.isCancelled || Task.isShuttingDownGracefully {
                // A flush that shutdown cut short may end with an error of that: not a new failure to alert on.
                if !(error is CancellationError) {
                    logger.notice(
                        "the last flush ended with an error while stopping",
                        metadata: ["queue": "\(queue.queueName)", "error": "\((error as? DataQueueError)?.message ?? "\(error)")"])
                }
                break
            }
            if case .failure(let error) = outcome, !(error is CancellationError) {
                queue.metrics.flushError(error)
                errors += 1
                // Once per kind of failure: a database that refuses writes fails one write after another
                // (a delivery, a failure, the server's capabilities), which is one state for the operator.
                let message = (error as? DataQueueError)?.message ?? "\(error)"
                let kind = (error as? DataQueueError)?.code.description ?? "\(type(of: error))"
                if kind != lastError {
                    logger.error("flush failed; items stay queued", metadata: ["queue": "\(queue.queueName)", "error": "\(message)"])
                    lastError = kind
                }
                // Another flusher holding the lease (a standby instance) is not a failure of this one.
                if (error as? DataQueueError)?.code != .busy {
                    failures.withLockedValue { $0[queue.queueName] = "flush failed: \(message)" }
                }
                let delay = queue.configuration.retryPolicy.delay(afterFailures: errors, retryAfter: nil)
                await cancelWhenGracefulShutdown { try? await beatingSleep(queue, for: .milliseconds(Int64(delay * 1000))) }
                continue
            }
            // Only a flush that ran says writes work again: one that backed off (a backoff written before the
            // failure) or found another flusher tried nothing, and the failure would be logged anew after it.
            var ran = false
            if case .success(let report) = outcome {
                switch report.stop {
                case .backoff, .busy: ran = false
                default: ran = true
                }
            }
            if lastError != nil && ran {
                logger.notice("flushes work again", metadata: ["queue": "\(queue.queueName)"])
                lastError = nil
                errors = 0
            }
            if case .success(let report) = outcome {
                // A refused credential needs a person, as a storage error does. A flush that backed off or found
                // another flusher says nothing new; any other that ran clears the failure.
                switch report.stop {
                case .authentication(let message):
                    failures.withLockedValue { $0[queue.queueName] = "the server refuses the credentials: \(message)" }
                case .backoff, .busy: break
                default: failures.withLockedValue { $0[queue.queueName] = nil }
                }
                // A flush that backed off or found another flusher says nothing new about the server.
                let up: Bool?
                switch report.stop {
                case .transient, .authentication: up = false
                case .backoff, .busy: up = nil
                case nil, .limit: up = true
                }
                if let up, healthy != up {
                    // One line per state change, not one per item.
                    if up {
                        if healthy != nil { logger.notice("server is reachable again", metadata: ["queue": "\(queue.queueName)"]) }
                    } else {
                        logger.warning(
                            "delivery stopped; items stay queued",
                            metadata: ["queue": "\(queue.queueName)", "reason": "\(report.stop.map(\.description) ?? "-")"])
                    }
                    healthy = up
                }
            }
            if let retention = configuration.journalRetention, pruned.map({ $0.duration(to: .now) > .seconds(86_400) }) ?? true {
                pruned = .now
                await pruneJournal(queue, olderThan: retention)
            }
            guard !Task.isCancelled && !Task.isShuttingDownGracefully else { break }
            if case .success(let report) = outcome, let until = report.stop?.retryDate, until > Date() {
                // The server failed or is backed off: nothing goes before `until`, so an enqueue's wake-up is no
                // reason to try (a receiver taking thousands of items a second woke a flush for each few, each
                // taking the lock and reading the state to back off again). The poll interval still bounds the wait:
                // another instance may clear the backoff sooner.
                let poll = configuration.pollInterval.components
                let seconds = min(until.timeIntervalSinceNow, Double(poll.seconds) + Double(poll.attoseconds) / 1e18)
                await cancelWhenGracefulShutdown { try? await beatingSleep(queue, for: .milliseconds(Int64(seconds * 1000))) }
                continue
            }
            await withGracefulShutdownHandler {
                await queue.wakeUp.wait(timeout: min(configuration.pollInterval, configuration.watchdog?.interval ?? .seconds(86_400)))
            } onGracefulShutdown: {
                queue.wakeUp.signal()
            }
        }
        return nil
    }

    /// Sleeps `duration` in slices no longer than the watchdog's interval (5 s at most), beating between them.
    private func beatingSleep(_ queue: DataQueue, for duration: Duration) async throws {
        var left = duration
        while left > .zero {
            let slice = min(left, configuration.watchdog?.interval ?? .seconds(5), .seconds(5))
            try await Task.sleep(for: slice)
            beat(queue)
            left -= slice
        }
    }

    /// The daily journal retention: how many lines went is logged; a failure is logged and tried the next day.
    private func pruneJournal(_ queue: DataQueue, olderThan retention: Duration) async {
        let seconds = Double(retention.components.seconds) + Double(retention.components.attoseconds) / 1e18
        do {
            let removed = try await queue.pruneJournal(olderThan: seconds) { _ in beat(queue) }
            if removed > 0 { logger.notice("pruned the delivery journal", metadata: ["lines": "\(removed)"]) }
        } catch {
            logger.warning(
                "cannot prune the delivery journal", metadata: ["error": "\((error as? DataQueueError)?.message ?? "\(error)")"])
        }
    }

    /// One flush. On graceful shutdown or cancellation the flush is cancelled: it stops before its next item,
    /// once the request on the wire is answered. Graceful shutdown waits for that at most the drain timeout,
    /// cancellation not at all; a request left behind stays queued, and the next flush lets it settle first.
    private func flushDraining(_ queue: DataQueue) async -> Result<FlushReport, any Error>? {
        let progress: @Sendable (FlushReport.Progress) -> Void = { [self] _ in beat(queue) }
        // Each request and each long step of the flush beats too (see Heartbeat). The flush is an unstructured
        // task because graceful shutdown may leave it behind after the drain timeout (a request on the wire may
        // take the whole request timeout), which a child task cannot be: its group would wait for it.
        let flush = Heartbeat.$current.withValue(Heartbeat.Beat(call: { [self] in beat(queue) })) {
            Task { () -> Result<FlushReport, any Error> in
                do {
                    return .success(try await queue.flush(progress: progress))
                } catch {
                    return .failure(error)
                }
            }
        }
        let result = ResumeOnce<Result<FlushReport, any Error>?>()
        let drainTimeout = configuration.drainTimeout
        // Task-local graceful shutdown state is inherited: this returns when the group shuts down, and is
        // cancelled (so that no watcher outlives its flush) once the flush is over.
        let watcher = Task {
            let cancelled = (try? await gracefulShutdown()) == nil
            guard !cancelled else { return }
            flush.cancel()
            try? await Task.sleep(for: drainTimeout)
            result.resume(with: nil)
        }
        defer { watcher.cancel() }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { continuation in
                result.set(continuation)
                Task { result.resume(with: await flush.value) }
            }
        } onCancel: {
            flush.cancel()
            result.resume(with: nil)
        }
    }
}

/// A continuation resumed by whichever of several tasks comes first; later resumes are ignored.
private final class ResumeOnce<Value: Sendable>: Sendable {
    private let state = NIOLockedValueBox<(continuation: CheckedContinuation<Value, Never>?, early: Value??)>((nil, nil))

    func set(_ continuation: CheckedContinuation<Value, Never>) {
        let early = state.withLockedValue { state -> Value?? in
            if let early = state.early { return early }
            state.continuation = continuation
            return nil
        }
        if let early { continuation.resume(returning: early!) }
    }

    func resume(with value: Value) {
        let continuation = state.withLockedValue { state -> CheckedContinuation<Value, Never>? in
            if state.continuation == nil && state.early == nil {
                state.early = .some(value)
                return nil
            }
            defer { state.continuation = nil }
            return state.continuation
        }
        continuation?.resume(returning: value)
    }
}

extension DataQueueService: RedactedDescription {
    /// `DataQueueService(queue: http://host/fhir)`: the queues it delivers, by name. swift-service-lifecycle names
    /// a service by its description in its log lines: nothing a queue holds is shown.
    public var description: String {
        "DataQueueService(\(queues.count == 1 ? "queue" : "queues"): \(queues.map(\.queueName).joined(separator: ", ")))"
    }

    /// The queues' names and how the service polls and drains.
    package var redactedFields: [RedactedField] {
        [.plain("queues", queues.map(\.queueName)), .plain("configuration", configuration)]
    }
}
