import FHIRDataQueue
import Foundation
import Logging
import Testing

/// `DataQueue` used in-process, as a data-collection service would, against a real server.
@Suite("DataQueue in-process against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct LibraryTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    func queue(_ base: String, idempotent: Bool = false) async throws -> DataQueue {
        var configuration = DataQueue.Configuration(databasePath: work.file("queue.sqlite"))
        configuration.idempotent = .init(idempotent)
        // One request per item: these tests script the answer to each request (BundleTests cover Bundles).
        configuration.batchSize = 1
        configuration.retryPolicy = RetryPolicy(initialDelay: 0, maximumDelay: 0)
        configuration.requestTimeout = 10
        return try await DataQueue(baseURL: URL(string: base)!, configuration: configuration)
    }

    @Test("create queues while the server is down, and a later create first flushes the older ones")
    func createFlushesFirst() async throws {
        let server = try FHIRServer()
        let queue = try await queue(server.base)
        for index in 0..<3 {
            let outcome = try await queue.create(try FHIRResource(json: Data(resources.observation(index).utf8)))
            guard case .queued(_, let reason) = outcome else {
                Issue.record("expected queued, got \(outcome)")
                continue
            }
            #expect(reason.contains("connection refused"))
        }
        try await server.start()
        let outcome = try await queue.create(try FHIRResource(json: Data(resources.observation(3).utf8)))
        guard case .delivered(let record) = outcome else {
            Issue.record("expected delivered, got \(outcome)")
            return
        }
        #expect(record.status == 201)
        #expect(record.location?.hasPrefix(server.base + "/Observation/") == true)
        #expect(record.serverID != nil && record.versionID == "1")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2", "3"])
        #expect(try await queue.status().pending == 0)
        try await queue.shutdown()
    }

    @Test("create of a resource the server rejects returns parked, with the reason")
    func createRejected() async throws {
        let server = try await FHIRServer.start()
        let queue = try await queue(server.base)
        let outcome = try await queue.create(try FHIRResource(json: Data(resources.invalid(0).utf8)))
        guard case .parked(let item, let reason) = outcome else {
            Issue.record("expected parked, got \(outcome)")
            return
        }
        #expect(reason.contains("400"))
        #expect(try await queue.items(state: .parked).map(\.id) == [item.id])
        try await queue.shutdown()
    }

    @Test("update sends PUT [base]/[type]/[id]")
    func updateUsesPut() async throws {
        let server = try await FHIRServer.start()
        let queue = try await queue(server.base)
        let json = #"{"resourceType":"Patient","id":"lib-1","active":true}"#
        let outcome = try await queue.update(try FHIRResource(json: Data(json.utf8)))
        guard case .delivered(let record) = outcome else {
            Issue.record("expected delivered, got \(outcome)")
            return
        }
        #expect(record.method == .put)
        #expect(record.url == server.base + "/Patient/lib-1")
        let stored = try await HTTP.json(server.base + "/Patient/lib-1")
        #expect(stored["active"] as? Bool == true)
        try await queue.shutdown()
    }

    @Test("64 concurrent producers and a concurrent flusher: each item is delivered once, each producer's order kept")
    func concurrentProducers() async throws {
        let server = try await FHIRServer.start()
        let queue = try await queue(server.base)
        let producers = 64
        let perProducer = 8  // under 100: a value's producer is value / 100
        try await withThrowingTaskGroup(of: Void.self) { group in
            for producer in 0..<producers {
                group.addTask {
                    for index in 0..<perProducer {
                        let value = producer * 100 + index
                        try await queue.enqueue(try FHIRResource(json: Data(resources.observation(value).utf8)))
                    }
                }
            }
            group.addTask { _ = try await queue.flush(lockWait: 30) }
            try await group.waitForAll()
        }
        let report = try await queue.flush(lockWait: 30)
        #expect(report.remaining == 0)
        let values = try await server.values("Observation", system: resources.system).compactMap(Int.init)
        #expect(values.count == producers * perProducer)
        #expect(Set(values).count == values.count, "no duplicates")
        for producer in 0..<producers {
            let mine = values.filter { $0 / 100 == producer }
            #expect(mine == mine.sorted(), "producer \(producer) order")
        }
        try await queue.shutdown()
    }

    @Test("A 503 with Retry-After stops the flush, keeps the order and backs off at least that long")
    func retryAfterIsHonoured() async throws {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server)
        let queue = try await queue(proxy.base)
        for index in 0..<3 { try await queue.enqueue(try FHIRResource(json: Data(resources.observation(index).utf8))) }
        try await proxy.inject(["pass", "503:120"])
        let report = try await queue.flush()
        #expect(report.delivered == 1 && report.remaining == 2)
        guard case .transient(_, let retryAt) = report.stop else {
            Issue.record("expected a transient stop, got \(String(describing: report.stop))")
            return
        }
        #expect(retryAt.timeIntervalSinceNow > 100)
        let skipped = try await queue.flush()
        guard case .backoff(let until) = skipped.stop else {
            Issue.record("expected a backoff stop, got \(String(describing: skipped.stop))")
            return
        }
        #expect(abs(until.timeIntervalSince(retryAt)) < 0.01)
        #expect((try await proxy.stats())["requests"] as? Int == 2, "a backing-off flush sends nothing")
        let forced = try await queue.flush(force: true)
        #expect(forced.delivered == 2 && forced.stop == nil)
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1", "2"])
        try await queue.shutdown()
    }

    @Test("A static bearer token is accepted; a wrong one stops the flush as an auth failure and loses nothing")
    func bearerToken() async throws {
        let token = "tok-\(UUID().uuidString)"
        let server = try await FHIRServer.start(tokens: [token])
        var configuration = DataQueue.Configuration(databasePath: work.file("auth.sqlite"))
        configuration.retryPolicy = RetryPolicy(initialDelay: 0, maximumDelay: 0)
        let wrong = try await DataQueue(
            baseURL: URL(string: server.base)!, configuration: configuration, authorization: StaticBearerToken("wrong"))
        for index in 0..<2 { try await wrong.enqueue(try FHIRResource(json: Data(resources.observation(index).utf8))) }
        let refused = try await wrong.flush()
        guard case .authentication = refused.stop else {
            Issue.record("expected an authentication stop, got \(String(describing: refused.stop))")
            return
        }
        #expect(refused.remaining == 2)
        try await wrong.shutdown()
        #expect("\(StaticBearerToken(token))".contains(token) == false)

        let right = try await DataQueue(
            baseURL: URL(string: server.base)!, configuration: configuration, authorization: StaticBearerToken(token))
        let report = try await right.flush(force: true)
        #expect(report.delivered == 2 && report.remaining == 0)
        try await right.shutdown()
        let (status, _) = try await HTTP.get(server.base + "/Observation")
        #expect(status == 401, "the server really requires the token")
    }

    /// Hands out a stale token first, the good one when asked to refresh.
    actor RotatingToken: AuthorizationProvider {
        let good: String
        var refreshes = 0
        init(good: String) { self.good = good }
        nonisolated func authorizationHeader(forceRefresh: Bool, logger: Logger) async throws -> String? {
            await header(forceRefresh)
        }
        func header(_ forceRefresh: Bool) -> String {
            if forceRefresh { refreshes += 1 }
            return refreshes > 0 ? "Bearer \(good)" : "Bearer stale"
        }
    }

    @Test("After a 401 the queue asks once for a fresh token and retries the same item")
    func refreshAfter401() async throws {
        let token = "tok-\(UUID().uuidString)"
        let server = try await FHIRServer.start(tokens: [token])
        var configuration = DataQueue.Configuration(databasePath: work.file("refresh.sqlite"))
        configuration.retryPolicy = RetryPolicy(initialDelay: 0, maximumDelay: 0)
        let provider = RotatingToken(good: token)
        let queue = try await DataQueue(baseURL: URL(string: server.base)!, configuration: configuration, authorization: provider)
        for index in 0..<3 { try await queue.enqueue(try FHIRResource(json: Data(resources.observation(index).utf8))) }
        let report = try await queue.flush()
        #expect(report.delivered == 3 && report.stop == nil)
        #expect(await provider.refreshes == 1, "one refresh, then the fresh token serves the rest")
        try await queue.shutdown()
    }
}
