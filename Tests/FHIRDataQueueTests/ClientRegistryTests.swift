import Crypto
import Foundation
import GRDB
import Logging
import Testing

@testable import FHIRDataQueue

/// A receiver's clients and tokens in the queue's own database (``ClientRegistry``), on SQLite and PostgreSQL.
/// One test at a time, as the storage conformance suite: each PostgreSQL case makes a database of its own (PostgreSQL
/// copies template1 into its WAL, ~8 MB with fsync, and dq makes its schema), and the suite's thirty-odd cases started
/// at once beside the rest of the test run on two cores held one case's token INSERT past dq's 15 s deadline ("cannot
/// store a token: PostgreSQL did not answer within 15 s", a fresh-clone make test).
@Suite("Client registry", .serialized, .hostClientsShutDown)
struct ClientRegistryTests {
    let scratch: Scratch

    init() throws {
        scratch = try Scratch("dq-clients")
    }

    /// SQLite, PostgreSQL by URL, and (with PostgreSQL) a host's client, whose queue's store is wrapped lazily.
    static let kinds = StoreKind.withHostClient.filter { $0 != .postgresUnprepared }
    /// The stores one database can be opened on again: a host's client is the host's, not the queue's.
    static let reopenable = StoreKind.available.filter { $0 != .postgresUnprepared }

    static let server = URL(string: "http://127.0.0.1:9/fhir")!
    static let start = Date(timeIntervalSince1970: 1_750_000_000)

    /// A new database for `kind`: a file in the test's directory, or a fresh PostgreSQL database (its URL with the
    /// password, so that every queue opened on it can log in).
    func database(_ kind: StoreKind) async throws -> String {
        switch kind {
        case .sqlite:
            return scratch.url.appendingPathComponent("q.sqlite").path
        case .postgres, .postgresUnprepared, .postgresHostClient:
            var components = try #require(URLComponents(string: try await StoreKind.freshDatabase()))
            components.password = StoreKind.environment["DQ_TEST_POSTGRES_PASSWORD"]
            return components.string!
        }
    }

    func queue(at database: String, atRest: AtRestKeys? = nil) async throws -> DataQueue {
        var configuration = DataQueue.Configuration(durability: .normal)
        configuration.databasePath = database
        configuration.atRest = atRest
        return try await DataQueue(baseURL: Self.server, configuration: configuration)
    }

    func queue(_ kind: StoreKind) async throws -> DataQueue {
        if kind == .postgresHostClient {
            let client = try await StoreKind.hostClient(database: try await StoreKind.freshDatabase())
            return try await DataQueue(baseURL: Self.server, storage: .postgres(client: client))
        }
        return try await queue(at: try await database(kind))
    }

    // MARK: - Clients

    @Test("A registered client's hash reads back; an unknown client is nil", arguments: kinds)
    func registerThenRead(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        try await registry.register(clientID: "c1", secretHash: "scrypt$h1", at: Self.start)
        try await registry.register(clientID: "c2", secretHash: "scrypt$h2", at: Self.start)
        #expect(try await registry.secretHash(clientID: "c1") == "scrypt$h1")
        #expect(try await registry.secretHash(clientID: "c2") == "scrypt$h2")
        #expect(try await registry.secretHash(clientID: "c3") == nil)
        try await queue.shutdown()
    }

    @Test(
        "An import stores the clients that are not there in one call and leaves those that are, and a second import stores none",
        arguments: kinds)
    func registerAbsent(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        try await registry.register(clientID: "c1", secretHash: "scrypt$upgraded", at: Self.start)
        let clients = Dictionary(uniqueKeysWithValues: (1...1200).map { ("c\($0)", "sha1b64$h\($0)") })
        #expect(try await registry.registerAbsent(clients, at: Self.start) == Set(clients.keys).subtracting(["c1"]))
        #expect(try await registry.secretHash(clientID: "c1") == "scrypt$upgraded", "never overwritten")
        #expect(try await registry.secretHash(clientID: "c1200") == "sha1b64$h1200")
        #expect(try await registry.registerAbsent(clients, at: Self.start).isEmpty)
        try await queue.shutdown()
    }

