import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOSSL
import PostgresNIO

/// The right to flush one server's queue from PostgreSQL: a lease row with an expiry on the database's
/// clock and a fencing token that grows on every takeover.
///
/// The holder renews it every third of its lifetime; on this host it counts as held only until 90% of the
/// lifetime after the start of the last successful renewal (a monotonic deadline, immune to clock jumps), and
/// ``markInFlight(sequence:)`` refuses to let anything be sent past that. The store's writes check the token.
final class PostgresLease: FlushOwnership {
    let queue: String
    let token: Int64
    private let store: PostgresQueueStore
    private let validUntil: NIOLockedValueBox<ContinuousClock.Instant>
    private let renewer: NIOLockedValueBox<Task<Void, Never>?>
    /// What this holder last wrote to the note row (see ``markInFlight(sequence:)`` and ``clearInFlight()``).
    private let note = NIOLockedValueBox(InFlightNoteWindow())

    private init(store: PostgresQueueStore, queue: String, token: Int64, since start: ContinuousClock.Instant) {
        self.store = store
        self.queue = queue
        self.token = token
        self.validUntil = NIOLockedValueBox(start + .milliseconds(Int64(store.leaseSeconds * 900)))
        self.renewer = NIOLockedValueBox(nil)
    }

    /// Takes the lease of `queue` if it is free (never held, released, or expired on the database's clock).
    static func take(store: PostgresQueueStore, queue: String) async throws -> PostgresLease? {
        let start = ContinuousClock.now
        let taken = try await store.client.withConnection { connection -> Int64? in
            var taken: Int64?
            for try await token in try await connection.query(
                """
                WITH taken AS (
                  INSERT INTO dq_lease (queue, holder, token, expires_at)
                  VALUES (\(queue), \(store.holder), 1, now() + make_interval(secs => \(store.leaseSeconds)))
                  ON CONFLICT (queue) DO UPDATE SET holder = EXCLUDED.holder, token = dq_lease.token + 1,
                    expires_at = EXCLUDED.expires_at
                  WHERE dq_lease.expires_at <= now()
                  RETURNING token),
                fenced AS (
                  INSERT INTO dq_note (queue, token) SELECT \(queue), token FROM taken
                  ON CONFLICT (queue) DO UPDATE SET token = EXCLUDED.token)
                SELECT token FROM taken
                """, logger: store.logger
            ).decode(Int64.self) {
                taken = token
            }
            // A token whose commit is not confirmed could be handed out again after a failover: two holders.
            try await connection.confirmCommit(logger: store.logger)
            return taken
        }
        guard let taken else { return nil }
        let lease = PostgresLease(store: store, queue: queue, token: taken, since: start)
        lease.startRenewing()
        return lease
    }

    private func startRenewing() {
        let task = Task { [weak self] in
            while !Task.isCancelled {
                guard let interval = self.map({ $0.store.leaseSeconds / 3 }) else { return }
                try? await Task.sleep(for: .milliseconds(Int64(interval * 1000)))
                guard let self, !Task.isCancelled else { return }
                let start = ContinuousClock.now
                do {
                    let renewed = try await store.client.withConnection { connection in
                        var renewed = false
                        for try await _ in try await connection.query(
                            """
                            UPDATE dq_lease SET expires_at = now() + make_interval(secs => \(store.leaseSeconds))
                            WHERE queue = \(queue) AND token = \(token) RETURNING token
                            """, logger: store.logger)
                        {
                            renewed = true
                        }
                        try await connection.confirmCommit(logger: store.logger)
                        return renewed
                    }
                    if !renewed {
                        lost()
                        return
                    }
                    validUntil.withLockedValue { $0 = start + .milliseconds(Int64(store.leaseSeconds * 900)) }
                } catch {
                    // Not renewed this time: the deadline stands; the next round tries again.
                    store.logger.warning("cannot renew the flush lease", metadata: ["queue": "\(queue)"])
                }
            }
        }
        renewer.withLockedValue { $0 = task }
    }

    /// The lease was taken over: nothing more may be sent.
    func lost() {
        validUntil.withLockedValue { $0 = ContinuousClock.now - .seconds(1) }
    }

    private func checkHeld() throws {
        guard ContinuousClock.now < validUntil.withLockedValue({ $0 }) else {
            throw DataQueueError(
                .busy, "the flush lease on \(queue) expired or was taken over by another dq instance; this flush stops")
        }
    }

