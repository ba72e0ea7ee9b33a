import Foundation
import PostgresNIO

// The envelopes opened per receiver key and day (``KeyOpenLog``), shared by every receiver on the database: table
// `dq_key_opens` (see ``schema``).
extension PostgresQueueStore: KeyOpenLog {
    func addKeyOpens(_ counts: [String: Int], day: Int) async throws {
        guard !counts.isEmpty else { return }
        let ids = Array(counts.keys)
        let numbers = ids.map { counts[$0] ?? 0 }
        try await run("count the envelopes opened per key") { [self] in
            _ = try await client.query(
                """
                INSERT INTO dq_key_opens (key_id, day, count)
                SELECT id, \(day), n FROM unnest(\(ids)::text[], \(numbers)::bigint[]) AS counted (id, n)
                ON CONFLICT (key_id, day) DO UPDATE SET count = dq_key_opens.count + excluded.count
                """, logger: logger
            ).collect()
        }
    }

    func keyOpens(since firstDay: Int) async throws -> [String: [Int: Int]] {
        try await run("read the envelopes opened per key") { [self] in
            var opens: [String: [Int: Int]] = [:]
            for try await (keyID, day, count) in try await client.query(
                "SELECT key_id, day, count FROM dq_key_opens WHERE day >= \(firstDay)", logger: logger
            ).decode((String, Int, Int).self) {
                opens[keyID, default: [:]][day] = count
            }
            return opens
        }
    }
}
