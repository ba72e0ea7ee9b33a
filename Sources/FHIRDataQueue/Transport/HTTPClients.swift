import AsyncHTTPClient
import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import NIOSSL

/// dq's HTTP clients: async-http-client, one client per proxy (and one for direct connections) for each
/// ``NetworkConfiguration``, shared by every queue and OAuth2 client of the process that uses it, as
/// `HTTPClient.shared` is. They live as long as the process, unless their TLS files change on disk.
///
/// Each client: no redirects followed, no connection retries of its own (dq has its backoff), HTTP/2 where the
/// server offers it by ALPN, decompression, TLS 1.2 at least, the configured trust and client certificate.
final class HTTPClients: Sendable {
    let network: NetworkConfiguration
    /// The one event loop these clients run on (of NIO's shared group): a flush sends one request at a time,
    /// and its code runs there too (see ``FHIRTransport/taskExecutor``), so an answer needs no thread hop.
    let eventLoop: any EventLoop
    private let tls: TLSConfiguration
    private let connectTimeout: TimeAmount
    private let idleLimit: TimeAmount
    private let clients = NIOLockedValueBox<[String: HTTPClient]>([:])
    /// Set once the set's TLS files changed on disk (see ``shared(for:connectTimeout:idleLimit:)``).
    private let retired = NIOLockedValueBox(false)
    /// The longest request deadline of any user of these clients: a retired client is shut down only after it.
    private let longestTimeout = NIOLockedValueBox<TimeAmount>(.seconds(30))

    /// Queues opened at once on several threads contend for it.
    private static let registry = NIOLockedValueBox<[Key: HTTPClients]>([:])

    private struct Key: Hashable {
        var network: NetworkConfiguration
        var connectTimeout: Int64
        var idleLimit: Int64
        /// The TLS files as they are on disk (see ``stamp(_:)``).
        var files: [Int64]

        /// The same settings, whatever the files hold.
        func sameSettings(as other: Key) -> Bool {
            network == other.network && connectTimeout == other.connectTimeout && idleLimit == other.idleLimit
        }
    }

    /// The process's clients for `network`.
    ///
    /// The CA bundle, client certificate and key are read when the clients are made. A file replaced or rewritten
    /// at its path since (a rotated key and certificate) makes new clients for the next caller (`dq run` makes its
    /// queue again on SIGHUP), and the old ones are retired as ``retire(_:)`` retires a client.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when a certificate, key or CA bundle cannot be read.
    static func shared(
        for network: NetworkConfiguration, connectTimeout: TimeAmount = .seconds(10), idleLimit: TimeAmount = .seconds(4)
    ) throws -> HTTPClients {
        let key = Key(
            network: network, connectTimeout: connectTimeout.nanoseconds, idleLimit: idleLimit.nanoseconds, files: stamp(network))
        if let found = registry.withLockedValue({ $0[key] }) { return found }
        let made = try HTTPClients(network: network, connectTimeout: connectTimeout, idleLimit: idleLimit)
        let (chosen, replaced) = registry.withLockedValue { registry -> (HTTPClients, [HTTPClients]) in
            if let found = registry[key] { return (found, []) }
            let stale = registry.filter { $0.key.sameSettings(as: key) }
            for old in stale.keys { registry[old] = nil }
            registry[key] = made
            return (made, Array(stale.values))
        }
        for old in replaced { old.retireAll() }
        return chosen
    }

    /// What the TLS files of `network` are now: device, inode, size and modification time of each (through
    /// symbolic links, as a credential mount links them). A file replaced or rewritten gives another stamp.
    package static func stamp(_ network: NetworkConfiguration) -> [Int64] {
        [network.caBundlePath, network.clientCertificatePath, network.clientKeyPath].flatMap { path -> [Int64] in
            guard let path else { return [] }
            var info = stat()
            guard stat(path, &info) == 0 else { return [-1] }
            return [
                Int64(info.st_dev), Int64(info.st_ino), Int64(info.st_size), Int64(info.st_mtim.tv_sec),
                Int64(info.st_mtim.tv_nsec),
            ]
        }
    }

    private init(network: NetworkConfiguration, connectTimeout: TimeAmount, idleLimit: TimeAmount) throws {
        self.network = network
        self.connectTimeout = connectTimeout
        self.idleLimit = idleLimit
        tls = try Self.tlsConfiguration(network)
        eventLoop = MultiThreadedEventLoopGroup.singleton.next()
    }

