import Foundation
import Logging
import NIOSSL
import PostgresNIO

// What a flush reads and records, each write fenced by the lease's token.
extension PostgresQueueStore {
    func acquireFlush(queue: String, until deadline: ContinuousClock.Instant) async throws -> (any FlushOwnership)? {
        try await run("take the flush lease") { [self] in
            var delay = Duration.milliseconds(20)
            while true {
                if let lease = try await PostgresLease.take(store: self, queue: queue) { return lease }
                Self.answered()  // the lease is held elsewhere: waiting for it (up to lock_wait) is no silence
                if ContinuousClock.now >= deadline { return nil }
                try await Task.sleep(for: min(delay, deadline - ContinuousClock.now))
                delay = min(delay * 2, .milliseconds(250))
            }
        }
    }

    func checkStates(queue: String) async throws {
        try await run("read the queue") { [self] in
            for try await (seq, state) in try await client.query(
                "SELECT seq, state FROM dq_item WHERE queue = \(queue) AND state NOT IN ('pending', 'parked') LIMIT 1",
                logger: logger
            ).decode((Int64, String).self) {
                throw Self.damaged(seq, "unknown state \(state.prefix(32))")
            }
        }
    }

    func serverState(queue: String) async throws -> (failures: Int, nextAttemptAt: Date?, lastError: String?) {
        try await run("read the server state") { [self] in
            for try await (failures, next, error) in try await client.query(
                "SELECT failures, next_attempt_at, last_error FROM dq_server_state WHERE queue = \(queue)", logger: logger
            ).decode((Int, Double?, String?).self) {
                return (failures, next.map(Date.init(timeIntervalSince1970:)), error)
            }
            return (0, nil, nil)
        }
    }

    static let itemColumns =
        "seq, uuid, queue, method, url, resource_type, resource_id, encrypted, state, attempts, enqueued_at, last_attempt_at, last_status, last_error, outcome, length(body) AS size, client_id"
    static let storedColumns = itemColumns + ", content_type, conditional_create, body, full_url"

    func pendingBatch(queue: String, after: Int64, maxCount: Int, maxBytes: Int) async throws -> [StoredItem] {
        try await run("read the queue") { [self] in
            let rows = try await client.query(
                PostgresQuery(
                    unsafeSQL:
                        "SELECT \(Self.storedColumns) FROM dq_item WHERE queue = $1 AND state = 'pending' AND seq > $2 ORDER BY seq LIMIT $3",
                    binds: Self.binds(queue, after, Int64(maxCount))),
                logger: logger)
            var items: [StoredItem] = []
            var bytes = 0
            for try await row in rows {
                Self.answered()  // each row is an answer (see rows(_:_:))
                let item = try Self.storedItem(row)
                items.append(item)
                bytes += item.body.count
                if bytes >= maxBytes { break }
            }
            return items
        }
    }

    func markDelivered(_ deliveries: [CompletedDelivery], owner: any FlushOwnership) async -> Result<Void, DataQueueError> {
        guard let queue = deliveries.first?.item.queue else { return .success(()) }
        do {
            try await fenced(owner, queue: queue, "record a delivery") { [self] connection in
                try await self.journal(deliveries, queue: queue, connection: connection)
            }
            return .success(())
        } catch {
            return .failure(Self.map(error, doing: "record a delivery"))
        }
    }

