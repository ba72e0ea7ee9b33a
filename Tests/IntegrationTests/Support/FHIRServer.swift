import AsyncHTTPClient
import Foundation
import NIOCore
import NIOFoundationCompat
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// A real sekmet-fhir server on a free loopback port, with its data in a temporary directory.
///
/// It can be killed (SIGKILL) and started again on the same port with the same data, to simulate an outage.
final class FHIRServer: @unchecked Sendable {
    let directory: TemporaryDirectory
    let port: Int
    var base: String { "http://127.0.0.1:\(port)/fhir" }
    private var child: ChildProcess?
    /// A static token the tests read with when the server requires auth.
    let readerToken: String?

    /// - Parameter tokens: static bearer tokens the server requires; nil for an open server.
    init(tokens: [String]? = nil, auth: String? = nil, readerToken: String? = nil) throws {
        self.readerToken = readerToken
        try #require(Peers.installed, "the FHIR server peer is not installed: run scripts/peers.sh install")
        directory = try TemporaryDirectory()
        port = Peers.freePort()
        let auth =
            auth ?? tokens.map { "  types: [bearer]\n  tokens: [\($0.joined(separator: ", "))]\n  token_lifetime: 300" }
            ?? "  types: [none]"
        _ = try directory.write(
            "settings.yaml",
            """
            host: 127.0.0.1
            port: \(port)
            base_url: http://127.0.0.1:\(port)/fhir
            data_dir: \(directory.path)/data
            log_inbound: false
            simulator: {enabled: false}
            server_auth:
            \(auth)

            """)
    }

    /// Starts a new server and waits until it answers.
    static func start(tokens: [String]? = nil, auth: String? = nil) async throws -> FHIRServer {
        let server = try FHIRServer(tokens: tokens, auth: auth)
        try await server.start()
        return server
    }

    func start() async throws {
        child = try ChildProcess(
            Peers.venv + "/bin/sekmet", ["serve", "-c", directory.file("settings.yaml")], directory: directory.path)
        let ready = try await eventually(timeout: .seconds(60)) {
            (try? await HTTP.get(base + "/metadata"))?.0 != nil
        }
        if !ready {
            let result = await child?.stop()
            throw TestFailure("sekmet-fhir did not start: \(result?.stderr.suffix(2000) ?? "")")
        }
    }

    /// Kills the server at once (SIGKILL), as a crash or a pulled cable would.
    func kill() async {
        guard let child else { return }
        child.kill(SIGKILL)
        _ = await child.wait()
        self.child = nil
    }

    deinit {
        child?.killInBackground()
    }

    /// Resources of `type` the server holds whose first identifier has `system`, oldest first,
    /// as (identifier value, resource).
    func resources(_ type: String, system: String) async throws -> [(String, [String: Any])] {
        var all: [(String, [String: Any])] = []
        var offset = 0
        while true {
            let page = try await HTTP.json("\(base)/\(type)/_history?_count=500&_offset=\(offset)", token: readerToken)
            let entries = page["entry"] as? [[String: Any]] ?? []
            if entries.isEmpty { break }
            for entry in entries {
                guard let resource = entry["resource"] as? [String: Any],
                    let identifiers = resource["identifier"] as? [[String: Any]],
                    let match = identifiers.first(where: { $0["system"] as? String == system }),
                    let value = match["value"] as? String
                else { continue }
                all.append((value, resource))
            }
            offset += entries.count
        }
        return all.reversed()
    }

    /// Identifier values of the resources of `type` with `system`, oldest first.
    func values(_ type: String, system: String) async throws -> [String] {
        try await resources(type, system: system).map(\.0)
    }
}

/// scripts/faultproxy.py between dq and a server.
final class FaultProxy: @unchecked Sendable {
    let port: Int
    var base: String { "http://127.0.0.1:\(port)/fhir" }
    private let child: ChildProcess

    convenience init(upstream: FHIRServer, random: Double = 0, seed: Int = 0, stall: Double = 3) async throws {
        try await self.init(upstreamPort: upstream.port, random: random, seed: seed, stall: stall)
    }

    /// `tls` serves HTTPS with the given certificate and key (PEM files) instead of plain HTTP.
    convenience init(upstream: FHIRServer, options: [String]) async throws {
        try await self.init(upstreamPort: upstream.port, options: options)
    }

