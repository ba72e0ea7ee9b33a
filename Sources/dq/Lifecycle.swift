import FHIRDataQueue
import Foundation
import Logging
import NIOConcurrencyHelpers
import ServiceLifecycle
import Synchronization
import UnixSignals

#if canImport(Glibc)
    import Glibc
#endif

// The lifecycle of a long-running dq command (dq run; the coming dq serve): signals, systemd notifications and
// the reload on SIGHUP, each a swift-service-lifecycle Service or what its services share.

/// The configuration a SIGHUP loaded and checked, for the next round of `dq run`.
final class ReloadRequest: Sendable {
    private let next = NIOLockedValueBox<(DataQueue, DataQueueSettings, DaemonSettings)?>(nil)

    func set(_ queue: DataQueue, _ settings: DataQueueSettings, _ daemon: DaemonSettings) {
        next.withLockedValue { $0 = (queue, settings, daemon) }
    }
    func take() -> (DataQueue, DataQueueSettings, DaemonSettings)? {
        next.withLockedValue { next in
            defer { next = nil }; return next
        }
    }
    var requested: Bool { next.withLockedValue { $0 != nil } }
}

/// Re-reads the configuration (and its secret files) on SIGHUP. One that validates (its queue opens) is handed
/// to the next round and ends this one; one that does not is logged and the running one stays. What changed is
/// logged by name, never by value.
struct ReloadOnHangup: Service {
    let current: DataQueueSettings
    /// The running configuration's own `dq` settings (log, poll interval, …).
    let currentDaemon: DaemonSettings
    /// The running configuration's TLS files as they were when its round began (see ``DataQueueSettings/tlsFiles()``).
    let currentTLSFiles: [Int64]
    let options: QueueOptions
    let sending: SendingOptions
    let request: ReloadRequest
    let hangups: HangupSignals
    let shutdown: GroupShutdown
    let logger: Logger

    func run() async throws {
        if try await cancelWhenGracefulShutdown({ [self] in try await listen() }) {
            await shutdown.trigger()
            try? await gracefulShutdown()
        }
    }

    /// Whether a configuration was handed over (false once the group stops first).
    private func listen() async throws -> Bool {
        while await hangups.next() {
            do {
                let (settings, daemon) = try await DaemonSettings.load(options: options, sending: sending)
                _ = try settings.journalRetention()
                let queue = try await settings.makeQueue(readOnly: false, logger: logger)
                // A SIGTERM came while the queue opened (which does not stop for it): stop, do not start a round.
                if Task.isCancelled {
                    try? await queue.shutdown()
                    return false
                }
                // A key or certificate rotated at its path: the queue just made has new HTTP clients that read it.
                // The log and the metrics endpoint are set up once per process: they change at the next start.
                let once = ["log_level", "log_format", "metrics_address"]
                let changed =
                    (Self.changes(current, settings) + daemon.changes(since: currentDaemon)).map {
                        once.contains($0) ? $0 + " (at the next start)" : $0
                    }
                    + (settings.tlsFiles() != currentTLSFiles ? ["tls files"] : [])
                logger.notice(
                    "configuration reloaded; delivery restarts with it",
                    metadata: ["changed": "\(changed.isEmpty ? "nothing" : changed.joined(separator: ","))"])
                request.set(queue, settings, daemon)
                SystemdNotify.send("RELOADING=1")
                return true
            } catch is CancellationError {
                return false
            } catch {
                logger.error(
                    "reload refused; the running configuration stays",
                    metadata: ["error": "\((error as? DataQueueError)?.message ?? "\(error)")"])
            }
        }
        return false
    }

    /// The settings that differ, by name (`auth.client_secret`), never by value.
    static func changes(_ old: DataQueueSettings, _ new: DataQueueSettings) -> [String] {
        // Not by their mirrors: those show every secret as "<redacted>", so a rotated one would look unchanged.
        new.changes(since: old)
    }
}

extension ReloadOnHangup: RedactedDescription {
    /// The config file it reads again: swift-service-lifecycle names the service by its description in its log
    /// lines, and the settings it holds are not shown.
    package var redactedFields: [RedactedField] { [.plain("config", current.sourcePath ?? "none")] }
}

/// STOPPING=1 to systemd when graceful shutdown begins, for a group whose READY=1 is sent elsewhere (`dq serve`
/// says it once its listener is bound).
struct SystemdStopping: Service {
    func run() async throws {
        try? await gracefulShutdown()
        SystemdNotify.send("STOPPING=1")
    }
}

/// systemd's notification protocol (sd_notify), as the last service of the group: READY=1 once the group
/// runs (its signal handlers are in place), STOPPING=1 when graceful shutdown begins. One datagram to
/// `$NOTIFY_SOCKET` each; nothing when it is unset.
struct SystemdNotify: Service {
    let status: String
    /// A stop for a reload is not a stop: no STOPPING=1 then (the next round says READY=1), unless SIGTERM came.
    var reload: ReloadRequest? = nil
    var stops: StopSignals? = nil
    /// Set when this service starts: the group traps its signals by then.
    var started: GroupStarted? = nil

    func run() async throws {
        started?.set()
        Self.send("READY=1\nSTATUS=\(status)")
        try? await gracefulShutdown()
        // The reload service hands its configuration over before the group begins to stop.
        if reload?.requested != true || stops?.requested == true { Self.send("STOPPING=1") }
    }

