import ArgumentParser
import FHIRDataQueue
import Foundation

/// Options for commands that read resources.
struct InputOptions: ParsableArguments {
    @Argument(help: "Resource files (JSON), or - for standard input.")
    var files: [String]

    @Flag(help: "Each input holds one resource per line (NDJSON).")
    var ndjson = false

    @Option(help: "POST (create), PUT (update, needs id) or auto (PUT when the resource has an id).")
    var method: MethodChoice = .auto

    @Option(parsing: .unconditional, help: "The largest resource in bytes (\"max_resource_bytes\", else 64 MiB).")
    var maxBytes: Int?

    func validate() throws {
        if files.isEmpty { throw ValidationError("give at least one file, or - for standard input") }
        if let maxBytes, maxBytes < 2 { throw ValidationError("--max-bytes must be at least 2") }
    }

    /// Reads, checks and queues every input in one transaction, checking the next inputs while the ones
    /// before are written; on any problem prints each and exits without queueing anything (65; 66 when an
    /// input file is missing or unreadable).
    ///
    /// - Parameter progress: show progress on a terminal (`dq enqueue` without `--json`).
    func enqueue(limit: Int, queue: DataQueue, progress: Bool = false) async throws -> [QueuedItem] {
        let reader = InputReader(maximumSize: maxBytes ?? limit, ndjson: ndjson)
        let (documents, problems, _) = reader.documents(files)
        // An unreadable file or no input at all: the reading path names every problem.
        guard problems.isEmpty, !documents.isEmpty else {
            return try await queue.enqueue(resources(limit: limit, queue: queue))
        }
        let maximumSize = reader.maximumSize
        let method = method
        // Only for inputs large enough to take a while (a chunk of the bulk path is 4,096).
        let display = TerminalProgress("checked and written", enabled: progress && documents.count > 4096)
        defer { display?.finish() }
        do {
            return try await queue.enqueue(
                count: documents.count,
                entry: { index in
                    var entry = try QueueEntry(json: documents[index].data, maximumSize: maximumSize)
                    entry.method = method.method(for: entry, queue: queue)
                    if entry.method == .put && entry.resource.id == nil {
                        throw DataQueueError(.invalidResource, "a PUT (update) needs the resource's \"id\"")
                    }
                    return entry
                },
                progress: { display?.update($0, of: documents.count) })
        } catch let error as EnqueueProblems {
            for problem in error.problems { printError("dq: \(documents[problem.index].label): \(problem.error.message)") }
            printError("dq: \(error.problems.count) bad input(s); nothing was queued")
            throw ExitCode(Exit.dataError)
        }
    }

    /// Reads every input; on any problem prints each and exits without queueing anything: 66 when an input
    /// file is missing or unreadable, else 65.
    func resources(limit: Int, queue: DataQueue) throws -> [QueueEntry] {
        let reader = InputReader(maximumSize: maxBytes ?? limit, ndjson: ndjson)
        let (inputs, problems, unreadable) = reader.read(files)
        var invalid = problems
        var resources: [QueueEntry] = []
        for input in inputs {
            var entry = input.entry
            entry.method = method.method(for: entry, queue: queue)
            if entry.method == .put && entry.resource.id == nil {
                invalid.append("\(input.label): a PUT (update) needs the resource's \"id\"")
                continue
            }
            resources.append(entry)
        }
        if !invalid.isEmpty {
            for problem in invalid { printError("dq: \(problem)") }
            printError("dq: \(invalid.count) bad input(s); nothing was queued")
            throw ExitCode(unreadable ? Exit.noInput : Exit.dataError)
        }
        if resources.isEmpty {
            printError("dq: the input holds no resources; nothing was queued")
            throw ExitCode(Exit.dataError)
        }
        return resources
    }
}

extension DQ {
    struct Enqueue: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "enqueue",
            abstract: "Queue resources without sending them (all inputs, or none when one is bad).",
            discussion: """
                A transaction or batch Bundle is queued as one item and sent as it is; references between its \
                entries (their urn:uuid fullUrls) are the server's to resolve. To let separate items reference each \
                other, write each input (or NDJSON line) as a Bundle entry, {"fullUrl": "urn:uuid:...", \
                "resource": {...}}, and reference that urn:uuid from later items: dq sends them together in a \
                transaction Bundle where it can, and otherwise rewrites the reference to where the server stored \
                the resource. A reference to a urn:uuid that neither the Bundle nor an earlier item declares is \
                refused (exit 65).

                With --idempotent (or "idempotent": true), a create whose resource has no identifier gets one \
                (system urn:ietf:rfc:3986, the item's urn:uuid), sent as If-None-Exist, so that a retry after a \
                lost answer does not create it twice.
                """)

        @OptionGroup var queueOptions: QueueOptions
        @OptionGroup var sending: SendingOptions
        @OptionGroup var input: InputOptions
        @Flag(help: "Print the queued items as JSON.") var json = false

        func run() async throws {
            try await withQueue(queueOptions, sending: sending) { queue in
                let items = try await input.enqueue(limit: queue.configuration.maximumResourceSize, queue: queue, progress: !json)
                if json {
                    try printJSON(items)
                } else {
                    print("queued \(items.count) resource(s) for \(queue.queueName)")
                }
            }
        }
    }

    struct Send: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "send",
            abstract: "Queue resources, then flush the queue up to them (older items go first).",
            discussion: """
                Exit 0 when all were delivered, 75 when some stay queued, 65 when some were parked (rejected by \
                the server, or held back unsent because a reference cannot be resolved), 77 on an authentication \
                failure; the first of 77, 75, 65 wins.
                """
        )

        @OptionGroup var queueOptions: QueueOptions
        @OptionGroup var sending: SendingOptions
        @OptionGroup var input: InputOptions
        @Flag(help: "Print the outcome as JSON.") var json = false

        func run() async throws {
            let code: Int32 = try await withQueue(queueOptions, sending: sending) { queue in
                let resources = try input.resources(limit: queue.configuration.maximumResourceSize, queue: queue)
                let items = try await queue.enqueue(resources)
                let report = try await queue.flush(force: false, lockWait: queue.configuration.lockWait)
                var delivered = 0
                var parked = 0
                var queued = 0
                var outcomes: [[String: String]] = []
                for item in items {
                    let state: String
                    switch try await queue.state(of: item.id) {
                    case .parked:
                        parked += 1
                        // Parked without an answer of the server: dq held it back unsent.
                        state = try await queue.item(item.id.uuidString.lowercased()).0.lastStatus == nil ? "held" : "parked"
                    case .pending: queued += 1; state = "queued"
                    case nil: delivered += 1; state = "delivered"
                    }
                    outcomes.append(["id": item.id.uuidString.lowercased(), "resourceType": item.resourceType, "state": state])
                }
                var authenticationFailed = false
                if case .authentication = report.stop { authenticationFailed = true }
                let code = Exit.outcome(authenticationFailed: authenticationFailed, pending: queued > 0, rejected: parked > 0)
                if json {
                    struct Summary: Encodable {
                        var items: [[String: String]]
                        var delivered, queued, parked: Int
                        var exitCode: Int32
                    }
                    try printJSON(
                        Summary(items: outcomes, delivered: delivered, queued: queued, parked: parked, exitCode: code))
                } else {
                    print("sent \(items.count) resource(s): \(delivered) delivered, \(queued) queued, \(parked) parked")
                    if let stop = report.stop { printError("dq: \(FlushCommandSupport.describe(stop))") }
                }
                return code
            }
            if code != 0 { throw ExitCode(code) }
        }
    }
}