    /// Moves `deliveries` to the journal in three statements whatever their number: one delete, one insert
    /// of the lines (in delivery order, for the items the delete found), and the backoff's reset.
    func journal(_ deliveries: [CompletedDelivery], queue: String, connection: PostgresConnection) async throws {
        var deleted = Set<Int64>()
        for try await seq in try await connection.query(
            "DELETE FROM dq_item WHERE seq = ANY(\(deliveries.map(\.item.sequence))) RETURNING seq", logger: logger
        ).decode(Int64.self) {
            deleted.insert(seq)
        }
        let lines = deliveries.filter { deleted.remove($0.item.sequence) != nil }  // once each, in delivery order
        for start in stride(from: 0, to: lines.count, by: 1000) {
            var bindings = PostgresBindings(capacity: 18 * min(1000, lines.count - start))
            var rows: [String] = []
            for delivery in lines[start..<min(start + 1000, lines.count)] {
                let item = delivery.item
                let base = bindings.count
                rows.append("(" + (1...18).map { "$\(base + $0)" }.joined(separator: ", ") + ")")
                bindings.append(item.sequence)
                bindings.append(item.id)
                bindings.append(delivery.event.rawValue)
                bindings.append(item.queue)
                bindings.append(item.method.rawValue)
                bindings.append(delivery.url)
                bindings.append(item.resourceType)
                bindings.append(delivery.status)
                bindings.append(delivery.location)
                bindings.append(delivery.serverID)
                bindings.append(delivery.versionID)
                bindings.append(item.attempts + 1)
                bindings.append(item.enqueuedAt.timeIntervalSince1970)
                bindings.append(delivery.answeredAt.timeIntervalSince1970)
                bindings.append(delivery.fullURL)
                bindings.append(delivery.bundle)
                bindings.append(delivery.entries)
                bindings.append(delivery.note)
            }
            try await connection.query(
                PostgresQuery(
                    unsafeSQL: """
                        INSERT INTO dq_delivery (item_seq, uuid, event, queue, method, url, resource_type, status, location,
                                                 server_id, version_id, attempts, enqueued_at, at, full_url, bundle, entries, note)
                        VALUES \(rows.joined(separator: ", "))
                        """, binds: bindings),
                logger: logger)
            Self.answered()
        }
        try await recordDigests(deliveries, connection: connection)
        try await connection.query(
            "UPDATE dq_server_state SET failures = 0, next_attempt_at = NULL, last_error = NULL WHERE queue = \(queue) AND failures > 0",
            logger: logger)
    }

    /// Runs `body` in a transaction that first locks the lease row of `queue` and checks that `owner` still
    /// holds it (the fence): a flusher whose lease was taken over writes nothing.
    func fenced(
        _ owner: any FlushOwnership, queue: String, _ what: String,
        _ body: @escaping @Sendable (PostgresConnection) async throws -> Void
    ) async throws {
        guard let lease = owner as? PostgresLease, lease.queue == queue else {
            throw DataQueueError(.storage, "cannot \(what): the flush right does not belong to this queue")
        }
        try await run(what) { [self] in
            try await client.withTransaction(logger: logger) { connection in
                var token: Int64?
                for try await value in try await connection.query(
                    "SELECT token FROM dq_lease WHERE queue = \(queue) FOR UPDATE", logger: logger
                ).decode(Int64.self) {
                    token = value
                }
                guard token == lease.token else {
                    lease.lost()
                    throw DataQueueError(
                        .busy, "cannot \(what): another dq instance took over the flush of \(queue); this one stops")
                }
                try await body(connection)
            }
        }
    }

    func park(_ item: QueuedItem, url: String, status: Int?, error: String, outcome: String?, owner: any FlushOwnership)
        async throws
    {
        try await fenced(owner, queue: item.queue, "park an item") { [self] connection in
            let now = Date().timeIntervalSince1970
            var changed = false
            for try await _ in try await connection.query(
                """
                UPDATE dq_item SET state = 'parked', attempts = attempts + 1, last_attempt_at = \(now),
                                   last_status = \(status), last_error = \(error), outcome = \(outcome)
                WHERE seq = \(item.sequence) RETURNING seq
                """, logger: logger)
            {
                changed = true
            }
            guard changed else { return }
            try await self.journalEvent(
                .parked, item: item, url: url, status: status, note: error, attempts: item.attempts + 1, at: now,
                connection: connection)
        }
    }

    func journalEvent(
        _ event: DeliveryRecord.Event, item: QueuedItem, url: String, status: Int?, note: String?, attempts: Int, at: Double,
        connection: PostgresConnection
    ) async throws {
        try await connection.query(
            """
            INSERT INTO dq_delivery (item_seq, uuid, event, queue, method, url, resource_type, status, attempts,
                                     enqueued_at, at, note)
            VALUES (\(item.sequence), \(item.id), \(event.rawValue), \(item.queue), \(item.method.rawValue), \(url),
                    \(item.resourceType), \(status), \(attempts), \(item.enqueuedAt.timeIntervalSince1970), \(at), \(note))
            """, logger: logger)
    }

