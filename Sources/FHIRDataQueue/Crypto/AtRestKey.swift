import Crypto
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// A 256-bit key that seals queued items at rest (AES-256-GCM), read from a key file that ``generate()`` made
/// (`dq keygen --at-rest`): one line, `dq-at-rest-v1:` and the key in base64.
///
/// The key's ``id`` is derived from the key (16 hex digits of a SHA-256 over a label and the key): a queue
/// names the key it needs by this id, which tells nothing about the key itself.
public struct AtRestKey: Sendable, Equatable {
    /// The key's id: 16 lowercase hex digits.
    public let id: String
    let key: SymmetricKey

    /// The first thing on a key file's line.
    static let filePrefix = "dq-at-rest-v1:"

    /// A key from its 32 bytes.
    init(bytes: Data) throws {
        guard bytes.count == 32 else {
            throw DataQueueError(.invalidConfiguration, "an at-rest key is 32 bytes, not \(bytes.count)")
        }
        key = SymmetricKey(data: bytes)
        var hasher = SHA256()
        hasher.update(data: Data("dq at-rest key id v1\0".utf8))
        hasher.update(data: bytes)
        id = hasher.finalize().prefix(8).hexString
    }

    /// Reads the key file at `path`.
    ///
    /// - Parameters:
    ///   - path: the key file (as `dq keygen --at-rest` writes it).
    ///   - setting: the setting that named the file, for the error (e.g. `"at_rest.key_file"`).
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the setting and the file, never its content.
    public init(contentsOfFile path: String, setting: String = "at_rest.key_file") throws {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw DataQueueError(.invalidConfiguration, "configuration: cannot read \"\(setting)\" (\(path))")
        }
        var text = String(decoding: data, as: UTF8.self)
        // Line ends dropped one scalar at a time: "\r\n" is one Character.
        while let last = text.unicodeScalars.last, last == "\n" || last == "\r" { text.unicodeScalars.removeLast() }
        guard text.hasPrefix(Self.filePrefix), let bytes = Data(base64Encoded: String(text.dropFirst(Self.filePrefix.count))),
            bytes.count == 32
        else {
            throw DataQueueError(
                .invalidConfiguration,
                "configuration: \"\(setting)\" (\(path)) is not a dq at-rest key (make one with dq keygen --at-rest --out FILE)")
        }
        try self.init(bytes: bytes)
    }

    /// A new random key, and the text of its key file.
    public static func generate() -> (key: AtRestKey, file: String) {
        let bytes = SymmetricKey(size: .bits256).withUnsafeBytes { Data($0) }
        // 32 bytes always make a key.
        let key = try! AtRestKey(bytes: bytes)
        return (key, filePrefix + bytes.base64EncodedString() + "\n")
    }

    /// Writes a new key file at `path` (mode 0600; an existing file is never overwritten) and returns its key.
    ///
    /// - Throws: ``DataQueueError`` (`.storage`) when the file exists or cannot be written.
    public static func generate(writingTo path: String) throws -> AtRestKey {
        let (key, text) = generate()
        let fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else {
            throw DataQueueError(.storage, "cannot create \(path): \(String(cString: strerror(errno)))")
        }
        let data = Data(text.utf8)
        let written = data.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
        let synced = fsync(fd) == 0
        close(fd)
        guard written == data.count, synced else {
            unlink(path)
            throw DataQueueError(.storage, "cannot write \(path)")
        }
        return key
    }
}

/// The keys of a sealed queue: the one that seals new items, and older ones that still open items sealed
/// before a rekey (listed until no item is sealed under them).
public struct AtRestKeys: Sendable {
    /// Seals every new item (and the ones a rekey reseals).
    public var current: AtRestKey
    /// Open items sealed under them; never seal.
    public var old: [AtRestKey]

    /// The keys, `current` first.
    public init(current: AtRestKey, old: [AtRestKey] = []) {
        self.current = current
        self.old = old.filter { $0.id != current.id }
    }

    /// The key with `id`, if it is one of these.
    func key(id: String) -> AtRestKey? {
        id == current.id ? current : old.first { $0.id == id }
    }

    /// Every key id, the current first.
    var ids: [String] { [current.id] + old.map(\.id) }
}

