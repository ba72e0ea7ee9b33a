import Foundation
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// The receiving side's keyring, on envelopes made by the openssl command line (AES-256-CBC with a zero IV, the
/// key RSA-OAEP-SHA1 wrapped, as C3-PRO apps make them): independent of dq's own sealer.
@Suite("Envelope keyring: opening by key_id, and quarantine in the queue")
struct EnvelopeKeyringTests {
    let scratch: Scratch
    var directory: String { scratch.url.path }
    var keys: String { scratch.url.appendingPathComponent("keys").path }

    init() throws {
        scratch = try Scratch("dq-keyring")
        try FileManager.default.createDirectory(atPath: scratch.url.appendingPathComponent("keys").path, withIntermediateDirectories: true)
    }

    private func openssl(_ arguments: [String]) async throws {
        let status = try await runToExit("/usr/bin/openssl", arguments)
        #expect(status == 0, "openssl \(arguments.joined(separator: " "))")
    }

    /// Makes an RSA key; returns the paths of its private PEM and public PEM (outside the keys directory).
    private func makeKey(_ name: String) async throws -> (privatePEM: String, publicPEM: String) {
        let privatePEM = directory + "/\(name).key.pem"
        let publicPEM = directory + "/\(name).pub.pem"
        try await openssl(["genrsa", "-out", privatePEM, "2048"])
        try await openssl(["rsa", "-in", privatePEM, "-pubout", "-out", publicPEM])
        return (privatePEM, publicPEM)
    }

