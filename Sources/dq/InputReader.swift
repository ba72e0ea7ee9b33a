import ArgumentParser
import FHIRDataQueue
import Foundation

/// Reads and validates resources from files, `-` (standard input) and NDJSON.
///
/// Every input is checked before anything is queued, so that a run either queues all or names each
/// bad input and queues none.
struct InputReader {
    var maximumSize: Int
    var ndjson: Bool

    struct Input {
        var label: String
        var entry: QueueEntry
        var resource: FHIRResource { entry.resource }
    }

    /// Every input's resources and every problem, and whether an input file could not be read at all.
    func read(_ paths: [String]) -> (inputs: [Input], problems: [String], unreadable: Bool) {
        let (documents, loadProblems, unreadable) = documents(paths)
        var inputs: [Input] = []
        var problems = loadProblems
        let results = Self.validateConcurrently(documents.map(\.data), maximumSize: maximumSize)
        for (index, result) in results.enumerated() {
            switch result {
            case .success(let entry): inputs.append(Input(label: documents[index].label, entry: entry))
            case .failure(let problem): problems.append("\(documents[index].label): \(problem.message)")
            }
        }
        return (inputs, problems, unreadable)
    }

    /// One input document: a whole file, or one line of an NDJSON file (a view into the file's bytes).
    struct Document {
        /// The file's label (`<stdin>` for `-`).
        var file: String
        /// The 1-based line number in an NDJSON file.
        var line: Int?
        var data: Data
        /// How errors name it: the file, and its line in NDJSON.
        var label: String { line.map { "\(file):\($0)" } ?? file }
    }

    /// Every input document, unchecked: a file is one document, an NDJSON file one per non-blank line,
    /// labelled with its line number. Also every file that could not be read, and whether one could not be
    /// read at all.
    func documents(_ paths: [String]) -> (documents: [Document], problems: [String], unreadable: Bool) {
        var documents: [Document] = []
        var problems: [String] = []
        var unreadable = false
        for path in paths {
            let label = path == "-" ? "<stdin>" : path
            let data: Data
            do {
                data = try load(path)
            } catch let error as Unreadable {
                problems.append("\(label): \(error.reason)")
                unreadable = true
                continue
            } catch let error as DataQueueError {
                problems.append("\(label): \(error.message)")
                continue
            } catch {
                problems.append("\(label): cannot be read")
                unreadable = true
                continue
            }
            if ndjson {
                // Slices share the file's bytes: no copy per line.
                for (number, range) in Self.lines(of: data) {
                    documents.append(Document(file: label, line: number, data: data[range]))
                }
            } else {
                documents.append(Document(file: label, data: data))
            }
        }
        return (documents, problems, unreadable)
    }

    /// An input that could not be read (exit 66, EX_NOINPUT), as distinct from one that was read and is bad.
    struct Unreadable: Error {
        var reason: String
    }

    /// The non-blank lines of `data` with their 1-based numbers, as ranges of `data`'s indices without the
    /// line ends (LF or CRLF).
    static func lines(of data: Data) -> [(Int, Range<Data.Index>)] {
        data.withUnsafeBytes { (raw: UnsafeRawBufferPointer) -> [(Int, Range<Data.Index>)] in
            guard let base = raw.baseAddress else { return [] }
            var lines: [(Int, Range<Data.Index>)] = []
            var start = 0
            var number = 0
            while start < raw.count {
                number += 1
                let end: Int
                if let found = memchr(base + start, 0x0A, raw.count - start) {
                    end = base.distance(to: UnsafeRawPointer(found))
                } else {
                    end = raw.count
                }
                var stop = end
                if stop > start, raw[stop - 1] == 0x0D { stop -= 1 }
                var blank = true
                for index in start..<stop where raw[index] != 0x20 && raw[index] != 0x09 {
                    blank = false
                    break
                }
                if !blank { lines.append((number, (data.startIndex + start)..<(data.startIndex + stop))) }
                start = end + 1
            }
            return lines
        }
    }

    /// Validates `documents` on every core (validation is pure CPU work and the documents are independent);
    /// the results keep the input order.
    static func validateConcurrently(_ documents: [Data], maximumSize: Int) -> [Result<QueueEntry, DataQueueError>] {
        let results = ResultSlots(count: documents.count)
        defer { results.deallocate() }
        let chunk = 1024
        ParallelWork.forEach((documents.count + chunk - 1) / chunk) { part in
            for index in part * chunk..<min(documents.count, (part + 1) * chunk) {
                do {
                    results.set(index, .success(try QueueEntry(json: documents[index], maximumSize: maximumSize)))
                } catch let error as DataQueueError {
                    results.set(index, .failure(error))
                } catch {
                    results.set(index, .failure(DataQueueError(.invalidResource, "\(error)")))
                }
            }
        }
        return results.collect()
    }

