import Foundation

/// Runs `process` to its end without holding a thread of the cooperative pool, and returns its exit status.
///
/// A `waitUntilExit` blocks its thread: on a two-core machine the pool has two, so two tests waiting for a
/// slow `CREATE DATABASE` on a cold server stalled every other test of the suite for twenty seconds, long
/// enough for their PostgreSQL operations to pass dq's 15 s deadline.
func runToExit(_ process: Process) async throws -> Int32 {
    try await withCheckedThrowingContinuation { continuation in
        process.terminationHandler = { process in continuation.resume(returning: process.terminationStatus) }
        do {
            try process.run()
        } catch {
            process.terminationHandler = nil
            continuation.resume(throwing: error)
        }
    }
}
