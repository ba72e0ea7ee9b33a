import Foundation
import Testing

@testable import FHIRDataQueue

/// ``SpawnedProcess``: what a child gets (streams, directory, environment, no other descriptor, default signals)
/// and how its end is told.
@Suite("Spawned processes")
struct SpawnedProcessTests {
    /// Runs `script` with `/bin/sh`; its standard output and ending.
    func shell(
        _ script: String, environment: [String: String]? = nil, directory: String? = nil, stdin: SpawnedProcess.Stream = .null
    ) async throws -> (String, SpawnedProcess.Ending) {
        let scratch = try Scratch("dq-spawn")
        let path = scratch.url.appendingPathComponent("out").path
        let fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0o600)
        try #require(fd >= 0)
        defer { close(fd) }
        let child = try SpawnedProcess(
            "/bin/sh", ["-c", script], environment: environment, directory: directory, stdin: stdin, stdout: .descriptor(fd))
        let ending = await child.wait()
        #expect(!child.isRunning)
        return (try String(contentsOfFile: path, encoding: .utf8), ending)
    }

    @Test("The exit status, the standard input given, the working directory and the environment asked for")
    func streamsDirectoryEnvironment() async throws {
        #expect(try await shell("exit 3").1 == .exited(3))
        #expect(try await shell("exit 0").1 == .exited(0))

        let scratch = try Scratch("dq-spawn-in")
        let input = scratch.url.appendingPathComponent("in").path
        try Data("from the file\n".utf8).write(to: URL(fileURLWithPath: input))
        let fd = open(input, O_RDONLY | O_CLOEXEC)
        defer { close(fd) }
        #expect(try await shell("cat", stdin: .descriptor(fd)).0 == "from the file\n")
        #expect(try await shell("cat").0 == "", "no input is /dev/null")

        let (directory, _) = try await shell("pwd -P", directory: scratch.url.path)
        #expect(directory == URL(fileURLWithPath: scratch.url.path).resolvingSymlinksInPath().path + "\n")

        let (environment, _) = try await shell("env", environment: ["DQ_SPAWN_ONLY": "yes", "PATH": "/usr/bin:/bin"])
        #expect(
            Set(environment.split(separator: "\n").filter { !$0.hasPrefix("PWD=") && !$0.hasPrefix("SHLVL=") && !$0.hasPrefix("_=") }) == [
                "DQ_SPAWN_ONLY=yes", "PATH=/usr/bin:/bin",
            ])
    }

    @Test("A descriptor of this process that does not close on exec is not the child's; nor is an ignored signal")
    func nothingElseInherited() async throws {
        let scratch = try Scratch("dq-spawn-fd")
        let fd = open(scratch.url.appendingPathComponent("open").path, O_WRONLY | O_CREAT, 0o600)  // no O_CLOEXEC
        try #require(fd > 2)
        defer { close(fd) }
        let (fds, _) = try await shell("if [ -e /proc/self/fd/\(fd) ]; then echo inherited; else echo closed; fi")
        #expect(fds == "closed\n")

        // SIGPIPE ignored here (as a server does) is the default again in the child.
        let before = signal(SIGPIPE, SIG_IGN)
        defer { signal(SIGPIPE, before) }
        let (status, _) = try await shell("grep SigIgn /proc/self/status")
        let ignored = try #require(UInt64(status.dropFirst("SigIgn:\t".count).prefix(16), radix: 16), "\(status)")
        // Signals 1 to 31. glibc keeps 32 and 33 for itself: posix_spawn cannot reset them, nor can any program.
        #expect(ignored & 0x7fff_ffff == 0, "\(status)")
        #expect(ignored & (1 << (UInt64(SIGPIPE) - 1)) == 0)
    }

    @Test("A child ended by a signal says which; a signal after the end reaches nobody")
    func signals() async throws {
        #expect(try await shell("kill -TERM $$").1 == .signalled(SIGTERM))
        let sleeper = try SpawnedProcess("/bin/sleep", ["60"])
        #expect(sleeper.isRunning)
        sleeper.signal(SIGKILL)
        #expect(await sleeper.wait() == .signalled(SIGKILL))
        #expect(sleeper.ending?.status == SIGKILL)
        sleeper.signal(SIGKILL)  // reaped: its pid is not signalled again
        #expect(await sleeper.wait() == .signalled(SIGKILL), "a second wait returns the same end")
    }

    @Test("A program that cannot run is an error naming it, and nothing is started")
    func missingProgram() {
        #expect(throws: SpawnedProcess.SpawnError.self) { try SpawnedProcess("/nonexistent/dq-spawn", []) }
    }
}
