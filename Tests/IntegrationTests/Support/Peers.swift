import AsyncHTTPClient
import DQTestSupport
import FHIRDataQueue
import Foundation
import NIOCore
import NIOFoundationCompat
import Synchronization
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Where the project and its test peers are.
enum Peers {
    static let packageRoot: URL = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    static var environment: [String: String] { ProcessInfo.processInfo.environment }

    static var venv: String {
        environment["DQ_PEERS_VENV"] ?? packageRoot.appendingPathComponent(".peers/venv").path
    }

    /// Whether the peers are installed (`scripts/peers.sh install`).
    static var installed: Bool { FileManager.default.isExecutableFile(atPath: venv + "/bin/sekmet") }

    /// `make test` sets DQ_REQUIRE_PEERS=1: then a missing peer fails the tests instead of skipping them.
    static var required: Bool { environment["DQ_REQUIRE_PEERS"] == "1" }

    /// Integration tests run when the peers are installed or required.
    static var enabled: Bool {
        if !installed && !required {
            print("IntegrationTests skipped: run `make test` (or scripts/peers.sh install) to install the real FHIR server")
        }
        return installed || required
    }

    static var dqBinary: String {
        environment["DQ_BIN"] ?? packageRoot.appendingPathComponent(".build/debug/dq").path
    }

    /// Whether something accepts TCP connections on 127.0.0.1:`port`.
    static func isListening(port: Int) -> Bool {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        let length = socklen_t(MemoryLayout<sockaddr_in>.size)
        return withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, length) }
        } == 0
    }

    /// The next port to try: below the kernel's ephemeral range (32768-60999 on Linux), so that neither an
    /// outgoing connection nor another `bind(0)` gets it, and rising, so that no port is handed to two servers
    /// of this test run (a port that was free when asked and taken by a parallel test's server before its own
    /// server bound it made a test talk to another test's server, which then went away).
    private static let nextPort = Mutex(20_000 + Int(getpid() % 4000) * 2)

    /// A loopback port that is free now and that no other call in this test run returns.
    static func freePort() -> Int {
        while true {
            let port = nextPort.withLock { next in
                defer { next = next >= 32_000 ? 20_000 : next + 1 }
                return next
            }
            if canBind(port) { return port }
        }
    }

    private static func canBind(_ port: Int) -> Bool {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = UInt16(port).bigEndian
        let length = socklen_t(MemoryLayout<sockaddr_in>.size)
        return withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) }
        } == 0
    }
}

/// A temporary directory removed when the test ends.
final class TemporaryDirectory: @unchecked Sendable {
    let url: URL
    var path: String { url.path }

    init() throws {
        url = FileManager.default.temporaryDirectory.appendingPathComponent("dq-test-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
    }

    func file(_ name: String) -> String { url.appendingPathComponent(name).path }

    func write(_ name: String, _ text: String) throws -> String {
        let path = file(name)
        try Data(text.utf8).write(to: URL(fileURLWithPath: path))
        return path
    }

    deinit { try? FileManager.default.removeItem(at: url) }
}

/// The result of running a process.
struct ProcessResult: Sendable {
    var status: Int32
    var stdout: String
    var stderr: String
}

/// A child process with its output in files (``BackgroundProcess``, not Foundation's `Process`: see there why).
final class ChildProcess: Sendable {
    let child: BackgroundProcess
    let executable: String
    let arguments: [String]
    let stdoutPath: String
    let stderrPath: String
    /// With `keepStdinOpen`: the write end of the process's standard input, until ``closeStdin()``.
    private let stdinWriter: Mutex<Int32?>

