import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

// Storing new items: single (grouped by the batcher), many, and in chunks.
extension SQLiteQueueStore {
    /// Stores `items` in one transaction: all of them or none. Returns their sequence numbers.
    func insert(_ items: [NewItem]) async throws -> [Int64] {
        try await immediate("enqueue") { db in try Self.insert(items, db: db) }
    }

    /// Stores the items of `chunks` chunks in one transaction, in order, inserting each as soon as `take`
    /// hands it over (`take(k)` may block until chunk `k` is made; nil means an input was bad and stops the
    /// enqueue), then checks the references of all of them on the same connection before the commit: all or
    /// none. The chunks after the first are made while the earlier ones are written.
    func insert(chunks: Int, take: @escaping @Sendable (Int) -> [NewItem]?) async throws -> [Int64] {
        try await immediate("enqueue") { db in
            var sequences: [Int64] = []
            var check = ReferenceCheck()
            for chunk in 0..<chunks {
                guard let items = take(chunk) else { throw DataQueueError(.invalidResource, "an input is bad; nothing was queued") }
                for item in items { check.add(item, index: check.added) }
                sequences += try Self.insert(items, db: db)
            }
            try check.refuseDeclaredTwice()
            try check.refuse(existing: try Self.knownFullURLs(check.lookups, db: db, before: sequences.first ?? .max))
            return sequences
        }
    }

    /// Transactions the grouped enqueues have committed (for tests of the grouping).
    var groupedCommits: Int { batcher.commits }

    /// Stores one item, sharing a commit with other enqueues that wait at the same moment.
    nonisolated(nonsending) func insertGrouped(_ item: NewItem) async throws -> Int64 {
        try await batcher.submit(item)
    }

    static func insert(_ items: [NewItem], db: Database) throws -> [Int64] {
        // Plain items are refused once the queue is sealed, in this very transaction: a process that opened the
        // queue while it was plain, without a key, would otherwise go on adding readable rows after another sealed
        // it. One look-up per transaction; sealed items (see ``Sealer``) need none.
        if items.contains(where: { !$0.sealed }), try isSealed(db) { throw SealedStorage.plainItemRefused }
        let now = Date().timeIntervalSince1970
        let statement = try db.cachedStatement(
            sql: """
                INSERT INTO item (uuid, queue, method, url, resource_type, resource_id, encrypted, content_type,
                                  body, enqueued_at, full_url, seq)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """)
        // The transaction's first number, read once and given to the first row; SQLite gives each later row
        // the number after the newest (a row given its number costs SQLite a lookup that a new one does not).
        let first = try Self.nextSequence(db)
        // Bound and stepped through SQLite's C API: GRDB's StatementArguments box each value of each row (an
        // array of existentials per row), which took a fifth of a bulk enqueue's writer thread.
        let handle = statement.sqliteStatement
        guard let connection = db.sqliteConnection else { throw DatabaseError(resultCode: .SQLITE_MISUSE, message: "closed") }
        defer {
            sqlite3_reset(handle)
            sqlite3_clear_bindings(handle)
        }
        var sequences: [Int64] = []
        sequences.reserveCapacity(items.count)
        // A row's text values, one after another in one reused buffer, bound where they lie (SQLITE_STATIC,
        // lengths given): no C string made per value, no strlen, no copy into SQLite's own buffers.
        var texts: [UInt8] = []
        texts.reserveCapacity(1024)
        var spans = [Range<Int>?](repeating: nil, count: 12)
        func append(_ column: Int, _ value: String?) {
            guard var value else { return spans[column] = nil }
            let start = texts.count
            value.withUTF8 { texts.append(contentsOf: $0) }
            spans[column] = start..<texts.count
        }
        for item in items {
            texts.removeAll(keepingCapacity: true)
            let start = texts.count
            item.id.appendLowercased(to: &texts)
            spans[1] = start..<texts.count
            append(2, item.queue)
            append(3, item.method.rawValue)
            append(4, item.url)
            append(5, item.resourceType)
            append(6, item.resourceID)
            append(8, item.contentType)
            append(11, item.fullURL)
            let code = item.body.withUnsafeBytes { body -> Int32 in
                texts.withUnsafeBufferPointer { texts -> Int32 in
                    var bound = SQLITE_OK
                    func check(_ code: Int32) { if bound == SQLITE_OK { bound = code } }
                    func text(_ index: Int32) {
                        guard let span = spans[Int(index)] else { return check(sqlite3_bind_null(handle, index)) }
                        // A zero-length value still needs a non-null pointer, or SQLite stores NULL.
                        let base = texts.baseAddress.map { UnsafeRawPointer($0 + span.lowerBound) } ?? UnsafeRawPointer(handle)
                        check(sqlite3_bind_text(handle, index, base.assumingMemoryBound(to: CChar.self), Int32(span.count), nil))
                    }
                    text(1)
                    text(2)
                    text(3)
                    text(4)
                    text(5)
                    text(6)
                    text(8)
                    text(11)
                    check(sqlite3_bind_int(handle, 7, item.encrypted ? 1 : 0))
                    // The bytes stay where they are (SQLITE_STATIC) until the step below has read them.
                    if let base = body.baseAddress, body.count > 0 {
                        check(sqlite3_bind_blob64(handle, 9, base, sqlite3_uint64(body.count), nil))
                    } else {
                        check(sqlite3_bind_zeroblob(handle, 9, 0))
                    }
                    check(sqlite3_bind_double(handle, 10, now))
                    check(sequences.isEmpty ? sqlite3_bind_int64(handle, 12, first) : sqlite3_bind_null(handle, 12))
                    guard bound == SQLITE_OK else { return bound }
                    let stepped = sqlite3_step(handle)
                    // Reset for the next row's bindings (after a failure, once its message was read: see `defer`).
                    if stepped == SQLITE_DONE { sqlite3_reset(handle) }
                    return stepped
                }
            }
            guard code == SQLITE_DONE else {
                throw DatabaseError(
                    resultCode: ResultCode(rawValue: code), message: String(cString: sqlite3_errmsg(connection)),
                    sql: statement.sql)
            }
            sequences.append(sqlite3_last_insert_rowid(connection))
            if let clientID = item.clientID {
                // A receiver's item (rare beside a producer's): its client, in the same transaction.
                try db.cachedStatement(sql: "UPDATE item SET client_id = ? WHERE seq = ?")
                    .execute(arguments: [clientID, sequences[sequences.count - 1]])
            }
        }
        return sequences
    }
}
