import Crypto
import Foundation
import Metrics
import NIOConcurrencyHelpers
import _CryptoExtras

/// The private keys a receiver opens envelopes with, chosen by each envelope's `key_id`, read from a directory:
/// `<directory>/<key_id>/private-c3pro.der` (the C3-PRO consumer's layout: PKCS#8 DER) or
/// `<directory>/<key_id>.pem`. Many keys are live at once (key rotation: old app builds keep their key id); a key
/// added to the directory is read when an envelope first names it, without a restart.
///
/// A queue given a keyring (``DataQueue/Configuration/envelopeKeyring``) opens its envelopes in memory when it
/// sends them and sends the resource inside to its server; an envelope that cannot be opened is quarantined (parked
/// with the reason), never sent, and never holds up the items behind it.
///
/// Each key has a ``KeyState``, declared by the operator in `<directory>/key-states.json`, an object of key id to
/// state (`{"k3": "active", "k1": "retired"}`): a key it does not name is `decrypt-only`; at most one is `active`,
/// and the active key opens an envelope with an empty `key_id` when there is no ``defaultKeyID``. An envelope under a
/// `retired` key is quarantined ("key k1 is retired"), not opened. The file is read once (``check()`` or the first
/// envelope) and again by ``reloadStates()``.
public final class EnvelopeKeyring: Sendable {
    /// The directory the keys are read from.
    public let directory: String
    /// The key id an envelope with an empty `key_id` is opened with (C3-PRO apps send `""` when they have none).
    public let defaultKeyID: String?
    private let loaded = NIOLockedValueBox<[String: EnvelopeOpener]>([:])
    /// The states read from the file (nil: not read yet), or why it does not read.
    private let states = NIOLockedValueBox<Result<KeyStates, Failure>?>(nil)
    /// Envelopes opened per key id since ``takeOpenCounts()`` last took them.
    private let openCounts = NIOLockedValueBox<[String: Int]>([:])

    /// The name of the file in the keys directory that declares the keys' states.
    public static let statesFileName = "key-states.json"

    /// What an operator declares of a key (`key-states.json`).
    public enum KeyState: String, Sendable, CaseIterable, Codable {
        /// The key new app builds are given (at most one); it also opens envelopes with an empty `key_id` when
        /// there is no default key id.
        case active
        /// Opens envelopes of app builds that have it; a key the file does not name is in this state.
        case decryptOnly = "decrypt-only"
        /// Opens nothing: its envelopes are quarantined with the reason "key <id> is retired".
        case retired
    }

    /// The states the file declares.
    struct KeyStates: Sendable {
        var byID: [String: KeyState] = [:]
        var active: String? { byID.first { $0.value == .active }?.key }
    }

    /// Why an envelope could not be opened: the quarantine's reason (no key material, no plaintext).
    public enum Failure: Error, Sendable, Equatable, CustomStringConvertible {
        /// No key of this id is in the directory (or the id is empty and there is no default).
        case unknownKey(String)
        /// The key file of this id is there but is not a readable RSA private key.
        case unreadableKey(String)
        /// The envelope is not one (not JSON, a member missing); checked at ingest, so only a damaged row.
        case malformed(String)
        /// The symmetric key does not unwrap with the key of this id, the message does not decrypt, or what it
        /// decrypts to is not one FHIR resource in JSON. These are one failure, told apart nowhere (not in the
        /// reason, the metrics or the log): a C3-PRO message is CBC without authentication, and a receiver that said
        /// "bad padding" for one and "no resource" for the other would be a padding oracle to anyone who can post an
        /// envelope and read either.
        case doesNotOpen(String)
        /// The key of this id is retired (`key-states.json`): its envelopes are not opened.
        case retired(String)
        /// `key-states.json` is not a valid declaration of the keys' states (why).
        case invalidStates(String)