    /// An envelope as a C3-PRO app makes it, made with the openssl command line.
    private func envelope(_ plaintext: Data, for publicPEM: String, keyID: String) async throws -> Data {
        let name = UUID().uuidString
        let plainFile = directory + "/\(name).plain"
        let keyFile = directory + "/\(name).aes"
        try plaintext.write(to: URL(fileURLWithPath: plainFile))
        let aesKey = Data((0..<32).map { _ in UInt8.random(in: 0...255) })
        try aesKey.write(to: URL(fileURLWithPath: keyFile))
        let hex = aesKey.map { String(format: "%02x", $0) }.joined()
        try await openssl([
            "enc", "-aes-256-cbc", "-K", hex, "-iv", String(repeating: "0", count: 32), "-in", plainFile, "-out", plainFile + ".enc",
        ])
        try await openssl([
            "pkeyutl", "-encrypt", "-pubin", "-inkey", publicPEM, "-pkeyopt", "rsa_padding_mode:oaep", "-in", keyFile, "-out",
            keyFile + ".wrapped",
        ])
        let message = try Data(contentsOf: URL(fileURLWithPath: plainFile + ".enc"))
        let wrapped = try Data(contentsOf: URL(fileURLWithPath: keyFile + ".wrapped"))
        let object: [String: String] = [
            "key_id": keyID, "symmetric_key": wrapped.base64EncodedString(), "message": message.base64EncodedString(),
            "version": "3.0.0",
        ]
        return try JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])
    }

    private func observation(_ marker: String) -> Data {
        Data(
            #"{"resourceType":"Observation","status":"final","code":{"text":"steps"},"valueString":"\#(marker)"}"#.utf8)
    }

    /// Makes an RSA key and puts its private PEM in the keys directory as `<name>.pem`.
    private func installedKey(_ name: String) async throws -> (privatePEM: String, publicPEM: String) {
        let key = try await makeKey(name)
        try FileManager.default.copyItem(atPath: key.privatePEM, toPath: keys + "/\(name).pem")
        return key
    }

    /// Queues `count` envelopes for k1 in a repeating pattern of five distinct ones (openssl makes each), each an
    /// Observation marked `<prefix><n>` with n = index % 5: the queue's order is the pattern's.
    private func enqueuePattern(_ count: Int, prefix: String, on queue: DataQueue, for k1: (privatePEM: String, publicPEM: String))
        async throws
    {
        var envelopes: [Data] = []
        for marker in 0..<5 { envelopes.append(try await envelope(observation("\(prefix)\(marker)"), for: k1.publicPEM, keyID: "k1")) }
        for index in 0..<count {
            try await queue.enqueue(try SealedEnvelope(json: envelopes[index % 5], resourceType: SealedEnvelope.unnamedType))
        }
    }

    @Test("opens by key_id from a .pem and from the C3-PRO consumer's <key_id>/private-c3pro.der; trims the id; empty means the default")
    func opensBothLayouts() async throws {
        let pem = try await makeKey("pem")
        let der = try await makeKey("der")
        try FileManager.default.copyItem(atPath: pem.privatePEM, toPath: keys + "/k-pem.pem")
        try FileManager.default.createDirectory(atPath: keys + "/k-der", withIntermediateDirectories: true)
        try await openssl([
            "pkcs8", "-topk8", "-nocrypt", "-in", der.privatePEM, "-outform", "DER", "-out", keys + "/k-der/private-c3pro.der",
        ])
        let keyring = EnvelopeKeyring(directory: keys, defaultKeyID: "k-der")
        #expect(try keyring.check() == ["k-der", "k-pem"])

        let first = try keyring.open(try await envelope(observation("one"), for: pem.publicPEM, keyID: " k-pem "))
        #expect(first.resourceType == "Observation")
        #expect(String(decoding: first.data, as: UTF8.self).contains("\"one\""))
        let second = try keyring.open(try await envelope(observation("two"), for: der.publicPEM, keyID: "k-der"))
        #expect(String(decoding: second.data, as: UTF8.self).contains("\"two\""))
        let byDefault = try keyring.open(try await envelope(observation("three"), for: der.publicPEM, keyID: ""))
        #expect(String(decoding: byDefault.data, as: UTF8.self).contains("\"three\""))
    }

    @Test(
        "key-states.json: a retired key opens nothing, the active key opens an empty key_id, an unnamed key is decrypt-only; a bad file is refused and a reload keeps the states it had; opens are counted per key"
    )
    func keyStates() async throws {
        let old = try await makeKey("old")
        let new = try await makeKey("new")
        try FileManager.default.copyItem(atPath: old.privatePEM, toPath: keys + "/k1.pem")
        try FileManager.default.copyItem(atPath: new.privatePEM, toPath: keys + "/k2.pem")
        let states = keys + "/" + EnvelopeKeyring.statesFileName
        try #"{"k1": "retired", "k2": "active"}"#.write(toFile: states, atomically: true, encoding: .utf8)
        let keyring = EnvelopeKeyring(directory: keys)
        #expect(try keyring.check() == ["k1", "k2"])
        #expect(try keyring.state(of: "k1") == .retired && keyring.state(of: "k2") == .active)

        let retired = try await envelope(observation("r"), for: old.publicPEM, keyID: "k1")
        #expect(throws: EnvelopeKeyring.Failure.retired("k1")) { try keyring.open(retired) }
        #expect(EnvelopeKeyring.Failure.retired("k1").description == "key k1 is retired")
        let empty = try await envelope(observation("e"), for: new.publicPEM, keyID: "")
        #expect(String(decoding: try keyring.open(empty).data, as: UTF8.self).contains("\"e\""))
        #expect(keyring.takeOpenCounts() == ["k2": 1] && keyring.takeOpenCounts().isEmpty)

        // A bad file: refused by a reload (the running states stay) and by a fresh keyring's check.
        for bad in [#"{"k1": "old"}"#, #"{"k1": "active", "k2": "active"}"#, #"{"k3": "retired"}"#, "not json"] {
            try bad.write(toFile: states, atomically: true, encoding: .utf8)
            #expect(throws: EnvelopeKeyring.Failure.self) { try EnvelopeKeyring(directory: keys).check() }
        }
        try #"{"k1": "old"}"#.write(toFile: states, atomically: true, encoding: .utf8)
        #expect(throws: EnvelopeKeyring.Failure.self) { try keyring.reloadStates() }
        #expect(throws: EnvelopeKeyring.Failure.retired("k1")) { try keyring.open(retired) }
        // k1 no longer named: decrypt-only, and it opens; with no active key, an empty key_id names no key.
        try "{}".write(toFile: states, atomically: true, encoding: .utf8)
        try keyring.reloadStates()
        #expect(try keyring.state(of: "k1") == .decryptOnly)
        #expect(String(decoding: try keyring.open(retired).data, as: UTF8.self).contains("\"r\""))
        #expect(throws: EnvelopeKeyring.Failure.unknownKey("")) { try keyring.open(empty) }
        #expect(keyring.takeOpenCounts() == ["k1": 1])
    }

    @Test(
        "each failure has its reason: unknown key_id, a key that does not open it, a path for a key id; a bad padding and no resource inside are one failure"
    )
    func failures() async throws {
        let right = try await makeKey("right")
        let other = try await makeKey("other")
        try FileManager.default.copyItem(atPath: right.privatePEM, toPath: keys + "/k1.pem")
        let keyring = EnvelopeKeyring(directory: keys)

        let unknown = try await envelope(observation("x"), for: right.publicPEM, keyID: "k9")
        #expect(throws: EnvelopeKeyring.Failure.unknownKey("k9")) { try keyring.open(unknown) }
        let empty = try await envelope(observation("x"), for: right.publicPEM, keyID: "")
        #expect(throws: EnvelopeKeyring.Failure.unknownKey("")) { try keyring.open(empty) }
        let path = try await envelope(observation("x"), for: right.publicPEM, keyID: "../k1")
        #expect(throws: EnvelopeKeyring.Failure.unknownKey("../k1")) { try keyring.open(path) }
        // Wrapped for another key than the one its key_id names.
        let wrongKey = try await envelope(observation("x"), for: other.publicPEM, keyID: "k1")
        #expect(throws: EnvelopeKeyring.Failure.doesNotOpen("k1")) { try keyring.open(wrongKey) }
        // What decrypts (good padding) to something that is not a resource fails exactly as a bad padding does:
        // the same reason, the same metric label (no padding oracle).
        let notResource = try await envelope(Data("just text".utf8), for: right.publicPEM, keyID: "k1")
        #expect(throws: EnvelopeKeyring.Failure.doesNotOpen("k1")) { try keyring.open(notResource) }
        let notAnObject = try await envelope(Data(#"{"resourceType":"Observation","status":"#.utf8), for: right.publicPEM, keyID: "k1")
        #expect(throws: EnvelopeKeyring.Failure.doesNotOpen("k1")) { try keyring.open(notAnObject) }
        let good = try await envelope(observation("x"), for: right.publicPEM, keyID: "k1")
        var badPadding = try #require(try JSONSerialization.jsonObject(with: good) as? [String: String])
        var message = try #require(Data(base64Encoded: badPadding["message"] ?? ""))
        message[message.count - 1] ^= 0x5a  // the last block's last byte: its padding no longer checks
        badPadding["message"] = message.base64EncodedString()
        let tampered = try JSONSerialization.data(withJSONObject: badPadding)
        #expect(throws: EnvelopeKeyring.Failure.doesNotOpen("k1")) { try keyring.open(tampered) }
        #expect(!EnvelopeKeyring.Failure.doesNotOpen("k1").description.contains("just text"), "the reason holds no plaintext")
    }

    @Test(
        "a queue with a keyring sends what is inside its envelopes, in order, as plain creates; one it cannot open is quarantined and the next goes; replayed after its key is added, it goes"
    )
    func queueOpensAndQuarantines() async throws {
        let k1 = try await installedKey("k1")
        let k2 = try await makeKey("k2")
        let server = try await ScriptedServer { request in
            .respond(.created(location: "Observation/o\(request.body.count)/_history/1"))
        }
        var configuration = DataQueue.Configuration(databasePath: directory + "/queue.sqlite", idempotent: .init(false))
        configuration.batchSize = 1
        configuration.envelopeKeyring = EnvelopeKeyring(directory: keys)
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)

        for (marker, key, id) in [("first", k1, "k1"), ("second", k2, "k2"), ("third", k1, "k1")] {
            let data = try await envelope(observation(marker), for: key.publicPEM, keyID: id)
            try await queue.enqueue(try SealedEnvelope(json: data, resourceType: SealedEnvelope.unnamedType))
        }
        let report = try await queue.flush()
        #expect(report.delivered == 2)
        #expect(report.parked == 1)
        let sent = server.requests
        #expect(sent.count == 2)
        #expect(sent.map(\.method) == ["POST", "POST"])
        #expect(sent.map(\.path) == ["/fhir/Observation", "/fhir/Observation"])
        #expect(sent.map { $0.bodyText.contains("\"first\"") } == [true, false])
        #expect(sent.map { $0.bodyText.contains("\"third\"") } == [false, true])
        #expect(!sent.contains { $0.bodyText.contains("symmetric_key") }, "no envelope went to the server")

        let parked = try await queue.items(state: .parked)
        #expect(parked.count == 1)
        let reason = try #require(parked.first?.lastError)
        #expect(reason.hasPrefix(DataQueue.quarantinePrefix) && reason.contains("k2"), "\(reason)")
        #expect(parked.first?.encrypted == true, "the stored row is still the envelope")

        try FileManager.default.copyItem(atPath: k2.privatePEM, toPath: keys + "/k2.pem")
        _ = try await queue.retry("#\(try #require(parked.first).sequence)")
        let replay = try await queue.flush()
        #expect(replay.delivered == 1)
        #expect(server.requests.count == 3)
        #expect(server.requests.last?.bodyText.contains("\"second\"") == true)
        #expect(try await queue.items().isEmpty)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test(
        "a flush opens envelopes ahead only once it delivers: 300 in order through the read-ahead, and a server that is down costs one opening per flush, not a prefetch"
    )
    func readAhead() async throws {
        let k1 = try await installedKey("k1")
        let down = ScriptedServer.Response(status: 503, headers: [("Retry-After", "1")])
        let up = NIOLockedValueBox(false)
        let server = try await ScriptedServer { _ in
            up.withLockedValue { $0 } ? .respond(.created(location: "Observation/o/_history/1")) : .respond(down)
        }
        var configuration = DataQueue.Configuration(databasePath: directory + "/queue.sqlite", idempotent: .init(false))
        configuration.batchSize = 1
        configuration.retryPolicy = RetryPolicy(initialDelay: 0, maximumDelay: 0)
        let keyring = EnvelopeKeyring(directory: keys)
        configuration.envelopeKeyring = keyring
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        try await enqueuePattern(300, prefix: "m", on: queue, for: k1)
        #expect(try await queue.items().count == 300)

        _ = try? await queue.flush()
        #expect(server.requests.count == 1, "the first request failed and the flush stopped")
        let opens = try await #require(queue.keyOpenLog).keyOpens(since: keyOpenDay(of: Date()) - 1)
        #expect(opens["k1"]?.values.reduce(0, +) == 1, "one envelope opened for the one request, not a prefetch: \(opens)")
        #expect(keyring.takeOpenCounts().isEmpty, "counted in the store already")

        up.withLockedValue { $0 = true }
        let report = try await queue.flush(force: true)
        #expect(report.delivered == 300)
        let sent = server.requests.dropFirst().map { request in (0..<5).first { request.bodyText.contains("\"m\($0)\"") } }
        #expect(sent.count == 300)
        #expect(sent == (0..<300).map { $0 % 5 }, "in queue order")
        #expect(try await queue.items().isEmpty)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test(
        "the read-ahead keeps two batches opened ahead: while one request is held the third batch's opening starts; 600 envelopes go in order, each opened once"
    )
    func readAheadDepth() async throws {
        let k1 = try await installedKey("k1")
        let opens = NIOLockedValueBox(0)
        // The first request carries the first item (a flush fetches only its first step until it delivers); the
        // second comes after a refill of 256, when the read-ahead starts. One batch ahead stops at 1 + 256 + 256.
        let oneAhead = 1 + 2 * Flusher.prefetchCount
        let arrived = NIOLockedValueBox(0)
        let reached = NIOLockedValueBox(false)
        let server = try await ScriptedServer { _ in
            if arrived.withLockedValue({
                $0 += 1; return $0
            }) == 2 {
                // Held until the opening goes past one batch ahead (a bound only a missing read-ahead reaches).
                let deadline = ContinuousClock.now + .seconds(300)
                while opens.withLockedValue({ $0 }) <= oneAhead, ContinuousClock.now < deadline {
                    try? await Task.sleep(for: .milliseconds(5))
                }
                reached.withLockedValue { $0 = opens.withLockedValue { $0 } > oneAhead }
            }
            return .respond(.created(location: "Observation/o/_history/1"))
        }
        var configuration = DataQueue.Configuration(databasePath: directory + "/queue.sqlite", idempotent: .init(false))
        configuration.batchSize = 1
        // The held request waits for the openings, which take what they take on the machine (a sanitizer's build is
        // slow): dq must not give up on it first.
        configuration.requestTimeout = 600
        configuration.envelopeKeyring = EnvelopeKeyring(directory: keys)
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        queue.hooks.openingEnvelope = { opens.withLockedValue { $0 += 1 } }
        let total = 600
        try await enqueuePattern(total, prefix: "d", on: queue, for: k1)

        let report = try await queue.flush()
        #expect(reached.withLockedValue { $0 }, "the opening went past one batch ahead while a request was held")
        #expect(report.delivered == total)
        let sent = server.requests.map { request in (0..<5).first { request.bodyText.contains("\"d\($0)\"") } }
        #expect(sent.count == total)
        #expect(sent == (0..<total).map { $0 % 5 }, "in queue order")
        #expect(opens.withLockedValue { $0 } == total, "each envelope opened once")
        #expect(try await queue.items().isEmpty)
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test(
        "a flush opens envelopes at a background priority: every opening thread runs ten nice steps below the process, the helpers it starts too, and the caller stays as it was"
    )
    func backgroundPriority() async throws {
        #if os(Linux)
            let base = OwnThread.niceness()
            let expected = min(19, base + 10)

            // The helpers inherit the priority: index 0 waits until another thread has run index 1.
            let niceness = try await OwnThread.run("dq-test-bg", priority: .background) { () -> [Int32] in
                let seen = NIOLockedValueBox([Int32](repeating: -100, count: 2))
                let second = DispatchSemaphore(value: 0)
                ParallelWork.forEach(2, threads: 2) { index in
                    if index == 0 { second.wait() }
                    seen.withLockedValue { $0[index] = OwnThread.niceness() }
                    if index == 1 { second.signal() }
                }
                return seen.withLockedValue { $0 }
            }
            #expect(niceness == [expected, expected], "both threads of the work, lowered: \(niceness) (the process at \(base))")
            #expect(OwnThread.niceness() == base, "the caller's priority is untouched")

            // A flush's opening, on whichever threads open each envelope.
            let k1 = try await installedKey("k1")
            let server = try await ScriptedServer { _ in .respond(.created(location: "Observation/o/_history/1")) }
            var configuration = DataQueue.Configuration(databasePath: directory + "/queue.sqlite", idempotent: .init(false))
            configuration.envelopeKeyring = EnvelopeKeyring(directory: keys)
            let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
            let seen = NIOLockedValueBox<[Int32]>([])
            queue.hooks.openingEnvelope = { seen.withLockedValue { $0.append(OwnThread.niceness()) } }
            let envelope = try await envelope(observation("p"), for: k1.publicPEM, keyID: "k1")
            for _ in 0..<40 {
                try await queue.enqueue(try SealedEnvelope(json: envelope, resourceType: SealedEnvelope.unnamedType))
            }
            let report = try await queue.flush()
            #expect(report.delivered == 40)
            let opened = seen.withLockedValue { $0 }
            #expect(opened.count >= 40, "every envelope opened once at least")
            #expect(opened.allSatisfy { $0 == expected }, "opened at \(Set(opened)), the process at \(base)")
            #expect(OwnThread.niceness() == base)
            try await queue.shutdown()
            try await server.shutdown()
        #endif
    }
}
