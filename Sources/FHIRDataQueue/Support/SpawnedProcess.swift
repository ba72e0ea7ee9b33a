import CSpawn
import Foundation
import Synchronization

/// A child process started with `posix_spawn`, and reaped by a thread of its own when it ends.
///
/// Not Foundation's `Process`: on Linux (swift-corelibs-foundation 6.3) its `run()` finds the highest open
/// descriptor by copying each `/proc/self/fd` entry's whole 256-byte name field, which reads past a short entry
/// and, at the last entry, past the end of the directory's buffer (AddressSanitizer reports it on every run of
/// the test suite). Where that buffer ends at an unmapped page the process dies of SIGSEGV: the test suite did,
/// once, in CI. The upstream fix (swiftlang/swift-corelibs-foundation#5472) is in no release yet.
///
/// The child gets the three standard streams asked for and no other descriptor of this process, default signal
/// dispositions and an empty signal mask (a parent's ignored SIGPIPE or SIGHUP is not passed on).
package final class SpawnedProcess: Sendable {
    /// Where one of the child's standard streams goes.
    package enum Stream: Sendable {
        /// This process's own.
        case inherit
        /// `/dev/null`.
        case null
        /// A descriptor of this process, which stays the caller's to close.
        case descriptor(Int32)
    }

    /// The process could not be started.
    package struct SpawnError: Error, CustomStringConvertible {
        /// The program that was to run.
        package let executable: String
        /// Why not, as `errno`.
        package let code: Int32
        package var description: String { "cannot run \(executable): \(String(cString: strerror(code)))" }
    }

    /// How the process ended.
    package enum Ending: Sendable, Equatable {
        /// It exited with this status.
        case exited(Int32)
        /// A signal ended it.
        case signalled(Int32)
        /// It ended, but how is not known: its status was taken by another waiter (`errno` of `waitpid`).
        case unknown(Int32)

        /// The exit status, or the signal's number (as Foundation's `terminationStatus`); -1 when unknown.
        package var status: Int32 {
            switch self {
            case .exited(let status), .signalled(let status): status
            case .unknown: -1
            }
        }
    }

    private struct State {
        var ending: Ending?
        var waiters: [CheckedContinuation<Ending, Never>] = []
    }

    /// The state, shared with the reaper thread.
    private final class Shared: Sendable {
        let state = Mutex(State())
    }

    /// The child's process ID.
    package let pid: pid_t
    private let shared = Shared()

    /// Starts `executable` (a path; `PATH` is not searched) with `arguments`.
    ///
    /// - Parameters:
    ///   - environment: the child's whole environment; `nil` passes this process's on.
    ///   - directory: the child's working directory; `nil` keeps this process's.
    package init(
        _ executable: String, _ arguments: [String], environment: [String: String]? = nil, directory: String? = nil,
        stdin: Stream = .null, stdout: Stream = .inherit, stderr: Stream = .inherit
    ) throws(SpawnError) {
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        var attributes = posix_spawnattr_t()
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }

        var opened: [Int32] = []
        defer { for fd in opened { close(fd) } }
        for (stream, target) in [(stdin, Int32(0)), (stdout, 1), (stderr, 2)] {
            switch stream {
            case .inherit:
                continue
            case .null:
                // Above the standard streams: where this process has closed one of them, open(2) would return
                // that number, and a later stream's dup2 could overwrite it.
                let first = open("/dev/null", (target == 0 ? O_RDONLY : O_WRONLY) | O_CLOEXEC)
                guard first >= 0 else { throw SpawnError(executable: executable, code: errno) }
                let fd = first > 2 ? first : fcntl(first, F_DUPFD_CLOEXEC, 3)
                let failure = errno
                if fd != first { close(first) }
                guard fd >= 0 else { throw SpawnError(executable: executable, code: failure) }
                opened.append(fd)
                posix_spawn_file_actions_adddup2(&actions, fd, target)
            case .descriptor(let fd):
                posix_spawn_file_actions_adddup2(&actions, fd, target)
            }
        }
        cspawn_file_actions_addclosefrom(&actions, 3)
        if let directory { cspawn_file_actions_addchdir(&actions, directory) }

        var signals = sigset_t()
        sigfillset(&signals)
        posix_spawnattr_setsigdefault(&attributes, &signals)
        sigemptyset(&signals)
        posix_spawnattr_setsigmask(&attributes, &signals)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK))

        let argv = ([executable] + arguments).map { strdup($0) } + [nil]
        defer { for pointer in argv { free(pointer) } }
        let envp = environment.map { $0.map { strdup("\($0.key)=\($0.value)") } + [nil] }
        defer { for pointer in envp ?? [] { free(pointer) } }

        var child: pid_t = 0
        let result =
            if let envp {
                posix_spawn(&child, executable, &actions, &attributes, argv, envp)
            } else {
                posix_spawn(&child, executable, &actions, &attributes, argv, environ)
            }
        guard result == 0 else { throw SpawnError(executable: executable, code: result) }
        pid = child

        // The reaper waits without reaping (WNOWAIT), records the end, and only then reaps: while the ending
        // is unrecorded the pid is still this child's, so `signal(_:)` never reaches a process that reused it.
        let thread = Thread { [shared, child] in
            var info = siginfo_t()
            while waitid(P_PID, id_t(child), &info, WEXITED | WNOWAIT) == -1 && errno == EINTR {}
            let (ending, waiters) = shared.state.withLock { state in
                var status: Int32 = 0
                var reaped: pid_t
                repeat { reaped = waitpid(child, &status, 0) } while reaped == -1 && errno == EINTR
                let signal = status & 0x7f
                let ending: Ending =
                    reaped != child ? .unknown(errno) : signal == 0 ? .exited((status >> 8) & 0xff) : .signalled(signal)
                state.ending = ending
                defer { state.waiters = [] }
                return (ending, state.waiters)
            }
            for waiter in waiters { waiter.resume(returning: ending) }
        }
        thread.name = "dq-child-reaper"
        thread.start()
    }

    /// A pipe for a child's standard input or output, both ends closed on exec (a child gets an end only as one
    /// of its standard streams): `(read, write)`, for the caller to close.
    package static func pipe() throws(SpawnError) -> (read: Int32, write: Int32) {
        var ends: [Int32] = [-1, -1]
        guard Glibc.pipe(&ends) == 0 else { throw SpawnError(executable: "pipe", code: errno) }
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        return (ends[0], ends[1])
    }

    /// How the process ended; `nil` while it runs.
    package var ending: Ending? { shared.state.withLock { $0.ending } }

    /// Whether the process still runs (or has ended and is not reaped yet).
    package var isRunning: Bool { ending == nil }

    /// Sends `signal` unless the process has ended: its pid may belong to another process by then.
    package func signal(_ signal: Int32) {
        shared.state.withLock { state in
            if state.ending == nil { _ = kill(pid, signal) }
        }
    }

    /// Waits for the end without holding a thread (the reaper resumes the wait).
    package func wait() async -> Ending {
        await withCheckedContinuation { continuation in
            let ended: Ending? = shared.state.withLock { state in
                if state.ending == nil { state.waiters.append(continuation) }
                return state.ending
            }
            if let ended { continuation.resume(returning: ended) }
        }
    }
}