        /// The reason, as the quarantine shows it.
        public var description: String {
            switch self {
            case .unknownKey(let id): "no key for key_id \(FHIRResource.printable(id)) in the keys directory"
            case .unreadableKey(let id): "the key of key_id \(FHIRResource.printable(id)) is not a readable RSA private key"
            case .malformed(let why): "not an envelope: \(why)"
            case .doesNotOpen(let id):
                "the envelope does not open with the key of key_id \(FHIRResource.printable(id)) into a FHIR resource"
            case .retired(let id): "key \(FHIRResource.printable(id)) is retired"
            case .invalidStates(let why): "\(EnvelopeKeyring.statesFileName): \(why)"
            }
        }
    }

    /// A keyring over `directory`; nothing is read until an envelope names a key (``check()`` reads them all).
    public init(directory: String, defaultKeyID: String? = nil) {
        self.directory = directory
        self.defaultKeyID = defaultKeyID.flatMap { $0.isEmpty ? nil : $0 }
    }

    /// The key ids the directory holds now, sorted.
    public func keyIDs() -> [String] {
        let names = (try? FileManager.default.contentsOfDirectory(atPath: directory)) ?? []
        var ids: Set<String> = []
        for name in names where !name.hasPrefix(".") {
            if name.hasSuffix(".pem") {
                ids.insert(String(name.dropLast(4)))
            } else if FileManager.default.fileExists(atPath: directory + "/" + name + "/private-c3pro.der") {
                ids.insert(name)
            }
        }
        return ids.sorted()
    }

    /// Reads every key in the directory and the states file; throws the first that cannot be read, a state file
    /// that names a key the directory does not hold, or a retired default key (for `dq doctor` and the start).
    /// - Returns: the key ids read.
    @discardableResult
    public func check() throws(Failure) -> [String] {
        let ids = keyIDs()
        for id in ids { _ = try opener(for: id) }
        if let defaultKeyID, !ids.contains(defaultKeyID) { throw .unknownKey(defaultKeyID) }
        try checkStates()
        return ids
    }

    /// Reads the states file (once; ``reloadStates()`` reads it again) and throws when it does not read, names a key
    /// the directory does not hold, or retires the default key; the keys themselves are not read.
    public func checkStates() throws(Failure) {
        try validate(try keyStates())
    }

    /// Throws when `states` names a key the directory does not hold, or retires the default key.
    private func validate(_ states: KeyStates) throws(Failure) {
        let ids = keyIDs()
        if let absent = states.byID.keys.sorted().first(where: { !ids.contains($0) }) {
            throw .invalidStates("it names key \(FHIRResource.printable(absent)), which is not in the keys directory")
        }
        if let defaultKeyID, states.byID[defaultKeyID] == .retired {
            throw .invalidStates("the default key \(FHIRResource.printable(defaultKeyID)) (\"serve.default_key_id\") is retired")
        }
    }

    /// The state of the key `id` (``KeyState/decryptOnly`` when the file does not name it).
    /// - Throws: ``Failure/invalidStates(_:)`` when the states file does not read.
    public func state(of id: String) throws(Failure) -> KeyState {
        try keyStates().byID[id] ?? .decryptOnly
    }

    /// The file of the key `id`: `<directory>/<id>/private-c3pro.der` or `<directory>/<id>.pem`, whichever is there.
    public func keyFile(of id: String) -> String? {
        guard Self.isKeyID(id) else { return nil }
        return [directory + "/" + id + "/private-c3pro.der", directory + "/" + id + ".pem"].first {
            FileManager.default.fileExists(atPath: $0)
        }
    }

