import Foundation

/// The bytes of the transaction Bundles dq makes of queued items, the reading of their answers, and the
/// `urn:uuid` references that tie resources together.
///
/// Entries are written around each item's stored bytes (never re-serialized); the answer's entries are
/// matched to the items by position, as FHIR requires of a transaction-response.
enum TransactionBundle {
    /// One entry: what the item sends, as it will be sent.
    struct Entry: Sendable {
        var method: FHIRMethod
        /// The request path relative to the base (`Patient`, `Patient/123`).
        var path: String
        /// `urn:uuid:…` (the producer's, or one naming the item) for a create; the resource's URL for an update.
        var fullURL: String
        var ifNoneExist: String?
        var body: Data
    }

    /// One entry of a transaction-response.
    struct EntryResponse: Sendable, Equatable {
        var status: Int
        var location: String?
        var etag: String?
        /// The entry's `resource`, re-serialized, when the server answered with it.
        var resource: Data? = nil
    }

    /// The Bundle's JSON: `{"resourceType":"Bundle","type":"transaction","entry":[…]}`.
    static func build(_ entries: [Entry]) -> Data {
        var data = Data(#"{"resourceType":"Bundle","type":"transaction","entry":["#.utf8)
        data.reserveCapacity(entries.reduce(data.count + 4) { $0 + $1.body.count + 200 })
        for (index, entry) in entries.enumerated() {
            if index > 0 { data.append(UInt8(ascii: ",")) }
            data.append(contentsOf: Array(#"{"fullUrl":"#.utf8))
            data.append(contentsOf: jsonString(entry.fullURL))
            data.append(contentsOf: Array(#","resource":"#.utf8))
            data.append(entry.body)
            data.append(contentsOf: Array(#","request":{"method":"\#(entry.method.rawValue)","url":"#.utf8))
            data.append(contentsOf: jsonString(entry.path))
            if let ifNoneExist = entry.ifNoneExist {
                data.append(contentsOf: Array(#","ifNoneExist":"#.utf8))
                data.append(contentsOf: jsonString(ifNoneExist))
            }
            data.append(contentsOf: Array("}}".utf8))
        }
        data.append(contentsOf: Array("]}".utf8))
        return data
    }

    /// The bytes of bundle overhead per entry, beyond the resource itself (for size limits).
    static func overhead(_ entry: Entry) -> Int {
        80 + entry.fullURL.utf8.count + entry.path.utf8.count + (entry.ifNoneExist?.utf8.count ?? 0)
    }

    /// A JSON string literal of `text` (dq's own paths and URLs: escapes quotes, backslashes and controls).
    static func jsonString(_ text: String) -> [UInt8] {
        var bytes: [UInt8] = [UInt8(ascii: "\"")]
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "\""), UInt8(ascii: "\\"):
                bytes.append(UInt8(ascii: "\\"))
                bytes.append(byte)
            case 0..<0x20:
                bytes.append(contentsOf: Array(String(format: "\\u%04x", byte).utf8))
            default:
                bytes.append(byte)
            }
        }
        bytes.append(UInt8(ascii: "\""))
        return bytes
    }

    /// The entries of a transaction-response, in order, or nil when the answer is not one.
    static func parseResponse(_ body: Data) -> [EntryResponse]? {
        guard let object = (try? JSONSerialization.jsonObject(with: body)) as? [String: Any],
            object["resourceType"] as? String == "Bundle", let entries = object["entry"] as? [[String: Any]]
        else { return nil }
        return entries.map { entry in
            let response = entry["response"] as? [String: Any] ?? [:]
            let statusText = response["status"] as? String ?? ""
            let status = Int(statusText.prefix { $0.isNumber }) ?? 0
            return EntryResponse(
                status: status, location: response["location"] as? String, etag: response["etag"] as? String,
                resource: (entry["resource"] as? [String: Any]).flatMap { try? JSONSerialization.data(withJSONObject: $0) })
        }
    }

    /// The version id an ETag names: `W/"3"` → `3`.
    static func version(fromETag etag: String?) -> String? {
        guard var text = etag else { return nil }
        if text.hasPrefix("W/") { text.removeFirst(2) }
        text = text.trimmingCharacters(in: CharacterSet(charactersIn: "\""))
        return text.isEmpty ? nil : text
    }

    /// Whether a refusal says the server does not take transactions (rather than that an entry is bad).
    static func refusesTransactions(status: Int, body: Data) -> Bool {
        if status == 405 || status == 501 { return true }
        let text = String(decoding: body.prefix(8192), as: UTF8.self).lowercased()
        return text.contains("transaction")
            && (text.contains("not supported") || text.contains("unsupported") || text.contains("not allowed"))
    }

    // MARK: - References

    /// The `urn:uuid` fullUrls `body` references and does not declare itself (lowercased, in order): every
    /// reference of a resource; for a transaction or batch Bundle (`isBundle`), those that none of its own
    /// entries declares as its `fullUrl` (the server resolves those within the Bundle).
    static func externalReferences(in body: Data, isBundle: Bool) -> [String] {
        let all = references(in: body).map(\.fullURL)
        guard isBundle, !all.isEmpty else { return all }
        let own = entryFullURLs(in: body)
        return all.filter { !own.contains($0) }
    }

    /// The `urn:uuid` fullUrls the entries of the Bundle `body` declare, lowercased.
    static func entryFullURLs(in body: Data) -> Set<String> {
        guard let object = (try? JSONSerialization.jsonObject(with: body)) as? [String: Any],
            let entries = object["entry"] as? [[String: Any]]
        else { return [] }
        return Set(entries.compactMap { ($0["fullUrl"] as? String)?.lowercased() }.filter { $0.hasPrefix("urn:uuid:") })
    }

    /// Where `"reference": "urn:uuid:…"` values are in `body`: the range of each string token (quotes
    /// included) and the `urn:uuid:…` it names. Only `reference` members count, never identifiers.
    static func references(in body: Data) -> [(range: Range<Int>, fullURL: String)] {
        var found: [(Range<Int>, String)] = []
        body.withUnsafeBytes { (raw: UnsafeRawBufferPointer) in
            let bytes = raw.bindMemory(to: UInt8.self)
            // Most resources reference no fullUrl at all: one search for the prefix settles them.
            guard firstIndex(of: uuidPrefix, in: bytes, from: 0) != nil else { return }
            let key = referenceKey
            var index = 0
            while index + key.count < bytes.count {
                guard let hit = firstIndex(of: key, in: bytes, from: index) else { break }
                var cursor = hit + key.count
                func skipSpace() {
                    while cursor < bytes.count {
                        switch bytes[cursor] {
                        case 0x20, 0x09, 0x0A, 0x0D: cursor += 1
                        default: return
                        }
                    }
                }
                skipSpace()
                index = hit + key.count
                guard cursor < bytes.count, bytes[cursor] == UInt8(ascii: ":") else { continue }
                cursor += 1
                skipSpace()
                guard cursor < bytes.count, bytes[cursor] == UInt8(ascii: "\"") else { continue }
                let start = cursor
                let valueStart = cursor + 1
                guard valueStart + uuidPrefix.count <= bytes.count,
                    uuidPrefix.withUnsafeBufferPointer({ memcmp(bytes.baseAddress! + valueStart, $0.baseAddress!, $0.count) }) == 0
                else { continue }
                var end = valueStart
                while end < bytes.count, bytes[end] != UInt8(ascii: "\""), bytes[end] != UInt8(ascii: "\\") { end += 1 }
                guard end < bytes.count, bytes[end] == UInt8(ascii: "\"") else { continue }
                let value = String(decoding: UnsafeBufferPointer(rebasing: bytes[valueStart..<end]), as: UTF8.self)
                found.append((start..<(end + 1), value.lowercased()))
                index = end + 1
            }
        }
        return found
    }

    private static let referenceKey = Array(#""reference""#.utf8)
    private static let uuidPrefix = Array("urn:uuid:".utf8)

    /// Where `needle` first occurs in `bytes` at or after `start` (Glibc's `memmem` is not imported).
    private static func firstIndex(of needle: [UInt8], in bytes: UnsafeBufferPointer<UInt8>, from start: Int) -> Int? {
        guard let base = bytes.baseAddress, let first = needle.first, start < bytes.count else { return nil }
        return needle.withUnsafeBufferPointer { needle -> Int? in
            var index = start
            while index + needle.count <= bytes.count {
                guard let hit = memchr(base + index, Int32(first), bytes.count - index) else { return nil }
                let position = UnsafeRawPointer(base).distance(to: UnsafeRawPointer(hit))
                if position + needle.count <= bytes.count, memcmp(base + position, needle.baseAddress!, needle.count) == 0 {
                    return position
                }
                index = position + 1
            }
            return nil
        }
    }

    /// `body` with each reference to a fullUrl in `locations` replaced by its location (`Type/id`).
    static func rewritingReferences(_ body: Data, _ locations: [String: String]) -> Data {
        let replacements = references(in: body).compactMap { reference in
            locations[reference.fullURL].map { (reference.range, jsonString($0)) }
        }
        guard !replacements.isEmpty else { return body }
        var result = Data()
        result.reserveCapacity(body.count)
        var position = 0
        for (range, bytes) in replacements {
            result.append(body[(body.startIndex + position)..<(body.startIndex + range.lowerBound)])
            result.append(contentsOf: bytes)
            position = range.upperBound
        }
        result.append(body[(body.startIndex + position)...])
        return result
    }

    /// Whether `text` is a fullUrl dq accepts from a producer: `urn:uuid:` and a UUID.
    static func isUUIDFullURL(_ text: String) -> Bool {
        let lowered = text.lowercased()
        guard lowered.hasPrefix("urn:uuid:") else { return false }
        return UUID(uuidString: String(lowered.dropFirst("urn:uuid:".count))) != nil
    }
}
