import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// `serve.tls`: `dq serve` speaking HTTPS itself, its certificate read again on SIGHUP without dropping the listener;
/// certificates made with the openssl CLI, checked by Python's `ssl` against the test CA.
extension ServeTrustSuite {
    /// A test CA and certificates it signed for 127.0.0.1: `one` and `two` (each with its key), and `expired` (one's
    /// key, valid only in January 2020).
    struct TLSFiles {
        let ca: String
        let one: (cert: String, key: String)
        let two: (cert: String, key: String)
        let expired: String
    }

    func tlsFiles() async throws -> TLSFiles {
        let folder = work.file("pki")
        try FileManager.default.createDirectory(atPath: folder + "/issued", withIntermediateDirectories: true)
        let (ca, caKey) = (folder + "/ca.pem", folder + "/ca.key")
        try await TestKeys.openssl([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", caKey, "-out", ca, "-days", "2", "-subj", "/CN=dq serve test CA",
        ])
        let extensions = try work.write("pki/san.ext", "subjectAltName=IP:127.0.0.1\n")
        func signed(_ name: String) async throws -> (cert: String, key: String) {
            let (cert, key, request) = (folder + "/\(name).pem", folder + "/\(name).key", folder + "/\(name).csr")
            try await TestKeys.openssl([
                "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", "/CN=dq-serve-\(name)",
            ])
            try await TestKeys.openssl([
                "x509", "-req", "-in", request, "-CA", ca, "-CAkey", caKey, "-CAcreateserial", "-out", cert, "-days", "2", "-extfile",
                extensions,
            ])
            chmod(key, 0o600)  // as the README asks of a TLS key (dq doctor fails on one others can read)
            return (cert, key)
        }
        let one = try await signed("one")
        let two = try await signed("two")
        // `openssl ca` takes explicit dates (openssl 3.0's x509 has no -not_after).
        _ = try work.write("pki/index.txt", "")
        _ = try work.write("pki/serial", "1000\n")
        let config = try work.write(
            "pki/ca.cnf",
            """
            [ca]
            default_ca = test
            [test]
            database = \(folder)/index.txt
            new_certs_dir = \(folder)/issued
            serial = \(folder)/serial
            default_md = sha256
            policy = any
            unique_subject = no
            [any]
            commonName = supplied

            """)
        let expired = folder + "/expired.pem"
        try await TestKeys.openssl([
            "ca", "-batch", "-config", config, "-cert", ca, "-keyfile", caKey, "-in", folder + "/one.csr", "-out", expired,
            "-startdate", "20200101000000Z", "-enddate", "20200102000000Z", "-notext",
        ])
        return TLSFiles(ca: ca, one: one, two: two, expired: expired)
    }

    /// The SHA-256 fingerprint of a PEM certificate, as `openssl x509 -fingerprint -sha256` prints it (colons
    /// removed, upper case).
    func fingerprint(_ certificate: String) async throws -> String {
        let printed = try await TestKeys.openssl(["x509", "-in", certificate, "-noout", "-fingerprint", "-sha256"]).stdout
        let value = try #require(printed.split(separator: "=").last.map(String.init), "\(printed)")
        return value.replacingOccurrences(of: ":", with: "").trimmingCharacters(in: .whitespacesAndNewlines).uppercased()
    }

    /// Puts `pair` where `serve.tls` names it (`tls/cert.pem`, `tls/key.pem`), as a renewal would.
    func installTLS(_ pair: (cert: String, key: String)) throws {
        let folder = work.file("tls")
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        for (from, to) in [(pair.cert, "cert.pem"), (pair.key, "key.pem")] {
            let data = try Data(contentsOf: URL(fileURLWithPath: from))
            try data.write(to: URL(fileURLWithPath: "\(folder)/\(to)"), options: .atomic)
            chmod("\(folder)/\(to)", 0o600)
        }
    }

