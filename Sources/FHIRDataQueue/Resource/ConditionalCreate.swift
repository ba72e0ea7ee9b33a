import Crypto
import Foundation

/// Idempotent mode's rewrite of a create: the `If-None-Exist` search that makes a retried create find the
/// resource the lost answer already created, instead of making a second one.
///
/// The condition names the resource's first `identifier` that has both `system` and `value`. A resource with
/// no such identifier gets one that names its queue item (`urn:ietf:rfc:3986|urn:uuid:<item id>`), inserted
/// into the bytes without re-serializing anything else: a list of one, or a single object where the type's
/// `identifier` is 0..1 in R4 (``IdentifierCardinality``). A type without an `identifier` element is sent as a
/// plain create (nothing to search by). The same item always gets the same identifier, so
/// every retry carries the same condition. In a transaction or batch Bundle each `POST` entry gets a
/// `request.ifNoneExist` in the same way (generated identifiers name the item and the entry's position).
///
/// It is computed when the item is sent, so the setting that applies is the one of the flush, and an
/// operator can turn it off for one item (`dq retry --no-conditional`). The default setting,
/// ``DataQueue/Idempotence/automatic``, conditions only what needs no change to the resource
/// (`prepareDeclared`).
enum ConditionalCreate {
    /// The system of generated identifiers (a URI as the identifier's value).
    static let generatedSystem = "urn:ietf:rfc:3986"

    /// The body to send and its `If-None-Exist` header (nil for a Bundle, whose conditions are in its entries).
    ///
    /// - Throws: ``DataQueueError`` with `.invalidResource` when the resource's `identifier` is not a list,
    ///   so that no identifier can be added to it.
    static func prepare(_ body: Data, itemID: UUID, isBundle: Bool) throws -> (body: Data, ifNoneExist: String?) {
        var insertions: [(offset: Int, bytes: [UInt8])] = []
        var ifNoneExist: String?
        do {
            if isBundle {
                try planBundle(body, itemID: itemID, into: &insertions)
            } else {
                let (condition, insertion) = try plan(
                    resource: body, 0..<body.count, generatedValue: "urn:uuid:\(itemID.lowercasedString)")
                ifNoneExist = condition
                if let insertion { insertions.append(insertion) }
            }
        } catch let error as DataQueueError {
            throw error
        } catch {
            throw DataQueueError(.invalidResource, "idempotent mode cannot read the resource's JSON")
        }
        return (apply(insertions, to: body), ifNoneExist)
    }