    @Test("A client id registered already is refused, and the first client's hash stays", arguments: kinds)
    func duplicateRefused(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        try await registry.register(clientID: "c1", secretHash: "first", at: Self.start)
        let error = await #expect(throws: DataQueueError.self) {
            try await registry.register(clientID: "c1", secretHash: "second", at: Self.start)
        }
        #expect(error?.code == .storage)
        #expect(error?.message.contains("registered already") == true, "\(String(describing: error))")
        #expect(try await registry.secretHash(clientID: "c1") == "first")
        try await queue.shutdown()
    }

    @Test("Replacing a hash is a compare-and-swap: only while it is still the old one", arguments: kinds)
    func replaceSecretHash(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        try await registry.register(clientID: "c1", secretHash: "sha1b64$old", at: Self.start)
        #expect(try await !registry.replaceSecretHash(clientID: "c1", old: "sha1b64$other", new: "scrypt$new"))
        #expect(try await registry.secretHash(clientID: "c1") == "sha1b64$old")
        #expect(try await registry.replaceSecretHash(clientID: "c1", old: "sha1b64$old", new: "scrypt$new"))
        #expect(try await registry.secretHash(clientID: "c1") == "scrypt$new")
        #expect(
            try await !registry.replaceSecretHash(clientID: "c1", old: "sha1b64$old", new: "scrypt$newer"), "a second swap finds it changed"
        )
        #expect(try await registry.secretHash(clientID: "c1") == "scrypt$new")
        #expect(try await !registry.replaceSecretHash(clientID: "nobody", old: "sha1b64$old", new: "scrypt$new"))
        try await queue.shutdown()
    }

    // MARK: - Tokens

    @Test("A token names its client until it expires, and nil from then on; an unknown token is nil", arguments: kinds)
    func tokenLifetime(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        try await registry.register(clientID: "c1", secretHash: "h", at: Self.start)
        let token = ClientSecrets.tokenHash(ClientSecrets.newToken())
        let expiry = Self.start + 1800
        try await registry.issueToken(tokenHash: token, clientID: "c1", expiresAt: expiry)
        #expect(try await registry.client(tokenHash: token, now: Self.start) == "c1")
        // Its expiry comes with it: a receiver remembers the token until then (TokenCache).
        #expect(try await registry.token(hash: token, now: Self.start)?.expiresAt == expiry)
        #expect(try await registry.client(tokenHash: token, now: expiry - 0.5) == "c1")
        #expect(try await registry.client(tokenHash: token, now: expiry) == nil, "expired at its expiry")
        #expect(try await registry.client(tokenHash: token, now: expiry + 1) == nil)
        #expect(try await registry.client(tokenHash: ClientSecrets.tokenHash("unknown"), now: Self.start) == nil)
        try await queue.shutdown()
    }

    @Test("A token for a client that is not registered is refused", arguments: kinds)
    func tokenForUnknownClient(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        let token = ClientSecrets.tokenHash(ClientSecrets.newToken())
        let error = await #expect(throws: DataQueueError.self) {
            try await registry.issueToken(tokenHash: token, clientID: "nobody", expiresAt: Self.start + 1800)
        }
        #expect(error?.message.contains("no such client") == true, "\(String(describing: error))")
        #expect(try await registry.client(tokenHash: token, now: Self.start) == nil)
        try await queue.shutdown()
    }

    @Test("Pruning removes the tokens that expired before the cutoff, counts them, and keeps the rest", arguments: kinds)
    func pruneTokens(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        try await registry.register(clientID: "c1", secretHash: "h", at: Self.start)
        for minutes in [10, 20, 30, 40] {
            try await registry.issueToken(tokenHash: "t\(minutes)", clientID: "c1", expiresAt: Self.start + Double(minutes * 60))
        }
        #expect(try await registry.pruneTokens(before: Self.start) == 0)
        #expect(try await registry.pruneTokens(before: Self.start + 25 * 60) == 2)
        #expect(try await registry.pruneTokens(before: Self.start + 25 * 60) == 0, "nothing left to prune")
        #expect(try await registry.client(tokenHash: "t10", now: Self.start) == nil, "pruned")
        #expect(try await registry.client(tokenHash: "t30", now: Self.start) == "c1")
        #expect(try await registry.pruneTokens(before: Self.start + 40 * 60) == 1, "t40 expires at the cutoff, not before it")
        #expect(try await registry.client(tokenHash: "t40", now: Self.start) == "c1")
        try await queue.shutdown()
    }

    @Test("Pruning in batches removes at most the limit in each, the expired only, until none is left", arguments: kinds)
    func pruneTokensInBatches(kind: StoreKind) async throws {
        let queue = try await queue(kind)
        let registry = queue.clientRegistry
        try await registry.register(clientID: "c1", secretHash: "h", at: Self.start)
        for index in 0..<5 {
            try await registry.issueToken(tokenHash: "old\(index)", clientID: "c1", expiresAt: Self.start + Double(index))
        }
        try await registry.issueToken(tokenHash: "valid", clientID: "c1", expiresAt: Self.start + 3600)
        let cutoff = Self.start + 60
        #expect(try await registry.pruneTokens(before: cutoff, limit: 2) == 2)
        #expect(try await registry.pruneTokens(before: cutoff, limit: 2) == 2)
        #expect(try await registry.pruneTokens(before: cutoff, limit: 2) == 1)
        #expect(try await registry.pruneTokens(before: cutoff, limit: 2) == 0)
        #expect(try await registry.client(tokenHash: "valid", now: Self.start) == "c1", "the valid token stays")
        try await queue.shutdown()
    }

    // MARK: - Durability and sharing

    @Test("Clients and tokens survive closing the queue: a new queue on the same database sees them", arguments: reopenable)
    func survivesReopening(kind: StoreKind) async throws {
        let database = try await database(kind)
        let token = ClientSecrets.tokenHash(ClientSecrets.newToken())
        do {
            let queue = try await queue(at: database)
            try await queue.clientRegistry.register(clientID: "c1", secretHash: "h1", at: Self.start)
            try await queue.clientRegistry.issueToken(tokenHash: token, clientID: "c1", expiresAt: Self.start + 1800)
            try await queue.shutdown()
        }
        let reopened = try await queue(at: database)
        #expect(try await reopened.clientRegistry.secretHash(clientID: "c1") == "h1")
        #expect(try await reopened.clientRegistry.client(tokenHash: token, now: Self.start + 60) == "c1")
        try await reopened.shutdown()
    }

    @Test(
        "Two queues on one PostgreSQL database see each other's clients and tokens",
        .enabled(if: StoreKind.available.contains(.postgres)))
    func sharedPostgres() async throws {
        let database = try await database(.postgres)
        let first = try await queue(at: database)
        let second = try await queue(at: database)
        try await first.clientRegistry.register(clientID: "c1", secretHash: "h1", at: Self.start)
        #expect(try await second.clientRegistry.secretHash(clientID: "c1") == "h1")
        try await second.clientRegistry.issueToken(tokenHash: "issued-by-second", clientID: "c1", expiresAt: Self.start + 1800)
        #expect(try await first.clientRegistry.client(tokenHash: "issued-by-second", now: Self.start) == "c1")
        try await first.clientRegistry.issueToken(tokenHash: "issued-by-first", clientID: "c1", expiresAt: Self.start + 60)
        #expect(try await second.clientRegistry.client(tokenHash: "issued-by-first", now: Self.start) == "c1")
        #expect(try await second.clientRegistry.pruneTokens(before: Self.start + 120) == 1)
        #expect(try await first.clientRegistry.client(tokenHash: "issued-by-first", now: Self.start) == nil)
        try await first.shutdown()
        try await second.shutdown()
    }

    @Test("A queue sealed at rest keeps its clients as plain hashes", arguments: reopenable)
    func sealedQueue(kind: StoreKind) async throws {
        let queue = try await queue(at: try await database(kind), atRest: AtRestKeys(current: AtRestKey.generate().key))
        #expect(queue.store is SealedStorage)
        try await queue.clientRegistry.register(clientID: "c1", secretHash: "scrypt$h1", at: Self.start)
        #expect(try await queue.clientRegistry.secretHash(clientID: "c1") == "scrypt$h1")
        try await queue.shutdown()
    }

    @Test("A SQLite queue made by an older dq (schema v6) gets the tables when it is opened, and keeps its items")
    func sqliteUpgrade() async throws {
        let file = scratch.url.appendingPathComponent("v6.sqlite").path
        let old = try DatabaseQueue(path: file)
        try SQLiteQueueStore.migrator.migrate(old, upTo: "v6")
        try old.close()
        let store = try SQLiteQueueStore(path: file, durability: .normal)
        let item = NewItem(
            id: UUID(), queue: "http://h/fhir", method: .post, url: "Patient", resourceType: "Patient", resourceID: nil,
            encrypted: false, contentType: "application/fhir+json", body: Data("{}".utf8))
        #expect(try await store.insert([item]) == [1])
        try await store.register(clientID: "c1", secretHash: "h1", at: Self.start)
        #expect(try await store.secretHash(clientID: "c1") == "h1")
        let migrations = try await store.database.read { db in
            try String.fetchAll(db, sql: "SELECT identifier FROM grdb_migrations ORDER BY identifier")
        }
        #expect(migrations.contains("v7") && Set(migrations) == Set(SQLiteQueueStore.migrator.migrations), "\(migrations)")
    }

    @Test(
        "A PostgreSQL queue made before the registry gets its tables at the next start",
        .enabled(if: StoreKind.available.contains(.postgres)))
    func postgresUpgrade() async throws {
        let database = try await database(.postgres)
        let first = try await queue(at: database)
        _ = try await first.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        // As an older dq left it: the schema complete but for the registry's tables.
        let store = try #require(first.store as? PostgresQueueStore)
        _ = try await store.client.query(
            "DROP TABLE dq_tokens, dq_clients", logger: Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })
        ).collect()
        try await first.shutdown()

        let upgraded = try await queue(at: database)
        #expect(try await upgraded.status().pending == 1)
        try await upgraded.clientRegistry.register(clientID: "c1", secretHash: "h1", at: Self.start)
        try await upgraded.clientRegistry.issueToken(tokenHash: "t", clientID: "c1", expiresAt: Self.start + 60)
        #expect(try await upgraded.clientRegistry.client(tokenHash: "t", now: Self.start) == "c1")
        try await upgraded.shutdown()
    }
}

