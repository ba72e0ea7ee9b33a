import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Group commit, the one engine behind every grouped write of dq: callers hand in inputs, and one committer at a
/// time takes whatever waits (up to ``maximumBatch``) and commits it in one transaction, so that many writers
/// share one `fsync` (or one round trip) instead of paying one each. Order is kept: inputs are committed in
/// the order they were added, and a batch's outputs go back to its inputs in that order.
///
/// Two ways to run commits:
/// - ``Committer/thread(name:commit:)``: synchronous commits on a thread of the engine's own, started on
///   demand and ended after ``idleTimeout`` without work. No thread of Swift's cooperative pool ever runs a
///   commit or waits in its `fsync` (SQLite).
/// - ``Committer/async(commit:)``: asynchronous commits (PostgreSQL, or SQLite through GRDB's writer queue). A
///   caller that finds no commit running commits its own input in its own task, with no hand-off; inputs that
///   arrive meanwhile join the next commit, run by a task of their own.
///
/// With ``stopsAtFailure``, a failed commit stops the engine: its inputs and every one added after are held,
/// unsent to the store, until ``takeHeld()`` (the journal of deliveries: what the server accepted must not be
/// dropped, and must not be recorded out of order with what failed).
final class GroupCommit<Input: Sendable, Output: Sendable>: @unchecked Sendable {  // unchecked: state guarded by `condition`
    typealias Completion = @Sendable (Result<Output, DataQueueError>) -> Void

    /// How commits run.
    enum Committer: Sendable {
        /// Synchronous commits on a thread of the engine's own (named `name`).
        case thread(name: String, commit: @Sendable ([Input]) -> Result<[Output], DataQueueError>)
        /// Asynchronous commits.
        case async(commit: @Sendable ([Input]) async -> Result<[Output], DataQueueError>)
    }

    private struct Waiter {
        let input: Input
        let completion: Completion?
        /// Names a ``submit(_:)``'s input, so that a cancelled caller can take it back while it waits.
        var ticket: UInt64? = nil
    }

    /// The largest number of inputs one commit carries.
    let maximumBatch: Int
    /// Whether a failed commit stops the engine (see the type's description).
    let stopsAtFailure: Bool
    /// How long the commit thread waits for more work before it ends.
    let idleTimeout: TimeInterval = 0.5
    /// How many times the commit thread yields, looking for more work, before it sleeps: a producer that
    /// writes one input at a time hands in its next within microseconds of being resumed, and its commit then
    /// does not wait for this thread's wake-up.
    let spinsBeforeSleep: Int
    private let committer: Committer

    private let condition = NSCondition()
    // Guarded by `condition`.
    private var waiting: [Waiter] = []
    private var running = false
    private var committing = false
    private var failure: DataQueueError?
    private var failed: [Input] = []
    private var idle: [CheckedContinuation<Void, Never>] = []
    private var commitCount = 0
    private var nextTicket: UInt64 = 0

    init(maximumBatch: Int = 512, stopsAtFailure: Bool = false, spinsBeforeSleep: Int = 0, committer: Committer) {
        self.maximumBatch = maximumBatch
        self.stopsAtFailure = stopsAtFailure
        self.spinsBeforeSleep = spinsBeforeSleep
        self.committer = committer
    }

    /// Inputs waiting for a commit (held ones included).
    var waitingCount: Int { condition.withLock { waiting.count } }

    /// Commits made so far, failed ones included (counted before their callers are resumed).
    var commits: Int { condition.withLock { commitCount } }

    /// The error that stopped the engine, if one did.
    var stoppedBy: DataQueueError? { condition.withLock { failure } }

