import Foundation
import GRDB

// A receiver's clients and tokens (``ClientRegistry``), in the queue's file: tables `dq_clients` and `dq_tokens`
// (migration v7). Times are seconds since 1970, as the queue's other times.
extension SQLiteQueueStore: ClientRegistry {
    func register(clientID: String, secretHash: String, at: Date) async throws {
        let added = try await immediate("register a client") { db in
            try db.execute(
                sql: "INSERT INTO dq_clients (client_id, secret_hash, created_at) VALUES (?, ?, ?) ON CONFLICT (client_id) DO NOTHING",
                arguments: [clientID, secretHash, at.timeIntervalSince1970])
            return db.changesCount == 1
        }
        guard added else { throw DataQueueError.clientAlreadyRegistered(clientID) }
    }

    func registerAbsent(_ clients: [String: String], at: Date) async throws -> Set<String> {
        try await immediate("import clients") { db in
            var added: Set<String> = []
            let statement = try db.makeStatement(
                sql: "INSERT INTO dq_clients (client_id, secret_hash, created_at) VALUES (?, ?, ?) ON CONFLICT (client_id) DO NOTHING")
            for (clientID, secretHash) in clients {
                try statement.execute(arguments: [clientID, secretHash, at.timeIntervalSince1970])
                if db.changesCount == 1 { added.insert(clientID) }
            }
            return added
        }
    }

    func secretHash(clientID: String) async throws -> String? {
        try await read("read a client") { db in
            try String.fetchOne(db, sql: "SELECT secret_hash FROM dq_clients WHERE client_id = ?", arguments: [clientID])
        }
    }

    func replaceSecretHash(clientID: String, old: String, new: String) async throws -> Bool {
        try await immediate("replace a client's secret hash") { db in
            try db.execute(
                sql: "UPDATE dq_clients SET secret_hash = ? WHERE client_id = ? AND secret_hash = ?", arguments: [new, clientID, old])
            return db.changesCount == 1
        }
    }

    func issueToken(tokenHash: String, clientID: String, expiresAt: Date) async throws {
        // Inserted only for a registered client: a missing one is named, not a foreign-key violation.
        let stored = try await immediate("store a token") { db in
            try db.execute(
                sql: """
                    INSERT INTO dq_tokens (token_hash, client_id, expires_at)
                    SELECT ?, client_id, ? FROM dq_clients WHERE client_id = ?
                    """,
                arguments: [tokenHash, expiresAt.timeIntervalSince1970, clientID])
            return db.changesCount == 1
        }
        guard stored else { throw DataQueueError.clientNotRegistered(clientID) }
    }

    func token(hash tokenHash: String, now: Date) async throws -> (clientID: String, expiresAt: Date)? {
        try await read("read a token") { db in
            let row = try Row.fetchOne(
                db.cachedStatement(sql: "SELECT client_id, expires_at FROM dq_tokens WHERE token_hash = ? AND expires_at > ?"),
                arguments: [tokenHash, now.timeIntervalSince1970])
            return row.map { (clientID: $0[0], expiresAt: Date(timeIntervalSince1970: $0[1])) }
        }
    }

    func pruneTokens(before cutoff: Date, limit: Int) async throws -> Int {
        try await immediate("remove expired tokens") { db in
            try db.execute(
                sql: "DELETE FROM dq_tokens WHERE rowid IN (SELECT rowid FROM dq_tokens WHERE expires_at < ? LIMIT ?)",
                arguments: [cutoff.timeIntervalSince1970, Int64(clamping: limit)])
            return db.changesCount
        }
    }
}

// The resources a receiver's clients wrote (``WritePolicy``): table `dq_resource_claims` (migration v9-claims).
extension SQLiteQueueStore {
    func claimResource(queue: String, target: String, clientID: String, at: Date) async throws -> String {
        let key = resourceClaimKey(queue: queue, target: target)
        return try await immediate("record a resource's writer") { db in
            try db.execute(
                sql: "INSERT INTO dq_resource_claims (claim, client_id, claimed_at) VALUES (?, ?, ?) ON CONFLICT (claim) DO NOTHING",
                arguments: [key, clientID, at.timeIntervalSince1970])
            return try String.fetchOne(db, sql: "SELECT client_id FROM dq_resource_claims WHERE claim = ?", arguments: [key])
                ?? clientID
        }
    }

    func resourceOwner(queue: String, target: String) async throws -> String? {
        let key = resourceClaimKey(queue: queue, target: target)
        return try await read("read a resource's writer") { db in
            try String.fetchOne(db, sql: "SELECT client_id FROM dq_resource_claims WHERE claim = ?", arguments: [key])
        }
    }
}

// What a receiver's client has waiting (index item_by_client, migration v9-claims).
extension SQLiteQueueStore {
    func waiting(clientID: String) async throws -> (count: Int, bytes: Int) {
        try await read("count a client's items") { db in
            let row = try Row.fetchOne(
                db.cachedStatement(sql: "SELECT count(*), coalesce(sum(length(body)), 0) FROM item WHERE client_id = ?"),
                arguments: [clientID])
            return (row?[0] ?? 0, row?[1] ?? 0)
        }
    }
}
