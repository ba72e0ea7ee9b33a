import NIOConcurrencyHelpers

/// A wake-up call between the tasks that enqueue and a service that waits to flush: `signal()` wakes every
/// waiter, or the next one to wait when none waits now (a signal is never lost between two waits).
final class WakeUp: Sendable {
    private struct State {
        var pending = false
        var waiters: [Int: CheckedContinuation<Void, Never>] = [:]
        var nextID = 0
    }
    private let state = NIOLockedValueBox(State())

    /// Wakes the waiters (or the next wait).
    func signal() {
        let waiters = state.withLockedValue { state -> [CheckedContinuation<Void, Never>] in
            if state.waiters.isEmpty {
                state.pending = true
                return []
            }
            defer { state.waiters.removeAll() }
            return Array(state.waiters.values)
        }
        for waiter in waiters { waiter.resume() }
    }

    /// Returns at the next signal (at once if one came since the last wait), after `timeout`, or when the task
    /// is cancelled.
    func wait(timeout: Duration) async {
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.waitForSignal() }
            group.addTask { try? await Task.sleep(for: timeout) }
            await group.next()
            group.cancelAll()
        }
    }

    private func waitForSignal() async {
        let id = state.withLockedValue { state -> Int in
            state.nextID += 1
            return state.nextID
        }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let resumeNow = state.withLockedValue { state -> Bool in
                    if state.pending || Task.isCancelled {
                        state.pending = false
                        return true
                    }
                    state.waiters[id] = continuation
                    return false
                }
                if resumeNow { continuation.resume() }
            }
        } onCancel: {
            let waiter = state.withLockedValue { $0.waiters.removeValue(forKey: id) }
            waiter?.resume()
        }
    }
}
