import DQTestSupport
import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import NIOPosix
import NIOSSL
import Testing

@testable import FHIRDataQueue

#if canImport(Glibc)
    import Glibc
#endif

/// The flush's requests through async-http-client (``FHIRTransport``), against real HTTP servers on loopback that
/// record what arrived, or write answers byte for byte: what was sent, and whether a request that got no
/// answer may have reached the server.
@Suite("The transport at the wire")
struct TransportTests {
    let logger = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })

    func request(_ url: String, body: String = #"{"resourceType":"Observation"}"#) -> OutgoingRequest {
        OutgoingRequest(method: .post, url: url, contentType: "application/fhir+json", ifNoneExist: "identifier=a|b", body: Data(body.utf8))
    }

    @Test("Sequential sends share one kept-alive connection; the server gets each request as it was sent")
    func keepAlive() async throws {
        let server = try await ScriptedServer { request in .respond(.created(location: "Observation/\(request.bodyText.count)")) }
        // Generous limits: on a loaded two-core machine a stall of several seconds (the server answers from a
        // task of the shared pool) is not what this test is about; a lost answer still fails it.
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, idleLimit: .seconds(60))
        for index in 0..<5 {
            let body = #"{"resourceType":"Observation","id":"\#(index)"}"#
            let response = try await transport.send(
                request(server.baseURL + "/fhir/Observation?_format=json", body: body), authorization: "Bearer t", logger: logger)
            #expect(response.status == 201 && response.location == "Observation/\(body.utf8.count)")
        }
        let requests = server.requests
        #expect(requests.count == 5)
        #expect(requests.map(\.bodyText) == (0..<5).map { #"{"resourceType":"Observation","id":"\#($0)"}"# })
        for received in requests {
            #expect(received.method == "POST" && received.uri == "/fhir/Observation?_format=json")
            #expect(received.header("Host") == "127.0.0.1:\(server.port)")
            #expect(received.header("Content-Length") == String(received.body.count))
            #expect(received.header("Content-Type") == "application/fhir+json")
            #expect(received.header("Authorization") == "Bearer t" && received.header("If-None-Exist") == "identifier=a|b")
            #expect(received.header("Transfer-Encoding") == nil)
        }
        #expect(server.connectionsOpened == 1)
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("An answer with Connection: close is read whole and the next send opens a new connection")
    func connectionClose() async throws {
        let server = try await ScriptedServer { _ in
            .respond(.init(status: 200, headers: [("Connection", "close")], body: #"{"resourceType":"OperationOutcome"}"#))
        }
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, idleLimit: .seconds(60))
        for _ in 0..<3 {
            let response = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
            #expect(response.status == 200)
            #expect(String(decoding: response.body, as: UTF8.self) == #"{"resourceType":"OperationOutcome"}"#)
        }
        #expect(server.requests.count == 3 && server.connectionsOpened == 3)
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("A connection closed without an answer, and one that times out, may have delivered; the next send gets through")
    func noAnswer() async throws {
        let script = ScriptLine()
        // The stall by path, not by turn: a stalled send that never reached the server must not pass its stall on.
        let server = try await ScriptedServer { request in request.uri.hasPrefix("/fhir/Stalled") ? .stall : script.next() }
        // The close and the answer must come before a timeout, however long a loaded machine starves this process:
        // their transport waits a minute. The stall must end in a timeout: its transport waits one second.
        let transport = try FHIRTransport(timeout: 60, connectTimeout: 60)
        let impatient = try FHIRTransport(timeout: 1, connectTimeout: 60)
        script.set([.close, .respond(.created(location: "Observation/1"))])
        let closed = await #expect(throws: TransportFailure.self) {
            try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
        }
        #expect(
            closed?.mayHaveArrived == true && closed?.message.contains("connection closed by the server") == true,
            "\(closed?.message ?? "")")
        // A timeout after the request left may have delivered. One second is also the whole deadline of the send: a
        // machine loaded enough (a sanitizer's build) may not write the request within it, and that timeout rightly
        // says the request never left; then the stall is asked again, until one timeout comes after the request left.
        var stalled: TransportFailure?
        for _ in 0..<30 where stalled == nil {
            let failure = await #expect(throws: TransportFailure.self) {
                try await impatient.send(request(server.baseURL + "/fhir/Stalled"), authorization: nil, logger: logger)
            }
            #expect(failure?.message.contains("timed out") == true, "\(failure?.message ?? "")")
            if failure?.mayHaveArrived == true { stalled = failure }
        }
        #expect(stalled != nil, "a timeout after the request left may have delivered")
        let response = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
        #expect(response.status == 201)
        let requests = server.requests
        #expect(requests.filter { $0.uri.hasPrefix("/fhir/Observation") }.count == 2)
        #expect(requests.contains { $0.uri.hasPrefix("/fhir/Stalled") })
        #expect(server.connectionsOpened >= 3, "the closed and the stalled connections are not used again")
        try await transport.shutdown()
        try await impatient.shutdown()
        try await server.shutdown()
    }

    @Test("A refused connection is a failure that never left; an answer longer than the limit is cut at the limit")
    func refusedAndLong() async throws {
        // A port bound and never listened on: connects to it are refused, and no other test's server can take it
        // meanwhile (a port closed after binding was taken by one, which answered 201).
        let reserved = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        #expect(reserved >= 0)
        defer { close(reserved) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                bind(reserved, $0, length) == 0 && getsockname(reserved, $0, &length) == 0
            }
        }
        #expect(bound)
        let port = Int(UInt16(bigEndian: address.sin_port))
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, idleLimit: .seconds(60))
        let refused = await #expect(throws: TransportFailure.self) {
            try await transport.send(request("http://127.0.0.1:\(port)/fhir/Observation"), authorization: nil, logger: logger)
        }
        #expect(refused?.mayHaveArrived == false)

        let long = Data(repeating: UInt8(ascii: "x"), count: transport.maximumResponseBytes + 12345)
        let server = try await ScriptedServer { _ in .respond(.init(status: 422, data: long)) }
        for _ in 0..<2 {
            let response = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
            #expect(response.status == 422 && response.body == long.prefix(transport.maximumResponseBytes))
        }
        #expect(server.connectionsOpened == 1, "the rest of a long answer is read, so the connection is kept")
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("A connection idle past the idle limit is replaced before the next request")
    func idleLimit() async throws {
        let server = try await ScriptedServer { _ in .respond(.created(location: "Observation/1")) }
        func send(_ transport: FHIRTransport) async throws -> Int {
            try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger).status
        }
        // Within the limit (one no stall of a loaded machine reaches): the connection is kept. The connect and request
        // timeouts are not what is tested: a minute each (a loopback connect took over 5 s under ThreadSanitizer with
        // the unit tests running at once, and failed the test on a timeout it is not about).
        let keeping = try FHIRTransport(timeout: 60, connectTimeout: 60, idleLimit: .seconds(60))
        #expect(try await send(keeping) == 201)
        #expect(try await send(keeping) == 201)
        #expect(server.connectionsOpened == 1)
        // Past the limit (the wait is at least the sleep, however loaded the machine): a new connection.
        let replacing = try FHIRTransport(timeout: 60, connectTimeout: 60, idleLimit: .seconds(1))
        #expect(try await send(replacing) == 201)
        #expect(server.connectionsOpened == 2)
        try await Task.sleep(for: .milliseconds(1500))
        #expect(try await send(replacing) == 201)
        #expect(server.connectionsOpened == 3)
        try await server.shutdown()
    }

    @Test("An unasked 100 Continue before the answer is skipped, and the next request on the connection gets its own answer")
    func informationalAnswer() async throws {
        // Answers are numbered across connections: the client may open a new one (async-http-client does
        // when a loaded machine lets the answer end before it saw its own request's end), and an answer
        // taken for the wrong request must still show.
        let answered = NIOLockedValueBox(0)
        let server = try await RawServer { _, _ in
            let number = answered.withLockedValue { count in
                defer { count += 1 }
                return count
            }
            let body = #"{"n":\#(number)}"#
            return (
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nLocation: Observation/\(number)\r\n"
                    + "Content-Length: \(body.utf8.count)\r\n\r\n\(body)", false
            )
        }
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, idleLimit: .seconds(60))
        for index in 0..<3 {
            let response = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
            #expect(response.status == 201 && response.location == "Observation/\(index)")
            #expect(String(decoding: response.body, as: UTF8.self) == #"{"n":\#(index)}"#)
        }
        #expect(server.requestsReceived == 3)
        // One connection on an idle machine (the second and third requests follow a skipped 100 on it).
        #expect((1...3).contains(server.connectionsOpened))
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("An HTTP/1.0 answer without a length is read until the server closes, and its connection is not reused")
    func answerUntilClose() async throws {
        let server = try await RawServer { _, connection in
            ("HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"connection\":\(connection)}", true)
        }
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, idleLimit: .seconds(60))
        for index in 0..<2 {
            let response = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
            #expect(response.status == 200)
            #expect(String(decoding: response.body, as: UTF8.self) == #"{"connection":\#(index)}"#)
        }
        #expect(server.connectionsOpened == 2)
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("A 204 without a body ends the exchange and keeps the connection")
    func noContent() async throws {
        let server = try await RawServer { _, _ in ("HTTP/1.1 204 No Content\r\nLocation: Observation/x\r\n\r\n", false) }
        // An idle limit no stall of a loaded machine reaches: reuse is what is checked (``idleLimit()`` tests the limit).
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, idleLimit: .seconds(60))
        for _ in 0..<3 {
            let response = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
            #expect(response.status == 204 && response.body.isEmpty && response.location == "Observation/x")
        }
        #expect(server.connectionsOpened == 1 && server.requestsReceived == 3)
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("An answer cut short after its status line still counts: the server decided (a 201 is not sent again)")
    func answerCutShort() async throws {
        let server = try await RawServer { request, _ in
            request == 0
                ? ("HTTP/1.1 201 Created\r\nLocation: Observation/9\r\nContent-Length: 100\r\n\r\n{\"partial", true)
                : ("HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n", false)
        }
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, idleLimit: .seconds(60))
        let cut = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
        #expect(cut.status == 201 && cut.location == "Observation/9")
        #expect(String(decoding: cut.body, as: UTF8.self) == #"{"partial"#)
        let next = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
        #expect(next.status == 201 && next.location == "Observation/9", "a new connection, whose first answer is cut too")
        #expect(server.connectionsOpened == 2, "the cut connection is not reused")
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("A server that answers before reading the whole body: the connection is not reused while the body is unsent")
    func answerBeforeBody() async throws {
        let server = try await RawServer(answerEarly: true) { _, _ in
            ("HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n", false)
        }
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60)
        // 32 MiB: more than the socket buffers take while the server reads nothing.
        let large = String(repeating: "a", count: 32 << 20)
        let first = try await transport.send(request(server.baseURL + "/fhir", body: large), authorization: nil, logger: logger)
        #expect(first.status == 401)
        let second = try await transport.send(request(server.baseURL + "/fhir/Observation"), authorization: nil, logger: logger)
        #expect(second.status == 401, "answered on a new connection, not queued behind the unsent body")
        #expect(server.connectionsOpened == 2)
        try await transport.shutdown()
        try await server.shutdown()
    }

    @Test("Stored request paths: a type, a type and an id, or empty for a Bundle; nothing else is sent")
    func storedPaths() {
        let valid: [(String, FHIRMethod, Bool)] = [
            ("Patient", .post, false), ("Patient", .post, true), ("Patient/p-1.2", .put, false), ("", .post, false),
        ]
        for (path, method, encrypted) in valid {
            #expect(DataQueue.isValidPath(path, method: method, encrypted: encrypted), "\(path) \(method)")
        }
        let invalid: [(String, FHIRMethod, Bool)] = [
            ("", .put, false), ("", .post, true), ("Patient", .put, false), ("Patient/p1", .post, false),
            ("Patient/p1", .put, true), ("Patient/p1/x", .put, false), ("Patient/", .put, false), ("/p1", .put, false),
            ("patient", .post, false), ("Patient/p 1", .put, false), ("Patient/../x", .put, false),
            ("Patient/" + String(repeating: "a", count: 65), .put, false), ("Patient?x=1", .post, false),
        ]
        for (path, method, encrypted) in invalid {
            #expect(!DataQueue.isValidPath(path, method: method, encrypted: encrypted), "\(path) \(method)")
        }
    }

    /// Until its TLS handshake completes, a connection holds the request back: an exchange that ends then sent
    /// nothing, and saying so lets the next flush go on at once instead of waiting for a request to settle.
    @Test("TLS that never completes sends nothing: a name mismatch, a stalled handshake, an unreadable CA bundle")
    func tlsNotSent() async throws {
        let scratch = try Scratch("dq-tls")
        defer { withExtendedLifetime(scratch) {} }  // the folder stays until the test ends
        let work = scratch.url.path
        // Two self-signed certificates (openssl's): one naming another host, one naming 127.0.0.1. Each is the
        // CA bundle of its transport, so that only the name can be wrong.
        let elsewhere = try await makeCertificate(in: work, name: "elsewhere", subjectAltName: "DNS:elsewhere.example")
        let here = try await makeCertificate(in: work, name: "here", subjectAltName: "IP:127.0.0.1")
        // openssl's own TLS server; it never answers a request, so one sent after a good handshake times out.
        let (mismatchServer, mismatchPort) = try await startOpenSSLServer(elsewhere)
        defer { mismatchServer.terminate() }
        let (goodServer, goodPort) = try await startOpenSSLServer(here)
        defer { goodServer.terminate() }

        // The mismatch ends the handshake at once; the request's own timeout is long enough never to come first,
        // however slow the machine (the message must name the mismatch, not a timeout).
        let trusting = try FHIRTransport(timeout: 60, connectTimeout: 60, network: trust(elsewhere.cert))
        let mismatch = await #expect(throws: TransportFailure.self) {
            try await trusting.send(request("https://127.0.0.1:\(mismatchPort)/fhir/Observation"), authorization: nil, logger: logger)
        }
        #expect(
            mismatch?.mayHaveArrived == false && mismatch?.message.contains("does not name this host") == true,
            "\(mismatch?.message ?? "")")
        try await trusting.shutdown()

        // A TCP server that reads the ClientHello and never answers it. The timeout is what ends the exchange here;
        // it is long enough for the connection itself to be made on a loaded machine (a second was not, under
        // ThreadSanitizer: the deadline passed before the connect, and nothing reached the server).
        let silent = try await RawServer { _, _ in ("", false) }
        let waiting = try FHIRTransport(timeout: 10, connectTimeout: 10, network: trust(here.cert))
        let stalled = await #expect(throws: TransportFailure.self) {
            try await waiting.send(request("https://127.0.0.1:\(silent.port)/fhir/Observation"), authorization: nil, logger: logger)
        }
        #expect(stalled?.mayHaveArrived == false, "\(stalled?.message ?? "")")
        try await waiting.shutdown()

        // A CA bundle that cannot be read is a configuration error before anything connects.
        let noBundle = #expect(throws: DataQueueError.self) {
            try FHIRTransport(timeout: 2, connectTimeout: 5, network: trust(work + "/missing.pem"))
        }
        #expect(noBundle?.code == .invalidConfiguration && noBundle?.message.contains("CA bundle") == true)
        #expect(silent.connectionsOpened == 1)
        try await silent.shutdown()

        // The other side of the line: after a good handshake, a request without an answer may have arrived. The
        // server ends once it has printed the request it read (s_server writes what it receives to its standard
        // output), so the connection closes after the request and never by a timeout, however slow the machine.
        let good = try FHIRTransport(timeout: 60, connectTimeout: 60, network: trust(here.cert))
        let sending = Task {
            try await good.send(request("https://127.0.0.1:\(goodPort)/fhir/Observation"), authorization: nil, logger: logger)
        }
        let received = await goodServer.waitForOutput(containing: "POST /fhir/Observation")
        goodServer.terminate()
        let unanswered = await #expect(throws: TransportFailure.self) { try await sending.value }
        #expect(received, "s_server never printed the request")
        #expect(
            unanswered?.mayHaveArrived == true && unanswered?.message.contains("handshake") == false
                && unanswered?.message.contains("timed out") == false, "\(unanswered?.message ?? "")")
        try await good.shutdown()
    }

    /// A proxy that will not open the tunnel is the proxy's answer, not the server's: nothing was sent, and the
    /// words name the proxy the request went through (the http one for an http server).
    @Test("A proxy that refuses CONNECT (403, 502): never sent, and its refusal names that proxy", arguments: [403, 502])
    func proxyRefusesTunnel(status: Int) async throws {
        let refusing = try await RawServer { _, _ in ("HTTP/1.1 \(status) No\r\nContent-Length: 0\r\n\r\n", true) }
        let other = try await RawServer { _, _ in ("HTTP/1.1 500 Wrong proxy\r\nContent-Length: 0\r\n\r\n", true) }
        var network = NetworkConfiguration()
        network.httpProxy = refusing.baseURL
        network.httpsProxy = other.baseURL
        let transport = try FHIRTransport(timeout: 60, connectTimeout: 60, network: network)
        let failure = await #expect(throws: TransportFailure.self) {
            try await transport.send(request("http://fhir.invalid/fhir/Observation"), authorization: nil, logger: logger)
        }
        #expect(failure?.mayHaveArrived == false, "\(failure?.message ?? "")")
        #expect(
            failure?.message.contains("the proxy \(refusing.baseURL)") == true && failure?.message.contains("refused the tunnel") == true,
            "\(failure?.message ?? "")")
        #expect(refusing.requestsReceived == 1 && other.requestsReceived == 0)
        try await transport.shutdown()
        try await refusing.shutdown()
        try await other.shutdown()
    }

    @Test("A proxy that does not answer is named as the one that did not, without its credentials; a host in no_proxy is the server's")
    func deadProxyNamed() async throws {
        var ports: [Int] = []
        for _ in 0..<2 {
            let unused = try await ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton).bind(host: "127.0.0.1", port: 0).get()
            ports.append(try #require(unused.localAddress?.port))
            try await unused.close()
        }
        var network = NetworkConfiguration()
        network.httpProxy = "http://ops:pr0xy-s3cret@127.0.0.1:\(ports[0])"
        network.noProxy = "127.0.0.1"
        let transport = try FHIRTransport(timeout: 30, connectTimeout: 60, network: network)
        let proxied = await #expect(throws: TransportFailure.self) {
            try await transport.send(request("http://fhir.invalid/fhir/Observation/1"), authorization: nil, logger: logger)
        }
        #expect(
            proxied?.message == "no answer from the proxy http://127.0.0.1:\(ports[0]) (for http://fhir.invalid): connection refused",
            "\(proxied?.message ?? "")")
        #expect(proxied?.cause == .proxyConnection && proxied?.mayHaveArrived == false)
        #expect(proxied?.message.contains("s3cret") == false && proxied?.message.contains("ops") == false)
        let direct = await #expect(throws: TransportFailure.self) {
            try await transport.send(request("http://127.0.0.1:\(ports[1])/fhir/Observation"), authorization: nil, logger: logger)
        }
        #expect(direct?.message == "no answer from http://127.0.0.1:\(ports[1]): connection refused", "\(direct?.message ?? "")")
        #expect(direct?.cause == .connection)
        try await transport.shutdown()
    }

    /// dq asks for TLS 1.2 at least: a server that can speak TLS 1.1 only is refused before any request.
    @Test("A server that offers only TLS 1.1 is refused in the handshake; nothing is sent")
    func tls12AtLeast() async throws {
        let scratch = try Scratch("dq-tls11")
        defer { withExtendedLifetime(scratch) {} }  // the folder stays until the test ends
        let work = scratch.url.path
        let here = try await makeCertificate(in: work, name: "here", subjectAltName: "IP:127.0.0.1")
        let (server, port) = try await startOpenSSLServer(here, extra: ["-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0"])
        defer { server.terminate() }
        // The server does speak TLS 1.1 (a client that allows it completes the handshake), so a refusal is dq's.
        let old = try await runToExit(
            "/usr/bin/openssl",
            ["s_client", "-connect", "127.0.0.1:\(port)", "-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0", "-CAfile", here.cert],
            stderr: .null)
        #expect(old == 0, "openssl s_client could not reach the TLS 1.1 server")
        let transport = try FHIRTransport(timeout: 60, connectTimeout: 60, network: trust(here.cert))
        let refused = await #expect(throws: TransportFailure.self) {
            try await transport.send(request("https://127.0.0.1:\(port)/fhir/Observation"), authorization: nil, logger: logger)
        }
        #expect(refused?.mayHaveArrived == false, "\(refused?.message ?? "")")
        let printed = (try? String(contentsOfFile: server.output, encoding: .utf8)) ?? ""
        #expect(!printed.contains("POST"), "the TLS 1.1 server read a request")
        try await transport.shutdown()
    }

    /// Network settings that trust `bundle` only.
    func trust(_ bundle: String) -> NetworkConfiguration {
        var network = NetworkConfiguration()
        network.caBundlePath = bundle
        network.caBundleOnly = true
        return network
    }

    /// A self-signed certificate and its key, made by the openssl CLI in `directory`.
    func makeCertificate(in directory: String, name: String, subjectAltName: String) async throws -> (cert: String, key: String) {
        let (cert, key) = (directory + "/\(name).crt", directory + "/\(name).key")
        try await runOpenSSL([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj",
            "/CN=\(name)", "-addext", "subjectAltName=\(subjectAltName)",
        ])
        return (cert, key)
    }

    func runOpenSSL(_ arguments: [String]) async throws {
        try #require(try await runToExit("/usr/bin/openssl", arguments, stderr: .null) == 0, "openssl \(arguments[0]) failed")
    }

    /// `openssl s_server` on a free loopback port, once it accepts connections.
    func startOpenSSLServer(_ certificate: (cert: String, key: String), extra: [String] = []) async throws -> (OpenSSLServer, Int) {
        let probe = try await ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton).bind(host: "127.0.0.1", port: 0).get()
        let port = try #require(probe.localAddress?.port)
        try await probe.close()
        let server = try OpenSSLServer(
            ["s_server", "-accept", "127.0.0.1:\(port)", "-cert", certificate.cert, "-key", certificate.key, "-quiet"] + extra,
            output: FileManager.default.temporaryDirectory.appendingPathComponent("dq-s_server-\(UUID().uuidString)").path)
        for _ in 0..<100 {
            if (try? await ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton).connect(host: "127.0.0.1", port: port).get()
                .close()) != nil
            {
                return (server, port)
            }
            try await Task.sleep(for: .milliseconds(50))
        }
        server.terminate()
        throw TransportFailure(message: "openssl s_server did not start", mayHaveArrived: false)
    }
}

