import Foundation
import Logging
import PostgresNIO

// A receiver's repeats (``ReceiptStore``), shared by every receiver on the database: the client column of
// `dq_item`, tables `dq_receipts` and `dq_digests` (see ``schema``). Times are seconds since 1970, the caller's clock.
extension PostgresQueueStore: ReceiptStore {
    func insert(_ item: NewItem, receipt: Receipt?, expiredBefore: Date) async throws -> ReceiptInsert {
        try await run("enqueue") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                if let receipt {
                    try await connection.query(
                        """
                        DELETE FROM dq_receipts WHERE client_id = \(receipt.clientID) AND idempotency_key = \(receipt.key)
                          AND created_at < \(expiredBefore.timeIntervalSince1970)
                        """, logger: logger)
                    // The receipt first: of two requests with one key at once, the second waits here for the first's
                    // commit, then inserts nothing and reads the first's receipt (a new statement sees it), and stores
                    // no item.
                    let stored = try await connection.query(
                        """
                        INSERT INTO dq_receipts (client_id, idempotency_key, fingerprint, item_uuid, status, location,
                                                 content_type, body, created_at)
                        VALUES (\(receipt.clientID), \(receipt.key), \(receipt.fingerprint), \(receipt.itemID), \(receipt.status),
                                \(receipt.location), \(receipt.contentType), \(receipt.body.map { ByteBuffer(bytes: $0) }),
                                \(receipt.createdAt.timeIntervalSince1970))
                        ON CONFLICT (client_id, idempotency_key) DO NOTHING RETURNING 1
                        """, logger: logger
                    ).collect()
                    if stored.isEmpty {
                        guard
                            let taken = try await Self.receipt(
                                clientID: receipt.clientID, key: receipt.key, since: expiredBefore, connection: connection,
                                logger: logger)
                        else { throw DataQueueError(.storage, "cannot enqueue: an Idempotency-Key was taken and then not found") }
                        return .taken(taken)
                    }
                }
                let first = try await Self.reserveSequences(1, connection: connection, logger: logger)
                var bindings = PostgresBindings(capacity: 12)
                Self.appendItemColumns([item][...], to: &bindings)
                try await connection.query(
                    PostgresQuery(unsafeSQL: Self.itemInsertSQL(base: 0, first: String(first)), binds: bindings), logger: logger)
                _ = try await connection.query("SELECT pg_notify('dq_enqueue', \(item.queue))", logger: logger).collect()
                return .stored(first)
            }
        }
    }

    func receipt(clientID: String, key: String, since: Date) async throws -> Receipt? {
        try await run("read a receipt") { [self] in
            try await client.withConnection { connection in
                try await Self.receipt(clientID: clientID, key: key, since: since, connection: connection, logger: logger)
            }
        }
    }

    private static func receipt(
        clientID: String, key: String, since: Date, connection: PostgresConnection, logger: Logger
    ) async throws -> Receipt? {
        let rows = try await connection.query(
            """
            SELECT fingerprint, item_uuid, status, location, content_type, body, created_at FROM dq_receipts
            WHERE client_id = \(clientID) AND idempotency_key = \(key) AND created_at >= \(since.timeIntervalSince1970)
            """, logger: logger)
        for try await (fingerprint, itemID, status, location, contentType, body, createdAt) in rows.decode(
            (String, UUID, Int?, String?, String?, Data?, Double).self)
        {
            return Receipt(
                clientID: clientID, key: key, fingerprint: fingerprint, itemID: itemID, status: status, location: location,
                contentType: contentType, body: body, createdAt: Date(timeIntervalSince1970: createdAt))
        }
        return nil
    }

    func recordAnswer(_ receipt: Receipt) async throws {
        _ = try await run("record an answer") { [self] in
            try await client.query(
                """
                UPDATE dq_receipts SET status = \(receipt.status), location = \(receipt.location),
                                       content_type = \(receipt.contentType), body = \(receipt.body.map { ByteBuffer(bytes: $0) })
                WHERE client_id = \(receipt.clientID) AND idempotency_key = \(receipt.key) AND item_uuid = \(receipt.itemID)
                  AND status IS NULL
                """, logger: logger)
        }
    }

    func deliveredDigests(_ digests: Set<ContentDigest>, since: Date) async throws -> [ContentDigest: UUID] {
        guard !digests.isEmpty else { return [:] }
        let list = Array(digests)
        let clients = list.map(\.clientID)
        let hashes = list.map(\.digest)
        return try await run("read the delivered digests") { [self] in
            var found: [ContentDigest: UUID] = [:]
            for try await (clientID, digest, itemID) in try await client.query(
                """
                SELECT d.client_id, d.digest, d.item_uuid FROM dq_digests d
                JOIN unnest(\(clients)::text[], \(hashes)::text[]) AS wanted (client_id, digest)
                  ON d.client_id = wanted.client_id AND d.digest = wanted.digest
                WHERE d.delivered_at >= \(since.timeIntervalSince1970)
                """, logger: logger
            ).decode((String, String, UUID).self) {
                found[ContentDigest(clientID: clientID, digest: digest)] = itemID
            }
            return found
        }
    }

    /// Records the digests of delivered receiver items, in the journal's transaction (the newest delivery of a
    /// digest is the one kept).
    func recordDigests(_ deliveries: [CompletedDelivery], connection: PostgresConnection) async throws {
        let lines = deliveries.compactMap { delivery in delivery.digest.map { ($0, delivery.item.id, delivery.answeredAt) } }
        guard !lines.isEmpty else { return }
        // One row per digest (the last), or ON CONFLICT would meet the same row twice in one statement.
        var newest: [ContentDigest: (UUID, Date)] = [:]
        for (digest, id, at) in lines { newest[digest] = (id, at) }
        let keys = Array(newest.keys)
        try await connection.query(
            """
            INSERT INTO dq_digests (client_id, digest, item_uuid, delivered_at)
            SELECT * FROM unnest(\(keys.map(\.clientID))::text[], \(keys.map(\.digest))::text[],
                                 \(keys.map { newest[$0]?.0 ?? UUID() })::uuid[],
                                 \(keys.map { newest[$0]?.1.timeIntervalSince1970 ?? 0 })::double precision[])
            ON CONFLICT (client_id, digest) DO UPDATE SET item_uuid = excluded.item_uuid, delivered_at = excluded.delivered_at
            """, logger: logger)
    }

    func recordDuplicate(_ item: QueuedItem, url: String, note: String, owner: any FlushOwnership) async throws {
        try await fenced(owner, queue: item.queue, "record a duplicate") { [self] connection in
            let deleted = try await connection.query(
                "DELETE FROM dq_item WHERE seq = \(item.sequence) RETURNING seq", logger: logger
            ).collect()
            guard !deleted.isEmpty else { return }
            try await self.journalEvent(
                .duplicate, item: item, url: url, status: nil, note: note, attempts: item.attempts,
                at: Date().timeIntervalSince1970, connection: connection)
        }
    }

    func pruneReceipts(before cutoff: Date) async throws -> Int {
        try await run("forget old receipts") { [self] in
            var count = 0
            for table in ["dq_receipts WHERE created_at", "dq_digests WHERE delivered_at"] {
                count += try await client.query(
                    PostgresQuery(
                        unsafeSQL: "DELETE FROM \(table) < $1 RETURNING 1", binds: Self.binds(cutoff.timeIntervalSince1970)),
                    logger: logger
                ).collect().count
            }
            return count
        }
    }
}
