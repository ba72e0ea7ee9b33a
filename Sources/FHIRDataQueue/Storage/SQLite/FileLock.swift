import Foundation
import NIOConcurrencyHelpers

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// An advisory `flock(2)` lock on a file, shared by processes and by connections in one process.
///
/// The kernel releases the lock when the holder exits, even on SIGKILL, so a crashed flusher never
/// leaves a queue locked.
///
/// A lock file can be deleted while it is held (a tired `rm *.lock`): the holder keeps its lock on the unlinked
/// file, and the next locker creates a new file at the path and locks that. So on Linux a lock made with
/// `guardsDeletion`, once it has the `flock` of the file at the path, also asks the kernel whether some process
/// still holds an `flock` on a deleted file that was at this path (``DeletedLockHolders``), and counts that as
/// a held lock. That process holds the lock until it lets go or exits. At its next send it sees its file is gone
/// and, if the lock was made with `guardsDeletion`, moves to the new one (``moveToFileAtPath()``): it keeps
/// going when it gets the new file's `flock` and nobody has flushed under that file; otherwise it stops sending.
///
/// `@unchecked Sendable`: the descriptor is behind a lock, and only the holder's own calls replace it.
final class FileLock: FlushOwnership, @unchecked Sendable {
    /// The open lock file; replaced when the file at `path` was deleted or replaced since it was opened.
    private let opened: NIOLockedValueBox<Int32>
    let path: String
    /// Whether a holder of a deleted file at `path` counts as holding this lock (see the type's notes).
    private let guardsDeletion: Bool

    private var descriptor: Int32 { opened.withLockedValue { $0 } }

    /// Opens (creating with mode 0600, or 0660 in a directory shared with a group) the lock file at `path`.
    ///
    /// A symbolic link at `path` is refused (`O_NOFOLLOW`): dq writes to its lock files, and a link planted
    /// there must not make it write to the link's target.
    ///
    /// - Parameter guardsDeletion: a process that still holds a deleted file that was at `path` holds this
    ///   lock too (Linux), so that deleting the file while it is held does not let a second locker in.
    init(path: String, guardsDeletion: Bool = false) throws {
        self.path = path
        opened = NIOLockedValueBox(try Self.openLockFile(path))
        self.guardsDeletion = guardsDeletion
    }

    /// Whether a process holds the lock through a deleted file that was at `path`, given that this one holds
    /// the `flock` of `fd`, the file at `path` now.
    private func heldThroughDeletedFile(_ fd: Int32) -> Bool {
        guard guardsDeletion else { return false }
        return DeletedLockHolders.anyHolds(deletedFileOf: fd)
    }

    private static func openLockFile(_ path: String) throws -> Int32 {
        let fd = QueuePaths.openCreating(
            path, O_RDWR | O_CLOEXEC | O_NOFOLLOW, mode: QueuePaths.fileMode(forFileIn: QueuePaths.directory(of: path)))
        guard fd >= 0 else {
            if errno == ELOOP {
                throw DataQueueError(.storage, "lock file \(path) is a symbolic link; refusing to follow it")
            }
            throw DataQueueError(.storage, "cannot open lock file \(path): \(String(cString: strerror(errno)))")
        }
        return fd
    }

    deinit { close(descriptor) }

    /// Whether `fd` is still the file at `path`: a lock file deleted (or replaced) after it was opened locks a
    /// file nobody else opens, so a second flusher that opens the path would lock another one and send too.
    private func isCurrent(_ fd: Int32) -> Bool {
        var held = stat()
        var named = stat()
        guard fstat(fd, &held) == 0, lstat(path, &named) == 0 else { return false }
        return held.st_ino == named.st_ino && held.st_dev == named.st_dev
    }

    /// After taking the lock on `fd`: true when it is the file at `path`; else unlocks it and opens the path
    /// again (creating it), for the caller to retry.
    private func keepOrReopen(_ fd: Int32) throws -> Bool {
        if isCurrent(fd) { return true }
        flock(fd, LOCK_UN)
        let fresh = try Self.openLockFile(path)
        opened.withLockedValue { current in
            close(current)
            current = fresh
        }
        return false
    }

