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
        var configPath = options.config ?? environment["DQ_CONFIG"]
        if configPath == nil, FileManager.default.fileExists(atPath: "dq.json") { configPath = "dq.json" }
        var settings = try configPath.map(DataQueueSettings.load(contentsOf:)) ?? DataQueueSettings()
        try settings.apply(environment: environment)
        if let server = options.server { settings.server = server }
        if let database = options.database { settings.database = database }
        if let sending {
            if let durability = sending.durability { settings.durability = durability }
            if sending.idempotent { settings.idempotent = true }
            if let timeout = sending.timeout { settings.timeoutSeconds = timeout }
            if let batchSize = sending.batchSize { settings.batchSize = Double(batchSize) }
        }
        return settings
    }
}
