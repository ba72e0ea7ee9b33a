import Foundation
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// ``ParallelWork``, which replaced `DispatchQueue.concurrentPerform` for dq's parsing on every core.
@Suite("Parallel work")
struct ParallelWorkTests {
    @Test("Every index is run exactly once, on more than one thread, and all have run when it returns", arguments: [1, 2, 7, 1000])
    func everyIndexOnce(iterations: Int) {
        let seen = NIOLockedValueBox<[Int]>([])
        let threads = NIOLockedValueBox<Set<pthread_t>>([])
        ParallelWork.forEach(iterations, threads: 4) { index in
            threads.withLockedValue { _ = $0.insert(pthread_self()) }
            seen.withLockedValue { $0.append(index) }
            // The first index waits until another has run: on a helper thread, since this one is busy here.
            if iterations > 1 && index == 0 {
                let deadline = Date().addingTimeInterval(60)
                while seen.withLockedValue({ $0.count }) < 2 && Date() < deadline { usleep(1_000) }
            }
        }
        let indexes = seen.withLockedValue { $0 }
        #expect(indexes.count == iterations)
        #expect(indexes.sorted() == Array(0..<iterations))
        #expect(threads.withLockedValue { $0.count } <= min(iterations, 4))
        if iterations > 1 {
            #expect(threads.withLockedValue { $0.count } >= 2, "the work was shared")
        }
    }
}
