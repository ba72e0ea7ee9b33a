import DQTestSupport
import Foundation
import Logging
import NIOConcurrencyHelpers
import PostgresNIO
import ServiceLifecycle
import Testing

@testable import FHIRDataQueue

/// The stores the conformance suite runs against: SQLite always; PostgreSQL when `make test` started one
/// (`DQ_TEST_POSTGRES_URL`), and required then when `DQ_REQUIRE_PEERS=1`.
enum StoreKind: String, CaseIterable, Sendable, CustomTestStringConvertible {
    case sqlite
    case postgres
    /// PostgreSQL with `prepared_statements=off`: the unnamed statements dq falls back to behind a pooler.
    case postgresUnprepared
    /// PostgreSQL through a client the host made and runs in its own `ServiceGroup` (postgres-nio's way).
    case postgresHostClient

    var testDescription: String { rawValue }

    static var environment: [String: String] { ProcessInfo.processInfo.environment }

    /// The kinds to run: PostgreSQL only with a server to run against (a missing one fails under `make test`).
    /// The host-owned client runs the same SQL as `.postgres`: the tests marked ``withHostClient`` run it.
    static var available: [StoreKind] {
        if environment["DQ_TEST_POSTGRES_URL"] != nil || environment["DQ_REQUIRE_PEERS"] == "1" {
            return [.sqlite, .postgres, .postgresUnprepared]
        }
        return [.sqlite]
    }

    /// ``available`` and, with PostgreSQL, a client the test runs in its own `ServiceGroup`.
    static var withHostClient: [StoreKind] {
        available.contains(.postgres) ? available + [.postgresHostClient] : available
    }

    func make(in directory: URL) async throws -> any QueueStorage {
        switch self {
        case .sqlite:
            // Opened on a thread of its own, as DataQueue opens it: the lock and the schema's fsyncs would otherwise
            // hold a thread of the test run's small cooperative pool while the disk is busy.
            let path = directory.appendingPathComponent("q.sqlite").path
            return try await onThreadOfItsOwn { Result { try SQLiteQueueStore(path: path, durability: .normal) } }.get()
        case .postgresHostClient:
            let client = try await Self.hostClient(database: try await Self.freshDatabase())
            return PostgresQueueStore(client: client, logger: Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() }))
        case .postgres, .postgresUnprepared:
            // The default lease (30 s): a shorter one can lapse while a loaded two-core CI machine runs the whole
            // suite in parallel and the renewal round trips stall (no test here waits for an expiry; the fencing
            // test makes one on the database's clock).
            return try PostgresQueueStore(
                url: try await Self.freshDatabase() + (self == .postgresUnprepared ? "&prepared_statements=off" : ""), leaseSeconds: 30,
                environment: ["PGPASSWORD": Self.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""],
                logger: Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() }))
        }
    }

    /// A client for `database` (a URL), run by a `ServiceGroup` of the test's own, as a host runs it; the group
    /// is shut down when the test ends (the test needs the ``HostClientScope`` trait).
    static func hostClient(database: String) async throws -> PostgresClient {
        let scope = try #require(HostClients.current, "a test that makes host clients needs the .hostClientsShutDown trait")
        let components = try #require(URLComponents(string: database))
        let configuration = PostgresClient.Configuration(
            host: components.host ?? "127.0.0.1", port: components.port ?? 5432, username: components.user ?? "dq",
            password: environment["DQ_TEST_POSTGRES_PASSWORD"], database: String(components.path.dropFirst()), tls: .disable)
        let client = PostgresClient(configuration: configuration)
        let group = ServiceGroup(
            services: [client], logger: Logger(label: "dq.test.host", factory: { _ in SwiftLogNoOpLogHandler() }))
        scope.add(group, Task { try await group.run() })
        return client
    }

    /// A new, empty database on the test server (one per test: the tests run in parallel).
    static func freshDatabase() async throws -> String {
        let base = try #require(environment["DQ_TEST_POSTGRES_URL"], "no PostgreSQL for the tests: run make test")
        var components = try #require(URLComponents(string: base))
        let name = "dq_t_" + UUID().uuidString.prefix(12).lowercased().replacingOccurrences(of: "-", with: "")
        let arguments = [
            "-h", components.host ?? "127.0.0.1", "-p", String(components.port ?? 5432), "-U", components.user ?? "dq", "-d",
            String(components.path.dropFirst()), "-qc", "CREATE DATABASE \(name)",
        ]
        let psqlEnvironment = ["PGPASSWORD": environment["DQ_TEST_POSTGRES_PASSWORD"] ?? "", "PATH": "/usr/bin:/bin"]
        try #require(
            try await runToExit("/usr/bin/psql", arguments, environment: psqlEnvironment, stdout: .inherit) == 0,
            "psql could not create a test database")
        components.path = "/" + name
        components.query = "sslmode=disable"
        return components.string!
    }
}

/// The host-owned PostgreSQL clients a test made (``StoreKind/hostClient(database:)``), shut down when it ends.
/// A client left running keeps its connections until the process ends: across the suite they used up the
/// server's max_connections, and every later test's connections waited ("did not answer within 15 s").
final class HostClients: Sendable {
    @TaskLocal static var current: HostClients?
    private let running = NIOLockedValueBox<[(ServiceGroup, Task<Void, any Error>)]>([])

