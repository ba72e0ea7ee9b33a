import Foundation
import Testing

/// What a connection can hold of `dq serve`: before these, a request declaring 100 GiB got its 413 and was then read
/// for as long as the client trickled bytes; a client that sent `Connection: close` and a large body never read its
/// 413 (the receiver stopped reading, the client's send blocked); a keep-alive 413 left the socket open for the idle
/// timeout; one address could hold any number of connections.
extension ServeTests {
    /// Runs `script` (Python, independent of dq) with the receiver's port as `PORT`; its standard output.
    func python(_ script: String, port: Int) async throws -> String {
        let result = try await ChildProcess(
            "/usr/bin/env", ["python3", "-c", "PORT = \(port)\n" + script]
        ).wait(timeout: .seconds(120))
        #expect(result.status == 0, "\(result.stderr.suffix(2000))")
        return result.stdout
    }

    @Test(
        "A 413 or 408 closes its connection: a trickled 100 GiB declaration is read at most lingering_time_seconds, a Connection: close client with a large body (urllib) reads its 413, a keep-alive 413 ends at once"
    )
    func lingeringClose() async throws {
        let (_, keys, _, receiver, bearer) = try await startWithClient(serve: [
            "max_body_bytes": 1 << 20, "lingering_time_seconds": 3, "lingering_timeout_seconds": 2,
        ])
        let output = try await python(
            """
            import socket, time, urllib.request, urllib.error
            def trickle(path, token):
                s = socket.create_connection(("127.0.0.1", PORT), timeout=5)
                auth = b"Authorization: Bearer " + token.encode() + b"\\r\\n" if token else b""
                s.sendall(b"POST " + path.encode() + b" HTTP/1.1\\r\\nHost: x\\r\\n" + auth +
                          b"Content-Type: application/json\\r\\nContent-Length: 107374182400\\r\\n\\r\\n")
                status = s.recv(4096).split(b"\\r\\n")[0].decode()
                start = time.monotonic()
                s.setblocking(False)
                # The answer's end (the receiver's FIN) comes first; the connection is over when a send fails (the
                # receiver closed it and answers with a reset).
                while time.monotonic() - start < 60:
                    try:
                        s.send(b"x")
                    except BlockingIOError:
                        pass
                    except OSError:
                        break
                    time.sleep(0.5)
                else:
                    print("trickle", path, status, "still open after 60 s", flush=True)
                    return
                print("trickle", path, status, "closed after %.1f" % (time.monotonic() - start), flush=True)
            trickle("/c3pro/encfhir/Observation", "\(bearer)")
            trickle("/c3pro/encfhir/Observation", None)
            trickle("/c3pro/register", None)

            # urllib sends Connection: close, then the whole body, then reads the answer.
            request = urllib.request.Request("http://127.0.0.1:%d/c3pro/encfhir/Observation" % PORT, data=b"x" * (20 << 20),
                                             headers={"Authorization": "Bearer \(bearer)", "Content-Type": "application/json"})
            start = time.monotonic()
            try:
                urllib.request.urlopen(request, timeout=20)
                print("urllib no error", flush=True)
            except urllib.error.HTTPError as error:
                print("urllib", error.code, "after %.1f" % (time.monotonic() - start), flush=True)
            except Exception as error:
                print("urllib failed", type(error).__name__, flush=True)

            # Keep-alive: a 413 from the head, and the client sends nothing more; the receiver ends the connection.
            s = socket.create_connection(("127.0.0.1", PORT), timeout=30)
            s.sendall(b"POST /c3pro/encfhir/Observation HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 5000000\\r\\n\\r\\n")
            start = time.monotonic()
            answer = b""
            while True:
                part = s.recv(4096)
                if not part:
                    break
                answer += part
            print("keepalive", answer.split(b"\\r\\n")[0].decode(), "ended after %.1f" % (time.monotonic() - start), flush=True)
            """, port: receiver.port)
        let lines = output.split(separator: "\n").map(String.init)
        let trickles = lines.filter { $0.hasPrefix("trickle ") }
        #expect(trickles.count == 3, "\(output)")
        for line in trickles {
            #expect(line.contains("HTTP/1.1 413"), "\(line)")
            let seconds = Double(line.split(separator: " ").last ?? "") ?? .infinity
            // lingering_time_seconds is 3: closed then, not when the client stops (it never would).
            #expect(line.contains("closed after") && seconds < 30, "\(line)")
        }
        let urllib = try #require(lines.first { $0.hasPrefix("urllib") }, "\(output)")
        #expect(urllib.hasPrefix("urllib 413 after"), "the client read its 413: \(urllib)")
        let keepAlive = try #require(lines.first { $0.hasPrefix("keepalive") }, "\(output)")
        #expect(keepAlive.contains("HTTP/1.1 413"), "\(keepAlive)")
        // idle_timeout_seconds is 60: the end comes with the answer, not then.
        #expect((Double(keepAlive.split(separator: " ").last ?? "") ?? .infinity) < 30, "\(keepAlive)")
        // The receiver still serves.
        try await anotherDeviceServed(receiver, keys, bearer)
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "One address holds at most max_connections_per_address connections: those past it are closed at once, the others answered; closed ones give their place back"
    )
    func connectionsPerAddress() async throws {
        let (_, keys, _, receiver, bearer) = try await startWithClient(serve: ["max_connections_per_address": 5])
        // From 127.0.0.2, so that the test's own HTTP client (127.0.0.1) is another address.
        let output = try await python(
            """
            import socket, time
            def connect():
                return socket.create_connection(("127.0.0.1", PORT), timeout=10, source_address=("127.0.0.2", 0))
            def ask(s):
                try:
                    s.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
                    answer = s.recv(4096)
                    return answer.split(b"\\r\\n")[0].decode() if answer else "closed"
                except OSError:
                    return "closed"
            held = [connect() for _ in range(8)]
            time.sleep(0.5)
            answers = [ask(s) for s in held]
            print("answered", sum(a.startswith("HTTP/1.1 200") for a in answers), "closed", answers.count("closed"), flush=True)
            for s in held:
                s.close()
            time.sleep(0.5)
            again = connect()
            print("again", ask(again), flush=True)
            """, port: receiver.port)
        #expect(output.contains("answered 5 closed 3"), "\(output)")
        #expect(output.contains("again HTTP/1.1 200"), "a closed connection gives its place back: \(output)")
        let refused = try await metricLines(receiver, "dq_serve_connections_refused_total")
        #expect(refused.contains(#"dq_serve_connections_refused_total{reason="per_address"} 3"#), "\(refused)")
        // Another address is served all along.
        try await anotherDeviceServed(receiver, keys, bearer)
        #expect(await receiver.stop().status == 0)
    }
}
