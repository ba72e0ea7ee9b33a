import Foundation

/// How dq reaches the network: proxies, trust and the client certificate, for every request it makes (FHIR
/// sends, the CapabilityStatement, token, registration, discovery, JWKS and revocation).
///
/// ```swift
/// var network = NetworkConfiguration()
/// network.httpsProxy = "http://proxy.hospital.example:3128"
/// network.noProxy = "localhost,.internal.example"
/// network.clientCertificatePath = "/etc/dq/client.pem"
/// network.clientKeyPath = "/etc/dq/client.key"
/// ```
public struct NetworkConfiguration: Sendable, Hashable {
    /// The proxy for `https` URLs (HTTP CONNECT through an `http://` proxy, or a `socks5://` proxy), with
    /// optional credentials in its user info. The default is none.
    public var httpsProxy: String?
    /// The proxy for `http` URLs. The default is none. async-http-client reaches an `http` server through a proxy
    /// by HTTP CONNECT too (not in absolute form), so the proxy must allow CONNECT to the server's port.
    public var httpProxy: String?
    /// Hosts reached without the proxy, as curl reads `NO_PROXY`: a comma-separated list of host names (each
    /// also matching its subdomains; a leading `.` is ignored), IP addresses, optionally with `:port`, or `*`
    /// for every host. The default is none.
    public var noProxy: String?
    /// A PEM file of CA certificates trusted in addition to the system's. The default is none.
    public var caBundlePath: String?
    /// Trust only ``caBundlePath``, not the system's CAs. The default is `false`.
    public var caBundleOnly = false
    /// A PEM certificate (chain) dq presents to servers that require one (mutual TLS). The default is none.
    public var clientCertificatePath: String?
    /// The PEM private key of ``clientCertificatePath``. The default is none.
    public var clientKeyPath: String?

    /// Direct connections, the system's trust store, no client certificate.
    public init() {}

    /// The proxy URL for a request to `url`, or nil to connect directly.
    public func proxy(for url: URL) -> String? {
        guard let scheme = url.scheme?.lowercased(), let host = url.host else { return nil }
        let proxy = scheme == "https" ? httpsProxy : scheme == "http" ? httpProxy : nil
        guard let proxy, !proxy.isEmpty else { return nil }
        let port = url.port ?? (scheme == "https" ? 443 : 80)
        return Self.bypasses(noProxy, host: host, port: port) ? nil : proxy
    }

    /// Whether `noProxy` (curl's rules) sends `host:port` around the proxy.
    static func bypasses(_ noProxy: String?, host: String, port: Int) -> Bool {
        guard let noProxy else { return false }
        let host = host.lowercased().trimmingCharacters(in: CharacterSet(charactersIn: "[]"))
        for raw in noProxy.split(separator: ",") {
            var entry = raw.trimmingCharacters(in: .whitespaces).lowercased()
            if entry.isEmpty { continue }
            if entry == "*" { return true }
            // An address range (`10.0.0.0/8`, `fd00::/8`), as curl takes one since 7.86: for a host given as an address.
            if entry.contains("/") {
                if Self.address(host, in: entry) { return true }
                continue
            }
            // A port after the last colon, unless the entry is a bare IPv6 address.
            if let colon = entry.lastIndex(of: ":"), entry.hasPrefix("[") || entry.filter({ $0 == ":" }).count == 1 {
                let after = entry[entry.index(after: colon)...]
                if let wanted = Int(after) {
                    if wanted != port { continue }
                    entry = String(entry[..<colon])
                }
            }
            entry = entry.trimmingCharacters(in: CharacterSet(charactersIn: "[]"))
            if entry.hasPrefix(".") { entry.removeFirst() }
            if host == entry || host.hasSuffix("." + entry) { return true }
        }
        return false
    }

    /// Whether `host` is an IP address inside `range` (`address/prefix length`, IPv4 or IPv6).
    static func address(_ host: String, in range: String) -> Bool {
        let parts = range.split(separator: "/", maxSplits: 1)
        guard parts.count == 2, let length = Int(parts[1]), length >= 0 else { return false }
        guard let network = bytes(of: String(parts[0])), let address = bytes(of: host), network.count == address.count,
            length <= network.count * 8
        else { return false }
        for bit in 0..<length where (network[bit / 8] ^ address[bit / 8]) & (0x80 >> UInt8(bit % 8)) != 0 {
            return false
        }
        return true
    }

    /// The bytes of an IPv4 or IPv6 address literal; nil for a name.
    private static func bytes(of text: String) -> [UInt8]? {
        var v4 = in_addr()
        if inet_pton(AF_INET, text, &v4) == 1 { return withUnsafeBytes(of: &v4) { Array($0) } }
        var v6 = in6_addr()
        if inet_pton(AF_INET6, text, &v6) == 1 { return withUnsafeBytes(of: &v6) { Array($0) } }
        return nil
    }

    /// The usual proxy variables of `environment`: `HTTPS_PROXY`/`https_proxy`, `HTTP_PROXY`/`http_proxy`,
    /// `NO_PROXY`/`no_proxy` (the lowercase name wins when both are set, as in curl).
    public mutating func apply(environment: [String: String]) {
        func value(_ name: String) -> String? {
            (environment[name.lowercased()] ?? environment[name]).flatMap { $0.isEmpty ? nil : $0 }
        }
        if let value = value("HTTPS_PROXY") { httpsProxy = value }
        if let value = value("HTTP_PROXY") { httpProxy = value }
        if let value = value("NO_PROXY") { noProxy = value }
    }

    /// A proxy URL with its password replaced, safe to print.
    public static func redacted(_ proxy: String) -> String {
        guard var components = components(proxy), components.host != nil else { return "the proxy" }
        if components.password != nil { components.password = "***" }
        components.query = nil
        return components.string ?? "the proxy"
    }

    /// The scheme, host and port a proxy URL names (`http://proxy.example:3128`), the port dq connects to
    /// (80, 1080 for SOCKS) when it names none: no user, password or path. How a proxy that did not answer is named.
    package static func origin(ofProxy proxy: String) -> String {
        guard let components = components(proxy), let host = components.host, !host.isEmpty else { return "the proxy" }
        let scheme = components.scheme?.lowercased() ?? "http"
        let port = components.port ?? (scheme.hasPrefix("socks") ? 1080 : 80)
        return "\(scheme)://\(host.contains(":") && !host.hasPrefix("[") ? "[\(host)]" : host):\(port)"
    }

    /// A proxy URL's parts; one without a scheme (`user:password@host:3128`, as curl takes it) is `http://`.
    package static func components(_ proxy: String) -> URLComponents? {
        URLComponents(string: proxy.contains("://") ? proxy : "http://" + proxy)
    }
}

extension NetworkConfiguration: RedactedDescription {
    /// Every setting; each proxy URL's password redacted (see ``redacted(_:)``).
    package var redactedFields: [RedactedField] {
        [
            .url("httpsProxy", httpsProxy), .url("httpProxy", httpProxy), .plain("noProxy", noProxy),
            .plain("caBundlePath", caBundlePath), .plain("caBundleOnly", caBundleOnly),
            .plain("clientCertificatePath", clientCertificatePath), .plain("clientKeyPath", clientKeyPath),
        ]
    }
}