    /// Commits `input` with the next group and returns its output once that commit is done.
    ///
    /// A caller cancelled while its input still waits takes it back: it is never committed, and the caller
    /// gets ``cancelledBeforeCommit``. Once its commit has begun, the caller waits for its outcome (the store
    /// may keep it), so that "not stored" is only said when it is true.
    nonisolated(nonsending) func submit(_ input: Input) async throws -> Output {
        if case .async(let commit) = committer, claimAlone() {
            let result = await commit([input])
            finish(alone: result, input: input)
            return try result.get()[0]
        }
        let ticket = condition.withLock {
            nextTicket += 1
            return nextTicket
        }
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Output, any Error>) in
                add(input, ticket: ticket) { result in continuation.resume(with: result.mapError { $0 as any Error }) }
            }
        } onCancel: {
            takeBack(ticket)
        }
    }

    /// What a caller cancelled before its commit began is told: nothing was stored.
    static var cancelledBeforeCommit: DataQueueError {
        DataQueueError(.transport, "the write was cancelled before its commit began; nothing was stored")
    }

    /// Removes the input of `ticket` if it still waits (not in a commit, not held after a failure), and tells
    /// its caller.
    private func takeBack(_ ticket: UInt64) {
        condition.lock()
        guard failure == nil, let index = waiting.firstIndex(where: { $0.ticket == ticket }) else {
            condition.unlock()
            return
        }
        let waiter = waiting.remove(at: index)
        let wake = takeIdleIfDone()
        condition.unlock()
        waiter.completion?(.failure(Self.cancelledBeforeCommit))
        for continuation in wake { continuation.resume() }
    }

    /// Adds `input` for the next commit without waiting; `completion` (if any) is called once it is committed
    /// or its commit failed. After the engine stopped at a failure the input is held, and `completion` is
    /// called at once with that failure.
    func add(_ input: Input, completion: Completion? = nil) {
        add(input, ticket: nil, completion: completion)
    }

    private func add(_ input: Input, ticket: UInt64?, completion: Completion?) {
        condition.lock()
        if ticket != nil && Task.isCancelled {
            // A submit cancelled before its input was added: not added at all.
            condition.unlock()
            completion?(.failure(Self.cancelledBeforeCommit))
            return
        }
        waiting.append(Waiter(input: input, completion: completion, ticket: ticket))
        if let failure {
            condition.unlock()
            completion?(.failure(failure))
            return
        }
        if running {
            condition.signal()
            condition.unlock()
            return
        }
        running = true
        condition.unlock()
        start()
    }

    /// Returns once nothing waits and no commit runs, or the engine has stopped at a failure.
    func waitUntilIdle() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            condition.lock()
            if (waiting.isEmpty && !committing) || failure != nil {
                condition.unlock()
                continuation.resume()
            } else {
                idle.append(continuation)
                condition.signal()
                condition.unlock()
            }
        }
    }

    /// After the engine stopped at a failure: the inputs of the failed commit and every one added since, in
    /// order; they are no longer the engine's (none when it has not stopped).
    func takeHeld() -> [Input] {
        condition.lock()
        defer { condition.unlock() }
        guard failure != nil else { return [] }
        defer {
            failed.removeAll()
            waiting.removeAll()
        }
        return failed + waiting.map(\.input)
    }

    // MARK: - Running commits

    private func start() {
        switch committer {
        case .thread(let name, let commit):
            let thread = Thread { [self] in runThread(commit) }
            thread.name = name
            thread.start()
        case .async(let commit):
            Task { await self.drain(commit) }
        }
    }

    /// Under the lock: the next batch to commit, marked as committing; nil when none may be committed.
    private func nextBatch() -> [Waiter]? {
        guard !waiting.isEmpty, failure == nil else { return nil }
        let batch = Array(waiting.prefix(maximumBatch))
        waiting.removeFirst(batch.count)
        committing = true
        return batch
    }

    /// Who to tell once a commit has ended, outside the lock.
    private struct Ended {
        var idle: [CheckedContinuation<Void, Never>]
        /// When the commit stopped the engine: the completions of the inputs that waited, and the error.
        var stopped: (completions: [Completion], error: DataQueueError)? = nil

        func tell() {
            for waiter in idle { waiter.resume() }
            if let stopped {
                for completion in stopped.completions { completion(.failure(stopped.error)) }
            }
        }
    }

    /// Under the lock: records a commit's end. When it stops the engine, the inputs waiting stay held and
    /// their completions are told the failure (once: they are taken off the held inputs).
    private func ended(_ inputs: @autoclosure () -> [Input], _ error: DataQueueError?) -> Ended {
        committing = false
        commitCount += 1
        var stopped: (completions: [Completion], error: DataQueueError)?
        if let error, stopsAtFailure {
            failure = error
            failed = inputs()
            stopped = (waiting.compactMap(\.completion), error)
            waiting = waiting.map { Waiter(input: $0.input, completion: nil) }
        }
        return Ended(idle: takeIdleIfDone(), stopped: stopped)
    }

    /// Under the lock: the idle waiters, when nothing waits (or the engine stopped).
    private func takeIdleIfDone() -> [CheckedContinuation<Void, Never>] {
        guard (waiting.isEmpty && !committing) || failure != nil else { return [] }
        defer { idle.removeAll() }
        return idle
    }

    /// Hands each input of `batch` its output (or the error).
    private func complete(_ batch: [Waiter], _ result: Result<[Output], DataQueueError>) {
        for (index, waiter) in batch.enumerated() {
            waiter.completion?(result.map { $0[index] })
        }
    }

    private func runThread(_ commit: @Sendable ([Input]) -> Result<[Output], DataQueueError>) {
        condition.lock()
        while true {
            if let batch = nextBatch() {
                condition.unlock()
                let result = commit(batch.map(\.input))
                condition.lock()
                let wake = ended(batch.map(\.input), result.failure)
                condition.unlock()
                complete(batch, result)
                wake.tell()
                condition.lock()
                continue
            }
            for waiter in takeIdleIfDone() { waiter.resume() }
            var spins = 0
            while waiting.isEmpty && failure == nil && spins < spinsBeforeSleep {
                condition.unlock()
                sched_yield()
                spins += 1
                condition.lock()
            }
            if !waiting.isEmpty && failure == nil { continue }
            if !condition.wait(until: Date(timeIntervalSinceNow: idleTimeout)) && (waiting.isEmpty || failure != nil) {
                running = false
                condition.unlock()
                return
            }
        }
    }

    private func drain(_ commit: @Sendable ([Input]) async -> Result<[Output], DataQueueError>) async {
        while let batch = takeBatchOrStop() {
            let result = await commit(batch.map(\.input))
            let wake = condition.withLock { ended(batch.map(\.input), result.failure) }
            complete(batch, result)
            wake.tell()
        }
    }

    /// The next batch for the async drainer, or nil after marking the engine not running.
    private func takeBatchOrStop() -> [Waiter]? {
        condition.lock()
        if let batch = nextBatch() {
            condition.unlock()
            return batch
        }
        running = false
        let wake = takeIdleIfDone()
        condition.unlock()
        for waiter in wake { waiter.resume() }
        return nil
    }

    /// Whether the caller may commit its input alone, now (nothing runs, nothing waits, not stopped).
    private func claimAlone() -> Bool {
        condition.withLock {
            guard !running && waiting.isEmpty && failure == nil else { return false }
            running = true
            committing = true
            return true
        }
    }

    /// After a commit made alone: goes on with what arrived meanwhile in a task of its own.
    private func finish(alone result: Result<[Output], DataQueueError>, input: Input) {
        condition.lock()
        let wake = ended([input], result.failure)
        let more = !waiting.isEmpty && failure == nil
        if !more { running = false }
        condition.unlock()
        wake.tell()
        if more, case .async(let commit) = committer { Task { await self.drain(commit) } }
    }
}

extension Result {
    /// The error of a failure, nil for a success.
    fileprivate var failure: Failure? {
        if case .failure(let error) = self { return error }
        return nil
    }
}