/// `openssl s_server` with its standard input a pipe kept open: the server waits on it and never answers. What
/// it receives from its client goes to the file `output`.
final class OpenSSLServer: Sendable {
    let process: BackgroundProcess
    let stdinWriter: Int32
    let output: String
    private let terminated = NIOLockedValueBox(false)

    init(_ arguments: [String], output: String) throws {
        self.output = output
        let outputFile = open(output, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
        guard outputFile >= 0 else { throw BackgroundProcess.StartError(executable: output, code: errno) }
        defer { close(outputFile) }
        let ends = try BackgroundProcess.pipe()
        defer { close(ends.read) }
        stdinWriter = ends.write
        do {
            process = try BackgroundProcess(
                "/usr/bin/openssl", arguments, stdin: .descriptor(ends.read), stdout: .descriptor(outputFile), stderr: .null)
        } catch {
            close(ends.write)
            unlink(output)
            throw error
        }
    }

    /// Waits until the server has written `text` (what a client sent) to its output; false if it ended first.
    func waitForOutput(containing text: String) async -> Bool {
        while !Task.isCancelled {
            if let written = FileManager.default.contents(atPath: output), String(decoding: written, as: UTF8.self).contains(text) {
                return true
            }
            if process.ending != nil { return false }
            try? await Task.sleep(for: .milliseconds(20))
        }
        return false
    }

    /// Ends the server (once); the connections it holds close.
    func terminate() {
        let first = terminated.withLockedValue { done in
            let first = !done
            done = true
            return first
        }
        guard first else { return }
        process.signal(SIGTERM)
        close(stdinWriter)
        unlink(output)
    }
}

/// The actions a scripted server takes, one per request, in order.
private final class ScriptLine: Sendable {
    private let actions = NIOLockedValueBox<[ScriptedServer.Action]>([])

    func set(_ actions: [ScriptedServer.Action]) { self.actions.withLockedValue { $0 = actions } }

    func next() -> ScriptedServer.Action {
        actions.withLockedValue { $0.isEmpty ? .respond(.init(status: 500)) : $0.removeFirst() }
    }
}
