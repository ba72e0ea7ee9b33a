import Foundation

/// A validated FHIR resource in its JSON form, as dq stores and sends it.
///
/// The bytes are kept exactly as given (dq never re-serializes a resource, so decimals and key order
/// survive unchanged); only the fields dq needs are read out.
///
/// ```swift
/// let patient = try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8))
/// ```
public struct FHIRResource: Sendable, Hashable {
    /// The default largest resource dq accepts: 64 MiB.
    public static let defaultMaximumSize = 64 << 20

    /// The JSON bytes, unchanged.
    public let data: Data
    /// The value of `resourceType`, e.g. `Patient`.
    public let resourceType: String
    /// The value of `id`, when present.
    public let id: String?
    /// The `Bundle.type` of a Bundle (`transaction`, `batch`, …), else `nil`.
    public let bundleType: String?
    /// The first `identifier` with both `system` and `value`, used for conditional create.
    public var identifier: (system: String, value: String)? {
        guard let identifierJSON else { return nil }
        let value = try? JSONSerialization.jsonObject(with: identifierJSON, options: [.fragmentsAllowed])
        let entries = value as? [[String: Any]] ?? (value as? [String: Any]).map { [$0] } ?? []
        for entry in entries {
            if let system = entry["system"] as? String, let value = entry["value"] as? String, !system.isEmpty, !value.isEmpty {
                return (system, value)
            }
        }
        return nil
    }
    /// The JSON of the `identifier` member, decoded only when asked for.
    private let identifierJSON: Data?

    /// Resources are equal when their bytes are.
    public static func == (lhs: FHIRResource, rhs: FHIRResource) -> Bool { lhs.data == rhs.data }
    /// Hashes the bytes.
    public func hash(into hasher: inout Hasher) { hasher.combine(data) }

    /// Validates JSON bytes as a FHIR resource.
    ///
    /// - Parameters:
    ///   - json: UTF-8 JSON of one resource.
    ///   - maximumSize: the largest accepted size in bytes. The default is ``defaultMaximumSize``.
    /// - Throws: ``DataQueueError`` with code ``DataQueueError/Code/invalidResource`` naming the problem
    ///   (never quoting the content).
    public init(json: Data, maximumSize: Int = FHIRResource.defaultMaximumSize) throws {
        func invalid(_ why: String) -> DataQueueError { DataQueueError(.invalidResource, why) }
        if json.count > maximumSize {
            throw invalid("resource is \(json.count) bytes, over the limit of \(maximumSize) bytes")
        }
        if json.isEmpty || json.allSatisfy({ $0 == 0x20 || $0 == 0x0A || $0 == 0x0D || $0 == 0x09 }) {
            throw invalid("input is empty")
        }
        if json.starts(with: [0xEF, 0xBB, 0xBF]) {
            // RFC 8259 forbids a BOM in JSON sent over a network; dq refuses it rather than change the bytes.
            throw invalid("input starts with a UTF-8 byte order mark (BOM); save it as UTF-8 without a BOM")
        }
        if !Self.isValidUTF8(json) {
            throw invalid("input is not valid UTF-8")
        }
        let document: JSONScanner.Document
        do {
            document = try json.withUnsafeBytes { raw in
                try JSONScanner.scan(raw.bindMemory(to: UInt8.self), keys: Self.scannedMembers)
            }
        } catch JSONScanner.Failure.tooDeep {
            throw invalid("JSON is nested deeper than \(JSONScanner.maximumDepth) levels")
        } catch JSONScanner.Failure.duplicateKey(let key) {
            throw invalid("the member \"\(FHIRResource.printable(key))\" appears twice (receivers differ on which one counts)")
        } catch JSONScanner.Failure.numberOutOfRange {
            throw invalid(
                "a number is out of range (longer than \(JSONScanner.maximumNumberLength) characters, or beyond a double: too large, or too small to be told from 0)"
            )
        } catch JSONScanner.Failure.loneSurrogate {
            throw invalid("a string holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair): it is not text")
        } catch {
            throw invalid("input is not valid JSON")
        }
        guard document.isObject else {
            throw invalid("JSON is not an object (a FHIR resource is a JSON object)")
        }
        /// Decodes one small member value (the scanner has validated the whole document).
        func member(_ key: String) -> Any? {
            guard let range = document.members[key] else { return nil }
            if let text = JSONScanner.string(in: json, range) { return text }
            return try? JSONSerialization.jsonObject(
                with: json[(json.startIndex + range.lowerBound)..<(json.startIndex + range.upperBound)], options: [.fragmentsAllowed])
        }
        guard let type = member("resourceType") else {
            throw invalid("JSON object has no \"resourceType\"")
        }
        guard let typeString = type as? String, FHIRResource.isValidTypeName(typeString) else {
            throw invalid("\"resourceType\" is not a FHIR type name")
        }
        var idString: String?
        if let rawID = member("id") {
            guard let text = rawID as? String, FHIRResource.isValidID(text) else {
                throw invalid("\"id\" is not a valid FHIR id ([A-Za-z0-9-.]{1,64})")
            }
            idString = text
        }
        self.data = json
        self.resourceType = typeString
        self.id = idString
        self.bundleType = typeString == "Bundle" ? member("type") as? String : nil
        self.identifierJSON = document.members["identifier"].map {
            Data(json[(json.startIndex + $0.lowerBound)..<(json.startIndex + $0.upperBound)])
        }
    }

    /// A transaction or batch Bundle, which is sent as one request to the base URL.
    public var isTransactionOrBatch: Bool {
        bundleType == "transaction" || bundleType == "batch"
    }

    /// Whether `json` is valid UTF-8: all ASCII (checked eight bytes at a time, without building a String),
    /// else the standard library's check.
    static func isValidUTF8(_ json: Data) -> Bool {
        let ascii = json.withUnsafeBytes { raw -> Bool in
            var index = 0
            while index + 8 <= raw.count {
                if raw.loadUnaligned(fromByteOffset: index, as: UInt64.self) & 0x8080_8080_8080_8080 != 0 { return false }
                index += 8
            }
            while index < raw.count {
                if raw[index] >= 0x80 { return false }
                index += 1
            }
            return true
        }
        return ascii || String(validating: json, as: UTF8.self) != nil
    }

    /// A key for an error message: at most 40 characters, control characters as `?` (keys are not PHI, but
    /// an error line must stay one line).
    static func printable(_ key: String) -> String {
        String(String.UnicodeScalarView(key.unicodeScalars.prefix(40).map { $0.value < 0x20 ? "?" : $0 }))
    }

    package static func isValidTypeName(_ name: String) -> Bool {
        guard let first = name.unicodeScalars.first, ("A"..."Z").contains(first), name.count <= 64 else {
            return false
        }
        return name.unicodeScalars.allSatisfy { ("A"..."Z").contains($0) || ("a"..."z").contains($0) || ("0"..."9").contains($0) }
    }

    static func isValidID(_ id: String) -> Bool {
        guard !id.isEmpty, id.utf8.count <= 64 else { return false }
        return id.unicodeScalars.allSatisfy {
            ("A"..."Z").contains($0) || ("a"..."z").contains($0) || ("0"..."9").contains($0) || $0 == "-" || $0 == "."
        }
    }
}

extension FHIRResource {
    /// The top-level members a resource is read for (made once, not for every resource).
    fileprivate static let scannedMembers: Set<String> = ["resourceType", "id", "type", "identifier"]
}