    /// `dq serve` with `serve.tls` on a free port, once its `/readyz` answers 200 over TLS verified against `ca`.
    func startTLS(_ config: String, ca: String) async throws -> Receiver {
        let port = Peers.freePort()
        let process = try ChildProcess(
            Peers.dqBinary, ["serve", "--config", config, "--listen", "127.0.0.1:\(port)", "--poll-interval", "0.1"],
            environment: ["HOME": work.path, "DQ_LOG_LEVEL": "notice"], directory: work.path)
        let receiver = Receiver(process: process, port: port)
        let probe = try work.write("tls-probe.py", Self.tlsProbeScript)
        let ready = try await eventually(timeout: .seconds(60)) {
            guard process.isRunning else { return false }
            let result = try await ChildProcess(Peers.venv + "/bin/python", [probe, "ready", String(port), ca]).wait(timeout: .seconds(30))
            return result.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "200"
        }
        if !ready {
            let result = await process.stop()
            throw TestFailure("dq serve with TLS did not become ready (\(result.status)): \(result.stderr.suffix(3000))")
        }
        return receiver
    }

    /// The C3-PRO client of ``ServeTests/client(_:_:)`` over HTTPS, verifying the server against `ca`.
    func tlsClient(_ base: String, _ steps: [Step], ca: String) async throws -> [Answer] {
        let path = try work.write("tls-client.py", Self.clientScript)
        let file = work.file("steps-\(UUID().uuidString).json")
        try JSONSerialization.data(withJSONObject: steps).write(to: URL(fileURLWithPath: file))
        let result = try await ChildProcess(Peers.venv + "/bin/python", [path, base, file], environment: ["DQ_TEST_CA": ca])
            .wait(timeout: .seconds(120))
        guard result.status == 0, let answers = try? JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [[String: Any]]
        else {
            throw TestFailure("the Python TLS client failed (\(result.status)): \(result.stderr.suffix(3000))")
        }
        return answers.map(Answer.init)
    }

