import AsyncHTTPClient
import Foundation
import GRDB
import Logging
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// The flush loop against a real HTTP server on loopback whose answers each test scripts: the races and
/// routing cases an outside review found, each with the interleaving forced rather than hoped for.
@Suite("Flush hardening", .timeLimit(.minutes(3)))
struct FlushHardeningTests {
    let directory: URL
    let scratch: Scratch

    init() throws {
        scratch = try Scratch("dq-flush")
        directory = scratch.url
    }

    var databasePath: String { directory.appendingPathComponent("q.sqlite").path }

    /// A queue that sends one request per item (these tests script each request's answer).
    func queue(
        _ server: ScriptedServer, path: String = "/fhir", idempotent: Bool = false, requestTimeout: TimeInterval = 10
    ) async throws -> DataQueue {
        var configuration = DataQueue.Configuration(databasePath: databasePath, idempotent: .init(idempotent))
        configuration.batchSize = 1
        configuration.retryPolicy = RetryPolicy(initialDelay: 60, maximumDelay: 600, jitter: 0)
        configuration.requestTimeout = requestTimeout
        return try await DataQueue(baseURL: URL(string: server.baseURL + path)!, configuration: configuration)
    }

    /// An idempotent queue whose server is known (as if its CapabilityStatement had just been read) to declare
    /// conditional create for the types these tests send: no request reads it.
    func declaringQueue(_ server: ScriptedServer) async throws -> DataQueue {
        let queue = try await queue(server, idempotent: true)
        try await queue.store.recordBundleSupport(
            queue: queue.queueName, transactions: false, batchLimit: nil, conditionalCreate: ["Patient", "Observation"])
        return queue
    }

