import CSQLite
import Foundation
import GRDB
import NIOConcurrencyHelpers
import NIOPosix
import Testing

@testable import FHIRDataQueue

/// What only the SQLite store does (the contract every store keeps is in StorageConformanceTests).
@Suite("The SQLite queue store")
struct QueueStoreTests {
    let directory: URL
    let scratch: Scratch

    init() throws {
        scratch = try Scratch("dq-unit")
        directory = scratch.url
    }

    var path: String { directory.appendingPathComponent("q.sqlite").path }

    func item(_ index: Int, queue: String = "http://h/fhir") -> NewItem {
        NewItem(
            id: UUID(), queue: queue, method: .post, url: "Patient", resourceType: "Patient", resourceID: nil,
            encrypted: false, contentType: "application/fhir+json",
            body: Data(#"{"resourceType":"Patient","n":\#(index)}"#.utf8))
    }

    @Test(
        "Listing the queues seeks along the item and journal indexes, one seek per name: no scan of either table (the journal keeps months of deliveries)"
    )
    func queueNamesSeek() async throws {
        let store = try SQLiteQueueStore(path: path, durability: .full)
        _ = try await store.insert([item(0), item(1, queue: "http://h/other")])
        let plan = try await store.database.read { db in
            try Row.fetchAll(db, sql: "EXPLAIN QUERY PLAN " + StatusQueries.queues).map { $0["detail"] as String? ?? "" }
        }
        #expect(plan.contains { $0.hasPrefix("SEARCH item USING COVERING INDEX") }, "\(plan)")
        #expect(plan.contains { $0.hasPrefix("SEARCH delivery USING COVERING INDEX") }, "\(plan)")
        // "SCAN items" and "SCAN journal" are the recursive steps' own rows; a scan of a table is "SCAN item …".
        let scans = plan.filter {
            $0.split(separator: " ").prefix(2) == ["SCAN", "item"] || $0.split(separator: " ").prefix(2) == ["SCAN", "delivery"]
        }
        #expect(scans.isEmpty, "a table read whole: \(plan)")
        #expect(try await store.queues() == ["http://h/fhir", "http://h/other"])
    }

    @Test("The database is WAL with synchronous=FULL by default, NORMAL when asked, and mode 0600")
    func pragmas() async throws {
        let store = try SQLiteQueueStore(path: path, durability: .full)
        let (mode, sync) = try await store.database.read { db in
            (try String.fetchOne(db, sql: "PRAGMA journal_mode"), try Int.fetchOne(db, sql: "PRAGMA synchronous"))
        }
        #expect(mode == "wal")
        #expect(sync == 2)
        let permissions = try FileManager.default.attributesOfItem(atPath: path)[.posixPermissions] as? Int
        #expect(permissions == 0o600)
        let normal = try SQLiteQueueStore(path: directory.appendingPathComponent("n.sqlite").path, durability: .normal)
        let normalSync = try await normal.database.read { db in try Int.fetchOne(db, sql: "PRAGMA synchronous") }
        #expect(normalSync == 1)
    }

    @Test("The WAL scrub after sealing says so when a reader keeps the WAL from being emptied, and empties it once the reader is gone")
    func scrubWaitsForReaders() async throws {
        let store = try SQLiteQueueStore(path: path, durability: .full, busyTimeout: 0.2)
        _ = try await store.insert((0..<20).map { item($0) })
        var reader: OpaquePointer?
        #expect(sqlite3_open_v2(path, &reader, SQLITE_OPEN_READONLY, nil) == SQLITE_OK)
        defer { sqlite3_close(reader) }
        // A read transaction: it reads from the WAL, which it keeps from being emptied while it lasts.
        #expect(sqlite3_exec(reader, "BEGIN; SELECT count(*) FROM item;", nil, nil, nil) == SQLITE_OK)
        _ = try await store.insert([item(20)])
        func walBytes() throws -> Int { try FileManager.default.attributesOfItem(atPath: path + "-wal")[.size] as? Int ?? -1 }
        #expect(try await store.scrubAfterSealing() == false)
        #expect(try walBytes() > 0)
        #expect(sqlite3_exec(reader, "COMMIT", nil, nil, nil) == SQLITE_OK)
        #expect(try await store.scrubAfterSealing() == true)
        #expect(try walBytes() == 0)
    }

    @Test("Opening an existing queue and reading its status writes nothing to disk")
    func readOnlyOpen() async throws {
        do {
            let store = try SQLiteQueueStore(path: path, durability: .full)
            _ = try await store.insert([item(1)])
        }
        func fingerprint() -> [String] {
            [path, path + "-wal"].map { file in
                guard let attributes = try? FileManager.default.attributesOfItem(atPath: file) else { return "absent" }
                let modified = (attributes[.modificationDate] as? Date)?.timeIntervalSince1970 ?? 0
                return "\(attributes[.size] ?? 0)@\(modified)"
            }
        }
        let before = fingerprint()
        do {
            let store = try SQLiteQueueStore(path: path, durability: .full)
            #expect(try await store.status(queue: "http://h/fhir", countingJournal: true).pending == 1)
        }
        #expect(fingerprint() == before)
    }

    @Test("Concurrent enqueues share commits, each gets its own sequence, and nothing is lost")
    func groupCommit() async throws {
        let store = try SQLiteQueueStore(path: path, durability: .full)
        let sequences = try await withThrowingTaskGroup(of: Int64.self) { group in
            for index in 0..<500 { group.addTask { try await store.insertGrouped(item(index)) } }
            return try await group.reduce(into: [Int64]()) { $0.append($1) }
        }
        #expect(sequences.count == 500 && Set(sequences).count == 500)
        #expect(try await store.status(queue: "http://h/fhir", countingJournal: true).pending == 500)
        #expect(store.groupedCommits >= 1 && store.groupedCommits <= 500, "\(store.groupedCommits) commits")
    }

    /// A durable enqueue must not hold a thread of the caller's executor in its commit: from a task whose
    /// executor has one thread, the enqueue's commit runs on another thread. (Before, an uncontended enqueue
    /// committed, with its fsync, on the calling thread: with two pool threads, two such enqueues stopped
    /// everything else the process did.)
    @Test("A durable enqueue commits off the calling task's thread")
    func enqueueCommitsOffCaller() async throws {
        let commitThreads = NIOLockedValueBox<[pthread_t]>([])
        let store = try SQLiteQueueStore(path: path, durability: .full)
        let batcher = GroupCommit<NewItem, Int64>(
            committer: .thread(name: "dq-enqueue") { items in
                commitThreads.withLockedValue { $0.append(pthread_self()) }
                return SQLiteQueueStore.immediateNow(store.database, "enqueue") { db in try SQLiteQueueStore.insert(items, db: db) }
            })
        let loop = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let executor = EventLoopTaskExecutor(loop.next())
        let callerThread = try await Task(executorPreference: executor) { () async throws -> pthread_t in
            for index in 0..<3 { _ = try await batcher.submit(item(index)) }
            return pthread_self()
        }.value
        #expect(try await store.status(queue: "http://h/fhir", countingJournal: true).pending == 3)
        try await loop.shutdownGracefully()
        let threads = commitThreads.withLockedValue { $0 }
        #expect(threads.count == 3)
        #expect(!threads.contains(callerThread), "a commit ran on the calling task's thread")
    }

    /// The same through the embedding API itself: `DataQueue.enqueue` at `durability: full`, from a task whose
    /// executor has one thread. SQLite's commit hook runs on the thread that commits (and then fsyncs): it must
    /// never be the caller's. A commit on the caller's thread (GRDB's synchronous write runs its block there) holds
    /// a host's pool thread through the fsync.
    @Test("DataQueue.enqueue at durability full commits off the calling task's thread (SQLite's commit hook says where)")
    func dataQueueEnqueueCommitsOffCaller() async throws {
        var configuration = DataQueue.Configuration(databasePath: path)
        configuration.durability = .full
        let queue = try await DataQueue(baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: configuration)
        let store = try #require(queue.store as? SQLiteQueueStore)
        let recorder = CommitThreads()
        try await store.database.writeWithoutTransaction { db in
            _ = sqlite3_commit_hook(
                db.sqliteConnection,
                { context in
                    Unmanaged<CommitThreads>.fromOpaque(context!).takeUnretainedValue().record()
                    return 0
                }, Unmanaged.passUnretained(recorder).toOpaque())
        }
        let loop = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let executor = EventLoopTaskExecutor(loop.next())
        let callerThread = try await Task(executorPreference: executor) { () async throws -> pthread_t in
            for index in 0..<3 {
                try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient","n":\#(index)}"#.utf8)))
            }
            return pthread_self()
        }.value
        #expect(try await queue.status().pending == 3)
        let threads = recorder.threads
        #expect(threads.count >= 3, "each enqueue committed: \(threads.count)")
        #expect(!threads.contains(callerThread), "a commit ran on the calling task's thread")
        // The control: a synchronous GRDB write from that executor commits on its thread, and the hook sees it
        // (so the check above can fail).
        let controlThread = try await Task(executorPreference: executor) { () throws -> pthread_t in
            try store.database.write { db in try db.execute(sql: "CREATE TABLE IF NOT EXISTS commit_probe (x)") }
            return pthread_self()
        }.value
        #expect(recorder.threads.dropFirst(threads.count).contains(controlThread), "the hook records the committing thread")
        try await queue.shutdown()
        try await loop.shutdownGracefully()
        withExtendedLifetime(recorder) {}
    }

    /// The threads SQLite's commit hook ran on.
    final class CommitThreads: Sendable {
        private let recorded = NIOLockedValueBox<[pthread_t]>([])
        var threads: [pthread_t] { recorded.withLockedValue { $0 } }
        func record() { recorded.withLockedValue { $0.append(pthread_self()) } }
    }

    @Test(
        "In a setgid, group-writable directory the queue, its WAL, SHM and lock files are made 0660 (whatever the umask) for the group to share; elsewhere 0600"
    )
    func groupSharedDirectory() async throws {
        let shared = directory.appendingPathComponent("shared").path
        try FileManager.default.createDirectory(atPath: shared, withIntermediateDirectories: true)
        #expect(chmod(shared, 0o2770) == 0)
        func mode(_ file: String) throws -> Int? {
            try FileManager.default.attributesOfItem(atPath: file)[.posixPermissions] as? Int
        }
        for (folder, expected) in [(shared, 0o660), (directory.path, 0o600)] {
            let database = folder + "/queue.sqlite"
            let store = try SQLiteQueueStore(path: database, durability: .full)
            _ = try await store.insert([item(1)])
            let lock = try #require(try await store.acquireFlush(queue: "http://h/fhir", until: .now) as? FileLock)
            for file in [database, database + "-wal", database + "-shm", database + ".lock", lock.path] {
                // The process umask (022 here) would make 0640 of a plain open(…, 0660).
                #expect(try mode(file) == expected, "\(file)")
            }
            lock.release()
        }
        // A file that exists keeps the mode its owner gave it.
        let existing = shared + "/queue.sqlite.flush-kept.lock"
        #expect(FileManager.default.createFile(atPath: existing, contents: nil, attributes: [.posixPermissions: 0o600]))
        _ = try FileLock(path: existing)
        #expect(try mode(existing) == 0o600)
    }

    /// Opening a queue may wait for another process's file lock (and then migrate): it must not hold the
    /// caller's thread meanwhile. From an executor of one thread, a second task on it runs while the open
    /// waits. (Before, `DataQueue.init` took the lock on the calling thread: the second task ran only after the
    /// lock was released, which here happens after 20 s without it.)
    @Test("Opening a queue waits for its file lock off the calling task's thread")
    func openWaitsOffCaller() async throws {
        let holder = try FileLock(path: path + ".lock")
        try holder.lock()
        let otherRan = NIOLockedValueBox(false)
        let otherRanBeforeRelease = NIOLockedValueBox<Bool?>(nil)
        let releaser = Thread {
            let deadline = Date().addingTimeInterval(20)
            while !otherRan.withLockedValue({ $0 }) && Date() < deadline { usleep(10_000) }
            otherRanBeforeRelease.withLockedValue { $0 = otherRan.withLockedValue { $0 } }
            holder.unlock()
        }
        let loop = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let executor = EventLoopTaskExecutor(loop.next())
        let path = path
        let started = NIOLockedValueBox(false)
        let opening = Task(executorPreference: executor) {
            started.withLockedValue { $0 = true }  // from here the open runs on without a suspension until it waits
            return try await DataQueue(
                baseURL: URL(string: "http://h/fhir")!, configuration: DataQueue.Configuration(databasePath: path))
        }
        while !started.withLockedValue({ $0 }) { try await Task.sleep(for: .milliseconds(5)) }
        releaser.start()
        await Task(executorPreference: executor) { otherRan.withLockedValue { $0 = true } }.value
        let queue = try await opening.value
        #expect(try await queue.status().pending == 0)
        try await queue.shutdown()
        try await loop.shutdownGracefully()
        #expect(otherRanBeforeRelease.withLockedValue { $0 } == true, "the open held the caller's only thread while it waited")
    }

    @Test("A queue path with URI characters is opened at that very path, and a relative one stays relative")
    func uriCharacters() async throws {
        let folder = directory.appendingPathComponent("a b?c#d%e&f=ü")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let path = folder.appendingPathComponent("q?vfs=unix#x.sqlite").path
        let store = try SQLiteQueueStore(path: path, durability: .full)
        #expect(try await store.insert([item(1)]) == [1])
        #expect(
            try FileManager.default.contentsOfDirectory(atPath: folder.path).sorted() == [
                "q?vfs=unix#x.sqlite", "q?vfs=unix#x.sqlite-shm", "q?vfs=unix#x.sqlite-wal", "q?vfs=unix#x.sqlite.lock",
            ])
        var configuration = Configuration()
        configuration.readonly = true
        let count = try await DatabaseQueue(path: SQLiteFileName.location(for: path), configuration: configuration).read { db in
            try Int.fetchOne(db, sql: "SELECT count(*) FROM item")
        }
        #expect(count == 1)
        try #require(SQLiteFileName.readsURIs, "Debian's SQLite reads URI filenames")
        #expect(SQLiteFileName.location(for: "queue dir/q.sqlite") == "file:queue%20dir/q.sqlite")
        #expect(SQLiteFileName.location(for: "//srv/q.sqlite") == "file:////srv/q.sqlite")
        // A file whose name starts with `file:` is that file, not a URI.
        #expect(SQLiteFileName.location(for: "file:q.sqlite") == "file:file%3Aq.sqlite")
    }

    /// Polls `condition` (yielding) for up to 10 s.
    func waitFor(_ condition: () -> Bool) async throws -> Bool {
        for _ in 0..<10_000 {
            if condition() { return true }
            try await Task.sleep(for: .milliseconds(1))
        }
        return condition()
    }

    /// `dq show 42`, the journal's `item_seq` and `dq migrate`'s cursor rely on it; a schema without
    /// AUTOINCREMENT (SQLite's default would hand out the newest deleted number again) fails it.
    @Test("A sequence number is never used twice: deleting the newest items, or all, does not hand their numbers out again")
    func sequenceNeverReused() async throws {
        let store = try SQLiteQueueStore(path: path, durability: .full)
        #expect(try await store.insert([item(1), item(2), item(3)]) == [1, 2, 3])
        try await store.database.write { db in try db.execute(sql: "DELETE FROM item WHERE seq = 3") }
        #expect(try await store.insert([item(4)]) == [4])
        // An older item's deletion changes nothing.
        try await store.database.write { db in try db.execute(sql: "DELETE FROM item WHERE seq = 1") }
        #expect(try await store.insertGrouped(item(5)) == 5)
        // Every item gone, in any order: the next is still past all of them, also after reopening.
        try await store.database.write { db in try db.execute(sql: "DELETE FROM item") }
        #expect(try await store.insert([item(6), item(7)]) == [6, 7])
        try await store.database.write { db in
            try db.execute(sql: "DELETE FROM item WHERE seq = 6")
            try db.execute(sql: "DELETE FROM item WHERE seq = 7")
        }
        let reopened = try SQLiteQueueStore(path: path, durability: .full)
        #expect(try await reopened.insert([item(8)]) == [8])
    }

    @Test("Many stores opening one new file at once migrate it exactly once")
    func concurrentMigration() async throws {
        let openers = 8
        for round in 0..<5 {
            let shared = directory.appendingPathComponent("m\(round).sqlite").path
            // Each opener hands back its store or its error, so every failed open is reported.
            let results: [Result<SQLiteQueueStore, any Error>] = await withTaskGroup(of: Result<SQLiteQueueStore, any Error>.self) {
                group in
                for _ in 0..<openers {
                    // Each on a thread of its own: an open waits for the file's lock, blocking its thread.
                    group.addTask { await onThreadOfItsOwn { Result { try SQLiteQueueStore(path: shared, durability: .full) } } }
                }
                var all: [Result<SQLiteQueueStore, any Error>] = []
                for await result in group { all.append(result) }
                return all
            }
            let stores = results.compactMap { try? $0.get() }
            let failures = results.compactMap { result -> String? in
                if case .failure(let error) = result { return "\(error)" }
                return nil
            }
            #expect(failures.isEmpty, "round \(round): \(failures)")
            #expect(stores.count == openers, "round \(round)")
            let store = try #require(stores.first)
            let (applied, tables) = try await store.database.read { db in
                (
                    try String.fetchAll(db, sql: "SELECT identifier FROM grdb_migrations"),
                    try ["item", "delivery", "server_state"].filter { try db.tableExists($0) }
                )
            }
            // Every registered migration ran, each once, and nothing else did.
            #expect(applied.count == Set(applied).count, "round \(round): \(applied)")
            #expect(applied.sorted() == SQLiteQueueStore.migrator.migrations.sorted(), "round \(round): \(applied)")
            #expect(tables == ["item", "delivery", "server_state"], "round \(round)")
            // The migrated file works: an item inserted through one store is seen through another.
            #expect(try await store.insert([item(round)]).count == 1)
            let other = try #require(stores.last)
            #expect(try await other.status(queue: "http://h/fhir", countingJournal: true).pending == 1, "round \(round)")
        }
    }
}
