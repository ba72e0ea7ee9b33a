import Foundation
import GRDB
import Testing

/// `dq` is a small front: it answers `dq status` from the queue file itself and hands everything else to
/// `dq-engine`. These tests hold it to the engine's answers byte for byte, and prove which of the two answered
/// by giving the front an engine that cannot run (`DQ_ENGINE=/nonexistent`): an answer then is the front's.
@Suite("The dq front", .serialized, .enabled(if: Peers.enabled))
struct FrontTests {
    let work: TemporaryDirectory
    let resources = Resources()
    static let noEngine = ["DQ_ENGINE": "/nonexistent/dq-engine"]

    init() throws { work = try TemporaryDirectory() }

    var engine: String { (Peers.dqBinary as NSString).deletingLastPathComponent + "/dq-engine" }

    func environment(_ server: String?) -> [String: String] {
        var env = ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
        env["DQ_SERVER"] = server
        return env
    }

    /// Runs `arguments` through the front with no engine and through the engine itself: both must answer 0
    /// with the same bytes. Returns the output.
    @discardableResult
    func sameAnswer(_ arguments: [String], _ env: [String: String], sourceLocation: SourceLocation = #_sourceLocation)
        async throws -> String
    {
        let front = try await dq(arguments, env.merging(Self.noEngine) { $1 })
        let direct = try await ChildProcess(engine, arguments, environment: env).wait()
        #expect(front.status == 0, "\(arguments): the front did not answer: \(front.stderr)", sourceLocation: sourceLocation)
        #expect(direct.status == 0, "\(arguments): \(direct.stderr)", sourceLocation: sourceLocation)
        #expect(front.stdout == direct.stdout, "\(arguments)", sourceLocation: sourceLocation)
        #expect(front.stderr == direct.stderr, "\(arguments)", sourceLocation: sourceLocation)
        return front.stdout
    }

    @Test("dq status is answered by the front itself, byte for byte as the engine answers it")
    func frontAnswersStatus() async throws {
        let server = try await FHIRServer.start()
        let here = environment(server.base)
        let lines = [resources.observation(0), resources.invalid(1), resources.observation(2)]
        #expect(try await dq(["enqueue", "--ndjson", try work.write("a.ndjson", lines.joined(separator: "\n"))], here).status == 0)
        #expect(try await dq(["flush"], here).status == 65)
        #expect(try await dq(["enqueue", try work.write("p.json", resources.observation(3))], here).status == 0)
        // A second queue whose server is down: backing off, with its last error.
        let down = environment("http://127.0.0.1:9/fhir")
        #expect(try await dq(["enqueue", try work.write("q.json", resources.observation(4))], down).status == 0)
        #expect(try await dq(["flush"], down).status == 75)

        // Counts first, from the front alone.
        let counts = try #require(
            try JSONSerialization.jsonObject(with: Data(try await sameAnswer(["status", "--json"], here).utf8)) as? [String: Any])
        #expect(counts["pending"] as? Int == 1 && counts["parked"] as? Int == 1 && counts["delivered"] as? Int == 2, "\(counts)")
        let text = try await sameAnswer(["status"], here)
        #expect(text.contains("elsewhere:  http://127.0.0.1:9/fhir: 1 pending, 0 parked"), "\(text)")
        let backingOff = try await sameAnswer(["status"], down)
        #expect(backingOff.contains("failures:   1 in a row") && backingOff.contains("last error:"), "\(backingOff)")
        try await sameAnswer(["status", "--json"], down)
        let all = try await sameAnswer(["status", "--all"], here)
        #expect(all.components(separatedBy: "queue:").count == 3, "\(all)")
        try await sameAnswer(["status", "--all", "--json"], here)
        try await sameAnswer(["status"], environment(nil))  // no server: every queue
        try await sameAnswer(["status", "--server=\(server.base)/", "--database", work.file("queue.sqlite")], ["HOME": work.path])
        let config = try work.write(
            "dq.json", #"{"server": "\#(server.base)", "database": "\#(work.file("queue.sqlite"))", "timeout_seconds": 5}"#)
        try await sameAnswer(["status", "--config", config], ["HOME": work.path])
        try await sameAnswer(["status", "--json"], ["HOME": work.path, "DQ_CONFIG": config])
    }

    @Test(
        "What the front cannot answer exactly as the engine would, the engine answers",
        arguments: [
            (["status", "-v"], [:]), (["status", "--help"], [:]), (["status", "--bogus"], [:]), (["status", "--json", "--json"], [:]),
            (["status", "--server"], [:]), (["status"], ["DQ_LOG_LEVEL": "debug"]), (["status"], ["DQ_TOKEN": "t0ken"]),
            (["status"], ["DQ_DATABASE": "postgres://dq@127.0.0.1:9/dq"]), (["status"], ["DQ_BATCH_SIZE": "0"]),
            (["status"], ["DQ_DATABASE": "/nonexistent/queue.sqlite"]), (["status", "--config", "/nonexistent/dq.json"], [:]),
            (["flush"], [:]), (["version"], [:]), ([], [:]),
        ] as [([String], [String: String])])
    func engineAnswers(arguments: [String], extra: [String: String]) async throws {
        let env = environment("http://127.0.0.1:9/fhir").merging(extra) { $1 }
        #expect(
            try await dq(["enqueue", try work.write("p.json", resources.observation(0))], environment("http://127.0.0.1:9/fhir")).status
                == 0)
        let front = try await dq(arguments, env.merging(Self.noEngine) { $1 })
        #expect(front.status == 69, "\(arguments) \(extra): the front answered: \(front.stdout)")
        #expect(front.stderr == "dq: cannot run the dq engine /nonexistent/dq-engine: No such file or directory; check DQ_ENGINE\n")
        let through = try await dq(arguments, env)
        let direct = try await ChildProcess(engine, arguments, environment: env).wait()
        #expect(through.status == direct.status, "\(arguments)")
        // A flush changes the queue's backoff state, so only its exit code can be compared.
        if arguments.first != "flush" {
            #expect(through.stdout == direct.stdout && through.stderr == direct.stderr, "\(arguments)")
        }
        #expect(!(through.stdout + through.stderr).contains("t0ken"))
    }