    /// The SHA-256 of the key's public key as DER SubjectPublicKeyInfo, in hexadecimal: the fingerprint
    /// `openssl pkey -pubout -outform DER | openssl dgst -sha256` prints for the key or its certificate.
    public func publicKeyFingerprint(of id: String) throws(Failure) -> String {
        guard let file = keyFile(of: id), let data = FileManager.default.contents(atPath: file) else { throw .unknownKey(id) }
        let key: _RSA.Encryption.PrivateKey
        do {
            key =
                file.hasSuffix(".pem")
                ? try _RSA.Encryption.PrivateKey(unsafePEMRepresentation: String(decoding: data, as: UTF8.self))
                : try _RSA.Encryption.PrivateKey(unsafeDERRepresentation: data)
        } catch {
            throw .unreadableKey(id)
        }
        return SHA256.hash(data: key.publicKey.derRepresentation).hexString
    }

    /// Reads `key-states.json` again (`dq serve` on SIGHUP); a file that does not read is thrown, and the states
    /// read before stay.
    public func reloadStates() throws(Failure) {
        let read = Self.readStates(directory)
        guard case .success(let states) = read else {
            if case .failure(let failure) = read { throw failure }
            return
        }
        // The checks of a start, on the file read now: a file that would not start dq serve does not replace the
        // running states (a retired default key would quarantine every envelope with an empty key_id).
        try validate(states)
        self.states.withLockedValue { $0 = read }
    }

    /// The envelopes opened per key id since the last call (what a flush adds to the queue's durable counts), and
    /// zero from now on.
    package func takeOpenCounts() -> [String: Int] {
        openCounts.withLockedValue { counts in
            defer { counts = [:] }
            return counts
        }
    }

    /// Gives back counts ``takeOpenCounts()`` took that could not be stored, to be taken again.
    package func restoreOpenCounts(_ counts: [String: Int]) {
        openCounts.withLockedValue { current in current.merge(counts, uniquingKeysWith: +) }
    }

    private func keyStates() throws(Failure) -> KeyStates {
        let read = states.withLockedValue { current in
            if let current { return current }
            let read = Self.readStates(directory)
            current = read
            return read
        }
        return try read.get()
    }

    /// The states declared in the directory's file; none when there is no file.
    private static func readStates(_ directory: String) -> Result<KeyStates, Failure> {
        let path = directory + "/" + statesFileName
        guard FileManager.default.fileExists(atPath: path) else { return .success(KeyStates()) }
        guard let data = FileManager.default.contents(atPath: path) else { return .failure(.invalidStates("cannot be read")) }
        guard let object = (try? JSONSerialization.jsonObject(with: data)) as? [String: Any] else {
            return .failure(.invalidStates("must be a JSON object of key id to state (\(choices))"))
        }
        var read = KeyStates()
        for (id, value) in object.sorted(by: { $0.key < $1.key }) {
            guard isKeyID(id) else { return .failure(.invalidStates("\(FHIRResource.printable(id)) is not a key id")) }
            guard let text = value as? String, let state = KeyState(rawValue: text) else {
                return .failure(.invalidStates("the state of key \(FHIRResource.printable(id)) must be one of \(choices)"))
            }
            read.byID[id] = state
        }
        let active = read.byID.filter { $0.value == .active }.keys.sorted()
        if active.count > 1 {
            return .failure(.invalidStates("at most one key may be active; \(active.joined(separator: ", ")) are"))
        }
        return .success(read)
    }

    private static var choices: String { KeyState.allCases.map { "\"\($0.rawValue)\"" }.joined(separator: ", ") }

    /// Whether `id` can name a key: a name in the directory, never a path.
    private static func isKeyID(_ id: String) -> Bool {
        !id.isEmpty && !id.contains("/") && id != "." && id != ".." && !id.contains("\0")
    }

    /// Forgets the keys read so far: each is read again from the directory when an envelope next names it (a key
    /// file replaced at its path; `dq serve` calls this on SIGHUP).
    public func forgetKeys() {
        loaded.withLockedValue { $0 = [:] }
    }

