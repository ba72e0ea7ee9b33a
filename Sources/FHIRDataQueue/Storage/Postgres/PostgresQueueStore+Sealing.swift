import Foundation
import Logging
import PostgresNIO

// The seal key table, and the raw rows a seal or rekey rewrites (see ``SealedStorage``).
extension PostgresQueueStore {
    func sealKeys() async throws -> [SealKeyRecord] {
        try await run("read the seal keys") { [self] in
            var records: [SealKeyRecord] = []
            do {
                for try await (id, wrapped) in try await client.query(
                    "SELECT key_id, index_key FROM dq_seal_key ORDER BY added_at, key_id", logger: logger
                ).decode((String, Data).self) {
                    records.append(SealKeyRecord(id: id, wrappedIndexKey: wrapped))
                }
            } catch let error as PSQLError where error.serverInfo?[.sqlState] == "42P01" {
                // A schema of a dq from before sealing, read without writing: not sealed.
                return []
            }
            return records
        }
    }

    func addSealKey(_ record: SealKeyRecord) async throws {
        _ = try await run("add a seal key") { [self] in
            try await client.query(
                """
                INSERT INTO dq_seal_key (key_id, index_key, added_at)
                VALUES (\(record.id), \(record.wrappedIndexKey), \(Date().timeIntervalSince1970)) ON CONFLICT (key_id) DO NOTHING
                """, logger: logger)
        }
    }

    func addFirstSealKey(_ record: SealKeyRecord) async throws -> Bool {
        try await run("add the first seal key") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                // Two transactions that both saw no key would each add theirs: the lock makes the second wait and
                // then see the first's.
                _ = try await connection.query("LOCK TABLE dq_seal_key IN SHARE ROW EXCLUSIVE MODE", logger: logger).collect()
                var added = false
                for try await _ in try await connection.query(
                    """
                    INSERT INTO dq_seal_key (key_id, index_key, added_at)
                    SELECT \(record.id), \(record.wrappedIndexKey), \(Date().timeIntervalSince1970)
                    WHERE NOT EXISTS (SELECT 1 FROM dq_seal_key) RETURNING key_id
                    """, logger: logger)
                {
                    added = true
                }
                return added
            }
        }
    }

    /// The SQLSTATE of the trigger's refusal of a plain item in a sealed queue (see ``refusePlainItems()``).
    static let plainItemRefusal = "DQS01"

    func refusePlainItems() async throws {
        // A trigger, so that it holds for every instance, also one that opened the queue while it was plain. Made
        // once under a versioned name, never replaced (as the enqueue procedures); instances that make it at the
        // same moment: the loser's duplicate is no error. A sealed body starts with `DQS1` (see ``Sealer``): the
        // trigger's WHEN, evaluated without calling the function, passes a sealed row at the cost of a compare.
        // Only inserts: a seal or rekey rewrites rows with UPDATE.
        _ = try await run("guard the sealed queue") { [self] in
            try await client.query(
                """
                DO $do$ BEGIN
                  IF to_regprocedure('dq_refuse_plain_item_v1()') IS NULL THEN
                    CREATE FUNCTION dq_refuse_plain_item_v1() RETURNS trigger LANGUAGE plpgsql AS $f$
                    BEGIN
                      RAISE EXCEPTION 'dq: the queue is sealed at rest; a plain item is refused' USING ERRCODE = 'DQS01';
                    END $f$;
                  END IF;
                  IF NOT EXISTS (
                    SELECT 1 FROM pg_trigger WHERE tgname = 'dq_item_sealed_only' AND tgrelid = to_regclass('dq_item')
                  ) THEN
                    CREATE TRIGGER dq_item_sealed_only BEFORE INSERT ON dq_item FOR EACH ROW
                      WHEN (substring(NEW.body FROM 1 FOR 4) IS DISTINCT FROM '\\x44515331'::bytea)
                      EXECUTE FUNCTION dq_refuse_plain_item_v1();
                  END IF;
                EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
                END $do$
                """, logger: logger)
        }
    }

    func sealedCounts() async throws -> [String: Int] {
        try await run("count sealed items") { [self] in
            var counts: [String: Int] = [:]
            // A sealed body starts with `DQS1` and its key id (see ``Sealer``); anything else is plain.
            for try await (key, count) in try await client.query(
                """
                SELECT CASE WHEN substring(body FROM 1 FOR 4) = '\\x44515331'::bytea
                            THEN encode(substring(body FROM 5 FOR 16), 'escape') ELSE '' END AS k, count(*)
                FROM dq_item GROUP BY k
                """, logger: logger
            ).decode((String, Int).self) {
                counts[key] = count
            }
            return counts
        }
    }

    func rawItems(after: Int64, limit: Int) async throws -> [StoredItem] {
        try await run("read the queue") { [self] in
            try await rows(
                PostgresQuery(
                    unsafeSQL: "SELECT \(Self.storedColumns) FROM dq_item WHERE seq > $1 ORDER BY seq LIMIT $2",
                    binds: Self.binds(after, Int64(limit))),
                Self.storedItem)
        }
    }

    func replaceSealed(_ replacements: [SealedReplacement]) async throws -> Int {
        guard !replacements.isEmpty else { return 0 }
        return try await run("seal items") { [self] in
            try await client.withTransaction(logger: logger) { connection in
                var changed = 0
                for r in replacements {
                    // Only if the row is still as it was read: a flush may have delivered or parked it meanwhile.
                    for try await _ in try await connection.query(
                        """
                        UPDATE dq_item SET url = \(r.url), resource_id = \(r.resourceID), body = \(r.body), full_url = \(r.fullURL),
                                           outcome = \(r.outcome)
                        WHERE seq = \(r.sequence) AND body = \(r.expectedBody) AND outcome IS NOT DISTINCT FROM \(r.expectedOutcome)
                        RETURNING seq
                        """, logger: logger)
                    {
                        changed += 1
                    }
                    Self.answered()
                }
                return changed
            }
        }
    }

    func plainJournalFullURLs(limit: Int) async throws -> [String] {
        try await run("read the journal") { [self] in
            var urls: [String] = []
            for try await url in try await client.query(
                """
                SELECT DISTINCT full_url FROM dq_delivery
                WHERE full_url IS NOT NULL AND full_url >= 'e' LIMIT \(limit)
                """, logger: logger
            ).decode(String.self) {
                urls.append(url)
            }
            return urls
        }
    }

    func replaceJournalFullURLs(_ hashes: [String: String]) async throws -> Int {
        guard !hashes.isEmpty else { return 0 }
        // One statement, rows in one order: two processes sealing at once do not deadlock.
        let pairs = hashes.sorted { $0.key < $1.key }
        let (plain, hashed) = (pairs.map(\.key), pairs.map(\.value))
        return try await run("seal the journal's fullUrls") { [self] in
            var changed = 0
            for try await _ in try await client.query(
                """
                UPDATE dq_delivery AS d SET full_url = v.hash FROM unnest(\(plain)::text[], \(hashed)::text[]) AS v(plain, hash)
                WHERE d.full_url = v.plain RETURNING 1
                """, logger: logger)
            {
                changed += 1
            }
            return changed
        }
    }
}
