import Foundation
import Testing

/// `/metrics`, `/healthz` and `/readyz` as HTTP/1.1 clients meet them: keep-alive, HEAD, unknown paths and
/// methods, and a body too large, against `dq run --metrics-address`.
@Suite("The operations endpoints over HTTP/1.1", .serialized, .enabled(if: Peers.enabled))
struct OperationsEndpointTests {
    let work: TemporaryDirectory

    init() throws { work = try TemporaryDirectory() }

    @Test("keep-alive, HEAD, 404, 405 with Allow, and a 1 MB body refused with 413 while the endpoint goes on serving")
    func httpBehaviour() async throws {
        let port = Peers.freePort()
        // A server that does not answer: the endpoints do not depend on it.
        let run = try ChildProcess(
            Peers.dqBinary,
            [
                "run", "--server", "http://127.0.0.1:\(Peers.freePort())/fhir", "--database", work.file("queue.sqlite"),
                "--metrics-address", "127.0.0.1:\(port)",
            ],
            environment: ["HOME": work.path, "DQ_LOG_LEVEL": "notice"])
        let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { (try? await HTTP.get("http://127.0.0.1:\(port)/healthz"))?.0 == 200 }, "\(log())")

        // Python's http.client on one socket (auto_open off: it never reconnects on its own), then raw sockets for
        // the bodies too large, declared and chunked; each answer read to its Content-Length.
        let client = try ChildProcess(
            "/usr/bin/env",
            [
                "python3", "-c",
                """
                import http.client, socket
                c = http.client.HTTPConnection("127.0.0.1", \(port), timeout=30)
                c.connect(); c.auto_open = 0
                first = c.sock.getsockname()
                def ask(method, path, body=None):
                    c.request(method, path, body=body); r = c.getresponse(); b = r.read()
                    print(method, path, r.status, len(b), r.getheader("content-length"), r.getheader("allow"),
                          c.sock.getsockname() == first, flush=True)
                    return b
                metrics = ask("GET", "/metrics")
                print("metrics text", b"dq_build_info" in metrics, flush=True)
                ask("HEAD", "/metrics")
                ask("GET", "/readyz")
                ask("HEAD", "/healthz")
                ask("GET", "/nothing-here")
                ask("POST", "/metrics", b"x")
                ask("DELETE", "/readyz")
                ask("GET", "/healthz")
                def answer(request, chunks=0):
                    s = socket.create_connection(("127.0.0.1", \(port)), timeout=30)
                    s.sendall(request)
                    for _ in range(chunks):
                        s.sendall(b"10000\\r\\n" + b"a" * 65536 + b"\\r\\n")
                    data = b""
                    while b"\\r\\n\\r\\n" not in data:
                        data += s.recv(65536)
                    head, _, body = data.partition(b"\\r\\n\\r\\n")
                    length = int([l.split(b":")[1] for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length")][0])
                    while len(body) < length:
                        body += s.recv(65536)
                    return head.split(b"\\r\\n")[0].decode()
                print("declared", answer(b"POST /healthz HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 1048576\\r\\n\\r\\n"), flush=True)
                print("chunked", answer(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n", 16), flush=True)
                ask("GET", "/healthz")
                """,
            ])
        let answers = await client.wait(timeout: .seconds(60))
        #expect(answers.status == 0, "\(answers.stderr)")
        let lines = answers.stdout.split(separator: "\n").map(String.init)
        #expect(lines.count == 12, "\(answers.stdout)")
        // Every answer on the one socket the client opened first.
        let onFirstSocket = lines.filter {
            $0.hasPrefix("GET ") || $0.hasPrefix("HEAD ") || $0.hasPrefix("POST ") || $0.hasPrefix("DELETE ")
        }
        #expect(onFirstSocket.count == 9 && onFirstSocket.allSatisfy { $0.hasSuffix(" True") }, "\(answers.stdout)")
        #expect(lines.contains("metrics text True"), "\(answers.stdout)")
        // HEAD: the status and the length a GET would have, and no body.
        let head = try #require(lines.first { $0.hasPrefix("HEAD /metrics ") })
        let headFields = head.split(separator: " ")
        #expect(headFields[2] == "200" && headFields[3] == "0" && Int(headFields[4]) ?? 0 > 0, "\(head)")
        #expect(lines.contains { $0.hasPrefix("HEAD /healthz 200 0 3 ") }, "\(answers.stdout)")
        #expect(lines.contains { $0.hasPrefix("GET /readyz 200 ") }, "\(answers.stdout)")
        #expect(lines.contains { $0.hasPrefix("GET /nothing-here 404 ") }, "\(answers.stdout)")
        #expect(lines.contains { $0.hasPrefix("POST /metrics 405 ") && $0.contains(" GET, HEAD ") }, "\(answers.stdout)")
        #expect(lines.contains { $0.hasPrefix("DELETE /readyz 405 ") && $0.contains(" GET, HEAD ") }, "\(answers.stdout)")
        #expect(lines.contains("declared HTTP/1.1 413 Payload Too Large"), "\(answers.stdout)")
        #expect(lines.contains("chunked HTTP/1.1 413 Payload Too Large"), "\(answers.stdout)")
        #expect(lines.last?.hasPrefix("GET /healthz 200 3 3 ") == true, "still serving: \(answers.stdout)")

        run.kill(SIGTERM)
        #expect(await run.wait(timeout: .seconds(30)).status == 0, "\(log())")
    }
}
