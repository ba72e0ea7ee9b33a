import ArgumentParser
import FHIRDataQueue
import FHIRDataQueueServer
import Foundation
import Hummingbird
import HummingbirdCore
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore
import Prometheus
import ServiceLifecycle
import UnixSignals

#if canImport(Glibc)
    import Glibc
#endif

/// The `serve` object of the configuration file: `dq serve`'s own settings (the forwarding side uses the
/// queue's `server`, `database`, `auth` and `at_rest` as `dq run` does).
struct ServeSettings: Sendable, Equatable {
    /// `listen`: `HOST:PORT` (default 127.0.0.1:8080).
    var listen = "127.0.0.1:8080"
    /// `path_prefix`: where the C3-PRO routes are (default `/c3pro`).
    var pathPrefix = "/c3pro"
    /// `antispam_file`: the `Antispam` secrets, one per line.
    var antispamFile: String?
    /// `keys_dir`: the private keys envelopes are opened with (`<key_id>/private-c3pro.der` or `<key_id>.pem`).
    var keysDirectory: String?
    /// `default_key_id`: the key of envelopes whose `key_id` is empty.
    var defaultKeyID: String?
    /// `token_lifetime_seconds` (default 1800).
    var tokenLifetimeSeconds = 1800
    /// `questionnaires_dir`: `GET /fhir/Questionnaire/{id}` reads `{id}.json` here.
    var questionnairesDirectory: String?
    /// `max_body_bytes` (default 10 MiB).
    var maxBodyBytes = 10 << 20
    /// `plain_fhir`: whether `/fhir` takes plain resources (default true).
    var plainFHIR = true
    /// `plain_at_rest`: take plain resources even though the queue does not seal them at rest.
    var plainAtRest = false
    /// `auth_requests_per_minute`: per source address, for `register` and `oauth` (default 60; 0: no limit).
    var authRequestsPerMinute = 60
    /// `secret_checks_per_minute`: secret hashings and checks (scrypt) for all addresses together (default 1,200;
    /// 0: no limit).
    var secretChecksPerMinute = 1200
    /// `trusted_proxies`: the IP addresses of proxies whose `X-Forwarded-For` names the device (default none).
    var trustedProxies: [String] = []
    /// `body_timeout_seconds`: how long a request's body may take to arrive (default 60; 408 after it).
    var bodyTimeoutSeconds = 60
    /// `idle_timeout_seconds`: how long a connection may go without a request head or body part arriving (default
    /// 60): an idle keep-alive connection, a request head (or TLS handshake) that trickles in, is closed after it.
    var idleTimeoutSeconds = 60
    /// `dedupe_window_days`: how long a repeat is recognised, by its `Idempotency-Key` or by its client and the
    /// SHA-256 of its plaintext (default 7).
    var dedupeWindowDays = 7
    /// `role`: what this receiver is (`all`, the default: one process that holds the keys; `edge`: public-facing,
    /// holds no key, forwards envelopes to `forward_to`; `decrypt`: the inside receiver edges forward to).
    var role = ServeRole.all
    /// `forward_to` (`edge`): the base URL of the inside receiver's routes, e.g. `https://inside.example/c3pro`.
    var forwardTo: String?
    /// `forward_certificate` (`edge`): the inside receiver's X.509 certificate; plain resources are sealed for it.
    var forwardCertificate: String?
    /// `forward_key_id` (`edge`): the inside receiver's name for that certificate's key (its `keys_dir` entry).
    var forwardKeyID: String?
    /// `edges` (`decrypt`): clients that authenticate with a signed assertion (SMART Backend Services) instead of a
    /// secret: client id → the file of its public JWKS (`dq keygen` prints it).
    var edges: [String: String] = [:]
    /// `tls`: `{"certificate", "key"}`, PEM files: serve HTTPS in process (read again on SIGHUP); none: plain HTTP.
    var tls: ServeTLSSettings?
    /// `routes`: resources that go to another FHIR server, by the envelope's version or the resource type: each
    /// `{"version": "1.0.2" | "resource_type": "Observation", "server": "https://…/fhir"}`, the first match wins.
    var routes: [ServeRoute] = []
    /// `write_policy`: what devices may write, as SMART v2 scopes (`["system/Observation.c", "system/Patient.cu"]`);
    /// default C3-PRO's writes plus Consent (``WritePolicy/c3pro``).
    var writePolicy = WritePolicy.c3pro
    /// `max_connections_per_address`: connections one address (an IPv6 /64) may hold open; a trusted proxy's count
    /// only towards `max_connections` (default 256: many phones share one carrier-grade NAT address; 0: no limit).
    var maxConnectionsPerAddress = 256
    /// `max_connections`: connections open in all (default 4,096; 0: no limit), never more than the open-file limit
    /// less what the delivery, the database and the keys need.
    var maxConnections = 4096
    /// `lingering_time_seconds`: how long a connection closing after its answer (a 413, a 408) is still read from,
    /// so that a client still sending reads its answer (default 30, as nginx).
    var lingeringTimeSeconds = 30
    /// `lingering_timeout_seconds`: how long such a connection may send nothing before it is closed (default 5).
    var lingeringTimeoutSeconds = 5
    /// `max_waiting_per_client`: items one device may have waiting (pending, parked, quarantined) before it gets 429
    /// (default 10,000; 0: no limit).
    var maxWaitingPerClient = 10_000
    /// `max_waiting_bytes_per_client`: their bytes before it gets 507 (default 256 MiB; 0: no limit).
    var maxWaitingBytesPerClient = 256 << 20
    /// `delivery_wait_seconds`: how long a plain resource's answer waits for its delivery (201 with the server's
    /// `Location` within it, 202 after; default 2; 0: 202 once committed). An edge always answers 202 at once.
    var deliveryWaitSeconds = 2
    /// Whether the file has a `serve` object at all.
    var present = false

