import Foundation
import Testing

@testable import FHIRDataQueue

/// `enqueue(count:entry:)`: entries made on every core while the chunks before them are written, in one
/// transaction. On SQLite the chunks are inserted as they are made; on PostgreSQL they are collected first.
@Suite("Bulk enqueue, checked while it is written", .serialized, .hostClientsShutDown)
struct BulkEnqueueTests {
    let directory: URL
    let scratch: Scratch

    init() throws {
        scratch = try Scratch("dq-bulk")
        directory = scratch.url
    }

    func queue(_ kind: StoreKind, atRest: AtRestKeys? = nil) async throws -> DataQueue {
        var configuration = DataQueue.Configuration(durability: .normal)
        configuration.atRest = atRest
        switch kind {
        case .sqlite:
            configuration.databasePath = directory.appendingPathComponent("q.sqlite").path
        case .postgres, .postgresUnprepared:
            var components = try #require(URLComponents(string: try await StoreKind.freshDatabase()))
            components.password = StoreKind.environment["DQ_TEST_POSTGRES_PASSWORD"]
            configuration.databasePath = components.string! + (kind == .postgresUnprepared ? "&prepared_statements=off" : "")
        case .postgresHostClient:
            // The host's client, handed in as the queue's storage (its ServiceGroup runs it).
            let client = try await StoreKind.hostClient(database: try await StoreKind.freshDatabase())
            return try await DataQueue(
                baseURL: URL(string: "http://127.0.0.1:9/fhir")!, storage: .postgres(client: client), configuration: configuration)
        }
        return try await DataQueue(baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: configuration)
    }

    static func observation(_ index: Int, subject: String? = nil) -> Data {
        let reference = subject.map { #","subject":{"reference":"\#($0)"}"# } ?? ""
        return Data(
            #"{"resourceType":"Observation","status":"final","identifier":[{"system":"urn:bulk","value":"\#(index)"}],"code":{"text":"x"}\#(reference)}"#
                .utf8)
    }

    /// The identifier values of every pending item, in queue order.
    func pendingValues(_ queue: DataQueue) async throws -> [String] {
        // In batches of 1,000, as a flush reads: one read of 10,000 rows (decoded by a debug build on two busy
        // cores) outlasted an operation's 15 s deadline while the integration suites ran beside it.
        var items: [StoredItem] = []
        while true {
            let batch = try await queue.store.pendingBatch(
                queue: queue.queueName, after: items.last?.info.sequence ?? 0, maxCount: 1000, maxBytes: .max)
            if batch.isEmpty { break }
            items += batch
        }
        var values: [String] = []
        for item in items {
            let text = String(decoding: item.body, as: UTF8.self)
            let value = try #require(text.firstRange(of: #""value":""#).map { text[$0.upperBound...].prefix { $0 != "\"" } })
            values.append(String(value))
        }
        return values
    }

    @Test(
        "A chunk is cut into non-empty, consecutive pieces, one per worker with work: a chunk smaller than the cores has one piece per item (it trapped on 3 or more cores with a 1-item chunk)"
    )
    func piecesPerWorker() {
        for workers in 1...9 {
            for count in [0, 1, 2, 3, 5, 8, 4096, 4097] {
                let pieces = ChunkPieces.pieces(of: count, workers: workers)
                #expect(pieces.count <= workers)
                #expect(pieces.allSatisfy { !$0.isEmpty })
                #expect(pieces.flatMap { Array($0) } == Array(0..<count), "workers \(workers), count \(count)")
            }
        }
        #expect(ChunkPieces.pieces(of: 1, workers: 3) == [0..<1])
        #expect(ChunkPieces.pieces(of: 4, workers: 3) == [0..<2, 2..<4])
        #expect(ChunkPieces.pieces(of: 4096, workers: 2) == [0..<2048, 2048..<4096])
    }

    @Test("10,000 entries (three chunks) are all queued after what was there, in input order", arguments: StoreKind.withHostClient)
    func ordered(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        try await queue.enqueue(try FHIRResource(json: Self.observation(-1)))
        let items = try await queue.enqueue(count: 10_000) { index in QueueEntry(try FHIRResource(json: Self.observation(index))) }
        #expect(items.count == 10_000)
        #expect(zip(items, items.dropFirst()).allSatisfy { $0.sequence < $1.sequence })
        let values = try await pendingValues(queue)
        #expect(values.count == 10_001)
        #expect(values == ["-1"] + (0..<10_000).map(String.init))
        try await queue.shutdown()
    }

    @Test(
        "Sealed at rest: entries are sealed where they are made, stored sealed once, read back as given; an error names the fullUrl, not its hash",
        arguments: StoreKind.withHostClient)
    func sealed(kind: StoreKind) async throws {
        let key = AtRestKey.generate().key
        let queue = try await queue(kind, atRest: AtRestKeys(current: key))
        let patient = "urn:uuid:" + UUID().uuidString.lowercased()
        let count = 5_000
        let items = try await queue.enqueue(count: count) { index in
            QueueEntry(
                try FHIRResource(json: Self.observation(index, subject: index == count - 1 ? patient : nil)),
                fullURL: index == 0 ? patient : nil)
        }
        #expect(items.count == count)
        #expect(items.allSatisfy { $0.url == "Observation" })
        #expect(items[1].size == Self.observation(1).count, "the caller is told the size of what it gave")
        let sealed = try #require(queue.store as? SealedStorage)
        let raw = try await sealed.inner.rawItems(after: 0, limit: 2 * count)
        #expect(raw.count == count)
        #expect(raw.allSatisfy { Sealer.keyID(ofBody: $0.body) == key.id && $0.info.url.hasPrefix("dqs1.\(key.id).") })
        #expect(raw[0].fullURL?.hasPrefix("dqx1.") == true)
        // Read through the seal: sealed twice, a body would open to another sealed body.
        #expect(try await pendingValues(queue) == (0..<count).map(String.init))

        let unknown = "urn:uuid:" + UUID().uuidString.lowercased()
        await #expect {
            try await queue.enqueue(count: 10) { index in
                QueueEntry(try FHIRResource(json: Self.observation(index, subject: index == 9 ? unknown : nil)))
            }
        } throws: { error in
            let message = (error as? DataQueueError)?.message ?? ""
            return message.contains(unknown) && !message.contains("dqx1.")
        }
        let reused = try await queue.enqueue(count: 2) { index in
            QueueEntry(try FHIRResource(json: Self.observation(count + index, subject: patient)))
        }
        #expect(reused.count == 2, "a reference to a fullUrl queued before resolves through its keyed hash")
        #expect(try await pendingValues(queue).count == count + 2)
        try await queue.shutdown()
    }

