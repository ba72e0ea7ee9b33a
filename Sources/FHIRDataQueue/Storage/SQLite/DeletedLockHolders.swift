import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Finds a process that holds an `flock` on a deleted file that was at a lock file's path, from the kernel's own
/// tables, as `lslocks` does: `/proc/locks` lists every lock with its holder's pid, and `/proc/PID/fd` names each
/// open file, a deleted one as `PATH (deleted)`.
///
/// Only processes dq may inspect count: its own user's (or every one, as root). A process of another user cannot
/// make or hold a file in the queue's directory (0700, or 0770 for a group that shares it), so this neither
/// misses a flusher of the queue's own user nor lets a stranger block the queue (a name in a shared namespace,
/// which anyone could take first, would). Holders in another PID namespace (another container) are not seen:
/// between those, the lock file alone excludes, as long as nobody deletes it.
enum DeletedLockHolders {
    /// Whether a process holds an `flock` on a deleted file that was at the path of the file open as `fd`.
    ///
    /// When the file open as `fd` was itself deleted since the caller found it at the path, the answer is yes: its
    /// name no longer says which deleted files were at that path, and a caller told "nobody" would hold a lock
    /// that a holder of an older deleted file may still hold. The caller lets go and tries the path again.
    static func anyHolds(deletedFileOf fd: Int32) -> Bool {
        #if os(Linux)
            // The kernel's name of the file: the path it was opened by, resolved.
            guard let name = link("/proc/self/fd/\(fd)") else { return false }
            if name.hasSuffix(" (deleted)") { return true }
            guard let table = try? String(contentsOfFile: "/proc/locks", encoding: .utf8) else { return false }
            // Each process's locked files, by inode.
            var locked: [String: Set<UInt64>] = [:]
            for line in table.split(separator: "\n") {
                // "2: FLOCK  ADVISORY  WRITE 13372 fe:00:16220733 0 EOF"; a waiter's line has "->" after the number.
                let fields = line.split(separator: " ")
                guard fields.count >= 6, fields[1] == "FLOCK", fields[3] == "WRITE", Int32(fields[4]) != nil,
                    let inode = fields[5].split(separator: ":").last.flatMap({ UInt64($0) })
                else { continue }
                locked[String(fields[4]), default: []].insert(inode)
            }
            let deleted = name + " (deleted)"
            for (pid, inodes) in locked {
                // Another user's process: not listable (EACCES), and not one of ours.
                guard let files = try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/fd") else { continue }
                for file in files where link("/proc/\(pid)/fd/\(file)") == deleted {
                    // Open is not enough: that process must hold the lock on it (stat follows the link, deleted or not).
                    var info = stat()
                    if stat("/proc/\(pid)/fd/\(file)", &info) == 0, inodes.contains(UInt64(info.st_ino)) { return true }
                }
            }
            return false
        #else
            return false
        #endif
    }

    private static func link(_ path: String) -> String? {
        var buffer = [UInt8](repeating: 0, count: 4096 + 32)
        let count = buffer.withUnsafeMutableBufferPointer { raw in
            raw.withMemoryRebound(to: CChar.self) { readlink(path, $0.baseAddress!, $0.count - 1) }
        }
        guard count > 0 else { return nil }
        return String(decoding: buffer[0..<count], as: UTF8.self)
    }
}
