import ArgumentParser
import FHIRDataQueue
import Foundation
import Logging
import NIOConcurrencyHelpers

#if canImport(Glibc)
    import Glibc
#endif

@main
struct DQ: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "dq",
        abstract: "An offline-first, durable FHIR data queue.",
        discussion: """
            Resources are committed to a SQLite queue before they are sent, delivered in order, and never lost: \
            a failed send stays queued, a rejected one is parked for an operator.

            Exit codes (sysexits): 0 ok, 64 usage, 65 bad input or items rejected by the server, 66 input file \
            missing or unreadable, 69 an endpoint or proxy does not answer (dq doctor), 74 I/O error, 75 temporary \
            failure (retry later), 77 authentication refused, 78 configuration error. When several apply, the first \
            of 77, 75, 65 wins.
            """,
        version: DQVersion.current,
        subcommands: [
            Enqueue.self, Send.self, Flush.self, Run.self, Status.self, List.self, Show.self, Retry.self, Resolve.self, Drop.self, Log.self,
            Prune.self, Rekey.self, Quarantine.self, Serve.self,
            Doctor.self, ShowConfig.self, Decrypt.self, Keygen.self, Register.self, Login.self, Logout.self, Migrate.self, Version.self,
        ])

    /// Parses and runs the command. A usage error ArgumentParser finds (exit 64) is written as dq's own error
    /// lines are: with its priority under systemd's journal stream, as JSON with `DQ_LOG_FORMAT=json`. Help,
    /// `--version` and every other end are ArgumentParser's.
    static func main() async {
        do {
            var command = try parseAsRoot()
            if var asynchronous = command as? any AsyncParsableCommand {
                try await asynchronous.run()
            } else {
                try command.run()
            }
        } catch {
            let code = exitCode(for: error)
            let message = fullMessage(for: error)
            guard code.rawValue == Exit.usage, !message.isEmpty else { exit(withError: error) }
            // The format a --log-format among the arguments names, else DQ_LOG_FORMAT (the file is not read).
            let arguments = Array(CommandLine.arguments.dropFirst())
            let flag = arguments.indices.lazy.compactMap { index -> String? in
                if arguments[index].hasPrefix("--log-format=") { return String(arguments[index].dropFirst("--log-format=".count)) }
                return arguments[index] == "--log-format" && index + 1 < arguments.count ? arguments[index + 1] : nil
            }.first
            if let format = try? DQLogHandler.Format.named(flag ?? ProcessInfo.processInfo.environment["DQ_LOG_FORMAT"]) {
                StandardError.format.withLockedValue { $0 = format }
            }
            printError(message, level: .error)
            // A monitoring plugin's caller reads a check it could not run as UNKNOWN (3), not as a usage error.
            Foundation.exit(arguments.first == "status" && arguments.contains("--check") ? 3 : code.rawValue)
        }
    }

    /// `dq` alone is a usage error (exit 64), with the help on standard error.
    func run() async throws {
        printError(DQ.helpMessage())
        throw ExitCode(Exit.usage)
    }
}

extension DQ {
    struct Version: ParsableCommand {
        static let configuration = CommandConfiguration(commandName: "version", abstract: "Print dq's version.")

        func run() {
            print("dq \(DQVersion.current)")
        }
    }
}

/// Options of every command that opens a queue: where it is and how much to say.
struct QueueOptions: ParsableArguments {
    @Option(
        help:
            "The config file (JSON). Default: $DQ_CONFIG, else the first of ./dq.json, $XDG_CONFIG_HOME/dq/dq.json (~/.config/dq/dq.json), /etc/dq/dq.json."
    )
    var config: String?

    @Option(help: "The FHIR base URL. Overrides \"server\" and $DQ_SERVER.")
    var server: String?

    @Option(help: "The queue database file. Overrides \"database\" and $DQ_DATABASE.")
    var database: String?

    @Option(
        help:
            "The proxy for every request (http://[user:password@]host:port, or socks5://host:port; \"\" for none). Overrides \"proxy\", $DQ_PROXY, $HTTPS_PROXY and $HTTP_PROXY."
    )
    var proxy: String?

    @Flag(name: [.short, .long], help: "Log more (debug level) to standard error.")
    var verbose = false

    @Option(help: "text (the default) or json (one object a line, for log shippers). Overrides \"log_format\" and $DQ_LOG_FORMAT.")
    var logFormat: String?
}

/// Options of commands that write to the queue or send: durability, idempotent mode, the request deadline.
struct SendingOptions: ParsableArguments {
    @Option(help: "full (survives power loss; the default) or normal (faster). Overrides \"durability\".")
    var durability: DataQueue.Durability?

