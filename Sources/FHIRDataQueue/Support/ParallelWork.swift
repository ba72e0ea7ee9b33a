import Foundation

/// Runs independent CPU work on every core: the calling thread and threads of dq's own.
///
/// Not `DispatchQueue.concurrentPerform`: a `dq enqueue` of bad input that ran it aborted about once in a
/// thousand runs on a loaded machine ("tcache_thread_shutdown(): unaligned tcache chunk detected"). The core
/// dump showed a freed 64-byte block, the size of one of libdispatch's continuations, with a small integer
/// (a flags word) written into it after `free`, found when the thread that had run `concurrentPerform`
/// exited and libdispatch released that thread's continuation cache. Plain threads that touch no dispatch
/// object leave nothing behind for a thread's exit to free.
package enum ParallelWork {
    /// Calls `body` once for every index in `0..<iterations`, on up to `threads` threads at once (the caller's
    /// among them), and returns when every call has returned. Indexes are handed out in order.
    package static func forEach(
        _ iterations: Int, threads: Int = ProcessInfo.processInfo.activeProcessorCount, _ body: @escaping @Sendable (Int) -> Void
    ) {
        let helpers = min(max(threads, 1), iterations) - 1
        guard helpers > 0 else {
            for index in 0..<iterations { body(index) }
            return
        }
        let work = Work(iterations: iterations, body: body)
        for _ in 0..<helpers {
            let thread = Thread {
                work.drain()
                work.helperFinished()
            }
            thread.name = "dq-parallel"
            thread.start()
        }
        work.drain()
        work.waitForHelpers(helpers)
    }

    private final class Work: @unchecked Sendable {  // unchecked: `next` and `finished` are guarded by `condition`
        let iterations: Int
        let body: @Sendable (Int) -> Void
        private let condition = NSCondition()
        private var next = 0
        private var finished = 0

        init(iterations: Int, body: @escaping @Sendable (Int) -> Void) {
            self.iterations = iterations
            self.body = body
        }

        private func take() -> Int? {
            condition.lock()
            defer { condition.unlock() }
            guard next < iterations else { return nil }
            defer { next += 1 }
            return next
        }

        func drain() {
            while let index = take() { body(index) }
        }

        func helperFinished() {
            condition.lock()
            finished += 1
            condition.signal()
            condition.unlock()
        }

        func waitForHelpers(_ count: Int) {
            condition.lock()
            while finished < count { condition.wait() }
            condition.unlock()
        }
    }
}
