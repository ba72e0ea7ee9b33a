import Foundation

/// Runs blocking work (a file lock's wait, a schema migration, an `fsync`) on a thread of its own, so that no
/// thread of Swift's cooperative pool waits in it: the caller is suspended, holding no thread, until it ends.
///
/// A thread per call, not NIO's thread pool: the work is rare (opening a queue), and a command that only
/// reads the queue starts no pool.
enum OwnThread {
    static func run<T: Sendable>(_ name: String, _ body: @escaping @Sendable () throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<T, any Error>) in
            let thread = Thread { continuation.resume(with: Result { try body() }) }
            thread.name = name
            thread.start()
        }
    }
}
