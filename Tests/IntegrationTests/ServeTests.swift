import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// `dq serve`, the receiving half of C3-PRO, driven by a C3-PRO client written in Python (`httpx` and
/// `cryptography`, independent of dq's Swift code) that builds envelopes as the iOS app does, with sekmet-fhir
/// behind it: what a device is told was taken reaches the server once, in order, opened; what cannot be opened
/// waits in quarantine; what is refused leaves nothing behind; plain resources are sealed at rest.
@Suite("dq serve: the C3-PRO receiving half", .serialized, .enabled(if: Peers.enabled))
struct ServeTests: ServeHarness {
    let work: TemporaryDirectory
    let resources = Resources()
    /// In the content of the resources of the at-rest test; must appear in no byte the queue stores.
    let marker = "SRVMARK" + UUID().uuidString.prefix(8).lowercased()
    let antispam = "spam-" + UUID().uuidString.lowercased()

    init() throws { work = try TemporaryDirectory() }
}

/// `dq serve`'s tests, part: connections, slow clients and what one client may use (ServeConnectionTests.swift). A suite of its own, serialized within, beside the others.
@Suite("dq serve: connections, slow clients and what one client may use", .serialized, .enabled(if: Peers.enabled))
struct ServeConnectionSuite: ServeHarness {
    let work: TemporaryDirectory
    let resources = Resources()
    let marker = "SRVMARK" + UUID().uuidString.prefix(8).lowercased()
    let antispam = "spam-" + UUID().uuidString.lowercased()

    init() throws { work = try TemporaryDirectory() }
}

/// `dq serve`'s tests, part: repeats, exactly once and the write policy (ServeRepeatsTests.swift, ServeExactlyOnceTests.swift, ServeWritePolicyTests.swift). A suite of its own, serialized within, beside the others.
@Suite("dq serve: repeats, exactly once and the write policy", .serialized, .enabled(if: Peers.enabled))
struct ServeRepeatsSuite: ServeHarness {
    let work: TemporaryDirectory
    let resources = Resources()
    let marker = "SRVMARK" + UUID().uuidString.prefix(8).lowercased()
    let antispam = "spam-" + UUID().uuidString.lowercased()

    init() throws { work = try TemporaryDirectory() }
}

/// `dq serve`'s tests, part: split trust, keys, imported credentials, routes and TLS (ServeSplitTests.swift, ServeKeysTests.swift, ServeCredentialsTests.swift, ServeRoutesTests.swift, ServeTLSTests.swift). A suite of its own, serialized within, beside the others.
@Suite("dq serve: split trust, keys, imported credentials, routes and TLS", .serialized, .enabled(if: Peers.enabled))
struct ServeTrustSuite: ServeHarness {
    let work: TemporaryDirectory
    let resources = Resources()
    let marker = "SRVMARK" + UUID().uuidString.prefix(8).lowercased()
    let antispam = "spam-" + UUID().uuidString.lowercased()

    init() throws { work = try TemporaryDirectory() }
}

/// What every suite of `dq serve`'s tests has: a directory of its own, the test resources, a marker for the
/// at-rest checks and an Antispam secret. The helpers below (a receiver started as a process, the Python C3-PRO
/// client, what the FHIR server holds) serve them all, so that the receiver's tests run as several serialized
/// suites side by side: each waits mostly on processes and timeouts, not on the CPU.
protocol ServeHarness {
    var work: TemporaryDirectory { get }
    var resources: Resources { get }
    var marker: String { get }
    var antispam: String { get }
}

/// A running `dq serve` on a free loopback port.
final class ServeReceiver: Sendable {
    let process: ChildProcess
    let port: Int
    var base: String { "http://127.0.0.1:\(port)" }
    var log: String { (try? String(contentsOfFile: process.stderrPath, encoding: .utf8)) ?? "" }

    init(process: ChildProcess, port: Int) {
        self.process = process
        self.port = port
    }

    /// SIGTERM, and how it ended.
    func stop() async -> ProcessResult {
        process.kill(SIGTERM)
        return await process.wait(timeout: .seconds(60))
    }

    deinit { process.killInBackground() }
}

/// Where each key goes in `keys_dir`: the C3-PRO consumer's `<id>/private-c3pro.der` or `<id>.pem`.
enum ServeKeyLayout { case pem, der }

/// An answer: `status` (0 when the connection failed: then `error`), `body` (text), `content_type`, `json`
/// (whether the body is strict JSON) and `object` (the body parsed).
struct ServeAnswer: CustomStringConvertible {
    let status: Int
    let body: String
    let contentType: String
    let strictJSON: Bool
    let object: [String: Any]
    let error: String?
    /// The `Location`, `Retry-After` and `WWW-Authenticate` headers ("" when absent).
    let location: String
    let retryAfter: String
    let challenge: String
    /// Seconds from sending the request to its answer.
    let elapsed: Double

    init(_ raw: [String: Any]) {
        elapsed = raw["elapsed"] as? Double ?? -1
        location = raw["location"] as? String ?? ""
        retryAfter = raw["retry_after"] as? String ?? ""
        challenge = raw["www_authenticate"] as? String ?? ""
        status = raw["status"] as? Int ?? -1
        body = raw["body"] as? String ?? ""
        contentType = raw["content_type"] as? String ?? ""
        strictJSON = raw["json"] as? Bool ?? false
        object = (try? JSONSerialization.jsonObject(with: Data(body.utf8))) as? [String: Any] ?? [:]
        error = raw["error"] as? String
    }

    var description: String { "\(status) \(contentType) \(body.prefix(600))\(error.map { " error: \($0)" } ?? "")" }
}

/// The Python programs the harness runs.
enum ServeScripts {
    /// A C3-PRO client as the iOS app (C3PRO's `EncryptedDataQueue`, p2/OAuth2) behaves, written with Python
    /// `requests` and `cryptography` alone: AES-256-CBC with a zero IV and PKCS#7 padding, one AES key per run,
    /// the key wrapped with RSA-OAEP (SHA-1, MGF1-SHA-1) under the receiver's certificate. With `DQ_TEST_CA` set it
    /// speaks HTTPS and verifies the receiver against that CA bundle.
    ///
    /// `client.py BASE STEPS.json` runs the steps in order and prints a JSON list of answers. A step: `path`;
    /// `headers`; `basic` {id, secret, form} (form: id and secret form-encoded before Base64, RFC 6749 2.3.1);
    /// `bearer` and `scheme`; one body: `json`, `form`, `fhir` (a resource as text), `raw` with `content_type`,
    /// `seal` {resource, cert, key_id, version}, or `pad_bytes` (a JSON body of that size; `chunked` sends it
    /// without a length).
    static let client = #"""
        import base64, json, os, sys, urllib.parse
        import requests
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, padding
        from cryptography.hazmat.primitives.asymmetric import padding as asym
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        AES_KEY = os.urandom(32)  # one per EncryptedDataQueue instance, as on iOS

        def seal(spec):
            with open(spec["cert"], "rb") as f:
                public_key = x509.load_pem_x509_certificate(f.read()).public_key()
            padder = padding.PKCS7(128).padder()
            padded = padder.update(spec["resource"].encode()) + padder.finalize()
            encryptor = Cipher(algorithms.AES(AES_KEY), modes.CBC(b"\0" * 16)).encryptor()
            message = encryptor.update(padded) + encryptor.finalize()
            wrapped = public_key.encrypt(
                AES_KEY, asym.OAEP(mgf=asym.MGF1(algorithm=hashes.SHA1()), algorithm=hashes.SHA1(), label=None))
            return json.dumps({
                "key_id": spec["key_id"],
                "symmetric_key": base64.b64encode(wrapped).decode(),
                "message": base64.b64encode(message).decode(),
                "version": spec.get("version", "3.0.0"),
            }).encode()

        def new_session():
            session = requests.Session()
            session.trust_env = False  # no proxy or .netrc from the environment: the receiver is spoken to directly
            if os.environ.get("DQ_TEST_CA"):
                session.verify = os.environ["DQ_TEST_CA"]
            return session

        def chunks(data, size=65536):
            for start in range(0, len(data), size):
                yield data[start:start + size]

        def run(session, base, step):
            headers = dict(step.get("headers", {}))
            if "basic" in step:
                b = step["basic"]
                ident, secret = b["id"], b["secret"]
                if b.get("form"):
                    ident, secret = urllib.parse.quote_plus(ident), urllib.parse.quote_plus(secret)
                headers["Authorization"] = "Basic " + base64.b64encode((ident + ":" + secret).encode()).decode()
            if "bearer" in step:
                headers["Authorization"] = step.get("scheme", "Bearer") + " " + step["bearer"]
            body = None
            if "seal" in step:
                body, headers["Content-Type"] = seal(step["seal"]), "application/json"
            elif "json" in step:
                body, headers["Content-Type"] = json.dumps(step["json"]).encode(), "application/json"
            elif "form" in step:
                body, headers["Content-Type"] = step["form"].encode(), "application/x-www-form-urlencoded"
            elif "fhir" in step:
                body, headers["Content-Type"] = step["fhir"].encode(), "application/fhir+json"
            elif "raw" in step:
                body, headers["Content-Type"] = step["raw"].encode(), step.get("content_type", "text/plain")
            elif "pad_bytes" in step:
                n = step["pad_bytes"]
                body = b'{"pad":"' + b"x" * (n - 10) + b'"}'
                headers["Content-Type"] = "application/json"
                if step.get("chunked"):
                    body = chunks(body)
            try:
                r = session.request(step.get("method", "POST"), base + step["path"], data=body, headers=headers, timeout=60)
            except requests.RequestException as error:
                return {"status": 0, "body": "", "content_type": "", "json": False, "error": repr(error)}
            try:
                json.loads(r.text)
                strict = True
            except ValueError:
                strict = False
            return {"status": r.status_code, "body": r.text, "content_type": r.headers.get("Content-Type", ""), "json": strict,
                    "location": r.headers.get("Location", ""), "retry_after": r.headers.get("Retry-After", ""),
                    "www_authenticate": r.headers.get("WWW-Authenticate", ""),
                    "elapsed": r.elapsed.total_seconds()}

