import FHIRDataQueue
import Foundation

extension DataQueueSettings {
    /// The settings of one `dq` run: the config file (`--config`, else `$DQ_CONFIG`, else `./dq.json` if
    /// present), then `DQ_*` environment variables, then flags. The file's schema and every check live in the
    /// library, so a service embedding dq reads the same file the same way.
    static func load(
        options: QueueOptions, sending: SendingOptions? = nil,
        environment: [String: String] = ProcessInfo.processInfo.environment
    ) throws -> DataQueueSettings {
        // The format the flag or environment names applies from here (an error in the settings file itself is
        // written in it); the file's own log_format from the line after the load.
        if let format = try? DQLogHandler.Format.named(options.logFormat ?? environment["DQ_LOG_FORMAT"]) {
            StandardError.format.withLock { $0 = format }
        }
        var settings = try DataQueueSettings.load(
            config: options.config, server: options.server, database: options.database, environment: environment,
            decode: DataQueueSettings.decode(_:source:))
        if let format = try? DQLogHandler.Format.named(options.logFormat ?? settings.logFormat?.rawValue) {
            StandardError.format.withLock { $0 = format }
        }
        if let proxy = options.proxy { settings.proxy = proxy }
        warnAboutCommandLineSecrets(database: options.database, proxy: options.proxy)
        warnAboutUnknownEnvironmentVariables(environment)
        if let sending {
            if let durability = sending.durability { settings.durability = durability }
            if sending.idempotent { settings.idempotent = true }
            if let timeout = sending.timeout { settings.timeoutSeconds = timeout }
            if let batchSize = sending.batchSize { settings.batchSize = batchSize }
        }
        return settings
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
    for (name, suggestion) in DataQueueSettings.unknownEnvironmentVariables(in: environment) {
        printError("dq: warning: \(name) is not a dq setting and is ignored" + (suggestion.map { " (did you mean \($0)?)" } ?? ""))
    }
}
