import Foundation
import GRDB
import Logging
import NIOConcurrencyHelpers
import ServiceLifecycle
import Testing

@testable import FHIRDataQueue

#if canImport(Glibc)
    import Glibc
#endif

/// What the background service does when a flush fails with an error of its own (not a server's answer).
@Suite("The service's flush errors")
struct ServiceErrorTests {
    /// A directory of each test's own (a fresh instance per test), removed with it.
    let scratch: Scratch
    init() throws { scratch = try Scratch("dq-service") }

    /// Keeps every line logged through it.
    struct CapturingHandler: LogHandler {
        let captured: Lines
        var logLevel: Logger.Level = .trace
        var metadata: Logger.Metadata = [:]

        subscript(metadataKey key: String) -> Logger.Metadata.Value? {
            get { metadata[key] }
            set { metadata[key] = newValue }
        }

        func log(event: LogEvent) {
            captured.lines.withLockedValue { $0.append((event.level, event.message.description, event.metadata ?? [:])) }
        }
    }

    final class Lines: Sendable {
        let lines = NIOLockedValueBox<[(Logger.Level, String, Logger.Metadata)]>([])
    }

    /// Counts calls (of a watchdog's beat).
    final class Counter: Sendable {
        private let count = NIOLockedValueBox(0)
        var value: Int { count.withLockedValue { $0 } }
        func increment() { count.withLockedValue { $0 += 1 } }
    }

    /// Runs a service for `queue` (polling every 50 ms) in a group of its own, its log lines kept; its delivery
    /// loop's watchdog beats, if given, are counted: one per round and one per retry delay.
    static func serve(_ queue: DataQueue, beats: Counter? = nil) -> (ServiceGroup, Task<Void, any Error>, Lines) {
        let captured = Lines()
        let logger = Logger(label: "test") { _ in CapturingHandler(captured: captured) }
        let watchdog = beats.map { beats in DataQueueService.Watchdog(interval: .seconds(3600)) { beats.increment() } }
        let group = ServiceGroup(
            services: [
                DataQueueService(
                    queues: [queue], configuration: .init(pollInterval: .milliseconds(50), watchdog: watchdog), logger: logger)
            ],
            logger: Logger(label: "group", factory: { _ in SwiftLogNoOpLogHandler() }))
        return (group, Task { try await group.run() }, captured)
    }