    func add(_ group: ServiceGroup, _ task: Task<Void, any Error>) { running.withLockedValue { $0.append((group, task)) } }

    /// Shuts every group down gracefully and waits for its client to close its connections.
    func shutDown() async {
        for (group, task) in running.withLockedValue({ $0 }) {
            await group.triggerGracefulShutdown()
            _ = try? await task.value
        }
    }
}

/// Runs each test with a ``HostClients`` scope of its own and shuts its clients down after it.
struct HostClientScope: SuiteTrait, TestTrait, TestScoping {
    var isRecursive: Bool { true }

    func provideScope(
        for test: Test, testCase: Test.Case?, performing function: @Sendable () async throws -> Void
    ) async throws {
        let clients = HostClients()
        try await HostClients.$current.withValue(clients) {
            do {
                try await function()
            } catch {
                await clients.shutDown()
                throw error
            }
            await clients.shutDown()
        }
    }
}

extension Trait where Self == HostClientScope {
    /// Shuts down the host-owned PostgreSQL clients a test made when it ends.
    static var hostClientsShutDown: Self { Self() }
}

/// The contract of the storage seam (``QueueStorage``): what every store must do, whatever it is built on.
/// Each test runs once per ``StoreKind``, one at a time: each makes a database of its own (PostgreSQL 15 copies
/// template1 into the WAL, ~8 MB with fsync), and run all at once beside the rest of the suite on two cores
/// they queued for the disk past an operation's 15 s deadline.
@Suite("Storage conformance", .serialized, .hostClientsShutDown)
struct StorageConformanceTests {
    let directory: URL
    let scratch: Scratch
    static let server = "http://h/fhir"

    init() throws {
        scratch = try Scratch("dq-store")
        directory = scratch.url
    }

