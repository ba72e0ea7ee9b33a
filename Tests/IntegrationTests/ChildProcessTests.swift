import Foundation
import Testing

/// The test helper that runs dq and the peers: what it does when its child misbehaves must not end the test
/// process, whose end would take every other test's result with it.
@Suite("The tests' child processes")
struct ChildProcessTests {
    @Test("Writing to the standard input of a child that has ended neither ends this process nor leaves SIGPIPE blocked")
    func writeAfterEnd() async throws {
        let child = try ChildProcess("/bin/true", [], keepStdinOpen: true)
        let result = await child.wait()
        #expect(result.status == 0)
        // Without the child reading it, the pipe has no reader: the write raises SIGPIPE, whose default action
        // ends this process.
        child.writeStdin(Data(repeating: 0x41, count: 65_536))
        var mask = sigset_t()
        pthread_sigmask(SIG_BLOCK, nil, &mask)
        #expect(sigismember(&mask, SIGPIPE) == 0, "SIGPIPE left blocked on this thread")
        var pending = sigset_t()
        sigpending(&pending)
        #expect(sigismember(&pending, SIGPIPE) == 0, "a SIGPIPE left pending")
        child.closeStdin()
    }
}
