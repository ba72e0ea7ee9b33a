import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Split trust: a public-facing `dq serve --role edge` that holds no private key, forwarding through its own queue
/// to an inside `dq serve --role decrypt` that opens and forwards to sekmet.
extension ServeTrustSuite {
    /// The edge's `dq.json`: no `server`, no key, no `at_rest`; its queue's `auth` is the client it registered as
    /// at the inside receiver.
    func configureEdge(
        inside: String, certificate: String, client: (id: String, secret: String), serve extra: [String: Any] = [:]
    ) throws -> String {
        var serve: [String: Any] = [
            "role": "edge", "antispam_file": "antispam.txt", "forward_to": inside + "/c3pro", "forward_certificate": certificate,
            "forward_key_id": "k1",
        ]
        for (key, value) in extra { serve[key] = value }
        let root: [String: Any] = [
            "database": work.file("edge.sqlite"), "serve": serve,
            "auth": ["client_id": client.id, "client_secret": client.secret, "token_uri": inside + "/c3pro/oauth"],
            "retry": ["initial_seconds": 0.1, "maximum_seconds": 0.5],
        ]
        let data = try JSONSerialization.data(withJSONObject: root, options: [.sortedKeys])
        return try work.write("edge.json", String(decoding: data, as: UTF8.self))
    }

    /// Every file of the edge's queue and its log, searched for `needle`.
    func edgeFiles(containing needle: String, log: String) -> [String] {
        var found = found(needle, database: "edge.sqlite")
        if log.contains(needle) { found.append("the edge's log") }
        return found
    }

