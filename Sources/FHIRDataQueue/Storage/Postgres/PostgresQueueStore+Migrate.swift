import Foundation
import Logging
import NIOSSL
import PostgresNIO

// Moving a SQLite queue in (dq migrate).
extension PostgresQueueStore {
    /// Stores items moved from another store, in their order, keeping their id, state, attempts and last
    /// answer; an item whose id is already here is skipped (a migration run again after a crash). Returns
    /// how many were added.
    func importItems(_ items: [StoredItem]) async throws -> Int {
        guard !items.isEmpty else { return 0 }
        return try await run("move items in") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                let first = try await Self.reserveSequences(items.count, connection: connection, logger: logger)
                var added = 0
                for (offset, stored) in items.enumerated() {
                    let item = stored.info
                    let conditional: Bool? = stored.conditionalCreate ? nil : false
                    for try await _ in try await connection.query(
                        """
                        INSERT INTO dq_item (seq, uuid, queue, method, url, resource_type, resource_id, encrypted, content_type,
                                             body, full_url, state, attempts, enqueued_at, last_attempt_at, last_status,
                                             last_error, outcome, conditional_create)
                        VALUES (\(first + Int64(offset)), \(item.id), \(item.queue), \(item.method.rawValue), \(item.url),
                                \(item.resourceType), \(item.resourceID), \(item.encrypted), \(stored.contentType), \(stored.body),
                                \(stored.fullURL), \(item.state.rawValue), \(item.attempts), \(item.enqueuedAt.timeIntervalSince1970),
                                \(item.lastAttemptAt?.timeIntervalSince1970), \(item.lastStatus), \(item.lastError), \(item.outcome),
                                \(conditional))
                        ON CONFLICT (uuid) DO NOTHING RETURNING seq
                        """, logger: logger)
                    {
                        added += 1
                    }
                    Self.answered()
                }
                return added
            }
        }
    }

    /// Adds journal lines moved from another store, skipping those already here (same id, event and time).
    func importJournal(_ records: [DeliveryRecord]) async throws -> Int {
        guard !records.isEmpty else { return 0 }
        return try await run("move the journal in") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                var added = 0
                for record in records {
                    let entries = record.entryLocations.flatMap { try? JSONEncoder().encode($0) }.map {
                        String(decoding: $0, as: UTF8.self)
                    }
                    let at = record.at.timeIntervalSince1970
                    for try await _ in try await connection.query(
                        """
                        INSERT INTO dq_delivery (item_seq, uuid, event, queue, method, url, resource_type, status, location,
                                                 server_id, version_id, attempts, enqueued_at, at, note, full_url, bundle, entries)
                        SELECT 0, \(record.id), \(record.event.rawValue), \(record.queue), \(record.method.rawValue), \(record.url),
                               \(record.resourceType), \(record.status), \(record.location), \(record.serverID), \(record.versionID),
                               \(record.attempts), \(record.enqueuedAt.timeIntervalSince1970), \(at), \(record.note), \(record.fullURL),
                               \(record.bundle), \(entries)
                        WHERE NOT EXISTS (SELECT 1 FROM dq_delivery WHERE uuid = \(record.id) AND event = \(record.event.rawValue) AND at = \(at))
                        RETURNING seq
                        """, logger: logger)
                    {
                        added += 1
                    }
                    Self.answered()
                }
                return added
            }
        }
    }
}
