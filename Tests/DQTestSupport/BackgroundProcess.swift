import Foundation
import NIOConcurrencyHelpers
import Subprocess

#if canImport(System)
    import System
#else
    import SystemPackage
#endif

#if canImport(Glibc)
    import Glibc
#endif

/// A child process that a test starts and that runs on its own until it ends: a `dq run`, a server, a tool the test
/// waits for later.
///
/// swift-subprocess binds a process's lifetime to a closure (`run(...) { execution in ... }`), and the `Execution`
/// must not leave it. A test often needs a process that outlives the call that started it: started in one place,
/// signalled from another, awaited at the end. This runs one `run` in a task of its own, and carries each
/// ``signal(_:)`` into its closure, where the process is still the one started: it is not reaped before the closure
/// returns, and on Linux the signal goes through its pidfd. Once the process has ended a signal reaches nobody, so
/// a pid that another process (another test's `dq run`) has taken since is never signalled.
///
/// The child gets the three standard streams asked for and no other descriptor of this process, default signal
/// dispositions and an empty signal mask: swift-subprocess resets both, so neither a parent's ignored SIGPIPE or
/// SIGHUP nor the signals that a thread of the cooperative pool blocks are passed on.
///
/// Not Foundation's `Process`: on Linux (swift-corelibs-foundation 6.3) its `run()` finds the highest open
/// descriptor by copying each `/proc/self/fd` entry's whole 256-byte name field, which reads past a short entry and,
/// at the last entry, past the end of the directory's buffer (AddressSanitizer reported it on every run of the test
/// suite, and the suite once died of SIGSEGV in CI). The upstream fix (swiftlang/swift-corelibs-foundation#5472) is
/// in no release yet.
///
/// ```swift
/// let server = try BackgroundProcess("/usr/bin/openssl", ["s_server", "-accept", "4433"], stdout: .null)
/// // ... the test talks to it ...
/// server.signal(SIGTERM)
/// #expect(await server.wait() == .signalled(SIGTERM))
/// ```
public final class BackgroundProcess: Sendable {
    /// Where one of the child's standard streams goes.
    public enum Stream: Sendable {
        /// This process's own.
        case inherit
        /// `/dev/null`.
        case null
        /// A descriptor of this process, which stays the caller's to close (the child gets a copy, so the caller
        /// may close it as soon as `init` returns).
        case descriptor(Int32)
    }

    /// The process could not be started.
    public struct StartError: Error, CustomStringConvertible {
        /// The program that was to run (or the file that could not be opened for it).
        public let executable: String
        /// Why not, as `errno`.
        public let code: Int32

        public init(executable: String, code: Int32) {
            self.executable = executable
            self.code = code
        }

        public var description: String { "cannot run \(executable): \(String(cString: strerror(code)))" }
    }

    /// How the process ended.
    public enum Ending: Sendable, Equatable {
        /// It exited with this status.
        case exited(Int32)
        /// A signal ended it.
        case signalled(Int32)
        /// swift-subprocess could not start it, or lost track of it; its error, described.
        case failed(String)

        /// The exit status, or the signal's number (as Foundation's `terminationStatus`); -1 when it failed.
        public var status: Int32 {
            switch self {
            case .exited(let status), .signalled(let status): status
            case .failed: -1
            }
        }
    }

    private struct State {
        /// Set when the process has started; `nil` before and when it could not be.
        var pid: pid_t?
        var started = false
        var ending: Ending?
        var startWaiters: [CheckedContinuation<pid_t?, Never>] = []
        var endWaiters: [CheckedContinuation<Ending, Never>] = []
    }

    private let state = NIOLockedValueBox(State())
    /// Signals asked for, in order, until the process has ended; the closure of `run` sends them.
    private let signals: AsyncStream<Int32>.Continuation

