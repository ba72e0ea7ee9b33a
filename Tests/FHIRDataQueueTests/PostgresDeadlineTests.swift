import Foundation
import Logging
import NIOConcurrencyHelpers
import PostgresNIO
import Testing

@testable import FHIRDataQueue

/// How long dq waits for PostgreSQL: per answer, not per operation.
@Suite("PostgreSQL's deadline")
struct PostgresDeadlineTests {
    @Test("The deadline is counted from the last answer: each answer gives the operation its whole time again")
    func perAnswer() {
        let start = ContinuousClock.now
        let clock = AnswerClock(start: start)
        let limit = Duration.seconds(2)
        #expect(clock.due(limit: limit, now: start + .seconds(1)) == start + .seconds(2))
        #expect(clock.due(limit: limit, now: start + .seconds(2)) == nil, "no answer for 2 s: over")
        clock.touch(at: start + .seconds(1.5))
        #expect(clock.due(limit: limit, now: start + .seconds(3)) == start + .seconds(3.5), "3 s in all, yet not over")
        clock.touch(at: start + .seconds(3))
        #expect(clock.due(limit: limit, now: start + .seconds(4.9)) == start + .seconds(5))
        #expect(clock.due(limit: limit, now: start + .seconds(5)) == nil)
        clock.touch(at: start + .seconds(1))
        #expect(clock.last == start + .seconds(3), "an older answer does not move it back")
    }

    @Test("An operation that stops answering ends at the deadline, with an error that says so")
    func silence() async throws {
        let started = ContinuousClock.now
        let error = await #expect(throws: DataQueueError.self) {
            try await PostgresQueueStore.withDeadline(seconds: 0.3, what: "run the test") {
                PostgresQueueStore.answered()
                try await Task.sleep(for: .seconds(60))
                return 0
            }
        }
        #expect(error?.code == .transport && error?.message.hasPrefix("cannot run the test: PostgreSQL did not answer") == true)
        #expect(ContinuousClock.now - started < .seconds(30), "it did not wait for the silent work")
    }

    @Test(
        "Each row PostgreSQL returns is an answer: a long result decoded on a busy machine is not silence",
        .enabled(if: StoreKind.available.contains(.postgres)))
    func rowsAreAnswers() async throws {
        let store = try PostgresQueueStore(
            url: try await StoreKind.freshDatabase(),
            environment: ["PGPASSWORD": StoreKind.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""],
            logger: Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() }))
        // An operation's clock that last heard from the server an hour ago, read as each row is decoded: a row
        // that counts as an answer has moved it before its decoding, past where the row before it left it.
        let start = ContinuousClock.now - .seconds(3600)
        let clock = AnswerClock(start: start)
        let seen = NIOLockedValueBox<[ContinuousClock.Instant]>([])
        let values = try await PostgresQueueStore.$answers.withValue(clock) {
            try await store.rows(PostgresQuery(unsafeSQL: "SELECT generate_series(1, 50)")) { row in
                seen.withLockedValue { $0.append(clock.last) }
                return try row.decode(Int.self)
            }
        }
        await store.shutdown()
        #expect(values == Array(1...50), "the count before the clock")
        let lasts = seen.withLockedValue { $0 }
        #expect(lasts.count == 50 && lasts[0] > start, "the first row did not count as an answer")
        #expect(zip(lasts, lasts.dropFirst()).allSatisfy { $0 < $1 }, "a row did not count as an answer")
    }

    @Test("answered() outside an operation does nothing")
    func outside() {
        PostgresQueueStore.answered()
        #expect(PostgresQueueStore.answers == nil)
    }
}