    @Test(
        "A storage error is logged once with its level, backed off, and nothing is sent; the service keeps running",
        .timeLimit(.minutes(2)))
    func storageErrorLoggedOnce() async throws {
        let directory = scratch.url
        let path = directory.appendingPathComponent("q.sqlite").path
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/p/_history/1")) }
        var configuration = DataQueue.Configuration(databasePath: path)
        configuration.retryPolicy = RetryPolicy(initialDelay: 0.2, maximumDelay: 0.4, jitter: 0)
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        // A row dq did not write: every flush fails on it.
        let store = try #require(queue.store as? SQLiteQueueStore)
        try await store.database.write { db in try db.execute(sql: "UPDATE item SET state = 'weird'") }

        let beats = Counter()
        let (group, running, captured) = Self.serve(queue, beats: beats)
        // The same error over and over: at least five failed rounds (a beat for each round and one for each retry
        // delay), counted rather than timed, so that a loaded machine (which once ran no round in a fixed 1.5 s)
        // waits longer instead of failing.
        while beats.value < 10 { try await Task.sleep(for: .milliseconds(20)) }
        await group.triggerGracefulShutdown()
        try await running.value
        let errors = captured.lines.withLockedValue { $0.filter { $0.1 == "flush failed; items stay queued" } }
        #expect(errors.count == 1, "one line per change of error, not per attempt: \(errors.count)")
        #expect(errors.first?.0 == .error)
        let message = errors.first.map { "\($0.2["error"] ?? "")" } ?? ""
        #expect(message.contains("damaged"), "\(message)")
        #expect(server.requests.isEmpty)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test(
        "While the server is backed off, enqueues do not wake flushes: the service tries at most once per poll interval, not once per enqueue",
        .timeLimit(.minutes(2)))
    func backoffIgnoresEnqueues() async throws {
        let directory = scratch.url
        let server = try await ScriptedServer { _ in .respond(.init(status: 503)) }
        var configuration = DataQueue.Configuration(databasePath: directory.appendingPathComponent("q.sqlite").path)
        configuration.retryPolicy = RetryPolicy(initialDelay: 3600, maximumDelay: 3600, jitter: 0)
        let captured = Lines()
        let logger = Logger(label: "test") { _ in CapturingHandler(captured: captured) }
        let queue = try await DataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration, logger: logger)
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        let poll = 0.5
        let group = ServiceGroup(
            services: [
                DataQueueService(queues: [queue], configuration: .init(pollInterval: .milliseconds(Int64(poll * 1000))), logger: logger)
            ],
            logger: Logger(label: "group", factory: { _ in SwiftLogNoOpLogHandler() }))
        let running = Task { try await group.run() }
        while server.requests.isEmpty { try await Task.sleep(for: .milliseconds(10)) }
        // The first flush failed and backed off for an hour. Each enqueue now signals the service.
        let start = ContinuousClock.now
        for index in 0..<300 {
            try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient","id":"p\#(index)"}"#.utf8)))
        }
        let elapsed = (ContinuousClock.now - start) / .seconds(1)
        await group.triggerGracefulShutdown()
        try await running.value
        let tries = captured.lines.withLockedValue { $0.filter { $0.1 == "the server is backed off; nothing sent" }.count }
        // At most one try per poll interval while the enqueues ran (and one at each end); before, a try per wake-up.
        #expect(tries <= Int(elapsed / poll) + 2, "\(tries) tries in \(elapsed) s")
        #expect(!server.requests.contains { $0.bodyText.contains(#""id":"p"#) }, "nothing sent during the backoff")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A flush that backs off after a journal write failed is not a recovery: the error is not logged again when it recurs")
    func backoffIsNoRecovery() async throws {
        let directory = scratch.url
        let path = directory.appendingPathComponent("q.sqlite").path
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/p/_history/1")) }
        var configuration = DataQueue.Configuration(databasePath: path)
        configuration.retryPolicy = RetryPolicy(initialDelay: 0.1, maximumDelay: 0.1, jitter: 0)
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        let store = try #require(queue.store as? SQLiteQueueStore)
        // The journal write of a delivery fails (reads and other writes work): the server has the item, and
        // nothing more is sent until its delivery is journaled.
        try await store.database.write { db in
            try db.execute(sql: "CREATE TRIGGER refuse BEFORE DELETE ON item BEGIN SELECT RAISE(ABORT, 'refused'); END")
        }
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))

        let (group, running, captured) = Self.serve(queue)
        func failures() -> Int { captured.lines.withLockedValue { $0.filter { $0.1 == "flush failed; items stay queued" }.count } }
        while failures() == 0 { try await Task.sleep(for: .milliseconds(20)) }
        // A backoff a moment long (as one written before the database stopped taking writes), then the same error.
        let until = Date().addingTimeInterval(0.5).timeIntervalSince1970
        try await store.database.write { db in
            try db.execute(
                sql: """
                    INSERT INTO server_state (queue, failures, next_attempt_at, last_error) VALUES (?, 1, ?, 'x')
                    ON CONFLICT(queue) DO UPDATE SET failures = 1, next_attempt_at = excluded.next_attempt_at
                    """,
                arguments: [queue.queueName, until])
        }
        try await Task.sleep(for: .seconds(1.5))
        await group.triggerGracefulShutdown()
        try await running.value
        let lines = captured.lines.withLockedValue { $0.map(\.1) }
        #expect(failures() == 1, "\(lines)")
        #expect(!lines.contains("flushes work again"), "\(lines)")
        let posts = server.requests.filter { $0.method == "POST" }
        #expect(posts.count == 1, "\(server.requests.map { "\($0.method) \($0.uri)" })")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A queue database deleted or replaced under the service ends it with that error, sending nothing more", arguments: [false, true])
    func databaseReplaced(replace: Bool) async throws {
        let directory = scratch.url
        let path = directory.appendingPathComponent("q.sqlite").path
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/p/_history/1")) }
        let queue = try await DataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, configuration: DataQueue.Configuration(databasePath: path))
        let group = ServiceGroup(
            services: [DataQueueService(queues: [queue], configuration: .init(pollInterval: .milliseconds(50)))],
            logger: Logger(label: "group", factory: { _ in SwiftLogNoOpLogHandler() }))
        let running = Task { try await group.run() }
        try await Task.sleep(for: .milliseconds(200))
        if replace {
            // Another queue file moved into place (a restore): what is queued there must not wait for nothing.
            // The file is made first and renamed over the old one in one step, as a restore does: unlinking
            // first would let the service see a deleted file in between (it polls every 50 ms).
            let other = directory.appendingPathComponent("other.sqlite").path
            let made = try await DataQueue(
                baseURL: URL(string: server.baseURL + "/fhir")!, configuration: DataQueue.Configuration(databasePath: other))
            try await made.shutdown()
            for suffix in ["-wal", "-shm"] { unlink(path + suffix) }
            #expect(rename(other, path) == 0)
        } else {
            for suffix in ["", "-wal", "-shm"] { unlink(path + suffix) }
        }
        let ended = await #expect(throws: (any Error).self) { try await running.value }
        let text = String(describing: ended.map { $0 } as Any)
        #expect(text.contains(replace ? "replaced" : "deleted"), "\(text)")
        #expect(server.requests.isEmpty)
        try await queue.shutdown()
        try await server.shutdown()
    }

    /// Liveness is the loop coming round, not the process answering: a loop held inside a flush (here, its journal
    /// commit blocked by a test hook) turns /healthz's answer to not alive once it has been quiet for longer than one
    /// request, the settle time, a poll and the margin; released, it is alive again.
    @Test("A delivery loop held past its longest legitimate wait is not alive; released, it is again", .timeLimit(.minutes(2)))
    func livenessFollowsTheLoop() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-live-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/p/_history/1")) }
        var configuration = DataQueue.Configuration(databasePath: directory.appendingPathComponent("q.sqlite").path)
        configuration.requestTimeout = 0.5
        configuration.connectTimeout = 0.5
        configuration.settleDelay = 0
        // A request that runs past its half second on a loaded machine is a transient failure: tried again at once,
        // not after the default backoff (5 s, then 10, 20, 40...), which held a make test run past the time limit
        // before the loop ever reached the gate.
        configuration.retryPolicy = RetryPolicy(initialDelay: 0.05, maximumDelay: 0.2)
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        let gate = Gate()
        var serviceConfiguration = DataQueueService.Configuration(pollInterval: .milliseconds(50))
        serviceConfiguration.livenessMargin = .milliseconds(200)
        let service = DataQueueService(queues: [queue], configuration: serviceConfiguration)
        #expect(service.livenessLimit(queue) == .milliseconds(1250))
        #expect(service.liveness().alive, "not started: nothing to judge")
        let group = ServiceGroup(services: [service], logger: Logger(label: "group", factory: { _ in SwiftLogNoOpLogHandler() }))
        let running = Task { try await group.run() }

        // A first flush (only loops whose first flush returned are judged: it may open the store), then one held.
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        while try await queue.status().pending > 0 { try await Task.sleep(for: .milliseconds(50)) }
        queue.hooks.beforeJournalCommit = { gate.waitUntilOpen() }
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        // The answer arrived and the commit waits at the gate: the loop cannot come round. Judged only once it is
        // there: on a loaded machine a loop on its way to the gate (its request, its thread hops) can already be quiet
        // for longer than this test's small limit, and that is not the hold this test is about.
        while !gate.waiting { try await Task.sleep(for: .milliseconds(20)) }
        var stuck = service.liveness()
        while stuck.alive {
            try await Task.sleep(for: .milliseconds(50))
            stuck = service.liveness()
        }
        #expect(stuck.reasons.count == 1 && stuck.reasons[0].contains("has not come round"), "\(stuck.reasons)")
        #expect(gate.waiting, "the loop is held in the commit")
        gate.open()
        while !service.liveness().alive { try await Task.sleep(for: .milliseconds(50)) }
        while try await queue.status().pending > 0 { try await Task.sleep(for: .milliseconds(50)) }
        await group.triggerGracefulShutdown()
        try await running.value
        try await queue.shutdown()
        try await server.shutdown()
    }

    /// The decision on explicit instants: quiet for longer than the limit is stuck, up to it is not.
    @Test("Stuck means quiet for longer than the limit")
    func stuckDecision() {
        let start = ContinuousClock.now
        #expect(DataQueueService.stuck(since: start, now: start + .seconds(10), limit: .seconds(10)) == nil)
        #expect(DataQueueService.stuck(since: start, now: start + .seconds(11), limit: .seconds(10)) == .seconds(11))
    }

    /// A gate a test thread waits at (blocking: the journal commit hook runs on a thread of its own) until opened.
    final class Gate: Sendable {
        private let state = NIOLockedValueBox((open: false, waiting: false))
        var waiting: Bool { state.withLockedValue { $0.waiting } }
        func open() { state.withLockedValue { $0.open = true } }
        func waitUntilOpen() {
            while !state.withLockedValue({ state in
                state.waiting = !state.open
                return state.open
            }) {
                usleep(10_000)
            }
        }
    }
}
