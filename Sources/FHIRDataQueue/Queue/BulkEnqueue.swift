import Foundation

/// The reference rules of one enqueue of several items: a `fullUrl` is declared once, is not already used by
/// a queued or delivered item, and every `urn:uuid` reference names a `fullUrl` declared by an earlier item
/// of the enqueue or by a queued or delivered one. Items are added in input order.
struct ReferenceCheck {
    private var declaredHere: Set<String> = []
    private var declared: [(index: Int, fullURL: String)] = []
    private var unknown: [(index: Int, fullURL: String)] = []
    private var declaredTwice: [(index: Int, fullURL: String)] = []
    /// How many items were added.
    private(set) var added = 0

    /// Adds the item at input position `index` (0-based).
    mutating func add(_ item: NewItem, index: Int) {
        added += 1
        if let fullURL = item.fullURL {
            if !declaredHere.insert(fullURL).inserted { declaredTwice.append((index, fullURL)) }
            declared.append((index, fullURL))
        }
        for reference in item.references where !declaredHere.contains(reference) {
            unknown.append((index, reference))
        }
    }

    /// The fullUrls to look up among queued and delivered items.
    var lookups: Set<String> { Set(declared.map(\.fullURL)).union(unknown.map(\.fullURL)) }

    /// Refuses a fullUrl declared twice in the enqueue.
    func refuseDeclaredTwice() throws {
        if let twice = declaredTwice.first {
            throw DataQueueError(.invalidResource, "input \(twice.index + 1): fullUrl \(twice.fullURL) is declared twice")
        }
    }

    /// Refuses a declared fullUrl that `existing` (the looked-up ones queued or delivered) already holds, and a
    /// reference that neither an earlier item nor `existing` declares.
    func refuse(existing: Set<String>) throws {
        if let reused = declared.first(where: { existing.contains($0.fullURL) }) {
            throw DataQueueError(
                .invalidResource, "input \(reused.index + 1): fullUrl \(reused.fullURL) is already used by a queued or delivered item")
        }
        if let missing = unknown.first(where: { !existing.contains($0.fullURL) }) {
            throw DataQueueError(
                .invalidResource,
                "input \(missing.index + 1): references \(missing.fullURL), which no earlier item declares as its fullUrl")
        }
    }
}

/// The inputs of a bulk enqueue that could not be queued, each by its position: nothing was queued.
public struct EnqueueProblems: Error, Sendable {
    /// Every bad input, in input order: its position (0-based) and why.
    public var problems: [(index: Int, error: DataQueueError)]
}

