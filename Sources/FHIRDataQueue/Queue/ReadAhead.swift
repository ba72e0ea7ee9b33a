import NIOConcurrencyHelpers

/// Batches read and made ready ahead of a flush, in order: a task fetches the batch after the last one it fetched
/// (and opens its envelopes) while the flush sends what it took before, and keeps up to `depth` batches ready.
///
/// One batch ahead is not enough when opening is the slower side: the opening's cores would stand idle from the
/// moment that batch is ready until the flush takes it, and the flush would then wait for the next. With two, the
/// opening runs on while a request is on the wire, and the flush finds a batch ready.
///
/// The task ends after a batch that is empty, that holds no envelope (nothing to do ahead for the next), that
/// reaches `through`, or that failed (the failure is what ``next()`` returns), and when cancelled.
final class ReadAhead<Batch: Sendable>: Sendable {
    private struct State {
        var ready: [Result<Batch, any Error>] = []
        /// No batch follows the ready ones.
        var ended = false
        var consumer: CheckedContinuation<Result<Batch, any Error>?, Never>?
        var producer: CheckedContinuation<Void, Never>?
        var task: Task<Void, Never>?
    }

    private let state = NIOLockedValueBox(State())
    private let depth: Int

    /// Starts fetching at once: `fetch(after)` reads the batch after `after`; `continuation(batch)` says where the
    /// next one starts (nil: none follows, the task ends).
    init(
        after: Int64, depth: Int, fetch: @escaping @Sendable (Int64) async throws -> Batch,
        continuation: @escaping @Sendable (Batch) -> Int64?
    ) {
        self.depth = max(depth, 1)
        let task = Task { [self] in
            var after = after
            while true {
                guard await room() else { return }
                let result: Result<Batch, any Error>
                do {
                    result = .success(try await fetch(after))
                } catch {
                    result = .failure(error)
                }
                let next = (try? result.get()).flatMap(continuation)
                deliver(result, last: next == nil)
                guard let next else { return }
                after = next
            }
        }
        state.withLockedValue { $0.task = task }
    }

    /// The next batch, in order, once it is ready; nil when none follows (the task ended or was cancelled).
    func next() async -> Result<Batch, any Error>? {
        await withCheckedContinuation { (continuation: CheckedContinuation<Result<Batch, any Error>?, Never>) in
            let (taken, producer): (Result<Batch, any Error>??, CheckedContinuation<Void, Never>?) = state.withLockedValue { state in
                if !state.ready.isEmpty {
                    let batch = state.ready.removeFirst()
                    defer { state.producer = nil }
                    return (.some(batch), state.producer)
                }
                if state.ended { return (.some(nil), nil) }
                precondition(state.consumer == nil, "one consumer at a time")
                state.consumer = continuation
                return (nil, nil)
            }
            producer?.resume()
            if let taken { continuation.resume(returning: taken) }
        }
    }

    /// Stops the task (a batch being fetched is finished and dropped); ``next()`` returns nil from now on.
    func cancel() {
        let (producer, consumer, task) = state.withLockedValue { state in
            state.ended = true
            state.ready = []
            defer {
                state.producer = nil
                state.consumer = nil
            }
            return (state.producer, state.consumer, state.task)
        }
        task?.cancel()
        producer?.resume()
        consumer?.resume(returning: nil)
    }

    /// Waits until fewer than `depth` batches are ready; false when cancelled.
    private func room() async -> Bool {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let wait = state.withLockedValue { state in
                guard !state.ended, state.ready.count >= depth else { return false }
                state.producer = continuation
                return true
            }
            if !wait { continuation.resume() }
        }
        return state.withLockedValue { !$0.ended }
    }

    private func deliver(_ result: Result<Batch, any Error>, last: Bool) {
        let consumer: CheckedContinuation<Result<Batch, any Error>?, Never>? = state.withLockedValue { state in
            guard !state.ended else { return nil }
            state.ended = last
            if let consumer = state.consumer {
                state.consumer = nil
                return consumer
            }
            state.ready.append(result)
            return nil
        }
        consumer?.resume(returning: result)
    }
}