    static let keys: Set<String> = [
        "listen", "path_prefix", "antispam_file", "keys_dir", "default_key_id", "token_lifetime_seconds",
        "questionnaires_dir", "max_body_bytes", "plain_fhir", "plain_at_rest", "auth_requests_per_minute",
        "secret_checks_per_minute", "trusted_proxies", "body_timeout_seconds", "idle_timeout_seconds", "dedupe_window_days",
        "role", "forward_to", "forward_certificate", "forward_key_id", "edges", "routes", "tls", "write_policy",
        "max_connections_per_address", "max_connections", "lingering_time_seconds", "lingering_timeout_seconds",
        "max_waiting_per_client", "max_waiting_bytes_per_client", "delivery_wait_seconds",
    ]

    /// The `serve` object of the file at `path` (nil: defaults); relative paths are taken from the file's directory.
    static func load(from path: String?) throws -> ServeSettings {
        var settings = ServeSettings()
        guard let path, let data = FileManager.default.contents(atPath: path),
            let root = (try? JSONSerialization.jsonObject(with: data)) as? [String: Any], let value = root["serve"]
        else { return settings }
        guard let object = value as? [String: Any] else { throw invalid("\"serve\" must be an object") }
        settings.present = true
        if let unknown = object.keys.sorted().first(where: { !keys.contains($0) }) {
            throw invalid("\"serve.\(unknown)\" is not a setting of dq serve (they are \(keys.sorted().joined(separator: ", ")))")
        }
        let base = URL(fileURLWithPath: path).deletingLastPathComponent()
        func string(_ key: String) throws -> String? {
            guard let value = object[key] else { return nil }
            guard let text = value as? String, !text.isEmpty else { throw invalid("\"serve.\(key)\" must be a non-empty string") }
            return text
        }
        func file(_ key: String) throws -> String? {
            try string(key).map { $0.hasPrefix("/") ? $0 : base.appendingPathComponent($0).path }
        }
        func integer(_ key: String, _ range: ClosedRange<Int>) throws -> Int? {
            guard let value = object[key] else { return nil }
            guard let number = value as? Int, !isBoolean(value), range.contains(number) else {
                throw invalid("\"serve.\(key)\" must be a whole number in \(range.lowerBound)...\(range.upperBound)")
            }
            return number
        }
        // JSONSerialization gives true and false as NSNumbers of the C type char (`0 is Bool` holds on Linux).
        func isBoolean(_ value: Any) -> Bool { (value as? NSNumber).map { String(cString: $0.objCType) == "c" } ?? false }
        func flag(_ key: String) throws -> Bool? {
            guard let value = object[key] else { return nil }
            guard isBoolean(value), let bool = value as? Bool else {
                throw invalid("\"serve.\(key)\" must be true or false")
            }
            return bool
        }
        if let value = try string("listen") { settings.listen = value }
        if let value = try string("path_prefix") { settings.pathPrefix = value }
        settings.antispamFile = try file("antispam_file")
        settings.keysDirectory = try file("keys_dir")
        settings.defaultKeyID = try string("default_key_id")
        if let value = try integer("token_lifetime_seconds", 60...86_400) { settings.tokenLifetimeSeconds = value }
        settings.questionnairesDirectory = try file("questionnaires_dir")
        if let value = try integer("max_body_bytes", 1024...(1 << 30)) { settings.maxBodyBytes = value }
        if let value = try flag("plain_fhir") { settings.plainFHIR = value }
        if let value = try flag("plain_at_rest") { settings.plainAtRest = value }
        if let value = try integer("auth_requests_per_minute", 0...1_000_000) { settings.authRequestsPerMinute = value }
        if let value = try integer("secret_checks_per_minute", 0...1_000_000) { settings.secretChecksPerMinute = value }
        if let value = object["trusted_proxies"] {
            guard let addresses = value as? [String],
                addresses.allSatisfy({ (try? SocketAddress(ipAddress: $0, port: 0)) != nil })
            else { throw invalid("\"serve.trusted_proxies\" must be a list of IP addresses, such as [\"127.0.0.1\"]") }
            settings.trustedProxies = addresses
        }
        if let value = try integer("body_timeout_seconds", 1...3600) { settings.bodyTimeoutSeconds = value }
        if let value = try integer("idle_timeout_seconds", 1...3600) { settings.idleTimeoutSeconds = value }
        if let value = try integer("dedupe_window_days", 1...365) { settings.dedupeWindowDays = value }
        if let value = try integer("max_connections_per_address", 0...1_000_000) { settings.maxConnectionsPerAddress = value }
        if let value = try integer("max_connections", 0...1_000_000) { settings.maxConnections = value }
        if let value = try integer("lingering_time_seconds", 1...3600) { settings.lingeringTimeSeconds = value }
        if let value = try integer("lingering_timeout_seconds", 1...3600) { settings.lingeringTimeoutSeconds = value }
        if let value = try integer("max_waiting_per_client", 0...100_000_000) { settings.maxWaitingPerClient = value }
        if let value = try integer("max_waiting_bytes_per_client", 0...(1 << 50)) { settings.maxWaitingBytesPerClient = value }
        if let value = try integer("delivery_wait_seconds", 0...300) { settings.deliveryWaitSeconds = value }
        if let value = try string("role") {
            guard let role = ServeRole(rawValue: value) else { throw invalid("\"serve.role\" must be \(ServeRole.choices)") }
            settings.role = role
        }
        settings.forwardTo = try string("forward_to")
        settings.forwardCertificate = try file("forward_certificate")
        settings.forwardKeyID = try string("forward_key_id")
        settings.tls = try ServeTLSSettings.parse(object["tls"], base: base)
        if let value = object["edges"] {
            guard let edges = value as? [String: Any],
                let files = edges.mapValues({ $0 as? String }) as? [String: String], !files.values.contains("")
            else { throw invalid("\"serve.edges\" must be an object of client id → JWKS file") }
            settings.edges = files.mapValues { $0.hasPrefix("/") ? $0 : base.appendingPathComponent($0).path }
        }
        if let value = object["routes"] {
            let form = "\"serve.routes\" must be a list of {\"version\" or \"resource_type\", \"server\"}"
            guard let list = value as? [Any] else { throw invalid(form) }
            settings.routes = try list.enumerated().map { index, element in
                guard let route = element as? [String: Any], Set(route.keys).isSubset(of: ["version", "resource_type", "server"]),
                    let server = route["server"] as? String, (route["version"] == nil) != (route["resource_type"] == nil),
                    let matched = (route["version"] ?? route["resource_type"]) as? String, !matched.isEmpty
                else { throw invalid("\(form) (route \(index + 1))") }
                guard let url = URL(string: server), ["http", "https"].contains(url.scheme?.lowercased() ?? ""), url.host != nil else {
                    throw invalid("\"serve.routes\" route \(index + 1): \"server\" must be an http(s) URL with a host")
                }
                return ServeRoute(version: route["version"] as? String, resourceType: route["resource_type"] as? String, server: server)
            }
        }
        if let value = object["write_policy"] {
            guard let scopes = value as? [String] else {
                throw invalid("\"serve.write_policy\" must be a list of scopes, such as [\"system/Observation.c\", \"system/Patient.cu\"]")
            }
            do {
                settings.writePolicy = try WritePolicy(scopes: scopes)
            } catch {
                throw invalid("\"serve.write_policy\": \(error.message)")
            }
        }
        return settings
    }

