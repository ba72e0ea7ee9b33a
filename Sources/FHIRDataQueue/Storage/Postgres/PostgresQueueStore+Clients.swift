import Foundation
import PostgresNIO

// A receiver's clients and tokens (``ClientRegistry``), shared by every receiver on the database: tables
// `dq_clients` and `dq_tokens` (see ``schema``). Times are seconds since 1970, as the queue's other times; a
// token's expiry is compared with the caller's `now`, not the database's clock.
extension PostgresQueueStore: ClientRegistry {
    func register(clientID: String, secretHash: String, at: Date) async throws {
        let added = try await run("register a client") { [self] in
            try await !client.query(
                """
                INSERT INTO dq_clients (client_id, secret_hash, created_at) VALUES (\(clientID), \(secretHash), \(at.timeIntervalSince1970))
                ON CONFLICT (client_id) DO NOTHING RETURNING client_id
                """, logger: logger
            ).collect().isEmpty
        }
        guard added else { throw DataQueueError.clientAlreadyRegistered(clientID) }
    }

    func registerAbsent(_ clients: [String: String], at: Date) async throws -> Set<String> {
        let ids = Array(clients.keys)
        let hashes = ids.map { clients[$0] ?? "" }
        return try await run("import clients") { [self] in
            var added: Set<String> = []
            for try await id in try await client.query(
                """
                INSERT INTO dq_clients (client_id, secret_hash, created_at)
                SELECT id, hash, \(at.timeIntervalSince1970) FROM unnest(\(ids)::text[], \(hashes)::text[]) AS imported (id, hash)
                ON CONFLICT (client_id) DO NOTHING RETURNING client_id
                """, logger: logger
            ).decode(String.self) {
                added.insert(id)
            }
            return added
        }
    }

    func secretHash(clientID: String) async throws -> String? {
        try await run("read a client") { [self] in
            for try await hash in try await client.query(
                "SELECT secret_hash FROM dq_clients WHERE client_id = \(clientID)", logger: logger
            ).decode(String.self) {
                return hash
            }
            return nil
        }
    }

    func replaceSecretHash(clientID: String, old: String, new: String) async throws -> Bool {
        try await run("replace a client's secret hash") { [self] in
            try await !client.query(
                """
                UPDATE dq_clients SET secret_hash = \(new) WHERE client_id = \(clientID) AND secret_hash = \(old) RETURNING client_id
                """, logger: logger
            ).collect().isEmpty
        }
    }

    func issueToken(tokenHash: String, clientID: String, expiresAt: Date) async throws {
        // Inserted only for a registered client: a missing one is named, not a foreign-key violation.
        let stored = try await run("store a token") { [self] in
            try await !client.query(
                """
                INSERT INTO dq_tokens (token_hash, client_id, expires_at)
                SELECT \(tokenHash), client_id, \(expiresAt.timeIntervalSince1970) FROM dq_clients WHERE client_id = \(clientID)
                RETURNING token_hash
                """, logger: logger
            ).collect().isEmpty
        }
        guard stored else { throw DataQueueError.clientNotRegistered(clientID) }
    }

    func token(hash tokenHash: String, now: Date) async throws -> (clientID: String, expiresAt: Date)? {
        try await run("read a token") { [self] in
            for try await (id, expiry) in try await client.query(
                "SELECT client_id, expires_at FROM dq_tokens WHERE token_hash = \(tokenHash) AND expires_at > \(now.timeIntervalSince1970)",
                logger: logger
            ).decode((String, Double).self) {
                return (clientID: id, expiresAt: Date(timeIntervalSince1970: expiry))
            }
            return nil
        }
    }

    func pruneTokens(before cutoff: Date, limit: Int) async throws -> Int {
        try await run("remove expired tokens") { [self] in
            var removed = 0
            let most = Int64(clamping: limit)
            for try await count in try await client.query(
                """
                WITH gone AS (
                  DELETE FROM dq_tokens WHERE token_hash IN (
                    SELECT token_hash FROM dq_tokens WHERE expires_at < \(cutoff.timeIntervalSince1970) LIMIT \(most))
                  RETURNING 1)
                SELECT count(*) FROM gone
                """, logger: logger
            ).decode(Int64.self) {
                removed = Int(count)
            }
            return removed
        }
    }
}

// The resources a receiver's clients wrote (``WritePolicy``): table `dq_resource_claims` (see ``schema``).
extension PostgresQueueStore {
    func claimResource(queue: String, target: String, clientID: String, at: Date) async throws -> String {
        let key = resourceClaimKey(queue: queue, target: target)
        return try await run("record a resource's writer") { [self] in
            // The insert and the read in one statement: of two receivers claiming at once, both read the one that won.
            for try await owner in try await client.query(
                """
                WITH claimed AS (
                  INSERT INTO dq_resource_claims (claim, client_id, claimed_at) VALUES (\(key), \(clientID), \(at.timeIntervalSince1970))
                  ON CONFLICT (claim) DO NOTHING RETURNING client_id)
                SELECT client_id FROM claimed UNION ALL SELECT client_id FROM dq_resource_claims WHERE claim = \(key)
                """, logger: logger
            ).decode(String.self) {
                return owner
            }
            return clientID
        }
    }

    func resourceOwner(queue: String, target: String) async throws -> String? {
        let key = resourceClaimKey(queue: queue, target: target)
        return try await run("read a resource's writer") { [self] in
            for try await owner in try await client.query(
                "SELECT client_id FROM dq_resource_claims WHERE claim = \(key)", logger: logger
            ).decode(String.self) {
                return owner
            }
            return nil
        }
    }
}

// What a receiver's client has waiting (index dq_item_by_client).
extension PostgresQueueStore {
    func waiting(clientID: String) async throws -> (count: Int, bytes: Int) {
        try await run("count a client's items") { [self] in
            for try await (count, bytes) in try await client.query(
                "SELECT count(*)::bigint, coalesce(sum(length(body)), 0)::bigint FROM dq_item WHERE client_id = \(clientID)",
                logger: logger
            ).decode((Int64, Int64).self) {
                return (Int(count), Int(bytes))
            }
            return (0, 0)
        }
    }
}
