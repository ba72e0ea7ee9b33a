import CSQLite
import Foundation
import GRDB

#if canImport(Glibc)
    import Glibc
#endif

// Rows to dq's types, with damage named.
extension SQLiteQueueStore {
    /// A row dq cannot read is named and refused, never guessed at (and never sent).
    static func damaged(_ table: String, _ row: Row, _ what: String) -> DataQueueError {
        let seq: Int64? = row["seq"]
        return DataQueueError(
            .storage,
            "\(table) row \(seq.map(String.init) ?? "?") of the queue database is damaged (\(what)); "
                + "inspect it with sqlite3, then fix or delete that row")
    }

    /// A text column read as what dq writes there, or the row named as damaged.
    static func column<T>(_ row: Row, _ name: String, of table: String, _ parse: (String) -> T?) throws -> T {
        let text: String? = row[name]
        guard let text, let value = parse(text) else { throw damaged(table, row, "unknown \(name)") }
        return value
    }

    static func queuedItem(_ row: Row) throws -> QueuedItem {
        let uuid = try column(row, "uuid", of: "item") { UUID(uuidString: $0) }
        let method = try column(row, "method", of: "item") { FHIRMethod(rawValue: $0) }
        let state = try column(row, "state", of: "item") { QueuedItem.State(rawValue: $0) }
        let lastAttempt: Double? = row["last_attempt_at"]
        let size: Int? = row["size"]
        let body: Data? = size == nil ? row["body"] : nil
        return QueuedItem(
            sequence: row["seq"], id: uuid, queue: row["queue"], method: method, url: row["url"],
            resourceType: row["resource_type"], resourceID: row["resource_id"], encrypted: row["encrypted"], state: state,
            attempts: row["attempts"], enqueuedAt: Date(timeIntervalSince1970: row["enqueued_at"]),
            lastAttemptAt: lastAttempt.map(Date.init(timeIntervalSince1970:)), lastStatus: row["last_status"],
            lastError: row["last_error"], outcome: row["outcome"], size: size ?? body?.count ?? 0,
            clientID: row.hasColumn("client_id") ? row["client_id"] : nil)
    }

    static func storedItem(_ row: Row) throws -> StoredItem {
        let conditional: Int? = row["conditional_create"]
        return StoredItem(
            info: try queuedItem(row), contentType: row["content_type"], conditionalCreate: conditional != 0,
            body: row["body"], fullURL: row["full_url"], clientID: row["client_id"])
    }

    static func deliveryRecord(_ row: Row) throws -> DeliveryRecord {
        let uuid = try column(row, "uuid", of: "delivery") { UUID(uuidString: $0) }
        let method = try column(row, "method", of: "delivery") { FHIRMethod(rawValue: $0) }
        let event = try column(row, "event", of: "delivery") { DeliveryRecord.Event(rawValue: $0) }
        return DeliveryRecord(
            sequence: row["seq"], id: uuid, event: event, queue: row["queue"], method: method, url: row["url"],
            resourceType: row["resource_type"], status: row["status"], location: row["location"],
            serverID: row["server_id"], versionID: row["version_id"], attempts: row["attempts"],
            enqueuedAt: Date(timeIntervalSince1970: row["enqueued_at"]), at: Date(timeIntervalSince1970: row["at"]),
            note: row["note"], fullURL: row["full_url"], bundle: row["bundle"],
            entryLocations: (row["entries"] as String?).flatMap {
                try? JSONDecoder().decode([String?].self, from: Data($0.utf8))
            })
    }
}