/// The sealing of one queue's values: AES-256-GCM under a fresh 96-bit nonce, with the item's id, its queue and
/// the column as associated data (a value copied onto another item or into another column does not open).
///
/// A sealed text value is `dqs1.<key id>.<base64 of nonce, ciphertext and tag>`; a sealed body is the bytes
/// `DQS1`, the key id (16 ASCII hex digits), nonce, ciphertext and tag, and its plaintext carries the item's
/// `fullUrl` before the body (so no column holds it readable). Values that must be found by equality (a
/// `fullUrl`, in the queue and the journal) are stored as a keyed hash (`dqx1.<hex>`, HMAC-SHA-256 under the
/// queue's index key), which stays the same across key rotations: the index key is random per queue, kept
/// wrapped under each of its at-rest keys.
struct Sealer: Sendable {
    let keys: AtRestKeys
    /// The queue's index key (see ``SealKeyRecord``).
    let indexKey: SymmetricKey

    static let textPrefix = "dqs1."
    static let bodyMagic = Data("DQS1".utf8)
    static let indexPrefix = "dqx1."
    /// The bytes of a sealed body before its nonce: magic and key id.
    static let bodyHeaderCount = 4 + 16

    /// Which column a value belongs to (part of the associated data).
    enum Column: String {
        case url, resourceID = "resource_id", body, outcome
    }

    /// `dq-at-rest-v1`, the column, the item's id and its queue, each ended by a zero byte but the last.
    private static func associatedData(_ column: Column, item: UUID, queue: String) -> Data {
        var bytes: [UInt8] = []
        bytes.reserveCapacity(14 + 12 + 37 + queue.utf8.count)
        bytes.append(contentsOf: "dq-at-rest-v1\0".utf8)
        bytes.append(contentsOf: column.rawValue.utf8)
        bytes.append(0)
        item.appendLowercased(to: &bytes)
        bytes.append(0)
        bytes.append(contentsOf: queue.utf8)
        return Data(bytes)
    }

    // MARK: Sealing

    func seal(text: String, _ column: Column, item: UUID, queue: String) -> String {
        let box = try! AES.GCM.seal(
            Data(text.utf8), using: keys.current.key, nonce: RandomBytes.nonce(),
            authenticating: Self.associatedData(column, item: item, queue: queue))
        // `combined` is nonce, ciphertext and tag (always present with the default 12-byte nonce).
        return Self.textPrefix + keys.current.id + "." + box.combined!.base64EncodedString()
    }

    func seal(body: Data, fullURL: String?, item: UUID, queue: String) -> Data {
        var plain = Data()
        let url = Data((fullURL ?? "").utf8)
        plain.reserveCapacity(4 + url.count + body.count)
        withUnsafeBytes(of: UInt32(url.count).bigEndian) { plain.append(contentsOf: $0) }
        plain.append(url)
        plain.append(body)
        let box = try! AES.GCM.seal(
            plain, using: keys.current.key, nonce: RandomBytes.nonce(),
            authenticating: Self.associatedData(.body, item: item, queue: queue))
        var sealed = Self.bodyMagic
        sealed.reserveCapacity(Self.bodyHeaderCount + 28 + plain.count)
        sealed.append(Data(keys.current.id.utf8))
        sealed.append(box.combined!)
        return sealed
    }

    /// The keyed hash stored for a `fullUrl` (in the queue and in the journal), found by equality.
    func index(_ fullURL: String) -> String {
        let mac = HMAC<SHA256>.authenticationCode(for: Data(fullURL.utf8), using: indexKey)
        return Self.indexPrefix + mac.hexString
    }

    /// A new item with every value that comes from the resource sealed (its `fullUrl` as its keyed hash, its
    /// references likewise, so that the store's checks compare hashes).
    func seal(_ item: NewItem) -> NewItem {
        var sealed = item
        sealed.request.path = seal(text: item.url, .url, item: item.id, queue: item.queue)
        sealed.request.resourceID = item.resourceID.map { seal(text: $0, .resourceID, item: item.id, queue: item.queue) }
        sealed.request.body = seal(body: item.body, fullURL: item.fullURL, item: item.id, queue: item.queue)
        sealed.fullURL = item.fullURL.map(index)
        sealed.references = item.references.map(index)
        sealed.sealed = true
        return sealed
    }