extension DataQueue {
    /// Durably queues `count` entries that `entry` makes, in one transaction: all of them or, on any error,
    /// none. Made for bulk input (`dq enqueue --ndjson`): the entries are made on every core, a chunk at a
    /// time, while the chunks before are being written, so checking the input overlaps with storing it.
    ///
    /// References between entries follow ``enqueue(_:)->[QueuedItem]``.
    ///
    /// - Parameters:
    ///   - count: how many entries.
    ///   - entry: makes the entry at `index` (0-based) or throws a ``DataQueueError`` saying why that input is
    ///     bad. It is called from several threads at once, once for each index.
    ///   - progress: told, a chunk at a time, how many entries have been made and handed to the store so far
    ///     (they are committed together at the end). For a progress display; called from the store's writer.
    /// - Returns: the queued items, in input order.
    /// - Throws: ``EnqueueProblems`` naming every input that `entry` refused or this queue cannot take (all of
    ///   them are tried first); else a ``DataQueueError`` (a reference no item declares, storage).
    @discardableResult
    public func enqueue(
        count: Int, entry: @escaping @Sendable (Int) throws -> QueueEntry, progress: (@Sendable (Int) -> Void)? = nil
    ) async throws -> [QueuedItem] {
        guard count > 0 else { return [] }
        // Sealing (in a sealed queue) is done here, on every core, rather than on the writer's thread.
        let preparation = try await store.preparation()
        let maker = ChunkMaker(count: count, chunkSize: 4096) { [self] index in
            do {
                let made = try entry(index)
                let item = try newItem(for: made.resource, method: made.method, fullURL: made.fullURL)
                guard let preparation else { return .success(MadeItem(stored: item, described: nil)) }
                return .success(MadeItem(stored: preparation.prepare(item), described: DescribedItem(item)))
            } catch let error as DataQueueError {
                return .failure(error)
            } catch {
                return .failure(DataQueueError(.invalidResource, "\(error)"))
            }
        }
        maker.start()
        let sequences: [Int64]
        var chunks: [[MadeItem]] = []
        do {
            // Each chunk is stored as it is made (where the store can); the chunks are kept to describe the items.
            let kept = ChunksKept()
            sequences = try await store.insert(chunks: maker.chunks) { chunk in
                guard let made = maker.take(chunk) else { return nil }
                let items = kept.append(made)
                progress?(items)
                return made.map(\.stored)
            }
            chunks = kept.chunks
        } catch {
            maker.stopUnlessBad()
            // The maker may still be checking the rest of the input (to name every bad one): waited for on a
            // thread of its own, not one of the cooperative pool's few.
            let problems = try await OwnThread.run("dq-bulk-finish") { maker.finish() }
            if !problems.isEmpty { throw EnqueueProblems(problems: problems) }
            if let preparation, let error = error as? DataQueueError { throw preparation.explain(error) }
            throw error
        }
        metrics.enqueued.increment(by: sequences.count)
        wakeUp.signal()
        let now = Date()
        var queued: [QueuedItem] = []
        queued.reserveCapacity(sequences.count)
        for (made, sequence) in zip(chunks.joined(), sequences) {
            if let described = made.described {
                queued.append(queuedItem(described.item, sequence: sequence, at: now, size: described.size))
            } else {
                queued.append(queuedItem(made.stored, sequence: sequence, at: now))
            }
        }
        return queued
    }
}

/// An item of a bulk enqueue: as it is stored, and (when that is not as it was made: sealed) what its caller
/// is told of it.
private struct MadeItem: Sendable {
    var stored: NewItem
    var described: DescribedItem?
}

/// An item as made, without its body (which is kept only in its stored, sealed form), and the body's size.
private struct DescribedItem: Sendable {
    var item: NewItem
    var size: Int

    init(_ item: NewItem) {
        size = item.body.count
        self.item = item
        self.item.request.body = Data()
    }
}

/// The chunks a pipelined enqueue inserted, collected on the writer's thread and read after its transaction.
private final class ChunksKept: @unchecked Sendable {  // unchecked: one writer thread, read after it has finished
    // Written only by the writer's closure, which runs on one thread at a time; read after it returned.
    private(set) var chunks: [[MadeItem]] = []
    private var items = 0

    /// Keeps `chunk`; returns how many items are kept now.
    func append(_ chunk: [MadeItem]) -> Int {
        chunks.append(chunk)
        items += chunk.count
        return items
    }
}

/// Makes the items of a bulk enqueue, chunk after chunk in input order, each chunk on every core, on a thread
/// of its own; a consumer takes the chunks in order as they are ready. After the first bad input it only looks
/// for more bad inputs, so that all of them are named.
private final class ChunkMaker: @unchecked Sendable {  // unchecked: mutable state guarded by `condition`
    let count: Int
    let chunkSize: Int
    var chunks: Int { (count + chunkSize - 1) / chunkSize }
    private let make: @Sendable (Int) -> Result<MadeItem, DataQueueError>
    // Guarded by `condition`.
    private let condition = NSCondition()
    private var ready: [Int: [MadeItem]] = [:]
    private var madeChunks = 0
    private var problems: [(index: Int, error: DataQueueError)] = []
    private var stopped = false
    private var done = false