    @Flag(
        help:
            "Idempotent mode: every create goes as a conditional create (If-None-Exist), one without an identifier given one. Overrides \"idempotent\"; the default, auto, does so for the types the server declares."
    )
    var idempotent = false

    @Option(parsing: .unconditional, help: "The deadline of one request, in seconds (the default is 30).")
    var timeout: Double?

    @Option(
        parsing: .unconditional,
        help:
            "The most items per request (transaction Bundle entries); 1 sends one request per item. Overrides \"batch_size\"; the default is automatic."
    )
    var batchSize: Int?

    func validate() throws {
        if let timeout { try checkFlagSeconds(timeout, name: "--timeout", allowZero: false) }
        if let batchSize, !(1...DataQueue.Configuration.maximumBatchSize).contains(batchSize) {
            throw ValidationError("--batch-size must be from 1 to \(DataQueue.Configuration.maximumBatchSize)")
        }
    }
}

/// The library's check of a duration, for a flag: a bad value is a usage error (exit 64) naming the flag.
func checkFlagSeconds(_ value: Double, name: String, allowZero: Bool) throws {
    do {
        try DataQueue.Configuration.checkSeconds(value, name: name, allowZero: allowZero)
    } catch let error as DataQueueError {
        throw ValidationError(error.message)
    }
}

/// Exit codes from sysexits.h, mapped from error codes in one place.
enum Exit {
    static let ok: Int32 = 0
    static let usage: Int32 = 64
    static let dataError: Int32 = 65
    static let noInput: Int32 = 66
    /// `dq doctor`: the server, a proxy, the token or the encrypted endpoint does not answer (EX_UNAVAILABLE).
    static let unavailable: Int32 = 69
    static let cannotCreate: Int32 = 73
    static let ioError: Int32 = 74
    static let temporaryFailure: Int32 = 75
    static let permissionDenied: Int32 = 77
    static let configuration: Int32 = 78

    static func code(for error: DataQueueError) -> Int32 {
        switch error.code {
        case .invalidResource, .notFound, .encryption: return dataError
        case .invalidConfiguration: return configuration
        case .storage, .storageFull, .damaged: return ioError
        case .transport, .busy: return temporaryFailure
        case .authentication: return permissionDenied
        default: return 1
        }
    }

    /// The code of a run that may have several outcomes at once: authentication refused (77) first, then
    /// items still queued (75), then items the server rejected in this run (65), else 0.
    static func outcome(authenticationFailed: Bool, pending: Bool, rejected: Bool) -> Int32 {
        if authenticationFailed { return permissionDenied }
        if pending { return temporaryFailure }
        if rejected { return dataError }
        return ok
    }
}

/// Writes `text` (`dq: …`, or `dq: warning: …`) to standard error as the log lines are written: under
/// systemd's journal each line starts with its syslog priority (`level`, else warning for a `dq: warning:` line
/// and error for the others), and with `--log-format json` it is one JSON object.
func printError(_ text: String, level: Logger.Level? = nil) {
    let level = level ?? (text.hasPrefix("dq: warning: ") ? .warning : .error)
    guard StandardError.format.withLockedValue({ $0 }) == .json else {
        StandardError.write(text, level: level)
        return
    }
    var message = Substring(text)
    for prefix in ["dq: ", "warning: "] where message.hasPrefix(prefix) { message = message.dropFirst(prefix.count) }
    StandardError.write(DQLogHandler.jsonLine(level: level, message: String(message), metadata: [:]), level: level)
}

/// Standard error as dq's lines go there.
enum StandardError {
    /// The log format, once the settings named it (`--log-format`, `DQ_LOG_FORMAT`, `log_format`).
    static let format = NIOLockedValueBox(DQLogHandler.Format.text)
    /// Whether standard error is systemd's journal stream (see ``DQLogHandler/writesToJournal(environment:)``).
    static let journal = DQLogHandler.writesToJournal()

    /// Writes `text`, each of its lines with the priority prefix of `level` when the journal reads them.
    static func write(_ text: String, level: Logger.Level, journal: Bool = StandardError.journal) {
        let output =
            journal
            ? text.split(separator: "\n", omittingEmptySubsequences: false).map { "<\(DQLogHandler.priority(level))>\($0)" }
                .joined(separator: "\n") : text
        FileHandle.standardError.write(Data((output + "\n").utf8))
    }
}

var standardErrorIsTerminal: Bool { isatty(2) == 1 }

/// Sets up the log once the settings are read: the level (`-v` is debug, else `log_level` or `DQ_LOG_LEVEL`,
/// else warning) and the format (`--log-format`, else `log_format` or `DQ_LOG_FORMAT`), for the logger's lines
/// and dq's own.
func bootstrapLogging(_ options: QueueOptions, _ daemon: DaemonSettings) throws {
    let level = options.verbose ? .debug : daemon.logLevel ?? .warning
    let format = try DQLogHandler.Format.named(options.logFormat ?? daemon.logFormat?.rawValue)
    StandardError.format.withLockedValue { $0 = format }
    LoggingSystem.bootstrap { label in DQLogHandler(label: label, level: level, format: format) }
}