    // MARK: Opening

    /// Why a sealed value does not open: which key it needs (that is not configured), or that it does not verify.
    struct Failure: Error {
        var message: String
    }

    /// The key id a sealed value names, if it is a sealed value.
    static func keyID(ofText text: String) -> String? {
        guard text.hasPrefix(textPrefix) else { return nil }
        let rest = text.dropFirst(textPrefix.count)
        guard let dot = rest.firstIndex(of: "."), rest.distance(from: rest.startIndex, to: dot) == 16 else { return nil }
        return String(rest[..<dot])
    }

    static func keyID(ofBody body: Data) -> String? {
        guard body.count >= bodyHeaderCount, body.prefix(4) == bodyMagic else { return nil }
        return String(decoding: body.dropFirst(4).prefix(16), as: UTF8.self)
    }

    /// Whether the key `id` is configured (current or old).
    func holds(_ id: String) -> Bool { keys.key(id: id) != nil }

    private func key(_ id: String) throws -> AtRestKey {
        guard let key = keys.key(id: id) else {
            throw Failure(
                message: "it is sealed under at-rest key \(id), which is not configured "
                    + "(set \"at_rest.key_file\" or \"at_rest.old_key_files\" to it)")
        }
        return key
    }

    func open(text: String, _ column: Column, item: UUID, queue: String) throws -> String {
        guard let id = Self.keyID(ofText: text) else {
            throw Failure(message: "its \(column.rawValue) is not sealed")
        }
        let key = try key(id)
        guard let combined = Data(base64Encoded: String(text.dropFirst(Self.textPrefix.count + 17))),
            let box = try? AES.GCM.SealedBox(combined: combined),
            let plain = try? AES.GCM.open(box, using: key.key, authenticating: Self.associatedData(column, item: item, queue: queue))
        else {
            throw Failure(message: "the seal of its \(column.rawValue) does not verify (changed, or copied from another item)")
        }
        return String(decoding: plain, as: UTF8.self)
    }

    func open(body: Data, item: UUID, queue: String) throws -> (body: Data, fullURL: String?) {
        guard let id = Self.keyID(ofBody: body) else { throw Failure(message: "its body is not sealed") }
        let key = try key(id)
        guard let box = try? AES.GCM.SealedBox(combined: body.dropFirst(Self.bodyHeaderCount)),
            let plain = try? AES.GCM.open(box, using: key.key, authenticating: Self.associatedData(.body, item: item, queue: queue)),
            plain.count >= 4
        else {
            throw Failure(message: "the seal of its body does not verify (changed, or copied from another item)")
        }
        let length = plain.prefix(4).reduce(0) { $0 << 8 | Int($1) }
        guard plain.count >= 4 + length else { throw Failure(message: "its sealed body is cut short") }
        let start = plain.startIndex + 4
        let url = String(decoding: plain[start..<start + length], as: UTF8.self)
        return (Data(plain[(start + length)...]), url.isEmpty ? nil : url)
    }

    // MARK: The index key

    /// The index key wrapped under `key`, for the store's seal key table.
    static func wrap(indexKey: SymmetricKey, under key: AtRestKey) -> Data {
        let bytes = indexKey.withUnsafeBytes { Data($0) }
        return try! AES.GCM.seal(bytes, using: key.key, authenticating: Data("dq-at-rest-v1\0index-key\0\(key.id)".utf8)).combined!
    }

    static func unwrap(_ wrapped: Data, under key: AtRestKey) -> SymmetricKey? {
        guard let box = try? AES.GCM.SealedBox(combined: wrapped),
            let bytes = try? AES.GCM.open(box, using: key.key, authenticating: Data("dq-at-rest-v1\0index-key\0\(key.id)".utf8)),
            bytes.count == 32
        else { return nil }
        return SymmetricKey(data: bytes)
    }
}

/// A row of a store's seal key table: an at-rest key a queue was sealed under, by id, with the queue's index key
/// wrapped under it. A store with at least one is a sealed queue.
struct SealKeyRecord: Sendable, Equatable {
    var id: String
    var wrappedIndexKey: Data
}
