import Configuration
import FHIRDataQueue
import Foundation
import NIOConcurrencyHelpers

extension DataQueueSettings {
    /// The library's settings of one `dq` run (see ``DaemonSettings/load(options:sending:environment:accessReporter:)``,
    /// which reads and checks dq's own keys beside them).
    static func load(
        options: QueueOptions, sending: SendingOptions? = nil,
        environment: [String: String] = ProcessInfo.processInfo.environment, accessReporter: (any AccessReporter)? = nil
    ) async throws -> DataQueueSettings {
        try await DaemonSettings.load(options: options, sending: sending, environment: environment, accessReporter: accessReporter).settings
    }
}

extension DaemonSettings {
    /// The settings of one `dq` run, read through one `ConfigReader` (see ``SettingsReader``): the flags, then
    /// the `DQ_*` environment variables, then the config file (`--config`, else `$DQ_CONFIG`, else `./dq.json`
    /// if present), then the secret files the settings name. The library's keys are read and checked by the
    /// library (a service embedding dq reads them the same way); dq's own (``keys``) from the same reader here.
    ///
    /// - Parameter accessReporter: told where each value came from (`dq config`).
    static func load(
        options: QueueOptions, sending: SendingOptions? = nil,
        environment: [String: String] = ProcessInfo.processInfo.environment, accessReporter: (any AccessReporter)? = nil
    ) async throws -> (settings: DataQueueSettings, daemon: DaemonSettings) {
        // The format the flag or environment names applies from here (an error in the settings file itself is
        // written in it); the file's own log_format from the line after the load.
        if let format = try? DQLogHandler.Format.named(options.logFormat ?? environment["DQ_LOG_FORMAT"]) {
            StandardError.format.withLockedValue { $0 = format }
        }
        var flags: [String: ConfigContent] = [:]
        flags["server"] = options.server.map(ConfigContent.string)
        flags["database"] = options.database.map(ConfigContent.string)
        flags["proxy"] = options.proxy.map(ConfigContent.string)
        flags["durability"] = sending?.durability.map { .string($0.rawValue) }
        flags["idempotent"] = sending?.idempotent == true ? .bool(true) : nil
        flags["timeout_seconds"] = sending?.timeout.map(ConfigContent.double)
        flags["batch_size"] = sending?.batchSize.map { .double(Double($0)) }
        let (reader, file) = try SettingsReader.make(
            config: options.config, flags: flags, environment: environment, keys: table, accessReporter: accessReporter)
        let settings = try await DataQueueSettings(reader: reader, file: file, environment: environment)
        let daemon = try await DaemonSettings(reader: reader)
        if let format = try? DQLogHandler.Format.named(options.logFormat ?? daemon.logFormat?.rawValue) {
            StandardError.format.withLockedValue { $0 = format }
        }
        warnAboutCommandLineSecrets(database: options.database, proxy: options.proxy)
        warnAboutUnknownEnvironmentVariables(environment)
        return (settings, daemon)
    }
}

/// Warns (never refuses) about a password given on the command line, where `ps` shows it to every user.
func warnAboutCommandLineSecrets(database: String?, proxy: String?, flag: String = "--database") {
    if let database, URLComponents(string: database)?.password != nil {
        printError("dq: warning: the password in \(flag) is visible to every user in ps; use PGPASSWORD or the config file")
    }
    if let proxy, NetworkConfiguration.components(proxy)?.password != nil {
        printError("dq: warning: the password in --proxy is visible to every user in ps; use DQ_PROXY or the config file")
    }
}

/// Warns (never refuses) about a `DQ_…` variable dq does not read: a misspelt name is otherwise ignored.
func warnAboutUnknownEnvironmentVariables(_ environment: [String: String]) {
    for (name, suggestion) in DaemonSettings.table.unknownEnvironmentVariables(in: environment) {
        printError("dq: warning: \(name) is not a dq setting and is ignored" + (suggestion.map { " (did you mean \($0)?)" } ?? ""))
    }
}