    static func patient(_ n: Int, extra: String = "") throws -> FHIRResource {
        try FHIRResource(json: Data(#"{"resourceType":"Patient","birthDate":"2000-01-0\#(n % 9 + 1)"\#(extra)}"#.utf8))
    }

    /// Answers in turn from `answers`, then 201 for everything after.
    static func scripted(_ answers: [ScriptedServer.Action]) -> @Sendable (ScriptedServer.Request) async -> ScriptedServer.Action {
        let next = NIOLockedValueBox(0)
        return { _ in
            let index = next.withLockedValue { value in
                defer { value += 1 }
                return value
            }
            return index < answers.count ? answers[index] : .respond(.created(location: "Patient/p\(index)/_history/1"))
        }
    }

    @Test("A late journal commit does not erase the backoff a failure after it started")
    func lateJournalKeepsBackoff() async throws {
        let server = try await ScriptedServer(
            handler: Self.scripted([.respond(.created(location: "Patient/a/_history/1")), .respond(.init(status: 503))]))
        let queue = try await queue(server)
        // Every journal commit of this queue happens half a second late: long after the 503 is handled.
        queue.hooks.beforeJournalCommit = { Thread.sleep(forTimeInterval: 0.5) }
        try await queue.enqueue(Self.patient(1))
        try await queue.enqueue(Self.patient(2))
        let report = try await queue.flush()
        #expect(report.delivered == 1)
        guard case .transient = report.stop else {
            Issue.record("expected a transient stop, got \(String(describing: report.stop))")
            return
        }
        let status = try await queue.status()
        #expect(status.delivered == 1)
        #expect(status.consecutiveFailures == 1, "the failure after the delivery is recorded, not reset by its journal commit")
        #expect(status.nextAttemptAt.map { $0 > Date().addingTimeInterval(30) } == true, "the backoff stands")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A send whose item another flush delivered while it waited for the flush right says delivered, not queued")
    func sendDeliveredByAnotherFlush() async throws {
        let gate = AsyncStream<Void>.makeStream()
        let first = NIOLockedValueBox(true)
        let server = try await ScriptedServer { request in
            let isFirst = first.withLockedValue { value in
                defer { value = false }
                return value
            }
            if isFirst {
                for await _ in gate.stream { break }  // the first request waits for the test
            }
            return .respond(.created(location: "Patient/p\(request.body.count)/_history/1"))
        }
        // The first request is held until the test lets it go, however long the wait for the send to queue its
        // item takes on a loaded machine (ThreadSanitizer's slowdown passed a 10 s timeout here): the request's
        // timeout must not end it first.
        let queue = try await queue(server, requestTimeout: 3600)
        try await queue.enqueue(Self.patient(1))
        let flushing = Task { try await queue.flush() }  // holds the flush right while its request waits
        #expect(await server.waitFor { $0.count == 1 })
        let sending = Task { try await queue.create(Self.patient(2)) }
        // The send queued its item and waits for the flush right (the suite's time limit ends a wait that never ends).
        while try await queue.status().pending != 2 { try await Task.sleep(for: .milliseconds(10)) }
        gate.continuation.yield()
        let report = try await flushing.value
        #expect(report.delivered == 2, "the running flush delivered the sent item too")
        let outcome = try await sending.value
        guard case .delivered(let record) = outcome else {
            Issue.record("expected delivered, got \(outcome)")
            return
        }
        #expect(record.location?.hasPrefix("Patient/p") == true && record.status == 201)
        #expect(server.requests.count == 2, "each item sent once")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("Two servers in one database flush independently: one stalled does not hold the other")
    func flushLockPerQueue() async throws {
        let stalled = try await ScriptedServer { _ in .stall }
        let healthy = try await ScriptedServer { _ in .respond(.created(location: "Patient/b/_history/1")) }
        let slow = try await queue(stalled)
        let fast = try await queue(healthy)
        #expect(slow.flushLockPath != fast.flushLockPath)
        try await slow.enqueue(Self.patient(1))
        let stuck = Task { try await slow.flush() }
        #expect(await stalled.waitFor { $0.count == 1 }, "the first server got its request")
        try await fast.enqueue(Self.patient(2))
        // No waiting for the other queue's lock: busy would be the answer if the lock were per database.
        let report = try await fast.flush(lockWait: 0)
        #expect(report.stop == nil)
        #expect(report.delivered == 1)
        #expect(healthy.requests.count == 1)
        stalled.releaseStalled()
        let slowReport = try await stuck.value
        #expect(slowReport.delivered == 0 && slowReport.remaining == 1)
        try await slow.shutdown()
        try await fast.shutdown()
        try await stalled.shutdown()
        try await healthy.shutdown()
    }

    @Test("A refused connection leaves no in-flight marker: nothing can be at the server to settle")
    func refusedConnectionLeavesNoMarker() async throws {
        // A port that was just free: nothing listens there.
        let probe = try await ScriptedServer { _ in .close }
        let port = probe.port
        try await probe.shutdown()
        var configuration = DataQueue.Configuration(databasePath: databasePath)
        configuration.connectTimeout = 2
        let queue = try await DataQueue(baseURL: URL(string: "http://127.0.0.1:\(port)/fhir")!, configuration: configuration)
        try await queue.enqueue(Self.patient(1))
        let report = try await queue.flush()
        guard case .transient = report.stop else {
            Issue.record("expected a transient stop, got \(String(describing: report.stop))")
            return
        }
        let lock = try FileLock(path: queue.flushLockPath)
        #expect(lock.inFlight() == nil, "no marker after a refused connection")
        try await queue.shutdown()
    }

    @Test("A request that may have reached the server (connection dropped after sending) keeps the marker")
    func droppedConnectionKeepsMarker() async throws {
        let server = try await ScriptedServer { _ in .close }
        let queue = try await queue(server)
        try await queue.enqueue(Self.patient(1))
        _ = try await queue.flush()
        let lock = try FileLock(path: queue.flushLockPath)
        #expect(lock.inFlight()?.sequence == 1)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("The in-flight marker is overwritten in place: marked, cleared, marked again; an older marker still reads")
    func markerInPlace() async throws {
        let path = databasePath + ".marker.lock"
        let lock = try FileLock(path: path)
        #expect(lock.inFlight() == nil, "a new lock file has no marker")
        lock.markInFlight(sequence: 123_456_789_012, at: Date(timeIntervalSince1970: 1_700_000_000.25))
        #expect(lock.inFlight()?.sequence == 123_456_789_012)
        #expect(lock.inFlight()?.sentAt == Date(timeIntervalSince1970: 1_700_000_000.25))
        lock.clearInFlight()
        #expect(lock.inFlight() == nil)
        try await lock.markInFlight(sequence: 7)
        #expect(lock.inFlight()?.sequence == 7, "a shorter record replaces a longer one whole")
        let size = try FileManager.default.attributesOfItem(atPath: path)[.size] as? Int
        #expect(size == FileLock.markerWidth, "one fixed-width record, never truncated")
        // The marker of an older dq (the bare text, then truncated) is still understood.
        try Data("42 1700000000.5\n".utf8).write(to: URL(fileURLWithPath: path))
        #expect(try FileLock(path: path).inFlight()?.sequence == 42)
    }

    @Test("The marker is written once per window, not twice per request; release clears a cleared one, not a kept one")
    func markerOncePerWindow() async throws {
        let path = databasePath + ".window.lock"
        let lock = try FileLock(path: path)
        let before = Date()
        for sequence in 1...100 {
            try await lock.markInFlight(sequence: Int64(sequence))
            lock.clearInFlight()
        }
        #expect(lock.markerWrites == 1, "one write covers the window's sends and answers")
        #expect(lock.inFlight() == nil, "the holder sees its own answers")
        // A holder that dies now (no release) leaves the marker, timed at the end of the window.
        let left = try #require(try FileLock(path: path).inFlight(), "the file still holds the marker")
        #expect(left.sequence == 1)
        #expect(left.sentAt >= before.addingTimeInterval(FileLock.noteWindow - 0.001))
        lock.release()
        #expect(lock.markerWrites == 2)
        #expect(try FileLock(path: path).inFlight() == nil, "a cleared marker is cleared on release")
        // A send whose answer never came keeps the marker through the release.
        try await lock.markInFlight(sequence: 200)
        lock.release()
        #expect(try FileLock(path: path).inFlight()?.sequence == 200)
    }

    @Test("The note window both stores keep: covers sends until its end, a send renews a cleared note, release says what to clear")
    func noteWindow() {
        let start = ContinuousClock.now
        var note = InFlightNoteWindow()
        var covered = note.covers(start)
        #expect(!covered, "nothing written yet")
        note.wrote(at: start, covering: .seconds(1))
        covered = note.covers(start + .milliseconds(999))
        #expect(covered)
        covered = note.covers(start + .seconds(1))
        #expect(!covered, "the window ends")
        note.clear()
        #expect(note.cleared)
        covered = note.covers(start + .milliseconds(500))
        #expect(covered && !note.cleared, "a send in the window makes the note current again")
        note.clear()
        var clear = note.release()
        #expect(clear, "an answered note is cleared on release")
        covered = note.covers(start)
        #expect(!note.cleared && !covered, "release forgets the window")
        note.wrote(at: start, covering: .seconds(1))
        clear = note.release()
        #expect(!clear, "a note whose answer never came is kept")
        note.wrote(at: start, covering: nil)
        covered = note.covers(start)
        #expect(!covered, "a note for one send covers no other")
    }

    @Test("A flush of many items leaves no marker behind")
    func flushLeavesNoMarker() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/x/_history/1")) }
        let queue = try await queue(server)
        for index in 1...20 { try await queue.enqueue(try Self.patient(index)) }
        let report = try await queue.flush()
        #expect(report.delivered == 20)
        #expect(try FileLock(path: queue.flushLockPath).inFlight() == nil)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("Cancelling a flush stops it before its next item; what was delivered is journaled")
    func cancelledFlushStops() async throws {
        let server = try await ScriptedServer { request in
            try? await Task.sleep(for: .milliseconds(50))
            return .respond(.created(location: "Patient/x/_history/1"))
        }
        let queue = try await queue(server)
        _ = try await queue.enqueue(contentsOf: (0..<40).map { (try Self.patient($0), FHIRMethod.post) })
        let flush = Task { try await queue.flush() }
        #expect(await server.waitFor { $0.count >= 3 })
        flush.cancel()
        await #expect(throws: CancellationError.self) { try await flush.value }
        let sent = server.requests.count
        let status = try await queue.status()
        #expect(sent < 40)
        #expect(status.delivered + status.pending == 40)
        #expect(status.delivered >= sent - 1, "every answered request is in the journal")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A cancelled task reading the queue sees CancellationError, not a storage error")
    func cancellationIsNotStorage() async throws {
        let server = try await ScriptedServer { _ in .close }
        let queue = try await queue(server)
        let task = Task {
            withUnsafeCurrentTask { $0?.cancel() }
            return try await queue.status()
        }
        await #expect(throws: CancellationError.self) { try await task.value }
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A row edited to another host is refused, naming the row; nothing is sent anywhere")
    func editedRowURLIsNeverSent() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/a/_history/1")) }
        let elsewhere = try await ScriptedServer { _ in .respond(.created(location: "Patient/a/_history/1")) }
        let queue = try await DataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!,
            configuration: .init(databasePath: databasePath, batchSize: 1), authorization: StaticBearerToken("secret-token"))
        let item = try await queue.enqueue(Self.patient(1))
        try await (queue.store as! SQLiteQueueStore).database.write { db in
            try db.execute(sql: "UPDATE item SET url = ? WHERE seq = ?", arguments: [elsewhere.baseURL + "/Patient", item.sequence])
        }
        let error = try await #require(throws: DataQueueError.self) { try await queue.flush() }
        #expect(error.code == .storage)
        #expect(error.message.contains("row \(item.sequence)"))
        #expect(server.requests.isEmpty)
        #expect(elsewhere.requests.isEmpty, "neither the resource nor the token left for another host")
        #expect(try await queue.status().pending == 1)
        try await queue.shutdown()
        try await server.shutdown()
        try await elsewhere.shutdown()
    }

    @Test("A row with an unknown state or method is an error that names it, not a pending item")
    func undecodableRows() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/a/_history/1")) }
        let queue = try await queue(server)
        let first = try await queue.enqueue(Self.patient(1))
        let second = try await queue.enqueue(Self.patient(2))
        try await (queue.store as! SQLiteQueueStore).database.write { db in
            try db.execute(sql: "UPDATE item SET state = 'sending' WHERE seq = ?", arguments: [first.sequence])
        }
        let status = try await #require(throws: DataQueueError.self) { try await queue.status() }
        #expect(status.code == .storage && status.message.contains("row \(first.sequence)"))
        let flush = try await #require(throws: DataQueueError.self) { try await queue.flush() }
        #expect(flush.code == .storage)
        try await (queue.store as! SQLiteQueueStore).database.write { db in
            try db.execute(sql: "UPDATE item SET state = 'pending' WHERE seq = ?", arguments: [first.sequence])
            try db.execute(sql: "UPDATE item SET method = 'DELETE' WHERE seq = ?", arguments: [second.sequence])
        }
        let list = try await #require(throws: DataQueueError.self) { try await queue.items() }
        #expect(list.code == .storage && list.message.contains("row \(second.sequence)"))
        try await queue.shutdown()
        try await server.shutdown()
    }

    // MARK: - Idempotent mode

    @Test("An identifier without system or value still gets a condition: a generated identifier is put first")
    func incompleteIdentifierGetsCondition() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/a/_history/1")) }
        let queue = try await declaringQueue(server)
        let item = try await queue.enqueue(Self.patient(1, extra: #","identifier":[{"value":"no-system"}]"#))
        _ = try await queue.flush()
        let request = try #require(server.requests.first)
        let expected = "urn:uuid:\(item.id.lowercasedString)"
        #expect(request.header("If-None-Exist") == "identifier=urn:ietf:rfc:3986|\(expected)")
        let body = try #require(try JSONSerialization.jsonObject(with: request.body) as? [String: Any])
        let identifiers = try #require(body["identifier"] as? [[String: String]])
        #expect(identifiers.count == 2)
        #expect(identifiers.first == ["system": "urn:ietf:rfc:3986", "value": expected])
        #expect(identifiers.last == ["value": "no-system"])
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A 200 to a conditional create is journaled as already present; a 201 as delivered")
    func alreadyPresentJournaled() async throws {
        let server = try await ScriptedServer(
            handler: Self.scripted([
                .respond(.init(status: 200, headers: [("Location", "Patient/old/_history/3")], body: "{}")),
                .respond(.created(location: "Patient/new/_history/1")),
            ]))
        let queue = try await declaringQueue(server)
        try await queue.enqueue(Self.patient(1))
        try await queue.enqueue(Self.patient(2))
        #expect(try await queue.flush().delivered == 2)
        let journal = try await queue.deliveries()
        #expect(journal.map(\.event) == [.alreadyPresent, .delivered])
        #expect(journal.first?.serverID == "old")
        #expect(try await queue.status().delivered == 2)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("An item a server refuses because of its condition is sent as a plain create after retry(conditionalCreate: false)")
    func retryWithoutCondition() async throws {
        let server = try await ScriptedServer { request in
            request.header("If-None-Exist") == nil
                ? .respond(.created(location: "QuestionnaireResponse/q/_history/1"))
                : .respond(.init(status: 400, body: #"{"resourceType":"OperationOutcome"}"#))
        }
        let queue = try await declaringQueue(server)
        let item = try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"QuestionnaireResponse"}"#.utf8)))
        #expect(try await queue.flush().parked == 1)
        // A plain retry keeps the condition and is refused again.
        _ = try await queue.retry(item.id.lowercasedString)
        #expect(try await queue.flush().parked == 1)
        _ = try await queue.retry(item.id.lowercasedString, conditionalCreate: false)
        let report = try await queue.flush()
        #expect(report.delivered == 1 && report.parkedTotal == 0)
        #expect(server.requests.map { $0.header("If-None-Exist") == nil } == [false, false, true])
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("Idempotent mode is decided when the item is sent: an item queued without it is sent conditionally")
    func decidedAtSendTime() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/a/_history/1")) }
        let plain = try await queue(server, idempotent: false)
        try await plain.enqueue(Self.patient(1))
        try await plain.shutdown()
        let idempotent = try await declaringQueue(server)
        _ = try await idempotent.flush()
        #expect(server.requests.first?.header("If-None-Exist")?.hasPrefix("identifier=urn:ietf:rfc:3986|urn:uuid:") == true)
        try await idempotent.shutdown()
        try await server.shutdown()
    }

    @Test("A queued transaction Bundle's creates carry ifNoneExist, identical on every retry; updates do not")
    func bundleEntriesConditional() async throws {
        let server = try await ScriptedServer(
            handler: Self.scripted([.close, .respond(.init(status: 200, body: #"{"resourceType":"Bundle"}"#))]))
        let queue = try await declaringQueue(server)
        let bundle = #"""
            {"resourceType":"Bundle","type":"transaction","entry":[
              {"fullUrl":"urn:uuid:9b0c6f5e-9a4c-4c43-8a48-1f4c1a2b3c4d","resource":{"resourceType":"Patient"},
               "request":{"method":"POST","url":"Patient"}},
              {"resource":{"resourceType":"Observation","identifier":[{"system":"urn:s","value":"o 1"}],"status":"final"},
               "request":{"method":"POST","url":"Observation"}},
              {"resource":{"resourceType":"Patient","id":"p2"},"request":{"method":"PUT","url":"Patient/p2"}}
            ]}
            """#
        let item = try await queue.enqueue(try FHIRResource(json: Data(bundle.utf8)))
        _ = try await queue.flush()  // the connection drops: transient
        _ = try await queue.flush(force: true)
        let requests = server.requests
        #expect(requests.count == 2)
        #expect(requests.first?.body == requests.last?.body, "a retry sends the same conditions")
        #expect(requests.last?.header("If-None-Exist") == nil)
        let sent = try #require(try JSONSerialization.jsonObject(with: requests[1].body) as? [String: Any])
        let entries = try #require(sent["entry"] as? [[String: Any]])
        #expect(entries.count == 3)
        let conditions = entries.map { ($0["request"] as? [String: Any])?["ifNoneExist"] as? String }
        let generated = ConditionalCreate.entryID(itemID: item.id, index: 0)
        #expect(conditions[0] == "identifier=urn:ietf:rfc:3986|urn:uuid:\(generated)")
        #expect(conditions[1] == "identifier=urn:s|o%201")
        #expect(conditions[2] == nil)
        let patient = try #require(entries[0]["resource"] as? [String: Any])
        #expect((patient["identifier"] as? [[String: String]])?.first?["value"] == "urn:uuid:\(generated)")
        #expect(try await queue.status().delivered == 1)
        try await queue.shutdown()
        try await server.shutdown()
    }

    // MARK: - Auth

    @Test("Refusals of one token cost one token request, however many senders saw them")
    func oneRefreshPerRefusedToken() async throws {
        let issued = NIOLockedValueBox(0)
        let tokens = try await ScriptedServer { _ in
            let n = issued.withLockedValue { value in
                value += 1
                return value
            }
            return .respond(.init(status: 200, body: #"{"access_token":"token-\#(n)","expires_in":3600}"#))
        }
        var configuration = OAuth2Configuration(fhirBaseURL: URL(string: tokens.baseURL + "/fhir")!)
        configuration.clientID = "c1"
        configuration.clientSecret = "s1"
        configuration.tokenURL = URL(string: tokens.baseURL + "/token")
        let auth = try OAuth2ClientCredentials(configuration: configuration)
        let logger = Logger(label: "test")
        let first = try await auth.authorizationHeader(forceRefresh: false, logger: logger)
        #expect(first == "Bearer token-1")
        // Three senders saw token-1 refused at once: one renewal.
        let renewed = try await withThrowingTaskGroup(of: String?.self) { group in
            for _ in 0..<3 { group.addTask { try await auth.authorizationHeader(replacing: "Bearer token-1", logger: logger) } }
            return try await group.reduce(into: Set<String?>()) { $0.insert($1) }
        }
        #expect(renewed == ["Bearer token-2"])
        // A refusal of token-1 that arrives after the renewal gets the new token, with no request.
        #expect(try await auth.authorizationHeader(replacing: "Bearer token-1", logger: logger) == "Bearer token-2")
        #expect(tokens.requests.count == 2)
        #expect(await auth.tokenRequests == 2)
        try await auth.shutdown()
        try await tokens.shutdown()
    }

    @Test("Endpoint discovery that gets no answer is a temporary failure, not a missing endpoint")
    func discoveryOutageIsTransient() async throws {
        let probe = try await ScriptedServer { _ in .close }
        let port = probe.port
        try await probe.shutdown()
        var configuration = OAuth2Configuration(fhirBaseURL: URL(string: "http://127.0.0.1:\(port)/fhir")!)
        configuration.clientID = "c1"
        configuration.clientSecret = "s1"
        let auth = try OAuth2ClientCredentials(configuration: configuration)
        let error = try await #require(throws: DataQueueError.self) { try await auth.accessToken() }
        #expect(error.code == .transport, "\(error.message)")
        try await auth.shutdown()
    }

    // MARK: - Library surface

    @Test("EncryptedDataQueue.update of a resource it encrypts is an error, not a silent POST; auto picks POST")
    func encryptedUpdateIsExplicit() async throws {
        let server = try await ScriptedServer { _ in .respond(.init(status: 200)) }
        let (recipient, _) = try EnvelopeTests.keyPair()
        let queue = try await EncryptedDataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, encryptedBaseURL: URL(string: server.baseURL + "/enc")!,
            sealer: EnvelopeSealer(recipient: recipient, keyID: "k1"), shouldEncrypt: { $0.resourceType == "Patient" },
            configuration: .init(databasePath: databasePath))
        let patient = try FHIRResource(json: Data(#"{"resourceType":"Patient","id":"p1"}"#.utf8))
        let error = try await #require(throws: DataQueueError.self) { try await queue.update(patient) }
        #expect(error.code == .invalidResource)
        #expect(error.message.contains("update"))
        #expect(server.requests.isEmpty)
        #expect(try await queue.status().pending == 0, "nothing was queued")
        #expect(queue.defaultMethod(for: patient) == .post)
        let observation = try FHIRResource(json: Data(#"{"resourceType":"Observation","id":"o1"}"#.utf8))
        #expect(queue.defaultMethod(for: observation) == .put, "what is not encrypted routes as DataQueue does")
        guard case .delivered = try await queue.create(patient) else {
            Issue.record("the create of an encrypted resource was not delivered")
            return
        }
        #expect(server.requests.map(\.uri) == ["/enc/Patient"])
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A caller's HTTP client is used and left running; shutdown() also shuts down the auth provider")
    func callersClient() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/a/_history/1")) }
        let client = HTTPClient(eventLoopGroupProvider: .singleton)
        let auth = RecordingAuthorization()
        let queue = try await DataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, configuration: .init(databasePath: databasePath),
            authorization: auth, httpClient: client)
        try await queue.enqueue(Self.patient(1))
        #expect(try await queue.flush().delivered == 1)
        #expect(server.requests.first?.header("Authorization") == "Bearer recorded")
        #expect(!auth.isShutDown)
        try await queue.shutdown()
        #expect(auth.isShutDown, "the queue's shutdown shut down its authorization provider")
        // Still usable by its owner after the queue is gone.
        let again = try await DataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, configuration: .init(databasePath: databasePath),
            httpClient: client)
        try await again.enqueue(Self.patient(2))
        #expect(try await again.flush().delivered == 1)
        try await again.shutdown()
        try await client.shutdown()
        try await server.shutdown()
    }

    @Test(
        "Flushes, the service's readiness and its gauges do not count the delivery journal (a read as long as months of deliveries); dq status does"
    )
    func journalNotCountedPerFlush() async throws {
        let server = try await ScriptedServer(handler: Self.scripted([]))
        let queue = try await queue(server)
        let counted = NIOLockedValueBox(0)
        queue.hooks.countingJournal = { counted.withLockedValue { $0 += 1 } }
        for n in 1...3 { try await queue.enqueue(Self.patient(n)) }
        let report = try await queue.flush()
        #expect(report.delivered == 3 && report.remaining == 0)
        try await queue.enqueue(Self.patient(4))
        let busy = try await queue.flush(limit: 0)
        #expect(busy.remaining == 1, "the counts a flush reports are read")
        let service = DataQueueService(queues: [queue])
        #expect(await service.readiness().ready)
        #expect(counted.withLockedValue { $0 } == 0, "no flush and no probe counted the journal")

        let others = try await queue.allQueueStatuses(countingJournal: false)
        #expect(others.map(\.pending) == [1] && others.map(\.delivered) == [0], "\(others)")
        #expect(counted.withLockedValue { $0 } == 0, "the queues' pending items, read without the journal")

        let status = try await queue.status()
        #expect(status.delivered == 3 && status.pending == 1)
        #expect(try await queue.allQueueStatuses().map(\.delivered) == [3])
        #expect(counted.withLockedValue { $0 } == 2, "an operator's status counts it")
        try await queue.shutdown()
        try await server.shutdown()
    }
}

/// An authorization provider that records whether it was shut down.
final class RecordingAuthorization: AuthorizationProvider {
    private let state = NIOLockedValueBox(false)
    var isShutDown: Bool { state.withLockedValue { $0 } }

    func authorizationHeader(forceRefresh: Bool, logger: Logger) async throws -> String? { "Bearer recorded" }

    func shutdown() async throws { state.withLockedValue { $0 = true } }
}
