import Foundation

/// A validating JSON scanner (RFC 8259) that builds no objects.
///
/// It checks a whole document in one pass with an explicit stack (no recursion, so deep nesting cannot
/// overflow a thread's stack) and records where the top-level object's members' values lie, so a caller
/// can decode just the few members it needs. Memory stays proportional to the nesting depth, not to the
/// document: a 50 MB Bundle is validated without building 50 MB of objects.
struct JSONScanner {
    /// The deepest nesting accepted. FHIR resources are far shallower.
    static let maximumDepth = 512
    /// The longest number accepted, in characters. FHIR decimals carry at most 18 significant digits; RFC 8259
    /// lets a parser limit the range and precision of numbers, and receivers differ wildly beyond that.
    static let maximumNumberLength = 64

    enum Failure: Error, Equatable {
        case invalid
        case tooDeep
        /// A number longer than ``maximumNumberLength`` or outside the range of a double (such as `1e999`).
        case numberOutOfRange
        /// The top-level object names a member twice (receivers differ on which one counts).
        case duplicateKey(String)
        /// A `\uD800`-`\uDFFF` escape without its pair: no Unicode text, so no receiver can store it.
        case loneSurrogate
    }

    /// The result of a scan.
    struct Document {
        /// Whether the top-level value is an object.
        var isObject: Bool
        /// Byte ranges of the top-level members' values, by key (escapes in keys decoded).
        var members: [String: Range<Int>]
        /// Byte ranges of the elements when the top-level value is an array.
        var elements: [Range<Int>] = []
        /// How many members the top-level object has (named in the keys or not).
        var memberCount = 0
    }

    /// Scans `bytes`, recording the value ranges of the top-level members named in `keys`.
    static func scan(_ bytes: UnsafeBufferPointer<UInt8>, keys: Set<String>) throws(Failure) -> Document {
        var scanner = Scanner(bytes: bytes, keys: keys)
        return try scanner.run()
    }

    /// Decodes the contents of a JSON string (between its quotes) that the scanner has validated.
    static func unescape(_ raw: UnsafeBufferPointer<UInt8>) -> String? {
        var quoted = [UInt8]()
        quoted.reserveCapacity(raw.count + 2)
        quoted.append(UInt8(ascii: "\""))
        quoted.append(contentsOf: raw)
        quoted.append(UInt8(ascii: "\""))
        return (try? JSONSerialization.jsonObject(with: Data(quoted), options: [.fragmentsAllowed])) as? String
    }

    /// Decodes the JSON string value at `range` of `data`, or nil when it is not a string.
    static func string(in data: Data, _ range: Range<Int>) -> String? {
        let start = data.startIndex + range.lowerBound
        let end = data.startIndex + range.upperBound
        guard range.count >= 2, data[start] == UInt8(ascii: "\""), data[end - 1] == UInt8(ascii: "\"") else { return nil }
        let inner = data[(start + 1)..<(end - 1)]
        // Through the bytes, not Data's iterator (a call per byte: a tenth of an envelope's ingest).
        return inner.withUnsafeBytes { raw -> String? in
            let bytes = raw.bindMemory(to: UInt8.self)
            guard bytes.count > 0, memchr(bytes.baseAddress!, Int32(UInt8(ascii: "\\")), bytes.count) != nil else {
                return String(decoding: bytes, as: UTF8.self)
            }
            return unescapeSolidus(bytes) ?? unescape(bytes)
        }
    }

    /// The string whose only escapes are `\/` (Apple's JSONSerialization writes every `/` of base64 so), or nil.
    static func unescapeSolidus(_ inner: UnsafeBufferPointer<UInt8>) -> String? {
        var bytes: [UInt8] = []
        bytes.reserveCapacity(inner.count)
        var escaped = false
        for byte in inner {
            if escaped {
                guard byte == UInt8(ascii: "/") else { return nil }
                bytes.append(byte)
                escaped = false
            } else if byte == UInt8(ascii: "\\") {
                escaped = true
            } else {
                bytes.append(byte)
            }
        }
        return escaped ? nil : String(decoding: bytes, as: UTF8.self)
    }

    /// Scans the part of `data` at `range` (a value inside a validated document) as a document of its own.
    static func scan(_ data: Data, _ range: Range<Int>, keys: Set<String>) throws(Failure) -> Document {
        let slice = data[(data.startIndex + range.lowerBound)..<(data.startIndex + range.upperBound)]
        let result: Result<Document, Failure> = slice.withUnsafeBytes { raw in
            Result { () throws(Failure) -> Document in try scan(raw.bindMemory(to: UInt8.self), keys: keys) }
        }
        var document = try result.get()
        // Ranges relative to `data`, not to the slice.
        document.members = document.members.mapValues { ($0.lowerBound + range.lowerBound)..<($0.upperBound + range.lowerBound) }
        document.elements = document.elements.map { ($0.lowerBound + range.lowerBound)..<($0.upperBound + range.lowerBound) }
        return document
    }