    init(count: Int, chunkSize: Int, make: @escaping @Sendable (Int) -> Result<MadeItem, DataQueueError>) {
        self.count = count
        self.chunkSize = chunkSize
        self.make = make
    }

    func start() {
        let thread = Thread { [self] in run() }
        thread.name = "dq-enqueue-maker"
        thread.start()
    }

    private func run() {
        let workers = max(1, ProcessInfo.processInfo.activeProcessorCount)
        for chunk in 0..<chunks {
            condition.lock()
            let stop = stopped
            condition.unlock()
            if stop { break }
            let range = chunk * chunkSize..<min(count, (chunk + 1) * chunkSize)
            let slots = Slots(count: range.count)
            // Many small pieces, not one a worker: a worker the store's writer thread preempts (they share the
            // cores) leaves its rest to the others instead of holding up the chunk (sealed bulk enqueue of 100,000:
            // 1.38 s -> 1.30 s, plain within noise, in turns on this 2-core machine).
            let pieces = ChunkPieces.pieces(of: range.count, workers: workers * 16)
            ParallelWork.forEach(pieces.count, threads: workers) { [make] piece in
                for offset in pieces[piece] { slots.set(offset, make(range.lowerBound + offset)) }
            }
            let results = slots.collect()
            condition.lock()
            var items: [MadeItem] = []
            if problems.isEmpty { items.reserveCapacity(range.count) }
            for (offset, result) in results.enumerated() {
                switch result {
                case .success(let item): if problems.isEmpty { items.append(item) }
                case .failure(let error): problems.append((range.lowerBound + offset, error))
                }
            }
            ready[chunk] = problems.isEmpty ? items : nil
            madeChunks = chunk + 1
            condition.broadcast()
            condition.unlock()
        }
        condition.lock()
        done = true
        condition.broadcast()
        condition.unlock()
    }

    /// Chunk `chunk`'s items once made; nil when an input so far was bad (or the maker was stopped).
    func take(_ chunk: Int) -> [MadeItem]? {
        condition.lock()
        defer { condition.unlock() }
        while madeChunks <= chunk && !done { condition.wait() }
        guard problems.isEmpty, let items = ready.removeValue(forKey: chunk) else { return nil }
        return items
    }

    /// Stops making chunks unless an input was found bad (then the rest is still checked, to name every bad one).
    func stopUnlessBad() {
        condition.lock()
        if problems.isEmpty { stopped = true }
        condition.unlock()
    }

    /// Waits until the maker is done; every bad input found, in input order.
    func finish() -> [(index: Int, error: DataQueueError)] {
        condition.lock()
        defer { condition.unlock() }
        while !done { condition.wait() }
        ready = [:]
        return problems
    }

    /// One slot per input of a chunk, each written by one worker (disjoint offsets) and read after all of them
    /// finished: the reason the `@unchecked Sendable` is sound.
    private final class Slots: @unchecked Sendable {
        private let slots: UnsafeMutableBufferPointer<Result<MadeItem, DataQueueError>?>
        init(count: Int) {
            slots = .allocate(capacity: count)
            slots.initialize(repeating: nil)
        }
        deinit {
            slots.deinitialize()
            slots.deallocate()
        }
        func set(_ offset: Int, _ value: Result<MadeItem, DataQueueError>) { slots[offset] = value }
        func collect() -> [Result<MadeItem, DataQueueError>] { slots.map { $0! } }
    }
}

/// How a chunk is shared among the workers that make its items.
enum ChunkPieces {
    /// `0..<count` cut into at most `workers` consecutive, non-empty pieces of nearly equal size: one for each
    /// worker that has something to do (a chunk of 1 item on 3 cores is 1 piece, not 3 of which 2 are empty).
    static func pieces(of count: Int, workers: Int) -> [Range<Int>] {
        guard count > 0 else { return [] }
        let part = (count + max(1, workers) - 1) / max(1, workers)
        return stride(from: 0, to: count, by: part).map { $0..<min(count, $0 + part) }
    }
}
