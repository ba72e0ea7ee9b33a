import AsyncHTTPClient
import FHIRDataQueue
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// The networks hospitals have: a forward proxy (Debian's squid) that alone knows the FHIR server's name
/// (`fhir.invalid`, RFC 2606: it resolves nowhere else), with and without credentials; a TLS server (nginx, in
/// front of sekmet-fhir) that requires a client certificate; HTTP/2 by ALPN. Certificates are made by the
/// openssl CLI in the test folder.
@Suite("Proxies, client certificates and HTTP/2", .serialized, .enabled(if: Peers.enabled))
struct NetworkTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws {
        work = try TemporaryDirectory()
        // squid's workers run as its own user: they write their logs here.
        chmod(work.path, 0o777)
    }

    /// Runs a tool of the system, which must succeed.
    func run(_ tool: String, _ arguments: [String]) async throws -> String {
        let result = try await ChildProcess(tool, arguments).wait()
        try #require(result.status == 0, "\(tool) \(arguments.first ?? ""): \(result.stderr.suffix(500))")
        return result.stdout
    }

    /// A test CA, and a certificate it signed for `name` (a server's DNS name, or a client's CN) with its key.
    func certificates() async throws -> (ca: String, server: (cert: String, key: String), client: (cert: String, key: String)) {
        let ca = (cert: work.file("ca.pem"), key: work.file("ca.key"))
        _ = try await run(
            "/usr/bin/openssl",
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca.key, "-out", ca.cert, "-days", "2", "-subj", "/CN=dq test CA"])
        func signed(_ name: String, _ extensions: String) async throws -> (cert: String, key: String) {
            let (cert, key, request) = (work.file("\(name).pem"), work.file("\(name).key"), work.file("\(name).csr"))
            let ext = try work.write("\(name).ext", extensions)
            _ = try await run(
                "/usr/bin/openssl", ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", "/CN=\(name)"])
            _ = try await run(
                "/usr/bin/openssl",
                [
                    "x509", "-req", "-in", request, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial", "-out", cert, "-days", "2",
                    "-extfile", ext,
                ])
            chmod(key, 0o600)
            return (cert, key)
        }
        let server = try await signed("fhir.invalid", "subjectAltName=DNS:fhir.invalid,IP:127.0.0.1\n")
        let client = try await signed("dq-client", "extendedKeyUsage=clientAuth\n")
        return (ca.cert, server, client)
    }

    /// squid on a free port, resolving `fhir.invalid` (and `names`) to 127.0.0.1 from its own hosts file; with
    /// `credentials`, it asks for them (basic auth).
    final class Squid: @unchecked Sendable {
        let port = Peers.freePort()
        let log: String
        private var child: ChildProcess?

        init(in work: TemporaryDirectory, credentials: (user: String, password: String)? = nil, names: [String] = []) async throws {
            log = work.file("squid-access-\(port).log")
            let hosts = try work.write("squid-hosts-\(port)", "127.0.0.1 \((["fhir.invalid"] + names).joined(separator: " "))\n")
            var access = "http_access allow localnet\n"
            if let credentials {
                let hash = try await ChildProcess("/usr/bin/openssl", ["passwd", "-apr1", credentials.password]).wait().stdout
                let file = try work.write("squid-passwd", "\(credentials.user):\(hash.trimmingCharacters(in: .whitespacesAndNewlines))\n")
                chmod(file, 0o644)
                access = """
                    auth_param basic program /usr/lib/squid/basic_ncsa_auth \(file)
                    acl authenticated proxy_auth REQUIRED
                    http_access allow localnet authenticated

                    """
            }
            let config = try work.write(
                "squid-\(port).conf",
                """
                http_port 127.0.0.1:\(port)
                hosts_file \(hosts)
                dns_nameservers 127.0.0.1
                acl localnet src 127.0.0.0/8
                \(access)http_access deny all
                cache deny all
                pid_filename \(work.file("squid-\(port).pid"))
                access_log \(log)
                cache_log \(work.file("squid-cache-\(port).log"))
                coredump_dir \(work.path)
                shutdown_lifetime 0 seconds
                buffered_logs off

                """)
            child = try ChildProcess("/usr/sbin/squid", ["-N", "-f", config])
            let port = port
            let ready = try await eventually(timeout: .seconds(30)) { Peers.isListening(port: port) }
            let cacheLog = (try? String(contentsOfFile: work.file("squid-cache-\(port).log"), encoding: .utf8)) ?? ""
            try #require(ready, "squid did not start: \(cacheLog.suffix(800))")
        }

        var url: String { "http://127.0.0.1:\(port)" }

        /// The access log's lines (squid writes them as requests end).
        func accessLines() throws -> [String] {
            ((try? String(contentsOfFile: log, encoding: .utf8)) ?? "").split(separator: "\n").map(String.init)
        }

        deinit {
            child?.killInBackground()
        }
    }

    /// nginx in front of `upstream` with TLS on two ports: one requiring a client certificate of `ca`, one
    /// offering HTTP/2; the access log names each request's protocol.
    final class TLSFront: @unchecked Sendable {
        let mutualPort = Peers.freePort()
        let http2Port = Peers.freePort()
        let log: String
        private var child: ChildProcess?

        init(in work: TemporaryDirectory, upstream: Int, ca: String, server: (cert: String, key: String)) async throws {
            let dir = work.file("nginx-\(mutualPort)")
            try FileManager.default.createDirectory(atPath: dir, withIntermediateDirectories: true)
            log = dir + "/access.log"
            let config = try work.write(
                "nginx-\(mutualPort).conf",
                """
                daemon off;
                master_process off;
                worker_processes 1;
                pid \(dir)/nginx.pid;
                error_log \(dir)/error.log;
                events { worker_connections 64; }
                http {
                  client_body_temp_path \(dir)/body;
                  proxy_temp_path \(dir)/proxy;
                  fastcgi_temp_path \(dir)/fastcgi;
                  uwsgi_temp_path \(dir)/uwsgi;
                  scgi_temp_path \(dir)/scgi;
                  log_format protocols '$server_port $server_protocol $request_method $uri $status $ssl_client_verify';
                  access_log \(log) protocols;
                  client_max_body_size 64m;
                  ssl_certificate \(server.cert);
                  ssl_certificate_key \(server.key);
                  server {
                    listen 127.0.0.1:\(mutualPort) ssl;
                    ssl_client_certificate \(ca);
                    ssl_verify_client on;
                    location / { proxy_pass http://127.0.0.1:\(upstream); proxy_set_header Host 127.0.0.1:\(upstream); }
                  }
                  server {
                    listen 127.0.0.1:\(http2Port) ssl http2;
                    location / { proxy_pass http://127.0.0.1:\(upstream); proxy_set_header Host 127.0.0.1:\(upstream); }
                  }
                }

                """)
            child = try ChildProcess("/usr/sbin/nginx", ["-c", config, "-p", dir])
            let port = mutualPort
            let ready = try await eventually(timeout: .seconds(30)) { Peers.isListening(port: port) }
            try #require(ready, "nginx did not start: \((try? String(contentsOfFile: dir + "/error.log", encoding: .utf8)) ?? "")")
        }

        func accessLines() -> [String] {
            ((try? String(contentsOfFile: log, encoding: .utf8)) ?? "").split(separator: "\n").map(String.init)
        }

        deinit {
            child?.killInBackground()
        }
    }

    func environment(_ server: String, _ extra: [String: String] = [:]) -> [String: String] {
        ["DQ_SERVER": server, "DQ_DATABASE": work.file("q-\(UUID().uuidString.prefix(6)).sqlite"), "HOME": work.path]
            .merging(extra) { $1 }
    }

    /// sekmet-fhir started with SMART backend services: client `c1` with secret `s1` gets tokens at `/auth/token`.
    static func smartServer() async throws -> FHIRServer {
        let reader = "reader-\(UUID().uuidString)"
        let server = try FHIRServer(
            auth:
                "  types: [bearer, smart]\n  tokens: [\(reader)]\n  token_lifetime: 300\n  smart_clients:\n    - {client_id: c1, client_secret: s1, scopes: 'system/*.cruds'}",
            readerToken: reader)
        try await server.start()
        return server
    }

    @Test("A server only the proxy can resolve is reached through it (flush and token); NO_PROXY sends a host around it")
    func throughTheProxy() async throws {
        let server = try await Self.smartServer()
        let squid = try await Squid(in: work)
        let hidden = "http://fhir.invalid:\(server.port)/fhir"
        let config = try work.write(
            "dq-proxy.json",
            #"{"server": "\#(hidden)", "auth": {"client_id": "c1", "client_secret": "s1", "token_uri": "http://fhir.invalid:\#(server.port)/auth/token"}}"#
        )
        var env = environment(hidden, ["DQ_CONFIG": config])
        #expect(try await dq(["enqueue", try work.write("o.json", resources.observation(0))], env).status == 0)
        let direct = try await dq(["flush"], env)
        #expect(direct.status == 75, "\(direct.stderr)")
        env["HTTP_PROXY"] = squid.url
        let proxied = try await dq(["flush", "--now"], env)
        #expect(proxied.status == 0, "\(proxied.stdout) \(proxied.stderr)")
        // async-http-client tunnels every proxied request through CONNECT, http:// ones too. The token endpoint
        // and the server are both fhir.invalid, which only squid resolves: the delivery proves both went through.
        #expect(
            try await eventually(timeout: .seconds(10)) {
                try squid.accessLines().contains { $0.contains("CONNECT fhir.invalid:\(server.port)") }
            }, "\((try? squid.accessLines()) ?? [])")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])

        // NO_PROXY: a host on the list goes direct, the proxy sees nothing of it. Judged by the lines that name each
        // server, once the proxied send's line is in: squid writes a tunnel's line when it closes, so a line of the
        // send that should have gone around it would be in by then.
        let open = try await FHIRServer.start()
        let other = try await FHIRServer.start()
        func named(_ port: Int) throws -> Bool {
            try squid.accessLines().contains { $0.contains(" 127.0.0.1:\(port) ") || $0.contains("//127.0.0.1:\(port)/") }
        }
        let around = environment(open.base, ["HTTP_PROXY": squid.url, "NO_PROXY": "localhost, 127.0.0.1"])
        #expect(try await dq(["send", try work.write("o1.json", resources.observation(1))], around).status == 0)
        let through = environment(other.base, ["HTTP_PROXY": squid.url, "NO_PROXY": "example.org"])
        #expect(try await dq(["send", try work.write("o2.json", resources.observation(2))], through).status == 0)
        #expect(try await eventually(timeout: .seconds(10)) { try named(other.port) }, "\((try? squid.accessLines()) ?? [])")
        #expect(try !named(open.port), "\((try? squid.accessLines()) ?? [])")
        #expect(try await open.values("Observation", system: resources.system) == ["1"])
        #expect(try await other.values("Observation", system: resources.system) == ["2"])
    }

    /// An embedding service that hands dq its own `HTTPClient` (its proxy, its trust) gets every request made by
    /// it: the queue's network settings say nothing of a proxy here, so only the caller's client can reach
    /// `fhir.invalid`, for the token as for the flush.
    @Test("A caller's own HTTPClient makes the token request and the flush (its proxy alone reaches the server)")
    func callersClient() async throws {
        let server = try await Self.smartServer()
        let squid = try await Squid(in: work)
        let client = HTTPClient(
            eventLoopGroupProvider: .singleton,
            configuration: HTTPClient.Configuration(proxy: .server(host: "127.0.0.1", port: squid.port)))
        let hidden = try #require(URL(string: "http://fhir.invalid:\(server.port)/fhir"))
        var oauth = OAuth2Configuration(fhirBaseURL: hidden)
        oauth.clientID = "c1"
        oauth.clientSecret = "s1"
        oauth.tokenURL = URL(string: "http://fhir.invalid:\(server.port)/auth/token")
        let tokens = try OAuth2ClientCredentials(configuration: oauth, httpClient: client)
        var configuration = DataQueue.Configuration(databasePath: work.file("caller.sqlite"))
        configuration.requestTimeout = 30
        let queue = try await DataQueue(baseURL: hidden, configuration: configuration, authorization: tokens, httpClient: client)
        let outcome = try await queue.create(try FHIRResource(json: Data(resources.observation(7).utf8)))
        guard case .delivered = outcome else {
            Issue.record("expected delivered, got \(outcome)")
            try await queue.shutdown()
            try await client.shutdown()
            return
        }
        #expect(await tokens.tokenRequests == 1)
        #expect(try await server.values("Observation", system: resources.system) == ["7"])
        try await queue.shutdown()
        try await tokens.shutdown()
        try await client.shutdown()
        // Without the caller's client, the token request has no way to the server.
        let alone = try OAuth2ClientCredentials(configuration: oauth)
        await #expect(throws: DataQueueError.self) { _ = try await alone.accessToken() }
        try await alone.shutdown()
    }

    @Test("A proxy with credentials: they come from the proxy URL and are never printed; without them, 407 leaves the item queued")
    func proxyCredentials() async throws {
        let server = try await FHIRServer.start()
        let password = "pw-\(UUID().uuidString.prefix(8))"
        let squid = try await Squid(in: work, credentials: ("dq", password))
        let hidden = "http://fhir.invalid:\(server.port)/fhir"
        let refused = environment(hidden, ["DQ_PROXY": squid.url])
        #expect(try await dq(["enqueue", try work.write("o.json", resources.observation(0))], refused).status == 0)
        let noCredentials = try await dq(["flush", "-v"], refused)
        #expect(noCredentials.status == 75, "\(noCredentials.stderr)")
        #expect(
            noCredentials.stderr.contains("the proxy http://127.0.0.1:\(squid.port) wants credentials (407"), "\(noCredentials.stderr)")
        #expect(try await dq(["status"], refused).stdout.contains("pending:    1"))

        let allowed = refused.merging(["DQ_PROXY": "http://dq:\(password)@127.0.0.1:\(squid.port)"]) { $1 }
        let flushed = try await dq(["flush", "--now", "-v"], allowed)
        #expect(flushed.status == 0, "\(flushed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])
        // A bad password: still 407, and no password in any output.
        let wrong = refused.merging(["DQ_PROXY": "http://dq:not-\(password)@127.0.0.1:\(squid.port)"]) { $1 }
        #expect(try await dq(["enqueue", try work.write("o1.json", resources.observation(1))], wrong).status == 0)
        let denied = try await dq(["flush", "--now", "-v"], wrong)
        #expect(denied.status == 75)
        for output in [noCredentials, flushed, denied] {
            #expect(!(output.stdout + output.stderr).contains(password), "the proxy password was printed")
        }
    }

    @Test(
        "https through the proxy's CONNECT, with the test CA added to the system's; a client certificate where one is required; HTTP/2 where offered"
    )
    func tlsDeployments() async throws {
        let server = try await FHIRServer.start()
        let (ca, serverCertificate, client) = try await certificates()
        let front = try await TLSFront(in: work, upstream: server.port, ca: ca, server: serverCertificate)
        let squid = try await Squid(in: work)

        // A server that requires a client certificate, without one: named as such, the item stays.
        let mutual = "https://fhir.invalid:\(front.mutualPort)/fhir"
        var env = environment(mutual, ["DQ_CA_BUNDLE": ca, "HTTPS_PROXY": squid.url])
        #expect(try await dq(["enqueue", try work.write("o.json", resources.observation(0))], env).status == 0)
        let without = try await dq(["flush"], env)
        #expect(without.status == 75, "\(without.stderr)")
        #expect(without.stderr.contains("wants a client certificate"), "\(without.stderr)")
        // With it (through the proxy's CONNECT: only squid knows fhir.invalid).
        env["DQ_CLIENT_CERTIFICATE"] = client.cert
        env["DQ_CLIENT_KEY"] = client.key
        let with = try await dq(["flush", "--now"], env)
        #expect(with.status == 0, "\(with.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])
        #expect(
            try await eventually(timeout: .seconds(10)) {
                try squid.accessLines().contains { $0.contains("CONNECT fhir.invalid:\(front.mutualPort)") }
            })
        // nginx writes an access line after it has passed the answer on, which dq may have read and exited on.
        #expect(
            try await eventually(timeout: .seconds(10)) {
                front.accessLines().contains { $0.hasPrefix("\(front.mutualPort) ") && $0.contains("POST") && $0.hasSuffix("SUCCESS") }
            }, "\(front.accessLines())")

        // HTTP/2 where the server offers it, and the CA bundle adds to the system's trust.
        let http2 = environment("https://127.0.0.1:\(front.http2Port)/fhir", ["DQ_CA_BUNDLE": ca])
        let sent = try await dq(["send", try work.write("o1.json", resources.observation(1))], http2)
        #expect(sent.status == 0, "\(sent.stderr)")
        #expect(
            try await eventually(timeout: .seconds(10)) {
                front.accessLines().contains { $0.hasPrefix("\(front.http2Port) HTTP/2.0 POST /fhir/Observation 201") }
            }, "\(front.accessLines())")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "1"])
        // Without the CA the server is not trusted (the system's store does not know the test CA).
        let untrusted = try await dq(
            ["send", try work.write("o2.json", resources.observation(2))], environment("https://127.0.0.1:\(front.http2Port)/fhir"))
        #expect(untrusted.status == 75 && untrusted.stderr.contains("not from a trusted issuer"), "\(untrusted.stderr)")
    }

    /// A client certificate rotated where it lies (the new key and certificate renamed over the old paths, as a
    /// certificate manager does) takes effect on SIGHUP: dq run makes its queue again, and its HTTP clients read
    /// the files anew instead of keeping the TLS setup of the old ones.
    @Test("SIGHUP with a client certificate and key rotated at their paths: dq run delivers with the new ones, without a restart")
    func rotatedClientCertificateOnHangup() async throws {
        let server = try await FHIRServer.start()
        let (ca, serverCertificate, client) = try await certificates()
        let front = try await TLSFront(in: work, upstream: server.port, ca: ca, server: serverCertificate)
        // The certificate dq starts with is not from the CA nginx trusts (it expired there, say).
        let (certificate, key) = (work.file("current.pem"), work.file("current.key"))
        _ = try await run(
            "/usr/bin/openssl",
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", certificate, "-days", "2", "-subj", "/CN=stale"])
        chmod(key, 0o600)
        let env = environment(
            "https://127.0.0.1:\(front.mutualPort)/fhir",
            [
                "DQ_CA_BUNDLE": ca, "DQ_CLIENT_CERTIFICATE": certificate, "DQ_CLIENT_KEY": key, "DQ_LOG_LEVEL": "notice",
                "DQ_RETRY_INITIAL_SECONDS": "0.1", "DQ_RETRY_MAXIMUM_SECONDS": "0.3",
            ])
        #expect(try await dq(["enqueue", try work.write("o.json", resources.observation(0))], env).status == 0)
        let run = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.1"], environment: env)
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        let port = front.mutualPort
        #expect(
            try await eventually { front.accessLines().contains { $0.hasPrefix("\(port) ") && $0.contains(" 400 FAILED") } },
            "nginx refused the stale certificate: \(front.accessLines()) \(log())")
        #expect(try await server.values("Observation", system: resources.system).isEmpty)

        for (from, to) in [(client.cert, certificate), (client.key, key)] {
            let staged = to + ".new"
            try FileManager.default.copyItem(atPath: from, toPath: staged)
            #expect(rename(staged, to) == 0)
        }
        chmod(key, 0o600)
        run.kill(SIGHUP)
        #expect(
            try await eventually { (try await server.values("Observation", system: resources.system)) == ["0"] },
            "delivered with the rotated certificate: \(front.accessLines()) \(log())")
        // nginx writes its access line once it has passed the answer on: after the server stored the resource.
        #expect(
            try await eventually {
                front.accessLines().contains { $0.hasPrefix("\(port) ") && $0.contains("POST") && $0.hasSuffix("SUCCESS") }
            }, "\(front.accessLines())")
        #expect(log().contains("configuration reloaded") && log().contains("tls files"), "\(log())")
        #expect(run.isRunning, "no restart")
        run.kill(SIGTERM)
        let result = await run.wait(timeout: .seconds(30))
        #expect(result.status == 0, "\(result.stderr)")
    }
}