    @Test("A bad entry after whole chunks were written queues nothing; every bad entry is named", arguments: StoreKind.available)
    func badEntries(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        try await queue.enqueue(try FHIRResource(json: Self.observation(-1)))
        let bad: Set<Int> = [7, 9_500]
        do {
            try await queue.enqueue(count: 10_000) { index in
                if bad.contains(index) { return QueueEntry(try FHIRResource(json: Data(#"{"resourceType":"x"}"#.utf8))) }
                return QueueEntry(try FHIRResource(json: Self.observation(index)))
            }
            Issue.record("the enqueue succeeded")
        } catch let error as EnqueueProblems {
            #expect(error.problems.count == 2)
            #expect(error.problems.map(\.index) == [7, 9_500])
            #expect(error.problems.allSatisfy { $0.error.message.contains("resourceType") })
        }
        #expect(try await pendingValues(queue) == ["-1"])
        try await queue.shutdown()
    }

    @Test("A reference reaches across chunks; a fullUrl declared twice or used before queues nothing", arguments: StoreKind.available)
    func references(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let patient = "urn:uuid:" + UUID().uuidString.lowercased()
        let items = try await queue.enqueue(count: 6_001) { index in
            switch index {
            case 0: QueueEntry(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)), fullURL: patient)
            case 6_000: QueueEntry(try FHIRResource(json: Self.observation(index, subject: patient)))
            default: QueueEntry(try FHIRResource(json: Self.observation(index)))
            }
        }
        #expect(items.count == 6_001)
        let other = "urn:uuid:" + UUID().uuidString.lowercased()
        for (declarations, message) in [([0, 5_000], "declared twice"), ([4_500], "already used")] {
            await #expect {
                try await queue.enqueue(count: 6_000) { index in
                    let fullURL =
                        index == declarations[0]
                        ? (declarations.count == 1 ? patient : other) : declarations.dropFirst().contains(index) ? other : nil
                    return QueueEntry(try FHIRResource(json: Self.observation(index)), fullURL: fullURL)
                }
            } throws: { error in
                (error as? DataQueueError)?.message.contains(message) == true
            }
        }
        #expect(try await queue.items(state: .pending, limit: 100_000).count == 6_001)
        try await queue.shutdown()
    }

    /// A transaction Bundle whose Observation references the Bundle's own Patient entry, and `other` (when given).
    static func transaction(patient: String, observation: String, other: String? = nil) -> Data {
        let extra = other.map { #","performer":[{"reference":"\#($0)"}]"# } ?? ""
        return Data(
            """
            {"resourceType":"Bundle","type":"transaction","entry":[
             {"fullUrl":"\(patient)","resource":{"resourceType":"Patient","identifier":[{"system":"urn:example:mrn","value":"MINI-1"}]},"request":{"method":"POST","url":"Patient"}},
             {"fullUrl":"\(observation)","resource":{"resourceType":"Observation","status":"final","code":{"text":"HR"},"subject":{"reference":"\(patient.uppercased().replacingOccurrences(of: "URN:UUID:", with: "urn:uuid:"))"}\(extra)},"request":{"method":"POST","url":"Observation"}}]}
            """.utf8)
    }

    @Test(
        "A transaction Bundle's references to its own entries are accepted, alone and in bulk; a reference to neither its entries nor an earlier item is refused",
        arguments: StoreKind.available)
    func bundleReferencesItsOwnEntries(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let urn: @Sendable () -> String = { "urn:uuid:" + UUID().uuidString.lowercased() }
        try await queue.enqueue(try FHIRResource(json: Self.transaction(patient: urn(), observation: urn())))
        let bulk = try await queue.enqueue(count: 3) { _ in
            QueueEntry(try FHIRResource(json: Self.transaction(patient: urn(), observation: urn())))
        }
        #expect(bulk.count == 3)
        let stranger = urn()
        let refused = await #expect(throws: DataQueueError.self) {
            try await queue.enqueue(try FHIRResource(json: Self.transaction(patient: urn(), observation: urn(), other: stranger)))
        }
        #expect(refused?.message.contains(stranger) == true, "\(refused?.message ?? "")")
        // An earlier item's fullUrl may be referenced from a Bundle.
        let earlier = urn()
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Practitioner"}"#.utf8)), fullURL: earlier)
        try await queue.enqueue(try FHIRResource(json: Self.transaction(patient: urn(), observation: urn(), other: earlier)))
        #expect(try await queue.items(state: .pending, limit: 100).count == 6)
        try await queue.shutdown()
    }
}
