import Foundation
import GRDB
import Testing

@testable import FHIRDataQueue

/// Routing ambiguities in resources, bad numbers in settings, and files dq must not trust.
@Suite("Input, settings and file hardening")
struct InputHardeningTests {
    let directory: URL
    let scratch: Scratch

    init() throws {
        scratch = try Scratch("dq-input")
        directory = scratch.url
    }

    func path(_ name: String) -> String { directory.appendingPathComponent(name).path }

    // MARK: - Resources

    @Test("Keys written with escapes are the keys every receiver reads")
    func escapedKeys() throws {
        let resource = try FHIRResource(json: Data(#"{"resource\u0054ype":"Patient","i\u0064":"p-1"}"#.utf8))
        #expect(resource.resourceType == "Patient")
        #expect(resource.id == "p-1")
    }

    @Test(
        "A top-level key given twice is refused, escaped or not, naming the key",
        arguments: [
            (#"{"resourceType":"Observation","resource\u0054ype":"Patient"}"#, "resourceType"),
            (#"{"resourceType":"Patient","id":"a","id":"b"}"#, "id"),
            (#"{"resourceType":"Patient","gender":"male","gender":"female"}"#, "gender"),
        ])
    func duplicateKeys(json: String, key: String) throws {
        let error = try #require(throws: DataQueueError.self) { try FHIRResource(json: Data(json.utf8)) }
        #expect(error.code == .invalidResource)
        #expect(error.message.contains("\"\(key)\" appears twice"), "\(error.message)")
    }

    @Test("Repeats are found among many keys, after an escaped key, and for the empty key")
    func duplicateKeysBeyondTheFirstFew() throws {
        let many = (0..<40).map { "\"k\($0)\":\($0)" }.joined(separator: ",")
        let cases: [(String, String)] = [
            // The repeat comes after more keys than are compared one by one.
            (#"{"resourceType":"Patient","k3":"x","# + many + "}", "k3"),
            (#"{"resourceType":"Patient","# + many + #","k39":0}"#, "k39"),
            // An escaped key first, then the same key plainly.
            (#"{"i\u0064":"a","resourceType":"Patient","id":"b"}"#, "id"),
            (#"{"":1,"resourceType":"Patient","":2}"#, ""),
        ]
        for (json, key) in cases {
            let error = try #require(throws: DataQueueError.self) { try FHIRResource(json: Data(json.utf8)) }
            #expect(error.message.contains("\"\(key)\" appears twice"), "\(error.message)")
        }
        // As many different keys are accepted, and the wanted members are still found past the first few.
        let resource = try FHIRResource(json: Data((#"{"# + many + #","resourceType":"Patient","id":"p-9"}"#).utf8))
        #expect(resource.resourceType == "Patient")
        #expect(resource.id == "p-9")
        // Keys that are canonically equivalent but different code points are different keys (as JSON parsers
        // compare them): "é" precomposed and "e" + combining acute.
        _ = try FHIRResource(json: Data(#"{"resourceType":"Patient","\u00e9":1,"e\u0301":2}"#.utf8))
        _ = try FHIRResource(json: Data("{\"resourceType\":\"Patient\",\"\u{E9}\":1,\"e\u{301}\":2}".utf8))
    }

    @Test("A UUID's lowercase form is the one Foundation prints, lowercased")
    func lowercaseUUID() {
        for _ in 0..<200 {
            let id = UUID.timeOrdered()
            var bytes: [UInt8] = [1, 2]
            id.appendLowercased(to: &bytes)
            #expect(id.lowercasedString == id.uuidString.lowercased())
            #expect(bytes == [1, 2] + Array(id.uuidString.lowercased().utf8))
        }
    }

    @Test("A repeated key inside a nested object is not a top-level duplicate")
    func nestedRepeatsAreLeftAlone() throws {
        // Only the top level routes a resource; deeper members are the server's to judge.
        _ = try FHIRResource(json: Data(#"{"resourceType":"Patient","a":{"x":1},"b":{"x":2}}"#.utf8))
    }

    @Test(
        "A lone surrogate and a number too small to tell from 0 are refused, named; a surrogate pair and 0e5 are fine",
        arguments: [
            (#"{"resourceType":"Patient","name":[{"text":"\ud800"}]}"#, "lone UTF-16 surrogate"),
            (#"{"resourceType":"Patient","name":[{"text":"\udc00x"}]}"#, "lone UTF-16 surrogate"),
            (#"{"resourceType":"Patient","name":[{"text":"\ud800\u0041"}]}"#, "lone UTF-16 surrogate"),
            (#"{"resourceType":"Observation","valueQuantity":{"value":1e-999}}"#, "too small to be told from 0"),
            (#"{"resourceType":"Observation","valueQuantity":{"value":1e999}}"#, "out of range"),
            (#"{"resourceType":"Patient","name":[{"text":"\ud83d\ude00"}]}"#, ""),
            (#"{"resourceType":"Observation","valueQuantity":{"value":0e5}}"#, ""),
            (#"{"resourceType":"Observation","valueQuantity":{"value":0.000}}"#, ""),
        ])
    func surrogatesAndUnderflow(json: String, refusal: String) throws {
        if refusal.isEmpty {
            _ = try FHIRResource(json: Data(json.utf8))
        } else {
            let error = #expect(throws: DataQueueError.self) { try FHIRResource(json: Data(json.utf8)) }
            #expect(error?.message.contains(refusal) == true, "\(error?.message ?? "")")
        }
    }

    @Test("A UTF-8 byte order mark is refused with its own message")
    func byteOrderMark() throws {
        let error = try #require(throws: DataQueueError.self) {
            try FHIRResource(json: Data([0xEF, 0xBB, 0xBF] + Array(#"{"resourceType":"Patient"}"#.utf8)))
        }
        #expect(error.code == .invalidResource)
        #expect(error.message.contains("byte order mark"))
    }

    @Test("Idempotent preparation keeps every byte of the resource and adds exactly one identifier")
    func conditionalCreateInsertion() throws {
        let id = UUID()
        let cases: [(String, String)] = [
            (
                #" {"resourceType":"Patient","value":1.50}"#,
                #" {"identifier":[{"system":"urn:ietf:rfc:3986","value":"urn:uuid:X"}],"resourceType":"Patient","value":1.50}"#
            ),
            (
                #"{"resourceType":"Patient","identifier":[]}"#,
                #"{"resourceType":"Patient","identifier":[{"system":"urn:ietf:rfc:3986","value":"urn:uuid:X"}]}"#
            ),
            (
                #"{"resourceType":"Patient","identifier":[{"value":"v"}]}"#,
                #"{"resourceType":"Patient","identifier":[{"system":"urn:ietf:rfc:3986","value":"urn:uuid:X"},{"value":"v"}]}"#
            ),
        ]
        for (input, expected) in cases {
            let (body, condition) = try ConditionalCreate.prepare(Data(input.utf8), itemID: id, isBundle: false)
            let wanted = expected.replacingOccurrences(of: "urn:uuid:X", with: "urn:uuid:\(id.lowercasedString)")
            #expect(String(decoding: body, as: UTF8.self) == wanted)
            #expect(condition == "identifier=urn:ietf:rfc:3986|urn:uuid:\(id.lowercasedString)")
            _ = try FHIRResource(json: body)
        }
        let kept = try ConditionalCreate.prepare(
            Data(#"{"resourceType":"Patient","identifier":[{"system":"s&x","value":"a|b"}]}"#.utf8), itemID: id, isBundle: false)
        #expect(kept.ifNoneExist == "identifier=s%26x|a%7Cb")
        // A single identifier (QuestionnaireResponse.identifier is 0..1) is used when it names the resource.
        let single = try ConditionalCreate.prepare(
            Data(#"{"resourceType":"QuestionnaireResponse","identifier":{"system":"s","value":"q"}}"#.utf8), itemID: id,
            isBundle: false)
        #expect(single.ifNoneExist == "identifier=s|q")
        let error = try #require(throws: DataQueueError.self) {
            try ConditionalCreate.prepare(
                Data(#"{"resourceType":"QuestionnaireResponse","identifier":{"value":"v"}}"#.utf8), itemID: id, isBundle: false)
        }
        #expect(error.message.contains("system and a value"))
    }

    // MARK: - Settings

    @Test(
        "Durations that are not finite, out of range or zero where zero makes no sense are refused, naming the setting",
        arguments: [Double.nan, .infinity, -.infinity, 1e300, 0, -1, 86_401])
    func badTimeouts(value: Double) async throws {
        var configuration = DataQueue.Configuration(databasePath: path("q.sqlite"))
        configuration.requestTimeout = value
        let error = try #require(throws: DataQueueError.self) { try configuration.validate() }
        #expect(error.code == .invalidConfiguration)
        #expect(error.message.contains("requestTimeout"))
        await #expect(throws: DataQueueError.self) {
            try await DataQueue(baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: configuration)
        }
        #expect(!FileManager.default.fileExists(atPath: path("q.sqlite")), "nothing opened for a bad setting")
    }

    @Test("Each duration and size is checked", arguments: ["connectTimeout", "lockWait", "settleDelay", "initialDelay", "jitter", "size"])
    func everySettingChecked(name: String) throws {
        var configuration = DataQueue.Configuration(databasePath: path("q.sqlite"))
        switch name {
        case "connectTimeout": configuration.connectTimeout = .nan
        case "lockWait": configuration.lockWait = -1
        case "settleDelay": configuration.settleDelay = .infinity
        case "initialDelay": configuration.retryPolicy.initialDelay = 1e300
        case "jitter": configuration.retryPolicy.jitter = .nan
        default: configuration.maximumResourceSize = 1 << 40
        }
        let error = try #require(throws: DataQueueError.self) { try configuration.validate() }
        #expect(error.message.contains(name == "size" ? "maximumResourceSize" : name))
        configuration = DataQueue.Configuration(databasePath: path("q.sqlite"))
        try configuration.validate()
    }

    @Test(
        "A database setting in a URL form dq does not know is refused without creating anything",
        arguments: ["mysql://u:pw@host/db", "sqlite://x"])
    func databaseURLRefused(url: String) async throws {
        let error = try #require(throws: DataQueueError.self) {
            try DataQueue.Configuration.checkDatabasePath(url, name: "database")
        }
        #expect(error.code == .invalidConfiguration)
        #expect(!error.message.contains("pw"))
        await #expect(throws: DataQueueError.self) {
            try await DataQueue(baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: .init(databasePath: url))
        }
        #expect(!FileManager.default.fileExists(atPath: url.components(separatedBy: "/")[0]))
    }

    // MARK: - Files

    @Test(
        "A flush lock file deleted or replaced: the next locker reopens the path, so two lockers never both hold it; a holder stops sending"
    )
    func deletedLockFile() async throws {
        let path = FileManager.default.temporaryDirectory.appendingPathComponent("dq-lock-\(UUID().uuidString)").path
        let first = try FileLock(path: path)
        #expect(try first.tryLock())
        first.unlock()
        // The file is deleted between two flushes of a long-lived process (first): a second process opens the
        // path anew and locks it. When the first locks again, it must find the second's lock.
        try FileManager.default.removeItem(atPath: path)
        let second = try FileLock(path: path)
        #expect(try second.tryLock())
        #expect(try !first.tryLock(), "the first locked the deleted file while the second held the new one")
        second.unlock()
        #expect(try first.tryLock())
        // Deleted while held, by a lock that does not look for holders of a deleted file (so a newcomer would
        // not see this one either): the holder's next send is refused.
        try FileManager.default.removeItem(atPath: path)
        await #expect(throws: DataQueueError.self) { try await first.markInFlight(sequence: 1) }
        first.unlock()
        try? FileManager.default.removeItem(atPath: path)
    }

    #if os(Linux)
        @Test(
            "A flush lock deleted while held keeps a second locker out until the holder lets go (the kernel's lock table names the holder)"
        )
        func deletedWhileHeld() throws {
            let path = self.path("q.sqlite.flush-x.lock")
            let holder = try FileLock(path: path, guardsDeletion: true)
            #expect(try holder.tryLock())
            try FileManager.default.removeItem(atPath: path)
            // A cron flush now opens the path, creates a new file and gets its flock, but not the lock: the holder
            // may have a request on the wire, and the new locker would send that item again.
            let cron = try FileLock(path: path, guardsDeletion: true)
            #expect(try !cron.tryLock(), "a second locker got in while the holder of the deleted file still held it")
            #expect(try !cron.tryLock(), "a refused locker must not keep the new file's flock either")
            let plain = try FileLock(path: path)
            #expect(try plain.tryLock(), "the refused locker let go of the new file's flock")
            plain.unlock()
            holder.unlock()
            #expect(try cron.tryLock(), "once the holder lets go, the next locker gets in")
            // A deleted lock file of another name, or in another directory, is another lock.
            try FileManager.default.createDirectory(atPath: self.path("other"), withIntermediateDirectories: true)
            let elsewhere = try FileLock(path: self.path("other/q.sqlite.flush-x.lock"), guardsDeletion: true)
            #expect(try elsewhere.tryLock())
            try FileManager.default.removeItem(atPath: self.path("other/q.sqlite.flush-x.lock"))
            let beside = try FileLock(path: self.path("q.sqlite.flush-y.lock"), guardsDeletion: true)
            #expect(try beside.tryLock(), "a deleted file of another name does not hold this lock")
            #expect(try !FileLock(path: self.path("other/q.sqlite.flush-x.lock"), guardsDeletion: true).tryLock())
            elsewhere.unlock()
            beside.unlock()
            cron.unlock()
        }

        @Test(
            "A flush lock deleted while held: the holder moves to the new file at its next send and goes on, with its marker there, and a second locker stays out; a stranger holding the new file stops it"
        )
        func holderMovesToNewFile() async throws {
            let path = self.path("q.sqlite.flush-m.lock")
            let holder = try FileLock(path: path, guardsDeletion: true)
            #expect(try holder.tryLock())
            try await holder.markInFlight(sequence: 1)
            for round in 2...4 {
                try FileManager.default.removeItem(atPath: path)
                let cron = try FileLock(path: path, guardsDeletion: true)
                #expect(try !cron.tryLock(), "round \(round): a locker got in while the holder of the deleted file held it")
                try await holder.markInFlight(sequence: Int64(round))
                #expect(try !cron.tryLock(), "round \(round): a locker got in after the holder moved to the new file")
                #expect(
                    try FileLock(path: path).inFlight()?.sequence == Int64(round),
                    "round \(round): the holder's marker is in the file at the path, for a flusher after a crash")
                #expect(
                    try !FileLock(path: path).tryLock(), "round \(round): the new file's flock is the holder's")
            }
            holder.release()
            let next = try FileLock(path: path, guardsDeletion: true)
            #expect(try next.tryLock(), "once the holder lets go, the next locker gets in")
            next.unlock()

            // The new file's flock taken first by a locker that does not look (a process this one cannot see in
            // /proc, of another user or container): the holder must stop, not send beside it.
            let second = try FileLock(path: path, guardsDeletion: true)
            #expect(try second.tryLock())
            try FileManager.default.removeItem(atPath: path)
            let stranger = try FileLock(path: path)
            #expect(try stranger.tryLock())
            await #expect(throws: DataQueueError.self) { try await second.markInFlight(sequence: 9) }
            stranger.unlock()
            second.unlock()

            // Such a locker got in, sent (its marker is in the new file) and left before the holder's next send:
            // the holder may have read ahead what that one delivered, so it stops although the flock is free.
            let third = try FileLock(path: path, guardsDeletion: true)
            #expect(try third.tryLock())
            try FileManager.default.removeItem(atPath: path)
            let unseen = try FileLock(path: path)
            #expect(try unseen.tryLock())
            try await unseen.markInFlight(sequence: 10)
            unseen.release()
            let used = await #expect(throws: DataQueueError.self) { try await third.markInFlight(sequence: 11) }
            #expect(used?.message.contains("another flusher has used the new one") == true, "\(String(describing: used))")
            third.unlock()

            // A locker whose own new file is deleted while it looks at the kernel's table cannot tell which
            // deleted files were at the path: it counts the lock as held and tries again later.
            let gone = self.path("q.sqlite.flush-g.lock")
            let fd = open(gone, O_CREAT | O_RDWR | O_CLOEXEC, 0o600)
            #expect(fd >= 0)
            unlink(gone)
            #expect(DeletedLockHolders.anyHolds(deletedFileOf: fd))
            close(fd)
        }
    #endif

    @Test("A symbolic link at a lock file is refused and its target left untouched")
    func lockFileSymlink() throws {
        let target = path("precious.txt")
        try Data("keep me".utf8).write(to: URL(fileURLWithPath: target))
        let lockPath = path("q.sqlite.lock")
        try FileManager.default.createSymbolicLink(atPath: lockPath, withDestinationPath: target)
        let error = try #require(throws: DataQueueError.self) { try SQLiteQueueStore(path: path("q.sqlite"), durability: .full) }
        #expect(error.message.contains("symbolic link"))
        #expect(try String(contentsOfFile: target, encoding: .utf8) == "keep me")
    }

    @Test("The flush lock refuses a symbolic link too: a flush cannot be made to write through it")
    func flushLockSymlink() async throws {
        let target = path("precious.txt")
        try Data("keep me".utf8).write(to: URL(fileURLWithPath: target))
        let queue = try await DataQueue(
            baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: .init(databasePath: path("q.sqlite")))
        try FileManager.default.createSymbolicLink(atPath: queue.flushLockPath, withDestinationPath: target)
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        await #expect(throws: DataQueueError.self) { try await queue.flush() }
        #expect(try String(contentsOfFile: target, encoding: .utf8) == "keep me")
        try await queue.shutdown()
    }

    @Test("Opening for reading creates nothing and fails when there is no queue")
    func readOnlyMissing() throws {
        let missing = path("no/such/dir/q.sqlite")
        let error = try #require(throws: DataQueueError.self) {
            try SQLiteQueueStore(path: missing, durability: .full, readOnly: true)
        }
        #expect(error.code == .storage && error.message.contains("no queue database"))
        #expect(!FileManager.default.fileExists(atPath: path("no")))
    }

    @Test("A read-only store reads a queue and refuses writes")
    func readOnlyReads() async throws {
        do {
            let store = try SQLiteQueueStore(path: path("q.sqlite"), durability: .full)
            _ = try await store.insert([
                NewItem(
                    id: UUID(), queue: "http://h/fhir", method: .post, url: "Patient", resourceType: "Patient",
                    resourceID: nil, encrypted: false, contentType: "application/fhir+json",
                    body: Data(#"{"resourceType":"Patient"}"#.utf8))
            ])
        }
        let reader = try SQLiteQueueStore(path: path("q.sqlite"), durability: .full, readOnly: true)
        #expect(try await reader.status(queue: "http://h/fhir", countingJournal: true).pending == 1)
        await #expect(throws: DataQueueError.self) { try await reader.retryAllParked(queue: "http://h/fhir") }
    }

    @Test("An empty file or a file that is not a dq queue is refused and left as it was")
    func foreignFiles() throws {
        let empty = path("empty.sqlite")
        _ = FileManager.default.createFile(atPath: empty, contents: Data())
        let emptyError = try #require(throws: DataQueueError.self) { try SQLiteQueueStore(path: empty, durability: .full) }
        #expect(emptyError.message.contains("empty"))
        #expect((try FileManager.default.attributesOfItem(atPath: empty)[.size] as? Int) == 0)

        let text = path("notes.sqlite")
        try Data(String(repeating: "not a database\n", count: 100).utf8).write(to: URL(fileURLWithPath: text))
        let textError = try #require(throws: DataQueueError.self) { try SQLiteQueueStore(path: text, durability: .full) }
        #expect(textError.message.contains("not a SQLite database"))
        #expect(try String(contentsOfFile: text, encoding: .utf8).hasPrefix("not a database"))

        let other = path("other.sqlite")
        try DatabaseQueue(path: other).write { db in try db.execute(sql: "CREATE TABLE notes (t TEXT)") }
        let otherError = try #require(throws: DataQueueError.self) { try SQLiteQueueStore(path: other, durability: .full) }
        #expect(otherError.message.contains("not a dq queue"))
        let tables = try DatabaseQueue(path: other).read { db in
            try String.fetchAll(db, sql: "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        }
        #expect(tables == ["notes"])
    }

    @Test("A new database appears whole: no leftover temporary file, schema complete")
    func creationIsAtomic() throws {
        let store = try SQLiteQueueStore(path: path("q.sqlite"), durability: .full)
        let files = try FileManager.default.contentsOfDirectory(atPath: directory.path)
        #expect(!files.contains { $0.hasPrefix("q.sqlite.new") }, "\(files)")
        let migrations = try store.database.read { db in
            try String.fetchAll(db, sql: "SELECT identifier FROM grdb_migrations ORDER BY identifier")
        }
        #expect(migrations == SQLiteQueueStore.migrator.migrations)
        #expect(migrations.count >= 3)
    }

    @Test("Migration v2 turns stored URLs into paths and queue names into their normal form")
    func migrationV2() throws {
        let file = path("old.sqlite")
        let old = try DatabaseQueue(path: file)
        // A database of the previous dq: the real migrator up to v1.
        try SQLiteQueueStore.migrator.migrate(old, upTo: "v1")
        try old.write { db in
            let columns = "(uuid, queue, method, url, resource_type, encrypted, content_type, body, enqueued_at)"
            try db.execute(
                sql: "INSERT INTO item \(columns) VALUES (?, ?, 'POST', ?, 'Patient', 0, 'application/fhir+json', x'7b7d', 0)",
                arguments: [UUID().uuidString.lowercased(), "HTTP://H:80/fhir", "HTTP://H:80/fhir/Patient"])
            try db.execute(
                sql: "INSERT INTO item \(columns) VALUES (?, ?, 'POST', ?, 'Patient', 1, 'application/json', x'7b7d', 0)",
                arguments: [UUID().uuidString.lowercased(), "HTTP://H:80/fhir", "https://enc/c3pro/Patient"])
            try db.execute(
                sql: "INSERT INTO item \(columns) VALUES (?, ?, 'PUT', ?, 'Patient', 0, 'application/fhir+json', x'7b7d', 0)",
                arguments: [UUID().uuidString.lowercased(), "HTTP://H:80/fhir", "http://evil/Patient/x"])
        }
        try old.close()
        let store = try SQLiteQueueStore(path: file, durability: .full)
        let rows = try store.database.read { db in
            try Row.fetchAll(db, sql: "SELECT queue, url FROM item ORDER BY seq").map { [$0["queue"] as String, $0["url"] as String] }
        }
        #expect(rows == [["http://h/fhir", "Patient"], ["http://h/fhir", "Patient"], ["http://h/fhir", "http://evil/Patient/x"]])
    }

    @Test("Migration v4 keeps every item and column, drops AUTOINCREMENT, and numbers on after the highest number ever used")
    func migrationV4() async throws {
        let file = path("v3.sqlite")
        let old = try DatabaseQueue(path: file)
        try SQLiteQueueStore.migrator.migrate(old, upTo: "v3")
        let columns = """
            (uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, if_none_exist, body, state, \
            attempts, enqueued_at, last_attempt_at, last_status, last_error, outcome, conditional_create, full_url)
            """
        try await old.write { db in
            for index in 1...4 {
                try db.execute(
                    sql:
                        "INSERT INTO item \(columns) VALUES (?, 'http://h/fhir', 'PUT', ?, 'Patient', ?, ?, 'application/fhir+json', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    arguments: [
                        UUID().uuidString.lowercased(), "Patient/p\(index)", "p\(index)", index % 2, index == 2 ? "identifier=x" : nil,
                        Data("{\"n\":\(index)}".utf8), index == 3 ? "parked" : "pending", index, Double(index), Double(index) + 0.5,
                        index == 3 ? 422 : nil, index == 3 ? "the server rejected it" : nil, nil, index == 1 ? 0 : nil,
                        index == 4 ? "urn:uuid:\(UUID().uuidString.lowercased())" : nil,
                    ])
            }
            // The newest number (4) was used and its item is gone: it must not be handed out again.
            try db.execute(sql: "DELETE FROM item WHERE seq = 4")
        }
        let before = try old.read { db in try Row.fetchAll(db, sql: "SELECT * FROM item ORDER BY seq") }
        try old.close()

        let store = try SQLiteQueueStore(path: file, durability: .full)
        // The columns the items had (later migrations add their own, e.g. v8-receipts' client_id).
        let columnsBefore = before.first.map { Array($0.columnNames).joined(separator: ", ") } ?? "*"
        let (after, schema, indexes, floor) = try store.database.read { db in
            (
                try Row.fetchAll(db, sql: "SELECT \(columnsBefore) FROM item ORDER BY seq"),
                try String.fetchOne(db, sql: "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'item'") ?? "",
                try String.fetchAll(
                    db, sql: "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'item' AND sql IS NOT NULL ORDER BY name"),
                try Int64.fetchOne(db, sql: "SELECT floor FROM item_sequence_floor")
            )
        }
        #expect(before.count == 3)
        #expect(after == before, "every column of every item, in order")
        #expect(!schema.uppercased().contains("AUTOINCREMENT"), "\(schema)")
        // v4's own two, and the receiver's index by client (v9-claims) after it.
        #expect(indexes == ["item_by_client", "item_by_full_url", "item_by_queue"])
        #expect(floor == 4)
        let next = NewItem(
            id: UUID(), queue: "http://h/fhir", method: .post, url: "Patient", resourceType: "Patient", resourceID: nil,
            encrypted: false, contentType: "application/fhir+json", body: Data("{}".utf8))
        #expect(try await store.insert([next]) == [5], "4 was used before the migration")
        // The uuid stays unique.
        let uuid: String = try #require(before.first?["uuid"])
        await #expect(throws: (any Error).self) {
            try await store.database.write { db in
                try db.execute(
                    sql:
                        "INSERT INTO item (uuid, queue, method, url, resource_type, content_type, body, enqueued_at) VALUES (?, 'q', 'POST', '', 'Patient', 'x', x'00', 0)",
                    arguments: [uuid])
            }
        }
    }

    @Test("A queue database upgraded by a newer dq is refused, for writing and for reading, and left as it was")
    func newerSchemaRefused() throws {
        let file = path("newer.sqlite")
        _ = try SQLiteQueueStore(path: file, durability: .full)
        let newer = try DatabaseQueue(path: file)
        try newer.write { db in try db.execute(sql: "INSERT INTO grdb_migrations (identifier) VALUES ('v99')") }
        try newer.close()
        for readOnly in [false, true] {
            let error = try #require(throws: DataQueueError.self) {
                try SQLiteQueueStore(path: file, durability: .full, readOnly: readOnly)
            }
            #expect(error.code == .storage)
            #expect(error.message.contains("newer dq"), "\(error.message)")
        }
        let identifiers = try DatabaseQueue(path: file).read { db in
            try String.fetchAll(db, sql: "SELECT identifier FROM grdb_migrations ORDER BY identifier")
        }
        #expect(identifiers == SQLiteQueueStore.migrator.migrations + ["v99"])
    }
}
