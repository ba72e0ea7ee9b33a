import Foundation
import GRDB
import SQLiteWALWrites
import Testing

@testable import FHIRDataQueue

/// The `dq-wal` VFS (``WALWrites``): one write per transaction's WAL frames, in the file before the commit
/// returns, checked through connections of SQLite's default VFS.
@Suite("WAL writes through the dq-wal VFS")
struct WALWritesTests {
    let directory: URL

    init() throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-wal-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
    }

    func item(_ index: Int, size: Int = 1024) -> NewItem {
        let head = #"{"resourceType":"Patient","n":\#(index),"text":""#
        let body = head + String(repeating: "x", count: max(0, size - head.utf8.count - 2)) + #""}"#
        return NewItem(
            id: UUID.timeOrdered(), queue: "http://h/fhir", method: .post, url: "Patient", resourceType: "Patient",
            resourceID: nil, encrypted: false, contentType: "application/fhir+json", body: Data(body.utf8))
    }

    @Test("Every commit is in the file when it returns: a connection of the default VFS reads each at once, across checkpoints")
    func visibleAtCommit() async throws {
        try #require(WALWrites.available, "this SQLite reads URI filenames (Debian's does)")
        let path = directory.appendingPathComponent("q.sqlite").path
        // NORMAL: no sync at a commit, so only the VFS's own write puts the frames in the file.
        let store = try QueueStore(path: path, durability: .normal)
        let reader = try DatabaseQueue(path: path)
        var expected: [Int64: Data] = [:]
        for index in 0..<400 {
            // One row, rows that overflow onto other pages, a group bigger than the VFS's buffer, a 300 KB row.
            let items: [NewItem] =
                switch index % 10 {
                case 3: [item(index, size: 9000)]
                case 7: (0..<150).map { item(index * 1000 + $0) }
                case 9: [item(index, size: 300_000)]
                default: [item(index)]
                }
            let sequences = try await store.insert(items)
            for (sequence, item) in zip(sequences, items) { expected[sequence] = item.body }
            let last = try #require(sequences.last)
            let body = try await reader.read { db in try Data.fetchOne(db, sql: "SELECT body FROM item WHERE seq = ?", arguments: [last]) }
            #expect(body == items.last?.body, "commit \(index) (sequence \(last)) read through the default VFS")
        }
        let (stored, check) = try await reader.read { db in
            (
                try Row.fetchAll(db, sql: "SELECT seq, body FROM item ORDER BY seq").map { ($0["seq"] as Int64, $0["body"] as Data) },
                try String.fetchOne(db, sql: "PRAGMA integrity_check")
            )
        }
        #expect(check == "ok")
        #expect(stored.count == expected.count && stored.count == 40 * 150 + 360)
        #expect(stored.allSatisfy { expected[$0.0] == $0.1 })
        // The checkpoints read the WAL back through the VFS: the log was restarted at least once.
        let pages = try await reader.read { db in try Int.fetchOne(db, sql: "PRAGMA page_count") } ?? 0
        #expect(pages > 1000)
    }

    @Test("A one-row commit is one write of its frames (SQLite makes two per frame)")
    func oneWritePerCommit() async throws {
        try #require(WALWrites.available)
        let store = try QueueStore(path: directory.appendingPathComponent("q.sqlite").path, durability: .normal)
        _ = try await store.insert([item(0)])
        func writes() -> Int64 {
            store.database.writeWithoutTransaction { db in
                var count: Int64 = -1
                guard let connection = db.sqliteConnection, dq_wal_writes_count(connection, &count) == SQLITE_OK else { return -1 }
                return count
            }
        }
        let before = writes()
        #expect(before >= 1)
        for index in 1...100 { _ = try await store.insertGrouped(item(index)) }
        #expect(writes() - before == 100)
    }

    @Test("A queue path with URI characters is opened at that very path, and a relative one stays relative")
    func uriCharacters() async throws {
        try #require(WALWrites.available)
        let folder = directory.appendingPathComponent("a b?c#d%e&f=ü")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let path = folder.appendingPathComponent("q?vfs=unix#x.sqlite").path
        let store = try QueueStore(path: path, durability: .full)
        #expect(try await store.insert([item(1)]) == [1])
        #expect(FileManager.default.fileExists(atPath: path))
        #expect(
            try FileManager.default.contentsOfDirectory(atPath: folder.path).sorted() == [
                "q?vfs=unix#x.sqlite", "q?vfs=unix#x.sqlite-shm", "q?vfs=unix#x.sqlite-wal", "q?vfs=unix#x.sqlite.lock",
            ])
        let count = try await DatabaseQueue(path: path).read { db in try Int.fetchOne(db, sql: "SELECT count(*) FROM item") }
        #expect(count == 1)
        #expect(WALWrites.location(for: "queue dir/q.sqlite") == "file:queue%20dir/q.sqlite?vfs=dq-wal")
        #expect(WALWrites.location(for: "//srv/q.sqlite") == "file:////srv/q.sqlite?vfs=dq-wal")
    }
}
