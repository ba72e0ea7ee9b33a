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
        var settings = try DataQueueSettings.load(
            config: options.config, server: options.server, database: options.database, environment: environment,
            decode: DataQueueSettings.decode(_:source:))
        if let proxy = options.proxy { settings.proxy = proxy }
        if let sending {
            if let durability = sending.durability { settings.durability = durability }
            if sending.idempotent { settings.idempotent = true }
            if let timeout = sending.timeout { settings.timeoutSeconds = timeout }
            if let batchSize = sending.batchSize { settings.batchSize = Double(batchSize) }
        }
        return settings
    }
}
