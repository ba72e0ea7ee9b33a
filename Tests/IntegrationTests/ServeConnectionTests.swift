import Foundation
import Testing

/// What a connection can hold of `dq serve`: before these, a request declaring 100 GiB got its 413 and was then read
/// for as long as the client trickled bytes; a client that sent `Connection: close` and a large body never read its
/// 413 (the receiver stopped reading, the client's send blocked); a keep-alive 413 left the socket open for the idle
/// timeout; one address could hold any number of connections.
extension ServeConnectionSuite {
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

            # Sends `request` and reads until the receiver ends the connection; prints the status and when.
            def read_to_end(name, request):
                s = socket.create_connection(("127.0.0.1", PORT), timeout=30)
                s.sendall(request)
                start = time.monotonic()
                answer = b""
                while True:
                    part = s.recv(4096)
                    if not part:
                        break
                    answer += part
                print(name, answer.split(b"\\r\\n")[0].decode(), "ended after %.1f" % (time.monotonic() - start), flush=True)

            # Keep-alive: a 413 from the head, and the client sends nothing more; the receiver ends the connection.
            read_to_end("keepalive", b"POST /c3pro/encfhir/Observation HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 5000000\\r\\n\\r\\n")
            # HTTP/1.0 without keep-alive: the client reads to the end of the connection, which comes with the answer.
            read_to_end("http10", b"GET /healthz HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
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
        let http10 = try #require(lines.first { $0.hasPrefix("http10") }, "\(output)")
        #expect(http10.contains(" 200 "), "\(http10)")
        #expect((Double(http10.split(separator: " ").last ?? "") ?? .infinity) < 30, "not at the idle timeout (60 s): \(http10)")
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

    @Test(
        "HTTP as RFC 9110 and 9112 have it: no Host or two Host headers is 400, another method on a receiver's path is 405 with Allow, the registration's 201 is not cached, a plain delivery's Location names the receiver's path, not the FHIR server"
    )
    func httpPapercuts() async throws {
        // The plain delivery below is answered 201 only when it is delivered within the answer's wait: a wait no
        // busy machine's delivery to a running sekmet outlasts (2 s, the default, did: 202 in one make test run).
        let (server, _, _, receiver, bearer) = try await startWithClient(serve: ["delivery_wait_seconds": 120])
        let output = try await python(
            """
            import socket, json, urllib.request
            def raw(data):
                s = socket.create_connection(("127.0.0.1", PORT), timeout=10)
                s.sendall(data)
                answer = b""
                while b"\\r\\n\\r\\n" not in answer:
                    part = s.recv(4096)
                    if not part:
                        break
                    answer += part
                s.close()
                return answer.decode(errors="replace")
            print("nohost", raw(b"GET /healthz HTTP/1.1\\r\\n\\r\\n").split("\\r\\n")[0], flush=True)
            print("twohosts", raw(b"GET /healthz HTTP/1.1\\r\\nHost: a\\r\\nHost: b\\r\\n\\r\\n").split("\\r\\n")[0], flush=True)
            print("onehost", raw(b"GET /healthz HTTP/1.1\\r\\nHost: a\\r\\n\\r\\n").split("\\r\\n")[0], flush=True)
            answer = raw(b"GET /c3pro/oauth HTTP/1.1\\r\\nHost: a\\r\\n\\r\\n")
            print("getoauth", answer.split("\\r\\n")[0], "allow" if "\\r\\nallow: post" in answer.lower() else "no-allow", flush=True)
            answer = raw(b"DELETE /c3pro/fhir/Patient/p1 HTTP/1.1\\r\\nHost: a\\r\\n\\r\\n")
            print("delete", answer.split("\\r\\n")[0], flush=True)
            request = urllib.request.Request("http://127.0.0.1:%d/c3pro/register" % PORT, data=json.dumps({"sandbox": False}).encode(),
                                             headers={"Antispam": "\(antispam)", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=20) as response:
                print("register", response.status, "cache-control=" + str(response.headers.get("Cache-Control")), flush=True)
            """, port: receiver.port)
        #expect(output.contains("nohost HTTP/1.1 400"), "\(output)")
        #expect(output.contains("twohosts HTTP/1.1 400"), "\(output)")
        #expect(output.contains("onehost HTTP/1.1 200"), "\(output)")
        #expect(output.contains("getoauth HTTP/1.1 405") && output.contains("405 Method Not Allowed allow"), "\(output)")
        #expect(output.contains("delete HTTP/1.1 405"), "\(output)")
        #expect(output.contains("register 201 cache-control=no-store"), "\(output)")
        let answers = try await client(receiver.base, [plain("/c3pro/fhir/Observation", observation("loc"), token: bearer)])
        let answer = try #require(answers.first)
        #expect(answer.status == 201, "delivered within the answer's wait, sekmet being up: \(answer)")
        #expect(answer.location.hasPrefix("/c3pro/fhir/Observation/") && answer.location.contains("/_history/"), "\(answer.location)")
        #expect(!answer.location.contains("127.0.0.1") && !answer.location.contains(server.base), "\(answer.location)")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "Wrong secrets for one client id back off per id (429 with Retry-After after five), whichever address sends them; another client gets its token meanwhile; an unknown id is treated as a known one"
    )
    func tokenBackoff() async throws {
        let (_, _, _, receiver, _) = try await startWithClient(serve: [:])
        let victim = try await register(receiver.base)
        let other = try await register(receiver.base)
        let guesses = (0..<6).map { index in tokenRequest((victim.id, "wrong-\(index)")) }
        let answers = try await client(receiver.base, guesses)
        #expect(answers.prefix(5).allSatisfy { $0.status == 401 }, "\(answers)")
        #expect(answers.last?.status == 429 && !(answers.last?.retryAfter.isEmpty ?? true), "\(answers.last.map(\.description) ?? "")")
        // The shared budget was not spent on the guesses past five: another device is answered.
        let token = try await client(receiver.base, [tokenRequest(other)])
        #expect(token.first?.status == 200, "\(token)")
        let unknown = (0..<6).map { index in tokenRequest(("imported-user-7", "wrong-\(index)")) }
        let unknownAnswers = try await client(receiver.base, unknown)
        #expect(unknownAnswers.prefix(5).allSatisfy { $0.status == 401 }, "\(unknownAnswers)")
        #expect(unknownAnswers.last?.status == 429, "an unknown id backs off as a known one: \(unknownAnswers)")
        #expect(await receiver.stop().status == 0)
    }

    @Test(
        "What one device may have waiting is limited (max_waiting_per_client: 429, max_waiting_bytes_per_client: 507), quarantined items included; other devices are served; quarantined envelopes are dropped in bulk by client and by reason, which gives the device its room back"
    )
    func quotaAndBulkQuarantine() async throws {
        let (server, keys, config, receiver, bearer) = try await startWithClient(serve: [
            "max_waiting_per_client": 3, "max_waiting_bytes_per_client": 60_000,
        ])
        let spammer = try await register(receiver.base)
        let spamToken = try await token(receiver.base, spammer)
        func unopenable(_ value: String, _ token: String) -> Step {
            sealed("/c3pro/encfhir/Observation", observation(value), certificate: keys.certificate, keyID: "k9", token: token)
        }
        let flood = try await client(receiver.base, (0..<5).map { unopenable("u\($0)", spamToken) })
        #expect(flood.map(\.status) == [202, 202, 202, 429, 429], "\(flood)")
        #expect(!(flood.last?.retryAfter.isEmpty ?? true), "\(flood)")
        // Quarantined (no key k9), they still count against the device.
        #expect(
            try await eventually {
                let list = try await dqCommand(["quarantine", "list", "--json"], config: config)
                return (try json(list) as? [Any])?.count == 3
            })
        let still = try await client(receiver.base, [unopenable("u5", spamToken)])
        #expect(still.first?.status == 429, "\(still)")
        // A body that would take a device past its bytes: 507.
        let big = observation("big", extra: String(repeating: " padding", count: 9_000))
        let tooBig = try await client(
            receiver.base, [sealed("/c3pro/encfhir/Observation", big, certificate: keys.certificate, keyID: "k1", token: bearer)])
        #expect(tooBig.first?.status == 507, "\(tooBig)")
        // Another device is served all along.
        try await anotherDeviceServed(receiver, keys, bearer)

        // Dropped in one run by client: the device has its room back.
        let dropped = try await dqCommand(["quarantine", "drop", "--client", spammer.id, "--vacuum", "--json"], config: config)
        #expect(dropped.status == 0, "\(dropped.stderr)")
        #expect(((try json(dropped) as? [String: Any])?["dropped"] as? [String])?.count == 3, "\(dropped.stdout)")
        #expect(
            try await eventually {
                try await client(receiver.base, [unopenable("v0", spamToken)]).first?.status == 202
            }, "taken again once its quarantined envelopes are gone")
        #expect(
            try await eventually {
                let list = try await dqCommand(["quarantine", "list", "--json"], config: config)
                return (try json(list) as? [Any])?.count == 1
            })
        let none = try await dqCommand(["quarantine", "drop", "--older-than-days", "1", "--json"], config: config)
        #expect(((try json(none) as? [String: Any])?["dropped"] as? [String])?.isEmpty == true, "\(none.stdout)")
        let byReason = try await dqCommand(["quarantine", "drop", "--reason", "key_id k9", "--json"], config: config)
        #expect(((try json(byReason) as? [String: Any])?["dropped"] as? [String])?.count == 1, "\(byReason.stdout)")
        let bad = try await dqCommand(["quarantine", "drop"], config: config)
        #expect(bad.status != 0, "nothing selected is an error: \(bad.stderr)")
        let metrics = try await metricLines(receiver, "dq_serve_quota_refusals_total")
        #expect(metrics.contains { $0.contains(#"limit="bytes""#) && $0.hasSuffix(" 1") }, "\(metrics)")
        #expect(metrics.contains { $0.contains(#"limit="count""#) }, "\(metrics)")
        #expect(try await values(server).contains("fast"))
        #expect(await receiver.stop().status == 0)
    }
}
