import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// An advisory `flock(2)` lock on a file, shared by processes and by connections in one process.
///
/// The kernel releases the lock when the holder exits, even on SIGKILL, so a crashed flusher never
/// leaves a queue locked.
final class FileLock: @unchecked Sendable {
    private let descriptor: Int32
    let path: String

    /// Opens (creating with mode 0600) the lock file at `path`.
    init(path: String) throws {
        let fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        guard fd >= 0 else {
            throw DataQueueError(.storage, "cannot open lock file \(path): \(String(cString: strerror(errno)))")
        }
        self.descriptor = fd
        self.path = path
    }

    deinit { close(descriptor) }

    /// Takes the lock exclusively, blocking the calling thread until it is free.
    func lock() throws {
        while flock(descriptor, LOCK_EX) != 0 {
            if errno == EINTR { continue }
            throw DataQueueError(.storage, "cannot lock \(path): \(String(cString: strerror(errno)))")
        }
    }

    /// Takes the lock if it is free and returns whether it did.
    func tryLock() throws -> Bool {
        if flock(descriptor, LOCK_EX | LOCK_NB) == 0 { return true }
        if errno == EWOULDBLOCK || errno == EINTR { return false }
        throw DataQueueError(.storage, "cannot lock \(path): \(String(cString: strerror(errno)))")
    }

    /// Waits for the lock without blocking a thread, polling until `deadline`.
    func lock(until deadline: ContinuousClock.Instant) async throws -> Bool {
        var delay = Duration.milliseconds(2)
        while true {
            if try tryLock() { return true }
            if ContinuousClock.now >= deadline { return false }
            try await Task.sleep(for: delay)
            delay = min(delay * 2, .milliseconds(100))
        }
    }

    func unlock() { flock(descriptor, LOCK_UN) }
}
