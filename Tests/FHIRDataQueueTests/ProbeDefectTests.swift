import Foundation
import GRDB
import Logging
import Testing

@testable import FHIRDataQueue

#if canImport(Glibc)
    import Glibc
#endif

/// The defects an outside probe found in the library (issue 42), each proven here against the behaviour it had.
@Suite("Defects found by the probe")
struct ProbeDefectTests {
    let scratch: Scratch
    init() throws { scratch = try Scratch("dq-probe") }

    // MARK: - Ports that overflow

    @Test(
        "A port that overflows, or is out of range, is refused naming it, for the server, auth endpoints and proxy",
        arguments: ["99999999999999999999", "9223372036854775808", "18446744073709551616", "65536", "0", "-1"])
    func overflowingPorts(port: String) throws {
        let url = "http://127.0.0.1:\(port)/fhir"
        var server = DataQueueSettings()
        server.server = url
        #expect(throws: DataQueueError.self) { _ = try server.checkedValues() }
        do {
            _ = try server.checkedValues()
        } catch let error as DataQueueError {
            #expect(error.code == .invalidConfiguration)
            #expect(error.message.contains("\"server\""), "\(error.message)")
            if port.allSatisfy(\.isNumber) { #expect(error.message.contains(port), "\(error.message)") }
        }
        if let parsed = URL(string: url) { #expect(throws: DataQueueError.self) { _ = try DataQueue.queueName(for: parsed) } }
        #expect(throws: DataQueueError.self) { _ = try HTTPClients.proxy("http://user:pw@127.0.0.1:\(port)") }
        #expect(throws: DataQueueError.self) { try URLPort.check("https://auth.example:\(port)/token", setting: "auth.token_url") }
    }

    @Test("Ports in range, IPv6 literals, user info and no port at all pass")
    func portsInRange() throws {
        for text in [
            "http://127.0.0.1:1/fhir", "http://127.0.0.1:65535/fhir", "http://[::1]:8080/fhir", "http://[::1]/fhir",
            "http://u:p@h:80", "h:3128", "http://h/fhir:9999999999999", "http://h:/fhir",
        ] {
            #expect(throws: Never.self) { try URLPort.check(text, setting: "x") }
        }
        #expect(try DataQueue.queueName(for: URL(string: "http://127.0.0.1:8080/fhir")!) == "http://127.0.0.1:8080/fhir")
    }

    @Test("A proxy password that a parser could take for a port is never echoed")
    func passwordNotEchoed() {
        do {
            try URLPort.check("http://user:hunter2/x@proxy:3128", setting: "proxy")
            Issue.record("refused")
        } catch {
            #expect(!"\(error)".contains("hunter2"))
        }
    }

    // MARK: - Settings

    @Test(
        "A key given twice in any object is refused, at_rest and nested objects included",
        arguments: [
            (#"{"at_rest": {"key_file": "a", "key_file": "b"}}"#, "at_rest.key_file"),
            (#"{"auth": {"client_id": "a", "client_id": "b"}}"#, "auth.client_id"),
            (#"{"tls": {"ca_bundle": "a", "ca_bundle": "b"}}"#, "tls.ca_bundle"),
            (#"{"server": "http://a/fhir", "server": "http://b/fhir"}"#, "server"),
        ])
    func repeatedKeys(json: String, name: String) async throws {
        await #expect {
            _ = try await DataQueueSettings.decode(Data(json.utf8))
        } throws: { error in
            (error as? DataQueueError)?.message.contains("\"\(name)\" appears twice") == true
        }
    }

    @Test("A byte order mark is named as such")
    func byteOrderMark() async throws {
        let data = Data([0xEF, 0xBB, 0xBF]) + Data(#"{"server": "http://a/fhir"}"#.utf8)
        await #expect {
            _ = try await DataQueueSettings.decode(data)
        } throws: { error in
            (error as? DataQueueError)?.message.contains("byte order mark") == true
        }
    }

    @Test("retry.initial_seconds longer than retry.maximum_seconds (given or the default) is refused")
    func retryOrder() async throws {
        func checked(_ retry: String) async throws {
            _ = try await DataQueueSettings.decode(Data(#"{"server": "http://127.0.0.1:9/fhir", "retry": \#(retry)}"#.utf8)).checkedValues()
        }
        await #expect(throws: DataQueueError.self) { try await checked(#"{"initial_seconds": 60, "maximum_seconds": 30}"#) }
        await #expect(throws: DataQueueError.self) { try await checked(#"{"initial_seconds": 1000}"#) }
        await #expect(throws: Never.self) { try await checked(#"{"initial_seconds": 30, "maximum_seconds": 30}"#) }
    }

    // MARK: - The journal's time

    @Test("A journal line written after a refused journal write carries the time of the server's answer")
    func journalTimeIsTheAnswers() async throws {
        let path = scratch.url.appendingPathComponent("q.sqlite").path
        let server = try await ScriptedServer { _ in .respond(.created(location: "Patient/p/_history/1")) }
        let queue = try await DataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, configuration: DataQueue.Configuration(databasePath: path))
        let store = try #require(queue.store as? SQLiteQueueStore)
        try await store.database.write { db in
            try db.execute(sql: "CREATE TRIGGER refuse BEFORE DELETE ON item BEGIN SELECT RAISE(ABORT, 'refused'); END")
        }
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        await #expect(throws: (any Error).self) { _ = try await queue.flush() }
        let answered = Date()
        #expect(server.requests.filter { $0.method == "POST" }.count == 1)
        try await Task.sleep(for: .seconds(2))
        try await store.database.write { db in try db.execute(sql: "DROP TRIGGER refuse") }
        _ = try await queue.flush()
        #expect(server.requests.filter { $0.method == "POST" }.count == 1, "the held delivery is journaled, not sent again")
        let lines = try await queue.deliveries()
        #expect(lines.count == 1)
        let at = try #require(lines.first?.at)
        #expect(at <= answered, "journal time \(at) is after the answer came (\(answered))")
        try await queue.shutdown()
        try await server.shutdown()
    }

    // MARK: - Refused static credentials

    @Test("A static bearer token the server refuses is not sent again at once: one request, an authentication stop")
    func staticTokenRefusedOnce() async throws {
        let server = try await ScriptedServer { _ in .respond(.init(status: 401, body: "")) }
        // A backoff far longer than the test, so that the second flush is inside it however slow the machine (under
        // ThreadSanitizer the default first delay passed between the two flushes, and the second one sent again).
        var configuration = DataQueue.Configuration(databasePath: scratch.url.appendingPathComponent("q.sqlite").path)
        configuration.retryPolicy.initialDelay = 3600
        configuration.retryPolicy.maximumDelay = 3600
        let queue = try await DataQueue(
            baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration,
            authorization: StaticBearerToken("refused-token"))
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        let report = try await queue.flush()
        guard case .authentication = report.stop else {
            Issue.record("expected an authentication stop, got \(String(describing: report.stop))")
            return
        }
        #expect(server.requests.filter { $0.method == "POST" }.count == 1, "\(server.requests.map { "\($0.method) \($0.uri)" })")
        // Inside the backoff the refusal is said again (not "backing off"), and nothing is sent.
        let again = try await queue.flush()
        guard case .authentication(let message) = again.stop else {
            Issue.record("expected an authentication stop inside the backoff, got \(String(describing: again.stop))")
            return
        }
        #expect(message.contains("--now"), "\(message)")
        #expect(server.requests.filter { $0.method == "POST" }.count == 1)
        try await queue.shutdown()
        try await server.shutdown()
    }

    // MARK: - A deleted database's WAL

    /// A database whose WAL holds real pages, left as a crash leaves it: the -wal and -shm copied while it was
    /// open, put back after it closed.
    private func crashedDatabase(_ path: String) throws {
        var configuration = Configuration()
        configuration.journalMode = .wal
        let database = try DatabaseQueue(path: path, configuration: configuration)
        try database.write { db in
            try db.execute(sql: "PRAGMA wal_autocheckpoint = 0")
            try db.execute(sql: "CREATE TABLE old (body TEXT)")
            try db.execute(
                sql:
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 400) INSERT INTO old SELECT hex(randomblob(1000)) FROM n"
            )
        }
        for suffix in ["-wal", "-shm"] {
            try FileManager.default.copyItem(atPath: path + suffix, toPath: path + suffix + ".kept")
        }
        try database.close()
        for suffix in ["-wal", "-shm"] {
            try? FileManager.default.removeItem(atPath: path + suffix)
            try FileManager.default.moveItem(atPath: path + suffix + ".kept", toPath: path + suffix)
        }
    }

    @Test("A -wal and -shm without their database are moved aside before a new one is made: nothing of the old replayed")
    func orphanedWALMovedAside() async throws {
        let path = scratch.url.appendingPathComponent("q.sqlite").path
        try crashedDatabase(path)
        let walSize = (try FileManager.default.attributesOfItem(atPath: path + "-wal")[.size] as? NSNumber)?.intValue ?? 0
        #expect(walSize > 500_000, "the WAL holds real pages (\(walSize) bytes)")
        try FileManager.default.removeItem(atPath: path)

        let queue = try await DataQueue(
            baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: DataQueue.Configuration(databasePath: path))
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Observation"}"#.utf8)))
        let status = try await queue.status()
        #expect(status.pending == 1, "only the new item: \(status.pending)")
        let store = try #require(queue.store as? SQLiteQueueStore)
        let check = try await store.database.read { db in try String.fetchOne(db, sql: "PRAGMA integrity_check") }
        #expect(check == "ok")
        #expect(try await store.database.read { db in try db.tableExists("old") } == false, "the old database's rows replayed")
        try await queue.shutdown()
        let names = try FileManager.default.contentsOfDirectory(atPath: scratch.url.path)
        #expect(names.contains { $0.hasPrefix("q.sqlite-wal.orphaned-") }, "\(names)")
        #expect(names.contains { $0.hasPrefix("q.sqlite-shm.orphaned-") }, "\(names)")
    }

    @Test("A process that finds its database deleted moves its own -wal and -shm aside and will not remove a successor's")
    func deletedUnderAProcess() async throws {
        let path = scratch.url.appendingPathComponent("q.sqlite").path
        let queue = try await DataQueue(
            baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: DataQueue.Configuration(databasePath: path))
        let body = String(repeating: "x", count: 2000)
        let entries = try (0..<400).map { _ in
            (
                try FHIRResource(json: Data(#"{"resourceType":"Patient","text":{"status":"generated","div":"\#(body)"}}"#.utf8)),
                FHIRMethod.post
            )
        }
        _ = try await queue.enqueue(contentsOf: entries)
        try queue.store.checkFileIdentity()  // the files it uses are noted while they are its own
        try FileManager.default.removeItem(atPath: path)
        #expect {
            try queue.store.checkFileIdentity()
        } throws: { error in
            (error as? DataQueueError)?.message.contains("moved aside") == true
        }
        #expect(!FileManager.default.fileExists(atPath: path + "-wal"))
        #expect(!FileManager.default.fileExists(atPath: path + "-shm"))

        // A successor made while the old connection is still open keeps its WAL when the old one closes.
        let successor = try await DataQueue(
            baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: DataQueue.Configuration(databasePath: path))
        try await successor.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Observation"}"#.utf8)))
        try await queue.shutdown()
        try #require(queue.store as? SQLiteQueueStore).database.close()
        #expect(FileManager.default.fileExists(atPath: path + "-wal"), "the successor's WAL is still there")
        #expect(try await successor.status().pending == 1)
        let store = try #require(successor.store as? SQLiteQueueStore)
        #expect(try await store.database.read { db in try String.fetchOne(db, sql: "PRAGMA integrity_check") } == "ok")
        try await successor.shutdown()
    }
}
