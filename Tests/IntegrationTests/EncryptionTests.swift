import Foundation
import Testing

/// The encrypted queue, checked by an independent decryptor (Python `cryptography`, and the openssl CLI).
@Suite("EncryptedDataQueue against an independent C3-PRO receiver", .serialized, .enabled(if: Peers.enabled))
struct EncryptionTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    func config(server: String, receiver: String, certificate: String, types: [String]? = nil, mode: String = "c3pro")
        throws -> [String: String]
    {
        var encryption: [String: Any] = ["endpoint": receiver, "certificate": certificate, "key_id": "test-key", "mode": mode]
        if let types { encryption["resource_types"] = types }
        let object: [String: Any] = ["server": server, "database": work.file("queue.sqlite"), "encryption": encryption]
        let path = work.file("dq-\(UUID().uuidString.prefix(8)).json")
        try JSONSerialization.data(withJSONObject: object).write(to: URL(fileURLWithPath: path))
        return ["DQ_CONFIG": path, "HOME": work.path]
    }

    @Test(
        "Every envelope dq makes is decrypted by the receiver, and the server holds exactly the originals",
        arguments: ["c3pro", "authenticated"])
    func endToEnd(mode: String) async throws {
        let keys = try await TestKeys()
        let server = try await FHIRServer.start()
        let receiver = try await C3PROReceiver(key: keys.privateKey, forwardTo: server)
        let env = try config(server: server.base, receiver: receiver.base, certificate: keys.certificate, mode: mode)
        let originals = (0..<8).map { resources.observation($0, extra: " é ✓") }
        let file = try work.write("in.ndjson", originals.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let flushed = try await dq(["flush"], env)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect((try await receiver.stats())["forwarded"] as? Int == 8)
        let stored = try await server.resources("Observation", system: resources.system)
        #expect(stored.map(\.0) == (0..<8).map(String.init))
        for (index, entry) in stored.enumerated() {
            let original = try #require(try JSONSerialization.jsonObject(with: Data(originals[index].utf8)) as? [String: Any])
            #expect((entry.1["code"] as? [String: Any])?["text"] as? String == (original["code"] as? [String: Any])?["text"] as? String)
        }
    }

    @Test("The queue stores only the envelope: a marker in the resource is nowhere in the database files")
    func noPlaintextOnDisk() async throws {
        let keys = try await TestKeys()
        let marker = "PHI-MARKER-\(UUID().uuidString)"
        let resource = #"{"resourceType":"Patient","name":[{"family":"\#(marker)"}]}"#
        let file = try work.write("p.json", resource)

        // Encrypted: the marker must not be on disk.
        let env = try config(server: "http://127.0.0.1:9/fhir", receiver: "http://127.0.0.1:9/enc", certificate: keys.certificate)
        #expect(try await dq(["enqueue", file], env).status == 0)
        // Keep a reader open so the WAL is not checkpointed away, then look at every file.
        let files = try FileManager.default.contentsOfDirectory(atPath: work.path).filter { $0.hasPrefix("queue.sqlite") }
        #expect(files.contains("queue.sqlite"))
        for name in files {
            let bytes = try Data(contentsOf: URL(fileURLWithPath: work.file(name)))
            #expect(bytes.range(of: Data(marker.utf8)) == nil, "\(name) holds the plaintext")
        }

        // Control: the same resource without encryption is on disk in plaintext (so the check can fail).
        let plain = ["DQ_SERVER": "http://127.0.0.1:9/fhir", "DQ_DATABASE": work.file("plain.sqlite"), "HOME": work.path]
        #expect(try await dq(["enqueue", file], plain).status == 0)
        let plainBytes =
            try Data(contentsOf: URL(fileURLWithPath: work.file("plain.sqlite")))
            + ((try? Data(contentsOf: URL(fileURLWithPath: work.file("plain.sqlite-wal")))) ?? Data())
        #expect(plainBytes.range(of: Data(marker.utf8)) != nil)
    }

    @Test("With resource_types, encrypted and plain resources reach the right endpoints, in order")
    func routing() async throws {
        let keys = try await TestKeys()
        let server = try await FHIRServer.start()
        let receiver = try await C3PROReceiver(key: keys.privateKey, forwardTo: server)
        let env = try config(server: server.base, receiver: receiver.base, certificate: keys.certificateDER, types: ["Observation"])
        var lines: [String] = []
        for index in 0..<6 {
            lines.append(
                index % 2 == 0
                    ? resources.observation(index)
                    : #"{"resourceType":"Patient","identifier":[{"system":"\#(resources.system)","value":"\#(index)"}]}"#)
        }
        let file = try work.write("mixed.ndjson", lines.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        #expect((try await receiver.stats())["forwarded"] as? Int == 3)
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(
            journal.map { $0["url"] as? String } == (0..<6).map { $0 % 2 == 0 ? receiver.base + "/Observation" : server.base + "/Patient" })
        #expect(try await server.values("Observation", system: resources.system) == ["0", "2", "4"])
        #expect(try await server.values("Patient", system: resources.system) == ["1", "3", "5"])
    }

    @Test("A receiver that answers 200 with an error body has not accepted the item: it is parked, never journaled")
    func errorBodyIsNotDelivered() async throws {
        let keys = try await TestKeys()
        let otherKeys = try await TestKeys()
        let server = try await FHIRServer.start()
        // The receiver holds a different private key, so it cannot decrypt and answers {'error':…} with 200.
        let receiver = try await C3PROReceiver(key: otherKeys.privateKey, forwardTo: server)
        let env = try config(server: server.base, receiver: receiver.base, certificate: keys.certificate)
        let file = try work.write("o.json", resources.observation(0))
        #expect(try await dq(["enqueue", file], env).status == 0)
        let flushed = try await dq(["flush"], env)
        #expect(flushed.stdout.contains("0 delivered, 1 parked"), "\(flushed.stdout)")
        #expect((try await receiver.stats())["failed"] as? Int == 1)
        let log = try await dq(["log", "--json"], env)
        #expect(log.stdout.contains("delivered") == false)
    }

    @Test("A bare \"OK\" answer counts as delivered")
    func okStringIsSuccess() async throws {
        let keys = try await TestKeys()
        let server = try await FHIRServer.start()
        let receiver = try await C3PROReceiver(key: keys.privateKey, forwardTo: server, reply: "ok")
        let env = try config(server: server.base, receiver: receiver.base, certificate: keys.publicKey)
        let file = try work.write("o.json", resources.observation(0))
        let sent = try await dq(["send", file], env)
        #expect(sent.status == 0, "\(sent.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])
    }

    @Test("dq decrypt opens an envelope made by Python; Python and openssl open envelopes made by dq")
    func bothDirections() async throws {
        let keys = try await TestKeys()
        // A small resource, and one of 150 KB: dq encrypts the C3-PRO message in 48 KiB chunks.
        for resource in [
            resources.observation(1, extra: " ünïcode"), resources.observation(2, extra: String(repeating: "x", count: 150_000)),
        ] {
            try await bothDirections(resource, keys: keys)
        }
    }

    func bothDirections(_ resource: String, keys: TestKeys) async throws {
        let plain = try work.write("r.json", resource)

        let sealed = try await C3PROReceiver.tool(["seal", "--cert", keys.certificate, "--key-id", "k", plain])
        #expect(sealed.status == 0, "\(sealed.stderr)")
        let envelope = try work.write("py-envelope.json", sealed.stdout)
        let decrypted = try await dq(["decrypt", "--key", keys.privateKey, envelope], [:])
        #expect(decrypted.status == 0, "\(decrypted.stderr)")
        #expect(decrypted.stdout == resource + "\n")

        for mode in ["c3pro", "authenticated"] {
            let env = try config(
                server: "http://127.0.0.1:9/fhir", receiver: "http://127.0.0.1:9/enc", certificate: keys.certificate, mode: mode)
            _ = try? FileManager.default.removeItem(atPath: work.file("queue.sqlite"))
            let enqueued = try await dq(["enqueue", "--json", plain], env)
            let items = try #require(try JSONSerialization.jsonObject(with: Data(enqueued.stdout.utf8)) as? [[String: Any]])
            let id = try #require(items.first?["id"] as? String)
            let shown = try await dq(["show", "--json", "--body", id], env)
            let object = try #require(try JSONSerialization.jsonObject(with: Data(shown.stdout.utf8)) as? [String: Any])
            let body = try #require(object["body"] as? String)
            let dqEnvelope = try work.write("dq-\(mode).json", body)
            let opened = try await C3PROReceiver.tool(["open", "--key", keys.privateKey, dqEnvelope])
            #expect(opened.status == 0, "\(opened.stderr)")
            #expect(opened.stdout == resource)
            let ourselves = try await dq(["decrypt", "--key", keys.privateKey, "-"], [:], stdin: Data(body.utf8))
            #expect(ourselves.stdout == resource + "\n")
            if mode == "c3pro" {
                // The openssl CLI, with the Java consumer's exact semantics: OAEP-SHA1 key, AES-256-CBC zero IV.
                let envelopeObject = try #require(try JSONSerialization.jsonObject(with: Data(body.utf8)) as? [String: String])
                let wrapped = try work.write("key.bin", "")
                try Data(base64Encoded: envelopeObject["symmetric_key"]!)!.write(to: URL(fileURLWithPath: wrapped))
                let keyOut = work.file("key.raw")
                try await TestKeys.openssl([
                    "pkeyutl", "-decrypt", "-inkey", keys.privateKey, "-pkeyopt", "rsa_padding_mode:oaep",
                    "-pkeyopt", "rsa_oaep_md:sha1", "-in", wrapped, "-out", keyOut,
                ])
                let keyHex = try Data(contentsOf: URL(fileURLWithPath: keyOut)).map { String(format: "%02x", $0) }.joined()
                #expect(keyHex.count == 64)
                let message = try work.write("msg.bin", "")
                try Data(base64Encoded: envelopeObject["message"]!)!.write(to: URL(fileURLWithPath: message))
                let out = try await TestKeys.openssl([
                    "enc", "-d", "-aes-256-cbc", "-K", keyHex, "-iv", String(repeating: "0", count: 32), "-in", message,
                ])
                #expect(out.stdout == resource)
            }
        }
    }

    @Test("Bad certificates and keys exit 78, a corrupt envelope exits 65, and nothing queued is lost")
    func badInputs() async throws {
        let keys = try await TestKeys()
        let good = try config(server: "http://127.0.0.1:9/fhir", receiver: "http://127.0.0.1:9/enc", certificate: keys.certificate)
        let file = try work.write("o.json", resources.observation(0))
        #expect(try await dq(["enqueue", file], good).status == 0)

        let cases: [(String, String)] = [
            (work.file("missing.crt"), "cannot read the certificate file"),
            (try await keys.smallCertificate(), "certificate"),
            (try await keys.ecCertificate(), "not an RSA key"),
            (file, "not an X.509 certificate or a PUBLIC KEY"),
        ]
        for (certificate, message) in cases {
            let env = try config(server: "http://127.0.0.1:9/fhir", receiver: "http://127.0.0.1:9/enc", certificate: certificate)
            let result = try await dq(["enqueue", file], env)
            #expect(result.status == 78, "\(certificate): \(result.stderr)")
            #expect(result.stderr.contains("\"encryption.certificate\""), "\(result.stderr)")
            #expect(result.stderr.contains(message), "\(result.stderr)")
        }
        let status = try await dq(["status", "--json"], good)
        #expect(status.stdout.contains("\"pending\" : 1"), "\(status.stdout)")

        let corrupt = try work.write("corrupt.json", #"{"key_id":"k","symmetric_key":"AAAA","message":"AAAA","version":"1.0.2"}"#)
        let badEnvelope = try await dq(["decrypt", "--key", keys.privateKey, corrupt], [:])
        #expect(badEnvelope.status == 65)
        #expect(badEnvelope.stderr.contains("cannot be unwrapped"))
        let notJSON = try await dq(["decrypt", "--key", keys.privateKey, file], [:])
        #expect(notJSON.status == 65)
        #expect(notJSON.stderr.contains("\"key_id\" is missing"))
        let badKey = try await dq(["decrypt", "--key", keys.certificate, corrupt], [:])
        #expect(badKey.status == 78)
        let missingKey = try await dq(["decrypt", "--key", work.file("nope.pem"), corrupt], [:])
        #expect(missingKey.status == 78)
        // An envelope file that cannot be read is missing input (66), as for dq enqueue, not bad data (65).
        let missingEnvelope = try await dq(["decrypt", "--key", keys.privateKey, work.file("nope.json")], [:])
        #expect(missingEnvelope.status == 66, "\(missingEnvelope.stderr)")
        #expect(missingEnvelope.stderr.contains("nope.json: cannot be read"), "\(missingEnvelope.stderr)")
    }
}