/// Opens the queue, runs `body`, shuts down, and turns errors into messages and exit codes.
///
/// `readOnly` opens an existing queue without creating or writing anything (for commands that only read).
func withQueue<T>(
    _ options: QueueOptions, sending: SendingOptions? = nil, readOnly: Bool = false, _ body: (DataQueue) async throws -> T
) async throws -> T {
    try await withQueue(options, sending: sending, readOnly: readOnly) { queue, _ in try await body(queue) }
}

/// Opens the queue. With `waitsForDatabase` (a daemon), a database that cannot be reached (a PostgreSQL server
/// restarting, failing over, or not up yet: `.transport`) is tried again with a growing delay up to 30 s, said
/// once, instead of ending the process; a refused login or a bad setting still ends it at once.
private func openQueue(
    _ settings: DataQueueSettings, readOnly: Bool, waitsForDatabase: Bool, logger: Logger
) async throws -> DataQueue {
    var attempts = 0
    while true {
        do {
            let queue = try await settings.makeQueue(readOnly: readOnly, logger: logger)
            if attempts > 0 { logger.notice("the queue's database is reachable again") }
            return queue
        } catch let error as DataQueueError where waitsForDatabase && error.code == .transport {
            if attempts == 0 {
                logger.warning("cannot open the queue's database; trying again until it answers", metadata: ["error": "\(error.message)"])
            }
            attempts += 1
            try await Task.sleep(for: .seconds(min(30, 1 << min(attempts - 1, 5))))
        }
    }
}

/// ``withQueue(_:sending:readOnly:_:)`` for a command that also reads the settings (`dq flush`).
func withQueue<T>(
    _ options: QueueOptions, sending: SendingOptions? = nil, readOnly: Bool = false,
    adjust: (inout DataQueueSettings) throws -> Void = { _ in },
    waitsForDatabase: Bool = false,
    _ body: (DataQueue, DataQueueSettings) async throws -> T
) async throws -> T {
    try await withQueue(options, sending: sending, readOnly: readOnly, adjust: adjust, waitsForDatabase: waitsForDatabase) {
        queue, settings, _ in try await body(queue, settings)
    }
}

/// ``withQueue(_:sending:readOnly:_:)`` for a command that also reads the settings and dq's own (`dq run`).
func withQueue<T>(
    _ options: QueueOptions, sending: SendingOptions? = nil, readOnly: Bool = false,
    adjust: (inout DataQueueSettings) throws -> Void = { _ in },
    waitsForDatabase: Bool = false,
    _ body: (DataQueue, DataQueueSettings, DaemonSettings) async throws -> T
) async throws -> T {
    // Past a file-size limit, writes must fail with EFBIG (reported as "full"), not kill the process.
    signal(SIGXFSZ, SIG_IGN)
    let queue: DataQueue
    let settings: DataQueueSettings
    let daemon: DaemonSettings
    let logger: Logger
    do {
        var loaded: DataQueueSettings
        (loaded, daemon) = try await DaemonSettings.load(options: options, sending: sending)
        try adjust(&loaded)
        settings = loaded
        try bootstrapLogging(options, daemon)
        logger = Logger(label: "dq")
        warnAboutExposure(settings)
        queue = try await openQueue(settings, readOnly: readOnly, waitsForDatabase: waitsForDatabase, logger: logger)
    } catch let error as DataQueueError {
        printError("dq: \(error.message)")
        throw ExitCode(Exit.code(for: error))
    }
    do {
        let result = try await body(queue, settings, daemon)
        try? await queue.shutdown()
        return result
    } catch let error as DataQueueError {
        try? await queue.shutdown()
        printError("dq: \(error.message)")
        throw ExitCode(Exit.code(for: error))
    } catch {
        try? await queue.shutdown()
        throw error
    }
}

