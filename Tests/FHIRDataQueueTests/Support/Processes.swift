import DQTestSupport
import FHIRDataQueue
import Foundation

/// Runs `executable` to its end without holding a thread of the cooperative pool, and returns its exit status
/// (or the number of the signal that ended it).
///
/// A blocking wait holds its thread: on a two-core machine the pool has two, so two tests waiting for a slow
/// `CREATE DATABASE` on a cold server stalled every other test of the suite for twenty seconds, long enough for
/// their PostgreSQL operations to pass dq's 15 s deadline. ``BackgroundProcess``, not Foundation's `Process`: see there.
func runToExit(
    _ executable: String, _ arguments: [String], environment: [String: String]? = nil,
    stdout: BackgroundProcess.Stream = .null, stderr: BackgroundProcess.Stream = .inherit
) async throws -> Int32 {
    try await BackgroundProcess(executable, arguments, environment: environment, stdout: stdout, stderr: stderr).wait().status
}
