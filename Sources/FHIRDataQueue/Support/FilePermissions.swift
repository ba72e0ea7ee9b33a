import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Who owns a file and who else may read it, judged through symbolic links as libpq, OpenSSH and systemd judge a
/// key: a secret mounted as a link to a secret store (a Kubernetes secret volume, systemd's credentials) is the
/// file the link names. A link itself always shows mode 0777, so `lstat` (`FileManager.attributesOfItem`) would
/// call every such secret exposed.
package enum FilePermissions {
    /// The owner and permission bits of the file at `path`, following symbolic links; nil when it cannot be
    /// reached.
    package static func ownerAndMode(_ path: String) -> (owner: UInt32, mode: Int)? {
        var info = stat()
        guard stat(path, &info) == 0 else { return nil }
        return (UInt32(info.st_uid), Int(info.st_mode) & 0o7777)
    }

    /// The permission bits of the file at `path` when its group or others may read or write it (a secret that
    /// leaks), else nil.
    package static func exposedMode(_ path: String) -> Int? {
        guard let (_, mode) = ownerAndMode(path), mode & 0o077 != 0 else { return nil }
        return mode
    }
}