    /// The fingerprint a new TLS connection to `port` is shown (verified against `ca`), and its `/healthz` status.
    func servedCertificate(port: Int, ca: String) async throws -> (fingerprint: String, status: Int) {
        let probe = try work.write("tls-probe.py", Self.tlsProbeScript)
        let result = try await ChildProcess(Peers.venv + "/bin/python", [probe, "once", String(port), ca]).wait(timeout: .seconds(60))
        let object = try #require(
            try? JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any], "\(result.status) \(result.stderr)")
        return (object["sha256"] as? String ?? "", object["status"] as? Int ?? -1)
    }

    @Test(
        "serve.tls: a Python client verifies dq serve's certificate against the test CA, registers and posts an envelope (202, on sekmet); plain HTTP to the port fails; after SIGHUP a new connection gets the renewed certificate while one opened before goes on, on the same listener; a bad pair on SIGHUP is refused and the old certificate stays"
    )
    func tlsInProcess() async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let files = try await tlsFiles()
        let (one, two) = (try await fingerprint(files.one.cert), try await fingerprint(files.two.cert))
        #expect(one != two && one.count == 64)
        try installTLS(files.one)
        // Relative paths: from the configuration file's directory.
        let config = try await configure(server: server.base, serve: ["tls": ["certificate": "tls/cert.pem", "key": "tls/key.pem"]])
        let receiver = try await startTLS(config, ca: files.ca)
        let base = "https://127.0.0.1:\(receiver.port)"

        // The device, over TLS: registration, a token, an envelope; it reaches sekmet opened.
        let device = try await tlsClient(
            base, [registration(antispam)], ca: files.ca)
        #expect(device.first?.status == 201, "\(device)")
        let client = (
            id: try #require(device.first?.object["client_id"] as? String),
            secret: try #require(device.first?.object["client_secret"] as? String)
        )
        let tokenAnswer = try #require(try await tlsClient(base, [tokenRequest(client)], ca: files.ca).first)
        #expect(tokenAnswer.status == 200, "\(tokenAnswer)")
        let bearer = try #require(tokenAnswer.object["access_token"] as? String, "\(tokenAnswer)")
        let posted = try await tlsClient(
            base, [sealed("/c3pro/encfhir/Observation", observation("t0"), certificate: keys.certificate, keyID: "k1", token: bearer)],
            ca: files.ca)
        #expect(posted.map(\.status) == [202], "\(posted)")
        #expect(try await eventually { try await values(server) == ["t0"] }, "\(receiver.log.suffix(2000))")

        // Plain HTTP to the TLS port gets no HTTP answer.
        let plain = try? await HTTP.get("http://127.0.0.1:\(receiver.port)/healthz")
        #expect(plain == nil, "plain HTTP answered \(String(describing: plain?.0))")
        let served = try await servedCertificate(port: receiver.port, ca: files.ca)
        #expect(served.fingerprint == one && served.status == 200, "\(served)")

        // A keep-alive connection opened before the renewal: it says what it was shown, then waits for a line.
        let probe = try work.write("tls-probe.py", Self.tlsProbeScript)
        let held = try ChildProcess(Peers.venv + "/bin/python", [probe, "hold", String(receiver.port), files.ca], keepStdinOpen: true)
        let opened = try await eventually {
            ((try? String(contentsOfFile: held.stdoutPath, encoding: .utf8)) ?? "").contains("\n") || !held.isRunning
        }
        #expect(opened && held.isRunning, "\((try? String(contentsOfFile: held.stderrPath, encoding: .utf8)) ?? "")")

        // Renewal: the second certificate and its key at the same paths, then SIGHUP.
        try installTLS(files.two)
        receiver.process.kill(SIGHUP)
        #expect(try await eventually { receiver.log.contains("TLS certificate read again") }, "\(receiver.log.suffix(2000))")
        let renewed = try await servedCertificate(port: receiver.port, ca: files.ca)
        #expect(renewed.fingerprint == two && renewed.status == 200, "a new connection gets the new certificate: \(renewed)")
        held.writeStdin(Data("go\n".utf8))
        held.closeStdin()
        let heldResult = await held.wait(timeout: .seconds(60))
        #expect(heldResult.status == 0, "\(heldResult.stderr.suffix(2000))")
        let lines = heldResult.stdout.split(separator: "\n").compactMap {
            try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any]
        }
        #expect(lines.count == 2, "\(heldResult.stdout)")
        if lines.count == 2 {
            #expect(lines[0]["sha256"] as? String == one && lines[0]["status"] as? Int == 200, "\(lines[0])")
            // The same socket (local port) still answers, on the session it had: the listener and it were not dropped.
            #expect(lines[1]["sha256"] as? String == one && lines[1]["status"] as? Int == 200, "\(lines[1])")
            #expect(lines[0]["local"] as? Int == lines[1]["local"] as? Int, "one connection: \(lines)")
        }
        // Still a working receiver on the new certificate: the device posts again.
        let again = try await tlsClient(
            base, [sealed("/c3pro/encfhir/Observation", observation("t1"), certificate: keys.certificate, keyID: "k1", token: bearer)],
            ca: files.ca)
        #expect(again.map(\.status) == [202], "\(again)")
        #expect(try await eventually { try await values(server) == ["t0", "t1"] }, "\(receiver.log.suffix(2000))")

        // A bad pair (the first certificate with the second's key): refused, the running one stays.
        try installTLS((files.one.cert, files.two.key))
        receiver.process.kill(SIGHUP)
        #expect(try await eventually { receiver.log.contains("reload refused") }, "\(receiver.log.suffix(2000))")
        #expect(receiver.log.contains("does not match its key"), "\(receiver.log.suffix(2000))")
        let kept = try await servedCertificate(port: receiver.port, ca: files.ca)
        #expect(kept.fingerprint == two && kept.status == 200, "the running certificate stays: \(kept)")
        #expect(receiver.process.isRunning)
        let log = receiver.log
        let stopped = await receiver.stop()
        #expect(stopped.status == 0, "\(stopped.stderr.suffix(2000))")
        for key in [files.one.key, files.two.key] {
            try expectNoKeyMaterial(of: key, in: log)
        }
    }

    /// No line of the PEM key's Base64 body (nor its armour) appears in `text`.
    func expectNoKeyMaterial(of key: String, in text: String) throws {
        let pem = try String(contentsOfFile: key, encoding: .utf8)
        #expect(!text.contains("PRIVATE KEY"))
        for line in pem.split(separator: "\n") where !line.hasPrefix("-----") {
            #expect(!text.contains(line), "a line of \(key) in the output")
        }
    }

    @Test(
        "serve.tls: a certificate that does not match its key, an expired certificate, an unreadable file or half a pair stop dq serve at start (78) with a clear message, nothing listening and no key material printed; dq doctor names the same"
    )
    func tlsRefusesToStart() async throws {
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let files = try await tlsFiles()
        let down = "http://127.0.0.1:\(Peers.freePort())/fhir"
        let cases: [(String, [String: String], String)] = [
            ("mismatch", ["certificate": files.one.cert, "key": files.two.key], "does not match its key"),
            ("expired", ["certificate": files.expired, "key": files.one.key], "expired: notValidAfter 2020-01-02T00:00:00Z"),
            ("unreadable", ["certificate": work.file("absent.pem"), "key": files.one.key], "cannot read \"serve.tls.certificate\""),
            ("not-a-key", ["certificate": files.one.cert, "key": files.one.cert], "is not an unencrypted PEM private key"),
            ("half", ["certificate": files.one.cert], "both or neither"),
        ]
        for (name, tls, message) in cases {
            let config = try await configure(server: down, serve: ["tls": tls], name: "\(name).json", database: "\(name).sqlite")
            let port = Peers.freePort()
            let result = try await ChildProcess(
                Peers.dqBinary, ["serve", "--config", config, "--listen", "127.0.0.1:\(port)"], environment: ["HOME": work.path]
            ).wait(timeout: .seconds(60))
            #expect(result.status == 78, "\(name): \(result.status) \(result.stderr.suffix(2000))")
            #expect(result.stderr.contains(message), "\(name): \(result.stderr.suffix(2000))")
            #expect(!Peers.isListening(port: port), "\(name): nothing left listening")
            try expectNoKeyMaterial(of: files.one.key, in: result.stderr + result.stdout)
            try expectNoKeyMaterial(of: files.two.key, in: result.stderr + result.stdout)
            let doctor = try await dqCommand(["doctor", "--offline"], config: config)
            #expect(doctor.status == 78, "\(name): doctor \(doctor.status) \(doctor.stderr.suffix(2000))")
            #expect(doctor.stderr.contains(message), "\(name): doctor \(doctor.stderr.suffix(2000))")
        }
        // A certificate good for two more days: dq doctor warns (exit 0) and names its end.
        let config = try await configure(
            server: down, serve: ["tls": ["certificate": files.one.cert, "key": files.one.key]], name: "soon.json",
            database: "mismatch.sqlite")
        let doctor = try await dqCommand(["doctor", "--offline"], config: config)
        #expect(doctor.status == 0, "\(doctor.stderr.suffix(2000))")
        #expect(doctor.stderr.contains("warning: \"serve.tls.certificate\"") && doctor.stderr.contains("notValidAfter"), "\(doctor.stderr)")
    }

    /// `tls-probe.py ready|once|hold PORT CA`: `ready` prints `/readyz`'s status over TLS (nothing when it cannot
    /// connect); `once` prints `{"sha256", "status", "local"}` of a new connection's `/healthz`; `hold` prints that,
    /// waits for a line on standard input, and prints it again for a second request on the same connection.
    static let tlsProbeScript = #"""
        import hashlib, http.client, json, ssl, sys

        mode, port, ca = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        context = ssl.create_default_context(cafile=ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2

        def get(connection, path):
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            return response.status

        def seen(connection, path):
            status = get(connection, path)
            der = connection.sock.getpeercert(binary_form=True)
            return {"sha256": hashlib.sha256(der).hexdigest().upper(), "status": status,
                    "local": connection.sock.getsockname()[1]}

        connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
        if mode == "ready":
            try:
                print(get(connection, "/readyz"))
            except OSError:
                pass
        elif mode == "once":
            print(json.dumps(seen(connection, "/healthz")))
        else:
            print(json.dumps(seen(connection, "/healthz")), flush=True)
            sys.stdin.readline()
            socket_before = connection.sock
            answer = seen(connection, "/healthz")
            if connection.sock is not socket_before:
                sys.exit("the connection was opened again")
            print(json.dumps(answer), flush=True)
        """#
}