    private static func invalid(_ message: String) -> DataQueueError { DataQueueError(.invalidConfiguration, message) }

    /// The secrets dq serve reads that others than their owner can read (a root-owned file its group may only read
    /// is private, as libpq has it): the Antispam file, each private key of `keys_dir`, the TLS key. Each with what
    /// it is and its mode.
    func exposedSecrets() -> [(what: String, path: String, mode: Int)] {
        var found: [(String, String, Int)] = []
        func check(_ what: String, _ path: String?) {
            if let path, let mode = FilePermissions.exposedMode(path) { found.append((what, path, mode)) }
        }
        check("the Antispam file", antispamFile)
        if let keys = keysDirectory, let names = try? FileManager.default.contentsOfDirectory(atPath: keys) {
            for name in names.sorted() {
                if name.hasSuffix(".pem") { check("the private key", keys + "/" + name) }
                check("the private key", keys + "/" + name + "/private-c3pro.der")
            }
        }
        check("the TLS key", tls?.key)
        return found.filter { secret in
            var isDirectory: ObjCBool = false
            return FileManager.default.fileExists(atPath: secret.1, isDirectory: &isDirectory) && !isDirectory.boolValue
        }
    }

    /// One warning line per secret of ``exposedSecrets()``, as `dq` warns of its own (`dq: warning: …; run: chmod 600`).
    func exposureWarnings() -> [String] {
        exposedSecrets().map { secret in
            "\(secret.what) \(secret.path) is readable by others (mode \(String(secret.mode, radix: 8))); run: chmod 600 \(secret.path)"
        }
    }

