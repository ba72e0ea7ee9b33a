import Configuration
import FHIRDataQueue
import Logging

/// The keys of `dq.json` that only the `dq` command reads: how it logs, and how `dq run` (and `dq serve`) run
/// as a daemon. They are read from the reader the library's settings are read from (the flags, then the `DQ_`
/// variables, then the file; see ``load(options:sending:environment:accessReporter:)``), and checked as they are
/// read: a bad value is a ``DataQueueError`` (`.invalidConfiguration`) naming the key or its variable.
struct DaemonSettings: Sendable, Equatable {
    /// `ready_max_age_seconds` (`dq run`): `/readyz` fails while a pending item is older than this. The default is none.
    var readyMaxAgeSeconds: Double?
    /// `log_format`: `text` (the default) or `json`.
    var logFormat: DQLogHandler.Format?
    /// `log_level`: the least level logged. The default is `warning`.
    var logLevel: Logger.Level?
    /// `metrics_address` (`dq run`): where `/metrics`, `/healthz` and `/readyz` are served. The default is none.
    var metricsAddress: String?
    /// `poll_interval_seconds`: how often it looks for items queued by other processes. The default is 1.
    var pollIntervalSeconds: Double?
    /// `drain_timeout_seconds`: how long a graceful stop waits for the request on the wire. The default is 10.
    var drainTimeoutSeconds: Double?

    private static let logLevels = Logger.Level.allCases.map(\.rawValue).joined(separator: ", ")

    /// The keys, in the README's order, with their variables.
    static let keys: [SettingKey] = [
        .init("ready_max_age_seconds", "DQ_READY_MAX_AGE_SECONDS", .number),
        .init("log_format", "DQ_LOG_FORMAT", .choice(["text", "json"], #"must be "text" or "json""#)),
        .init("log_level", "DQ_LOG_LEVEL", .choice(Logger.Level.allCases.map(\.rawValue), "must be one of \(logLevels)")),
        .init("metrics_address", "DQ_METRICS_ADDRESS"),
        .init("poll_interval_seconds", "DQ_POLL_INTERVAL_SECONDS", .number),
        .init("drain_timeout_seconds", "DQ_DRAIN_TIMEOUT_SECONDS", .number),
    ]

    /// Every key `dq` reads: the library's, these, and the `serve` object (read by `dq serve` itself).
    static let table = SettingKeys.library.adding(keys, objects: ["serve"])

    /// Empty settings (every key unset).
    init() {}

    /// Reads the keys from `reader` and checks them.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key (or the variable) of a bad value.
    init(reader: ConfigReader) async throws {
        let read = DataQueueSettings.Read(reader: reader, keys: Self.table)
        let seconds = "must be a number of seconds"
        readyMaxAgeSeconds = try await read.number("ready_max_age_seconds", seconds)
        logFormat = try await read.choice("log_format", #"must be "text" or "json""#) { DQLogHandler.Format(rawValue: $0.lowercased()) }
        logLevel = try await read.choice("log_level", "must be one of \(Self.logLevels)") { Logger.Level(rawValue: $0.lowercased()) }
        metricsAddress = try await read.text("metrics_address", "must be a string (HOST:PORT, or a port)")
        pollIntervalSeconds = try await read.number("poll_interval_seconds", seconds)
        drainTimeoutSeconds = try await read.number("drain_timeout_seconds", seconds)
        for (key, value, allowZero) in [
            ("poll_interval_seconds", pollIntervalSeconds, false), ("drain_timeout_seconds", drainTimeoutSeconds, true),
            ("ready_max_age_seconds", readyMaxAgeSeconds, false),
        ] {
            guard let value else { continue }
            do {
                try DataQueue.Configuration.checkSeconds(value, name: "\"\(key)\"", allowZero: allowZero)
            } catch let error as DataQueueError {
                throw DataQueueSettings.configError(error.message)
            }
        }
        if let metricsAddress, ListenAddress.parse(metricsAddress) == nil {
            throw DataQueueSettings.configError("\"metrics_address\" is \(metricsAddress): \(ListenAddress.form)")
        }
    }

    /// The keys whose values differ from `old`'s, by name (none is a secret).
    func changes(since old: DaemonSettings) -> [String] {
        [
            ("ready_max_age_seconds", readyMaxAgeSeconds != old.readyMaxAgeSeconds), ("log_format", logFormat != old.logFormat),
            ("log_level", logLevel != old.logLevel), ("metrics_address", metricsAddress != old.metricsAddress),
            ("poll_interval_seconds", pollIntervalSeconds != old.pollIntervalSeconds),
            ("drain_timeout_seconds", drainTimeoutSeconds != old.drainTimeoutSeconds),
        ].filter(\.1).map(\.0)
    }
}

/// An address to listen on, as `metrics_address`, `--metrics-address`, `serve.listen` and `--listen` take it.
enum ListenAddress {
    /// What the address must be, for errors.
    static let form = "it must be HOST:PORT, [IPv6]:PORT or PORT, the port a whole number from 0 to 65535 (0: any free port)"

    /// `HOST:PORT` (`[v6]:PORT`) or a bare port (on loopback); nil when `text` is neither.
    static func parse(_ text: String) -> (host: String, port: Int)? {
        if let port = Int(text), (0...65535).contains(port) { return ("127.0.0.1", port) }
        guard let colon = text.lastIndex(of: ":"), let port = Int(text[text.index(after: colon)...]), (0...65535).contains(port)
        else { return nil }
        var host = String(text[..<colon])
        if host.hasPrefix("[") && host.hasSuffix("]") { host = String(host.dropFirst().dropLast()) }
        return host.isEmpty ? nil : (host, port)
    }

    /// Whether `host` (as ``parse(_:)`` gives it) is a loopback address: 127.0.0.0/8, ::1 or localhost.
    static func isLoopback(_ host: String) -> Bool {
        host == "localhost" || host == "::1" || host.split(separator: ".", omittingEmptySubsequences: false).first == "127"
    }
}