/// New credentials and the hashes kept of them (``ClientSecrets``).
@Suite("Client secrets")
struct ClientSecretsTests {
    static let urlSafe = Set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

    // The slow hash runs on NIO's thread pool, as the receiver runs it: on the cooperative pool (two threads here)
    // each scrypt held a thread for seconds under ThreadSanitizer, and a test of another suite that waits for a
    // 0.3 s deadline waited 35 s for a thread.
    @Test("A secret verifies against its hash; another secret does not")
    func verifyRightAndWrong() async throws {
        let secret = ClientSecrets.newSecret()
        let hash = try await ClientSecrets.hashOffPool(secret: secret)
        #expect(hash.hasPrefix("scrypt$32768$8$3$"), "\(hash)")
        #expect(try await ClientSecrets.verifyOffPool(secret: secret, against: hash))
        #expect(try await !ClientSecrets.verifyOffPool(secret: ClientSecrets.newSecret(), against: hash))
        #expect(try await !ClientSecrets.verifyOffPool(secret: secret + "x", against: hash))
        #expect(try await !ClientSecrets.verifyOffPool(secret: "", against: hash))
        #expect(try await !ClientSecrets.verifyOffPool(secret: secret, against: nil), "an unknown client verifies nothing")
        #expect(!ClientSecrets.isLegacy(hash))
    }