    func item(_ index: Int, queue: String = Self.server, fullURL: String? = nil) -> NewItem {
        NewItem(
            id: UUID.timeOrdered(), queue: queue, method: .post, url: "Patient", resourceType: "Patient", resourceID: nil,
            encrypted: false, contentType: "application/fhir+json", body: Data(#"{"resourceType":"Patient","n":\#(index)}"#.utf8),
            fullURL: fullURL)
    }

    func bodies(_ items: [StoredItem]) -> [String] { items.map { String(decoding: $0.body, as: UTF8.self) } }

    /// Every pending item of `queue`, read in batches as a flusher does.
    func drain(_ store: any QueueStorage, queue: String = Self.server) async throws -> [StoredItem] {
        var all: [StoredItem] = []
        while true {
            let batch = try await store.pendingBatch(queue: queue, after: all.last?.info.sequence ?? 0, maxCount: 3, maxBytes: 1 << 20)
            if batch.isEmpty { return all }
            all += batch
        }
    }

    @Test("Items come back per server, in enqueue order, with their bodies", arguments: StoreKind.withHostClient)
    func order(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        let first = try await store.insert((0..<4).map { item($0) } + [item(99, queue: "http://h/other")])
        let second = try await store.insert([item(4)])
        #expect(first.count == 5 && second.count == 1)
        #expect(zip(first, first.dropFirst()).allSatisfy { $0 < $1 } && second[0] > first[3], "sequences rise in commit order")
        let drained = try await drain(store)
        #expect(drained.count == 5)
        #expect(bodies(drained) == (0..<5).map { #"{"resourceType":"Patient","n":\#($0)}"# })
        #expect(try await drain(store, queue: "http://h/other").count == 1)
        #expect(Set(try await store.queues()) == [Self.server, "http://h/other"])
    }

    @Test(
        "Every queue is listed once, in order, whether it holds items, only journal lines, or only a server state; status without the journal still counts its items",
        arguments: StoreKind.withHostClient)
    func queueNames(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        // Items of three queues (several rows each), one of them then delivered whole: only its journal remains.
        let journalOnly = "http://h/journal-only"
        _ = try await store.insert(
            (0..<3).map { item($0) } + (0..<2).map { item($0, queue: "http://a/first") } + (0..<2).map { item($0, queue: journalOnly) })
        let owner = try #require(try await store.acquireFlush(queue: journalOnly, until: .now))
        let recorder = DeliveryRecorder(store: store, owner: owner)
        for stored in try await drain(store, queue: journalOnly) {
            try recorder.record(
                CompletedDelivery(
                    item: stored.info, url: "http://h/journal-only/Patient", status: 201, location: nil, serverID: nil, versionID: nil))
        }
        try await recorder.finish()
        await owner.release()
        // A server state alone (its capabilities read, nothing queued).
        try await store.recordBundleSupport(queue: "http://z/state-only", transactions: true, batchLimit: nil, conditionalCreate: nil)
        #expect(try await drain(store, queue: journalOnly).isEmpty, "delivered: no item left")
        #expect(try await store.queues() == ["http://a/first", Self.server, journalOnly, "http://z/state-only"])
        let statuses = try await store.allStatuses(countingJournal: false)
        #expect(statuses.map(\.queue) == ["http://a/first", Self.server, journalOnly, "http://z/state-only"])
        #expect(statuses.map(\.pending) == [2, 3, 0, 0] && statuses.allSatisfy { $0.delivered == 0 })
        #expect(try await store.allStatuses(countingJournal: true).map(\.delivered) == [0, 0, 2, 0])
    }

    @Test("A large insert (several statements' worth) keeps order, every column and its NULLs", arguments: StoreKind.available)
    func largeInsert(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        var items = (0..<2500).map { item($0, fullURL: $0 % 2 == 0 ? "urn:uuid:\(UUID())" : nil) }
        items[7].request.resourceID = "p7"
        items[7].request.method = .put
        items[8].request.encrypted = true
        let sequences = try await store.insert(items)
        #expect(sequences.count == 2500 && zip(sequences, sequences.dropFirst()).allSatisfy { $0 + 1 == $1 })
        let single = try await store.insertGrouped(item(2500))
        #expect(single > sequences[2499])
        var stored: [StoredItem] = []
        while true {
            let batch = try await store.pendingBatch(
                queue: Self.server, after: stored.last?.info.sequence ?? 0, maxCount: 1000, maxBytes: 1 << 24)
            if batch.isEmpty { break }
            stored += batch
        }
        #expect(stored.count == 2501)
        #expect(bodies(stored) == (0...2500).map { #"{"resourceType":"Patient","n":\#($0)}"# })
        #expect(stored.map(\.info.id) == items.map(\.id) + [stored.last?.info.id].compactMap { $0 })
        #expect(stored[0].fullURL == items[0].fullURL && stored[1].fullURL == nil)
        #expect(stored[7].info.method == .put && stored[7].info.resourceID == "p7" && stored[6].info.resourceID == nil)
        #expect(stored[8].info.encrypted && !stored[9].info.encrypted)
    }

    @Test("A batch holds at most maxCount items and maxBytes, but always its first item", arguments: StoreKind.available)
    func batchLimits(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        _ = try await store.insert((0..<5).map { item($0) })
        let two = try await store.pendingBatch(queue: Self.server, after: 0, maxCount: 2, maxBytes: 1 << 20)
        #expect(two.count == 2)
        let tiny = try await store.pendingBatch(queue: Self.server, after: 0, maxCount: 5, maxBytes: 1)
        #expect(tiny.count == 1, "the first item goes whatever its size")
        let afterSecond = try await store.pendingBatch(queue: Self.server, after: two[1].info.sequence, maxCount: 5, maxBytes: 1 << 20)
        #expect(afterSecond.count == 3 && afterSecond.first?.info.sequence ?? 0 > two[1].info.sequence)
    }

    @Test("Concurrent grouped enqueues each get their own sequence and are all durable", arguments: StoreKind.available)
    func concurrentEnqueues(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        let sequences = try await withThrowingTaskGroup(of: Int64.self) { group in
            for index in 0..<200 { group.addTask { try await store.insertGrouped(item(index)) } }
            return try await group.reduce(into: [Int64]()) { $0.append($1) }
        }
        #expect(sequences.count == 200 && Set(sequences).count == 200)
        let drained = try await drain(store)
        #expect(drained.count == 200)
        #expect(drained.map(\.info.sequence) == sequences.sorted())
    }

    @Test(
        "An item is found by its id, a unique prefix or suffix, or its sequence; a shared prefix is ambiguous",
        arguments: StoreKind.available)
    func references(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        let items = (0..<3).map { item($0) }
        let sequences = try await store.insert(items)
        let ids = items.map(\.id.lowercasedString)
        #expect(try await store.item(ids[1]).info.sequence == sequences[1])
        #expect(try await store.item(String(ids[2].suffix(12))).info.sequence == sequences[2])
        #expect(try await store.item(String(ids[0].suffix(12)).uppercased()).info.sequence == sequences[0])
        #expect(try await store.item("\(sequences[1])").info.id == items[1].id)
        // Time-ordered ids queued in the same instant share their first characters.
        await #expect(throws: DataQueueError.self) { try await store.item(String(ids[0].prefix(4))) }
        await #expect(throws: DataQueueError.self) { try await store.item("ffffffff") }
        await #expect(throws: DataQueueError.self) { try await store.item("x';--") }
    }

    @Test(
        "A reference of digits alone is looked up as a sequence and as an id; two different items make it ambiguous, '#N' names the sequence",
        arguments: StoreKind.available)
    func digitReferences(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        var first = item(0)
        first.id = try #require(UUID(uuidString: "0193a1b2-c3d4-7e5f-8a9b-832911116327"))
        let firstSequence = try #require(try await store.insert([first]).first)
        var second = item(1)
        second.id = try #require(UUID(uuidString: String(format: "0193a1b2-c3d4-7e5f-8a9b-%012lld", firstSequence)))
        let secondSequence = try #require(try await store.insert([second]).first)
        // Only an id ends in these digits, and no item has this sequence: the id's item, not "no queued item".
        #expect(try await store.item("832911116327").info.sequence == firstSequence)
        #expect(try await store.item("6327").info.sequence == firstSequence)
        // The first item's sequence, zero-padded, is also the end of the second item's id.
        let padded = String(format: "%012lld", firstSequence)
        await #expect(throws: DataQueueError.self) { try await store.item(padded) }
        do {
            _ = try await store.item(padded)
        } catch let error as DataQueueError {
            #expect(error.message.contains("ambiguous") && error.message.contains("#\(padded)"))
        }
        #expect(try await store.item("#\(firstSequence)").info.id == first.id)
        #expect(try await store.item("#\(secondSequence)").info.id == second.id)
        await #expect(throws: DataQueueError.self) { try await store.item("#6327") }
        // A sequence too short to be an id part is only a sequence.
        #expect(try await store.item("\(secondSequence)").info.id == second.id)

        let owner = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        let recorder = DeliveryRecorder(store: store, owner: owner)
        for (stored, serverID) in [
            (try await store.item("#\(firstSequence)").info, "a"), (try await store.item("#\(secondSequence)").info, "b"),
        ] {
            try recorder.record(
                CompletedDelivery(item: stored, url: "http://h/fhir/Patient", status: 201, location: nil, serverID: serverID))
        }
        try await recorder.finish()
        await owner.release()
        #expect(try await store.journalLine("832911116327")?.serverID == "a")
        #expect(try await store.journalLine("#\(firstSequence)")?.serverID == "a")
        await #expect(throws: DataQueueError.self) { try await store.journalLine(padded) }
    }

    @Test("Delivery moves an item to the journal; park, retry and drop keep records", arguments: StoreKind.withHostClient)
    func lifecycle(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        let sequences = try await store.insert([item(0, fullURL: "urn:uuid:a"), item(1), item(2), item(3)])
        #expect(try await store.knownFullURLs(["urn:uuid:a", "urn:uuid:b"]) == ["urn:uuid:a"])
        let owner = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        let first = try await store.item(String(sequences[0])).info
        let recorder = DeliveryRecorder(store: store, owner: owner)
        try recorder.record(
            CompletedDelivery(
                item: first, url: "http://h/fhir/Patient", status: 201, location: "http://h/fhir/Patient/a/_history/1",
                serverID: "a", versionID: "1", fullURL: "urn:uuid:a"))
        try await recorder.finish()
        #expect(try await store.deliveredLocations(fullURLs: ["urn:uuid:a"]) == ["urn:uuid:a": "Patient/a"])
        #expect(try await store.knownFullURLs(["urn:uuid:a"]) == ["urn:uuid:a"], "a delivered fullUrl stays known")
        let second = try await store.item(String(sequences[1])).info
        try await store.park(second, url: "http://h/fhir/Patient", status: 400, error: "rejected", outcome: "{}", owner: owner)
        let third = try await store.item(String(sequences[2])).info
        try await store.drop(third, url: "http://h/fhir/Patient")
        let status = try await store.status(queue: Self.server, countingJournal: true)
        #expect(status.pending == 1 && status.parked == 1 && status.delivered == 1)
        // Without counting the journal: the same counts of the queue, the last delivery's time, and no journal totals.
        let uncounted = try await store.status(queue: Self.server, countingJournal: false)
        #expect(uncounted.pending == 1 && uncounted.parked == 1 && uncounted.delivered == 0 && uncounted.duplicates == 0)
        #expect(uncounted.lastDeliveryAt != nil && uncounted.lastDeliveryAt == status.lastDeliveryAt)
        #expect(uncounted.oldestPendingAt == status.oldestPendingAt)
        #expect(try await store.items(queue: Self.server, state: .parked, limit: 10).map(\.sequence) == [sequences[1]])
        let journal = try await store.deliveries(queue: nil, limit: 10)
        #expect(journal.count == 3)
        #expect(Set(journal.map(\.event)) == [.delivered, .parked, .dropped])
        #expect(try await store.journalLine(String(sequences[0]))?.serverID == "a")
        #expect(try await store.retry(sequence: second.sequence, conditionalCreate: false))
        #expect(try await store.retry(sequence: second.sequence, conditionalCreate: nil) == false, "no longer parked")
        let retried = try await store.item(String(sequences[1]))
        #expect(retried.info.state == .pending && retried.conditionalCreate == false)
        #expect(try await drain(store).map(\.info.sequence) == [sequences[1], sequences[3]], "a retried item keeps its place")
        try await store.park(retried.info, url: "http://h/fhir/Patient", status: 422, error: "again", outcome: nil, owner: owner)
        #expect(try await store.retryAllParked(queue: Self.server) == 1)
        await owner.release()
    }

    @Test(
        "Sealed at rest: the stored values hold nothing of an item, all reads back; the journal finds fullUrls by keyed hash; a rekey reseals; other keys are refused",
        arguments: StoreKind.withHostClient)
    func sealedAtRest(kind: StoreKind) async throws {
        let inner = try await kind.make(in: directory)
        let logger = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })
        let lazily = kind == .postgresHostClient
        let first = AtRestKey.generate().key
        let store = try await SealedStorage.open(inner, keys: AtRestKeys(current: first), readOnly: false, lazily: lazily, logger: logger)
        var put = item(1)
        put.request.method = .put
        put.request.resourceID = "secret-id"
        put.request.path = "Patient/secret-id"
        let sequences = try await store.insert([item(0, fullURL: "urn:uuid:sealed-a"), put])
        let grouped = try await store.insertGrouped(item(2))

