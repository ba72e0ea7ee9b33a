import FHIRDataQueue
import Foundation
import Hummingbird
import HummingbirdTLS
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOSSL

/// `serve.tls`: the PEM files `dq serve` serves HTTPS with, instead of plain HTTP (for a TLS proxy in front).
///
/// ```json
/// "tls": { "certificate": "/etc/dq/tls/fullchain.pem", "key": "/etc/dq/tls/privkey.pem" }
/// ```
/// Both or neither; a relative path is taken from the configuration file's directory.
struct ServeTLSSettings: Sendable, Equatable {
    /// `certificate`: the certificate chain, leaf first (PEM).
    var certificate: String
    /// `key`: the leaf's private key (PEM, unencrypted).
    var key: String

    /// The `tls` value of the `serve` object (nil when absent); `base` is the configuration file's directory.
    static func parse(_ value: Any?, base: URL) throws -> ServeTLSSettings? {
        guard let value else { return nil }
        let form = "\"serve.tls\" must be an object with \"certificate\" and \"key\", the paths of PEM files (both or neither)"
        guard let object = value as? [String: Any], Set(object.keys).isSubset(of: ["certificate", "key"]) else {
            throw DataQueueError(.invalidConfiguration, form)
        }
        guard let certificate = object["certificate"] as? String, !certificate.isEmpty, let key = object["key"] as? String,
            !key.isEmpty
        else { throw DataQueueError(.invalidConfiguration, form) }
        func path(_ name: String) -> String { name.hasPrefix("/") ? name : base.appendingPathComponent(name).path }
        return ServeTLSSettings(certificate: path(certificate), key: path(key))
    }
}

/// A certificate chain and its private key, read from `serve.tls` and checked: both readable PEM, the key the
/// leaf's, the leaf not expired. Errors name the files and never hold key material.
struct ServeTLSIdentity: Sendable {
    let chain: [NIOSSLCertificate]
    let key: NIOSSLPrivateKey
    /// The leaf's `notValidAfter`.
    let notValidAfter: Date

    /// Reads and checks the pair.
    /// - Throws: `DataQueueError(.invalidConfiguration)` naming the file and what is wrong with it.
    static func load(_ settings: ServeTLSSettings, now: Date = Date()) throws -> ServeTLSIdentity {
        func refuse(_ message: String) -> DataQueueError { DataQueueError(.invalidConfiguration, message) }
        let (certificateFile, keyFile) = (settings.certificate, settings.key)
        guard let certificateBytes = FileManager.default.contents(atPath: certificateFile) else {
            throw refuse("cannot read \"serve.tls.certificate\" \(certificateFile)")
        }
        guard let keyBytes = FileManager.default.contents(atPath: keyFile) else {
            throw refuse("cannot read \"serve.tls.key\" \(keyFile)")
        }
        guard let chain = try? NIOSSLCertificate.fromPEMBytes(Array(certificateBytes)), let leaf = chain.first else {
            throw refuse("\"serve.tls.certificate\" \(certificateFile) holds no PEM certificate")
        }
        // No passphrase callback: an encrypted key is refused here rather than prompted for.
        guard let key = try? NIOSSLPrivateKey(bytes: Array(keyBytes), format: .pem) else {
            throw refuse("\"serve.tls.key\" \(keyFile) is not an unencrypted PEM private key")
        }
        // BoringSSL checks that the key is the leaf's public key's when both go into a context (the leaf first).
        var probe = TLSConfiguration.makeServerConfiguration(certificateChain: chain.map { .certificate($0) }, privateKey: .privateKey(key))
        probe.minimumTLSVersion = .tlsv12
        do {
            _ = try NIOSSLContext(configuration: probe)
        } catch {
            throw refuse("\"serve.tls.certificate\" \(certificateFile) does not match its key \"serve.tls.key\" \(keyFile)")
        }
        let notValidAfter = Date(timeIntervalSince1970: TimeInterval(leaf.notValidAfter))
        guard notValidAfter > now else {
            throw refuse(
                "\"serve.tls.certificate\" \(certificateFile) expired: notValidAfter \(notValidAfter.formatted(.iso8601)); renew it")
        }
        return ServeTLSIdentity(chain: chain, key: key, notValidAfter: notValidAfter)
    }
}

