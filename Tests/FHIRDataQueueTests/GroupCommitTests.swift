import Foundation
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// The one group-commit engine (``GroupCommit``) behind the SQLite enqueue batcher, the PostgreSQL one and the
/// delivery journal: grouping, order, where commits run, and what a failure does.
@Suite("Group commit")
struct GroupCommitTests {
    /// Polls `condition` (yielding) for up to 10 s.
    func waitFor(_ condition: () -> Bool) async throws -> Bool {
        for _ in 0..<10_000 {
            if condition() { return true }
            try await Task.sleep(for: .milliseconds(1))
        }
        return condition()
    }

    /// A commit that records each batch, numbers its inputs after those committed before, and waits at `gate`
    /// in its first commit (so that others arrive while it runs).
    final class Recorder: Sendable {
        let batches = NIOLockedValueBox<[[String]]>([])
        let threads = NIOLockedValueBox<Set<pthread_t>>([])
        let gate = DispatchSemaphore(value: 0)
        let fail = NIOLockedValueBox<Set<String>>([])

        func commit(_ inputs: [String]) -> Result<[Int], DataQueueError> {
            threads.withLockedValue { _ = $0.insert(pthread_self()) }
            let first = batches.withLockedValue { batches in
                batches.append(inputs)
                return batches.count == 1
            }
            if first { gate.wait() }
            if inputs.contains(where: { input in fail.withLockedValue { $0.contains(input) } }) {
                return .failure(DataQueueError(.storage, "refused"))
            }
            let base = batches.withLockedValue { $0.flatMap { $0 }.count - inputs.count }
            return .success(inputs.indices.map { base + $0 + 1 })
        }
    }

    @Test("On its thread: inputs that arrive during a commit share the next, in arrival order; every commit runs on that thread")
    func threadGroups() async throws {
        let recorder = Recorder()
        let engine = GroupCommit<String, Int>(committer: .thread(name: "dq-test") { recorder.commit($0) })
        let leader = Task { try await engine.submit("0") }
        #expect(try await waitFor { recorder.batches.withLockedValue { $0.count } == 1 }, "the leader is committing")
        var followers: [Task<Int, any Error>] = []
        for index in 1...10 {
            followers.append(Task { try await engine.submit("\(index)") })
            #expect(try await waitFor { engine.waitingCount == index }, "input \(index) waits for the commit")
        }
        recorder.gate.signal()
        #expect(try await leader.value == 1)
        var outputs: [Int] = []
        for follower in followers { outputs.append(try await follower.value) }
        #expect(outputs == Array(2...11), "each follower got its own output, in arrival order")
        let committed = recorder.batches.withLockedValue { $0 }
        #expect(committed.count == 2, "two commits for eleven inputs: \(committed.map(\.count))")
        #expect(committed.last == (1...10).map(String.init))
        #expect(engine.commits == 2)
        #expect(try await engine.submit("11") == 12)
        #expect(recorder.batches.withLockedValue { $0.last } == ["11"], "uncontended again: the next commits alone")
        #expect(!recorder.threads.withLockedValue { $0.contains(pthread_self()) })
    }

    @Test("Asynchronous: the first commits alone in its own task; those arriving meanwhile share the next commit, in order")
    func asyncGroups() async throws {
        let recorder = Recorder()
        let engine = GroupCommit<String, Int>(
            committer: .async { inputs in
                // Off the cooperative pool's threads only in this test: the gate blocks.
                await withCheckedContinuation { continuation in Thread { continuation.resume(returning: recorder.commit(inputs)) }.start() }
            })
        let leader = Task { try await engine.submit("0") }
        #expect(try await waitFor { recorder.batches.withLockedValue { $0.count } == 1 })
        var followers: [Task<Int, any Error>] = []
        for index in 1...5 {
            followers.append(Task { try await engine.submit("\(index)") })
            #expect(try await waitFor { engine.waitingCount == index })
        }
        recorder.gate.signal()
        #expect(try await leader.value == 1)
        var outputs: [Int] = []
        for follower in followers { outputs.append(try await follower.value) }
        #expect(outputs == Array(2...6))
        #expect(recorder.batches.withLockedValue { $0 } == [["0"], ["1", "2", "3", "4", "5"]])
    }

