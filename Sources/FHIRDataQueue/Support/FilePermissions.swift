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

    /// The permission bits of the file at `path` when others than its owner may read or write it (a secret that
    /// leaks), else nil.
    ///
    /// A file owned by root that its group may only read (0640) is not exposed, as libpq accepts such a key: it
    /// is how a package gives a service's user a secret it must not change (the Debian package installs
    /// `/etc/dq/dq.json` root:dq 0640 for the `dq` user's units), and `chmod 600` would lock that service out.
    package static func exposedMode(_ path: String) -> Int? {
        guard let (owner, mode) = ownerAndMode(path), !isPrivate(owner: owner, mode: mode) else { return nil }
        return mode
    }

    /// libpq's rule for a secret: only its owner may read it, or root owns it and its group may only read it.
    package static func isPrivate(owner: UInt32, mode: Int) -> Bool {
        mode & 0o077 == 0 || (mode & 0o037 == 0 && owner == 0)
    }
}
