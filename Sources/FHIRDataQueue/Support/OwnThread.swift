import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// Runs blocking work (a file lock's wait, a schema migration, an `fsync`) on a thread of its own, so that no
/// thread of Swift's cooperative pool waits in it: the caller is suspended, holding no thread, until it ends.
///
/// A thread per call, not NIO's thread pool: the work is rare (opening a queue), and a command that only
/// reads the queue starts no pool.
enum OwnThread {
    /// How the thread is scheduled against the rest of the machine.
    enum Priority {
        /// As the process.
        case normal
        /// Work that may wait: ten nice steps below the process (at most 19) on Linux, for this thread and the
        /// threads it starts. With nothing else to run it still has every core; beside other work (the receiver's
        /// requests, a FHIR server or database on the same host) it takes about a tenth of a core's share.
        case background
    }

    static func run<T: Sendable>(
        _ name: String, priority: Priority = .normal, _ body: @escaping @Sendable () throws -> T
    ) async throws -> T {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<T, any Error>) in
            let thread = Thread {
                if case .background = priority { lowerPriority() }
                continuation.resume(with: Result { try body() })
            }
            thread.name = name
            thread.start()
        }
    }

    /// The nice value of the calling thread (on Linux a thread's own, inherited by the threads it starts).
    static func niceness() -> Int32 {
        #if os(Linux)
            return getpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0)
        #else
            return 0
        #endif
    }

    /// Lowers the calling thread's priority by ten nice steps. Only a fresh thread of dq's own is lowered: an
    /// unprivileged process cannot raise it again, and the thread ends with its work.
    private static func lowerPriority() {
        #if os(Linux)
            // PRIO_PROCESS with 0 is the calling thread on Linux (nice is per thread there), not the process.
            _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, min(19, niceness() + 10))
        #endif
    }
}
