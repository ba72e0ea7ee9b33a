import AsyncHTTPClient
import Foundation
import NIOSSL
import Testing

@testable import FHIRDataQueue

/// Which requests go through the proxy, and what of a proxy URL may be printed.
@Suite("Proxy settings")
struct NetworkConfigurationTests {
    @Test(
        "NO_PROXY as curl reads it: host names with their subdomains, a leading dot, ports, IP addresses, address ranges, *",
        arguments: [
            ("fhir.example.org", 443, "example.org", true), ("fhir.example.org", 443, ".example.org", true),
            ("example.org", 443, ".example.org", true), ("badexample.org", 443, "example.org", false),
            ("fhir.example.org", 443, "example.org:8443", false), ("fhir.example.org", 8443, "example.org:8443", true),
            ("127.0.0.1", 80, "localhost, 127.0.0.1", true), ("10.1.2.3", 80, "10.1.2.4", false), ("any.host", 80, "*", true),
            ("::1", 80, "::1", true), ("::1", 80, "[::1]:80", true), ("FHIR.Example.ORG", 443, "example.org", true),
            // Address ranges (CIDR), as curl 7.86 reads them: only for a host given as an address.
            ("10.1.2.3", 443, "10.0.0.0/8", true), ("11.1.2.3", 443, "10.0.0.0/8", false),
            ("192.168.5.200", 443, "192.168.5.128/25", true), ("192.168.5.100", 443, "192.168.5.128/25", false),
            ("fd00::1234", 443, "fd00::/8", true), ("fe80::1", 443, "fd00::/8", false), ("10.0.0.1", 443, "fd00::/8", false),
            ("ten.example.org", 443, "10.0.0.0/8", false), ("1.2.3.4", 443, "0.0.0.0/0", true), ("1.2.3.4", 443, "1.2.3.4/33", false),
        ])
    func noProxy(host: String, port: Int, list: String, bypassed: Bool) {
        #expect(NetworkConfiguration.bypasses(list, host: host, port: port) == bypassed, "\(host):\(port) against \(list)")
    }

    @Test("Each scheme takes its own proxy; NO_PROXY sends a host around it; lowercase variables win")
    func perScheme() {
        var network = NetworkConfiguration()
        network.apply(environment: [
            "HTTPS_PROXY": "http://upper:3128", "https_proxy": "http://lower:3128", "HTTP_PROXY": "http://plain:3128",
            "NO_PROXY": "internal.example",
        ])
        #expect(network.proxy(for: URL(string: "https://fhir.example/r4")!) == "http://lower:3128")
        #expect(network.proxy(for: URL(string: "http://fhir.example/r4")!) == "http://plain:3128")
        #expect(network.proxy(for: URL(string: "https://a.internal.example/r4")!) == nil)
    }

    @Test("A proxy password is never shown, with or without a scheme, and is decoded once")
    func redaction() throws {
        for proxy in ["alice:s3cret@proxy:3128", "http://alice:s3cret@proxy:3128", "socks5://alice:s3cret@proxy"] {
            let shown = NetworkConfiguration.redacted(proxy)
            #expect(!shown.contains("s3cret") && shown.contains("proxy"), "\(shown)")
        }
        #expect(NetworkConfiguration.redacted("not a url with s3cret") == "the proxy")
        // A literal %41 in the password is written %2541: the proxy must get "%41", not "A".
        let proxy = try HTTPClients.proxy("http://alice:p%2541ss@proxy:3128")
        let expected = HTTPClient.Authorization.basic(username: "alice", password: "p%41ss")
        #expect(proxy == HTTPClient.Configuration.Proxy.server(host: "proxy", port: 3128, authorization: expected))
        #expect(throws: DataQueueError.self) { try HTTPClients.proxy("ftp://proxy:21") }
    }

    @Test("A proxy's refusal names the proxy of the request's scheme, not another one, and none for a host sent around it")
    func refusalNamesItsProxy() {
        var network = NetworkConfiguration()
        network.httpsProxy = "http://secure-gate:3128"
        network.httpProxy = "http://plain-gate:8080"
        network.noProxy = "inside.example"
        let refused = HTTPClientError.invalidProxyResponse
        #expect(FHIRTransport.describe(refused, url: "http://fhir.example/r4/Observation", network: network).contains("plain-gate:8080"))
        #expect(FHIRTransport.describe(refused, url: "https://fhir.example/r4/Observation", network: network).contains("secure-gate:3128"))
        let around = FHIRTransport.describe(refused, url: "https://inside.example/r4", network: network)
        #expect(!around.contains("gate"), "\(around)")
    }

    @Test("ca_bundle adds to the system's CAs; ca_bundle_only trusts the bundle alone; TLS 1.2 at least")
    func trustRoots() async throws {
        let scratch = try Scratch("dq-trust")
        defer { withExtendedLifetime(scratch) {} }  // the folder stays until the test ends
        let work = scratch.url.path
        let bundle = work + "/ca.pem"
        let made = try await runToExit(
            "/usr/bin/openssl",
            [
                "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", work + "/ca.key",
                "-out", bundle, "-days", "2", "-subj", "/CN=dq test CA",
            ], stderr: .null)
        try #require(made == 0)
        var network = NetworkConfiguration()
        network.caBundlePath = bundle
        let adding = try HTTPClients.tlsConfiguration(network)
        #expect(adding.trustRoots == nil || adding.trustRoots == .default)
        #expect(adding.additionalTrustRoots.count == 1)
        #expect(adding.minimumTLSVersion == .tlsv12)
        network.caBundleOnly = true
        let replacing = try HTTPClients.tlsConfiguration(network)
        #expect(replacing.additionalTrustRoots.isEmpty)
        guard case .certificates(let certificates)? = replacing.trustRoots else {
            Issue.record("ca_bundle_only must trust the bundle's certificates alone: \(String(describing: replacing.trustRoots))")
            return
        }
        #expect(certificates.count >= 1)
        #expect(try HTTPClients.tlsConfiguration(NetworkConfiguration()).additionalTrustRoots.isEmpty)
    }
}