    /// The TLS settings of `network`: system trust plus the CA bundle (or the bundle alone), the client
    /// certificate and key, TLS 1.2 at least.
    static func tlsConfiguration(_ network: NetworkConfiguration) throws -> TLSConfiguration {
        var tls = TLSConfiguration.makeClientConfiguration()
        tls.minimumTLSVersion = .tlsv12
        if let path = network.caBundlePath {
            let certificates: [NIOSSLCertificate]
            do {
                certificates = try NIOSSLCertificate.fromPEMFile(path)
            } catch {
                throw DataQueueError(.invalidConfiguration, "configuration: cannot read the CA bundle \(path) (a PEM file of certificates)")
            }
            guard !certificates.isEmpty else {
                throw DataQueueError(.invalidConfiguration, "configuration: the CA bundle \(path) holds no certificate")
            }
            if network.caBundleOnly {
                tls.trustRoots = .certificates(certificates)
            } else {
                tls.additionalTrustRoots = [.certificates(certificates)]
            }
        }
        switch (network.clientCertificatePath, network.clientKeyPath) {
        case (nil, nil):
            break
        case (let certificate?, let key?):
            do {
                tls.certificateChain = try NIOSSLCertificate.fromPEMFile(certificate).map { .certificate($0) }
            } catch {
                throw DataQueueError(
                    .invalidConfiguration, "configuration: cannot read the client certificate \(certificate) (a PEM certificate)")
            }
            guard !tls.certificateChain.isEmpty else {
                throw DataQueueError(.invalidConfiguration, "configuration: the client certificate \(certificate) holds no certificate")
            }
            do {
                tls.privateKey = .privateKey(try NIOSSLPrivateKey(file: key, format: .pem))
            } catch {
                throw DataQueueError(.invalidConfiguration, "configuration: cannot read the client key \(key) (an unencrypted PEM key)")
            }
        default:
            throw DataQueueError(
                .invalidConfiguration, "configuration: \"tls.client_certificate\" and \"tls.client_key\" go together")
        }
        return tls
    }

    /// The client for a request to `url`: through its proxy, or direct.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) for a proxy URL dq cannot use.
    func client(for url: URL) throws -> HTTPClient {
        let proxy = network.proxy(for: url)
        let key = proxy ?? ""
        if let found = clients.withLockedValue({ $0[key] }) { return found }
        var configuration = HTTPClient.Configuration()
        configuration.tlsConfiguration = tls
        configuration.timeout = .init(connect: connectTimeout)
        configuration.redirectConfiguration = .disallow
        // dq retries with its own backoff; the pool must not spin on a refused connection until the deadline.
        configuration.connectionPool.retryConnectionEstablishment = false
        configuration.connectionPool.idleTimeout = idleLimit
        configuration.decompression = .enabled(limit: .ratio(100))
        if let proxy { configuration.proxy = try Self.proxy(proxy) }
        let (client, kept) = clients.withLockedValue { clients -> (HTTPClient, Bool) in
            if let found = clients[key] { return (found, true) }
            let made = HTTPClient(eventLoopGroup: eventLoop, configuration: configuration)
            // A set retired for changed TLS files (its holder, a round still draining, sends on its own event loop)
            // keeps no client: this one serves the request and is shut down after the longest deadline, as a
            // retired one is. retireAll sets the flag before it collects the clients, so none is left running.
            guard !retired.withLockedValue({ $0 }) else { return (made, false) }
            clients[key] = made
            return (made, true)
        }
        if !kept { shutDownLater(client) }
        return client
    }

    /// Notes a user's request deadline (see ``retire(_:)``).
    func noteTimeout(_ timeout: TimeAmount) {
        longestTimeout.withLockedValue { $0 = max($0, timeout) }
    }

    /// Takes `client` out of use: the next request makes a new one. It is shut down once the requests already
    /// on it (other queues' and OAuth2 clients' too) have passed their deadlines: after the longest one noted.
    func retire(_ client: HTTPClient) {
        let removed = clients.withLockedValue { clients in
            guard let key = clients.first(where: { $0.value === client })?.key else { return false }
            clients[key] = nil
            return true
        }
        guard removed else { return }
        shutDownLater(client)
    }

    /// Shuts `client` down once the requests already on it have passed their deadlines (the longest noted).
    private func shutDownLater(_ client: HTTPClient) {
        let after = longestTimeout.withLockedValue { $0 } + .seconds(5)
        eventLoop.scheduleTask(in: after) { client.shutdown { _ in } }
    }

    /// Retires every client of this set (see ``retire(_:)``): its TLS files changed. A request through this set
    /// later (a round still draining) gets a client of its own, shut down after it.
    private func retireAll() {
        retired.withLockedValue { $0 = true }
        for client in clients.withLockedValue({ Array($0.values) }) { retire(client) }
    }

    /// async-http-client's proxy for a proxy URL: `http://[user:password@]host[:port]` or `socks5://host[:port]`.
    static func proxy(_ text: String) throws -> HTTPClient.Configuration.Proxy {
        let shown = NetworkConfiguration.redacted(text)
        try URLPort.check(text, setting: "configuration: the proxy \(shown)")
        guard let components = NetworkConfiguration.components(text), let host = components.host, !host.isEmpty
        else {
            throw DataQueueError(.invalidConfiguration, "configuration: the proxy \(shown) is not a URL (http://host:port)")
        }
        switch components.scheme?.lowercased() {
        case "http":
            var authorization: HTTPClient.Authorization?
            if let user = components.percentEncodedUser {
                let password = components.percentEncodedPassword ?? ""
                authorization = .basic(
                    username: user.removingPercentEncoding ?? user, password: password.removingPercentEncoding ?? password)
            }
            return .server(host: host, port: components.port ?? 80, authorization: authorization)
        case "socks5", "socks5h":
            guard components.user == nil else {
                throw DataQueueError(.invalidConfiguration, "configuration: dq cannot give credentials to a SOCKS proxy (\(shown))")
            }
            return .socksServer(host: host, port: components.port ?? 1080)
        default:
            throw DataQueueError(
                .invalidConfiguration, "configuration: the proxy \(shown) must be http:// (CONNECT for https) or socks5://")
        }
    }
}