    private struct Scanner {
        let bytes: UnsafeBufferPointer<UInt8>
        let keys: Set<String>
        var index = 0
        var stack: [UInt8] = []  // "{" or "["
        var members: [String: Range<Int>] = [:]
        var elements: [Range<Int>] = []
        /// The top-level keys seen, to refuse a repeated one: where they lie while all are few and written
        /// without escapes (compared byte for byte, no String made); past that, a set of the decoded keys'
        /// bytes. Keys are the same when their code points are (as JSON parsers compare them), not when they
        /// are canonically equivalent.
        var seenRanges: [Range<Int>] = []
        var seenKeys: Set<[UInt8]>?
        var currentKey: String?
        var valueStart = 0

        init(bytes: UnsafeBufferPointer<UInt8>, keys: Set<String>) {
            self.bytes = bytes
            self.keys = keys
        }

        mutating func skipWhitespace() {
            while index < bytes.count {
                switch bytes[index] {
                case 0x20, 0x09, 0x0A, 0x0D: index += 1
                default: return
                }
            }
        }

        mutating func run() throws(Failure) -> Document {
            skipWhitespace()
            guard index < bytes.count else { throw .invalid }
            let isObject = bytes[index] == UInt8(ascii: "{")
            try value()
            skipWhitespace()
            guard index == bytes.count, stack.isEmpty else { throw .invalid }
            return Document(
                isObject: isObject, members: members, elements: elements, memberCount: seenKeys?.count ?? seenRanges.count)
        }

        /// Parses the value that starts here, with every value nested in it, without recursion.
        mutating func value() throws(Failure) {
            var expectValue = true
            repeat {
                skipWhitespace()
                guard index < bytes.count else { throw .invalid }
                if expectValue {
                    if stack.count == 1 { valueStart = index }
                    let c = bytes[index]
                    switch c {
                    case UInt8(ascii: "{"), UInt8(ascii: "["):
                        guard stack.count < JSONScanner.maximumDepth else { throw .tooDeep }
                        stack.append(c)
                        index += 1
                        skipWhitespace()
                        guard index < bytes.count else { throw .invalid }
                        let close = c == UInt8(ascii: "{") ? UInt8(ascii: "}") : UInt8(ascii: "]")
                        if bytes[index] == close {
                            index += 1
                            stack.removeLast()
                            expectValue = false
                            finishedValue()
                        } else if c == UInt8(ascii: "{") {
                            try key()
                        }
                    case UInt8(ascii: "\""):
                        try string()
                        expectValue = false
                        finishedValue()
                    case UInt8(ascii: "t"):
                        try literal("true")
                        expectValue = false
                        finishedValue()
                    case UInt8(ascii: "f"):
                        try literal("false")
                        expectValue = false
                        finishedValue()
                    case UInt8(ascii: "n"):
                        try literal("null")
                        expectValue = false
                        finishedValue()
                    default:
                        try number()
                        expectValue = false
                        finishedValue()
                    }
                } else {
                    // After a value inside a container: "," or the closing bracket.
                    guard let top = stack.last else { throw .invalid }
                    let c = bytes[index]
                    index += 1
                    if c == UInt8(ascii: ",") {
                        if top == UInt8(ascii: "{") { try key() }
                        expectValue = true
                    } else if (top == UInt8(ascii: "{") && c == UInt8(ascii: "}"))
                        || (top == UInt8(ascii: "[") && c == UInt8(ascii: "]"))
                    {
                        stack.removeLast()
                        finishedValue()
                    } else {
                        throw .invalid
                    }
                }
            } while expectValue || !stack.isEmpty
        }

        /// Records the range of a top-level member's value (or array element) that just ended.
        mutating func finishedValue() {
            guard stack.count == 1 else { return }
            if stack[0] == UInt8(ascii: "{") {
                if let key = currentKey {
                    members[key] = valueStart..<index
                    currentKey = nil
                }
            } else {
                elements.append(valueStart..<index)
            }
        }

        /// Reads `"key" :` inside an object; remembers the key at the top level.
        mutating func key() throws(Failure) {
            skipWhitespace()
            guard index < bytes.count, bytes[index] == UInt8(ascii: "\"") else { throw .invalid }
            let start = index + 1
            let escaped = try string()
            if stack.count == 1 { try topLevelKey(start..<(index - 1), escaped: escaped) }
            skipWhitespace()
            guard index < bytes.count, bytes[index] == UInt8(ascii: ":") else { throw .invalid }
            index += 1
        }

        /// How many keys are compared byte for byte before a set of them is built.
        static let linearKeyLimit = 32