    @Test("Two hashes of one secret differ (a salt each), and neither contains the secret")
    func salted() async throws {
        let secret = ClientSecrets.newSecret()
        let first = try await ClientSecrets.hashOffPool(secret: secret)
        let second = try await ClientSecrets.hashOffPool(secret: secret)
        #expect(first != second)
        #expect(first != secret && !first.contains(secret))
        #expect(!second.contains(secret))
        #expect(try await ClientSecrets.verifyOffPool(secret: secret, against: second))
    }

    @Test("An empty secret has no hash")
    func emptySecret() {
        #expect(throws: DataQueueError.self) { try ClientSecrets.hash(secret: "") }
    }

    @Test(
        "A damaged or unknown hash verifies nothing, and a hostile cost is not computed",
        arguments: [
            "", "secret", "scrypt$", "scrypt$32768$8$3$c2FsdA==", "scrypt$32768$8$3$!!$AAAAAAAAAAAAAAAAAAAAAA==",
            "scrypt$1073741824$8$1$c2FsdHNhbHRzYWx0c2FsdA==$AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            "scrypt$1000$8$1$c2FsdHNhbHRzYWx0c2FsdA==$AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "sha1b64$", "sha1b64$!!",
            "md5$xyz", "bcrypt$2a$10$abc",
        ])
    func damagedHash(hash: String) {
        #expect(!ClientSecrets.verify(secret: "secret", against: hash))
    }

