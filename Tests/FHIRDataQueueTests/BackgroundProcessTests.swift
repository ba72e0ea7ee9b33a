import DQTestSupport
import Foundation
import Testing

/// ``BackgroundProcess``, the tests' child processes on swift-subprocess: what a child gets (streams, directory,
/// environment, no other descriptor, default signals and an empty mask) and how its end is told.
@Suite("Background processes")
struct BackgroundProcessTests {
    /// Runs `script` with `/bin/sh`; its standard output and ending.
    func shell(
        _ script: String, environment: [String: String]? = nil, directory: String? = nil, stdin: BackgroundProcess.Stream = .null
    ) async throws -> (String, BackgroundProcess.Ending) {
        let scratch = try Scratch("dq-spawn")
        let path = scratch.url.appendingPathComponent("out").path
        let fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0o600)
        try #require(fd >= 0)
        let child: BackgroundProcess
        do {
            defer { close(fd) }  // at once: the child has a copy
            child = try BackgroundProcess(
                "/bin/sh", ["-c", script], environment: environment, directory: directory, stdin: stdin, stdout: .descriptor(fd))
        }
        let ending = await child.wait()
        #expect(!child.isRunning)
        return (try String(contentsOfFile: path, encoding: .utf8), ending)
    }

    /// The signals named by a `SigIgn:` or `SigBlk:` line of `/proc/<pid>/status`, as a mask of signals 1 to 31.
    /// glibc keeps 32 and 33 for itself: posix_spawn cannot reset them, nor can any program.
    func signals(_ line: Substring, _ field: String) throws -> UInt64 {
        try #require(line.hasPrefix(field + ":\t"), "\(line)")
        let mask = try #require(UInt64(line.dropFirst(field.count + 2).prefix(16), radix: 16), "\(line)")
        return mask & 0x7fff_ffff
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
        let (inherited, _) = try await shell("echo \"$HOME\"")
        #expect(inherited == (ProcessInfo.processInfo.environment["HOME"] ?? "") + "\n", "no environment given is this process's")
    }

    @Test("A descriptor of this process that does not close on exec is not the child's; nor is an ignored or blocked signal")
    func nothingElseInherited() async throws {
        let scratch = try Scratch("dq-spawn-fd")
        let fd = open(scratch.url.appendingPathComponent("open").path, O_WRONLY | O_CREAT, 0o600)  // no O_CLOEXEC
        try #require(fd > 2)
        defer { close(fd) }
        let (fds, _) = try await shell("if [ -e /proc/self/fd/\(fd) ]; then echo inherited; else echo closed; fi")
        #expect(fds == "closed\n")

        // SIGPIPE and SIGHUP ignored here (as a server does) are the default again in the child.
        let pipe = signal(SIGPIPE, SIG_IGN)
        let hangUp = signal(SIGHUP, SIG_IGN)
        defer {
            signal(SIGPIPE, pipe)
            signal(SIGHUP, hangUp)
        }
        let ignoredHere = try signals(
            try #require(try await shell("grep SigIgn /proc/\(getpid())/status").0.split(separator: "\n").first), "SigIgn")
        #expect(ignoredHere & (1 << (UInt64(SIGPIPE) - 1)) != 0, "the test's own premise: this process ignores SIGPIPE")
        #expect(ignoredHere & (1 << (UInt64(SIGHUP) - 1)) != 0, "and SIGHUP")
        // And no signal blocked: on Linux the cooperative pool's threads (libdispatch's workers) block nearly all of
        // them, and a thread made by one of them, as swift-subprocess's spawning thread is, inherits that mask.
        let (status, _) = try await shell("grep -E '^Sig(Ign|Blk)' /proc/self/status")
        let lines = status.split(separator: "\n")
        try #require(lines.count == 2, "\(status)")
        #expect(try signals(lines[0], "SigBlk") == 0, "no signal blocked in the child: \(status)")
        #expect(try signals(lines[1], "SigIgn") == 0, "no signal ignored in the child: \(status)")
    }

    @Test("A child ended by a signal says which; a signal asked for while it starts is sent once it has; one after the end reaches nobody")
    func signals() async throws {
        #expect(try await shell("kill -TERM $$").1 == .signalled(SIGTERM))

        let early = try BackgroundProcess("/bin/sleep", ["60"])
        early.signal(SIGTERM)
        #expect(await early.wait() == .signalled(SIGTERM))

        let sleeper = try BackgroundProcess("/bin/sleep", ["60"])
        let pid = try #require(await sleeper.pid)
        #expect(FileManager.default.fileExists(atPath: "/proc/\(pid)"))
        #expect(sleeper.isRunning)
        sleeper.signal(SIGKILL)
        #expect(await sleeper.wait() == .signalled(SIGKILL))
        #expect(sleeper.ending?.status == SIGKILL)
        sleeper.signal(SIGKILL)  // reaped: its pid is not signalled again
        #expect(await sleeper.wait() == .signalled(SIGKILL), "a second wait returns the same end")
        #expect(await sleeper.pid == pid)
    }

    @Test("A program or a directory that is not there, or a program that may not be run, is an error naming it, and nothing is started")
    func missingProgram() throws {
        let scratch = try Scratch("dq-spawn-missing")
        let text = scratch.url.appendingPathComponent("text").path
        try #require(
            FileManager.default.createFile(atPath: text, contents: Data("not a program\n".utf8), attributes: [.posixPermissions: 0o600]))
        for (executable, directory, stdin) in [
            ("/nonexistent/dq-spawn", nil, BackgroundProcess.Stream.null), (text, nil, .null), ("/bin", nil, .null),
            ("/bin/true", "/nonexistent/dq", .null), ("/bin/true", text, .null), ("/bin/true", nil, .descriptor(-1)),
        ] {
            #expect(throws: BackgroundProcess.StartError.self, "\(executable) in \(directory ?? "."), \(stdin)") {
                try BackgroundProcess(executable, [], directory: directory, stdin: stdin)
            }
        }
    }

    @Test("A program that swift-subprocess cannot start ends as failed, with its reason")
    func programThatCannotStart() async throws {
        let scratch = try Scratch("dq-spawn-noexec")
        let text = scratch.url.appendingPathComponent("text").path
        try #require(
            FileManager.default.createFile(
                atPath: text, contents: Data("\u{7f}ELF not really\n".utf8), attributes: [.posixPermissions: 0o700]))
        let child = try BackgroundProcess(text, [])
        let ending = await child.wait()
        guard case .failed(let reason) = ending else {
            Issue.record("ended as \(ending)")
            return
        }
        #expect(ending.status == -1)
        #expect(!reason.isEmpty)
        #expect(await child.pid == nil, "no process")
        child.signal(SIGKILL)  // nobody to send it to
    }
}