/// The certificate and key `dq serve` answers TLS handshakes with, swapped on SIGHUP without touching the listener:
/// every handshake takes the pair current when it starts (`TLSConfiguration.sslContextCallback`), so a new
/// connection gets a new certificate and an open one keeps the session it has.
final class ServeTLSCertificates: Sendable {
    private let current: NIOLockedValueBox<ServeTLSIdentity>
    /// Where the running pair was read from.
    private let files: NIOLockedValueBox<ServeTLSSettings>

    init(_ settings: ServeTLSSettings) throws {
        current = NIOLockedValueBox(try ServeTLSIdentity.load(settings))
        files = NIOLockedValueBox(settings)
    }

    /// The pair served now.
    var identity: ServeTLSIdentity { current.withLockedValue { $0 } }

    /// The server's TLS configuration: TLS 1.2 at least, HTTP/1.1 by ALPN, and the pair chosen per handshake.
    func configuration() -> TLSConfiguration {
        let identity = self.identity
        var configuration = TLSConfiguration.makeServerConfiguration(
            certificateChain: identity.chain.map { .certificate($0) }, privateKey: .privateKey(identity.key))
        configuration.minimumTLSVersion = .tlsv12
        configuration.applicationProtocols = ["http/1.1"]
        configuration.sslContextCallback = { [self] _, promise in
            let identity = self.identity
            var override = NIOSSLContextConfigurationOverride()
            override.certificateChain = identity.chain.map { .certificate($0) }
            override.privateKey = .privateKey(identity.key)
            promise.succeed(override)
        }
        return configuration
    }

    /// Reads the pair at `settings` (the running files when nil) and checks it, without using it yet.
    /// - Throws: what `ServeTLSIdentity.load` throws; the running pair stays.
    func read(_ settings: ServeTLSSettings?) throws -> (ServeTLSSettings, ServeTLSIdentity) {
        let settings = settings ?? files.withLockedValue { $0 }
        return (settings, try ServeTLSIdentity.load(settings))
    }

    /// Serves `identity` from the next handshake on.
    func use(_ read: (ServeTLSSettings, ServeTLSIdentity), logger: Logger) {
        files.withLockedValue { $0 = read.0 }
        current.withLockedValue { $0 = read.1 }
        logger.notice(
            "TLS certificate read again: new connections get it",
            metadata: ["notValidAfter": "\(read.1.notValidAfter.formatted(.iso8601))"])
    }
}

extension ServeReload {
    /// Whether "tls" among the changed settings took effect now (the pair is read again) rather than at the next start
    /// (TLS turned on or off needs a new listener).
    static func tlsReloaded(_ running: ServeSettings, _ loaded: ServeSettings) -> Bool {
        running.tls != nil && loaded.tls != nil
    }
}

extension DQ.Doctor {
    /// `serve.tls`: readable, the key the certificate's, not expired (a warning within 30 days of its end).
    static func tlsFindings(_ serve: ServeSettings, now: Date = Date()) -> [Finding] {
        guard let tls = serve.tls else { return [] }
        do {
            let identity = try ServeTLSIdentity.load(tls, now: now)
            let left = identity.notValidAfter.timeIntervalSince(now)
            guard left < 30 * 86_400 else { return [] }
            return [
                Finding(
                    about: "serve",
                    problem:
                        "warning: \"serve.tls.certificate\" \(tls.certificate) expires within 30 days (notValidAfter \(identity.notValidAfter.formatted(.iso8601)))",
                    remedy: "renew it, put it at the same path and reload dq serve (SIGHUP: systemctl reload dq-serve)",
                    exitCode: Exit.ok)
            ]
        } catch {
            return [
                Finding(
                    about: "serve", problem: (error as? DataQueueError)?.message ?? "\"serve.tls\": \(error)",
                    remedy:
                        "give \"serve.tls\" a PEM certificate chain (leaf first) and its unencrypted PEM key, readable by dq's user, the certificate current",
                    exitCode: Exit.configuration)
            ]
        }
    }
}
