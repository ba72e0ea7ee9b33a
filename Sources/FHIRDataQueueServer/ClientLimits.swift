import NIOConcurrencyHelpers

// What one client may use of a receiver: its turns at the secret check, and what it may have waiting.

/// Failed secret checks per client id: the first ``free`` in a row go at once; after them each next check of that id
/// waits twice as long as the last (1 s, 2 s, 4 s… at most ``longest``), whichever address asks. A success clears
/// the id; an id with no failure for ``forgetAfter`` is forgotten. The table is bounded as ``RateLimiter``'s is.
///
/// An attacker guessing one device's secret from many addresses then spends that id's turns, not the secret checks
/// all devices share; the device itself waits while its id is being guessed (Retry-After says how long).
final class FailureBackoff: Sendable {
    /// Failures in a row that cost nothing extra.
    static let free = 5
    /// The longest wait.
    static let longest: Duration = .seconds(300)
    /// How long an id's failures are remembered after its last.
    static let forgetAfter: Duration = .seconds(900)
    /// The most ids remembered; past it, the oldest half go.
    static let capacity = 100_000

    private struct Record {
        var failures: Int
        var last: ContinuousClock.Instant
    }

    private let records = NIOLockedValueBox<[String: Record]>([:])

    /// Nil when `id` may be checked at `now`; else the seconds to wait.
    func refuse(_ id: String, now: ContinuousClock.Instant = .now) -> Int? {
        records.withLockedValue { records in
            guard let record = records[id] else { return nil }
            if now - record.last >= Self.forgetAfter {
                records[id] = nil
                return nil
            }
            guard record.failures >= Self.free else { return nil }
            let until = record.last + Self.wait(afterFailures: record.failures)
            guard now < until else { return nil }
            return max(1, Int((until - now).components.seconds) + 1)
        }
    }

    /// The wait after `failures` in a row (none before ``free``).
    static func wait(afterFailures failures: Int) -> Duration {
        guard failures >= free else { return .zero }
        let doublings = min(failures - free, 20)
        return min(.seconds(1 << doublings), longest)
    }

    /// Counts a failed check of `id` at `now`.
    func failed(_ id: String, now: ContinuousClock.Instant = .now) {
        records.withLockedValue { records in
            if records[id] == nil, records.count >= Self.capacity {
                let keep = records.sorted { $0.value.last > $1.value.last }.prefix(Self.capacity / 2)
                records = Dictionary(uniqueKeysWithValues: keep.map { ($0.key, $0.value) })
            }
            var record = records[id] ?? Record(failures: 0, last: now)
            if now - record.last >= Self.forgetAfter { record.failures = 0 }
            record.failures += 1
            record.last = now
            records[id] = record
        }
    }

    /// Clears `id` after a check that passed.
    func succeeded(_ id: String) {
        records.withLockedValue { _ = $0.removeValue(forKey: id) }
    }
}

/// What each client has waiting in the database, as ``C3PROReceiver`` limits it: read at most once per ``freshFor``
/// per client, with what this receiver took since added (so a fast device cannot pass the limit between two reads).
/// When an entry is stale, one request reads it again while the others go on with the stale figures (a count read
/// by every request at once held a fast device's requests for most of a second: 64 connections, one scan each).
/// Bounded: past ``capacity`` clients, the table starts again.
final class WaitingCounts: Sendable {
    static let freshFor: Duration = .seconds(5)
    static let capacity = 50_000

    private struct Entry {
        var count: Int
        var bytes: Int
        var readAt: ContinuousClock.Instant
        /// Whether a request is reading it again now.
        var refreshing = false
    }

    private let entries = NIOLockedValueBox<[String: Entry]>([:])

    /// The client's count and bytes: cached, or read with `read` by one request when stale.
    func waiting(
        _ client: String, now: ContinuousClock.Instant = .now, read: () async throws -> (count: Int, bytes: Int)
    ) async throws -> (count: Int, bytes: Int) {
        let cached: (count: Int, bytes: Int)? = entries.withLockedValue { entries in
            guard var entry = entries[client] else { return nil }
            if now - entry.readAt < Self.freshFor || entry.refreshing { return (entry.count, entry.bytes) }
            entry.refreshing = true
            entries[client] = entry
            return nil
        }
        if let cached { return cached }
        let counted: (count: Int, bytes: Int)
        do {
            counted = try await read()
        } catch {
            entries.withLockedValue { $0[client]?.refreshing = false }
            throw error
        }
        entries.withLockedValue { entries in
            if entries.count >= Self.capacity { entries.removeAll(keepingCapacity: true) }
            entries[client] = Entry(count: counted.count, bytes: counted.bytes, readAt: now)
        }
        return counted
    }

    /// Counts an item of `bytes` taken for `client` since its last read.
    func add(_ client: String, bytes: Int) {
        entries.withLockedValue { entries in
            entries[client]?.count += 1
            entries[client]?.bytes += bytes
        }
    }
}