    /// The key sets of `edges`, read: client id → JWKS JSON.
    func edgeKeySets() throws -> [String: String] {
        try edges.mapValues { file in
            guard let data = FileManager.default.contents(atPath: file) else {
                throw DataQueueError(.invalidConfiguration, "cannot read \"serve.edges\" key set \(file)")
            }
            return String(decoding: data, as: UTF8.self)
        }
    }

    /// The `Antispam` secrets: the file's non-empty lines, trimmed.
    func antispamSecrets() throws -> [String] {
        guard let antispamFile else {
            throw DataQueueError(.invalidConfiguration, "\"serve.antispam_file\" is required: registration needs the Antispam secrets")
        }
        guard let data = FileManager.default.contents(atPath: antispamFile) else {
            throw DataQueueError(.invalidConfiguration, "cannot read \"serve.antispam_file\" \(antispamFile)")
        }
        let secrets = String(decoding: data, as: UTF8.self).split(whereSeparator: \.isNewline)
            .map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty && !$0.hasPrefix("#") }
        guard !secrets.isEmpty else {
            throw DataQueueError(.invalidConfiguration, "\"serve.antispam_file\" \(antispamFile) holds no secret")
        }
        return secrets
    }
}

/// One of `serve.routes`.
struct ServeRoute: Sendable, Equatable {
    /// The envelope version it matches, or
    var version: String?
    /// the resource type it matches.
    var resourceType: String?
    /// The FHIR server what it matches goes to.
    var server: String
}

/// What a `dq serve` process is in a deployment (`serve.role`, `--role`).
enum ServeRole: String, Sendable, CaseIterable, ExpressibleByArgument {
    /// One process: takes what devices send, holds the keys, opens and forwards to the FHIR server.
    case all
    /// Public-facing: holds no private key; queues envelopes as they are (plain resources sealed at ingest for the
    /// inside's certificate) and forwards them to the inside receiver (`serve.forward_to`).
    case edge
    /// Inside: takes envelopes from edges (its registered clients), opens them and forwards to the FHIR server.
    case decrypt

    static let choices = #""all", "edge" or "decrypt""#
}

