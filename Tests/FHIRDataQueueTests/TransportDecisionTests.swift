import Foundation
import Testing

@testable import FHIRDataQueue

@Suite("Response classification and retry decisions")
struct TransportDecisionTests {
    @Test(
        "Status codes map to success, permanent, transient or authentication",
        arguments: [
            (200, "success"), (201, "success"), (204, "success"),
            (400, "permanent"), (404, "permanent"), (409, "permanent"), (412, "permanent"), (422, "permanent"),
            (301, "permanent"),
            (401, "authentication"), (403, "authentication"),
            (408, "transient"), (429, "transient"), (500, "transient"), (502, "transient"), (503, "transient"),
        ])
    func classification(status: Int, expected: String) {
        let result = ResponseClassification.classify(status: status, body: Data(), retryAfter: nil, envelope: false)
        let kind: String
        switch result {
        case .success: kind = "success"
        case .permanent: kind = "permanent"
        case .transient: kind = "transient"
        case .authentication: kind = "authentication"
        }
        #expect(kind == expected)
    }

    @Test("On the encrypted endpoint a 2xx with an error body is a failure; empty and \"OK\" are success")
    func envelopeQuirks() {
        func classify(_ body: String) -> ResponseClassification {
            ResponseClassification.classify(status: 200, body: Data(body.utf8), retryAfter: nil, envelope: true)
        }
        #expect(classify("") == .success)
        #expect(classify("\"OK\"") == .success)
        #expect(classify("{'error':'cannot decrypt'}") != .success)
        #expect(classify(#"{"error":"x"}"#) != .success)
        // The plain FHIR endpoint does not apply the quirk.
        #expect(
            ResponseClassification.classify(status: 200, body: Data(#"{"error":"x"}"#.utf8), retryAfter: nil, envelope: false) == .success)
    }

    @Test("Retry-After is read as seconds or an HTTP date")
    func retryAfter() {
        #expect(ResponseClassification.parseRetryAfter("120") == 120)
        #expect(ResponseClassification.parseRetryAfter(nil) == nil)
        #expect(ResponseClassification.parseRetryAfter("soon") == nil)
        let now = Date(timeIntervalSince1970: 1_700_000_000)
        let later = ResponseClassification.parseRetryAfter("Tue, 14 Nov 2023 22:14:20 GMT", now: now)
        #expect(later == 60)
    }

    @Test("Backoff doubles, is capped, is jittered, and honours a longer Retry-After")
    func backoff() {
        let policy = RetryPolicy(initialDelay: 10, maximumDelay: 100, jitter: 0.5)
        for _ in 0..<50 {
            #expect((5...10).contains(policy.delay(afterFailures: 1)))
            #expect((10...20).contains(policy.delay(afterFailures: 2)))
            #expect((50...100).contains(policy.delay(afterFailures: 30)))
            #expect(policy.delay(afterFailures: 1, retryAfter: 300) == 300)
        }
        let delays = Set((0..<20).map { _ in policy.delay(afterFailures: 3) })
        #expect(delays.count > 1, "jitter spreads clients")
    }

    @Test("Location headers give id and version")
    func location() {
        let (id, version) = Delivery.parseLocation("http://h/fhir/Patient/abc/_history/3")
        #expect(id == "abc" && version == "3")
        let (plainID, noVersion) = Delivery.parseLocation("http://h/fhir/Patient/abc")
        #expect(plainID == "abc" && noVersion == nil)
    }

    @Test("Queue names keep the full path, so two servers on one host have two queues")
    func queueNames() throws {
        #expect(try DataQueue.queueName(for: URL(string: "https://h/a/fhir/")!) == "https://h/a/fhir")
        #expect(
            try DataQueue.queueName(for: URL(string: "https://h/a/fhir")!)
                != DataQueue.queueName(for: URL(string: "https://h/b/fhir")!))
    }

    @Test(
        "A host differing only in case, or a default port written out, is the same server",
        arguments: [
            "HTTPS://FHIR.Example.org/r4", "https://fhir.example.org:443/r4", "https://fhir.example.org/r4/",
            "https://fhir.example.org/r4//",
        ])
    func queueNameNormalForm(url: String) throws {
        #expect(try DataQueue.queueName(for: URL(string: url)!) == "https://fhir.example.org/r4")
    }

    @Test("A port that is not the scheme's default stays in the name")
    func queueNameKeepsPort() throws {
        #expect(try DataQueue.queueName(for: URL(string: "http://h:443/fhir")!) == "http://h:443/fhir")
        #expect(try DataQueue.queueName(for: URL(string: "http://h:80/fhir")!) == "http://h/fhir")
    }

    @Test(
        "A base URL with a query, a fragment, credentials or another scheme is refused, naming why",
        arguments: [
            ("https://h/fhir?x=1", "query"), ("https://h/fhir#f", "fragment"), ("https://u:p@h/fhir", "user or password"),
            ("https://u@h/fhir", "user or password"), ("ftp://h/fhir", "http or https"), ("https:///fhir", "host"),
        ])
    func queueNameRefusals(url: String, why: String) throws {
        let error = try #require(throws: DataQueueError.self) { try DataQueue.queueName(for: URL(string: url)!) }
        #expect(error.code == .invalidConfiguration)
        #expect(error.message.contains(why))
        #expect(!error.message.contains("u:p"))
    }

    @Test("A redirect parks the item naming the status, its reason and the server it pointed to (not its path or query)")
    func redirectInWords() {
        let result = ResponseClassification.classify(
            status: 307, body: Data(), retryAfter: nil, envelope: false,
            location: "https://other.example:8443/fhir/Patient/p-4711?t=secret")
        guard case .permanent(let message) = result else {
            Issue.record("a redirect is permanent for the item: \(result)")
            return
        }
        #expect(message.contains("307 Temporary Redirect"))
        #expect(message.contains("to https://other.example:8443;"), "\(message)")
        // The path may hold the resource's id: the text is kept readable with the item, even when sealed at rest.
        #expect(!message.contains("p-4711") && !message.contains("/fhir"), "\(message)")
        #expect(!message.contains("secret"))
    }

    @Test(
        "A FHIR server is named by its origin: scheme, host and port, never user info or path",
        arguments: [
            ("https://user:pw@fhir.example.org/fhir/R4/Patient/p-4711", "https://fhir.example.org"),
            ("http://127.0.0.1:8080/fhir/Patient/p-4711?x=1", "http://127.0.0.1:8080"),
            ("http://[::1]:9000/Patient/p-4711", "http://[::1]:9000"),
            ("not a url", "the server"),
        ])
    func originOfAServer(url: String, origin: String) {
        #expect(FHIRTransport.origin(url) == origin)
    }

    @Test(
        "TLS failures are told in words",
        arguments: [
            (
                "handshakeFailed(BoringSSLError.sslError([error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED]))",
                "trusted issuer"
            ),
            ("NIOSSLExtraError.failedToValidateHostname: Couldn't find <none> in certificate", "does not name this host"),
            ("sslError: certificate has expired", "has expired"),
        ])
    func tlsInWords(text: String, words: String) {
        #expect(FHIRTransport.describeTLS(text)?.contains(words) == true)
    }
}
