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
            entries = try Self.entries(options: queueOptions, environment: ProcessInfo.processInfo.environment)
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

    /// `url` with the password of its user info replaced (a PostgreSQL URL's), safe to print.
    static func redacted(_ url: String) -> String {
        guard var components = URLComponents(string: url), components.password != nil else { return url }
        components.password = "***"
        return components.string ?? "(a URL with a password)"
    }

    /// The settings as `options` and `environment` make them, in the README's order.
    static func entries(options: QueueOptions, environment: [String: String]) throws -> [Entry] {
        let settings = try DataQueueSettings.load(options: options, environment: environment)
        let resolved = try settings.resolve()
        let configuration = resolved.configuration
        let file =
            settings.sourcePath.flatMap { FileManager.default.contents(atPath: $0) }
            .flatMap { try? JSONSerialization.jsonObject(with: $0) as? [String: Any] } ?? [:]

        func inFile(_ key: String) -> Bool {
            let parts = key.split(separator: ".").map(String.init)
            guard parts.count == 2 else { return file[key] != nil }
            return (file[parts[0]] as? [String: Any])?[parts[1]] != nil
        }
        func origin(_ key: String, _ variables: [String], flag: (String, Bool)? = nil, also: [String] = []) -> String {
            if let (name, given) = flag, given { return "flag \(name)" }
            if let name = variables.first(where: { environment[$0] != nil }) { return "env \(name)" }
            if let key = ([key] + also).first(where: inFile), let path = settings.sourcePath { return "\(path): \(key)" }
            return "default"
        }
        func number(_ value: Double) -> String {
            value.rounded() == value && abs(value) < 1e15 ? String(Int(value)) : String(value)
        }
        var entries: [Entry] = []
        func add(_ key: String, _ value: String, _ origin: String) { entries.append(Entry(key: key, value: value, origin: origin)) }

        add(
            "server", Self.redacted(resolved.server.absoluteString),
            origin("server", ["DQ_SERVER"], flag: ("--server", options.server != nil)))
        let database = configuration.databasePath
        add(
            "database", database.hasPrefix("postgres") ? Self.redacted(database) : database,
            origin("database", ["DQ_DATABASE"], flag: ("--database", options.database != nil)))
        add(
            "database_password_file", settings.databasePasswordFile ?? "none",
            origin("database_password_file", ["DQ_DATABASE_PASSWORD_FILE"]))
        add("durability", configuration.durability.rawValue, origin("durability", ["DQ_DURABILITY"]))
        add("idempotent", configuration.idempotent.rawValue, origin("idempotent", ["DQ_IDEMPOTENT"]))
        add("max_resource_bytes", String(configuration.maximumResourceSize), origin("max_resource_bytes", ["DQ_MAX_RESOURCE_BYTES"]))
        let extraTypes: String
        switch configuration.resourceTypes {
        case .any: extraTypes = "* (any type)"
        case .r4(let adding): extraTypes = adding.isEmpty ? "none (FHIR R4's types)" : adding.sorted().joined(separator: ",")
        }
        add("extra_resource_types", extraTypes, origin("extra_resource_types", ["DQ_EXTRA_RESOURCE_TYPES"]))
        add("timeout_seconds", number(configuration.requestTimeout), origin("timeout_seconds", ["DQ_TIMEOUT_SECONDS"]))
        add(
            "connect_timeout_seconds", number(configuration.connectTimeout),
            origin("connect_timeout_seconds", ["DQ_CONNECT_TIMEOUT_SECONDS"]))
        add("batch_size", configuration.batchSize.map(String.init) ?? "automatic", origin("batch_size", ["DQ_BATCH_SIZE"]))
        add("batch_max_bytes", String(configuration.batchMaxBytes), origin("batch_max_bytes", ["DQ_BATCH_MAX_BYTES"]))
        add("lease_seconds", number(configuration.leaseDuration), origin("lease_seconds", ["DQ_LEASE_SECONDS"]))
        add("settle_seconds", number(configuration.settleDelay), origin("settle_seconds", ["DQ_SETTLE_SECONDS"]))
        add(
            "retry.initial_seconds", number(configuration.retryPolicy.initialDelay),
            origin("retry.initial_seconds", ["DQ_RETRY_INITIAL_SECONDS"]))
        add(
            "retry.maximum_seconds", number(configuration.retryPolicy.maximumDelay),
            origin("retry.maximum_seconds", ["DQ_RETRY_MAXIMUM_SECONDS"]))
        add("retry.jitter", number(configuration.retryPolicy.jitter), origin("retry.jitter", ["DQ_RETRY_JITTER"]))
        let proxy = configuration.network.proxy(for: resolved.server)
        add(
            "proxy", proxy.map(NetworkConfiguration.redacted) ?? "none",
            origin(
                "proxy",
                ["DQ_PROXY", "DQ_PROXY_FILE"]
                    + (resolved.server.scheme == "https" ? ["HTTPS_PROXY", "https_proxy"] : ["HTTP_PROXY", "http_proxy"]),
                flag: ("--proxy", options.proxy != nil), also: ["proxy_file"]))
        add("no_proxy", configuration.network.noProxy ?? "none", origin("no_proxy", ["DQ_NO_PROXY", "NO_PROXY", "no_proxy"]))
        add("tls.ca_bundle", configuration.network.caBundlePath ?? "none", origin("tls.ca_bundle", ["DQ_CA_BUNDLE"], also: ["ca_bundle"]))
        add("tls.ca_bundle_only", String(configuration.network.caBundleOnly), origin("tls.ca_bundle_only", ["DQ_CA_BUNDLE_ONLY"]))
        add(
            "tls.client_certificate", configuration.network.clientCertificatePath ?? "none",
            origin("tls.client_certificate", ["DQ_CLIENT_CERTIFICATE"]))
        add("tls.client_key", configuration.network.clientKeyPath ?? "none", origin("tls.client_key", ["DQ_CLIENT_KEY"]))
        let auth = settings.auth
        add("auth.client_id", auth?.clientID ?? "none", origin("auth.client_id", ["DQ_CLIENT_ID"]))
        add("auth.token_uri", auth?.tokenURI ?? "none", origin("auth.token_uri", ["DQ_TOKEN_URI"]))
        add("auth.scope", auth?.scope ?? "none", origin("auth.scope", ["DQ_SCOPE"]))
        add(
            "auth.bearer_token", auth?.bearerToken == nil ? "none" : "(set)",
            origin("auth.bearer_token", ["DQ_TOKEN", "DQ_BEARER_TOKEN_FILE"], also: ["auth.bearer_token_file"]))
        add(
            "auth.client_secret", auth?.clientSecret == nil ? "none" : "(set)",
            origin("auth.client_secret", ["DQ_CLIENT_SECRET", "DQ_CLIENT_SECRET_FILE"], also: ["auth.client_secret_file"]))
        add(
            "journal_retention_days", (try settings.journalRetention()).map { number($0 / 86_400) } ?? "0 (keep every line)",
            origin("journal_retention_days", ["DQ_JOURNAL_RETENTION_DAYS"]))
        add(
            "ready_max_age_seconds", settings.readyMaxAgeSeconds.map(number) ?? "none",
            origin("ready_max_age_seconds", ["DQ_READY_MAX_AGE_SECONDS"]))
        add(
            "log_format", options.logFormat ?? settings.logFormat?.rawValue ?? "text",
            origin("log_format", ["DQ_LOG_FORMAT"], flag: ("--log-format", options.logFormat != nil)))
        add(
            "log_level", options.verbose ? "debug" : settings.logLevel?.rawValue ?? "warning",
            origin("log_level", ["DQ_LOG_LEVEL"], flag: ("-v", options.verbose)))
        add("metrics_address", settings.metricsAddress ?? "none (dq run)", origin("metrics_address", ["DQ_METRICS_ADDRESS"]))
        add(
            "poll_interval_seconds", number(settings.pollIntervalSeconds ?? 1),
            origin("poll_interval_seconds", ["DQ_POLL_INTERVAL_SECONDS"]))
        add(
            "drain_timeout_seconds", number(settings.drainTimeoutSeconds ?? 10),
            origin("drain_timeout_seconds", ["DQ_DRAIN_TIMEOUT_SECONDS"]))
        let authText: [(String, String, String?)] = [
            ("authorize_type", "DQ_AUTHORIZE_TYPE", auth?.authorizeType?.rawValue ?? (auth == nil ? nil : "client_credentials")),
            ("authorize_uri", "DQ_AUTHORIZE_URI", auth?.authorizeURI), ("issuer", "DQ_ISSUER", auth?.issuer),
            ("revocation_uri", "DQ_REVOCATION_URI", auth?.revocationURI),
            ("registration_uri", "DQ_REGISTRATION_URI", auth?.registrationURI), ("client_name", "DQ_CLIENT_NAME", auth?.clientName),
            ("token_endpoint_auth_method", "DQ_TOKEN_ENDPOINT_AUTH_METHOD", auth?.tokenEndpointAuthMethod?.rawValue),
            ("private_key", "DQ_PRIVATE_KEY", auth?.privateKey.map { settings.keyFilePath($0) }), ("key_id", "DQ_KEY_ID", auth?.keyID),
            ("key_alg", "DQ_KEY_ALG", auth?.keyAlgorithm?.rawValue), ("credentials_dir", "DQ_CREDENTIALS_DIR", auth?.credentialsDirectory),
        ]
        for (key, variable, value) in authText {
            add("auth." + key, value ?? "none", origin("auth." + key, [variable]))
        }
        // The fields' names and values (none is a secret); the headers' names only (one may carry a token).
        add(
            "auth.registration_fields",
            (auth?.registrationFields ?? [:]).sorted { $0.key < $1.key }.map { "\($0.key)=\(Self.text($0.value))" }
                .joined(separator: ", ").ifEmpty("none"),
            origin("auth.registration_fields", ["DQ_REGISTRATION_FIELDS"]))
        add(
            "auth.registration_headers",
            (auth?.registrationHeaders ?? [:]).keys.sorted().map { "\($0): (set)" }.joined(separator: ", ").ifEmpty("none"),
            origin("auth.registration_headers", ["DQ_REGISTRATION_HEADERS"]))
        add(
            "at_rest.key_file", settings.atRest?.keyFile.map { "\($0) (key \(configuration.atRest?.current.id ?? "?"))" } ?? "none",
            origin("at_rest.key_file", ["DQ_AT_REST_KEY_FILE"]))
        add(
            "at_rest.old_key_files", (settings.atRest?.oldKeyFiles ?? []).joined(separator: ", ").ifEmpty("none"),
            origin("at_rest.old_key_files", ["DQ_AT_REST_OLD_KEY_FILES"]))
        add(
            "encryption.endpoint", resolved.encryption?.endpoint.absoluteString ?? "none",
            origin("encryption.endpoint", ["DQ_ENCRYPTION_ENDPOINT"]))
        let encryption = settings.encryption
        let encryptionText: [(String, String, String?)] = [
            ("certificate", "DQ_ENCRYPTION_CERTIFICATE", encryption?.certificate),
            ("key_id", "DQ_ENCRYPTION_KEY_ID", encryption?.keyID),
            ("fhir_version", "DQ_ENCRYPTION_FHIR_VERSION", encryption?.fhirVersion ?? (encryption == nil ? nil : "1.0.2")),
            ("resource_types", "DQ_ENCRYPTION_RESOURCE_TYPES", encryption?.resourceTypes?.joined(separator: ", ")),
            ("mode", "DQ_ENCRYPTION_MODE", encryption?.mode?.rawValue ?? (encryption == nil ? nil : "c3pro")),
            ("in_flight", "DQ_ENCRYPTION_IN_FLIGHT", encryption?.inFlight.map(String.init) ?? (encryption == nil ? nil : "1")),
        ]
        for (key, variable, value) in encryptionText {
            add("encryption." + key, value ?? "none", origin("encryption." + key, [variable]))
        }
        return entries
    }
}

extension String {
    /// `replacement` for an empty string, else the string.
    fileprivate func ifEmpty(_ replacement: String) -> String { isEmpty ? replacement : self }
}