    private func load(_ path: String) throws -> Data {
        let fileLimit = ndjson ? Int.max : maximumSize
        if path == "-" { return try readAll(FileHandle.standardInput, limit: fileLimit) }
        var isDirectory: ObjCBool = false
        guard FileManager.default.fileExists(atPath: path, isDirectory: &isDirectory) else {
            throw Unreadable(reason: "no such file")
        }
        if isDirectory.boolValue { throw Unreadable(reason: "is a directory, not a file") }
        guard FileManager.default.isReadableFile(atPath: path) else {
            throw Unreadable(reason: "permission denied")
        }
        let attributes = try? FileManager.default.attributesOfItem(atPath: path)
        var expected: Int?
        if attributes?[.type] as? FileAttributeType == .typeRegular, let size = (attributes?[.size] as? NSNumber)?.intValue {
            if size > fileLimit {
                throw DataQueueError(.invalidResource, "file is \(size) bytes, over the limit of \(maximumSize) bytes")
            }
            expected = size
        }
        // Read as a stream: a pipe or process substitution (`<(cat p.json)`, /dev/fd/63) has no size. Opened
        // without waiting: a named pipe nobody writes to would block open(2) for ever; opened so, it reads as empty
        // (its end) and is refused as such.
        let isPipe = isFIFO(path)
        let fd = open(path, O_RDONLY | O_CLOEXEC | (isPipe ? O_NONBLOCK : 0))
        guard fd >= 0 else { throw Unreadable(reason: "cannot be read") }
        if isPipe { _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) }
        let handle = FileHandle(fileDescriptor: fd, closeOnDealloc: true)
        let data = try readAll(handle, limit: fileLimit, expected: expected)
        if isPipe && data.isEmpty { throw Unreadable(reason: "is a named pipe with nothing written to it (no writer had it open)") }
        return data
    }

    /// Whether `path` is a FIFO (a named pipe, or the pipe of a process substitution).
    private func isFIFO(_ path: String) -> Bool {
        var info = stat()
        return stat(path, &info) == 0 && (info.st_mode & S_IFMT) == S_IFIFO
    }

    /// Reads to the end, refusing more than `limit` bytes; `expected` (a regular file's size) saves growing
    /// the buffer as it fills.
    private func readAll(_ handle: FileHandle, limit: Int, expected: Int? = nil) throws -> Data {
        var data = Data()
        if let expected, expected <= limit { data.reserveCapacity(expected + 1) }
        do {
            while let chunk = try handle.read(upToCount: 1 << 20), !chunk.isEmpty {
                data.append(chunk)
                if data.count > limit {
                    throw DataQueueError(.invalidResource, "input is over the limit of \(maximumSize) bytes")
                }
            }
        } catch let error as DataQueueError {
            throw error
        } catch {
            throw Unreadable(reason: "cannot be read")
        }
        return data
    }
}

/// How `dq enqueue` and `dq send` choose the HTTP method.
enum MethodChoice: String, ExpressibleByArgument, CaseIterable {
    case auto, post = "POST", put = "PUT"

    init?(argument: String) {
        switch argument.lowercased() {
        case "auto": self = .auto
        case "post": self = .post
        case "put": self = .put
        default: return nil
        }
    }

    /// `auto` asks the queue (``DataQueue/defaultMethod(for:)``): PUT for a resource with an id and POST
    /// otherwise (as C3-PRO did), POST for Bundles and for what an encrypted queue encrypts.
    func method(for entry: QueueEntry, queue: DataQueue) -> FHIRMethod {
        switch self {
        case .post: return .post
        case .put: return .put
        case .auto: return entry.declaredMethod ?? queue.defaultMethod(for: entry.resource)
        }
    }
}

/// One slot per input, written by exactly one concurrent worker each (disjoint indices), read after all
/// workers finished: the reason the `@unchecked Sendable` is sound.
private final class ResultSlots: @unchecked Sendable {
    private let slots: UnsafeMutableBufferPointer<Result<QueueEntry, DataQueueError>?>

    init(count: Int) {
        slots = .allocate(capacity: count)
        slots.initialize(repeating: nil)
    }

    func set(_ index: Int, _ value: Result<QueueEntry, DataQueueError>) { slots[index] = value }

    func collect() -> [Result<QueueEntry, DataQueueError>] { slots.map { $0! } }

    func deallocate() {
        slots.deinitialize()
        slots.deallocate()
    }
}