extension DQ {
    struct Serve: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "serve",
            abstract: "Receive from C3-PRO apps (registration, tokens, encrypted envelopes) and forward to the FHIR server.",
            discussion: """
                The receiving half of the C3-PRO system on dq's queue. Apps register (POST <prefix>/register with the \
                Antispam header), get tokens (POST <prefix>/oauth), and post envelopes (POST <prefix>/encfhir/…): \
                each is committed to the queue before it is answered 202, then opened in memory with the key its \
                key_id names ("serve.keys_dir") and forwarded to "server" once, in order. An envelope that does not \
                open is quarantined (dq quarantine), never bounced. /healthz, /readyz and /metrics are served on the \
                same listener. SIGTERM or SIGINT stop it gracefully.
                """,
            subcommands: [ImportCredentials.self, Keys.self])

        @OptionGroup var queueOptions: QueueOptions
        @OptionGroup var sending: SendingOptions
        @Option(help: "HOST:PORT to listen on. Overrides \"serve.listen\".") var listen: String?
        @Option(parsing: .unconditional, help: "Seconds between looks for items queued by other processes (default 1).")
        var pollInterval: Double?
        @Option(
            help:
                "all (one process with the keys), edge (holds no key; forwards to \"serve.forward_to\") or decrypt. Overrides \"serve.role\"."
        )
        var role: ServeRole?

        func validate() throws {
            if let pollInterval { try checkFlagSeconds(pollInterval, name: "--poll-interval", allowZero: false) }
            if let listen, ListenAddress.parse(listen) == nil {
                throw ValidationError("--listen is \(listen): \(ListenAddress.form)")
            }
        }

        func run() async throws {
            // SIGHUP's default action would end dq serve: it is trapped for the whole run, before the queue opens, and
            // reads the antispam file and the keys again (ServeReload).
            signal(SIGHUP, SIG_IGN)
            let hangups = await UnixSignalsSequence(trapping: .sighup)
            let registry = PrometheusCollectorRegistry()
            MetricsSystem.bootstrap(Exposition.factory(registry))
            recordBuildInfo()
            // The keyring goes into the queue's configuration before it opens: envelopes are opened when sent.
            let serve = NIOLockedValueBox<ServeSettings?>(nil)
            try await withQueue(
                queueOptions, sending: sending,
                adjust: { settings in
                    var loaded = try ServeSettings.load(from: settings.sourcePath)
                    if let role { loaded.role = role }
                    if loaded.role == .edge {
                        try Self.forwardingToInside(&settings, loaded)
                    } else {
                        guard let keys = loaded.keysDirectory else {
                            throw DataQueueError(
                                .invalidConfiguration, "\"serve.keys_dir\" is required: the private keys envelopes are opened with")
                        }
                        settings.envelopeKeyring = EnvelopeKeyring(directory: keys, defaultKeyID: loaded.defaultKeyID)
                    }
                    settings.duplicateWindow = TimeInterval(loaded.dedupeWindowDays) * 86_400
                    settings.writePolicy = loaded.writePolicy
                    serve.withLockedValue { $0 = loaded }
                }, waitsForDatabase: true
            ) { queue, settings, daemon in
                let logger = Logger(label: "dq")
                guard let loaded = serve.withLockedValue({ $0 }) else { return }
                var options = loaded
                if let listen { options.listen = listen }
                for warning in loaded.exposureWarnings() { logger.warning("\(warning)") }
                try await run(
                    queue: queue, settings: settings, daemon: daemon, loaded: loaded, options: options, hangups: hangups,
                    registry: registry, logger: logger)
            }
        }

        /// An edge's queue: every item goes to the inside receiver's encrypted endpoint, envelopes as they came and
        /// plain resources sealed at ingest for the inside's certificate (dq's authenticated format unless
        /// `encryption.mode` says otherwise), so the edge keeps no plaintext and holds no private key.
        static func forwardingToInside(_ settings: inout DataQueueSettings, _ serve: ServeSettings) throws {
            func refuse(_ message: String) -> DataQueueError { DataQueueError(.invalidConfiguration, message) }
            guard serve.keysDirectory == nil else {
                throw refuse(
                    "an edge (role edge) holds no private key: remove \"serve.keys_dir\" (the keys belong on the decrypting receiver)")
            }
            guard let forward = serve.forwardTo else {
                throw refuse(
                    "\"serve.forward_to\" is required with role edge: the inside receiver's base URL, e.g. https://inside.example/c3pro")
            }
            guard let url = URL(string: forward), ["http", "https"].contains(url.scheme?.lowercased() ?? ""), url.host != nil,
                url.query == nil
            else {
                throw refuse("\"serve.forward_to\" must be an http(s) URL with a host (the inside receiver's routes)")
            }
            guard let certificate = serve.forwardCertificate, let keyID = serve.forwardKeyID else {
                throw refuse(
                    "\"serve.forward_certificate\" and \"serve.forward_key_id\" are required with role edge: plain resources are sealed for the inside receiver's key"
                )
            }
            guard serve.routes.isEmpty else {
                throw refuse("an edge forwards everything to \"serve.forward_to\": \"serve.routes\" belong to the decrypting receiver")
            }
            guard settings.server == nil, settings.encryption?.endpoint == nil else {
                throw refuse(
                    "an edge forwards everything to \"serve.forward_to\": remove \"server\" and \"encryption.endpoint\" (they belong to the decrypting receiver)"
                )
            }
            let base = forward.hasSuffix("/") ? String(forward.dropLast()) : forward
            settings.server = base + "/fhir"
            var encryption = settings.encryption ?? .init()
            encryption.endpoint = base + "/encfhir"
            encryption.certificate = certificate
            encryption.keyID = keyID
            encryption.resourceTypes = nil
            if encryption.mode == nil { encryption.mode = .authenticated }
            settings.encryption = encryption
            // The inside is a dq serve: consecutive envelopes go in batches, committed there all or none, in order.
            settings.envelopeBatches = true
        }

        /// A queue for each route, in the receiver's database, with the queue's settings but the route's server.
        static func routeQueues(_ routes: [ServeRoute], settings: DataQueueSettings, logger: Logger) async throws
            -> [C3PROReceiver.Route]
        {
            var made: [C3PROReceiver.Route] = []
            for route in routes {
                var routed = settings
                routed.server = route.server
                let queue = try await routed.makeQueue(logger: logger)
                made.append(.init(route.version.map { .version($0) } ?? .resourceType(route.resourceType ?? ""), to: queue))
            }
            return made
        }

        private func run(
            queue: DataQueue, settings: DataQueueSettings, daemon: DaemonSettings, loaded: ServeSettings, options: ServeSettings,
            hangups: UnixSignalsSequence, registry: PrometheusCollectorRegistry, logger: Logger
        ) async throws {
            guard let (host, port) = ListenAddress.parse(options.listen) else {
                throw DataQueueError(
                    .invalidConfiguration, "\"serve.listen\" is \(options.listen): \(ListenAddress.form)")
            }
            if options.tls == nil && !ListenAddress.isLoopback(host) {
                // Envelopes are sealed, but bearer tokens, client secrets and plain resources would cross the network
                // readable: the design is a TLS proxy in front (on this host, listening on loopback) or serve.tls.
                logger.warning(
                    "serving plain HTTP on \(host), not loopback: tokens, client secrets and plain resources cross the network unencrypted; set \"serve.tls\", or listen on 127.0.0.1 behind a TLS proxy"
                )
            }
            if options.tls == nil && ListenAddress.isLoopback(host) && options.trustedProxies.isEmpty && options.authRequestsPerMinute > 0 {
                // Plain HTTP on loopback is the TLS proxy's setup, where every device has the proxy's address.
                logger.warning(
                    "plain HTTP on loopback and no \"serve.trusted_proxies\": behind a TLS proxy every device has the proxy's address, so register and oauth are limited to \(options.authRequestsPerMinute) a minute for all devices together; name the proxy in \"serve.trusted_proxies\""
                )
            }
            if let keyring = queue.configuration.envelopeKeyring {
                do {
                    let ids = try keyring.check()
                    if ids.isEmpty { logger.warning("no key in \"serve.keys_dir\": every envelope will be quarantined") }
                } catch {
                    throw DataQueueError(.invalidConfiguration, "\"serve.keys_dir\": \(error)")
                }
            }
            if options.plainFHIR && queue.configuration.atRest == nil && options.role != .edge {
                guard options.plainAtRest else {
                    throw DataQueueError(
                        .invalidConfiguration,
                        "plain FHIR resources are PHI and this queue does not seal them at rest: set \"at_rest\", or \"serve.plain_fhir\": false, or (knowingly) \"serve.plain_at_rest\": true"
                    )
                }
                logger.warning("plain FHIR resources will be stored readable on disk (\"serve.plain_at_rest\": true)")
            }
            var receiving = C3PROReceiver.Configuration(
                pathPrefix: options.pathPrefix, antispamSecrets: try options.antispamSecrets(),
                tokenLifetime: .seconds(options.tokenLifetimeSeconds), questionnairesDirectory: options.questionnairesDirectory,
                maximumBodyBytes: options.maxBodyBytes, acceptsPlainResources: options.plainFHIR,
                authRequestsPerMinute: options.authRequestsPerMinute,
                // An edge's delivery reaches the inside receiver, not the FHIR server: its answer says nothing a
                // device reads (no Location), so a plain resource is answered 202 once it is committed.
                deliveryWait: options.role == .edge ? .zero : .seconds(options.deliveryWaitSeconds))
            receiving.clientKeySets = try options.edgeKeySets()
            receiving.trustedProxies = Set(options.trustedProxies)
            receiving.secretChecksPerMinute = options.secretChecksPerMinute
            receiving.maximumWaitingPerClient = options.maxWaitingPerClient
            receiving.maximumWaitingBytesPerClient = options.maxWaitingBytesPerClient
            receiving.routes = try await Self.routeQueues(options.routes, settings: settings, logger: logger)
            let receiver = try C3PROReceiver(queue: queue, configuration: receiving, logger: Logger(label: "dq.serve"))
            try await receiver.loadClientKeySets()
            let delivery = DataQueueService(
                queues: [queue] + receiving.routes.map(\.queue),
                configuration: .init(
                    pollInterval: .milliseconds(Int64((pollInterval ?? daemon.pollIntervalSeconds ?? 1) * 1000)),
                    drainTimeout: .milliseconds(Int64((daemon.drainTimeoutSeconds ?? 10) * 1000)),
                    journalRetention: try settings.journalRetention().map { .seconds($0) },
                    watchdog: SystemdNotify.watchdog()),
                logger: logger)
            let router = Router(context: ReceiverRequestContext.self)
            router.add(
                middleware: receiver.bodyLimitMiddleware(
                    maximumBytes: options.maxBodyBytes, deadline: .seconds(options.bodyTimeoutSeconds)))
            receiver.addRoutes(to: router)
            OperationsEndpoints(
                metrics: { Exposition.emit(registry) }, readiness: { await delivery.readiness() },
                liveness: { delivery.liveness() }
            ).addRoutes(to: router)
            let tls = try options.tls.map(ServeTLSCertificates.init)
            // A connection that sends nothing HTTP can use (no request head, no body part) for the idle time is closed:
            // a device that trickles its headers, or a TLS handshake, a byte at a time holds a connection that long, not
            // for good (the body has its own deadline, above).
            let connections = ConnectionGuard(
                .init(
                    perAddress: options.maxConnectionsPerAddress,
                    total: ConnectionBudget.connections(wanted: options.maxConnections, logger: logger),
                    exempt: Set(options.trustedProxies), lingeringTime: .seconds(options.lingeringTimeSeconds),
                    lingeringTimeout: .seconds(options.lingeringTimeoutSeconds)))
            let http1 = HTTP1Channel.Configuration(
                additionalChannelHandlers: connections.channelHandlers(), idleTimeout: .seconds(Int64(options.idleTimeoutSeconds)))
            let app = Application(
                router: router,
                server: try tls.map { try .tls(.http1(configuration: http1), tlsConfiguration: $0.configuration()) }
                    ?? .http1(configuration: http1),
                configuration: .init(address: .hostname(host, port: port), serverName: nil),
                services: [
                    delivery,
                    ServeReload(
                        hangups: hangups, configPath: settings.sourcePath, running: loaded, receiver: receiver,
                        keyring: queue.configuration.envelopeKeyring, logger: logger, tls: tls),
                    SystemdStopping(),
                ],
                onServerRunning: { channel in
                    let bound = channel.localAddress?.port ?? port
                    logger.notice("serving", metadata: ["address": "\(host):\(bound)", "prefix": "\(options.pathPrefix)"])
                    SystemdNotify.send("READY=1\nSTATUS=receiving on \(host):\(bound), delivering to \(queue.queueName)")
                },
                logger: Logger(label: "dq.http", factory: { _ in SwiftLogNoOpLogHandler() }))
            // The application's group runs the listener and the delivery; SIGTERM or SIGINT stop both gracefully: the
            // requests on the wire are answered, the journal committed.
            try await app.runService()
            for route in receiving.routes { try? await route.queue.shutdown() }
        }
    }
}

