import Foundation
import GRDB
import SQLiteWALWrites
import Testing

@testable import FHIRDataQueue

/// The `dq-wal` VFS (``WALWrites``): one write per WAL frame, with what reaches the file and when it is
/// there unchanged, checked through connections of SQLite's default VFS and copies taken as a kill leaves them.
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
            // One row, rows that overflow onto other pages, a group of 150, a 300 KB row.
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

    @Test("Each WAL frame is one write (SQLite makes two: its header, then its page)")
    func oneWritePerFrame() async throws {
        try #require(WALWrites.available)
        let path = directory.appendingPathComponent("q.sqlite").path
        let store = try QueueStore(path: path, durability: .normal)
        _ = try await store.insert([item(0)])
        func writes() -> Int64 {
            store.database.writeWithoutTransaction { db in
                var count: Int64 = -1
                guard let connection = db.sqliteConnection, dq_wal_writes_count(connection, &count) == SQLITE_OK else { return -1 }
                return count
            }
        }
        // Frames are 24 + 4,096 bytes after the WAL's 32-byte header; no checkpoint runs below 1,000 frames.
        func frames() throws -> Int64 {
            let size = try FileManager.default.attributesOfItem(atPath: path + "-wal")[.size] as? Int64 ?? 0
            return (size - 32) / (24 + 4096)
        }
        let (writesBefore, framesBefore) = (writes(), try frames())
        #expect(writesBefore >= 1)
        for index in 1...100 { _ = try await store.insertGrouped(item(index)) }
        let (written, appended) = (writes() - writesBefore, try frames() - framesBefore)
        #expect(appended >= 300 && appended < 1000, "\(appended) frames for 100 one-row commits")
        #expect(written == appended)
    }

    /// Opens `path` through the VFS (`extra` appended to the URI), or through the default VFS.
    func connection(_ path: String, viaVFS: Bool, extra: String = "") throws -> DatabaseQueue {
        try DatabaseQueue(path: viaVFS ? WALWrites.location(for: path) + extra : path)
    }

    @Test("A rolled-back transaction that spilled frames leaves nothing to be written over another connection's commit")
    func rollbackThenAnotherWriter() async throws {
        try #require(WALWrites.available)
        let path = directory.appendingPathComponent("r.sqlite").path
        let first = try connection(path, viaVFS: true)
        try await first.writeWithoutTransaction { db in
            try db.execute(sql: "PRAGMA journal_mode = WAL")
            try db.execute(sql: "PRAGMA wal_autocheckpoint = 0; CREATE TABLE t (x); CREATE TABLE u (x); PRAGMA cache_size = 10")
            try db.execute(sql: "PRAGMA wal_checkpoint(TRUNCATE)")
            // 125 KB: more than the page cache, so SQLite writes frames to the log before the rollback.
            try db.execute(sql: "BEGIN")
            try db.execute(
                sql:
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 250) INSERT INTO u SELECT randomblob(500) FROM n"
            )
            try db.execute(sql: "ROLLBACK")
        }
        // Another connection appends its commit where the rolled-back frames were; then the first one closes.
        let second = try connection(path, viaVFS: false)
        try await second.write { db in
            try db.execute(
                sql:
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20) INSERT INTO t SELECT zeroblob(1500) FROM n"
            )
        }
        try first.close()
        try second.close()
        let reader = try connection(path, viaVFS: false)
        let (count, zeros, check) = try await reader.read { db in
            (
                try Int.fetchOne(db, sql: "SELECT count(*) FROM t"),
                try Int.fetchOne(db, sql: "SELECT count(*) FROM t WHERE x = zeroblob(1500)"),
                try String.fetchOne(db, sql: "PRAGMA integrity_check")
            )
        }
        #expect(check == "ok")
        #expect(count == 20 && zeros == 20)
    }

    @Test("A commit whose checksums SQLite rewrites (a page spilled, then changed again) is whole in a copy taken as it returns")
    func rewrittenChecksums() async throws {
        try #require(WALWrites.available)
        let path = directory.appendingPathComponent("s.sqlite").path
        let writer = try connection(path, viaVFS: true)
        try await writer.writeWithoutTransaction { db in
            try db.execute(sql: "PRAGMA journal_mode = WAL")
            try db.execute(
                sql:
                    "PRAGMA synchronous = NORMAL; PRAGMA wal_autocheckpoint = 0; CREATE TABLE t (x); CREATE INDEX tx ON t (x); PRAGMA cache_size = 10"
            )
            try db.execute(sql: "BEGIN")
            try db.execute(
                sql:
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3000) INSERT INTO t SELECT randomblob(500) FROM n"
            )
            try db.execute(sql: "COMMIT")
        }
        // What a kill of the process right now would leave on disk (no further call on the connection).
        let copy = directory.appendingPathComponent("copy")
        try FileManager.default.createDirectory(at: copy, withIntermediateDirectories: true)
        for suffix in ["", "-wal"] {
            try FileManager.default.copyItem(atPath: path + suffix, toPath: copy.appendingPathComponent("s.sqlite" + suffix).path)
        }
        let recovered = try connection(copy.appendingPathComponent("s.sqlite").path, viaVFS: false)
        let (count, check) = try await recovered.read { db in
            (try Int.fetchOne(db, sql: "SELECT count(*) FROM t"), try String.fetchOne(db, sql: "PRAGMA integrity_check"))
        }
        #expect(check == "ok")
        #expect(count == 3000)
        try writer.close()
    }

    @Test("Without powersafe overwrite (psow=0) and with synchronous=FULL, the padding frames are in the file at each commit")
    func paddingFrames() async throws {
        try #require(WALWrites.available)
        let path = directory.appendingPathComponent("p.sqlite").path
        let writer = try connection(path, viaVFS: true, extra: "&psow=0")
        try await writer.writeWithoutTransaction { db in
            try db.execute(sql: "PRAGMA journal_mode = WAL")
            try db.execute(sql: "PRAGMA synchronous = FULL; CREATE TABLE t (x)")
        }
        let reader = try connection(path, viaVFS: false)
        var problems: [String] = []
        for index in 1...200 {
            try await writer.write { db in try db.execute(sql: "INSERT INTO t VALUES (randomblob(300))") }
            let (count, check) = try await reader.read { db in
                (try Int.fetchOne(db, sql: "SELECT count(*) FROM t"), try String.fetchOne(db, sql: "PRAGMA quick_check"))
            }
            if count != index || check != "ok" { problems.append("commit \(index): \(count ?? -1) rows, \(check ?? "?")") }
        }
        #expect(problems.isEmpty, "\(problems.prefix(5))")
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
        // A file whose name starts with `file:` is that file, not a URI.
        #expect(WALWrites.location(for: "file:q.sqlite") == "file:file%3Aq.sqlite?vfs=dq-wal")
    }
}
