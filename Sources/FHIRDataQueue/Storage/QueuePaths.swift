#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Where a queue lives and what it is called.
package enum QueuePaths {
    /// The default database: `$STATE_DIRECTORY/queue.sqlite` under systemd's `StateDirectory=` (its first
    /// directory), else `$XDG_DATA_HOME/dq/queue.sqlite`, else `~/.local/share/dq/queue.sqlite`.
    package static func defaultDatabasePath(environment: [String: String]) -> String {
        if let state = environment["STATE_DIRECTORY"]?.split(separator: ":").first, state.hasPrefix("/") {
            return state + "/queue.sqlite"
        }
        if let xdg = environment["XDG_DATA_HOME"], xdg.hasPrefix("/") {
            return xdg + "/dq/queue.sqlite"
        }
        let home = environment["HOME"] ?? FileManager.default.homeDirectoryForCurrentUser.path
        return home + "/.local/share/dq/queue.sqlite"
    }

    /// The mode of the files dq makes beside a SQLite queue (the database, its lock files; SQLite gives the
    /// `-wal` and `-shm` the database's mode): 0660 when the directory is shared with a group (setgid and
    /// group-writable, as `install -d -m 2770 -g GROUP DIR` makes it), so that producers of that group and the
    /// daemon's user can all enqueue and flush; else 0600.
    package static func fileMode(forFileIn directory: String) -> mode_t {
        var info = stat()
        guard stat(directory.isEmpty ? "." : directory, &info) == 0 else { return 0o600 }
        return info.st_mode & S_ISGID != 0 && info.st_mode & S_IWGRP != 0 ? 0o660 : 0o600
    }

    /// Opens `path` with `flags`, creating it (`O_CREAT` is added here) with exactly `mode`, whatever the umask (a
    /// service's `UMask=0077` would take a shared queue's group bits away); a file that exists keeps its mode. The
    /// caller passes `O_NOFOLLOW` where a link must not be followed. Returns -1 with `errno` set.
    static func openCreating(_ path: String, _ flags: Int32, mode: mode_t) -> Int32 {
        while true {
            let created = open(path, flags | O_CREAT | O_EXCL, mode)
            if created >= 0 {
                fchmod(created, mode)
                return created
            }
            // An existing file keeps the mode its owner gave it. (A caller's own O_EXCL means it must be new.)
            guard errno == EEXIST, flags & O_EXCL == 0 else { return -1 }
            let existing = open(path, flags)
            // Deleted between the two opens: create it again.
            if existing >= 0 || errno != ENOENT { return existing }
        }
    }

    /// Whether a database setting names PostgreSQL rather than a SQLite file.
    package static func isPostgresURL(_ database: String) -> Bool {
        database.hasPrefix("postgres://") || database.hasPrefix("postgresql://")
    }

    /// A database setting as dq prints it: a PostgreSQL URL without its password.
    package static func displayDatabase(_ databasePath: String) -> String {
        guard isPostgresURL(databasePath), var components = URLComponents(string: databasePath), components.password != nil
        else { return databasePath }
        components.password = nil
        return components.string ?? "postgres://…"
    }

    /// The directory part of a file path, as `NSString.deletingLastPathComponent` gives it: `""` for a bare
    /// name, `"/"` for a file at the root, trailing and repeated slashes ignored.
    package static func directory(of path: String) -> String {
        let root = path.hasPrefix("/") ? "/" : ""
        var parts = path.split(separator: "/")
        guard !parts.isEmpty else { return root }
        parts.removeLast()
        return root + parts.joined(separator: "/")
    }

    /// The queue name of a base URL: its normal form (see `DataQueue.queueName(for:)`); `setting` names the
    /// URL in errors.
    package static func queueName(for baseURL: URL, setting: String) throws -> String {
        func invalid(_ why: String) -> DataQueueError {
            DataQueueError(.invalidConfiguration, "\(setting): the URL \(why)")
        }
        guard let components = URLComponents(url: baseURL, resolvingAgainstBaseURL: false),
            let scheme = components.scheme?.lowercased(), scheme == "http" || scheme == "https"
        else { throw invalid("must be an http or https URL") }
        guard let host = components.host, !host.isEmpty else { throw invalid("must have a host") }
        try URLPort.check(baseURL.absoluteString, setting: setting)
        if let port = components.port, !(1...65535).contains(port) { throw invalid("has port \(port), not one from 1 to 65535") }
        if components.user != nil || components.password != nil {
            throw invalid("must not hold a user or password (put credentials in \"auth\" or the environment)")
        }
        if components.query != nil { throw invalid("must not have a query (\"?...\")") }
        if components.fragment != nil { throw invalid("must not have a fragment (\"#...\")") }
        var name = scheme + "://" + (host.contains(":") && !host.hasPrefix("[") ? "[\(host)]" : host).lowercased()
        if let port = components.port, port != (scheme == "https" ? 443 : 80) { name += ":\(port)" }
        var path = components.percentEncodedPath
        while path.hasSuffix("/") { path.removeLast() }
        return name + path
    }
}

/// The bounds of settings, and the checks every setting passes whether it comes from code, a config file,
/// the environment or a flag.
package enum SettingLimits {
    /// The largest number of seconds a duration setting takes (one day).
    package static let maximumSeconds: Double = 86_400
    /// The largest `batchSize` accepted.
    package static let maximumBatchSize = 10_000
    /// The largest resource size a queue can be set to accept (1 GiB).
    package static let maximumResourceSizeLimit = 1 << 30

    /// Refuses a duration that is not finite, negative (or zero when `allowZero` is false), or over a day.
    package static func checkSeconds(_ value: Double, name: String, allowZero: Bool) throws {
        let low = allowZero ? "0" : "more than 0"
        guard value.isFinite, allowZero ? value >= 0 : value > 0, value <= maximumSeconds else {
            throw DataQueueError(.invalidConfiguration, "\(name) must be a number of seconds from \(low) to \(Int(maximumSeconds))")
        }
    }

    /// Refuses a database setting that is empty or a URL other than `postgres://…`.
    package static func checkDatabasePath(_ path: String, name: String) throws {
        guard !path.isEmpty else { throw DataQueueError(.invalidConfiguration, "\(name) is empty") }
        if QueuePaths.isPostgresURL(path) { return }
        if let scheme = path.firstRange(of: "://").map({ path[..<$0.lowerBound] }), !scheme.contains("/") {
            throw DataQueueError(
                .invalidConfiguration,
                "\(name) \"\(scheme)://…\" is a URL dq does not know: give a SQLite file path or a postgres:// URL")
        }
    }
}
