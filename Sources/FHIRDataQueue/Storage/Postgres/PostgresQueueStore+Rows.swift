import Foundation
import Logging
import NIOSSL
import PostgresNIO

// Rows to dq's types, with damage named.
extension PostgresQueueStore {
    /// Every row `query` returns, each made into a value by `decode`.
    func rows<T>(_ query: PostgresQuery, _ decode: (PostgresRow) throws -> T) async throws -> [T] {
        var values: [T] = []
        for try await row in try await client.query(query, logger: logger) {
            // Each row is an answer: a long result read on a busy machine is not a server that went silent.
            Self.answered()
            values.append(try decode(row))
        }
        return values
    }

    static func binds(_ values: any PostgresEncodable...) -> PostgresBindings {
        var bindings = PostgresBindings()
        for value in values { try? bindings.append(value) }
        return bindings
    }

    static func damaged(_ seq: Int64?, _ what: String) -> DataQueueError {
        DataQueueError(
            .storage,
            "item row \(seq.map(String.init) ?? "?") of the queue database is damaged (\(what)); inspect it with psql, then fix or delete that row"
        )
    }

    static func queuedItem(_ row: PostgresRow) throws -> QueuedItem {
        let cells = row.makeRandomAccess()
        let seq = try cells["seq"].decode(Int64.self)
        guard let method = FHIRMethod(rawValue: try cells["method"].decode(String.self)) else { throw damaged(seq, "unknown method") }
        guard let state = QueuedItem.State(rawValue: try cells["state"].decode(String.self)) else { throw damaged(seq, "unknown state") }
        return QueuedItem(
            sequence: seq, id: try cells["uuid"].decode(UUID.self), queue: try cells["queue"].decode(String.self),
            method: method, url: try cells["url"].decode(String.self), resourceType: try cells["resource_type"].decode(String.self),
            resourceID: try cells["resource_id"].decode(String?.self), encrypted: try cells["encrypted"].decode(Bool.self),
            state: state, attempts: try cells["attempts"].decode(Int.self),
            enqueuedAt: Date(timeIntervalSince1970: try cells["enqueued_at"].decode(Double.self)),
            lastAttemptAt: try cells["last_attempt_at"].decode(Double?.self).map(Date.init(timeIntervalSince1970:)),
            lastStatus: try cells["last_status"].decode(Int?.self), lastError: try cells["last_error"].decode(String?.self),
            outcome: try cells["outcome"].decode(String?.self), size: try cells["size"].decode(Int.self),
            clientID: cells.contains("client_id") ? try cells["client_id"].decode(String?.self) : nil)
    }

    static func storedItem(_ row: PostgresRow) throws -> StoredItem {
        let cells = row.makeRandomAccess()
        return StoredItem(
            info: try queuedItem(row), contentType: try cells["content_type"].decode(String.self),
            conditionalCreate: try cells["conditional_create"].decode(Bool?.self) != false, body: try cells["body"].decode(Data.self),
            fullURL: try cells["full_url"].decode(String?.self), clientID: try cells["client_id"].decode(String?.self))
    }

    static func deliveryRecord(_ row: PostgresRow) throws -> DeliveryRecord {
        let cells = row.makeRandomAccess()
        let seq = try cells["seq"].decode(Int64.self)
        guard let method = FHIRMethod(rawValue: try cells["method"].decode(String.self)),
            let event = DeliveryRecord.Event(rawValue: try cells["event"].decode(String.self))
        else {
            throw DataQueueError(.storage, "delivery row \(seq) of the queue database is damaged (unknown method or event)")
        }
        return DeliveryRecord(
            sequence: seq, id: try cells["uuid"].decode(UUID.self), event: event, queue: try cells["queue"].decode(String.self),
            method: method, url: try cells["url"].decode(String.self), resourceType: try cells["resource_type"].decode(String.self),
            status: try cells["status"].decode(Int?.self), location: try cells["location"].decode(String?.self),
            serverID: try cells["server_id"].decode(String?.self), versionID: try cells["version_id"].decode(String?.self),
            attempts: try cells["attempts"].decode(Int.self),
            enqueuedAt: Date(timeIntervalSince1970: try cells["enqueued_at"].decode(Double.self)),
            at: Date(timeIntervalSince1970: try cells["at"].decode(Double.self)), note: try cells["note"].decode(String?.self),
            fullURL: try cells["full_url"].decode(String?.self), bundle: try cells["bundle"].decode(String?.self),
            entryLocations: try cells["entries"].decode(String?.self).flatMap {
                try? JSONDecoder().decode([String?].self, from: Data($0.utf8))
            })
    }
}