    /// Starts `executable` (a path; `PATH` is not searched) with `arguments`.
    ///
    /// Returns at once: the process starts in a task of its own. What makes a start fail in practice (no such
    /// program, not executable, no such directory) is checked here and thrown; anything else that stops
    /// swift-subprocess from starting it is the ending ``Ending/failed(_:)``.
    ///
    /// - Parameters:
    ///   - environment: the child's whole environment; `nil` passes this process's on.
    ///   - directory: the child's working directory; `nil` keeps this process's.
    ///   - stdin: the child's standard input. The default is `/dev/null`.
    ///   - stdout: the child's standard output. The default is this process's.
    ///   - stderr: the child's standard error. The default is this process's.
    /// - Throws: ``StartError`` when the program or the directory is not there, or a stream cannot be opened.
    public init(
        _ executable: String, _ arguments: [String], environment: [String: String]? = nil, directory: String? = nil,
        stdin: Stream = .null, stdout: Stream = .inherit, stderr: Stream = .inherit
    ) throws(StartError) {
        try Self.checkRunnable(executable, directory: directory)
        var copies: [Int32] = []
        do {
            for (stream, standard) in [(stdin, Int32(0)), (stdout, 1), (stderr, 2)] {
                copies.append(try Self.childEnd(of: stream, standard: standard))
            }
        } catch {
            for fd in copies where fd > 2 { close(fd) }
            throw error
        }
        let (stream, signals) = AsyncStream.makeStream(of: Int32.self)
        self.signals = signals
        let configuration = Configuration(
            executable: .path(FilePath(executable)), arguments: Arguments(arguments),
            environment: environment.map { variables in
                .custom(Dictionary(uniqueKeysWithValues: variables.map { (Environment.Key(stringLiteral: $0.key), $0.value) }))
            } ?? .inherit,
            workingDirectory: directory.map { FilePath($0) })
        // A standard stream of this process (`.inherit`) is only lent; the copies are the child's, closed once it has them.
        func handOver(_ fd: Int32) -> (FileDescriptor, Bool) { (FileDescriptor(rawValue: fd), fd > 2) }
        let (input, output, error) = (handOver(copies[0]), handOver(copies[1]), handOver(copies[2]))
        Task {
            let ending: Ending
            do {
                let result = try await Subprocess.run(
                    configuration, input: .fileDescriptor(input.0, closeAfterSpawningProcess: input.1),
                    output: .fileDescriptor(output.0, closeAfterSpawningProcess: output.1),
                    error: .fileDescriptor(error.0, closeAfterSpawningProcess: error.1)
                ) { execution in
                    await self.supervise(execution, signals: stream)
                }
                switch result.terminationStatus {
                case .exited(let status): ending = .exited(status)
                case .signaled(let signal): ending = .signalled(signal)
                }
            } catch {
                ending = .failed("\(error)")
            }
            self.end(ending)
        }
    }

    /// Runs while the process does, inside `run`'s closure: sends the signals asked for, and returns once the
    /// process has ended (not yet reaped: swift-subprocess reaps it after this returns, so until then its pid is
    /// still its own).
    private func supervise(
        _ execution: Execution<FileDescriptorInput, FileDescriptorOutput, FileDescriptorOutput>, signals: AsyncStream<Int32>
    ) async {
        let pid = execution.processIdentifier.value
        start(pid)
        async let ended: Void = endOfSignals(at: pid)
        for await signal in signals {
            try? execution.send(signal: Signal(rawValue: signal))
        }
        await ended
    }

    /// Ends the signals asked for once the child `pid` has ended: a signal asked for later reaches nobody.
    private func endOfSignals(at pid: pid_t) async {
        await Self.exit(of: pid)
        signals.finish()
    }

