import Foundation

// Sealing at rest, for operators: what is sealed under which key, and a rekey.
extension DataQueue {
    /// How a queue database is sealed at rest: the keys of its seal key table and how many items (of every
    /// queue) each seals; `plain` counts items stored as given.
    package struct SealingSummary: Sendable, Encodable, Equatable {
        /// The at-rest keys the database was sealed under (empty: not sealed).
        package var keys: [String]
        /// Items by the key that seals them.
        package var items: [String: Int]
        /// Items stored as given.
        package var plain: Int
    }

    /// How this queue's database is sealed at rest (readable without a key).
    package func sealingSummary() async throws -> SealingSummary {
        // A sealed store passes these reads to the store it wraps: no key is needed.
        try await Self.summary(of: store)
    }

    static func summary(of store: any QueueStorage) async throws -> SealingSummary {
        var counts = try await store.sealedCounts()
        let plain = counts.removeValue(forKey: "") ?? 0
        return SealingSummary(keys: try await store.sealKeys().map(\.id), items: counts, plain: plain)
    }

    /// What ``rekey(progress:)`` did.
    package struct RekeyReport: Sendable, Encodable {
        /// Items sealed again under the current key.
        package var resealed: Int
        /// Keys the queue was sealed under that seal no item now: they can leave `old_key_files` (the queue keeps
        /// their id, so that a process still configured with one of them keeps working).
        package var unused: [String]
        /// The sealing afterwards.
        package var summary: SealingSummary
    }

    /// Seals every item under the current at-rest key (``Configuration/atRest``): those sealed under an old key
    /// and any plain one, in batches, while producers and flushes go on; then names the old keys no item needs.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when no at-rest key is configured.
    package func rekey(progress: (Int) -> Void) async throws -> RekeyReport {
        guard let current = configuration.atRest?.current else {
            throw SealedStorage.noKeyToSealUnder
        }
        let resealed = try await store.resealUnderCurrentKey(progress: progress)
        let summary = try await Self.summary(of: store)
        let unused = summary.keys.filter { $0 != current.id && (summary.items[$0] ?? 0) == 0 }
        return RekeyReport(resealed: resealed, unused: unused, summary: summary)
    }
}