/// Reads the `serve` object's secrets again on SIGHUP, while dq serve goes on serving: the antispam file (a new
/// secret is taken, a removed one refused from then on) and the keys (a key file replaced at its path is read
/// when an envelope next names it; a key added is read on demand anyway). A file that does not read is logged, and
/// the running secrets stay. The other settings take effect at the next start; those that changed are logged by
/// name, never by value.
struct ServeReload: Service {
    let hangups: UnixSignalsSequence
    let configPath: String?
    /// The `serve` object the running receiver was started with (before `--listen`).
    let running: ServeSettings
    let receiver: C3PROReceiver
    let keyring: EnvelopeKeyring?
    let logger: Logger
    /// The certificate served (`serve.tls`), read again too; nil: plain HTTP.
    var tls: ServeTLSCertificates? = nil

    func run() async throws {
        for await _ in hangups.cancelOnGracefulShutdown() {
            do {
                let loaded = try ServeSettings.load(from: configPath)
                let secrets = try loaded.antispamSecrets()
                // A certificate and key that do not read or match refuse the whole reload: the running pair stays.
                let pair = try tls?.read(loaded.tls)
                // The keys' states first: a state file that does not read refuses the whole reload.
                try keyring?.reloadStates()
                receiver.replaceAntispamSecrets(secrets)
                keyring?.forgetKeys()
                if let tls, let pair { tls.use(pair, logger: logger) }
                let later = Self.changes(running, loaded).filter {
                    $0 != "antispam_file" && ($0 != "tls" || !Self.tlsReloaded(running, loaded))
                }
                if later.isEmpty {
                    logger.notice("configuration reloaded: the antispam secrets and the keys are read again")
                } else {
                    // Named, so that an operator knows the file and the running receiver differ until a restart.
                    logger.notice(
                        "configuration reloaded: the antispam secrets and the keys are read again; other changed settings take effect only after a restart",
                        metadata: ["changed_until_restart": "\(later.joined(separator: ","))"])
                }
                if let keyring {
                    do {
                        try keyring.check()
                    } catch {
                        logger.warning("\"serve.keys_dir\": \(error)")
                    }
                }
            } catch {
                logger.error(
                    "reload refused; the running antispam secrets and keys stay",
                    metadata: ["error": "\((error as? DataQueueError)?.message ?? "\(error)")"])
            }
        }
    }