    /// How long one note covers sends: a second, or a tenth of the lease when that is shorter.
    var noteWindow: Duration { .milliseconds(Int64(noteWindowSeconds * 1000)) }
    private var noteWindowSeconds: Double { min(1, store.leaseSeconds / 10) }

    /// Notes `sequence` in `dq_note`, where the token still matches (a takeover raises it there too, so a
    /// lost lease stops here), with the end of a window (``noteWindow``) as its time: the note covers every
    /// send until then, so a flush writes it once per window, not once per request. A next holder lets the
    /// server settle requests until the settle delay has passed after that time, which is never earlier
    /// than after the last request the note covers.
    ///
    /// One statement whose commit does not wait for the disk (`synchronous_commit` off for that transaction
    /// alone): the note outlives a crash of dq at once, and a crash of PostgreSQL in the next few hundred
    /// milliseconds may lose it, as the SQLite store's marker (a write to the page cache) outlives dq but not
    /// the machine.
    func markInFlight(sequence: Int64) async throws {
        try checkHeld()
        let start = ContinuousClock.now
        if note.withLockedValue({ $0.covers(start) }) { return }
        let window = noteWindow
        let coveredUntil = Date().addingTimeInterval(noteWindowSeconds)
        let (queue, token, client, logger) = (queue, token, store.client, store.logger)
        let held = try await store.run("note the item being sent") {
            var held = false
            for try await _ in try await client.query(
                """
                WITH asynchronous AS (SELECT set_config('synchronous_commit', 'off', true))
                INSERT INTO dq_note (queue, token, in_flight_seq, in_flight_at)
                SELECT \(queue), \(token), \(sequence), \(coveredUntil.timeIntervalSince1970) FROM asynchronous
                ON CONFLICT (queue) DO UPDATE SET token = EXCLUDED.token, in_flight_seq = EXCLUDED.in_flight_seq,
                  in_flight_at = EXCLUDED.in_flight_at
                WHERE dq_note.token <= EXCLUDED.token
                RETURNING token
                """, logger: logger)
            {
                held = true
            }
            return held
        }
        note.withLockedValue { $0.wrote(at: start, covering: held ? window : nil) }
        if !held { lost() }
        try checkHeld()
    }

    /// Clears the note, lazily: the next ``markInFlight(sequence:)`` overwrites it and ``release()`` clears
    /// it, so a flush costs no round trip per answer for it. A flusher that dies between an answer and its
    /// next send leaves the answered item's note: the next holder waits out the rest of its settle delay,
    /// which costs time, never a resource.
    func clearInFlight() async throws {
        note.withLockedValue { $0.clear() }
    }

    func inFlight() async throws -> (sequence: Int64, sentAt: Date)? {
        if note.withLockedValue({ $0.cleared }) { return nil }
        let (queue, client, logger) = (queue, store.client, store.logger)
        return try await store.run("read the in-flight note") {
            for try await (sequence, at) in try await client.query(
                "SELECT in_flight_seq, in_flight_at FROM dq_note WHERE queue = \(queue)", logger: logger
            ).decode((Int64?, Double?).self) {
                if let sequence, let at { return (sequence, Date(timeIntervalSince1970: at)) }
            }
            return nil
        }
    }

    func release() async {
        renewer.withLockedValue { $0?.cancel() }
        let clearNote = note.withLockedValue { $0.release() }
        let (queue, token, store) = (queue, token, store)
        // Not cancelled with the caller: a flush that graceful shutdown ends releases its lease on its way out, or
        // the next flush (a cron flush, the restarted service) finds it held until it expires.
        let released = await Task {
            do {
                if clearNote {
                    _ = try await store.client.query(
                        "UPDATE dq_note SET in_flight_seq = NULL, in_flight_at = NULL WHERE queue = \(queue) AND token = \(token)",
                        logger: store.logger)
                }
                _ = try await store.client.query(
                    "UPDATE dq_lease SET expires_at = '-infinity' WHERE queue = \(queue) AND token = \(token)", logger: store.logger)
                return true
            } catch {
                return false
            }
        }.value
        if !released {
            store.logger.warning(
                "the flush lease could not be released; the next flush waits until it expires",
                metadata: ["queue": "\(queue)", "seconds": "\(store.leaseSeconds)"])
        }
    }
}