    /// Takes the lock exclusively, blocking the calling thread until it is free.
    func lock() throws {
        while true {
            let fd = descriptor
            if flock(fd, LOCK_EX) != 0 {
                if errno == EINTR { continue }
                throw DataQueueError(.storage, "cannot lock \(path): \(String(cString: strerror(errno)))")
            }
            guard try keepOrReopen(fd) else { continue }
            if !heldThroughDeletedFile(fd) { return }
            // The file was deleted while another holder had it, and that holder still runs: wait for it.
            flock(fd, LOCK_UN)
            usleep(10_000)
        }
    }

    /// Takes the lock if it is free and returns whether it did.
    func tryLock() throws -> Bool {
        while true {
            let fd = descriptor
            if flock(fd, LOCK_EX | LOCK_NB) != 0 {
                if errno == EWOULDBLOCK || errno == EINTR { return false }
                throw DataQueueError(.storage, "cannot lock \(path): \(String(cString: strerror(errno)))")
            }
            guard try keepOrReopen(fd) else { continue }
            if !heldThroughDeletedFile(fd) { return true }
            flock(fd, LOCK_UN)
            return false
        }
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

    func unlock() { opened.withLockedValue { _ = flock($0, LOCK_UN) } }

    /// Unlocks (the flush right of ``FlushOwnership``), first clearing a marker that was cleared lazily.
    func release() {
        if note.withLockedValue({ $0.release() }) { writeMarker("") }
        unlock()
    }

    // MARK: - The in-flight marker

    /// What this holder last wrote to the marker (its time is the end of the window it covers).
    private let note = NIOLockedValueBox(InFlightNoteWindow())
    /// How many times the marker was written (for tests of how often a flush writes it).
    var markerWrites: Int { writes.withLockedValue { $0 } }
    private let writes = NIOLockedValueBox(0)

    /// How long one written marker covers the sends after it, in seconds.
    static let noteWindow: TimeInterval = 1

    /// Notes in the lock file that the item `sequence` is being sent now (for a later flusher to see if
    /// this one dies before the answer). A small write to the page cache: no fsync, no SQLite.
    ///
    /// The marker is one fixed-width record at the start of the file, overwritten in place by one `pwrite`
    /// (a truncation per item cost more than the write: it is a metadata change in the file system's journal).
    /// Its time is the end of a window (``noteWindow``) and covers every send until then, as the PostgreSQL
    /// store's note does: a send inside the window writes nothing. After a crash the next flusher lets the
    /// server settle until that time plus the settle delay, at most a window longer than it had to; the
    /// sequence names the first item sent in the window.
    ///
    /// - Throws: ``DataQueueError`` (`.storage`) when the lock file was deleted or replaced while this flusher
    ///   held it and it cannot take the new one (``moveToFileAtPath()``): another flusher may hold that, so
    ///   nothing more may be sent under this lock.
    func markInFlight(sequence: Int64) async throws {
        if !opened.withLockedValue({ isCurrent($0) }) { try await moveToFileAtPath() }
        let now = ContinuousClock.now
        if note.withLockedValue({ $0.covers(now) }) { return }
        writeMarker("\(sequence) \(Date().addingTimeInterval(Self.noteWindow).timeIntervalSince1970)")
        note.withLockedValue { $0.wrote(at: now, covering: .milliseconds(Int64(Self.noteWindow * 1000))) }
    }

    /// The lock file was deleted or replaced while this flusher held it: takes the `flock` of the file at `path`
    /// now, and lets go of the old one only once it has it, so that no moment passes where neither is held.
    ///
    /// It goes on only where that cannot let two flushers send the same item:
    /// - the lock was made with `guardsDeletion`, so every other locker that got a newer file's `flock` while this
    ///   one held the deleted file saw it in the kernel's lock table and let go without writing anything;
    /// - the new file is empty: every flusher that sent writes its marker, so a flusher this one could not see
    ///   (another user, another PID namespace, an older dq, a lock file renamed away instead of deleted) that
    ///   flushed under the new file, and may have delivered what this one read ahead, leaves it non-empty.
    ///
    /// A locker in the middle of its look at `/proc` holds the new file's `flock` for that moment, so the
    /// `flock` is tried five times over about 30 ms before giving up.
    ///
    /// - Throws: ``DataQueueError`` (`.storage`) when it cannot go on: nothing more may be sent under this lock.
    private func moveToFileAtPath() async throws {
        func stop(_ why: String) -> DataQueueError {
            DataQueueError(
                .storage,
                "the flush lock file \(path) was deleted or replaced during the flush and \(why); stopping so that no two flushers send the same items"
            )
        }
        guard guardsDeletion else { throw stop("this lock does not look for other holders") }
        var pause = Duration.milliseconds(2)
        for attempt in 1...5 {
            let fresh = try Self.openLockFile(path)
            if flock(fresh, LOCK_EX | LOCK_NB) == 0 {
                var info = stat()
                guard isCurrent(fresh) else {
                    // Deleted again between the open and the lock: try the file there now.
                    flock(fresh, LOCK_UN)
                    close(fresh)
                    continue
                }
                guard fstat(fresh, &info) == 0, info.st_size == 0 else {
                    flock(fresh, LOCK_UN)
                    close(fresh)
                    throw stop("another flusher has used the new one")
                }
                // Held both for a moment; the old one goes now (closing it lets go of its lock).
                opened.withLockedValue { current in
                    close(current)
                    current = fresh
                }
                // The new file holds no marker yet: the next send writes one, whatever window was open.
                _ = note.withLockedValue { $0.release() }
                return
            }
            let failure = errno
            close(fresh)
            guard failure == EWOULDBLOCK || failure == EINTR else {
                throw stop("its lock cannot be taken (\(String(cString: strerror(failure))))")
            }
            if attempt < 5 {
                try await Task.sleep(for: pause)
                pause *= 2
            }
        }
        throw stop("another flusher holds the new one")
    }

    /// Notes `sequence` as sent at `date`.
    func markInFlight(sequence: Int64, at date: Date) {
        writeMarker("\(sequence) \(date.timeIntervalSince1970)")
        note.withLockedValue { $0.wrote(at: .now, covering: nil) }
    }

    /// Clears the marker, lazily: the answer came (or the request was given up) while this flusher was alive.
    /// The next ``markInFlight(sequence:)`` renews it and ``release()`` clears it, so a flush writes nothing
    /// per answer. A flusher that dies between an answer and its next send leaves the marker: the next one
    /// waits out the rest of its settle delay, which costs time, never a resource.
    func clearInFlight() { note.withLockedValue { $0.clear() } }

    /// The width of the marker record (the text, padded with spaces, and a newline).
    static let markerWidth = 64

    private func writeMarker(_ text: String) {
        var record = Array(text.utf8.prefix(Self.markerWidth - 1))
        record += [UInt8](repeating: UInt8(ascii: " "), count: Self.markerWidth - 1 - record.count) + [UInt8(ascii: "\n")]
        opened.withLockedValue { fd in _ = record.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) } }
        writes.withLockedValue { $0 += 1 }
    }

    /// The marker a flusher left behind: the item it was sending and when.
    func inFlight() -> (sequence: Int64, sentAt: Date)? {
        if note.withLockedValue({ $0.cleared }) { return nil }
        var buffer = [UInt8](repeating: 0, count: Self.markerWidth)
        let count = opened.withLockedValue { fd in buffer.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, 0) } }
        guard count > 0 else { return nil }
        let fields = String(decoding: buffer[0..<count], as: UTF8.self).split(whereSeparator: \.isWhitespace)
        guard fields.count == 2, let sequence = Int64(fields[0]), let seconds = Double(fields[1]) else { return nil }
        return (sequence, Date(timeIntervalSince1970: seconds))
    }
}
