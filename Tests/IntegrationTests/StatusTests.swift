import Foundation
import GRDB
import Testing

/// `dq status` on a queue file that dq did not leave as it is.
@Suite("dq status on a damaged queue", .serialized, .enabled(if: Peers.enabled))
struct StatusTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    func environment(_ server: String?) -> [String: String] {
        var env = ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
        env["DQ_SERVER"] = server
        return env
    }

    @Test("dq status names a damaged row and a schema made by a newer dq, with a non-zero exit")
    func damagedFile() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        #expect(try await dq(["enqueue", try work.write("p.json", resources.observation(0))], env).status == 0)
        let first = try await dq(["status"], env)
        #expect(first.status == 0 && first.stdout.contains("pending:    1"), "\(first.stdout) \(first.stderr)")
        let database = try DatabaseQueue(path: work.file("queue.sqlite"))
        try await database.write { db in try db.execute(sql: "UPDATE item SET state = 'weird'") }
        let through = try await dq(["status"], env)
        #expect(through.status != 0 && through.stderr.contains("unknown state"), "\(through.stderr)")
        try await database.write { db in
            try db.execute(sql: "UPDATE item SET state = 'pending'")
            try db.execute(sql: "INSERT INTO grdb_migrations VALUES ('v99')")
        }
        try database.close()
        let newer = try await dq(["status"], env)
        #expect(newer.status != 0 && newer.stderr.contains("newer dq"), "\(newer.stderr)")
    }
}