    @Test("C3-PRO's unsalted SHA-1 in Base64 verifies as sha1b64$…, and is legacy")
    func legacyHash() {
        // `printf 'secret' | openssl sha1 -binary | base64`, computed independently of swift-crypto.
        let openssl = "5en6G6MezRroT3XKqkdPOmY/BfQ="
        #expect(Data(Insecure.SHA1.hash(data: Data("secret".utf8))).base64EncodedString() == openssl)
        let stored = ClientSecrets.legacyHash(sha1Base64: openssl)
        #expect(stored == "sha1b64$" + openssl)
        #expect(ClientSecrets.isLegacy(stored))
        #expect(ClientSecrets.verify(secret: "secret", against: stored))
        #expect(!ClientSecrets.verify(secret: "Secret", against: stored))
        #expect(!ClientSecrets.verify(secret: "secret", against: "sha1b64$" + String(openssl.dropLast(4)) + "AAA="))

        // A C3-PRO secret (Base64 of 64 random bytes, with `+`, `/` and `=`), hashed as the Java server did.
        var generator = SystemRandomNumberGenerator()
        let secret = Data((0..<64).map { _ in UInt8.random(in: .min ... .max, using: &generator) }).base64EncodedString()
        let legacy = "sha1b64$" + Data(Insecure.SHA1.hash(data: Data(secret.utf8))).base64EncodedString()
        #expect(ClientSecrets.verify(secret: secret, against: legacy))
        #expect(!ClientSecrets.verify(secret: ClientSecrets.newSecret(), against: legacy))
    }

    @Test("Client ids are lowercase UUIDs; secrets and tokens are URL-safe, unpadded and new each time")
    func alphabets() {
        let id = ClientSecrets.newClientID()
        #expect(UUID(uuidString: id) != nil && id == id.lowercased())
        var seen: Set<String> = []
        for _ in 0..<200 {
            let secret = ClientSecrets.newSecret()
            let token = ClientSecrets.newToken()
            #expect(secret.count == 43, "\(secret)")
            #expect(token.count == 64, "\(token)")
            #expect(Set(secret).isSubset(of: Self.urlSafe), "\(secret)")
            #expect(Set(token).isSubset(of: Self.urlSafe), "\(token)")
            seen.insert(secret)
            seen.insert(token)
        }
        #expect(seen.count == 400)
    }

    @Test("A token's hash is its SHA-256 in lowercase hexadecimal")
    func tokenHash() {
        // `printf 'abc' | openssl sha256`: the FIPS 180-2 test vector.
        #expect(ClientSecrets.tokenHash("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        let token = ClientSecrets.newToken()
        #expect(ClientSecrets.tokenHash(token) == ClientSecrets.tokenHash(token))
        #expect(ClientSecrets.tokenHash(token) != ClientSecrets.tokenHash(ClientSecrets.newToken()))
    }
}

extension ClientRegistry {
    /// The client of a token that has not expired at `now`, or nil (what these tests ask of a token).
    func client(tokenHash: String, now: Date) async throws -> String? {
        try await token(hash: tokenHash, now: now)?.clientID
    }
}