    /// Waits until `pid`, a child of this process, has ended, without reaping it (`WNOWAIT`): swift-subprocess
    /// reaps it and reports how it ended. On a thread of its own, which `waitid` blocks, not one of the pool's.
    private static func exit(of pid: pid_t) async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let thread = Thread {
                var info = siginfo_t()
                while waitid(P_PID, id_t(pid), &info, WEXITED | WNOWAIT) == -1 && errno == EINTR {}
                continuation.resume()
            }
            thread.name = "dq-child-watch"
            thread.start()
        }
    }

    private func start(_ pid: pid_t) {
        let waiters = state.withLockedValue { state in
            state.pid = pid
            state.started = true
            defer { state.startWaiters = [] }
            return state.startWaiters
        }
        for waiter in waiters { waiter.resume(returning: pid) }
    }

    private func end(_ ending: Ending) {
        signals.finish()
        let (startWaiters, endWaiters) = state.withLockedValue { state in
            state.started = true
            state.ending = ending
            defer { (state.startWaiters, state.endWaiters) = ([], []) }
            return (state.startWaiters, state.endWaiters)
        }
        for waiter in startWaiters { waiter.resume(returning: nil) }
        for waiter in endWaiters { waiter.resume(returning: ending) }
    }

    /// What makes a start fail in practice, said before the process is started in the background.
    private static func checkRunnable(_ executable: String, directory: String?) throws(StartError) {
        var info = stat()
        guard stat(executable, &info) == 0 else { throw StartError(executable: executable, code: errno) }
        guard info.st_mode & S_IFMT != S_IFDIR else { throw StartError(executable: executable, code: EISDIR) }
        guard access(executable, X_OK) == 0 else { throw StartError(executable: executable, code: errno) }
        if let directory {
            guard stat(directory, &info) == 0 else { throw StartError(executable: directory, code: errno) }
            guard info.st_mode & S_IFMT == S_IFDIR else { throw StartError(executable: directory, code: ENOTDIR) }
        }
    }

    /// The descriptor the child gets as its standard stream `standard`: this process's own (`.inherit`), or a copy
    /// of its own, numbered above 2 (were it 0, 1 or 2, where this process has closed one of them, binding an
    /// earlier stream could overwrite it before it is bound).
    private static func childEnd(of stream: Stream, standard: Int32) throws(StartError) -> Int32 {
        switch stream {
        case .inherit:
            return standard
        case .null:
            let null = open("/dev/null", (standard == 0 ? O_RDONLY : O_WRONLY) | O_CLOEXEC)
            guard null >= 0 else { throw StartError(executable: "/dev/null", code: errno) }
            defer { close(null) }
            return try duplicate(null, name: "/dev/null")
        case .descriptor(let fd):
            return try duplicate(fd, name: "descriptor \(fd)")
        }
    }

    private static func duplicate(_ fd: Int32, name: String) throws(StartError) -> Int32 {
        let copy = fcntl(fd, F_DUPFD_CLOEXEC, 3)
        guard copy >= 0 else { throw StartError(executable: name, code: errno) }
        return copy
    }

    /// A pipe for a child's standard input or output, both ends closed on exec (a child gets an end only as one
    /// of its standard streams): `(read, write)`, for the caller to close.
    public static func pipe() throws(StartError) -> (read: Int32, write: Int32) {
        var ends: [Int32] = [-1, -1]
        guard Glibc.pipe(&ends) == 0 else { throw StartError(executable: "pipe", code: errno) }
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        return (ends[0], ends[1])
    }

    /// The child's process ID once it has started; `nil` when it could not be started. Waits for the start.
    public var pid: pid_t? {
        get async {
            await withCheckedContinuation { continuation in
                let known: pid_t?? = state.withLockedValue { state in
                    if !state.started { state.startWaiters.append(continuation) }
                    return state.started ? .some(state.pid) : .none
                }
                if let known { continuation.resume(returning: known) }
            }
        }
    }

    /// How the process ended; `nil` while it starts or runs.
    public var ending: Ending? { state.withLockedValue { $0.ending } }

    /// Whether the process still starts or runs (or has ended and is not reaped yet).
    public var isRunning: Bool { ending == nil }

    /// Sends `signal` unless the process has ended; a signal sent while it starts is sent once it has.
    public func signal(_ signal: Int32) {
        signals.yield(signal)
    }

    /// Waits for the end without holding a thread of the cooperative pool.
    public func wait() async -> Ending {
        await withCheckedContinuation { continuation in
            let ended: Ending? = state.withLockedValue { state in
                if state.ending == nil { state.endWaiters.append(continuation) }
                return state.ending
            }
            if let ended { continuation.resume(returning: ended) }
        }
    }
}