    /// The condition of ``DataQueue/Idempotence/automatic``: `If-None-Exist` on the resource's own first
    /// identifier with a system and a value, when the server declares conditional create for its type; in a
    /// transaction or batch Bundle, a `request.ifNoneExist` for each such `POST` entry that has none of its own.
    /// Nothing is added to a resource and nothing is refused: a resource without such an identifier, of a type
    /// not in `declared`, or whose JSON dq cannot read here goes as it is, a plain create.
    static func prepareDeclared(_ body: Data, resourceType: String, isBundle: Bool, declared: Set<String>)
        -> (body: Data, ifNoneExist: String?)
    {
        if isBundle {
            var insertions: [(offset: Int, bytes: [UInt8])] = []
            for entry in (try? postEntries(body)) ?? [] {
                guard let resource = try? JSONScanner.scan(body, entry.resource, keys: ["resourceType"]),
                    let type = resource.members["resourceType"].flatMap({ JSONScanner.string(in: body, $0) }),
                    declared.contains(type), let condition = ownCondition(body, entry.resource)
                else { continue }
                insertions.append((entry.request.lowerBound + 1, Array(#""ifNoneExist":"\#(condition)","#.utf8)))
            }
            return (apply(insertions, to: body), nil)
        }
        guard declared.contains(resourceType) else { return (body, nil) }
        return (body, ownCondition(body, 0..<body.count))
    }

    /// The condition on the first identifier with a system and a value of the resource object at `range` (its
    /// `identifier` a list, or a single one), else nil.
    private static func ownCondition(_ data: Data, _ range: Range<Int>) -> String? {
        guard let document = try? JSONScanner.scan(data, range, keys: ["identifier"]),
            let identifier = document.members["identifier"]
        else { return nil }
        switch data[data.startIndex + identifier.lowerBound] {
        case UInt8(ascii: "{"):
            return usable(data, identifier)
        case UInt8(ascii: "["):
            let list = try? JSONScanner.scan(data, identifier, keys: [])
            return list?.elements.lazy.compactMap { usable(data, $0) }.first
        default:
            return nil
        }
    }

    /// `identifier=<system>|<value>`, each part escaped for a search URL (and therefore safe inside JSON).
    static func condition(system: String, value: String) -> String {
        "identifier=" + searchEscape(system) + "|" + searchEscape(value)
    }

    static func searchEscape(_ text: String) -> String {
        var allowed = CharacterSet.urlQueryAllowed
        allowed.remove(charactersIn: "&=+,|$#?\\\" ")
        return text.addingPercentEncoding(withAllowedCharacters: allowed) ?? text
    }

    /// The condition for the resource object at `range`, and the insertion of a generated identifier when it has
    /// no usable one.
    /// The condition is nil for a type without an `identifier` element (sent as a plain create).
    private static func plan(resource data: Data, _ range: Range<Int>, generatedValue: String) throws
        -> (String?, (offset: Int, bytes: [UInt8])?)
    {
        let document = try JSONScanner.scan(data, range, keys: ["identifier", "resourceType"])
        let generated = #"{"system":"\#(generatedSystem)","value":"\#(generatedValue)"}"#
        let condition = Self.condition(system: generatedSystem, value: generatedValue)
        guard let identifier = document.members["identifier"] else {
            let type = document.members["resourceType"].flatMap { JSONScanner.string(in: data, $0) } ?? ""
            if IdentifierCardinality.none.contains(type) { return (nil, nil) }
            // No identifier: add one right after the opening brace, a list or a single one as R4 has it.
            let slice = data[(data.startIndex + range.lowerBound)..<(data.startIndex + range.upperBound)]
            guard let brace = slice.firstIndex(of: UInt8(ascii: "{")) else {
                throw DataQueueError(.invalidResource, "idempotent mode needs the resource to be a JSON object")
            }
            let rest = slice[(brace + 1)...].first { ![0x20, 0x09, 0x0A, 0x0D].contains($0) }
            let separator = rest == UInt8(ascii: "}") ? "" : ","
            let value = IdentifierCardinality.single.contains(type) ? generated : "[" + generated + "]"
            return (condition, (brace - data.startIndex + 1, Array(#""identifier":\#(value)\#(separator)"#.utf8)))
        }
        let list = try JSONScanner.scan(data, identifier, keys: [])
        let first = data[data.startIndex + identifier.lowerBound]
        if first == UInt8(ascii: "{") {
            // A type whose identifier is a single one (QuestionnaireResponse, Bundle): it must name the resource.
            if let usable = usable(data, identifier) { return (usable, nil) }
            throw DataQueueError(
                .invalidResource,
                "idempotent mode needs this resource's one \"identifier\" to have a system and a value (or turn idempotent off for it)")
        }
        guard first == UInt8(ascii: "[") else {
            throw DataQueueError(.invalidResource, "idempotent mode needs \"identifier\" to be a list or an object")
        }
        for element in list.elements {
            if let usable = usable(data, element) { return (usable, nil) }
        }

        // A list without a usable identifier (no system or no value): put the generated one first.
        let separator = list.elements.isEmpty ? "" : ","
        return (condition, (identifier.lowerBound + 1, Array((generated + separator).utf8)))
    }

    /// The condition of one Identifier object with both a system and a value, else nil.
    private static func usable(_ data: Data, _ range: Range<Int>) -> String? {
        guard data[data.startIndex + range.lowerBound] == UInt8(ascii: "{"),
            let entry = try? JSONScanner.scan(data, range, keys: ["system", "value"]),
            let system = entry.members["system"].flatMap({ JSONScanner.string(in: data, $0) }),
            let value = entry.members["value"].flatMap({ JSONScanner.string(in: data, $0) }),
            !system.isEmpty, !value.isEmpty
        else { return nil }
        return condition(system: system, value: value)
    }

    private static func planBundle(_ data: Data, itemID: UUID, into insertions: inout [(offset: Int, bytes: [UInt8])]) throws {
        for entry in try postEntries(data) {
            let (condition, insertion) = try plan(
                resource: data, entry.resource, generatedValue: "urn:uuid:" + entryID(itemID: itemID, index: entry.index))
            if let insertion { insertions.append(insertion) }
            if let condition { insertions.append((entry.request.lowerBound + 1, Array(#""ifNoneExist":"\#(condition)","#.utf8))) }
        }
    }

    /// The `POST` entries of a Bundle without an `ifNoneExist` of their own: each one's position, its `request`
    /// object and its `resource` object.
    private static func postEntries(_ data: Data) throws -> [(index: Int, request: Range<Int>, resource: Range<Int>)] {
        let bundle = try JSONScanner.scan(data, 0..<data.count, keys: ["entry"])
        guard let entryRange = bundle.members["entry"], data[data.startIndex + entryRange.lowerBound] == UInt8(ascii: "[")
        else { return [] }
        var entries: [(index: Int, request: Range<Int>, resource: Range<Int>)] = []
        for (index, element) in try JSONScanner.scan(data, entryRange, keys: []).elements.enumerated() {
            guard data[data.startIndex + element.lowerBound] == UInt8(ascii: "{") else { continue }
            let entry = try JSONScanner.scan(data, element, keys: ["request", "resource"])
            guard let requestRange = entry.members["request"], let resourceRange = entry.members["resource"],
                data[data.startIndex + requestRange.lowerBound] == UInt8(ascii: "{"),
                data[data.startIndex + resourceRange.lowerBound] == UInt8(ascii: "{")
            else { continue }
            let request = try JSONScanner.scan(data, requestRange, keys: ["method", "ifNoneExist"])
            guard request.members["ifNoneExist"] == nil,
                let method = request.members["method"].flatMap({ JSONScanner.string(in: data, $0) }), method == "POST"
            else { continue }
            entries.append((index, requestRange, resourceRange))
        }
        return entries
    }

    /// A UUID for entry `index` of item `itemID`: the same on every retry, different for every entry.
    static func entryID(itemID: UUID, index: Int) -> String {
        var bytes = Array(SHA256.hash(data: Data("\(itemID.lowercasedString)#\(index)".utf8)).prefix(16))
        bytes[6] = (bytes[6] & 0x0F) | 0x80  // version 8: name-based, application-defined
        bytes[8] = (bytes[8] & 0x3F) | 0x80  // RFC 9562 variant
        let uuid = UUID(
            uuid: (
                bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7], bytes[8], bytes[9],
                bytes[10], bytes[11], bytes[12], bytes[13], bytes[14], bytes[15]
            ))
        return uuid.lowercasedString
    }

    /// The resource with `meta.source` set to `source` (inserted into the bytes, nothing else re-serialized), or nil
    /// when it has a `meta.source` of its own (or its JSON cannot be read): a receiver's create is then conditioned on
    /// `_source`, which names its queue item, so that the research content the app wrote is left as it is.
    static func stampingSource(_ body: Data, source: String) -> Data? {
        guard let document = try? JSONScanner.scan(body, 0..<body.count, keys: ["meta"]), document.isObject,
            let open = body.firstIndex(of: UInt8(ascii: "{"))
        else { return nil }
        let value = Array(#""source":"\#(source)""#.utf8)
        guard let meta = document.members["meta"] else {
            return apply([(open - body.startIndex + 1, Array(#""meta":{"#.utf8) + value + Array("},".utf8))], to: body)
        }
        guard let inner = try? JSONScanner.scan(body, meta, keys: ["source"]), inner.isObject, inner.members["source"] == nil
        else { return nil }
        return apply([(meta.lowerBound + 1, value + (inner.memberCount > 0 ? Array(",".utf8) : []))], to: body)
    }

    private static func apply(_ insertions: [(offset: Int, bytes: [UInt8])], to data: Data) -> Data {
        guard !insertions.isEmpty else { return data }
        var result = Data()
        result.reserveCapacity(data.count + insertions.reduce(0) { $0 + $1.bytes.count })
        var position = 0
        for insertion in insertions.sorted(by: { $0.offset < $1.offset }) {
            result.append(data[(data.startIndex + position)..<(data.startIndex + insertion.offset)])
            result.append(contentsOf: insertion.bytes)
            position = insertion.offset
        }
        result.append(data[(data.startIndex + position)...])
        return result
    }
}