/// Warns (never refuses) where a secret may leak: a config file holding one that others can read, and a
/// token about to travel over plain http to a host other than this machine.
func warnAboutExposure(_ settings: DataQueueSettings) {
    if let path = settings.sourcePath, settings.fileHoldsSecret, let mode = FilePermissions.exposedMode(path) {
        printError(
            "dq: warning: \(path) holds a secret and is readable by others (mode \(String(mode, radix: 8))); run: chmod 600 \(path)")
    }
    if settings.databasePassword != nil {
        printError("dq: warning: \"database_password_file\" is set but \"database\" is not a postgres:// URL; the file is not used")
    }
    for path in settings.exposedSecretFiles {
        printError("dq: warning: the secret file \(path) is readable by others; run: chmod 600 \(path)")
    }
    if let key = settings.tls?.clientKey.map({ settings.keyFilePath($0) }), let mode = FilePermissions.exposedMode(key) {
        printError(
            "dq: warning: the client key \(key) is readable by others (mode \(String(mode, radix: 8))); run: chmod 600 \(key)")
    }
    if let key = settings.auth?.privateKey.map({ settings.keyFilePath($0) }), let mode = FilePermissions.exposedMode(key) {
        printError(
            "dq: warning: the private_key_jwt key \(key) is readable by others (mode \(String(mode, radix: 8))); run: chmod 600 \(key)")
    }
    if settings.auth != nil, let text = settings.server, let url = URL(string: text), url.scheme?.lowercased() == "http",
        let host = url.host?.lowercased(), !["localhost", "127.0.0.1", "::1", "[::1]"].contains(host), !host.hasPrefix("127.")
    {
        printError("dq: warning: credentials will be sent over plain http to \(host); use https")
    }
}

/// One readable line per event on standard error: `dq: warning: parked (item=…, reason=…)`.
struct DQLogHandler: LogHandler {
    /// How lines look: `dq: warning: message (key=value, …)`, or one JSON object a line.
    enum Format: String {
        case text, json

        /// The format named by a flag, variable or setting; text when none is given.
        static func named(_ name: String?) throws -> Format {
            guard let name else { return .text }
            guard let format = Format(rawValue: name.lowercased()) else {
                throw DataQueueError(.invalidConfiguration, "the log format must be text or json, not \"\(name)\"")
            }
            return format
        }
    }

    let label: String
    var logLevel: Logger.Level
    var metadata: Logger.Metadata = [:]
    let format: Format
    /// Whether standard error is systemd's journal stream: each line then starts with its syslog priority.
    let journal: Bool

    init(label: String, level: Logger.Level, format: Format = .text, journal: Bool = StandardError.journal) {
        self.label = label
        self.logLevel = level
        self.format = format
        self.journal = journal
    }

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    /// Whether `$JOURNAL_STREAM` (`device:inode`, set by systemd) names the file standard error is, as
    /// sd-daemon(3) says to check before using priority prefixes.
    static func writesToJournal(environment: [String: String] = ProcessInfo.processInfo.environment) -> Bool {
        guard let stream = environment["JOURNAL_STREAM"] else { return false }
        let parts = stream.split(separator: ":")
        guard parts.count == 2, let device = UInt64(parts[0]), let inode = UInt64(parts[1]) else { return false }
        var info = stat()
        guard fstat(STDERR_FILENO, &info) == 0 else { return false }
        return UInt64(info.st_dev) == device && UInt64(info.st_ino) == inode
    }

    /// The syslog priority of a level (sd-daemon(3)'s `<N>` prefixes).
    static func priority(_ level: Logger.Level) -> Int {
        switch level {
        case .trace, .debug: 7
        case .info: 6
        case .notice: 5
        case .warning: 4
        case .error: 3
        case .critical: 2
        }
    }

    func log(event: LogEvent) {
        let merged = metadata.merging(event.metadata ?? [:]) { $1 }
        let line: String
        switch format {
        case .text:
            let details = merged.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: ", ")
            line = "dq: \(event.level): \(event.message)" + (details.isEmpty ? "" : " (\(details))")
        case .json:
            line = Self.jsonLine(level: event.level, message: "\(event.message)", metadata: merged)
        }
        StandardError.write(line, level: event.level, journal: journal)
    }

    /// One JSON log line: `time` (RFC 3339, UTC), `level`, `message` and the event's fields.
    static func jsonLine(level: Logger.Level, message: String, metadata: Logger.Metadata) -> String {
        var object: [String: String] = metadata.mapValues { "\($0)" }
        object["time"] = Date().formatted(.iso8601)
        object["level"] = level.rawValue
        object["message"] = message
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .withoutEscapingSlashes]
        return (try? encoder.encode(object)).map { String(decoding: $0, as: UTF8.self) } ?? "{}"
    }
}

/// JSON for `--json` output: sorted keys, ISO 8601 dates, no escaped slashes.
func printJSON<T: Encodable>(_ value: T) throws {
    let data = try StatusReport.jsonEncoder().encode(value)
    FileHandle.standardOutput.write(data)
    FileHandle.standardOutput.write(Data("\n".utf8))
}

/// `2026-11-23T12:41:13Z`: UTC to the second (see `StatusReport.formatDate`).
func formatDate(_ date: Date?) -> String {
    StatusReport.formatDate(date)
}

extension DataQueue.Durability: ExpressibleByArgument {}
