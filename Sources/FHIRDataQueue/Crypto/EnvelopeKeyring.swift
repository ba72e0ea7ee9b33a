import Foundation
import Metrics
import Synchronization

/// The private keys a receiver opens envelopes with, chosen by each envelope's `key_id`, read from a directory:
/// `<directory>/<key_id>/private-c3pro.der` (the C3-PRO consumer's layout: PKCS#8 DER) or
/// `<directory>/<key_id>.pem`. Many keys are live at once (key rotation: old app builds keep their key id); a key
/// added to the directory is read when an envelope first names it, without a restart.
///
/// A queue given a keyring (``DataQueue/Configuration/envelopeKeyring``) opens its envelopes in memory when it
/// sends them and sends the resource inside to its server; an envelope that cannot be opened is quarantined (parked
/// with the reason), never sent, and never holds up the items behind it.
public final class EnvelopeKeyring: Sendable {
    /// The directory the keys are read from.
    public let directory: String
    /// The key id an envelope with an empty `key_id` is opened with (C3-PRO apps send `""` when they have none).
    public let defaultKeyID: String?
    private let loaded = Mutex<[String: EnvelopeOpener]>([:])

    /// Why an envelope could not be opened: the quarantine's reason (no key material, no plaintext).
    public enum Failure: Error, Sendable, Equatable, CustomStringConvertible {
        /// No key of this id is in the directory (or the id is empty and there is no default).
        case unknownKey(String)
        /// The key file of this id is there but is not a readable RSA private key.
        case unreadableKey(String)
        /// The envelope is not one (not JSON, a member missing); checked at ingest, so only a damaged row.
        case malformed(String)
        /// The symmetric key does not unwrap with the key of this id, or the message does not decrypt.
        case doesNotOpen(String)
        /// It opens, but what is inside is not one FHIR resource in JSON.
        case notAResource(String)

        /// The reason, as the quarantine shows it.
        public var description: String {
            switch self {
            case .unknownKey(let id): "no key for key_id \(FHIRResource.printable(id)) in the keys directory"
            case .unreadableKey(let id): "the key of key_id \(FHIRResource.printable(id)) is not a readable RSA private key"
            case .malformed(let why): "not an envelope: \(why)"
            case .doesNotOpen(let id): "the envelope does not open with the key of key_id \(FHIRResource.printable(id))"
            case .notAResource(let why): "the envelope opens, but holds no FHIR resource: \(why)"
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

    /// Reads every key in the directory; throws the first that cannot be read (for `dq doctor` and the start).
    /// - Returns: the key ids read.
    @discardableResult
    public func check() throws(Failure) -> [String] {
        let ids = keyIDs()
        for id in ids { _ = try opener(for: id) }
        if let defaultKeyID, !ids.contains(defaultKeyID) { throw .unknownKey(defaultKeyID) }
        return ids
    }

    /// Forgets the keys read so far: each is read again from the directory when an envelope next names it (a key
    /// file replaced at its path; `dq serve` calls this on SIGHUP).
    public func forgetKeys() {
        loaded.withLock { $0 = [:] }
    }

    /// The resource inside `envelope`, opened in memory with the key its `key_id` names.
    ///
    /// Counts `dq_envelopes_opened_total{key_id}` and `dq_envelopes_quarantined_total{key_id,reason}` (a key id
    /// the directory does not hold is counted as `unknown`: what a sender writes there is not a label).
    public func open(_ envelope: Data) throws(Failure) -> FHIRResource {
        do {
            let (resource, id) = try openCounted(envelope)
            Counter(label: "dq_envelopes_opened_total", dimensions: [("key_id", id)]).increment()
            return resource
        } catch {
            let (id, reason): (String, String) =
                switch error {
                case .unknownKey: ("unknown", "unknown_key")
                case .unreadableKey(let id): (id, "unreadable_key")
                case .malformed: ("unknown", "malformed")
                case .doesNotOpen(let id): (id, "does_not_open")
                case .notAResource(_): ("unknown", "not_a_resource")
                }
            Counter(label: "dq_envelopes_quarantined_total", dimensions: [("key_id", id), ("reason", reason)]).increment()
            throw error
        }
    }

    private func openCounted(_ envelope: Data) throws(Failure) -> (FHIRResource, String) {
        guard let object = (try? JSONSerialization.jsonObject(with: envelope)) as? [String: Any] else {
            throw .malformed("not a JSON object")
        }
        guard let named = object["key_id"] as? String else { throw .malformed("\"key_id\" is not a string") }
        let trimmed = named.trimmingCharacters(in: .whitespacesAndNewlines)
        guard let id = trimmed.isEmpty ? defaultKeyID : trimmed else { throw .unknownKey("") }
        let opener = try opener(for: id)
        let plaintext: Data
        do {
            plaintext = try opener.open(envelope)
        } catch {
            throw .doesNotOpen(id)
        }
        do {
            return (try FHIRResource(json: plaintext), id)
        } catch let error as DataQueueError {
            throw .notAResource(error.message)
        } catch {
            throw .notAResource("not JSON")
        }
    }

    private func opener(for id: String) throws(Failure) -> EnvelopeOpener {
        if let known = loaded.withLock({ $0[id] }) { return known }
        // A key id is a name in the directory, never a path.
        guard !id.isEmpty, !id.contains("/"), id != ".", id != "..", !id.contains("\0") else { throw .unknownKey(id) }
        let opener: EnvelopeOpener
        if let der = FileManager.default.contents(atPath: directory + "/" + id + "/private-c3pro.der") {
            guard let read = try? EnvelopeOpener(privateKeyDER: der) else { throw .unreadableKey(id) }
            opener = read
        } else if let pem = FileManager.default.contents(atPath: directory + "/" + id + ".pem") {
            guard let read = try? EnvelopeOpener(privateKeyPEM: String(decoding: pem, as: UTF8.self)) else {
                throw .unreadableKey(id)
            }
            opener = read
        } else {
            throw .unknownKey(id)
        }
        loaded.withLock { $0[id] = opener }
        return opener
    }
}