    /// `options`: more faultproxy.py flags (`--max-entries N`, `--no-transactions`, `--latency MS`).
    init(
        upstreamPort: Int, random: Double = 0, seed: Int = 0, stall: Double = 3, tls: (cert: String, key: String)? = nil,
        options: [String] = []
    ) async throws {
        port = Peers.freePort()
        let script = Peers.packageRoot.appendingPathComponent("scripts/faultproxy.py").path
        var arguments = [
            "python3", script, "--listen", String(port), "--upstream", "http://127.0.0.1:\(upstreamPort)",
            "--random", String(random), "--seed", String(seed), "--stall", String(stall),
        ]
        if let tls { arguments += ["--tls-cert", tls.cert, "--tls-key", tls.key] }
        arguments += options
        child = try ChildProcess("/usr/bin/env", arguments)
        let ready: Bool
        if tls != nil {
            // An HTTPS proxy with a certificate the test client does not trust: wait for its port to accept.
            let listening = port
            ready = try await eventually(timeout: .seconds(20)) { Peers.isListening(port: listening) }
        } else {
            let url = "http://127.0.0.1:\(port)/__proxy/stats"
            ready = try await eventually(timeout: .seconds(20)) { (try? await HTTP.get(url))?.0 == 200 }
        }
        if !ready { throw TestFailure("faultproxy did not start") }
    }

    /// Appends faults to the script (see scripts/faultproxy.py).
    func inject(_ faults: [String]) async throws {
        _ = try await HTTP.post(
            "http://127.0.0.1:\(port)/__proxy/faults", json: try JSONSerialization.data(withJSONObject: faults))
    }

    /// Sends the answers a `hold` fault keeps, and lets every later one through at once.
    func release() async throws {
        _ = try await HTTP.post("http://127.0.0.1:\(port)/__proxy/release", json: Data("{}".utf8))
    }

    /// The proxy's counters.
    func stats() async throws -> [String: Any] {
        try await HTTP.json("http://127.0.0.1:\(port)/__proxy/stats")
    }

    deinit {
        child.killInBackground()
    }
}

/// Synthetic test resources with a per-test identifier system, so a test can find exactly its own.
struct Resources {
    let system = "urn:dq-test:\(UUID().uuidString.lowercased())"

    func observation(_ index: Int, extra: String = "") -> String {
        #"{"resourceType":"Observation","status":"final","identifier":[{"system":"\#(system)","value":"\#(index)"}],"code":{"text":"test \#(index)\#(extra)"}}"#
    }

    /// An Observation the server rejects (an element FHIR does not define).
    func invalid(_ index: Int) -> String {
        #"{"resourceType":"Observation","status":"final","identifier":[{"system":"\#(system)","value":"\#(index)"}],"code":{"text":"bad"},"notAnElement":true}"#
    }

    func ndjson(_ range: Range<Int>) -> String {
        range.map { observation($0) }.joined(separator: "\n") + "\n"
    }
}

/// Canaille, a real OAuth2 server with RFC 7591 registration (scripts/canaille_server.py).
final class CanailleServer: @unchecked Sendable {
    let port: Int
    var base: String { "http://127.0.0.1:\(port)" }
    private let child: ChildProcess

    /// - Parameters:
    ///   - users: `name:password` of people who can sign in.
    ///   - clients: `id` (public), `id:secret` (client_secret_basic) or `id:secret:client_secret_post`
    ///     clients of the authorization code flow.
    ///   - keyClients: private_key_jwt clients of the code flow: their id and public JWKS.
    ///   - tokenLifetime: seconds an access token of the code flow lives.
    ///   - refreshLifetime: seconds a refresh token lives (nil: until revoked).
    init(
        users: [String] = [], clients: [String] = [], keyClients: [String: String] = [:], tokenLifetime: Int? = nil,
        refreshLifetime: Int? = nil
    ) async throws {
        port = Peers.freePort()
        let python = Peers.packageRoot.appendingPathComponent(".peers/canaille/bin/python").path
        try #require(FileManager.default.isExecutableFile(atPath: python), "Canaille is not installed: run scripts/peers.sh install")
        let script = Peers.packageRoot.appendingPathComponent("scripts/canaille_server.py").path
        var arguments = [script, "--port", String(port)]
        for user in users { arguments += ["--user", user] }
        for client in clients { arguments += ["--client", client] }
        for (client, jwks) in keyClients { arguments += ["--key-client", client + "=" + jwks] }
        if let tokenLifetime { arguments += ["--token-lifetime", String(tokenLifetime)] }
        if let refreshLifetime { arguments += ["--refresh-lifetime", String(refreshLifetime)] }
        child = try ChildProcess(python, arguments)
        let url = base + "/.well-known/oauth-authorization-server"
        let ready = try await eventually(timeout: .seconds(60)) { (try? await HTTP.get(url))?.0 == 200 }
        if !ready {
            let result = await child.stop()
            throw TestFailure("Canaille did not start: \(result.stderr.suffix(2000))")
        }
    }