    /// The resource inside `envelope`, opened in memory with the key its `key_id` names.
    ///
    /// Counts `dq_envelopes_opened_total{key_id}` and `dq_envelopes_quarantined_total{key_id,reason}` (a key id
    /// the directory does not hold, or an envelope too damaged to name one, is counted as `unknown`: what a sender
    /// writes there is not a label).
    ///
    /// Each envelope opened is also counted per key id, for the durable counts `dq serve keys` shows.
    public func open(_ envelope: Data) throws(Failure) -> FHIRResource {
        try openNamingKey(envelope).resource
    }

    /// The resource inside `envelope` and the id of the key that opened it, counted as ``open(_:)`` counts.
    public func openNamingKey(_ envelope: Data) throws(Failure) -> (resource: FHIRResource, keyID: String) {
        do {
            let (resource, id) = try openCounted(envelope)
            Counter(label: "dq_envelopes_opened_total", dimensions: [("key_id", id)]).increment()
            openCounts.withLockedValue { $0[id, default: 0] += 1 }
            return (resource, id)
        } catch {
            let (id, reason): (String, String) =
                switch error {
                case .unknownKey: ("unknown", "unknown_key")
                case .unreadableKey(let id): (id, "unreadable_key")
                case .malformed: ("unknown", "malformed")
                case .doesNotOpen(let id): (id, "does_not_open")
                case .retired(let id): (id, "retired_key")
                case .invalidStates: ("unknown", "invalid_key_states")
                }
            Counter(label: "dq_envelopes_quarantined_total", dimensions: [("key_id", id), ("reason", reason)]).increment()
            throw error
        }
    }

    /// The resource inside `envelope`, opened as ``open(_:)`` opens it but counted nowhere: for a receiver that
    /// looks inside a request before it is queued (a keyed repeat's fingerprint), which its delivery opens again.
    package func openUncounted(_ envelope: Data) throws(Failure) -> FHIRResource {
        try openCounted(envelope).0
    }

    private func openCounted(_ envelope: Data) throws(Failure) -> (FHIRResource, String) {
        guard let object = (try? JSONSerialization.jsonObject(with: envelope)) as? [String: Any] else {
            throw .malformed("not a JSON object")
        }
        guard let named = object["key_id"] as? String else { throw .malformed("\"key_id\" is not a string") }
        let trimmed = named.trimmingCharacters(in: .whitespacesAndNewlines)
        let read = try keyStates()
        guard let id = trimmed.isEmpty ? defaultKeyID ?? read.active : trimmed else { throw .unknownKey("") }
        if read.byID[id] == .retired { throw .retired(id) }
        let opener = try opener(for: id)
        // One failure whatever step fails (see `doesNotOpen`).
        guard let plaintext = try? opener.open(envelope), let resource = try? FHIRResource(json: plaintext) else {
            throw .doesNotOpen(id)
        }
        return (resource, id)
    }

    private func opener(for id: String) throws(Failure) -> EnvelopeOpener {
        if let known = loaded.withLockedValue({ $0[id] }) { return known }
        // A key id is a name in the directory, never a path.
        guard Self.isKeyID(id) else { throw .unknownKey(id) }
        let opener: EnvelopeOpener
        if let der = FileManager.default.contents(atPath: directory + "/" + id + "/private-c3pro.der") {
            guard let read = try? EnvelopeOpener(privateKeyDER: der) else { throw .unreadableKey(id) }
            opener = read
        } else if let pem = FileManager.default.contents(atPath: directory + "/" + id + ".pem") {
            guard let read = try? EnvelopeOpener(privateKeyPEM: String(decoding: pem, as: UTF8.self)) else {
                throw .unreadableKey(id)
            }
            opener = read
        } else if [directory + "/" + id + "/private-c3pro.der", directory + "/" + id + ".pem"].contains(where: {
            FileManager.default.fileExists(atPath: $0)
        }) {
            // There, but not readable by this user (or not a file): not the same as no key at all.
            throw .unreadableKey(id)
        } else {
            throw .unknownKey(id)
        }
        loaded.withLockedValue { $0[id] = opener }
        return opener
    }
}