    @Test("A damaged row or a schema the front does not know goes to the engine, which names the problem")
    func damagedFile() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        #expect(try await dq(["enqueue", try work.write("p.json", resources.observation(0))], env).status == 0)
        #expect(try await sameAnswer(["status"], env).contains("pending:    1"))
        let database = try DatabaseQueue(path: work.file("queue.sqlite"))
        try await database.write { db in try db.execute(sql: "UPDATE item SET state = 'weird'") }
        var front = try await dq(["status"], env.merging(Self.noEngine) { $1 })
        #expect(front.status == 69)
        let through = try await dq(["status"], env)
        #expect(through.status != 0 && through.stderr.contains("unknown state"), "\(through.stderr)")
        try await database.write { db in
            try db.execute(sql: "UPDATE item SET state = 'pending'")
            try db.execute(sql: "INSERT INTO grdb_migrations VALUES ('v99')")
        }
        try database.close()
        front = try await dq(["status"], env.merging(Self.noEngine) { $1 })
        #expect(front.status == 69, "a newer schema is the engine's to judge")
        let newer = try await dq(["status"], env)
        #expect(newer.status != 0 && newer.stderr.contains("newer dq"), "\(newer.stderr)")
    }

    @Test("Without its engine, dq says where it looked and exits 69")
    func missingEngine() async throws {
        let result = try await dq(["flush"], environment("http://127.0.0.1:9/fhir").merging(Self.noEngine) { $1 })
        #expect(result.status == 69)
        #expect(result.stderr.contains("/nonexistent/dq-engine") && result.stderr.contains("DQ_ENGINE"), "\(result.stderr)")
    }
}