    /// The `serve` settings that differ, by name.
    static func changes(_ old: ServeSettings, _ new: ServeSettings) -> [String] {
        ServeSettings.fields.filter { $0.1(old) != $0.1(new) }.map(\.0)
    }
}

extension ServeSettings {
    /// Each setting of the `serve` object by its key, as text (what `dq config` shows and a reload compares).
    static let fields: [(String, @Sendable (ServeSettings) -> String)] = [
        ("listen", { $0.listen }), ("path_prefix", { $0.pathPrefix }), ("antispam_file", { $0.antispamFile ?? "" }),
        ("keys_dir", { $0.keysDirectory ?? "" }), ("default_key_id", { $0.defaultKeyID ?? "" }),
        ("token_lifetime_seconds", { "\($0.tokenLifetimeSeconds)" }),
        ("questionnaires_dir", { $0.questionnairesDirectory ?? "" }), ("max_body_bytes", { "\($0.maxBodyBytes)" }),
        ("plain_fhir", { "\($0.plainFHIR)" }), ("plain_at_rest", { "\($0.plainAtRest)" }),
        ("auth_requests_per_minute", { "\($0.authRequestsPerMinute)" }),
        ("secret_checks_per_minute", { "\($0.secretChecksPerMinute)" }),
        ("trusted_proxies", { $0.trustedProxies.description }),
        ("body_timeout_seconds", { "\($0.bodyTimeoutSeconds)" }),
        ("idle_timeout_seconds", { "\($0.idleTimeoutSeconds)" }),
        ("dedupe_window_days", { "\($0.dedupeWindowDays)" }), ("role", { $0.role.rawValue }),
        ("forward_to", { $0.forwardTo ?? "" }), ("forward_certificate", { $0.forwardCertificate ?? "" }),
        ("forward_key_id", { $0.forwardKeyID ?? "" }), ("edges", { $0.edges.sorted { $0.key < $1.key }.description }),
        ("routes", { $0.routes.description }), ("write_policy", { $0.writePolicy.description }),
        ("max_connections_per_address", { "\($0.maxConnectionsPerAddress)" }), ("max_connections", { "\($0.maxConnections)" }),
        ("lingering_time_seconds", { "\($0.lingeringTimeSeconds)" }),
        ("lingering_timeout_seconds", { "\($0.lingeringTimeoutSeconds)" }),
        ("max_waiting_per_client", { "\($0.maxWaitingPerClient)" }),
        ("max_waiting_bytes_per_client", { "\($0.maxWaitingBytesPerClient)" }),
        ("delivery_wait_seconds", { "\($0.deliveryWaitSeconds)" }),
        ("tls", { $0.tls.map { "\($0.certificate) \($0.key)" } ?? "" }),
    ]
}

/// The open files dq serve may give to connections: the soft limit raised to the hard one at start, less what the
/// delivery (its HTTP connections), the database (its file, WAL, lock, or PostgreSQL connections), the keys and the
/// logs need, so that a flood of connections can never stop the delivery ("Too many open files").
enum ConnectionBudget {
    /// The files kept for everything but connections.
    static let reserved = 256

    /// `wanted` (0: as many as the budget allows), at most the open-file limit less ``reserved``; said when lowered.
    static func connections(wanted: Int, logger: Logger) -> Int {
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return wanted }
        if limit.rlim_cur < limit.rlim_max {
            var raised = limit
            raised.rlim_cur = limit.rlim_max
            if setrlimit(Int32(RLIMIT_NOFILE.rawValue), &raised) == 0 { limit = raised }
        }
        let files = Int(clamping: limit.rlim_cur)
        let budget = max(16, files - reserved)
        if wanted == 0 || wanted > budget {
            if wanted != 0 {
                logger.warning(
                    "\"serve.max_connections\" is more than the open-file limit allows; lowered (raise LimitNOFILE to serve more)",
                    metadata: ["max_connections": "\(budget)", "open_files": "\(files)"])
            }
            return budget
        }
        return wanted
    }
}