    init(
        _ executable: String, _ arguments: [String], environment: [String: String] = [:], stdin: Data? = nil,
        directory: String? = nil, keepStdinOpen: Bool = false
    ) throws {
        self.executable = executable
        self.arguments = arguments
        let outputs = FileManager.default.temporaryDirectory.appendingPathComponent("dq-proc-\(UUID().uuidString)")
        stdoutPath = outputs.path + ".out"
        stderrPath = outputs.path + ".err"
        var env = ProcessInfo.processInfo.environment
        for key in env.keys where key.hasPrefix("DQ_") && key != "DQ_BIN" { env[key] = nil }
        env.merge(environment) { $1 }
        var opened: [Int32] = []
        defer { for fd in opened { close(fd) } }
        func create(_ path: String, _ flags: Int32) throws -> Int32 {
            let fd = open(path, flags | O_CLOEXEC, 0o600)
            guard fd >= 0 else { throw POSIXError(POSIXErrorCode(rawValue: errno) ?? .EIO) }
            opened.append(fd)
            return fd
        }
        let out = try create(stdoutPath, O_WRONLY | O_CREAT | O_TRUNC)
        let err = try create(stderrPath, O_WRONLY | O_CREAT | O_TRUNC)
        var input = BackgroundProcess.Stream.null
        var writer: Int32?
        if keepStdinOpen {
            let ends = try BackgroundProcess.pipe()
            opened.append(ends.read)
            writer = ends.write
            input = .descriptor(ends.read)
        } else if let stdin {
            // From a file, not a pipe: nothing blocks on a child that reads slowly or not at all.
            let path = outputs.path + ".in"
            let fd = try create(path, O_RDWR | O_CREAT | O_EXCL)
            unlink(path)
            guard stdin.withUnsafeBytes({ pwrite(fd, $0.baseAddress, $0.count, 0) }) == stdin.count else {
                throw POSIXError(.EIO)
            }
            input = .descriptor(fd)
        }
        stdinWriter = Mutex(writer)
        do {
            child = try BackgroundProcess(
                executable, arguments, environment: env, directory: directory, stdin: input, stdout: .descriptor(out),
                stderr: .descriptor(err))
        } catch {
            if let writer { close(writer) }
            throw error
        }
    }

    /// The output files go with the process (a test that killed it without waiting leaves none in /tmp).
    deinit {
        closeStdin()
        try? FileManager.default.removeItem(atPath: stdoutPath)
        try? FileManager.default.removeItem(atPath: stderrPath)
    }

    /// The process ID, once it has started; `nil` when it could not be started.
    var pid: Int32? { get async { await child.pid } }

    /// Whether the process still starts or runs.
    var isRunning: Bool { child.isRunning }

    /// What the process wrote to standard output so far.
    var outputSoFar: String { (try? String(contentsOfFile: stdoutPath, encoding: .utf8)) ?? "" }

    /// With `keepStdinOpen`: writes `data` to the process's standard input.
    /// A process that has ended takes nothing: the write stops, and the SIGPIPE it raises is taken here rather than
    /// ending the test process (SIGPIPE is blocked on this thread for the write, and a pending one consumed).
    func writeStdin(_ data: Data) {
        stdinWriter.withLock { fd in
            guard let fd else { return }
            var pipeSignal = sigset_t()
            sigemptyset(&pipeSignal)
            sigaddset(&pipeSignal, SIGPIPE)
            var previous = sigset_t()
            pthread_sigmask(SIG_BLOCK, &pipeSignal, &previous)
            defer { pthread_sigmask(SIG_SETMASK, &previous, nil) }
            data.withUnsafeBytes { bytes in
                var offset = 0
                while offset < bytes.count {
                    let written = write(fd, bytes.baseAddress! + offset, bytes.count - offset)
                    if written < 0 && errno == EINTR { continue }
                    if written < 0 && errno == EPIPE {
                        var now = timespec()
                        while sigtimedwait(&pipeSignal, nil, &now) == -1 && errno == EINTR {}
                    }
                    if written <= 0 { return }
                    offset += written
                }
            }
        }
    }

    /// With `keepStdinOpen`: ends the process's standard input.
    func closeStdin() {
        stdinWriter.withLock { fd in
            if let open = fd { close(open) }
            fd = nil
        }
    }

    /// Sends `signal` while the process runs. Once it has ended its pid may belong to another process already
    /// (another test's `dq run`, under a parallel suite): that one is never signalled.
    func kill(_ signal: Int32 = SIGKILL) { child.signal(signal) }

    /// Kills the process (SIGKILL); the task that started it collects it. For a peer's deinit, which cannot await.
    func killInBackground() { kill(SIGKILL) }

    /// Kills the process if it still runs (a peer that never became ready) and returns its output.
    func stop() async -> ProcessResult {
        kill(SIGKILL)
        return await wait()
    }