    /// RFC 7662 introspection of `token`, authenticated as the client.
    func introspect(_ token: String, clientID: String, secret: String) async throws -> [String: Any] {
        var request = HTTPClientRequest(url: base + "/oauth/introspect")
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/x-www-form-urlencoded")
        request.headers.add(name: "Authorization", value: "Basic " + Data("\(clientID):\(secret)".utf8).base64EncodedString())
        request.body = .bytes(ByteBuffer(string: "token=" + token))
        let response = try await HTTPClient.shared.execute(request, timeout: .seconds(30))
        let body = try await response.body.collect(upTo: 1 << 20)
        return try JSONSerialization.jsonObject(with: Data(buffer: body)) as? [String: Any] ?? [:]
    }

    /// Posts a form to one of Canaille's endpoints (e.g. `/oauth/token`) as a public client would.
    func postForm(_ path: String, _ form: [String: String]) async throws -> (Int, [String: Any]) {
        var request = HTTPClientRequest(url: base + path)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/x-www-form-urlencoded")
        var allowed = CharacterSet.alphanumerics
        allowed.insert(charactersIn: "-._~")
        let body = form.map { "\($0.key)=\($0.value.addingPercentEncoding(withAllowedCharacters: allowed)!)" }.joined(separator: "&")
        request.body = .bytes(ByteBuffer(string: body))
        let response = try await HTTPClient.shared.execute(request, timeout: .seconds(30))
        let data = try await response.body.collect(upTo: 1 << 20)
        return (Int(response.status.code), (try? JSONSerialization.jsonObject(with: Data(buffer: data))) as? [String: Any] ?? [:])
    }

    deinit {
        child.killInBackground()
    }
}

/// A SMART-on-FHIR front (scripts/smart_gate.py): the SMART configuration, a token endpoint that passes
/// to Canaille and adds the launch context (and can tamper with ID tokens), and a FHIR API that accepts only
/// Canaille's access tokens before forwarding to sekmet-fhir.
final class SMARTGate: @unchecked Sendable {
    let port: Int
    /// The host name the gate's smart-configuration gives its own endpoints (token, JWKS).
    let publicHost: String
    var fhirBase: String { "http://127.0.0.1:\(port)/fhir" }
    /// The FHIR base by `publicHost`, as a client configured with that name reaches it.
    var publicFHIRBase: String { "http://\(publicHost):\(port)/fhir" }
    private let child: ChildProcess

    init(fhir: FHIRServer, canaille: CanailleServer, patient: String, publicHost: String = "127.0.0.1") async throws {
        port = Peers.freePort()
        self.publicHost = publicHost
        let script = Peers.packageRoot.appendingPathComponent("scripts/smart_gate.py").path
        child = try ChildProcess(
            Peers.venv + "/bin/python",
            [
                script, "--port", String(port), "--fhir", fhir.base, "--issuer", canaille.base, "--patient", patient, "--public-host",
                publicHost,
            ])
        let url = fhirBase + "/.well-known/smart-configuration"
        let ready = try await eventually(timeout: .seconds(60)) { (try? await HTTP.get(url))?.0 == 200 }
        if !ready {
            let result = await child.stop()
            throw TestFailure("the SMART gate did not start: \(result.stderr.suffix(2000))")
        }
    }

    /// `{"tamper": mode}`, `{"reject_issued_before_now": true}` or `{"jwks_down": true}`.
    func control(_ body: [String: Any]) async throws {
        let (status, _) = try await HTTP.post(
            "http://127.0.0.1:\(port)/_gate/control", json: try JSONSerialization.data(withJSONObject: body))
        try #require(status == 200)
    }

    /// Token requests by grant type, and FHIR requests accepted and refused.
    func stats() async throws -> (grants: [String: Int], accepted: Int, refused: Int) {
        let object = try await HTTP.json("http://127.0.0.1:\(port)/_gate/stats")
        return (
            object["grants"] as? [String: Int] ?? [:], object["fhir_accepted"] as? Int ?? -1, object["fhir_refused"] as? Int ?? -1
        )
    }

    /// How many times the gate served its JWKS.
    func jwksServed() async throws -> Int {
        try await HTTP.json("http://127.0.0.1:\(port)/_gate/stats")["jwks_served"] as? Int ?? -1
    }

    /// Every authorization code, PKCE verifier, client assertion and token that passed the token endpoint.
    func secrets() async throws -> [String] {
        try await HTTP.json("http://127.0.0.1:\(port)/_gate/stats")["secrets"] as? [String] ?? []
    }

    deinit {
        child.killInBackground()
    }
}