    func recordFailure(
        queue: String, item: QueuedItem?, status: Int?, error: String, nextAttemptAt: Date?, owner: any FlushOwnership
    ) async throws {
        try await fenced(owner, queue: queue, "record a failure") { [self] connection in
            let now = Date().timeIntervalSince1970
            if let item {
                try await connection.query(
                    """
                    UPDATE dq_item SET attempts = attempts + 1, last_attempt_at = \(now), last_status = \(status),
                                       last_error = \(error) WHERE seq = \(item.sequence)
                    """, logger: logger)
            }
            let next = nextAttemptAt?.timeIntervalSince1970
            try await connection.query(
                """
                INSERT INTO dq_server_state (queue, failures, next_attempt_at, last_error) VALUES (\(queue), 1, \(next), \(error))
                ON CONFLICT (queue) DO UPDATE SET failures = dq_server_state.failures + 1,
                  next_attempt_at = EXCLUDED.next_attempt_at, last_error = EXCLUDED.last_error
                """, logger: logger)
        }
    }

    func bundleSupport(queue: String) async throws -> BundleSupport {
        try await run("read the server state") { [self] in
            for try await (transactions, checked, limit, types) in try await client.query(
                "SELECT transactions, capability_at, batch_limit, conditional_create FROM dq_server_state WHERE queue = \(queue)",
                logger: logger
            ).decode((Bool?, Double?, Int?, String?).self) {
                return BundleSupport(
                    transactions: transactions, checkedAt: checked.map(Date.init(timeIntervalSince1970:)), batchLimit: limit,
                    conditionalCreate: BundleSupport.decodeTypes(types))
            }
            return BundleSupport()
        }
    }

    func recordBundleSupport(queue: String, transactions: Bool?, batchLimit: Int?, conditionalCreate: Set<String>?) async throws {
        try await run("record what the server supports") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                try await connection.query(
                    "INSERT INTO dq_server_state (queue, failures) VALUES (\(queue), 0) ON CONFLICT (queue) DO NOTHING",
                    logger: logger)
                if let conditionalCreate {
                    try await connection.query(
                        "UPDATE dq_server_state SET conditional_create = \(BundleSupport.encodeTypes(conditionalCreate)) WHERE queue = \(queue)",
                        logger: logger)
                }
                if let transactions {
                    try await connection.query(
                        "UPDATE dq_server_state SET transactions = \(transactions), capability_at = \(Date().timeIntervalSince1970) WHERE queue = \(queue)",
                        logger: logger)
                }
                if let batchLimit {
                    try await connection.query(
                        "UPDATE dq_server_state SET batch_limit = \(batchLimit) WHERE queue = \(queue)", logger: logger)
                }
            }
        }
    }

    func deliveredLocations(fullURLs: [String]) async throws -> [String: String] {
        guard !fullURLs.isEmpty else { return [:] }
        return try await run("read the delivery journal") { [self] in
            var found: [String: String] = [:]
            for try await (fullURL, type, id) in try await client.query(
                """
                SELECT DISTINCT ON (full_url) full_url, resource_type, server_id FROM dq_delivery
                WHERE full_url = ANY(\(fullURLs)) AND event IN ('delivered', 'already-present') AND server_id IS NOT NULL
                ORDER BY full_url, seq DESC
                """, logger: logger
            ).decode((String, String, String).self) {
                found[fullURL] = type + "/" + id
            }
            return found
        }
    }

    func unlocatedDeliveries(fullURLs: [String]) async throws -> [String: UUID] {
        guard !fullURLs.isEmpty else { return [:] }
        return try await run("read the delivery journal") { [self] in
            var found: [String: UUID] = [:]
            for try await (fullURL, id, serverID) in try await client.query(
                """
                SELECT DISTINCT ON (full_url) full_url, uuid, server_id FROM dq_delivery
                WHERE full_url = ANY(\(fullURLs)) AND event IN ('delivered', 'already-present')
                ORDER BY full_url, seq DESC
                """, logger: logger
            ).decode((String, UUID, String?).self) where serverID == nil {
                found[fullURL] = id
            }
            return found
        }
    }

    func resolveLocation(itemID: UUID, location: String, serverID: String, versionID: String?, note: String) async throws -> Bool {
        try await run("record a location") { [self] in
            var changed = false
            try await client.withConnection { connection in
                for try await _ in try await connection.query(
                    """
                    UPDATE dq_delivery SET location = \(location), server_id = \(serverID), version_id = \(versionID), note = \(note)
                    WHERE seq = (SELECT max(seq) FROM dq_delivery WHERE uuid = \(itemID) AND event IN ('delivered', 'already-present'))
                      AND server_id IS NULL
                    RETURNING seq
                    """, logger: logger)
                {
                    changed = true
                }
                try await connection.confirmCommit(logger: logger)
            }
            return changed
        }
    }
}