    /// Waits without blocking a thread of the cooperative pool. A process still running after `timeout` is a
    /// test failure: it is killed (SIGKILL) and its output returned.
    func wait(timeout: Duration = .seconds(300)) async -> ProcessResult {
        let watchdog = Task { [child, executable, arguments] in
            try await Task.sleep(for: timeout)
            Issue.record("\(executable) \(arguments) still ran after \(timeout): killed")
            child.signal(SIGKILL)
        }
        let ending = await child.wait()
        watchdog.cancel()
        let out = (try? String(contentsOfFile: stdoutPath, encoding: .utf8)) ?? ""
        var err = (try? String(contentsOfFile: stderrPath, encoding: .utf8)) ?? ""
        if case .failed(let reason) = ending { err += "\(executable) did not run: \(reason)\n" }
        try? FileManager.default.removeItem(atPath: stdoutPath)
        try? FileManager.default.removeItem(atPath: stderrPath)
        return ProcessResult(status: ending.status, stdout: out, stderr: err)
    }
}

/// Runs `dq` with the given arguments and environment.
func dq(_ arguments: [String], _ environment: [String: String], stdin: Data? = nil, directory: String? = nil) async throws
    -> ProcessResult
{
    try await ChildProcess(Peers.dqBinary, arguments, environment: environment, stdin: stdin, directory: directory).wait()
}

/// Simple HTTP calls for assertions.
enum HTTP {
    /// A GET; retried once when the connection fails (a server may close a pooled keep-alive connection just
    /// as it is reused: "I/O on closed channel", "remote connection closed", or, when it closes with data unread,
    /// "connection reset by peer"), since a GET changes nothing.
    static func get(_ url: String, token: String? = nil) async throws -> (Int, Data) {
        var request = HTTPClientRequest(url: url)
        if let token { request.headers.add(name: "Authorization", value: "Bearer \(token)") }
        for attempt in 1...2 {
            do {
                let response = try await HTTPClient.shared.execute(request, timeout: .seconds(30))
                let body = try await response.body.collect(upTo: 64 << 20)
                return (Int(response.status.code), Data(buffer: body))
            } catch let error as ChannelError where attempt == 1 && error == .ioOnClosedChannel {
                continue
            } catch let error as HTTPClientError where attempt == 1 && error == .remoteConnectionClosed {
                continue
            } catch let error as IOError where attempt == 1 && error.errnoCode == ECONNRESET {
                continue
            }
        }
        throw ChannelError.ioOnClosedChannel
    }

    static func post(_ url: String, json: Data) async throws -> (Int, Data) {
        var request = HTTPClientRequest(url: url)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        request.body = .bytes(ByteBuffer(data: json))
        let response = try await HTTPClient.shared.execute(request, timeout: .seconds(30))
        let body = try await response.body.collect(upTo: 64 << 20)
        return (Int(response.status.code), Data(buffer: body))
    }

    static func json(_ url: String, token: String? = nil) async throws -> [String: Any] {
        let (status, data) = try await get(url, token: token)
        guard status == 200, let object = try JSONSerialization.jsonObject(with: data) as? [String: Any] else {
            throw TestFailure("GET \(url) answered \(status)")
        }
        return object
    }
}

struct TestFailure: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}

/// Polls `condition` until it holds or `timeout` passes; it is looked at once more after the deadline, so that a
/// sleep that overran it on a busy machine does not count as the condition's failure.
func eventually(timeout: Duration = .seconds(30), _ condition: () async throws -> Bool) async throws -> Bool {
    let deadline = ContinuousClock.now + timeout
    while ContinuousClock.now < deadline {
        if try await condition() { return true }
        try await Task.sleep(for: .milliseconds(50))
    }
    return try await condition()
}

/// Whether the `dq run` serving metrics on `port` has its service group running: its `/readyz` no longer says it
/// is starting. A test that means its SIGTERM to stop a running round (not a dq run still opening its queue,
/// which a SIGTERM stops before delivery begins) waits for this first.
func serviceGroupRuns(metricsPort port: Int) async throws -> Bool {
    try await eventually {
        guard let (_, body) = try? await HTTP.get("http://127.0.0.1:\(port)/readyz") else { return false }
        return !String(decoding: body, as: UTF8.self).contains("starting")
    }
}