        let raw = try await inner.rawItems(after: 0, limit: 10)
        #expect(raw.map(\.info.sequence) == sequences + [grouped])
        for row in raw {
            #expect(String(decoding: row.body, as: UTF8.self).contains("resourceType") == false, "the body is sealed")
            #expect(row.info.url.hasPrefix("dqs1.\(first.id).") && !row.info.url.contains("Patient"))
        }
        #expect(raw[0].fullURL?.hasPrefix("dqx1.") == true && raw[0].fullURL?.contains("sealed-a") == false)
        #expect(raw[1].info.resourceID?.hasPrefix("dqs1.") == true)
        #expect(try await inner.sealKeys().map(\.id) == [first.id])
        #expect(try await inner.sealedCounts() == [first.id: 3])

        let drained = try await drain(store)
        #expect(bodies(drained) == (0..<3).map { #"{"resourceType":"Patient","n":\#($0)}"# })
        #expect(
            drained[0].fullURL == "urn:uuid:sealed-a" && drained[0].info.url == "Patient" && drained.allSatisfy { $0.unreadable == nil })
        #expect(drained[1].info.url == "Patient/secret-id" && drained[1].info.resourceID == "secret-id")
        #expect(try await store.knownFullURLs(["urn:uuid:sealed-a", "urn:uuid:b"]) == ["urn:uuid:sealed-a"])

        let owner = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        let recorder = DeliveryRecorder(store: store, owner: owner)
        try recorder.record(
            CompletedDelivery(
                item: drained[0].info, url: "http://h/fhir/Patient", status: 201, location: "http://h/fhir/Patient/a/_history/1",
                serverID: "a", versionID: "1", fullURL: "urn:uuid:sealed-a"))
        try await recorder.finish()
        #expect(try await store.deliveredLocations(fullURLs: ["urn:uuid:sealed-a"]) == ["urn:uuid:sealed-a": "Patient/a"])
        #expect(try await inner.deliveries(queue: nil, limit: 10).first?.fullURL?.hasPrefix("dqx1.") == true)
        try await store.park(
            drained[1].info, url: "http://h/fhir/Patient/secret-id", status: 400, error: "rejected", outcome: "secret answer", owner: owner)
        await owner.release()
        #expect(try await inner.items(queue: Self.server, state: .parked, limit: 10).first?.outcome?.hasPrefix("dqs1.") == true)
        #expect(try await store.items(queue: Self.server, state: .parked, limit: 10).first?.outcome == "secret answer")

        // A replacement made from a stale read changes nothing.
        let stale = SealedReplacement(
            sequence: grouped, url: "x", resourceID: nil, body: Data("x".utf8), fullURL: nil, outcome: nil,
            expectedBody: Data("not what is stored".utf8), expectedOutcome: nil)
        #expect(try await inner.replaceSealed([stale]) == 0)

        // A rekey: the second key seals, the first opens what it sealed until everything is sealed again.
        let second = AtRestKey.generate().key
        let rekeyed = try #require(
            try await SealedStorage.open(
                inner, keys: AtRestKeys(current: second, old: [first]), readOnly: false, lazily: false, logger: logger) as? SealedStorage)
        #expect(try await rekeyed.sealAll(only: .notUnderCurrentKey) { _ in } == 2)
        #expect(try await inner.sealedCounts() == [second.id: 2])
        #expect(Set(try await inner.sealKeys().map(\.id)) == [first.id, second.id])
        let alone = try await SealedStorage.open(inner, keys: AtRestKeys(current: second), readOnly: false, lazily: lazily, logger: logger)
        #expect(bodies(try await drain(alone)) == [#"{"resourceType":"Patient","n":2}"#], "the parked item is not pending")
        #expect(try await alone.deliveredLocations(fullURLs: ["urn:uuid:sealed-a"]) == ["urn:uuid:sealed-a": "Patient/a"], "one index key")

        // Another key, and no key, are refused for writing; nothing is changed.
        for keys in [AtRestKeys(current: AtRestKey.generate().key), nil] {
            await #expect(throws: DataQueueError.self) {
                let refused = try await SealedStorage.open(inner, keys: keys, readOnly: false, lazily: lazily, logger: logger)
                _ = try await refused.insert([item(9)])
            }
        }
        #expect(try await inner.rawItems(after: 0, limit: 10).count == 2)
    }

    @Test(
        "Processes that seal a plain queue at the same moment under different keys: one key is recorded, the others are told to use it",
        arguments: StoreKind.available)
    func firstSealersRace(kind: StoreKind) async throws {
        let inner = try await kind.make(in: directory)
        _ = try await inner.insert([item(0, fullURL: "urn:uuid:first")])
        let logger = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })
        let keys = (0..<6).map { _ in AtRestKey.generate().key }
        let opened = await withTaskGroup(of: Bool.self) { group in
            for key in keys {
                group.addTask {
                    let store = try? await SealedStorage.open(
                        inner, keys: AtRestKeys(current: key), readOnly: false, lazily: false, logger: logger)
                    return store != nil
                }
            }
            var count = 0
            for await sealed in group where sealed { count += 1 }
            return count
        }
        #expect(opened == 1, "one process seals the queue; the others are told which key it needs")
        let recorded = try await inner.sealKeys()
        #expect(recorded.count == 1, "one key, hence one index key: \(recorded.map(\.id))")
        #expect(try await inner.sealedCounts()[""] == nil, "the item is sealed")
    }

    @Test(
        "A sealed store refuses plain items, also from a writer that opened it while it was plain: one, grouped or bulk, nothing queued",
        arguments: StoreKind.available)
    func sealedRefusesPlainItems(kind: StoreKind) async throws {
        let inner = try await kind.make(in: directory)
        let logger = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })
        // A writer without a key that opened the queue while it was plain writes to the store itself.
        _ = try await inner.insert([item(0)])
        let sealed = try await SealedStorage.open(
            inner, keys: AtRestKeys(current: AtRestKey.generate().key), readOnly: false, lazily: false, logger: logger)
        #expect(try await inner.sealedCounts()[""] == nil, "the item queued before was sealed")
        let attempts: [(String, @Sendable () async throws -> Void)] = [
            ("one", { _ = try await inner.insert([item(1)]) }),
            ("grouped", { _ = try await inner.insertGrouped(item(2)) }),
            ("bulk", { [item = item(3)] in _ = try await inner.insert(chunks: 1) { _ in [item] } }),
        ]
        for (shape, attempt) in attempts {
            do {
                try await attempt()
                Issue.record("\(shape): a plain item was stored in a sealed queue")
            } catch let error as DataQueueError {
                #expect(error.code == .invalidConfiguration, "\(shape): \(error)")
                #expect(error.message.contains("sealed at rest") && error.message.contains("at_rest.key_file"), "\(error.message)")
            }
        }
        #expect(try await inner.rawItems(after: 0, limit: 10).count == 1, "nothing of the refused inserts is stored")
        // The writer with the key goes on; guarding again is no error.
        _ = try await sealed.insert([item(4)])
        try await inner.refusePlainItems()
        #expect(try await inner.rawItems(after: 0, limit: 10).count == 2)
        #expect(try await inner.sealedCounts()[""] == nil)
    }

    @Test(
        "A queue sealed after deliveries: its journal's fullUrls become keyed hashes, and a bulk enqueue may reference them",
        arguments: StoreKind.available)
    func sealedAfterDeliveries(kind: StoreKind) async throws {
        let inner = try await kind.make(in: directory)
        let logger = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })
        let patient = "urn:uuid:" + UUID().uuidString.lowercased()
        _ = try await inner.insert([item(0, fullURL: patient)])
        let delivered = try await drain(inner)
        let owner = try #require(try await inner.acquireFlush(queue: Self.server, until: .now))
        let recorder = DeliveryRecorder(store: inner, owner: owner)
        try recorder.record(
            CompletedDelivery(
                item: delivered[0].info, url: "http://h/fhir/Patient", status: 201, location: "http://h/fhir/Patient/p/_history/1",
                serverID: "p", versionID: "1", fullURL: patient))
        try await recorder.finish()
        await owner.release()
        #expect(try await inner.deliveries(queue: nil, limit: 10).first?.fullURL == patient, "written plain, before sealing")

        let store = try await SealedStorage.open(
            inner, keys: AtRestKeys(current: AtRestKey.generate().key), readOnly: false, lazily: false, logger: logger)
        let lines = try await inner.deliveries(queue: nil, limit: 10)
        #expect(lines.count == 1 && lines[0].fullURL?.hasPrefix(Sealer.indexPrefix) == true, "\(lines.map(\.fullURL))")
        #expect(try await store.deliveredLocations(fullURLs: [patient]) == [patient: "Patient/p"])
        var referring = item(1)
        referring.references = [patient]
        let observation = referring
        let stored = try await store.insert(chunks: 1) { _ in [observation] }
        #expect(stored.count == 1)
        #expect(try await inner.plainJournalFullURLs(limit: 10).isEmpty)
    }

    @Test("Pruning the journal removes only lines older than asked, oldest first, and never a queued item", arguments: StoreKind.available)
    func pruneJournal(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        let sequences = try await store.insert((0..<6).map { item($0) })
        let owner = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        func deliver(_ range: Range<Int>) async throws {
            let recorder = DeliveryRecorder(store: store, owner: owner)
            for index in range {
                let info = try await store.item(String(sequences[index])).info
                try recorder.record(
                    CompletedDelivery(item: info, url: "http://h/fhir/Patient", status: 201, location: nil, serverID: "\(index)"))
            }
            try await recorder.finish()
        }
        try await deliver(0..<2)
        try await Task.sleep(for: .milliseconds(20))  // the journal's clock moves past the cutoff
        let cutoff = Date()
        try await Task.sleep(for: .milliseconds(20))
        try await deliver(2..<4)
        #expect(try await store.pruneJournal(before: Date(timeIntervalSince1970: 0)) { _ in } == 0, "nothing that old")
        #expect(try await store.pruneJournal(before: cutoff) { _ in } == 2)
        #expect(try await store.deliveries(queue: nil, limit: 10).compactMap(\.serverID) == ["2", "3"], "the newer lines stay")
        #expect(try await store.pruneJournal(before: cutoff) { _ in } == 0, "again: nothing left that old")
        #expect(try await store.pruneJournal(before: Date().addingTimeInterval(1)) { _ in } == 2)
        #expect(try await store.deliveries(queue: nil, limit: 10).isEmpty)
        #expect(try await drain(store).map(\.info.sequence) == Array(sequences[4...]), "queued items untouched")
        await owner.release()
    }

    @Test("Failures set the server's backoff; a delivery clears it; Bundle support is remembered", arguments: StoreKind.available)
    func serverState(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        let sequences = try await store.insert([item(0), item(1)])
        let owner = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        let first = try await store.item(String(sequences[0])).info
        let later = Date().addingTimeInterval(60)
        try await store.recordFailure(queue: Self.server, item: first, status: 503, error: "down", nextAttemptAt: later, owner: owner)
        try await store.recordFailure(queue: Self.server, item: nil, status: nil, error: "still down", nextAttemptAt: later, owner: owner)
        let state = try await store.serverState(queue: Self.server)
        #expect(state.failures == 2 && state.lastError == "still down")
        #expect(abs((state.nextAttemptAt ?? .distantPast).timeIntervalSince(later)) < 0.01)
        #expect(try await store.item(String(sequences[0])).info.attempts == 1)
        let recorder = DeliveryRecorder(store: store, owner: owner)
        try recorder.record(
            CompletedDelivery(item: first, url: "http://h/fhir/Patient", status: 201, location: nil, serverID: nil, versionID: nil))
        try await recorder.finish()
        #expect(try await store.serverState(queue: Self.server).failures == 0)

        #expect(try await store.bundleSupport(queue: Self.server) == BundleSupport())
        try await store.recordBundleSupport(
            queue: Self.server, transactions: true, batchLimit: nil, conditionalCreate: ["Patient", "Observation"])
        try await store.recordBundleSupport(queue: Self.server, transactions: nil, batchLimit: 7, conditionalCreate: nil)
        let support = try await store.bundleSupport(queue: Self.server)
        #expect(support.transactions == true && support.batchLimit == 7 && support.checkedAt != nil)
        #expect(support.conditionalCreate == ["Patient", "Observation"])
        await owner.release()
    }

    @Test("One flusher at a time per server; the in-flight note outlives its owner", arguments: StoreKind.withHostClient)
    func flushOwnership(kind: StoreKind) async throws {
        let store = try await kind.make(in: directory)
        let owner = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        #expect(try await store.acquireFlush(queue: Self.server, until: .now + .milliseconds(50)) == nil, "held")
        let other = try #require(try await store.acquireFlush(queue: "http://h/other", until: .now), "another server is free")
        await other.release()
        let before = Date()
        try await owner.markInFlight(sequence: 42)
        let after = Date()
        await owner.release()
        let next = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        let note = try #require(try await next.inFlight(), "the next owner sees the request left on the wire")
        // Its time is when it was written, or the end of the window it covers (a second at most): bounds from
        // clocks read around the write, not from now (a loaded `make test` makes each query take a second).
        #expect(note.sequence == 42)
        #expect(
            note.sentAt >= before.addingTimeInterval(-0.001) && note.sentAt <= after.addingTimeInterval(1.001),
            "\(note.sentAt) not within \(before)...\(after) + 1 s")
        try await next.clearInFlight()
        #expect(try await next.inFlight() == nil)
        await next.release()
        let third = try #require(try await store.acquireFlush(queue: Self.server, until: .now))
        #expect(try await third.inFlight() == nil, "a cleared note stays cleared for the owners after")
        await third.release()
    }

    @Test(
        "PostgreSQL: a store that finds the schema complete starts without DDL, so it does not wait behind a transaction on dq's tables",
        .enabled(if: StoreKind.available.contains(.postgres)))
    func startWithoutDDL() async throws {
        let url = try await StoreKind.freshDatabase()
        let logger = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })
        let environment = ["PGPASSWORD": StoreKind.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""]
        let first = try PostgresQueueStore(url: url, environment: environment, logger: logger)
        _ = try await first.insert([item(0)])  // the schema is made

        // Another session reads dq_server_state in a transaction that stays open (a report, a backup's
        // snapshot): ALTER TABLE ... ADD COLUMN IF NOT EXISTS would wait for it even with nothing to add.
        let components = try #require(URLComponents(string: url))
        let holder = try BackgroundProcess(
            "/usr/bin/psql",
            [
                "-h", components.host ?? "127.0.0.1", "-p", String(components.port ?? 5432), "-U", components.user ?? "dq", "-d",
                String(components.path.dropFirst()), "-qc",
                "BEGIN; LOCK TABLE dq_server_state IN ACCESS SHARE MODE; SELECT pg_sleep(60); COMMIT",
            ],
            environment: ["PGPASSWORD": environment["PGPASSWORD"] ?? "", "PATH": "/usr/bin:/bin"], stdout: .null)
        defer { holder.signal(SIGTERM) }
        var held = false
        for _ in 0..<600 where !held {
            for try await count in try await first.client.query(
                "SELECT count(*) FROM pg_locks WHERE relation = to_regclass('dq_server_state') AND pid <> pg_backend_pid()",
                logger: logger
            ).decode(Int.self) {
                held = count > 0
            }
            if !held { try await Task.sleep(for: .milliseconds(50)) }
        }
        try #require(held, "the other session holds its lock")

        let second = try PostgresQueueStore(url: url, environment: environment, logger: logger)
        let status = try await second.status(queue: Self.server, countingJournal: true)
        #expect(status.pending == 1, "the second store started and read while the other transaction stayed open")
        await second.shutdown()
        await first.shutdown()
    }

    @Test(
        "PostgreSQL: a flusher whose lease expired and was taken over can neither send nor write (the fence)",
        .enabled(if: StoreKind.available.contains(.postgres)))
    func fencing() async throws {
        let url = try await StoreKind.freshDatabase()
        let logger = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })
        let environment = ["PGPASSWORD": StoreKind.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""]
        // The stalled holder's lease would be renewed a third of its lifetime after it was taken, by its own
        // renewer, which a stalled process does not run: 300 s keeps the renewer out of the test however slowly
        // a loaded machine runs it (with 30 s, a run that took 20 s saw the renewal undo the expiry below).
        let first = try PostgresQueueStore(url: url, leaseSeconds: 300, environment: environment, logger: logger)
        let second = try PostgresQueueStore(url: url, leaseSeconds: 30, environment: environment, logger: logger)
        let sequences = try await first.insert([item(0), item(1)])
        let stale = try #require(try await first.acquireFlush(queue: Self.server, until: .now))
        #expect(try await second.acquireFlush(queue: Self.server, until: .now + .milliseconds(100)) == nil, "held")
        try await stale.markInFlight(sequence: sequences[0])

        // The holder stalls (SIGSTOP, a long GC pause) past its lease: on the database's clock it has expired.
        _ = try await first.client.query(
            "UPDATE dq_lease SET expires_at = now() - interval '1 second' WHERE queue = \(Self.server)", logger: logger
        ).collect()
        let fresh = try #require(try await second.acquireFlush(queue: Self.server, until: .now), "taken over")
        let note = try #require(try await fresh.inFlight(), "the new holder sees the request on the wire")
        #expect(note.sequence == sequences[0])

        // The stalled flusher wakes up: once its note's window has passed it may not note a send (before
        // anything else told it of the takeover), and its attempt leaves the new holder's view untouched;
        // each write it tries is refused.
        try await Task.sleep(for: try #require(stale as? PostgresLease).noteWindow + .milliseconds(50))
        await #expect(throws: DataQueueError.self) { try await stale.markInFlight(sequence: sequences[1]) }
        #expect(try await fresh.inFlight()?.sequence == sequences[0])
        let item0 = try await first.item(String(sequences[0])).info
        let parked = await #expect(throws: DataQueueError.self) {
            try await first.park(item0, url: "http://h/fhir/Patient", status: 400, error: "x", outcome: nil, owner: stale)
        }
        #expect(parked?.message.contains("took over") == true, "\(parked?.message ?? "")")
        await #expect(throws: DataQueueError.self) {
            try await first.recordFailure(
                queue: Self.server, item: item0, status: 503, error: "x", nextAttemptAt: nil, owner: stale)
        }
        let staleDelivery = await first.markDelivered(
            [CompletedDelivery(item: item0, url: "http://h/fhir/Patient", status: 201, location: nil, serverID: nil, versionID: nil)],
            owner: stale)
        if case .success = staleDelivery {
            Issue.record("a delivery was recorded under a lost lease")
        }
        await #expect(throws: DataQueueError.self) { try await stale.markInFlight(sequence: sequences[1]) }
        let status = try await second.status(queue: Self.server, countingJournal: true)
        #expect(status.pending == 2 && status.parked == 0 && status.delivered == 0, "nothing the stale flusher did was written")
        #expect(try await second.serverState(queue: Self.server).failures == 0)

        // The new holder's writes go through.
        let recorder = DeliveryRecorder(store: second, owner: fresh)
        try recorder.record(
            CompletedDelivery(item: item0, url: "http://h/fhir/Patient", status: 201, location: nil, serverID: "p", versionID: "1"))
        try await recorder.finish()
        #expect(try await second.status(queue: Self.server, countingJournal: true).delivered == 1)
        await fresh.release()
        await stale.release()
        await first.shutdown()
        await second.shutdown()
    }
}