    @Test(
        "A caller cancelled while its input waits takes it back: never committed, told at once; one whose commit began waits for it",
        arguments: ["thread", "async"])
    func cancelledWhileWaiting(mode: String) async throws {
        let recorder = Recorder()
        let committer: GroupCommit<String, Int>.Committer =
            mode == "thread"
            ? .thread(name: "dq-test") { recorder.commit($0) }
            : .async { inputs in
                await withCheckedContinuation { continuation in Thread { continuation.resume(returning: recorder.commit(inputs)) }.start() }
            }
        let engine = GroupCommit<String, Int>(committer: committer)
        let leader = Task { try await engine.submit("0") }
        #expect(try await waitFor { recorder.batches.withLockedValue { $0.count } == 1 }, "the first commit runs (and waits at the gate)")
        let kept = Task { try await engine.submit("1") }
        #expect(try await waitFor { engine.waitingCount == 1 })
        let cancelled = Task { try await engine.submit("2") }
        #expect(try await waitFor { engine.waitingCount == 2 })
        cancelled.cancel()
        await #expect(throws: DataQueueError.self, "told at once, while the first commit still runs") { try await cancelled.value }
        #expect(engine.waitingCount == 1, "taken back")
        // The leader's commit began before its task was cancelled: it goes on, and its caller gets the outcome.
        leader.cancel()
        recorder.gate.signal()
        #expect(try await leader.value == 1)
        #expect(try await kept.value == 2)
        await engine.waitUntilIdle()
        #expect(recorder.batches.withLockedValue { $0 } == [["0"], ["1"]], "the cancelled input never reached the store")
    }

    @Test("A failed commit fails its inputs only; the next commit goes through")
    func failureWithoutStop() async throws {
        let recorder = Recorder()
        recorder.gate.signal()
        recorder.fail.withLockedValue { $0 = ["bad"] }
        let engine = GroupCommit<String, Int>(committer: .thread(name: "dq-test") { recorder.commit($0) })
        _ = try await engine.submit("a")
        await #expect(throws: DataQueueError.self) { try await engine.submit("bad") }
        #expect(try await engine.submit("c") == 3)
        #expect(engine.stoppedBy == nil)
    }

    @Test(
        "With stopsAtFailure, inputs that wait while the failing commit runs are held, and told the failure",
        arguments: ["thread", "async"])
    func waitingWhenStopped(mode: String) async throws {
        let recorder = Recorder()  // the first commit waits at the gate, then fails
        recorder.fail.withLockedValue { $0 = ["1"] }
        let committer: GroupCommit<String, Int>.Committer =
            mode == "thread"
            ? .thread(name: "dq-test") { recorder.commit($0) }
            : .async { inputs in
                await withCheckedContinuation { continuation in Thread { continuation.resume(returning: recorder.commit(inputs)) }.start() }
            }
        let engine = GroupCommit<String, Int>(maximumBatch: .max, stopsAtFailure: true, committer: committer)
        engine.add("1")
        #expect(try await waitFor { recorder.batches.withLockedValue { $0.count } == 1 }, "the first commit runs")
        let told = NIOLockedValueBox<Result<Int, DataQueueError>?>(nil)
        engine.add("2") { result in told.withLockedValue { $0 = result } }
        recorder.gate.signal()
        await engine.waitUntilIdle()
        #expect(try await waitFor { told.withLockedValue { $0 != nil } }, "the waiting input is told")
        #expect(told.withLockedValue { $0.map { (try? $0.get()) == nil } } == true, "with the failure")
        #expect(recorder.batches.withLockedValue { $0 } == [["1"]], "nothing more reached the store")
        #expect(engine.takeHeld() == ["1", "2"])
    }

    @Test(
        "With stopsAtFailure, a failed commit stops the engine: its inputs and all added later are held, in order, for takeHeld",
        arguments: ["thread", "async"])
    func stopsAtFailure(mode: String) async throws {
        let recorder = Recorder()
        recorder.gate.signal()
        recorder.fail.withLockedValue { $0 = ["2"] }
        let committer: GroupCommit<String, Int>.Committer =
            mode == "thread" ? .thread(name: "dq-test") { recorder.commit($0) } : .async { recorder.commit($0) }
        let engine = GroupCommit<String, Int>(maximumBatch: .max, stopsAtFailure: true, committer: committer)
        engine.add("1")
        await engine.waitUntilIdle()
        #expect(recorder.batches.withLockedValue { $0 } == [["1"]])
        #expect(engine.takeHeld() == [], "nothing is held while the engine runs")
        engine.add("2")
        await engine.waitUntilIdle()
        #expect(engine.stoppedBy?.message == "refused")
        let lateOutcome = NIOLockedValueBox<Result<Int, DataQueueError>?>(nil)
        engine.add("3") { result in lateOutcome.withLockedValue { $0 = result } }
        engine.add("4")
        #expect(lateOutcome.withLockedValue { $0.map { (try? $0.get()) == nil } } == true, "a later input is told at once")
        await engine.waitUntilIdle()
        #expect(recorder.batches.withLockedValue { $0 } == [["1"], ["2"]], "nothing more reached the store")
        #expect(engine.takeHeld() == ["2", "3", "4"])
        #expect(engine.takeHeld() == [], "taken once")
    }
}
