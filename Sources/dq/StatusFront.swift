import FHIRDataQueueCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#endif

/// `dq status` answered without the engine, or nil to let the engine answer.
enum StatusFront {
    /// The whole output of `dq status` for these arguments (after `dq`), or nil when the engine must run it.
    static func answer(arguments: [String], environment: [String: String]) -> String? {
        guard let options = Options(arguments: arguments),
            // Another log level could print lines the front does not.
            environment["DQ_LOG_LEVEL"] == nil,
            let settings = try? DataQueueSettings.load(
                config: options.config, server: options.server, database: options.database, environment: environment,
                decode: { data, _ in try JSONDecoder().decode(DataQueueSettings.self, from: data) })
        else { return nil }
        if options.all || settings.server == nil {
            let database = settings.database ?? QueuePaths.defaultDatabasePath(environment: environment)
            guard !QueuePaths.isPostgresURL(database), let reader = SQLiteStatusReader(path: database),
                let statuses = reader.allStatuses()
            else { return nil }
            if options.json { return json(statuses) }
            return text(StatusReport.allLines(database: database, statuses: statuses))
        }
        // Sign-in, credentials, encryption and a CA bundle are checked by the engine, which reads keys and
        // certificates; so is every setting the front's check refuses.
        guard settings.auth == nil, settings.encryption == nil, settings.caBundle == nil,
            let values = try? settings.checkedValues()
        else { return nil }
        let database = values.database ?? QueuePaths.defaultDatabasePath(environment: environment)
        guard !QueuePaths.isPostgresURL(database), let reader = SQLiteStatusReader(path: database),
            let status = reader.status(queue: values.queueName)
        else { return nil }
        if options.json { return json(status) }
        guard let all = reader.allStatuses() else { return nil }
        var lines = StatusReport.lines(status)
        lines.append(StatusReport.databaseLine(database))
        for other in all where StatusReport.isElsewhere(other, of: status.queue) {
            lines.append(StatusReport.elsewhereLine(other))
        }
        return text(lines)
    }

    private static func text(_ lines: [String]) -> String {
        lines.map { $0 + "\n" }.joined()
    }

    private static func json<T: Encodable>(_ value: T) -> String? {
        guard let data = try? StatusReport.jsonEncoder().encode(value) else { return nil }
        return String(decoding: data, as: UTF8.self) + "\n"
    }

    /// The arguments of a `dq status` the front answers: `status` and only its own options, each at most
    /// once; anything else (help, `-v`, an unknown flag, a missing value) is the engine's.
    struct Options {
        var config: String?
        var server: String?
        var database: String?
        var all = false
        var json = false

        init?(arguments: [String]) {
            guard arguments.first == "status" else { return nil }
            var seen: Set<String> = []
            var rest = arguments.dropFirst()[...]
            while let argument = rest.popFirst() {
                var name = argument
                var value: String?
                if let equals = argument.firstIndex(of: "="), argument.hasPrefix("--") {
                    name = String(argument[..<equals])
                    value = String(argument[argument.index(after: equals)...])
                }
                guard seen.insert(name).inserted else { return nil }
                switch name {
                case "--all", "--json":
                    guard value == nil else { return nil }
                    if name == "--all" { all = true } else { json = true }
                case "--config", "--server", "--database":
                    if value == nil {
                        guard let next = rest.popFirst(), !next.hasPrefix("-") else { return nil }
                        value = next
                    }
                    switch name {
                    case "--config": config = value
                    case "--server": server = value
                    default: database = value
                    }
                default:
                    return nil
                }
            }
        }
    }
}

/// The engine: `dq-engine` beside this binary, or `$DQ_ENGINE`.
enum Engine {
    /// Replaces this process with the engine, with the same arguments; returns only to exit with 69 when the
    /// engine cannot be run.
    static func exec(arguments: [String]) -> Never {
        let override = getenv("DQ_ENGINE").map { String(cString: $0) }
        let path = override ?? besideThisBinary()
        var argv: [UnsafeMutablePointer<CChar>?] = arguments.map { strdup($0) } + [nil]
        execv(path, &argv)
        let reason = String(cString: strerror(errno))
        let hint = override == nil ? "install dq-engine beside dq (make install)" : "check DQ_ENGINE"
        _ = writeAll("dq: cannot run the dq engine \(path): \(reason); \(hint)\n", to: 2)
        exit(69)
    }

    private static func besideThisBinary() -> String {
        var buffer = [CChar](repeating: 0, count: Int(PATH_MAX) + 1)
        let count = readlink("/proc/self/exe", &buffer, buffer.count - 1)
        guard count > 0 else { return "dq-engine" }
        let path = String(decoding: buffer[..<count].map { UInt8(bitPattern: $0) }, as: UTF8.self)
        let directory = QueuePaths.directory(of: path)
        return (directory.isEmpty ? "." : directory) + "/dq-engine"
    }
}

/// Writes all of `text` to the file descriptor `fd` (retrying short writes and EINTR); false on an error.
func writeAll(_ text: String, to fd: Int32) -> Bool {
    var bytes = Array(text.utf8)[...]
    while !bytes.isEmpty {
        let written = bytes.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
        if written < 0 {
            if errno == EINTR { continue }
            return false
        }
        bytes = bytes.dropFirst(written)
    }
    return true
}