        /// Refuses a repeated top-level key and remembers where the value of a wanted one starts.
        mutating func topLevelKey(_ range: Range<Int>, escaped: Bool) throws(Failure) {
            let raw = UnsafeBufferPointer(rebasing: bytes[range])
            if !escaped && seenKeys == nil && seenRanges.count < Self.linearKeyLimit {
                for seen in seenRanges where seen.count == raw.count {
                    if raw.isEmpty || memcmp(bytes.baseAddress! + seen.lowerBound, raw.baseAddress!, raw.count) == 0 {
                        throw .duplicateKey(String(decoding: raw, as: UTF8.self))
                    }
                }
                seenRanges.append(range)
                currentKey = nil
                for key in keys where key.utf8.count == raw.count {
                    if key.utf8.elementsEqual(raw) { currentKey = key }
                }
                return
            }
            // A key written with escapes (`"resource\u0054ype"`) is the same key to every receiver.
            guard let name = escaped ? JSONScanner.unescape(raw) : String(decoding: raw, as: UTF8.self) else {
                throw .invalid
            }
            if seenKeys == nil { seenKeys = Set(seenRanges.map { Array(bytes[$0]) }) }
            guard seenKeys!.insert(Array(name.utf8)).inserted else { throw .duplicateKey(name) }
            currentKey = keys.contains(name) ? name : nil
        }

        /// Reads a string; returns whether it held an escape.
        @discardableResult
        mutating func string() throws(Failure) -> Bool {
            index += 1  // opening quote
            var escaped = false
            while index < bytes.count {
                let c = bytes[index]
                if c == UInt8(ascii: "\"") {
                    index += 1
                    return escaped
                }
                if c < 0x20 { throw .invalid }
                if c == UInt8(ascii: "\\") {
                    escaped = true
                    index += 1
                    guard index < bytes.count else { throw .invalid }
                    switch bytes[index] {
                    case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"), UInt8(ascii: "b"), UInt8(ascii: "f"),
                        UInt8(ascii: "n"), UInt8(ascii: "r"), UInt8(ascii: "t"):
                        index += 1
                    case UInt8(ascii: "u"):
                        let unit = try hexUnit(at: index + 1)
                        index += 5
                        if (0xDC00...0xDFFF).contains(unit) { throw .loneSurrogate }
                        if (0xD800...0xDBFF).contains(unit) {
                            // A high surrogate must be followed by `\u` and a low one.
                            guard index + 1 < bytes.count, bytes[index] == UInt8(ascii: "\\"), bytes[index + 1] == UInt8(ascii: "u"),
                                (0xDC00...0xDFFF).contains(try hexUnit(at: index + 2))
                            else { throw .loneSurrogate }
                            index += 6
                        }
                    default:
                        throw .invalid
                    }
                    continue
                }
                index += 1
            }
            throw .invalid
        }

        /// The UTF-16 unit of the four hex digits at `start`.
        func hexUnit(at start: Int) throws(Failure) -> Int {
            guard start + 3 < bytes.count else { throw .invalid }
            var value = 0
            for offset in 0..<4 {
                let c = bytes[start + offset]
                guard isHex(c) else { throw .invalid }
                value = value * 16 + Int(c <= 0x39 ? c - 0x30 : (c | 0x20) - 0x61 + 10)
            }
            return value
        }

        func isHex(_ c: UInt8) -> Bool {
            (0x30...0x39).contains(c) || (0x41...0x46).contains(c) || (0x61...0x66).contains(c)
        }

        mutating func literal(_ word: StaticString) throws(Failure) {
            let count = word.utf8CodeUnitCount
            guard index + count <= bytes.count else { throw .invalid }
            for offset in 0..<count where bytes[index + offset] != word.utf8Start[offset] { throw .invalid }
            index += count
        }

        mutating func number() throws(Failure) {
            let start = index
            try numberSyntax()
            let length = index - start
            guard length <= JSONScanner.maximumNumberLength else { throw .numberOutOfRange }
            // A finite double is the common ground of every JSON receiver; `1e999` is not one.
            var text = [CChar](repeating: 0, count: length + 1)
            for offset in 0..<length { text[offset] = CChar(bitPattern: bytes[start + offset]) }
            let value = strtod(text, nil)
            guard value.isFinite else { throw .numberOutOfRange }
            // `1e-999` is 0 to a double but not to a decimal reader: receivers would store different values.
            if value == 0 {
                for offset in 0..<length {
                    let c = bytes[start + offset]
                    if c == UInt8(ascii: "e") || c == UInt8(ascii: "E") { break }
                    if (0x31...0x39).contains(c) { throw .numberOutOfRange }
                }
            }
        }

        mutating func numberSyntax() throws(Failure) {
            func digits() -> Int {
                let start = index
                while index < bytes.count, (0x30...0x39).contains(bytes[index]) { index += 1 }
                return index - start
            }
            if index < bytes.count, bytes[index] == UInt8(ascii: "-") { index += 1 }
            guard index < bytes.count else { throw .invalid }
            if bytes[index] == UInt8(ascii: "0") {
                index += 1
            } else {
                guard digits() > 0 else { throw .invalid }
            }
            if index < bytes.count, bytes[index] == UInt8(ascii: ".") {
                index += 1
                guard digits() > 0 else { throw .invalid }
            }
            if index < bytes.count, bytes[index] == UInt8(ascii: "e") || bytes[index] == UInt8(ascii: "E") {
                index += 1
                if index < bytes.count, bytes[index] == UInt8(ascii: "+") || bytes[index] == UInt8(ascii: "-") { index += 1 }
                guard digits() > 0 else { throw .invalid }
            }
        }
    }
}
