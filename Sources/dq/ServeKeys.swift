import ArgumentParser
import FHIRDataQueue
import Foundation

extension DQ.Serve {
    /// `dq serve keys`: each key in `serve.keys_dir` with its state (`key-states.json`), its file, the fingerprint of
    /// its public key, and how many envelopes it opened in the last 7 and 30 days (from the queue's database), so
    /// that an operator sees when a key is no longer used and can be retired.
    struct Keys: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "keys",
            abstract: "List the keys of \"serve.keys_dir\": state, file, fingerprint, envelopes opened in the last 7 and 30 days.",
            discussion: """
                A key's state is declared in <keys_dir>/key-states.json, an object of key id to "active", \
                "decrypt-only" or "retired" (a key it does not name is decrypt-only; at most one is active, and it \
                opens envelopes with an empty key_id when "serve.default_key_id" is unset). An envelope under a \
                retired key is quarantined. dq serve reads the file at its start and on SIGHUP. The fingerprint is \
                the SHA-256 of the public key's DER SubjectPublicKeyInfo (openssl pkey -pubout -outform DER | \
                openssl dgst -sha256). Days are UTC days, today included.
                """)

        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Print as JSON.") var json = false

        /// One key as listed.
        struct Listed: Encodable {
            var id: String
            var state: String
            var file: String
            /// SHA-256 of the public key's SubjectPublicKeyInfo, hexadecimal; nil when the key does not read.
            var spkiSHA256: String?
            /// Whether it opens envelopes with an empty `key_id`.
            var answersEmptyKeyID: Bool
            var openedLast7Days: Int
            var openedLast30Days: Int
            /// Why the key does not read, if it does not.
            var problem: String?
        }

        func run() async throws {
            try await withQueue(queueOptions) { queue, settings in
                let serve = try ServeSettings.load(from: settings.sourcePath)
                guard let directory = serve.keysDirectory else {
                    throw DataQueueError(.invalidConfiguration, "\"serve.keys_dir\" is not set: there are no keys to list")
                }
                let keyring = EnvelopeKeyring(directory: directory, defaultKeyID: serve.defaultKeyID)
                for warning in serve.exposureWarnings() { printError("dq: warning: \(warning)") }
                let listed = try await Self.list(keyring, opens: queue.keyOpenLog, now: Date())
                if json {
                    try printJSON(listed)
                    return
                }
                if listed.isEmpty {
                    print("no key in \(directory)")
                    return
                }
                print("KEY\tSTATE\tOPENED 7D\tOPENED 30D\tSPKI SHA-256\tFILE")
                for key in listed {
                    let state = key.state + (key.answersEmptyKeyID ? " (empty key_id)" : "")
                    let fingerprint = key.spkiSHA256 ?? "unreadable: \(key.problem ?? "")"
                    print("\(key.id)\t\(state)\t\(key.openedLast7Days)\t\(key.openedLast30Days)\t\(fingerprint)\t\(key.file)")
                }
            }
        }

        /// The keys of `keyring`'s directory, sorted by id.
        /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when the states file does not read.
        static func list(_ keyring: EnvelopeKeyring, opens log: (any KeyOpenLog)?, now: Date) async throws -> [Listed] {
            let today = keyOpenDay(of: now)
            let counts = try await log?.keyOpens(since: today - 29) ?? [:]
            var listed: [Listed] = []
            var active: String?
            let states: [String: EnvelopeKeyring.KeyState]
            do {
                try keyring.checkStates()
                states = try Dictionary(uniqueKeysWithValues: keyring.keyIDs().map { ($0, try keyring.state(of: $0)) })
            } catch {
                throw DataQueueError(.invalidConfiguration, "\"serve.keys_dir\": \(error)")
            }
            for id in keyring.keyIDs() {
                let state = states[id] ?? .decryptOnly
                if state == .active { active = id }
                var key = Listed(
                    id: id, state: state.rawValue, file: keyring.keyFile(of: id) ?? "", answersEmptyKeyID: false,
                    openedLast7Days: counts[id, default: [:]].filter { $0.key > today - 7 }.values.reduce(0, +),
                    openedLast30Days: counts[id, default: [:]].values.reduce(0, +))
                do {
                    key.spkiSHA256 = try keyring.publicKeyFingerprint(of: id)
                } catch {
                    key.problem = error.description
                }
                listed.append(key)
            }
            let empty = keyring.defaultKeyID ?? active
            for index in listed.indices where listed[index].id == empty { listed[index].answersEmptyKeyID = true }
            return listed
        }
    }
}