    /// systemd's watchdog (`WatchdogSec=`), when `$WATCHDOG_USEC` is set for this process: `WATCHDOG=1` from
    /// the delivery loop at least every half of it.
    static func watchdog(environment: [String: String] = ProcessInfo.processInfo.environment) -> DataQueueService.Watchdog? {
        guard let text = environment["WATCHDOG_USEC"], let microseconds = Int64(text), microseconds > 0 else { return nil }
        if let pid = environment["WATCHDOG_PID"].flatMap(Int32.init), pid != getpid() { return nil }
        return DataQueueService.Watchdog(interval: .microseconds(microseconds / 2)) { send("WATCHDOG=1") }
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

/// The SIGHUPs `dq run` has received and no reload service has taken yet (several count as one: each asks for
/// the configuration to be read again).
final class HangupSignals: Sendable {
    private struct State {
        var pending = false
        var waiter: CheckedContinuation<Bool, Never>?
    }
    private let state = NIOLockedValueBox(State())

    /// A SIGHUP came: the waiting reload service takes it, else the next one that waits.
    func arrived() {
        let waiter = state.withLockedValue { state in
            guard let waiter = state.waiter else {
                state.pending = true
                return CheckedContinuation<Bool, Never>?.none
            }
            state.waiter = nil
            return waiter
        }
        waiter?.resume(returning: true)
    }

    /// Waits for a SIGHUP (true); false once the waiting task is cancelled.
    func next() async -> Bool {
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Bool, Never>) in
                let answer: Bool? = state.withLockedValue { state in
                    // Cancelled first: a service that is stopping takes no more SIGHUPs (one left pending is for the
                    // next round, if there is one). Checked under the lock that the cancellation handler takes: it
                    // either finds this waiter or ran before, and then the task is cancelled already.
                    if Task.isCancelled { return false }
                    if state.pending {
                        state.pending = false
                        return true
                    }
                    precondition(state.waiter == nil, "one reload service waits at a time")
                    state.waiter = continuation
                    return nil
                }
                if let answer { continuation.resume(returning: answer) }
            }
        } onCancel: {
            let waiter = state.withLockedValue { state in
                defer { state.waiter = nil }
                return state.waiter
            }
            waiter?.resume(returning: false)
        }
    }
}

/// SIGTERM and SIGINT for the whole of `dq run`: a round's ``StopOnSignal`` ends its group gracefully; between
/// rounds (the queue opening, a database awaited) the handler given to ``whenOutsideRounds(_:)`` runs.
final class StopSignals: Sendable {
    private struct State {
        var requested = false
        var inRound = false
        var waiter: CheckedContinuation<Void, Never>?
        var outsideRounds: (@Sendable () -> Void)?
    }
    private let state = NIOLockedValueBox(State())

    /// Whether a stop came.
    var requested: Bool { state.withLockedValue { $0.requested } }

    /// A SIGTERM or SIGINT came: the round's stop service ends its group, or, between rounds, the handler runs.
    func arrived() {
        let (waiter, handler) = state.withLockedValue { state in
            state.requested = true
            defer { state.waiter = nil }
            return (state.waiter, state.inRound ? nil : state.outsideRounds)
        }
        waiter?.resume()
        handler?()
    }

    /// What a stop between rounds does; run at once if one came already and no round runs.
    func whenOutsideRounds(_ handler: @escaping @Sendable () -> Void) {
        let now = state.withLockedValue { state in
            state.outsideRounds = handler
            return state.requested && !state.inRound
        }
        if now { handler() }
    }

    /// A round begins, unless a stop came (false).
    func beginRound() -> Bool {
        state.withLockedValue { state in
            guard !state.requested else { return false }
            state.inRound = true
            return true
        }
    }

    /// The round has ended; a stop from now on is handled outside rounds.
    func endRound() { state.withLockedValue { $0.inRound = false } }

    /// Waits for a stop (at once if one came); returns early once the waiting task is cancelled.
    func wait() async {
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let now = state.withLockedValue { state in
                    // Checked under the lock the cancellation handler takes (see HangupSignals.next()).
                    if state.requested || Task.isCancelled { return true }
                    precondition(state.waiter == nil, "one stop service waits at a time")
                    state.waiter = continuation
                    return false
                }
                if now { continuation.resume() }
            }
        } onCancel: {
            let waiter = state.withLockedValue { state in
                defer { state.waiter = nil }
                return state.waiter
            }
            waiter?.resume()
        }
    }
}

/// Ends its group gracefully when SIGTERM or SIGINT comes (at once if one came before the group started); ends
/// quietly when the group stops for another reason (a reload).
struct StopOnSignal: Service {
    let stops: StopSignals
    let shutdown: GroupShutdown

    func run() async throws {
        await cancelWhenGracefulShutdown { await stops.wait() }
        if stops.requested { await shutdown.trigger() }
        try? await gracefulShutdown()
    }
}

/// A round's service group, for the services that end it (a stop, a reload): they ask it to shut down gracefully
/// and return in their turn. Not by returning at once: a service that returns while the group stops the others
/// one by one, before its own turn, is taken for a failure, and the group cancels every service (the request on
/// the wire with them) and throws.
final class GroupShutdown: Sendable {
    private let group = NIOLockedValueBox<ServiceGroup?>(nil)

    func set(_ group: ServiceGroup) { self.group.withLockedValue { $0 = group } }

    func trigger() async {
        guard let group = group.withLockedValue({ $0 }) else { return }
        await group.triggerGracefulShutdown()
    }
}

/// Whether a service group has started its services (and so traps its shutdown signals).
final class GroupStarted: Sendable {
    private let flag = Atomic<Bool>(false)

    var isSet: Bool { flag.load(ordering: .acquiring) }

    func set() { flag.store(true, ordering: .releasing) }
}

extension SystemdNotify: RedactedDescription {
    /// The status it reports (`delivering to` and the queue's name).
    package var redactedFields: [RedactedField] { [.plain("status", status)] }
}

extension StopOnSignal: RedactedDescription {
    /// Nothing to show: it waits for SIGTERM or SIGINT.
    package var redactedFields: [RedactedField] { [] }
}