@Suite("PostgreSQL URL options")
struct PostgresURLTests {
    @Test("prepared_statements is on unless the URL says off; another value is named in the error")
    func preparedStatementsOption() throws {
        let base = "postgres://dq@127.0.0.1:5432/q"
        #expect(try PostgresQueueStore.configuration(url: base, environment: [:]).2)
        #expect(try PostgresQueueStore.configuration(url: base + "?prepared_statements=on", environment: [:]).2)
        #expect(try !PostgresQueueStore.configuration(url: base + "?sslmode=disable&prepared_statements=off", environment: [:]).2)
        let error = #expect(throws: DataQueueError.self) {
            try PostgresQueueStore.configuration(url: base + "?prepared_statements=maybe", environment: [:])
        }
        #expect(error?.code == .invalidConfiguration)
        #expect(error?.message.contains("prepared_statements \"maybe\"") == true, "\(String(describing: error))")
    }

    @Test("statement names carry a hash of their SQL: another SQL text gets another name")
    func statementNames() {
        #expect(PreparedStatements.name("s", sql: "SELECT 1") == PreparedStatements.name("s", sql: "SELECT 1"))
        #expect(PreparedStatements.name("s", sql: "SELECT 1") != PreparedStatements.name("s", sql: "SELECT 2"))
        #expect(EnqueueOne.name != EnqueueMany.name)
        #expect(EnqueueOne.name.hasPrefix("dq_enqueue_one_"))
    }
}

/// `body`'s result, run on a thread of its own: for the store calls that block their caller.
func onThreadOfItsOwn<T: Sendable>(_ body: @escaping @Sendable () -> T) async -> T {
    await withCheckedContinuation { continuation in
        Thread { continuation.resume(returning: body()) }.start()
    }
}