    @Test(
        "Split trust: a device posts envelopes and plain resources to an edge that holds no key; the inside opens them; all on sekmet once, in order; no plaintext on the edge; the edge killed and restarted while the inside is down loses nothing",
        arguments: ["sqlite", "postgres"]
    )
    func edgeAndDecrypt(store: String) async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let insideConfig = try await configure(
            server: server.base, serve: ["role": "decrypt", "plain_fhir": false], name: "inside.json", database: "inside.sqlite")
        // The inside's queue in SQLite or PostgreSQL (an edge's batch commits with each envelope's client there too).
        var insideEnvironment = ["HOME": work.path]
        if store == "postgres" {
            var root = try #require(
                try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: insideConfig))) as? [String: Any])
            root["database"] = try await PostgresTests.freshDatabase()
            insideEnvironment["PGPASSWORD"] = Peers.environment["DQ_TEST_POSTGRES_PASSWORD"] ?? ""
            _ = try work.write("inside.json", String(decoding: try JSONSerialization.data(withJSONObject: root), as: UTF8.self))
        }
        let insideStatus = { () async throws -> [String: Any] in
            let result = try await dq(["status", "--json", "--config", insideConfig], insideEnvironment, directory: work.path)
            return try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any] ?? ["stderr": result.stderr]
        }
        let insidePort = Peers.freePort()
        var inside = try await start(insideConfig, environment: insideEnvironment, port: insidePort)
        // The edge is a client of the inside receiver, registered as a device would be.
        let edgeClient = try await register(inside.base)
        let edgeConfig = try configureEdge(inside: inside.base, certificate: keys.certificate, client: edgeClient)
        var edge = try await start(edgeConfig)

        let device = try await register(edge.base)
        let token = try await self.token(edge.base, device)
        var posted: [String] = []
        func steps(_ range: Range<Int>) -> [Step] {
            range.map { index in
                let value = "s\(index)-\(marker)"
                switch index % 3 {
                case 0:
                    posted.append(questionnaireResponse(value))
                    return sealed(
                        "/c3pro/encfhir/QuestionnaireResponse", posted[index], certificate: keys.certificate, keyID: "k1", token: token)
                case 1:
                    posted.append(observation(value))
                    return sealed("/c3pro/fhirenc/Observation", posted[index], certificate: keys.certificate, keyID: "", token: token)
                default:
                    posted.append(observation(value, extra: " plain"))
                    return plain("/c3pro/fhir/Observation", posted[index], token: token)
                }
            }
        }
        let first = try await client(edge.base, steps(0..<9))
        #expect(first.count == 9 && first.allSatisfy { $0.status == 202 }, "\(first)")
        let expected = { (count: Int) in (0..<count).map { "s\($0)-\(marker)" } }
        #expect(try await eventually(timeout: .seconds(60)) { try await values(server).count >= 9 }, "\(inside.log.suffix(2000))")
        #expect(try await values(server) == expected(9), "once each, in the order posted")
        #expect(try await eventually { try await counts(edgeConfig).delivered == 9 }, "\(edge.log.suffix(2000))")

        // The inside goes down; the device goes on posting to the edge, which is then killed and started again.
        let insideStopped = await inside.stop()
        #expect(insideStopped.status == 0, "\(insideStopped.stderr.suffix(2000))")
        let second = try await client(edge.base, steps(9..<15))
        #expect(second.count == 6 && second.allSatisfy { $0.status == 202 }, "\(second)")
        edge.process.kill(SIGKILL)
        _ = await edge.process.wait(timeout: .seconds(30))
        edge = try await start(edgeConfig)
        let third = try await client(edge.base, steps(15..<18))
        #expect(third.count == 3 && third.allSatisfy { $0.status == 202 }, "\(third)")
        #expect(try await counts(edgeConfig).pending == 9, "waiting on the edge while the inside is down")
        inside = try await start(insideConfig, environment: insideEnvironment, port: insidePort)
        #expect(try await eventually(timeout: .seconds(60)) { try await values(server).count >= 18 }, "\(edge.log.suffix(2000))")
        let onServer = try await stored(server)
        #expect(onServer.map(\.0) == expected(18), "once each, in the order posted, across the edge's kill")
        for (value, resource) in onServer {
            guard let index = expected(18).firstIndex(of: value) else { continue }
            let sent = try #require(try JSONSerialization.jsonObject(with: Data(posted[index].utf8)) as? [String: Any])
            #expect(content(resource) == content(sent), "\(value) arrived opened and unchanged")
        }
        #expect(try await eventually { try await counts(edgeConfig).delivered == 18 }, "\(edge.log.suffix(2000))")
        // The edge forwarded in batches (one request, one commit on each side, for many envelopes).
        let (_, metricsBody) = try await HTTP.get(inside.base + "/metrics")
        let batches = String(decoding: metricsBody, as: UTF8.self).split(separator: "\n")
            .first { $0.hasPrefix(#"dq_serve_requests_total{endpoint="encfhir_batch",status="202"}"#) }
        let batchCount = batches.flatMap { Double($0.split(separator: " ").last ?? "") } ?? 0
        #expect(batchCount >= 1 && batchCount < 18, "\(batches.map(String.init) ?? "no batch")")

        // Repeats across the split, decided inside: device A sends a resource again with a fresh key wrap (a
        // duplicate of its own), device B sends the same plaintext device A sent (not a duplicate: another device
        // behind the same edge).
        let deviceB = try await register(edge.base)
        let tokenB = try await self.token(edge.base, deviceB)
        let repeats = try await client(
            edge.base,
            [
                sealed("/c3pro/fhirenc/Observation", posted[1], certificate: keys.certificate, keyID: "", token: token),
                sealed("/c3pro/fhirenc/Observation", posted[1], certificate: keys.certificate, keyID: "", token: tokenB),
            ])
        #expect(repeats.map(\.status) == [202, 202], "\(repeats)")
        let settled = try await eventually(timeout: .seconds(60)) {
            let status = try await insideStatus()
            return status["duplicates"] as? Int == 1 && status["delivered"] as? Int == 19
        }
        let finalStatus = try await insideStatus()
        #expect(settled, "one duplicate (device A's), device B's delivered: \(finalStatus)")

        // The edge never held a readable resource: no marker in its database, WAL or log (the inside opened them).
        let edgeStopped = await edge.stop()
        #expect(edgeStopped.status == 0, "\(edgeStopped.stderr.suffix(2000))")
        #expect(edgeFiles(containing: marker, log: edgeStopped.stderr).isEmpty)
        _ = await inside.stop()
    }

    @Test(
        "An edge authenticates to the decrypting receiver with a SMART Backend Services key (its JWKS in serve.edges); a bad assertion is refused"
    )
    func edgeWithKeySet() async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .der)
        let made = try await dq(["keygen", "--out", work.file("edge-key.pem"), "--kid", "edge-1-key"], ["HOME": work.path])
        #expect(made.status == 0, "\(made.stderr)")
        _ = try work.write("edge-1.jwks.json", made.stdout)
        let insideConfig = try await configure(
            server: server.base, serve: ["role": "decrypt", "plain_fhir": false, "edges": ["edge-1": "edge-1.jwks.json"]],
            name: "inside.json", database: "inside.sqlite")
        let inside = try await start(insideConfig)
        var edgeConfig = try configureEdge(inside: inside.base, certificate: keys.certificate, client: ("edge-1", "unused"))
        var root = try #require(
            try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: edgeConfig))) as? [String: Any])
        root["auth"] = [
            "client_id": "edge-1", "token_uri": inside.base + "/c3pro/oauth", "private_key": work.file("edge-key.pem"),
            "key_id": "edge-1-key", "token_endpoint_auth_method": "private_key_jwt",
        ]
        edgeConfig = try work.write("edge.json", String(decoding: try JSONSerialization.data(withJSONObject: root), as: UTF8.self))
        let edge = try await start(edgeConfig)
        let device = try await register(edge.base)
        let token = try await self.token(edge.base, device)
        let answers = try await client(
            edge.base,
            (0..<3).map {
                sealed(
                    "/c3pro/encfhir/QuestionnaireResponse", questionnaireResponse("j\($0)"), certificate: keys.certificate, keyID: "k1",
                    token: token)
            })
        #expect(answers.map(\.status) == [202, 202, 202], "\(answers)")
        #expect(
            try await eventually(timeout: .seconds(60)) { try await values(server).count >= 3 },
            "\(edge.log.suffix(2000)) \(inside.log.suffix(2000))")
        #expect(try await values(server) == ["j0", "j1", "j2"])
        // A device's update through the edge (sealed there, a create on the wire to the inside) is an update on the
        // server: the opener PUTs a resource with an id, as C3-PRO's consumer PUT a Patient.
        let patientID = "p-" + UUID().uuidString.prefix(8).lowercased()
        let patient = #"{"resourceType":"Patient","id":"\#(patientID)","active":true,"name":[{"family":"Edge"}]}"#
        let put = try await client(
            edge.base, [["path": "/c3pro/fhir/Patient/\(patientID)", "method": "PUT", "bearer": token, "fhir": patient]])
        #expect(put.first?.status == 202, "\(put)")
        let updated = try await eventually(timeout: .seconds(60)) {
            (try? await HTTP.get("\(server.base)/Patient/\(patientID)"))?.0 == 200
        }
        #expect(updated, "Patient/\(patientID) on the server under its own id: \(inside.log.suffix(1500))")
        // An assertion that is not a signed JWT, and one without its type: refused, no token.
        let refused = try await client(
            inside.base,
            [
                [
                    "path": "/c3pro/oauth",
                    "form":
                        "grant_type=client_credentials&client_assertion_type=urn%3Aietf%3Aparams%3Aoauth%3Aclient-assertion-type%3Ajwt-bearer&client_assertion=e30.e30.AAAA",
                ],
                ["path": "/c3pro/oauth", "form": "grant_type=client_credentials&client_assertion=e30.e30.AAAA"],
            ])
        #expect(refused.map(\.status) == [401, 400], "\(refused)")
        #expect(refused.first?.challenge.hasPrefix("Basic") == true, "a 401 names a scheme: \(refused)")
        #expect(refused.allSatisfy { $0.object["access_token"] == nil }, "\(refused)")
        // The edge's client has no secret: Basic with any secret is refused.
        let basic = try await client(inside.base, [tokenRequest(("edge-1", Self.keySetOnlyHash))])
        #expect(basic.first?.status == 401, "\(basic)")
        _ = await edge.stop()
        _ = await inside.stop()
    }

    @Test(
        "Updates are not repeats: A, B, then A again of one Patient through dq serve, as plain PUTs or as envelopes, leaves A on the server",
        arguments: [false, true])
    func updatesAreNotRepeats(sealedUpdates: Bool) async throws {
        let server = try await FHIRServer.start()
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(server: server.base)
        let receiver = try await start(config)
        let device = try await register(receiver.base)
        let token = try await self.token(receiver.base, device)
        let id = "u-" + UUID().uuidString.prefix(8).lowercased()
        func patient(_ family: String) -> Step {
            let body = #"{"resourceType":"Patient","id":"\#(id)","name":[{"family":"\#(family)"}]}"#
            // An envelope holding a resource with an id is forwarded as its update (PUT), as C3-PRO's consumer did.
            return sealedUpdates
                ? sealed("/c3pro/encfhir/Patient", body, certificate: keys.certificate, keyID: "k1", token: token)
                : ["path": "/c3pro/fhir/Patient/\(id)", "method": "PUT", "bearer": token, "fhir": body]
        }
        let answers = try await client(receiver.base, [patient("Alpha"), patient("Beta"), patient("Alpha")])
        #expect(answers.allSatisfy { [200, 201, 202].contains($0.status) }, "\(answers)")
        #expect(try await eventually(timeout: .seconds(60)) { try await counts(config).delivered == 3 }, "\(receiver.log.suffix(2000))")
        let (status, body) = try await HTTP.get("\(server.base)/Patient/\(id)")
        let stored = (try? JSONSerialization.jsonObject(with: body)) as? [String: Any]
        let family = ((stored?["name"] as? [[String: Any]])?.first?["family"] as? String) ?? ""
        #expect(status == 200 && family == "Alpha", "the last update is on the server: \(String(decoding: body, as: UTF8.self))")
        _ = await receiver.stop()
    }

    @Test(
        "An edge whose inside answers a batch 2xx without counting it (no dq serve) counts none of it delivered and sends each envelope alone"
    )
    func edgeBatchNotCounted() async throws {
        let keys = try await TestKeys()
        let port = Peers.freePort()
        let log = work.file("fake-inside.log")
        let script = try work.write("fake-inside.py", Self.fakeInside)
        _ = try work.write("antispam.txt", "\(antispam)\n")
        let edgeConfig = try configureEdge(inside: "http://127.0.0.1:\(port)", certificate: keys.certificate, client: ("edge", "s"))
        let edge = try await start(edgeConfig)
        let device = try await register(edge.base)
        let token = try await self.token(edge.base, device)
        // Queued while nothing listens at the inside's address, so that the edge's next attempt is a batch of four.
        let answers = try await client(
            edge.base,
            (0..<4).map {
                sealed("/c3pro/encfhir/Observation", observation("b\($0)"), certificate: keys.certificate, keyID: "k1", token: token)
            })
        #expect(answers.map(\.status) == [202, 202, 202, 202], "\(answers)")
        let fake = try ChildProcess(Peers.venv + "/bin/python", [script, String(port), log])
        defer { fake.killInBackground() }
        let settled = try await eventually(timeout: .seconds(60)) { try await counts(edgeConfig).delivered == 4 }
        let seen = (try? String(contentsOfFile: log, encoding: .utf8)) ?? ""
        #expect(settled, "\(seen) \(edge.log.suffix(2000))")
        #expect(seen.split(separator: "\n") == ["batch 4", "single", "single", "single", "single"], "\(seen)")
        _ = await edge.stop()
    }

    /// A receiver that takes one envelope per request and answers a batch 202 with an empty body (as a C3-PRO
    /// servlet or a proxy would): `fake-inside.py PORT LOG`; each request is a line of LOG.
    static let fakeInside = #"""
        import json, sys
        from http.server import BaseHTTPRequestHandler, HTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.endswith("/oauth"):
                    answer = json.dumps({"access_token": "t", "token_type": "bearer", "expires_in": 3600}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                kind = self.headers.get("Content-Type", "")
                line = "batch %d" % len(json.loads(body)) if "envelope-batch" in kind else "single"
                with open(sys.argv[2], "a") as log:
                    log.write(line + "\n")
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
        """#

    /// What the receiver stores as the secret hash of a client with a key set; it must verify no secret.
    static let keySetOnlyHash = "private_key_jwt"

    @Test("An edge refuses to start with a private key, without forward_to, or with its own server; decrypt and all need keys_dir")
    func edgeRefusals() async throws {
        let keys = try await TestKeys()
        let client = (id: "edge", secret: "edge-secret")
        var config = try configureEdge(
            inside: "http://127.0.0.1:9", certificate: keys.certificate, client: client, serve: ["keys_dir": "keys"])
        try FileManager.default.createDirectory(atPath: work.file("keys"), withIntermediateDirectories: true)
        _ = try work.write("antispam.txt", "\(antispam)\n")
        var result = try await dqCommand(["serve"], config: config)
        #expect(result.status != 0 && result.stderr.contains("holds no private key"), "\(result.stderr)")
        config = try configureEdge(
            inside: "http://127.0.0.1:9", certificate: keys.certificate, client: client, serve: ["forward_to": "ftp://x"])
        result = try await dqCommand(["serve"], config: config)
        #expect(result.status != 0 && result.stderr.contains("\"serve.forward_to\" must be an http(s) URL"), "\(result.stderr)")
        config = try configureEdge(inside: "http://127.0.0.1:9", certificate: keys.certificate, client: client, serve: ["role": "nothing"])
        result = try await dqCommand(["serve"], config: config)
        #expect(result.status != 0 && result.stderr.contains("\"serve.role\" must be"), "\(result.stderr)")
        // The flag overrides the file: the edge's file run as the decrypting receiver lacks keys_dir.
        config = try configureEdge(inside: "http://127.0.0.1:9", certificate: keys.certificate, client: client)
        result = try await dqCommand(["serve", "--role", "decrypt"], config: config)
        #expect(result.status != 0 && result.stderr.contains("\"serve.keys_dir\" is required"), "\(result.stderr)")
        let inside = try await configure(server: "http://127.0.0.1:9/fhir", name: "inside.json")
        result = try await dqCommand(["serve", "--role", "edge"], config: inside)
        #expect(result.status != 0 && result.stderr.contains("holds no private key"), "\(result.stderr)")
    }
}
