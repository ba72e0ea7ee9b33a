import ArgumentParser
import FHIRDataQueue
import Foundation

/// `dq config`: the effective settings, each with where its value came from, secrets redacted (as
/// `git config --show-origin` shows them).
struct ShowConfig: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "config",
        abstract: "Print the effective configuration: each setting's value and where it came from.",
        discussion: """
            Origins: the config file and key, a DQ_ variable (or HTTPS_PROXY, HTTP_PROXY, NO_PROXY), a flag, or
            dq's default. Secrets (tokens, client secrets, passwords in URLs) are never printed: "(set)" says one
            is configured. The settings are checked as every command checks them (exit 78 names a bad one).
            """)

    @OptionGroup var queueOptions: QueueOptions
    @Flag(help: "One JSON object: for each setting its value and origin.") var json = false

    /// One setting as shown.
    struct Entry: Encodable {
        var key: String
        var value: String
        var origin: String
    }

    func run() async throws {
        let entries: [Entry]
        do {
            entries = try await Self.entries(options: queueOptions, environment: ProcessInfo.processInfo.environment)
        } catch let error as DataQueueError {
            printError("dq: \(error.message)")
            throw ExitCode(Exit.code(for: error))
        }
        if json {
            try printJSON(Dictionary(uniqueKeysWithValues: entries.map { ($0.key, ["value": $0.value, "origin": $0.origin]) }))
            return
        }
        let width = entries.map(\.key.count).max() ?? 0
        for entry in entries {
            print(entry.key.padding(toLength: width, withPad: " ", startingAt: 0) + "  " + entry.value + "  (" + entry.origin + ")")
        }
    }

    /// A registration field's value as the file writes it.
    static func text(_ value: DataQueueSettings.Auth.FieldValue) -> String {
        switch value {
        case .string(let text): text
        case .bool(let flag): String(flag)
        }
    }

    /// The keys the `serve` object of the file at `path` gives.
    static func serveKeys(_ path: String?) -> Set<String> {
        guard let path, let data = FileManager.default.contents(atPath: path),
            let root = (try? JSONSerialization.jsonObject(with: data)) as? [String: Any],
            let serve = root["serve"] as? [String: Any]
        else { return [] }
        return Set(serve.keys)
    }

    /// `url` with the password of its user info replaced (a PostgreSQL URL's), safe to print.
    static func redacted(_ url: String) -> String {
        guard var components = URLComponents(string: url), components.password != nil else { return url }
        components.password = "***"
        return components.string ?? "(a URL with a password)"
    }

    /// The settings as `options` and `environment` make them, in the README's order; each origin is the provider
    /// of the reader that gave the value, as the reader reported it.
    static func entries(options: QueueOptions, environment: [String: String]) async throws -> [Entry] {
        let recorder = OriginRecorder()
        let (settings, daemon) = try await DaemonSettings.load(options: options, environment: environment, accessReporter: recorder)
        let resolved = try settings.resolve()
        let configuration = resolved.configuration
        let flags = ["server": "--server", "database": "--database", "proxy": "--proxy"]

        /// Where the first of `keys` that the reader found came from; else the first of `variables` set (the
        /// proxy variables, which are not dq keys); else dq's default.
        func origin(_ keys: String..., variables: [String] = []) -> String {
            for key in keys {
                guard let (provider, name) = recorder.origin(of: key) else { continue }
                switch provider {
                case SettingsReader.flagsName: return "flag \(flags[key] ?? key)"
                case SettingsReader.environmentName: return "env \(name)"
                default: return "\(settings.sourcePath ?? "the config file"): \(name)"
                }
            }
            return variables.first { environment[$0] != nil }.map { "env \($0)" } ?? "default"
        }
        func number(_ value: Double) -> String {
            value.rounded() == value && abs(value) < 1e15 ? String(Int(value)) : String(value)
        }
        var entries: [Entry] = []
        func add(_ key: String, _ value: String, _ origin: String) { entries.append(Entry(key: key, value: value, origin: origin)) }

        add(
            "server", Self.redacted(resolved.server.absoluteString),
            origin("server"))
        let database = configuration.databasePath
        add(
            "database", database.hasPrefix("postgres") ? Self.redacted(database) : database,
            origin("database"))
        add(
            "database_password_file", settings.databasePasswordFile ?? "none",
            origin("database_password_file"))
        add("durability", configuration.durability.rawValue, origin("durability"))
        add("idempotent", configuration.idempotent.rawValue, origin("idempotent"))
        add("max_resource_bytes", String(configuration.maximumResourceSize), origin("max_resource_bytes"))
        let extraTypes: String
        switch configuration.resourceTypes {
        case .any: extraTypes = "* (any type)"
        case .r4(let adding): extraTypes = adding.isEmpty ? "none (FHIR R4's types)" : adding.sorted().joined(separator: ",")
        }
        add("extra_resource_types", extraTypes, origin("extra_resource_types"))
        add("timeout_seconds", number(configuration.requestTimeout), origin("timeout_seconds"))
        add(
            "connect_timeout_seconds", number(configuration.connectTimeout),
            origin("connect_timeout_seconds"))
        add("batch_size", configuration.batchSize.map(String.init) ?? "automatic", origin("batch_size"))
        add("batch_max_bytes", String(configuration.batchMaxBytes), origin("batch_max_bytes"))
        add("lease_seconds", number(configuration.leaseDuration), origin("lease_seconds"))
        add("settle_seconds", number(configuration.settleDelay), origin("settle_seconds"))
        add(
            "retry.initial_seconds", number(configuration.retryPolicy.initialDelay),
            origin("retry.initial_seconds"))
        add(
            "retry.maximum_seconds", number(configuration.retryPolicy.maximumDelay),
            origin("retry.maximum_seconds"))
        add("retry.jitter", number(configuration.retryPolicy.jitter), origin("retry.jitter"))
        let proxy = configuration.network.proxy(for: resolved.server)
        add(
            "proxy", proxy.map(NetworkConfiguration.redacted) ?? "none",
            origin(
                "proxy", "proxy_file",
                variables: resolved.server.scheme == "https" ? ["https_proxy", "HTTPS_PROXY"] : ["http_proxy", "HTTP_PROXY"]))
        add("no_proxy", configuration.network.noProxy ?? "none", origin("no_proxy", variables: ["no_proxy", "NO_PROXY"]))
        add("tls.ca_bundle", configuration.network.caBundlePath ?? "none", origin("tls.ca_bundle", "ca_bundle"))
        add("tls.ca_bundle_only", String(configuration.network.caBundleOnly), origin("tls.ca_bundle_only"))
        add(
            "tls.client_certificate", configuration.network.clientCertificatePath ?? "none",
            origin("tls.client_certificate"))
        add("tls.client_key", configuration.network.clientKeyPath ?? "none", origin("tls.client_key"))
        let auth = settings.auth
        add("auth.client_id", auth?.clientID ?? "none", origin("auth.client_id"))
        add("auth.token_uri", auth?.tokenURI ?? "none", origin("auth.token_uri"))
        add("auth.scope", auth?.scope ?? "none", origin("auth.scope"))
        add(
            "auth.bearer_token", auth?.bearerToken == nil ? "none" : "(set)",
            origin("auth.bearer_token", "auth.bearer_token_file"))
        add(
            "auth.client_secret", auth?.clientSecret == nil ? "none" : "(set)",
            origin("auth.client_secret", "auth.client_secret_file"))
        add(
            "journal_retention_days", (try settings.journalRetention()).map { number($0 / 86_400) } ?? "0 (keep every line)",
            origin("journal_retention_days"))
        add(
            "ready_max_age_seconds", daemon.readyMaxAgeSeconds.map(number) ?? "none",
            origin("ready_max_age_seconds"))
        add(
            "log_format", options.logFormat ?? daemon.logFormat?.rawValue ?? "text",
            options.logFormat != nil ? "flag --log-format" : origin("log_format"))
        add(
            "log_level", options.verbose ? "debug" : daemon.logLevel?.rawValue ?? "warning",
            options.verbose ? "flag -v" : origin("log_level"))
        add("metrics_address", daemon.metricsAddress ?? "none (dq run)", origin("metrics_address"))
        add(
            "poll_interval_seconds", number(daemon.pollIntervalSeconds ?? 1),
            origin("poll_interval_seconds"))
        add(
            "drain_timeout_seconds", number(daemon.drainTimeoutSeconds ?? 10),
            origin("drain_timeout_seconds"))
        let authText: [(String, String?)] = [
            ("authorize_type", auth?.authorizeType?.rawValue ?? (auth == nil ? nil : "client_credentials")),
            ("authorize_uri", auth?.authorizeURI), ("issuer", auth?.issuer),
            ("revocation_uri", auth?.revocationURI),
            ("registration_uri", auth?.registrationURI), ("client_name", auth?.clientName),
            ("token_endpoint_auth_method", auth?.tokenEndpointAuthMethod?.rawValue),
            ("private_key", auth?.privateKey.map { settings.keyFilePath($0) }), ("key_id", auth?.keyID),
            ("key_alg", auth?.keyAlgorithm?.rawValue), ("credentials_dir", auth?.credentialsDirectory),
        ]
        for (key, value) in authText {
            add("auth." + key, value ?? "none", origin("auth." + key))
        }
        // The fields' names and values (none is a secret); the headers' names only (one may carry a token).
        add(
            "auth.registration_fields",
            (auth?.registrationFields ?? [:]).sorted { $0.key < $1.key }.map { "\($0.key)=\(Self.text($0.value))" }
                .joined(separator: ", ").ifEmpty("none"),
            origin("auth.registration_fields"))
        add(
            "auth.registration_headers",
            (auth?.registrationHeaders ?? [:]).keys.sorted().map { "\($0): (set)" }.joined(separator: ", ").ifEmpty("none"),
            origin("auth.registration_headers"))
        add(
            "at_rest.key_file", settings.atRest?.keyFile.map { "\($0) (key \(configuration.atRest?.current.id ?? "?"))" } ?? "none",
            origin("at_rest.key_file"))
        add(
            "at_rest.old_key_files", (settings.atRest?.oldKeyFiles ?? []).joined(separator: ", ").ifEmpty("none"),
            origin("at_rest.old_key_files"))
        add(
            "encryption.endpoint", resolved.encryption?.endpoint.absoluteString ?? "none",
            origin("encryption.endpoint"))
        let encryption = settings.encryption
        let encryptionText: [(String, String?)] = [
            ("certificate", encryption?.certificate),
            ("key_id", encryption?.keyID),
            ("fhir_version", encryption?.fhirVersion ?? (encryption == nil ? nil : "1.0.2")),
            ("resource_types", encryption?.resourceTypes?.joined(separator: ", ")),
            ("mode", encryption?.mode?.rawValue ?? (encryption == nil ? nil : "c3pro")),
            ("in_flight", encryption?.inFlight.map(String.init) ?? (encryption == nil ? nil : "1")),
        ]
        for (key, value) in encryptionText {
            add("encryption." + key, value ?? "none", origin("encryption." + key))
        }
        // dq serve's own settings, when the file has a `serve` object (read as dq serve reads them).
        let serve = try ServeSettings.load(from: settings.sourcePath)
        if serve.present {
            let given = Self.serveKeys(settings.sourcePath)
            for (key, value) in ServeSettings.fields {
                let shown = value(serve)
                add(
                    "serve." + key, shown.isEmpty ? "none" : shown,
                    given.contains(key) ? "\(settings.sourcePath ?? "the config file"): serve.\(key)" : "default")
            }
        }
        return entries
    }
}

extension String {
    /// `replacement` for an empty string, else the string.
    fileprivate func ifEmpty(_ replacement: String) -> String { isEmpty ? replacement : self }
}