        def main():
            base = sys.argv[1]
            with open(sys.argv[2]) as f:
                steps = json.load(f)
            session = new_session()
            answers = []
            for step in steps:
                answers.append(run(session, base, step))
                if answers[-1]["status"] == 0:
                    session = new_session()
            json.dump(answers, sys.stdout)

        main()
        """#
}

extension ServeHarness {
    typealias Receiver = ServeReceiver
    typealias KeyLayout = ServeKeyLayout
    typealias Answer = ServeAnswer
    /// One request of the Python client; see `client.py` below for the fields.
    typealias Step = [String: Any]

    /// The C3-PRO client program (ServeScripts.client).
    static var clientScript: String { ServeScripts.client }

    // MARK: - The receiver

    /// Puts the private key of `keys` into `keys_dir` as the key of `id`.
    func install(_ keys: TestKeys, as id: String, layout: KeyLayout) async throws {
        let directory = work.file("keys")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        switch layout {
        case .pem:
            try FileManager.default.copyItem(atPath: keys.privateKey, toPath: "\(directory)/\(id).pem")
            chmod("\(directory)/\(id).pem", 0o600)
        case .der:
            try FileManager.default.createDirectory(atPath: "\(directory)/\(id)", withIntermediateDirectories: true)
            try await TestKeys.openssl([
                "pkcs8", "-topk8", "-nocrypt", "-in", keys.privateKey, "-outform", "DER", "-out", "\(directory)/\(id)/private-c3pro.der",
            ])
            chmod("\(directory)/\(id)/private-c3pro.der", 0o600)
        }
    }

    /// Writes `dq.json` (and the antispam file and an at-rest key): `serve` holds the receiver's settings, the
    /// rest the queue's; `extra` is added to `serve`, and a nil value removes a key.
    @discardableResult
    func configure(
        server: String, atRest: Bool = true, serve extra: [String: Any?] = [:], name: String = "dq.json",
        database: String = "queue.sqlite"
    ) async throws -> String {
        _ = try work.write("antispam.txt", "# the apps' secret\n\(antispam)\n")
        // Readable by its owner only, as the README asks (dq doctor fails on one others can read).
        chmod(work.file("antispam.txt"), 0o600)
        var serve: [String: Any] = [
            "antispam_file": "antispam.txt", "keys_dir": "keys", "default_key_id": "k1", "path_prefix": "/c3pro",
        ]
        for (key, value) in extra { serve[key] = value }
        var root: [String: Any] = [
            "server": server, "database": work.file(database), "serve": serve,
            "retry": ["initial_seconds": 0.1, "maximum_seconds": 0.5],
        ]
        if atRest {
            let key = work.file("rest.key")
            if !FileManager.default.fileExists(atPath: key) {
                let made = try await dq(["keygen", "--at-rest", "--out", key], ["HOME": work.path])
                #expect(made.status == 0, "\(made.stderr)")
            }
            root["at_rest"] = ["key_file": key]
        }
        let data = try JSONSerialization.data(withJSONObject: root, options: [.sortedKeys])
        return try work.write(name, String(decoding: data, as: UTF8.self))
    }

    /// Starts `dq serve --config <config>` (on `host` and `port`, else a free one) and waits until its `/readyz`
    /// answers 200 (on loopback).
    func start(_ config: String, environment: [String: String] = [:], host: String = "127.0.0.1", port fixed: Int? = nil)
        async throws -> Receiver
    {
        let port = fixed ?? Peers.freePort()
        let process = try ChildProcess(
            Peers.dqBinary,
            ["serve", "--config", config, "--listen", "\(host):\(port)", "--poll-interval", "0.1"],
            environment: ["HOME": work.path].merging(environment) { $1 }, directory: work.path)
        let receiver = Receiver(process: process, port: port)
        let ready = try await eventually(timeout: .seconds(60)) {
            guard process.isRunning else { return false }
            return (try? await HTTP.get("http://127.0.0.1:\(port)/readyz"))?.0 == 200
        }
        if !ready {
            let result = await process.stop()
            throw TestFailure("dq serve did not become ready (\(result.status)): \(result.stderr.suffix(3000))")
        }
        return receiver
    }

    /// Runs `dq` on the same configuration as the receiver.
    func dqCommand(_ arguments: [String], config: String) async throws -> ProcessResult {
        try await dq(arguments + ["--config", config], ["HOME": work.path], directory: work.path)
    }

    func json(_ result: ProcessResult) throws -> Any {
        try JSONSerialization.jsonObject(with: Data(result.stdout.utf8))
    }

    /// Pending, parked and delivered items of the queue.
    func counts(_ config: String) async throws -> (pending: Int, parked: Int, delivered: Int) {
        let status = try await dqCommand(["status", "--json"], config: config)
        // Without `server` (an edge's settings), status lists the database's queues: an edge has one.
        let parsed = try json(status)
        let object = try #require(
            parsed as? [String: Any] ?? ((parsed as? [[String: Any]]).flatMap { $0.count == 1 ? $0[0] : nil }),
            "\(status.stdout) \(status.stderr)")
        return (object["pending"] as? Int ?? -1, object["parked"] as? Int ?? -1, object["delivered"] as? Int ?? -1)
    }

    // MARK: - The C3-PRO client

    /// Runs the steps in order with one Python process (one session, one AES key: as one iOS app run).
    func client(_ base: String, _ steps: [Step]) async throws -> [Answer] {
        let script = try work.write("client.py", Self.clientScript)
        let file = work.file("steps-\(UUID().uuidString).json")
        try JSONSerialization.data(withJSONObject: steps).write(to: URL(fileURLWithPath: file))
        let result = try await ChildProcess(Peers.venv + "/bin/python", [script, base, file]).wait(timeout: .seconds(120))
        guard result.status == 0, let answers = try? JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [[String: Any]]
        else {
            throw TestFailure("the Python client failed (\(result.status)): \(result.stderr.suffix(3000))")
        }
        return answers.map(Answer.init)
    }

    /// Registers with the antispam secret; the new client's id and secret.
    func register(_ base: String) async throws -> (id: String, secret: String) {
        let answer = try #require(try await client(base, [registration(antispam)]).first)
        #expect(answer.status == 201, "\(answer)")
        let id = try #require(answer.object["client_id"] as? String, "\(answer)")
        let secret = try #require(answer.object["client_secret"] as? String, "\(answer)")
        return (id, secret)
    }

    /// A token for the client (HTTP Basic with the id and secret raw, or form-encoded first).
    func token(_ base: String, _ client: (id: String, secret: String), formEncoded: Bool = false) async throws -> String {
        let answer = try #require(try await self.client(base, [tokenRequest(client, formEncoded: formEncoded)]).first)
        #expect(answer.status == 200, "\(answer)")
        return try #require(answer.object["access_token"] as? String, "\(answer)")
    }

    func registration(_ secret: String?) -> Step {
        var step: Step = [
            "path": "/c3pro/register",
            "json": [
                "sandbox": false, "receipt-data": "NO-APP-RECEIPT", "client_name": "C Tracker",
                "grant_types": ["client_credentials"], "token_endpoint_auth_method": "client_secret_basic",
            ],
        ]
        if let secret { step["headers"] = ["Antispam": secret] }
        return step
    }

    func tokenRequest(_ client: (id: String, secret: String), formEncoded: Bool = false, grant: String = "client_credentials")
        -> Step
    {
        ["path": "/c3pro/oauth", "form": "grant_type=\(grant)", "basic": ["id": client.id, "secret": client.secret, "form": formEncoded]]
    }

    /// An envelope of `resource` sealed under `certificate` with `keyID`, posted to `path`.
    func sealed(
        _ path: String, _ resource: String, certificate: String, keyID: String, token: String, scheme: String = "Bearer",
        version: String = "3.0.0"
    ) -> Step {
        [
            "path": path, "bearer": token, "scheme": scheme,
            "seal": ["resource": resource, "cert": certificate, "key_id": keyID, "version": version],
        ]
    }

    func plain(_ path: String, _ resource: String, token: String, scheme: String = "Bearer") -> Step {
        ["path": path, "bearer": token, "scheme": scheme, "fhir": resource]
    }

    /// A QuestionnaireResponse with `value` under the test's identifier system (one Identifier, as R4 has it).
    func questionnaireResponse(_ value: String, extra: String = "") -> String {
        #"{"resourceType":"QuestionnaireResponse","status":"completed","identifier":{"system":"\#(resources.system)","value":"\#(value)"},"authored":"2026-11-28T10:00:00Z","item":[{"linkId":"q1","text":"How do you feel\#(extra)?","answer":[{"valueString":"answer \#(value)\#(extra)"}]}]}"#
    }

    func observation(_ value: String, extra: String = "") -> String {
        #"{"resourceType":"Observation","status":"final","identifier":[{"system":"\#(resources.system)","value":"\#(value)"}],"code":{"text":"steps \#(value)\#(extra)"},"valueQuantity":{"value":42,"unit":"steps"}}"#
    }

    // MARK: - What the FHIR server holds

    /// Every resource of any type on `server` with the test's identifier system, oldest first, as (value,
    /// resource): from the server's whole history, so the order across types shows.
    func stored(_ server: FHIRServer) async throws -> [(String, [String: Any])] {
        var all: [(String, [String: Any])] = []
        var offset = 0
        while true {
            let page = try await HTTP.json("\(server.base)/_history?_count=500&_offset=\(offset)")
            let entries = page["entry"] as? [[String: Any]] ?? []
            if entries.isEmpty { break }
            for entry in entries {
                guard let resource = entry["resource"] as? [String: Any] else { continue }
                let identifiers =
                    resource["identifier"] as? [[String: Any]] ?? (resource["identifier"] as? [String: Any]).map { [$0] } ?? []
                guard let match = identifiers.first(where: { $0["system"] as? String == resources.system }),
                    let value = match["value"] as? String
                else { continue }
                all.append((value, resource))
            }
            offset += entries.count
        }
        return all.reversed()
    }

    func values(_ server: FHIRServer) async throws -> [String] { try await stored(server).map(\.0) }

    /// The resource as it was posted: the server's `id` and `meta` left out.
    func content(_ resource: [String: Any]) -> NSDictionary {
        var resource = resource
        resource["id"] = nil
        resource["meta"] = nil
        return resource as NSDictionary
    }

    /// The files of the SQLite queue in which `needle` appears.
    func found(_ needle: String, database: String = "queue.sqlite") -> [String] {
        let path = work.file(database)
        return [path, path + "-wal", path + "-shm", path + "-journal"].filter { file in
            guard let data = FileManager.default.contents(atPath: file) else { return false }
            return data.range(of: Data(needle.utf8)) != nil
        }
    }

    // MARK: - The client program

    /// sekmet, k1 installed (PEM), a receiver with `serve` added to its settings, and a client registered there: its
    /// bearer token.
    func startWithClient(serve: [String: Any?]) async throws -> (
        server: FHIRServer, keys: TestKeys, config: String, receiver: Receiver, bearer: String
    ) {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: server.base, serve: serve)
        let receiver = try await start(config)
        let bearer = try await token(receiver.base, try await register(receiver.base))
        return (server, keys, config, receiver, bearer)
    }

    /// As ``startWithClient(serve:)``, with scripts/faultproxy.py (its `options`) between the receiver and sekmet.
    func startBehindProxy(options: [String] = []) async throws -> (
        server: FHIRServer, proxy: FaultProxy, keys: TestKeys, config: String, receiver: Receiver, bearer: String
    ) {
        let server = try await FHIRServer.start()
        let proxy = try await FaultProxy(upstream: server, options: options)
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: proxy.base)
        let receiver = try await start(config)
        let bearer = try await token(receiver.base, try await register(receiver.base))
        return (server, proxy, keys, config, receiver, bearer)
    }

    /// The lines of the receiver's `/metrics` that start with `name`.
    func metricLines(_ receiver: Receiver, _ name: String) async throws -> [String] {
        let (status, body) = try await HTTP.get(receiver.base + "/metrics")
        #expect(status == 200)
        return String(decoding: body, as: UTF8.self).split(separator: "\n").map(String.init).filter { $0.hasPrefix(name) }
    }

    /// Another device is answered (202 for an envelope holding the Observation "fast") while a slow one holds a
    /// connection.
    func anotherDeviceServed(_ receiver: Receiver, _ keys: TestKeys, _ bearer: String) async throws {
        let other = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("fast"), certificate: keys.certificate, keyID: "k1", token: bearer)])
        #expect(other.first?.status == 202, "\(other)")
    }
}

extension ServeTests {
    // MARK: - Tests

    @Test(
        "A Python C3-PRO client registers, gets tokens (secret raw and form-encoded) and posts envelopes (encfhir, fhirenc) and plain resources: all on sekmet once, in order, opened"
    )
    func endToEnd() async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .der)
        try FileManager.default.createDirectory(atPath: work.file("questionnaires"), withIntermediateDirectories: true)
        _ = try work.write(
            "questionnaires/mood-1.json",
            #"{"resourceType":"Questionnaire","id":"mood-1","status":"active","item":[{"linkId":"q1","type":"string","text":"How do you feel?"}]}"#
        )
        let config = try await configure(server: server.base, serve: ["questionnaires_dir": "questionnaires"])
        let receiver = try await start(config)

        let registered = try #require(try await client(receiver.base, [registration(antispam)]).first)
        #expect(registered.status == 201, "\(registered)")
        #expect(registered.strictJSON, "strict JSON (C3-PRO's had a trailing comma): \(registered.body)")
        #expect(registered.contentType.hasPrefix("application/json"), "\(registered)")
        let id = try #require(registered.object["client_id"] as? String, "\(registered)")
        let secret = try #require(registered.object["client_secret"] as? String, "\(registered)")
        #expect(!id.isEmpty && secret.count >= 32, "\(registered)")
        #expect(registered.object["grant_types"] as? [String] == ["client_credentials"], "\(registered)")
        #expect(registered.object["token_endpoint_auth_method"] as? String == "client_secret_basic", "\(registered)")
        #expect(
            Set(registered.object.keys) == ["client_id", "client_secret", "grant_types", "token_endpoint_auth_method"],
            "the four members C3-PRO apps read, no more: \(registered.object.keys.sorted())")
        #expect(secret.allSatisfy { $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "-" || $0 == "_") }, "URL-safe")

        let tokens = try await client(
            receiver.base, [tokenRequest((id, secret)), tokenRequest((id, secret), formEncoded: true)])
        var bearers: [String] = []
        for answer in tokens {
            #expect(answer.status == 200, "\(answer)")
            #expect(answer.strictJSON, "\(answer)")
            // An integer (JSON 1800, not 1800.0 or "1800"), as C3-PRO answered.
            #expect(answer.body.range(of: #""expires_in"\s*:\s*1800\s*[,}]"#, options: .regularExpression) != nil, "\(answer)")
            #expect(answer.object["token_type"] as? String == "bearer", "\(answer)")
            bearers.append(try #require(answer.object["access_token"] as? String, "\(answer)"))
        }
        #expect(bearers.count == 2 && bearers[0] != bearers[1])

        // Ten resources, each with its own value: QuestionnaireResponse envelopes to encfhir, Observation envelopes
        // to fhirenc, each envelope with one of the versions the apps in the field send; plain Observations and
        // QuestionnaireResponses; both tokens, `Bearer` and `bearer`.
        let versions = ["0.5.0", "0.9.0", "1.0.2", "3.0.0"]
        var posted: [String] = []
        var steps: [Step] = []
        for index in 0..<10 {
            let token = bearers[index % 2]
            let scheme = index % 4 < 2 ? "Bearer" : "bearer"
            let version = versions[steps.filter { $0["seal"] != nil }.count % versions.count]
            switch index % 3 {
            case 0:
                posted.append(questionnaireResponse("m\(index)"))
                steps.append(
                    sealed(
                        "/c3pro/encfhir/QuestionnaireResponse", posted[index], certificate: keys.certificate, keyID: "k1",
                        token: token, scheme: scheme, version: version))
            case 1:
                posted.append(observation("m\(index)"))
                steps.append(
                    sealed(
                        "/c3pro/fhirenc/Observation", posted[index], certificate: keys.certificate, keyID: "k1", token: token,
                        scheme: scheme, version: version))
            default:
                let type = index % 2 == 0 ? "QuestionnaireResponse" : "Observation"
                posted.append(type == "Observation" ? observation("m\(index)") : questionnaireResponse("m\(index)"))
                steps.append(plain("/c3pro/fhir/\(type)", posted[index], token: token, scheme: scheme))
            }
        }
        let answers = try await client(receiver.base, steps)
        // A plain resource is answered 201 with the server's Location when the queue delivered it within the receiver's
        // short wait, else 202 (queued): which one depends on how busy this machine is (a busy one gave 202), so both
        // are taken here, counted, and the metrics must count the same; sekmet's copies are checked below either way.
        var plainAnswers: [Int: Int] = [:]
        for (index, answer) in answers.enumerated() {
            if index % 3 == 2 {
                #expect(
                    (answer.status == 201 && answer.location.contains(index % 2 == 0 ? "/QuestionnaireResponse/" : "/Observation/"))
                        || answer.status == 202,
                    "plain \(index): \(answer)")
                plainAnswers[answer.status, default: 0] += 1
            } else {
                #expect(answer.status == 202, "envelope \(index): \(answer)")
            }
        }
        let expected = (0..<10).map { "m\($0)" }
        // The queue's own count says when the deliveries are committed (sekmet stores each before its answer reaches
        // the flusher, which records it only then); the server's copy is checked after.
        let arrived = try await eventually(timeout: .seconds(60)) { try await counts(config).delivered >= 10 }
        let onServer = try await stored(server)
        #expect(arrived && onServer.count == 10, "\(onServer.map(\.0)) \(receiver.log.suffix(2000))")
        #expect(onServer.map(\.0) == expected, "once each, in the order posted")
        for (value, resource) in onServer {
            guard let index = expected.firstIndex(of: value) else { continue }
            let sent = try #require(try JSONSerialization.jsonObject(with: Data(posted[index].utf8)) as? [String: Any])
            #expect(content(resource) == content(sent), "\(value) arrived opened and unchanged: \(resource)")
        }
        let (pending, parked, delivered) = try await counts(config)
        #expect(pending == 0 && parked == 0 && delivered == 10, "\(pending) \(parked) \(delivered)")
        let (metricsStatus, metricsBody) = try await HTTP.get(receiver.base + "/metrics")
        #expect(plainAnswers.values.reduce(0, +) == 3, "\(plainAnswers)")
        let metrics = String(decoding: metricsBody, as: UTF8.self)
        #expect(metricsStatus == 200)
        for line in [
            #"dq_serve_requests_total{endpoint="register",status="201"} 1"#, #"dq_serve_requests_total{endpoint="oauth",status="200"} 2"#,
            #"dq_serve_requests_total{endpoint="encfhir",status="202"} 7"#,
        ] + plainAnswers.map({ #"dq_serve_requests_total{endpoint="fhir",status="\#($0.key)"} \#($0.value)"# }) {
            #expect(metrics.contains(line), "\(line) in \(metrics.split(separator: "\n").filter { $0.contains("dq_serve") })")
        }
        // The ingest latency of each committed envelope and plain resource, and the queue's depth and oldest age.
        let lines = metrics.split(separator: "\n").map(String.init)
        #expect(
            lines.contains(#"dq_serve_ingest_duration_seconds_count{endpoint="encfhir"} 7"#), "\(lines.filter { $0.contains("ingest") })")
        #expect(lines.contains(#"dq_serve_ingest_duration_seconds_count{endpoint="fhir"} 3"#), "\(lines.filter { $0.contains("ingest") })")
        for gauge in ["dq_queue_depth{", "dq_oldest_pending_age_seconds{"] {
            #expect(
                lines.contains { $0.hasPrefix(gauge) }, "\(gauge) in \(lines.filter { $0.hasPrefix("dq_") && !$0.contains("_bucket") })")
        }
        // A device whose 202 was lost sends the same resource again (sealed again: a new wrapped key): taken, journaled
        // as a duplicate of the first (same client, same plaintext), and on the server still once.
        let again = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", posted[4], certificate: keys.certificate, keyID: "k1", token: bearers[0])])
        #expect(again.first?.status == 202, "\(again)")
        #expect(
            try await eventually { try await journal(config).last?["event"] as? String == "duplicate" }, "\(receiver.log.suffix(2000))")
        #expect(try await counts(config).delivered == 10)
        // A Questionnaire from questionnaires_dir, for a bearer client only.
        let questionnaire = try await client(
            receiver.base,
            [
                ["path": "/c3pro/fhir/Questionnaire/mood-1", "method": "GET", "bearer": bearers[1], "scheme": "bearer"],
                ["path": "/c3pro/fhir/Questionnaire/mood-1", "method": "GET"],
                ["path": "/c3pro/fhir/Questionnaire/absent", "method": "GET", "bearer": bearers[1]],
                ["path": "/c3pro/fhir/Questionnaire/..", "method": "GET", "bearer": bearers[1]],
            ])
        #expect(questionnaire.map(\.status) == [200, 401, 404, 404], "\(questionnaire)")
        #expect(questionnaire.first?.object["id"] as? String == "mood-1", "\(questionnaire)")
        let stopped = await receiver.stop()
        #expect(stopped.status == 0, "\(stopped.stderr.suffix(2000))")
        #expect(try await values(server) == expected, "nothing sent again")
    }

    @Test(
        "Refusals: wrong or missing Antispam (401), wrong secret (401, with its Basic challenge), no or unknown token (401), bodies over the limit (413, counted in /metrics), not JSON (400), an unsupported or missing grant (400; grant_type in the query is taken); nothing stored"
    )
    func refusals() async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let small = try await configure(server: server.base, serve: ["max_body_bytes": 65536], name: "small.json")
        var receiver = try await start(small)
        let base = receiver.base
        let good = try await register(base)
        let bearer = try await token(base, good)
        let megabyte = 1 << 20

        var steps: [Step] = [
            registration(nil),
            registration("wrong-" + antispam),
            registration(antispam + "x"),
            ["path": "/c3pro/register", "headers": ["Antispam": antispam], "raw": "sandbox=false", "content_type": "text/plain"],
            tokenRequest((good.id, good.secret + "x")),
            tokenRequest((good.id + "x", good.secret)),
            ["path": "/c3pro/oauth", "form": "grant_type=client_credentials"],
            tokenRequest(good, grant: "password"),
            tokenRequest(good, grant: "authorization_code"),
            ["path": "/c3pro/oauth", "form": "", "basic": ["id": good.id, "secret": good.secret]],
            ["path": "/c3pro/oauth?grant_type=client_credentials", "form": "", "basic": ["id": good.id, "secret": good.secret]],
        ]
        let refusedPosts: [Step] = [
            sealed("/c3pro/encfhir/Observation", observation("x0"), certificate: keys.certificate, keyID: "k1", token: "")
                .filter { $0.key != "bearer" },
            sealed(
                "/c3pro/encfhir/Observation", observation("x1"), certificate: keys.certificate, keyID: "k1",
                token: "not-a-token-" + UUID().uuidString),
            sealed("/c3pro/encfhir", observation("x2"), certificate: keys.certificate, keyID: "k1", token: bearer, scheme: "Basic"),
            plain("/c3pro/fhir/Observation", observation("x3"), token: "not-a-token"),
            ["path": "/c3pro/encfhir/Observation", "bearer": bearer, "pad_bytes": megabyte],
            ["path": "/c3pro/fhirenc/Observation", "bearer": bearer, "pad_bytes": megabyte, "chunked": true],
            ["path": "/c3pro/fhir/Observation", "bearer": bearer, "pad_bytes": megabyte],
            ["path": "/c3pro/encfhir/Observation", "bearer": bearer, "raw": "this is not JSON", "content_type": "application/json"],
            ["path": "/c3pro/fhir/Observation", "bearer": bearer, "raw": "<Observation/>", "content_type": "application/fhir+json"],
            ["path": "/c3pro/encfhir/Observation", "bearer": bearer, "raw": #"{"key_id":"k1"}"#, "content_type": "application/json"],
            [
                "path": "/c3pro/fhir/Patient/other-id", "method": "PUT", "bearer": bearer,
                "fhir": #"{"resourceType":"Patient","id":"this-id","active":true}"#,
            ],
            ["path": "/c3pro/fhir/Patient/this-id", "method": "PUT", "bearer": bearer, "fhir": observation("x4")],
        ]
        steps += refusedPosts
        let answers = try await client(base, steps)
        let expected: [(Int, String?)] = [
            (401, "unauthorized_client"), (401, "unauthorized_client"), (401, "unauthorized_client"), (400, "invalid_request"),
            (401, "invalid_client"), (401, "invalid_client"), (401, "invalid_client"), (400, "unsupported_grant_type"),
            (400, "unsupported_grant_type"), (400, "invalid_request"), (200, nil),
            (401, nil), (401, nil), (401, nil), (401, nil), (413, nil), (413, nil), (413, nil), (400, nil), (400, nil), (400, nil),
            (400, nil), (400, nil),
        ]
        #expect(answers.count == expected.count)
        for (index, (answer, (status, error))) in zip(answers, expected).enumerated() {
            #expect(answer.status == status, "step \(index) \(steps[index]["path"] ?? ""): \(answer)")
            if let error {
                #expect(answer.strictJSON && answer.object["error"] as? String == error, "step \(index): \(answer)")
            }
            #expect(!answer.body.contains(good.secret), "step \(index)")
        }
        // RFC 6749 5.2: a refused client authentication carries its challenge; so does a refused registration
        // (RFC 9110: every 401 names a scheme).
        for index in 4...6 where answers.count > index {
            #expect(answers[index].challenge.hasPrefix("Basic"), "step \(index): \(answers[index].challenge)")
        }
        for index in 0...2 where answers.count > index {
            #expect(answers[index].challenge.hasPrefix("Antispam"), "step \(index): \(answers[index].challenge)")
        }
        // grant_type in the query (C3-PRO read it with getParameter): a token, valid.
        let queried = try #require(answers.count > 10 ? answers[10] : nil)
        let queriedToken = try #require(queried.object["access_token"] as? String, "\(queried)")
        #expect(queried.object["expires_in"] as? Int == 1800 && queried.body.contains(#""expires_in":1800"#), "\(queried)")
        // The receiver kept serving: one good envelope and one good plain resource.
        let accepted = try await client(
            base,
            [
                sealed(
                    "/c3pro/encfhir/Observation", observation("g0"), certificate: keys.certificate, keyID: "k1", token: queriedToken),
                plain("/c3pro/fhir/Observation", observation("g1"), token: bearer),
            ])
        #expect(accepted.first?.status == 202, "\(accepted)")
        #expect([201, 202].contains(accepted.last?.status ?? 0), "\(accepted)")
        #expect(try await eventually { try await values(server).count >= 2 }, "\(receiver.log.suffix(2000))")

        // 20 MB against the default limit (10 MiB), declared and chunked.
        #expect(await receiver.stop().status == 0)
        let standard = try await configure(server: server.base)
        receiver = try await start(standard)
        let huge = try await client(
            receiver.base,
            [
                ["path": "/c3pro/encfhir/QuestionnaireResponse", "bearer": bearer, "pad_bytes": 20 * megabyte],
                ["path": "/c3pro/fhir/Observation", "bearer": bearer, "pad_bytes": 20 * megabyte, "chunked": true],
                ["path": "/c3pro/register", "headers": ["Antispam": antispam], "pad_bytes": 20 * megabyte],
                // No valid token and a chunked body over the limit: answered 413 once read that far, counted once.
                ["path": "/c3pro/encfhir/Observation", "bearer": "not-a-token", "pad_bytes": 20 * megabyte, "chunked": true],
            ])
        #expect(huge.count == 4)
        for answer in huge { #expect(answer.status == 413, "\(answer)") }
        // Refused before their routes ran, and counted with their routes' answers: each once, as sent.
        let afterHuge = try await metricLines(receiver, "dq_serve_requests_total")
        for line in [
            #"dq_serve_requests_total{endpoint="encfhir",status="413"} 2"#, #"dq_serve_requests_total{endpoint="fhir",status="413"} 1"#,
            #"dq_serve_requests_total{endpoint="register",status="413"} 1"#,
        ] {
            #expect(afterHuge.contains(line), "\(line) in \(afterHuge)")
        }
        #expect(!afterHuge.contains { $0.contains(#"endpoint="encfhir",status="401""#) }, "no 401 was sent: \(afterHuge)")
        // Still serving, and the token still valid after the restart.
        let after = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("g2"), certificate: keys.certificate, keyID: "k1", token: bearer)])
        #expect(after.first?.status == 202, "\(after)")
        // g2's delivery is committed after sekmet's answer reaches the flusher: wait on the queue's count, not the server.
        #expect(try await eventually { try await counts(standard).delivered >= 3 }, "\(receiver.log.suffix(2000))")

        #expect(try await values(server) == ["g0", "g1", "g2"], "only the good ones")
        let (pending, parked, delivered) = try await counts(standard)
        #expect(pending == 0 && parked == 0 && delivered == 3, "nothing else stored: \(pending) \(parked) \(delivered)")
        let list = try await dqCommand(["list", "--json"], config: standard)
        #expect((try json(list) as? [Any])?.count == 0, "\(list.stdout)")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "What cannot be opened is taken (202) and quarantined with its reason (unknown key_id, wrong key, no resource inside); what the server rejects is taken and parked; another client's resources flow past; the key added and replayed, it is delivered; an empty key_id is the default key"
    )
    func quarantine() async throws {
        let server = try await FHIRServer.start()
        let first = try await TestKeys()
        let second = try await TestKeys()
        try await install(first, as: "k1", layout: .pem)
        let config = try await configure(server: server.base)
        let receiver = try await start(config)

        // One client sends, first, what cannot be delivered: an envelope under a key the receiver lacks, one under
        // the wrong key, one with no resource inside, and a plain and an enveloped resource the server rejects.
        let stranger = try await register(receiver.base)
        let strangerToken = try await token(receiver.base, stranger)
        // The server names the element it does not know in its refusal: the marker must not reach the disk that way.
        let invalid = resources.invalid(99).replacingOccurrences(of: "notAnElement", with: marker)
        let held = try await client(
            receiver.base,
            [
                sealed(
                    "/c3pro/encfhir/Observation", observation("q0"), certificate: second.certificate, keyID: "k2", token: strangerToken),
                sealed(
                    "/c3pro/encfhir/Observation", observation("w0"), certificate: second.certificate, keyID: "k1", token: strangerToken),
                sealed("/c3pro/encfhir/Observation", "not a resource", certificate: first.certificate, keyID: "k1", token: strangerToken),
                plain("/c3pro/fhir/Observation", invalid, token: strangerToken),
                sealed("/c3pro/fhirenc/Observation", invalid, certificate: first.certificate, keyID: "k1", token: strangerToken),
            ])
        for (index, answer) in held.enumerated() {
            // Taken, not bounced: a device's queue stops at its first error, so a refusal would block it for good.
            #expect((200..<300).contains(answer.status), "\(index): \(answer)")
            #expect(answer.body.isEmpty || answer.strictJSON, "\(index): a 2xx body a C3-PRO app can read: \(answer)")
        }

        let other = try await register(receiver.base)
        let otherToken = try await token(receiver.base, other, formEncoded: true)
        let patientID = "serve-" + UUID().uuidString.prefix(8).lowercased()
        let patient =
            #"{"resourceType":"Patient","id":"\#(patientID)","identifier":[{"system":"\#(resources.system)","value":"q5"}],"active":true}"#
        let flowing = try await client(
            receiver.base,
            [
                sealed("/c3pro/encfhir/Observation", observation("q1"), certificate: first.certificate, keyID: "k1", token: otherToken),
                sealed(
                    "/c3pro/fhirenc/QuestionnaireResponse", questionnaireResponse("q2"), certificate: first.certificate, keyID: "",
                    token: otherToken),
                sealed("/c3pro/encfhir", observation("q3"), certificate: first.certificate, keyID: " k1 ", token: otherToken),
                plain("/c3pro/fhir/Observation", observation("q4"), token: otherToken),
                ["path": "/c3pro/fhir/Patient/\(patientID)", "method": "PUT", "bearer": otherToken, "fhir": patient],
                // The path names a DSTU2 type (not R4): it carries no meaning, the type inside counts.
                sealed("/c3pro/fhirenc/DiagnosticOrder", observation("q6"), certificate: first.certificate, keyID: "k1", token: otherToken),
            ])
        for answer in flowing { #expect([201, 202].contains(answer.status), "\(answer)") }
        let passed = try await eventually(timeout: .seconds(60)) { try await values(server).count >= 6 }
        let passedValues = try await values(server)
        #expect(passed, "\(passedValues) \(receiver.log.suffix(2000))")
        #expect(passedValues == ["q1", "q2", "q3", "q4", "q5", "q6"], "the other client's, in order; nothing of the first's")
        let put = try await HTTP.json("\(server.base)/Patient/\(patientID)")
        #expect(put["active"] as? Bool == true, "PUT with its id: \(put)")

        let listed = try await dqCommand(["quarantine", "list", "--json"], config: config)
        #expect(listed.status == 0, "\(listed.stderr)")
        let quarantined = try #require(try json(listed) as? [[String: Any]], "\(listed.stdout)")
        let reasons = quarantined.map { $0["lastError"] as? String ?? "" }
        #expect(reasons.count == 3, "\(listed.stdout)")
        #expect(reasons.first?.contains("key_id k2") == true, "the reason names the key id: \(reasons)")
        #expect(reasons.dropFirst().first?.contains("does not open") == true, "\(reasons)")
        // What does not unwrap and what opens to no resource read the same: nothing tells a padding failure apart.
        #expect(reasons.last == reasons.dropFirst().first, "\(reasons)")
        #expect(!listed.stdout.contains("not a resource"), "no plaintext in the quarantine's reasons")
        let (_, parkedCount, _) = try await counts(config)
        #expect(parkedCount == 5, "3 quarantined, 2 rejected by the server: \(parkedCount)")
        let itemID = try #require(quarantined.first?["id"] as? String)
        let shown = try await dqCommand(["quarantine", "show", itemID, "--json"], config: config)
        #expect(shown.status == 0, "\(shown.stderr)")
        let detail = try #require(try json(shown) as? [String: Any], "\(shown.stdout)")
        #expect(detail["keyID"] as? String == "k2" && detail["version"] as? String == "3.0.0", "\(shown.stdout)")
        #expect(!shown.stdout.contains("symmetric_key") && !shown.stdout.contains("\"message\""), "\(shown.stdout)")
        // Replayed while the key is still missing: quarantined again, nothing sent.
        let early = try await dqCommand(["quarantine", "replay", itemID, "--json"], config: config)
        #expect(early.status == 0, "\(early.stderr)")
        let again = try await eventually(timeout: .seconds(30)) {
            let list = try await dqCommand(["quarantine", "list", "--json"], config: config)
            return (try json(list) as? [Any])?.count == 3
        }
        #expect(again, "still quarantined without the key")

        // The key added: dq serve reads it when the envelope next names it. The other two stay where they are.
        try await install(second, as: "k2", layout: .pem)
        let replayed = try await dqCommand(["quarantine", "replay", "--all", "--json"], config: config)
        #expect(replayed.status == 0, "\(replayed.stderr)")
        #expect(((try json(replayed) as? [String: Any])?["replayed"] as? [String])?.first == itemID, "\(replayed.stdout)")
        let delivered = try await eventually(timeout: .seconds(60)) { try await values(server).count >= 7 }
        let deliveredValues = try await values(server)
        #expect(delivered, "\(deliveredValues) \(receiver.log.suffix(2000))")
        #expect(deliveredValues == ["q1", "q2", "q3", "q4", "q5", "q6", "q0"], "each once")
        #expect(receiver.process.isRunning, "dq serve ran throughout")
        let remaining = try await eventually(timeout: .seconds(30)) {
            let list = try await dqCommand(["quarantine", "list", "--json"], config: config)
            return (try json(list) as? [Any])?.count == 2
        }
        #expect(remaining, "the envelope under the wrong key and the one with no resource stay quarantined")
        // Opened and quarantined per key id; a key id the directory does not hold is no label of the sender's.
        let metrics = String(decoding: try await HTTP.get(receiver.base + "/metrics").1, as: UTF8.self).split(separator: "\n")
        func counted(_ parts: [String]) -> Bool { metrics.contains { line in parts.allSatisfy { line.contains($0) } } }
        #expect(counted(["dq_envelopes_opened_total{", #"key_id="k1""#]), "\(metrics.filter { $0.contains("envelopes") })")
        #expect(counted(["dq_envelopes_opened_total{", #"key_id="k2""#]), "\(metrics.filter { $0.contains("envelopes") })")
        let quarantinedLines = metrics.filter { $0.hasPrefix("dq_envelopes_quarantined_total{") }
        #expect(quarantinedLines.count == 2, "one line per key id and reason: \(quarantinedLines)")
        #expect(counted(["dq_envelopes_quarantined_total{", #"key_id="unknown""#, #"reason="unknown_key""#]))
        // The envelope under another key and the one that opens to no resource: one reason, counted (at least) twice
        // under k1.
        let underK1 = quarantinedLines.first { $0.contains(#"key_id="k1""#) && $0.contains(#"reason="does_not_open""#) }
        #expect(underK1.flatMap { $0.split(separator: " ").last.flatMap { Double($0) } } ?? 0 >= 2, "\(quarantinedLines)")
        let (pending, parked, count) = try await counts(config)
        #expect(pending == 0 && parked == 4 && count == 7, "\(pending) \(parked) \(count)")
        // Dropped, they are gone from the quarantine.
        let rest = try #require(
            try json(try await dqCommand(["quarantine", "list", "--json"], config: config)) as? [[String: Any]])
        for item in rest {
            let dropped = try await dqCommand(["quarantine", "drop", item["id"] as? String ?? "", "--json"], config: config)
            #expect(dropped.status == 0, "\(dropped.stderr)")
        }
        let empty = try await dqCommand(["quarantine", "list", "--json"], config: config)
        #expect((try json(empty) as? [Any])?.count == 0, "\(empty.stdout)")
        #expect(found(marker).isEmpty, "what the server said of a rejected resource is sealed at rest too: \(found(marker))")
        let parkedList = try await dqCommand(["list", "--parked", "--json"], config: config)
        #expect(parkedList.stdout.contains(marker), "the server's refusal names the element (the scan above can fail)")
        let stopped = await receiver.stop()
        #expect(stopped.status == 0, "\(stopped.stderr.suffix(2000))")
        #expect(!stopped.stderr.contains("not a resource") && !stopped.stderr.contains(marker), "no plaintext in the log")
    }

    @Test(
        "With at_rest set, a marker in every plain and enveloped resource posted while the FHIR server is down is in no byte of the database or WAL, nor in dq serve's log"
    )
    func sealedAtRest() async throws {
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .der)
        let down = "http://127.0.0.1:\(Peers.freePort())/fhir"
        let config = try await configure(server: down)
        let receiver = try await start(config, environment: ["DQ_LOG_LEVEL": "debug"])
        let registered = try await register(receiver.base)
        let bearer = try await token(receiver.base, registered)
        var steps: [Step] = []
        for index in 0..<4 {
            steps.append(plain("/c3pro/fhir/Observation", observation("a\(index)", extra: " \(marker)"), token: bearer))
            steps.append(
                sealed(
                    "/c3pro/encfhir/QuestionnaireResponse", questionnaireResponse("e\(index)", extra: " \(marker)"),
                    certificate: keys.certificate, keyID: "k1", token: bearer))
            steps.append(
                sealed(
                    "/c3pro/fhirenc/Observation", observation("f\(index)", extra: " \(marker)"), certificate: keys.certificate, keyID: "",
                    token: bearer))
        }
        let answers = try await client(receiver.base, steps)
        for answer in answers { #expect(answer.status == 202, "queued, the server being down: \(answer)") }
        #expect(answers.allSatisfy { !$0.body.contains(marker) })
        // Delivery is tried (and fails) meanwhile: the envelopes are opened in memory for it.
        try await Task.sleep(for: .seconds(2))
        let (pending, _, _) = try await counts(config)
        #expect(pending == 12)
        // Taking is what a receiver is ready for: a FHIR server that is down does not take it out of rotation.
        let (ready, why) = try await HTTP.get(receiver.base + "/readyz")
        #expect(ready == 200, "\(String(decoding: why, as: UTF8.self))")
        let walSize = (try? FileManager.default.attributesOfItem(atPath: work.file("queue.sqlite-wal"))[.size] as? Int) ?? 0
        #expect(walSize > 0, "dq serve holds the database open: the WAL is there to search")
        #expect(found(marker).isEmpty, "the marker is readable in \(found(marker))")
        #expect(!receiver.log.contains(marker), "the marker is in dq serve's log")
        let stopped = await receiver.stop()
        #expect(stopped.status == 0, "\(stopped.stderr.suffix(2000))")
        #expect(!stopped.stderr.contains(marker), "the marker is in dq serve's log")
        #expect(found(marker).isEmpty, "the marker is readable in \(found(marker))")
    }

    @Test(
        "dq serve refuses to start (78) with plain FHIR and no at_rest unless plain_at_rest is set (then a warning, and the marker is readable: the scan can fail), and without keys_dir or antispam_file"
    )
    func refusesToStart() async throws {
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let down = "http://127.0.0.1:\(Peers.freePort())/fhir"
        let cases: [(String, String, [String: Any?], String)] = [
            ("plain.json", "plain-db.sqlite", [:], "plain_at_rest"),
            ("nokeys.json", "nokeys-db.sqlite", ["keys_dir": nil], "serve.keys_dir"),
            ("nospam.json", "nospam-db.sqlite", ["antispam_file": nil], "serve.antispam_file"),
            ("missing.json", "missing-db.sqlite", ["antispam_file": "absent.txt"], "serve.antispam_file"),
            ("delete.json", "delete-db.sqlite", ["write_policy": ["system/Patient.cud"]], "never delete"),
            ("scope.json", "scope-db.sqlite", ["write_policy": ["Patient"]], "serve.write_policy"),
        ]
        for (name, database, serve, named) in cases {
            let config = try await configure(
                server: down, atRest: name != "plain.json" ? true : false, serve: serve, name: name, database: database)
            let port = Peers.freePort()
            let result = try await ChildProcess(
                Peers.dqBinary, ["serve", "--config", config, "--listen", "127.0.0.1:\(port)"], environment: ["HOME": work.path]
            ).wait(timeout: .seconds(60))
            #expect(result.status == 78, "\(name): \(result.status) \(result.stderr.suffix(2000))")
            #expect(result.stderr.contains(named), "\(name): the message names \(named): \(result.stderr.suffix(2000))")
            #expect(!Peers.isListening(port: port), "\(name): nothing left listening")
        }

        // Knowingly plain: it starts, warns, and the resource is readable on disk.
        let config = try await configure(server: down, atRest: false, serve: ["plain_at_rest": true], name: "knowing.json")
        let receiver = try await start(config)
        let registered = try await register(receiver.base)
        let bearer = try await token(receiver.base, registered)
        let answers = try await client(
            receiver.base, [plain("/c3pro/fhir/Observation", observation("p0", extra: " \(marker)"), token: bearer)])
        #expect(answers.first?.status == 202, "\(answers)")
        #expect(receiver.log.contains("plain_at_rest"), "a warning: \(receiver.log.suffix(2000))")
        #expect(!found(marker).isEmpty, "without at_rest the marker is readable: the at-rest scan can fail")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "Clients imported from C3-PRO (unsalted SHA-1 of a Base64 secret with + / =) get tokens with the secret raw or form-encoded, in either order; the hash is replaced on first use"
    )
    func importedClients() async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: server.base)
        let receiver = try await start(config)
        // Two clients as C3-PRO's Users table held them, put in dq's table as an import would.
        var imported: [(id: String, secret: String)] = []
        var rows: [String] = []
        for index in 0..<2 {
            var secret = ""
            var hash = ""
            repeat {
                let made = try await TestKeys.openssl(["rand", "-base64", "64"])
                secret = made.stdout.replacingOccurrences(of: "\n", with: "")
                // "SHA1(stdin)= <hex>"
                let digest = try await TestKeys.openssl(["dgst", "-sha1"], stdin: Data(secret.utf8))
                let hex = Array(digest.stdout.split(separator: " ").last?.trimmingCharacters(in: .whitespacesAndNewlines) ?? "")
                let bytes = stride(from: 0, to: hex.count - 1, by: 2).compactMap { UInt8(String(hex[$0...$0 + 1]), radix: 16) }
                #expect(bytes.count == 20, "\(digest.stdout)")
                hash = Data(bytes).base64EncodedString()
            } while !(secret.contains("+") && secret.contains("/"))
            let id = "c3pro-\(index)-" + UUID().uuidString.lowercased()
            imported.append((id, secret))
            rows.append("INSERT INTO dq_clients VALUES ('\(id)', 'sha1b64$\(hash)', 0);")
        }
        let inserted = try await ChildProcess(
            "/usr/bin/sqlite3", [work.file("queue.sqlite")], stdin: Data((".timeout 5000\n" + rows.joined(separator: "\n")).utf8)
        ).wait()
        #expect(inserted.status == 0, "\(inserted.stderr)")
        let answers = try await client(
            receiver.base,
            [
                tokenRequest(imported[0]), tokenRequest(imported[0], formEncoded: true),
                tokenRequest(imported[1], formEncoded: true), tokenRequest(imported[1]),
                tokenRequest((imported[0].id, imported[0].secret.replacingOccurrences(of: "+", with: " "))),
            ])
        #expect(answers.map(\.status) == [200, 200, 200, 200, 401], "\(answers)")
        let hashes = try await ChildProcess(
            "/usr/bin/sqlite3", [work.file("queue.sqlite")],
            stdin: Data(".timeout 5000\nSELECT secret_hash FROM dq_clients WHERE client_id LIKE 'c3pro-%';\n".utf8)
        ).wait()
        let stored = hashes.stdout.split(separator: "\n")
        #expect(stored.count == 2 && stored.allSatisfy { !$0.hasPrefix("sha1b64$") }, "replaced: \(stored)")
        // The token works.
        let token = try #require(answers.first?.object["access_token"] as? String)
        let posted = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("i0"), certificate: keys.certificate, keyID: "k1", token: token)])
        #expect(posted.first?.status == 202, "\(posted)")
        #expect(try await eventually { try await values(server) == ["i0"] }, "\(receiver.log.suffix(2000))")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "A plain resource is answered within a short wait while the FHIR server holds an answer (202, queued), then delivered after what was posted before it"
    )
    func plainAnsweredPromptly() async throws {
        let (server, proxy, keys, _, receiver, bearer) = try await startBehindProxy()
        try await proxy.inject(["hold"])
        let first = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("s0"), certificate: keys.certificate, keyID: "k1", token: bearer)])
        #expect(first.first?.status == 202, "\(first)")
        #expect(try await eventually { (try await proxy.stats()["holding"] as? Int) == 1 }, "the envelope's request is on the wire")
        // The device's request is not held for the server: it is answered once committed, after a short wait.
        let answers = try await client(
            receiver.base,
            [
                plain("/c3pro/fhir/Observation", observation("s1"), token: bearer),
                plain("/c3pro/fhir/Observation", observation("s2"), token: bearer),
            ])
        for answer in answers {
            #expect(answer.status == 202 && answer.strictJSON, "\(answer)")
        }
        // Both were answered while the server's answer was still held: neither waited for the server (no clock in
        // the check, which a busy machine would fail).
        #expect((try await proxy.stats()["holding"] as? Int) == 1, "the first request is still held")
        try await proxy.release()
        #expect(try await eventually(timeout: .seconds(60)) { try await values(server).count >= 3 }, "\(receiver.log.suffix(2000))")
        #expect(try await values(server) == ["s0", "s1", "s2"])
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "SIGHUP: dq serve goes on serving and reads the antispam file and the keys again; register and oauth are limited per address (429 with Retry-After); a token lives token_lifetime_seconds; secret checks are limited for all addresses together (503 with Retry-After)"
    )
    func hangupAndRateLimit() async throws {
        let server = try await FHIRServer.start()
        var keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: server.base)
        var receiver = try await start(config, environment: ["DQ_LOG_LEVEL": "notice"])
        let registered = try await register(receiver.base)
        let bearer = try await token(receiver.base, registered)

        // The antispam secret rotated, and the key of k1 replaced at its path (read when dq serve started).
        let rotated = "rotated-" + UUID().uuidString.lowercased()
        _ = try work.write("antispam.txt", "\(rotated)\n")
        keys = try await TestKeys()
        try FileManager.default.removeItem(atPath: work.file("keys/k1.pem"))
        try await install(keys, as: "k1", layout: .pem)
        receiver.process.kill(SIGHUP)
        let reloaded = try await eventually { receiver.log.contains("configuration reloaded") }
        #expect(reloaded, "\(receiver.log.suffix(2000))")
        #expect(receiver.process.isRunning, "a SIGHUP does not end dq serve")
        let answers = try await client(
            receiver.base,
            [
                registration(antispam), registration(rotated),
                sealed("/c3pro/encfhir/Observation", observation("h0"), certificate: keys.certificate, keyID: "k1", token: bearer),
            ])
        #expect(answers.map(\.status) == [401, 201, 202], "\(answers)")
        #expect(try await eventually { try await values(server) == ["h0"] }, "opened with the new key: \(receiver.log.suffix(2000))")
        // An antispam file that no longer reads: the reload is refused, the running secrets stay.
        try FileManager.default.removeItem(atPath: work.file("antispam.txt"))
        receiver.process.kill(SIGHUP)
        #expect(try await eventually { receiver.log.contains("reload refused") }, "\(receiver.log.suffix(2000))")
        #expect(try await client(receiver.base, [registration(rotated)]).first?.status == 201)
        #expect(!receiver.log.contains(rotated) && !receiver.log.contains(registered.secret), "no secret in the log")
        #expect(await receiver.stop().status == 0)

        // Three auth requests a minute from one address: the fourth is refused with 429 and Retry-After.
        _ = try work.write("antispam.txt", "\(antispam)\n")
        let limited = try await configure(
            server: server.base, serve: ["auth_requests_per_minute": 3, "token_lifetime_seconds": 60], name: "limited.json")
        receiver = try await start(limited)
        let burst = try await client(
            receiver.base,
            [registration(antispam), tokenRequest(registered), registration("wrong"), registration(antispam), tokenRequest(registered)])
        #expect(burst.map(\.status) == [201, 200, 401, 429, 429], "\(burst)")
        for answer in burst.suffix(2) {
            let wait = Int(answer.retryAfter) ?? 0
            #expect((1...60).contains(wait) && answer.strictJSON, "\(answer) Retry-After \(answer.retryAfter)")
        }
        // The limit is on registration and tokens only: a device with a token goes on posting.
        let posted = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("h1"), certificate: keys.certificate, keyID: "k1", token: bearer)])
        #expect(posted.first?.status == 202, "\(posted)")
        #expect(try await eventually { try await values(server) == ["h0", "h1"] }, "\(receiver.log.suffix(2000))")

        // A token of this receiver lives 60 s (its expiry, by the receiver's time source, is tested in process:
        // ReceiverLibraryTests.timeSource, without waiting a minute here).
        let short = try #require(burst[1].object["access_token"] as? String, "\(burst[1])")
        #expect(burst[1].body.contains(#""expires_in":60"#), "\(burst[1])")
        let fresh = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("h2"), certificate: keys.certificate, keyID: "k1", token: short)])
        #expect(fresh.first?.status == 202, "\(fresh)")
        #expect(try await eventually { try await values(server) == ["h0", "h1", "h2"] }, "\(receiver.log.suffix(2000))")
        #expect(await receiver.stop().status == 0)

        // Two secret checks (scrypt) a minute from all addresses together, none per address: a registration and a
        // token request take them; the next of each is answered 503 with Retry-After; a wrong Antispam costs none.
        let checked = try await configure(
            server: server.base, serve: ["auth_requests_per_minute": 0, "secret_checks_per_minute": 2], name: "checked.json")
        receiver = try await start(checked)
        let checks = try await client(
            receiver.base,
            [registration(antispam), tokenRequest(registered), tokenRequest(registered), registration(antispam), registration("wrong")])
        #expect(checks.map(\.status) == [201, 200, 503, 503, 401], "\(checks)")
        for answer in checks[2...3] {
            let wait = Int(answer.retryAfter) ?? 0
            #expect((1...60).contains(wait) && answer.strictJSON, "\(answer) Retry-After \(answer.retryAfter)")
            #expect(answer.object["error"] as? String == "temporarily_unavailable", "\(answer)")
        }
        let stillPosting = try await client(
            receiver.base,
            [sealed("/c3pro/encfhir/Observation", observation("h4"), certificate: keys.certificate, keyID: "k1", token: bearer)])
        #expect(stillPosting.first?.status == 202, "a device with a token goes on posting: \(stillPosting)")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "A client that sends its body a byte a second gets 408 at body_timeout_seconds and holds nothing else up: another device is answered meanwhile, and nothing of the slow one is stored"
    )
    func slowClient() async throws {
        let (server, keys, config, receiver, bearer) = try await startWithClient(serve: ["body_timeout_seconds": 3])
        // The slow device: a declared body of 100 bytes, sent a byte a second; it prints the status line it gets.
        let slow = try ChildProcess(
            "/usr/bin/env",
            [
                "python3", "-c",
                """
                import socket, time, sys
                s = socket.create_connection(("127.0.0.1", \(receiver.port)), timeout=60)
                s.sendall(b"POST /c3pro/encfhir/Observation HTTP/1.1\\r\\nHost: x\\r\\nAuthorization: Bearer \(bearer)\\r\\n"
                          b"Content-Type: application/json\\r\\nContent-Length: 100\\r\\n\\r\\n")
                print("started", flush=True)
                s.setblocking(False)
                answer = b""
                for i in range(100):
                    try:
                        s.send(b"{")
                    except OSError:
                        break
                    time.sleep(1)
                    try:
                        answer += s.recv(4096)
                    except BlockingIOError:
                        pass
                    if b"\\r\\n" in answer:
                        break
                print("answer", answer.split(b"\\r\\n")[0].decode(), flush=True)
                """,
            ])
        #expect(try await eventually { slow.outputSoFar.contains("started") })
        try await anotherDeviceServed(receiver, keys, bearer)
        #expect(!slow.outputSoFar.contains("answer"), "the slow device is still sending: \(slow.outputSoFar)")
        let ended = await slow.wait(timeout: .seconds(90))
        #expect(ended.stdout.contains("answer HTTP/1.1 408"), "\(ended.stdout) \(ended.stderr)")
        let requests = try await metricLines(receiver, "dq_serve_requests_total")
        #expect(requests.contains(#"dq_serve_requests_total{endpoint="encfhir",status="408"} 1"#), "\(requests)")
        #expect(try await eventually(timeout: .seconds(60)) { try await counts(config).delivered >= 1 }, "\(receiver.log.suffix(2000))")
        #expect(try await values(server) == ["fast"])
        let counted = try await counts(config)
        #expect(counted.pending == 0 && counted.parked == 0 && counted.delivered == 1, "\(counted)")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "A connection that trickles its request head a byte at a time, or sits idle after a request, is closed at idle_timeout_seconds; another device is answered meanwhile"
    )
    func slowHead() async throws {
        let (server, keys, _, receiver, bearer) = try await startWithClient(serve: ["idle_timeout_seconds": 2])
        // Two connections: one sends a request head of 180 bytes, a byte every half second (90 s in all, if the
        // receiver let it); one is answered once on a kept-alive connection and then says nothing. Each prints how it
        // ended: "closed after N" (the receiver closed it) or what it got.
        let slow = try ChildProcess(
            "/usr/bin/env",
            [
                "python3", "-c",
                """
                import socket, time
                head = b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\nX-Padding: " + b"p" * 140 + b"\\r\\n\\r\\n"
                idle = socket.create_connection(("127.0.0.1", \(receiver.port)), timeout=60)
                idle.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
                answer = idle.recv(4096)
                print("idle answered", answer.split(b"\\r\\n")[0].decode(), flush=True)
                s = socket.create_connection(("127.0.0.1", \(receiver.port)), timeout=60)
                print("started", flush=True)
                s.setblocking(False)
                sent = 0
                ended = None
                for byte in head:
                    try:
                        s.send(bytes([byte]))
                        sent += 1
                    except OSError:
                        ended = "closed after %d" % sent
                        break
                    time.sleep(0.5)
                    try:
                        got = s.recv(4096)
                        if not got:
                            ended = "closed after %d" % sent
                            break
                        ended = "answer " + got.split(b"\\r\\n")[0].decode()
                        break
                    except BlockingIOError:
                        pass
                    except OSError:
                        ended = "closed after %d" % sent
                        break
                print("slow", ended or "complete", flush=True)
                idle.settimeout(60)
                try:
                    rest = idle.recv(4096)
                    print("idle", "closed" if not rest else "got " + rest.decode(errors="replace"), flush=True)
                except OSError as error:
                    print("idle", "closed" if not isinstance(error, socket.timeout) else "open", flush=True)
                """,
            ])
        #expect(try await eventually { slow.outputSoFar.contains("started") }, "\(slow.outputSoFar)")
        #expect(slow.outputSoFar.contains("idle answered HTTP/1.1 200"), "\(slow.outputSoFar)")
        try await anotherDeviceServed(receiver, keys, bearer)
        let ended = await slow.wait(timeout: .seconds(120))
        let lines = ended.stdout.split(separator: "\n").map(String.init)
        let slowEnd = try #require(lines.first { $0.hasPrefix("slow ") }, "\(ended.stdout) \(ended.stderr)")
        #expect(slowEnd.hasPrefix("slow closed after "), "the trickling head was cut off: \(slowEnd)")
        let sent = Int(slowEnd.split(separator: " ").last ?? "") ?? .max
        #expect(sent < 180, "closed before its head was complete: \(slowEnd)")
        #expect(lines.contains("idle closed"), "the idle kept-alive connection was closed: \(ended.stdout)")
        #expect(try await eventually(timeout: .seconds(60)) { try await values(server) == ["fast"] }, "\(receiver.log.suffix(2000))")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "Under systemd (NOTIFY_SOCKET, WATCHDOG_USEC), dq serve says READY=1 once it listens, beats WATCHDOG=1 from its delivery loop, and says STOPPING=1"
    )
    func systemdNotify() async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: server.base)
        let notify = try NotifySocket(path: work.file("notify.sock"))
        let receiver = try await start(config, environment: ["NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"])
        let messages = await notify.messages(until: 5, contain: "WATCHDOG=1")
        #expect(messages.contains { $0.contains("READY=1") }, "\(messages)")
        #expect(messages.filter { $0.contains("WATCHDOG=1") }.count >= 5, "the delivery loop beats: \(messages)")
        #expect(await receiver.stop().status == 0)
        #expect(notify.waiting().contains { $0.contains("STOPPING=1") })
    }

    @Test(
        "Plain HTTP on an address that is not loopback is warned of at start (tokens and secrets would cross the network readable); on loopback it is not, but a missing trusted_proxies is (every device behind the proxy would share one rate limit)"
    )
    func plainHTTPBeyondLoopback() async throws {
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: "http://127.0.0.1:\(Peers.freePort())/fhir")
        let warning = "not loopback: tokens, client secrets and plain resources cross the network unencrypted"
        // Each log read once it answers (the warning comes before it listens).
        let loopback = try await start(config)
        #expect(!loopback.log.contains(warning), "\(loopback.log.suffix(2000))")
        let proxyWarning =
            #"plain HTTP on loopback and no "serve.trusted_proxies": behind a TLS proxy every device has the proxy's address"#
        #expect(loopback.log.contains(proxyWarning), "\(loopback.log.suffix(2000))")
        #expect(await loopback.stop().status == 0)
        let wildcard = try await start(config, host: "0.0.0.0")
        #expect(wildcard.log.contains("serving plain HTTP on 0.0.0.0, " + warning), "\(wildcard.log.suffix(2000))")
        #expect(!wildcard.log.contains(proxyWarning), "\(wildcard.log.suffix(2000))")
        #expect(await wildcard.stop().status == 0)
    }

    @Test(
        "Behind a trusted proxy, register and oauth are limited per device by X-Forwarded-For (its rightmost address not a trusted proxy); from any other peer the header is ignored; a trusted proxy that is not an IP address is refused"
    )
    func trustedProxies() async throws {
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let down = "http://127.0.0.1:\(Peers.freePort())/fhir"
        func registration(forwardedFor: String) -> Step {
            var step = self.registration(antispam)
            step["headers"] = ["Antispam": antispam, "X-Forwarded-For": forwardedFor]
            return step
        }
        let trusting = try await configure(
            server: down, serve: ["auth_requests_per_minute": 2, "trusted_proxies": ["127.0.0.1"]], name: "trusting.json")
        var receiver = try await start(trusting)
        #expect(!receiver.log.contains("no \"serve.trusted_proxies\""), "\(receiver.log.suffix(2000))")
        let proxied = try await client(
            receiver.base,
            [
                registration(forwardedFor: "203.0.113.5"), registration(forwardedFor: "203.0.113.5"),
                registration(forwardedFor: "203.0.113.5"),
                // Another device; then the same with a left part it wrote itself, and through a second trusted hop.
                registration(forwardedFor: "203.0.113.6"), registration(forwardedFor: "198.51.100.1, 203.0.113.6"),
                registration(forwardedFor: "203.0.113.6, 127.0.0.1"),
            ])
        #expect(proxied.map(\.status) == [201, 201, 429, 201, 201, 429], "\(proxied)")
        #expect(await receiver.stop().status == 0)

        // Without trusted proxies the header is a device's word: every request counts against the peer (loopback).
        let direct = try await configure(server: down, serve: ["auth_requests_per_minute": 2], name: "direct.json")
        receiver = try await start(direct)
        let spoofed = try await client(
            receiver.base,
            [
                registration(forwardedFor: "203.0.113.5"), registration(forwardedFor: "203.0.113.6"),
                registration(forwardedFor: "203.0.113.7"),
            ])
        #expect(spoofed.map(\.status) == [201, 201, 429], "\(spoofed)")
        #expect(await receiver.stop().status == 0)

        let bad = try await configure(server: down, serve: ["trusted_proxies": ["proxy.local"]], name: "bad.json")
        let refused = try await dqCommand(["serve", "--listen", "127.0.0.1:\(Peers.freePort())"], config: bad)
        #expect(refused.status == 78, "\(refused.stderr)")
        #expect(refused.stderr.contains("\"serve.trusted_proxies\" must be a list of IP addresses"), "\(refused.stderr)")
    }
}
