import ArgumentParser
import FHIRDataQueue
import Foundation
import Logging

#if canImport(Glibc)
    import Glibc
#endif

@main
struct DQ: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "dq",
        abstract: "An offline-first, durable FHIR data queue.",
        discussion: """
            Resources are committed to a SQLite queue before they are sent, delivered in order, and never
            lost: a failed send stays queued, a rejected one is parked for an operator.

            Exit codes (sysexits): 0 ok, 64 usage, 65 bad input, 69 unavailable, 74 I/O error,
            75 temporary failure (retry later), 77 authentication refused, 78 configuration error.
            """,
        version: DQVersion.current,
        subcommands: [
            Enqueue.self, Send.self, Flush.self, Status.self, List.self, Show.self, Retry.self, Drop.self, Log.self,
            Decrypt.self, Keygen.self, Register.self,
        ])
}

/// Options shared by every command that opens a queue.
struct QueueOptions: ParsableArguments {
    @Option(help: "The config file (JSON). Default: $DQ_CONFIG, else ./dq.json if present.")
    var config: String?

    @Option(help: "The FHIR base URL. Overrides \"server\" and $DQ_SERVER.")
    var server: String?

    @Option(help: "The queue database file. Overrides \"database\" and $DQ_DATABASE.")
    var database: String?

    @Option(help: "full (survives power loss, default) or normal (faster). Overrides \"durability\".")
    var durability: String?

    @Flag(help: "Make retried creates safe with conditional create (If-None-Exist).")
    var idempotent = false

    @Option(parsing: .unconditional, help: "Request deadline in seconds (default 30).")
    var timeout: Double?

    @Flag(name: [.short, .long], help: "Log more (to standard error).")
    var verbose = false

    func validate() throws {
        if let timeout { try checkFlagSeconds(timeout, name: "--timeout", allowZero: false) }
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
    static let unavailable: Int32 = 69
    static let ioError: Int32 = 74
    static let temporaryFailure: Int32 = 75
    static let permissionDenied: Int32 = 77
    static let configuration: Int32 = 78

    static func code(for error: DataQueueError) -> Int32 {
        switch error.code {
        case .invalidResource, .notFound, .encryption: return dataError
        case .invalidConfiguration: return configuration
        case .storage, .storageFull: return ioError
        case .transport, .busy: return temporaryFailure
        case .authentication: return permissionDenied
        default: return 1
        }
    }
}

/// Prints to standard error.
func printError(_ text: String) {
    FileHandle.standardError.write(Data((text + "\n").utf8))
}

var standardErrorIsTerminal: Bool { isatty(2) == 1 }

/// Opens the queue, runs `body`, shuts down, and turns errors into messages and exit codes.
///
/// `readOnly` opens an existing queue without creating or writing anything (for commands that only read).
func withQueue<T>(_ options: QueueOptions, readOnly: Bool = false, _ body: (DataQueue) async throws -> T) async throws -> T {
    // Past a file-size limit, writes must fail with EFBIG (reported as "full"), not kill the process.
    signal(SIGXFSZ, SIG_IGN)
    let level: Logger.Level
    if options.verbose {
        level = .debug
    } else if let text = ProcessInfo.processInfo.environment["DQ_LOG_LEVEL"], let parsed = Logger.Level(rawValue: text) {
        level = parsed
    } else {
        level = .warning
    }
    LoggingSystem.bootstrap { label in
        var handler = StreamLogHandler.standardError(label: label)
        handler.logLevel = level
        return handler
    }
    let logger = Logger(label: "dq")
    let queue: DataQueue
    do {
        queue = try DataQueueSettings.load(options: options).makeQueue(readOnly: readOnly, logger: logger)
    } catch let error as DataQueueError {
        printError("dq: \(error.message)")
        throw ExitCode(Exit.code(for: error))
    }
    func close() async {
        try? await queue.shutdown()
    }
    do {
        let result = try await body(queue)
        await close()
        return result
    } catch let error as DataQueueError {
        await close()
        printError("dq: \(error.message)")
        throw ExitCode(Exit.code(for: error))
    } catch {
        await close()
        throw error
    }
}

/// JSON for `--json` output: sorted keys, ISO 8601 dates, no escaped slashes.
func printJSON<T: Encodable>(_ value: T) throws {
    let encoder = JSONEncoder()
    encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
    encoder.dateEncodingStrategy = .iso8601
    let data = try encoder.encode(value)
    FileHandle.standardOutput.write(data)
    FileHandle.standardOutput.write(Data("\n".utf8))
}

func formatDate(_ date: Date?) -> String {
    guard let date else { return "-" }
    let formatter = ISO8601DateFormatter()
    return formatter.string(from: date)
}
