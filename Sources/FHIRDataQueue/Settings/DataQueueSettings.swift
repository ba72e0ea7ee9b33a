import Logging

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// The `dq.json` settings file, as the `dq` command line and an embedding service both read it.
///
/// Decoding checks names and types (an unknown key or a wrong type is an error that names the key);
/// making a queue (``makeQueue(readOnly:logger:)``) checks values and builds its pieces. Environment variables (`DQ_*`) are applied
/// with ``apply(environment:)``; an application applies its own overrides by setting the properties.
///
/// ```swift
/// var settings = try DataQueueSettings.load(contentsOf: "/etc/dq/dq.json")
/// try settings.apply(environment: ProcessInfo.processInfo.environment)
/// let queue = try await settings.makeQueue(logger: logger)
/// ```
///
/// Every error is a ``DataQueueError`` with code `.invalidConfiguration` and a message that starts with
/// `configuration:` and names the key, never its secret value.
public struct DataQueueSettings: Sendable, Decodable {
    /// `server`: the FHIR base URL.
    public var server: String?
    /// `database`: the queue's SQLite file. The default is ``DataQueue/defaultDatabasePath(environment:)``.
    public var database: String?
    /// `database_password_file` (or `DQ_DATABASE_PASSWORD_FILE`): a file holding the PostgreSQL password, for a
    /// `database` URL without one (a relative name is looked up in `$CREDENTIALS_DIRECTORY` when systemd's
    /// `LoadCredential=` set it, else beside the config file). Over `PGPASSWORD` and the password file.
    public var databasePasswordFile: String?
    /// The password `database_password_file` holds, read by ``readSecretFiles(environment:)``. Not read from the
    /// file.
    package var databasePassword: String?
    /// `durability`: `full` or `normal`.
    public var durability: DataQueue.Durability?
    /// `idempotent`: conditional creates, so that a create whose answer was lost is not stored twice: `"auto"`
    /// (the default: for the types whose conditional create the server declares), `true` or `false` (see
    /// ``DataQueue/Idempotence``).
    public var idempotent: DataQueue.Idempotence?
    /// `max_resource_bytes`: the largest resource accepted.
    public var maxResourceBytes: Int?
    /// `extra_resource_types`: resource types a server adds to FHIR R4's, accepted at enqueue; `"*"` accepts any.
    public var extraResourceTypes: [String]?
    /// `timeout_seconds`: the deadline of one request.
    public var timeoutSeconds: Double?
    /// `connect_timeout_seconds`: the connect timeout.
    public var connectTimeoutSeconds: Double?
    /// `settle_seconds`: see ``DataQueue/Configuration/settleDelay``.
    public var settleSeconds: Double?
    /// `lease_seconds` (or `DQ_LEASE_SECONDS`): see ``DataQueue/Configuration/leaseDuration``.
    public var leaseSeconds: Double?
    /// `batch_size`: the most items per request (transaction Bundle entries); `1` one request per item. Unset:
    /// automatic (see ``DataQueue/Configuration/batchSize``).
    public var batchSize: Int?
    /// `batch_max_bytes`: the most body bytes per Bundle.
    public var batchMaxBytes: Int?
    /// `ready_max_age_seconds`: `dq run`'s `/readyz` fails while a pending item is older than this (unset: age
    /// is not looked at).
    public var readyMaxAgeSeconds: Double?
    /// `log_format` (or `DQ_LOG_FORMAT`): `text` (the default) or `json`, for the command line's log lines.
    public var logFormat: LogFormat?
    /// `log_level` (or `DQ_LOG_LEVEL`): the least level logged, `trace` to `critical`; the default is `warning`
    /// (`-v` is `debug`).
    public var logLevel: Logger.Level?
    /// `metrics_address` (or `DQ_METRICS_ADDRESS`): where `dq run` serves `/metrics`, `/healthz` and `/readyz`
    /// (`HOST:PORT`, or a port on loopback). The default is none.
    public var metricsAddress: String?
    /// `poll_interval_seconds` (or `DQ_POLL_INTERVAL_SECONDS`): how often `dq run` looks for items queued by other
    /// processes. The default is 1.
    public var pollIntervalSeconds: Double?
    /// `drain_timeout_seconds` (or `DQ_DRAIN_TIMEOUT_SECONDS`): how long `dq run`'s graceful stop waits for the
    /// request on the wire. The default is 10.
    public var drainTimeoutSeconds: Double?
    /// `journal_retention_days`: delivery journal lines older than this are deleted by `dq run` (daily) and
    /// `dq flush`. The default is 90; 0 keeps every line.
    public var journalRetentionDays: Double?
    /// `retry`: the backoff after failures.
    public var retry: Retry?
    /// `ca_bundle`: PEM CAs to trust in addition to the system's (also `tls.ca_bundle`).
    public var caBundle: String?
    /// `proxy`: the proxy for every request (`http://[user:password@]host:port`, or `socks5://host:port`); over
    /// `HTTPS_PROXY` and `HTTP_PROXY`.
    public var proxy: String?
    /// `proxy_file`: a file holding the proxy URL (its credentials kept out of the config file), read like
    /// the other `…_file` secrets; excludes `proxy`.
    public var proxyFile: String?
    /// `no_proxy`: hosts reached without the proxy (curl's `NO_PROXY` rules); over `NO_PROXY`.
    public var noProxy: String?
    /// `tls`: the client certificate and trust.
    public var tls: TLS?
    /// The proxy variables of the environment (`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`), set by
    /// ``apply(environment:)``. Not read from the file.
    public var environmentNetwork = NetworkConfiguration()
    /// `auth`: how requests are authorized.
    public var auth: Auth?
    /// `encryption`: the encrypted endpoint (see ``EncryptedDataQueue``).
    public var encryption: Encryption?
    /// `at_rest`: the keys that seal queued items on disk (see ``DataQueue/Configuration/atRest``).
    public var atRest: AtRest?
    /// The directory that relative paths in the file (keys, certificates, credentials) are relative to: the
    /// file's own directory when loaded with ``load(contentsOf:)``. Not read from the file.
    public var baseDirectory: String?
    /// The file the settings were loaded from, if any. Not read from the file.
    public var sourcePath: String?
    /// Whether the file itself (not the environment) holds a secret: a bearer token or a client secret.
    public var fileHoldsSecret = false
    /// Secret files (`…_file` settings) that others than their owner can read. Not read from the file.
    public var exposedSecretFiles: [String] = []

    /// The `retry` object.
    public struct Retry: Sendable, Decodable {
        /// `initial_seconds`.
        public var initialSeconds: Double?
        /// `maximum_seconds`.
        public var maximumSeconds: Double?
        /// `jitter`, from 0 to 1.
        public var jitter: Double?
    }

    /// The `auth` object: a static bearer token, or OAuth2 client_credentials with optional registration.
    public struct Auth: Sendable, Decodable {
        /// `bearer_token` (or `DQ_TOKEN`).
        public var bearerToken: String?
        /// `client_id`.
        public var clientID: String?
        /// `client_secret` (or `DQ_CLIENT_SECRET`).
        public var clientSecret: String?
        /// `bearer_token_file`: a file holding the bearer token (a relative name is looked up in
        /// `$CREDENTIALS_DIRECTORY` when systemd's `LoadCredential=` set it, else beside the config file).
        public var bearerTokenFile: String?
        /// `client_secret_file`: a file holding the client secret, found as `bearer_token_file` is.
        public var clientSecretFile: String?
        /// `authorize_uri`: with `client_credentials` C3-PRO's name for the token endpoint; with
        /// `authorization_code` the authorization endpoint.
        public var authorizeURI: String?
        /// `token_uri`.
        public var tokenURI: String?
        /// `authorize_type`: `client_credentials` (unattended, the default) or `authorization_code` (a
        /// person signs in once with `dq login`; SMART standalone launch with PKCE).
        public var authorizeType: AuthorizeType?
        /// `issuer`: the OpenID issuer whose ID tokens are accepted (authorization_code); the default is
        /// the SMART configuration's.
        public var issuer: String?
        /// `revocation_uri`: the RFC 7009 revocation endpoint (authorization_code); the default is discovered.
        public var revocationURI: String?
        /// `registration_uri`: RFC 7591 dynamic registration.
        public var registrationURI: String?
        /// `client_name` for registration.
        public var clientName: String?
        /// `scope`.
        public var scope: String?
        /// `token_endpoint_auth_method` (`none` only for `authorization_code`).
        public var tokenEndpointAuthMethod: OAuth2Configuration.TokenEndpointAuthMethod?
        /// `private_key`: a PEM file for private_key_jwt.
        public var privateKey: String?
        /// `key_id` of the private key.
        public var keyID: String?
        /// `key_alg`: the JWS algorithm of an RSA private key, `RS384` (the default) or `RS256`; an EC key's
        /// curve decides its own (`ES256`, `ES384`).
        public var keyAlgorithm: OAuth2Configuration.ClientAssertionKey.Algorithm?
        /// `registration_fields`: extra members of the registration request (strings or booleans).
        public var registrationFields: [String: FieldValue]?
        /// `registration_headers`: extra headers of the registration request.
        public var registrationHeaders: [String: String]?
        /// `credentials_dir`: where registered credentials are kept.
        public var credentialsDirectory: String?

        /// How requests are authorized with OAuth2 (`authorize_type`).
        public enum AuthorizeType: String, Sendable, CaseIterable {
            /// Unattended: the client's own credentials (the default).
            case clientCredentials = "client_credentials"
            /// A person signs in once with `dq login`; refresh tokens after that.
            case authorizationCode = "authorization_code"
        }

        /// A registration field's value.
        public enum FieldValue: Sendable, Decodable, Equatable {
            /// A string.
            case string(String)
            /// A boolean.
            case bool(Bool)

            /// Decodes a string or a boolean.
            public init(from decoder: any Decoder) throws {
                let container = try decoder.singleValueContainer()
                if let flag = try? container.decode(Bool.self) {
                    self = .bool(flag)
                } else if let text = try? container.decode(String.self) {
                    self = .string(text)
                } else {
                    throw SettingsKeys.typeError(decoder.codingPath, "must be a string or a boolean")
                }
            }
        }
    }

    /// The `tls` object.
    public struct TLS: Sendable, Decodable {
        /// `client_certificate`: a PEM certificate (chain) for servers that require one.
        public var clientCertificate: String?
        /// `client_key`: its PEM private key.
        public var clientKey: String?
        /// `ca_bundle`: PEM CAs trusted in addition to the system's.
        public var caBundle: String?
        /// `ca_bundle_only`: trust only `ca_bundle`, not the system's CAs.
        public var caBundleOnly: Bool?

        /// Empty `tls` settings.
        public init() {}
    }

    /// The `at_rest` object.
    public struct AtRest: Sendable, Decodable {
        /// `key_file` (or `DQ_AT_REST_KEY_FILE`): the key that seals new items, made by `dq keygen --at-rest`
        /// (a relative name is looked up in `$CREDENTIALS_DIRECTORY` when set, else beside the config file).
        public var keyFile: String?
        /// `old_key_files`: keys that open items sealed before a rekey, listed until none is sealed under them.
        public var oldKeyFiles: [String]?

        /// Empty `at_rest` settings.
        public init() {}
    }

    /// The `encryption` object.
    public struct Encryption: Sendable, Decodable {
        /// `endpoint`: where envelopes are posted.
        public var endpoint: String?
        /// `certificate`: the receiver's X.509 certificate (PEM or DER).
        public var certificate: String?
        /// `key_id`: the receiver's name for its key.
        public var keyID: String?
        /// `fhir_version` written into envelopes. The default is `1.0.2`.
        public var fhirVersion: String?
        /// `resource_types` to encrypt. The default is every resource.
        public var resourceTypes: [String]?
        /// `mode`: `c3pro` (the default) or `authenticated`.
        public var mode: EnvelopeSealer.Format?
        /// `in_flight`: envelopes sent at once (default 1; more gives up order for the encrypted endpoint).
        public var inFlight: Int?

        /// Empty (every key unset).
        public init() {}
    }

    /// Empty settings (every key unset).
    public init() {}

    /// Applies the `DQ_*` environment variables over the file: `DQ_SERVER`, `DQ_DATABASE`, `DQ_DURABILITY`,
    /// `DQ_IDEMPOTENT`, `DQ_CA_BUNDLE`, `DQ_CA_BUNDLE_ONLY`, `DQ_TOKEN`, `DQ_CLIENT_SECRET`, `DQ_PROXY`,
    /// `DQ_NO_PROXY`, `DQ_CLIENT_CERTIFICATE`, `DQ_CLIENT_KEY`, `DQ_AT_REST_KEY_FILE`, `DQ_AT_REST_OLD_KEY_FILES`
    /// (a comma list); each number setting as `DQ_` and its key (`DQ_TIMEOUT_SECONDS`, `DQ_RETRY_JITTER`, …);
    /// each `auth` key as `DQ_` and the key (`DQ_CLIENT_ID`, `DQ_TOKEN_URI`, `DQ_KEY_ALG`, …, and
    /// `DQ_BEARER_TOKEN_FILE`, `DQ_CLIENT_SECRET_FILE`); each `encryption` key as `DQ_ENCRYPTION_` and the key
    /// (`DQ_ENCRYPTION_ENDPOINT`, `DQ_ENCRYPTION_RESOURCE_TYPES` a comma list, …); `DQ_DATABASE_PASSWORD_FILE`; and the usual `HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY` (see ``environmentNetwork``).
    ///
    /// - Throws: ``DataQueueError`` for a flag that is not a boolean or a number that is not one, naming the
    ///   variable.
    public mutating func apply(environment: [String: String]) throws {
        if let value = environment["DQ_SERVER"] { server = value }
        let formats = "must be \"text\" or \"json\""
        if let format = try Self.choice(environment, "DQ_LOG_FORMAT", formats, { LogFormat(rawValue: $0.lowercased()) }) {
            logFormat = format
        }
        let levels = "must be one of \(Self.logLevels)"
        if let level = try Self.choice(environment, "DQ_LOG_LEVEL", levels, { Logger.Level(rawValue: $0.lowercased()) }) {
            logLevel = level
        }
        if let value = environment["DQ_METRICS_ADDRESS"] { metricsAddress = value }
        for (name, key) in [("DQ_REGISTRATION_FIELDS", "registration_fields"), ("DQ_REGISTRATION_HEADERS", "registration_headers")] {
            guard let text = environment[name] else { continue }
            // A JSON object, as the file's key takes it (a header may carry a registration token: never echoed).
            let wrapped = Data(#"{"\#(key)": \#(text)}"#.utf8)
            guard let decoded = try? JSONDecoder().decode(Auth.self, from: wrapped) else {
                throw Self.configError(
                    "\(name) must be a JSON object of \(key == "registration_fields" ? "strings or booleans" : "strings")")
            }
            auth = auth ?? Auth()
            if key == "registration_fields" {
                auth?.registrationFields = decoded.registrationFields
            } else {
                auth?.registrationHeaders = decoded.registrationHeaders
            }
        }
        if let value = environment["DQ_DATABASE"] { database = value }
        if let value = environment["DQ_DATABASE_PASSWORD_FILE"] { databasePasswordFile = value }
        let durabilities = "must be \"full\" or \"normal\""
        if let value = try Self.choice(environment, "DQ_DURABILITY", durabilities, DataQueue.Durability.init(rawValue:)) {
            durability = value
        }
        if let text = environment["DQ_IDEMPOTENT"] {
            idempotent =
                text.lowercased() == "auto"
                ? .automatic : DataQueue.Idempotence(try Self.flag(text, name: "DQ_IDEMPOTENT", or: "auto"))
        }
        if let value = environment["DQ_CA_BUNDLE"] {
            // Over the file's, whichever of its two names the file used.
            if tls?.caBundle != nil { tls?.caBundle = value } else { caBundle = value }
        }
        if let value = environment["DQ_PROXY"] {
            proxy = value
            proxyFile = nil
        }
        if let value = environment["DQ_PROXY_FILE"] {
            proxyFile = value
            proxy = nil
        }
        if let value = environment["DQ_CLIENT_CERTIFICATE"] {
            tls = tls ?? TLS()
            tls?.clientCertificate = value
        }
        if let value = environment["DQ_CLIENT_KEY"] {
            tls = tls ?? TLS()
            tls?.clientKey = value
        }
        environmentNetwork.apply(environment: environment)
        if let text = environment["DQ_BATCH_SIZE"] {
            let limit = SettingLimits.maximumBatchSize
            guard let value = Int(text.trimmingCharacters(in: .whitespaces)), (1...limit).contains(value) else {
                throw Self.configError("DQ_BATCH_SIZE must be a whole number from 1 to \(limit)")
            }
            batchSize = value
        }
        if let value = environment["DQ_AT_REST_KEY_FILE"] {
            atRest = atRest ?? AtRest()
            atRest?.keyFile = value
        }
        if let value = environment["DQ_AT_REST_OLD_KEY_FILES"] {
            atRest = atRest ?? AtRest()
            atRest?.oldKeyFiles = Self.commaList(value)
        }
        try applyNumbers(environment: environment)
        if let value = environment["DQ_NO_PROXY"] { noProxy = value }
        if let text = environment["DQ_CA_BUNDLE_ONLY"] {
            tls = tls ?? TLS()
            tls?.caBundleOnly = try Self.flag(text, name: "DQ_CA_BUNDLE_ONLY")
        }
        for (name, key) in Self.authTextVariables {
            if let value = environment[name] {
                auth = auth ?? Auth()
                auth?[keyPath: key] = value
            }
        }
        for (name, key) in Self.encryptionTextVariables {
            if let value = environment[name] {
                encryption = encryption ?? Encryption()
                encryption?[keyPath: key] = value
            }
        }
        try applyChoices(environment: environment)
        if let value = environment["DQ_EXTRA_RESOURCE_TYPES"] { extraResourceTypes = Self.commaList(value) }
        if let value = environment["DQ_ENCRYPTION_RESOURCE_TYPES"] {
            encryption = encryption ?? Encryption()
            encryption?.resourceTypes = Self.commaList(value)
        }
        // A secret from the environment replaces the file's, in either of its forms.
        for (name, key, other) in Self.authSecretVariables {
            if let value = environment[name] {
                auth = auth ?? Auth()
                auth?[keyPath: key] = value
                auth?[keyPath: other] = nil
            }
        }
    }

    /// `true`/`false` (or `1`/`0`) in a variable; `or` names a further value the caller takes, for the message.
    private static func flag(_ text: String, name: String, or other: String? = nil) throws -> Bool {
        guard let flag = ["1": true, "true": true, "0": false, "false": false][text.lowercased()] else {
            throw configError("\(name) must be true or false" + (other.map { " (or \($0))" } ?? ""))
        }
        return flag
    }

    /// The settings that are numbers, each with its variable (`DQ_` and the key, upper-case; `retry.` keys as
    /// `DQ_RETRY_…`); the value is checked as the file's is, when the settings are resolved.
    private static let numberVariables: [(name: String, key: any WritableKeyPath<DataQueueSettings, Double?> & Sendable)] = [
        ("DQ_TIMEOUT_SECONDS", \.timeoutSeconds),
        ("DQ_CONNECT_TIMEOUT_SECONDS", \.connectTimeoutSeconds), ("DQ_SETTLE_SECONDS", \.settleSeconds),
        ("DQ_READY_MAX_AGE_SECONDS", \.readyMaxAgeSeconds),
        ("DQ_JOURNAL_RETENTION_DAYS", \.journalRetentionDays), ("DQ_LEASE_SECONDS", \.leaseSeconds),
        ("DQ_POLL_INTERVAL_SECONDS", \.pollIntervalSeconds), ("DQ_DRAIN_TIMEOUT_SECONDS", \.drainTimeoutSeconds),
    ]

    /// The settings that are whole numbers, each with its variable (`DQ_BATCH_SIZE`, with its own check, aside).
    private static let wholeNumberVariables: [(name: String, key: any WritableKeyPath<DataQueueSettings, Int?> & Sendable)] = [
        ("DQ_MAX_RESOURCE_BYTES", \.maxResourceBytes), ("DQ_BATCH_MAX_BYTES", \.batchMaxBytes),
    ]

    /// The log levels, least first, as `log_level` names them.
    package static let logLevels = Logger.Level.allCases.map(\.rawValue).joined(separator: ", ")

    /// How the command line writes its log lines (`log_format`).
    public enum LogFormat: String, Sendable, CaseIterable {
        /// Plain lines (the default); under systemd's journal each starts with its syslog priority.
        case text
        /// One JSON object a line, for log shippers.
        case json
    }

    static var maxResourceBytesError: DataQueueError {
        configError("\"max_resource_bytes\" must be a whole number of bytes from 64 to \(SettingLimits.maximumResourceSizeLimit)")
    }

    static var batchSizeError: DataQueueError {
        configError("\"batch_size\" must be a whole number from 1 to \(SettingLimits.maximumBatchSize)")
    }

    static var batchMaxBytesError: DataQueueError {
        configError("\"batch_max_bytes\" must be a whole number of bytes from 1024 to \(256 << 20)")
    }

    private static let retryVariables: [(name: String, key: any WritableKeyPath<Retry, Double?> & Sendable)] = [
        ("DQ_RETRY_INITIAL_SECONDS", \.initialSeconds), ("DQ_RETRY_MAXIMUM_SECONDS", \.maximumSeconds), ("DQ_RETRY_JITTER", \.jitter),
    ]

    /// The `auth` settings that are text and no secret (secrets come as `DQ_TOKEN`, `DQ_CLIENT_SECRET`,
    /// `DQ_BEARER_TOKEN_FILE` or `DQ_CLIENT_SECRET_FILE`), each with its variable: `DQ_` and the key, upper-case.
    private static let authTextVariables: [(name: String, key: any WritableKeyPath<Auth, String?> & Sendable)] = [
        ("DQ_CLIENT_ID", \.clientID), ("DQ_TOKEN_URI", \.tokenURI), ("DQ_SCOPE", \.scope), ("DQ_ISSUER", \.issuer),
        ("DQ_AUTHORIZE_URI", \.authorizeURI), ("DQ_REVOCATION_URI", \.revocationURI),
        ("DQ_REGISTRATION_URI", \.registrationURI), ("DQ_CLIENT_NAME", \.clientName),
        ("DQ_PRIVATE_KEY", \.privateKey), ("DQ_KEY_ID", \.keyID), ("DQ_CREDENTIALS_DIR", \.credentialsDirectory),
    ]

    /// The `encryption` settings that are text, each with its variable: `DQ_ENCRYPTION_` and the key, upper-case.
    private static let encryptionTextVariables: [(name: String, key: any WritableKeyPath<Encryption, String?> & Sendable)] = [
        ("DQ_ENCRYPTION_ENDPOINT", \.endpoint), ("DQ_ENCRYPTION_CERTIFICATE", \.certificate), ("DQ_ENCRYPTION_KEY_ID", \.keyID),
        ("DQ_ENCRYPTION_FHIR_VERSION", \.fhirVersion),
    ]

    /// The secret variables: each sets one form of a secret (the value, or the file holding it) and clears the
    /// other. In this order, so that with both forms in the environment the value itself wins.
    private static let authSecretVariables:
        [(name: String, key: any WritableKeyPath<Auth, String?> & Sendable, other: any WritableKeyPath<Auth, String?> & Sendable)] = [
            ("DQ_BEARER_TOKEN_FILE", \.bearerTokenFile, \.bearerToken),
            ("DQ_CLIENT_SECRET_FILE", \.clientSecretFile, \.clientSecret),
            ("DQ_TOKEN", \.bearerToken, \.bearerTokenFile),
            ("DQ_CLIENT_SECRET", \.clientSecret, \.clientSecretFile),
        ]

    private mutating func applyNumbers(environment: [String: String]) throws {
        func number(_ name: String) throws -> Double? {
            guard let text = environment[name] else { return nil }
            guard let value = Double(text.trimmingCharacters(in: .whitespaces)), value.isFinite else {
                throw Self.configError("\(name) must be a number")
            }
            return value
        }
        for (name, key) in Self.numberVariables {
            if let value = try number(name) { self[keyPath: key] = value }
        }
        // Whole numbers: their range is checked as the file's is, when the settings are resolved.
        for (name, key) in Self.wholeNumberVariables {
            guard let text = environment[name] else { continue }
            guard let value = Int(text.trimmingCharacters(in: .whitespaces)) else {
                throw Self.configError("\(name) must be a whole number")
            }
            self[keyPath: key] = value
        }
        for (name, key) in Self.retryVariables {
            if let value = try number(name) {
                retry = retry ?? Retry()
                retry?[keyPath: key] = value
            }
        }
        if let text = environment["DQ_ENCRYPTION_IN_FLIGHT"] {
            guard let value = Int(text.trimmingCharacters(in: .whitespaces)) else {
                throw Self.configError("DQ_ENCRYPTION_IN_FLIGHT must be a whole number")
            }
            encryption = encryption ?? Encryption()
            encryption?.inFlight = value
        }
    }

    /// The `auth` and `encryption` settings that name one of a set of values, from their variables.
    private mutating func applyChoices(environment: [String: String]) throws {
        func choice<T>(_ name: String, _ what: String, _ parse: (String) -> T?) throws -> T? {
            try Self.choice(environment, name, what, parse)
        }
        if let value = try choice("DQ_AUTHORIZE_TYPE", Self.authorizeTypeError, Auth.AuthorizeType.init(rawValue:)) {
            auth = auth ?? Auth()
            auth?.authorizeType = value
        }
        if let value = try choice(
            "DQ_TOKEN_ENDPOINT_AUTH_METHOD", Self.authMethodError, OAuth2Configuration.TokenEndpointAuthMethod.init(rawValue:))
        {
            auth = auth ?? Auth()
            auth?.tokenEndpointAuthMethod = value
        }
        if let value = try choice(
            "DQ_KEY_ALG", Self.keyAlgorithmError, { OAuth2Configuration.ClientAssertionKey.Algorithm(rawValue: $0.uppercased()) })
        {
            auth = auth ?? Auth()
            auth?.keyAlgorithm = value
        }
        if let value = try choice("DQ_ENCRYPTION_MODE", "must be \"c3pro\" or \"authenticated\"", EnvelopeSealer.Format.init(rawValue:)) {
            encryption = encryption ?? Encryption()
            encryption?.mode = value
        }
    }

    /// The value of variable `name` as `parse` reads it (nil when unset); a value it does not read is an error
    /// saying the variable `what`.
    private static func choice<T>(_ environment: [String: String], _ name: String, _ what: String, _ parse: (String) -> T?) throws
        -> T?
    {
        guard let text = environment[name] else { return nil }
        guard let value = parse(text) else { throw configError("\(name) \(what)") }
        return value
    }

    static let authorizeTypeError = "must be \"client_credentials\" or \"authorization_code\""
    static let authMethodError = "must be client_secret_basic, client_secret_post, none or private_key_jwt"
    static let keyAlgorithmError = "must be RS256, RS384, ES256 or ES384"
    static var inFlightError: DataQueueError { configError("\"encryption.in_flight\" must be a whole number from 1 to 64") }

    /// The names of a comma list in a variable, trimmed, empty ones left out.
    private static func commaList(_ text: String) -> [String] {
        text.split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
    }

    /// The journal retention in seconds (`journal_retention_days`, 90 by default); nil keeps every line.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) for a negative or non-finite number of days.
    package func journalRetention() throws -> TimeInterval? {
        let days = journalRetentionDays ?? 90
        guard days.isFinite, days >= 0, days <= 36_500 else {
            throw Self.configError("\"journal_retention_days\" must be a number of days from 0 (keep every line) to 36500")
        }
        return days == 0 ? nil : days * 86_400
    }

    /// Every `DQ_…` environment variable dq reads (the library's and the command line's).
    package static let environmentVariables: Set<String> = Set(
        [
            "DQ_SERVER", "DQ_DATABASE", "DQ_DURABILITY", "DQ_IDEMPOTENT", "DQ_CA_BUNDLE", "DQ_PROXY",
            "DQ_CLIENT_CERTIFICATE", "DQ_CLIENT_KEY", "DQ_BATCH_SIZE", "DQ_TOKEN",
            "DQ_CLIENT_SECRET", "DQ_CONFIG", "DQ_LOG_LEVEL", "DQ_LOG_FORMAT", "DQ_AT_REST_KEY_FILE",
            "DQ_AT_REST_OLD_KEY_FILES", "DQ_NO_PROXY", "DQ_CA_BUNDLE_ONLY", "DQ_PROXY_FILE", "DQ_BEARER_TOKEN_FILE",
            "DQ_CLIENT_SECRET_FILE", "DQ_DATABASE_PASSWORD_FILE", "DQ_ENCRYPTION_RESOURCE_TYPES", "DQ_ENCRYPTION_IN_FLIGHT",
            "DQ_METRICS_ADDRESS", "DQ_REGISTRATION_FIELDS", "DQ_REGISTRATION_HEADERS", "DQ_AUTHORIZE_TYPE",
            "DQ_TOKEN_ENDPOINT_AUTH_METHOD", "DQ_KEY_ALG", "DQ_ENCRYPTION_MODE", "DQ_EXTRA_RESOURCE_TYPES",
        ] + numberVariables.map(\.name) + wholeNumberVariables.map(\.name) + retryVariables.map(\.name) + authTextVariables.map(\.name)
            + encryptionTextVariables.map(\.name))

    /// `DQ_…` names that dq's own make targets and scripts export for its tests, torture and benchmarks (and
    /// `DQ_TEST_…`): not dq settings, and not misspellings of one.
    package static let toolingVariables: Set<String> = [
        "DQ_BIN", "DQ_GATEWAY_BIN", "DQ_BENCH_BIN", "DQ_REQUIRE_PEERS", "DQ_SANITIZER", "DQ_PEERS_VENV", "DQ_GENERATOR_VENV",
    ]

    /// The `DQ_…` names in `environment` that dq does not read (a misspelt `DQ_SEVER` would otherwise be
    /// ignored without a word), sorted, each with the known name it most likely meant, if one is close.
    package static func unknownEnvironmentVariables(in environment: [String: String]) -> [(name: String, suggestion: String?)] {
        environment.keys.filter {
            $0.hasPrefix("DQ_") && !environmentVariables.contains($0) && !toolingVariables.contains($0) && !$0.hasPrefix("DQ_TEST_")
        }.sorted().map { name in
            let nearest = environmentVariables.map { ($0, editDistance(name, $0)) }.min { ($0.1, $0.0) < ($1.1, $1.0) }
            return (name, nearest.flatMap { $0.1 <= 2 ? $0.0 : nil })
        }
    }

    /// Levenshtein distance between two short ASCII names.
    private static func editDistance(_ a: String, _ b: String) -> Int {
        let a = Array(a.utf8), b = Array(b.utf8)
        var row = Array(0...b.count)
        for i in 1...max(a.count, 1) where !a.isEmpty {
            var previous = row[0]
            row[0] = i
            for j in 1...max(b.count, 1) where !b.isEmpty {
                let substitution = previous + (a[i - 1] == b[j - 1] ? 0 : 1)
                previous = row[j]
                row[j] = min(substitution, row[j] + 1, row[j - 1] + 1)
            }
        }
        return row[b.count]
    }

    /// Reads a settings file with `decode` and records where it came from: its directory (relative paths in
    /// it are relative to that), its path, and whether it holds a secret. The one reading of a settings file,
    /// for ``load(contentsOf:)`` and the command line.
    package static func load(contentsOf path: String, decode: (Data) throws -> DataQueueSettings) throws -> DataQueueSettings {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw configError("cannot read the config file \(path)")
        }
        var settings = try decode(data)
        // The directory of the file as named from the working directory (`dq.json` alone names no directory, and
        // its relative paths would otherwise be read from `/`).
        let absolute = path.hasPrefix("/") ? path : FileManager.default.currentDirectoryPath + "/" + path
        settings.baseDirectory = QueuePaths.directory(of: absolute)
        settings.sourcePath = path
        settings.fileHoldsSecret =
            settings.auth?.bearerToken != nil || settings.auth?.clientSecret != nil
            || settings.database.flatMap { URLComponents(string: $0)?.password } != nil
            || settings.proxy.flatMap { NetworkConfiguration.components($0)?.password } != nil
        return settings
    }

    /// The settings of one `dq` run: the config file (`config`, else `$DQ_CONFIG`, else the first of
    /// ``configSearchPath(environment:)`` that exists, read with `decode`) with its `…_file` secrets, then the `DQ_*` environment variables, then the `--server` and `--database` flags.
    package static func load(
        config: String?, server: String?, database: String?, environment: [String: String],
        decode: (Data, String) throws -> DataQueueSettings
    ) throws -> DataQueueSettings {
        let configPath =
            config ?? environment["DQ_CONFIG"]
            ?? configSearchPath(environment: environment).first {
                FileManager.default.fileExists(atPath: $0)
            }
        var settings = try configPath.map { path in try load(contentsOf: path) { try decode($0, path) } } ?? DataQueueSettings()
        // The environment first: a `DQ_…_FILE` names a file to read, and a `DQ_TOKEN` replaces the file's one.
        try settings.apply(environment: environment)
        try settings.readSecretFiles(environment: environment)
        settings.noteExposedKeyFiles(environment: environment)
        if let server { settings.server = server }
        if let database { settings.database = database }
        try settings.applyDatabasePassword()
        return settings
    }

    /// Where dq looks for its config file when neither `--config` nor `$DQ_CONFIG` names one, in order:
    /// `./dq.json`, `$XDG_CONFIG_HOME/dq/dq.json` (else `~/.config/dq/dq.json`), `/etc/dq/dq.json`.
    package static func configSearchPath(environment: [String: String]) -> [String] {
        var paths = ["dq.json"]
        if let xdg = environment["XDG_CONFIG_HOME"], xdg.hasPrefix("/") {
            paths.append(xdg + "/dq/dq.json")
        } else if let home = environment["HOME"], !home.isEmpty {
            paths.append(home + "/.config/dq/dq.json")
        }
        paths.append("/etc/dq/dq.json")
        return paths
    }

    /// Where a `…_file` secret is: an absolute path as given; a relative one in `$CREDENTIALS_DIRECTORY`
    /// (systemd's `LoadCredential=`) when that is set, else beside the config file.
    package func secretFilePath(_ name: String, environment: [String: String]) -> String {
        if !name.hasPrefix("/"), let credentials = environment["CREDENTIALS_DIRECTORY"], !credentials.isEmpty {
            return credentials + "/" + name
        }
        return inBaseDirectory(name)
    }

    /// Where a key or certificate file of the settings is (`tls.client_certificate`, `tls.client_key`,
    /// `auth.private_key`): an absolute path as given; a relative one in `$CREDENTIALS_DIRECTORY` (systemd's
    /// `LoadCredential=`) when that is set and holds it, else beside the config file.
    package func keyFilePath(_ name: String, environment: [String: String] = ProcessInfo.processInfo.environment) -> String {
        if !name.hasPrefix("/"), let credentials = environment["CREDENTIALS_DIRECTORY"], !credentials.isEmpty,
            FileManager.default.fileExists(atPath: credentials + "/" + name)
        {
            return credentials + "/" + name
        }
        return inBaseDirectory(name)
    }

    /// Reads `auth.bearer_token_file`, `auth.client_secret_file`, `proxy_file` and `database_password_file` into
    /// the secrets they hold
    /// (without a trailing newline), and remembers which secret files others can read (``exposedSecretFiles``).
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the setting of a file that cannot be read
    ///   or is empty, never its content.
    package mutating func readSecretFiles(environment: [String: String]) throws {
        func read(_ name: String, key: String) throws -> String {
            let path = secretFilePath(name, environment: environment)
            guard let data = FileManager.default.contents(atPath: path) else {
                throw Self.configError("cannot read \"\(key)\" (\(path))")
            }
            var text = String(decoding: data, as: UTF8.self)
            // Line ends dropped one scalar at a time: "\r\n" is one Character.
            while let last = text.unicodeScalars.last, last == "\n" || last == "\r" { text.unicodeScalars.removeLast() }
            guard !text.isEmpty else { throw Self.configError("\"\(key)\" (\(path)) is empty") }
            if FilePermissions.exposedMode(path) != nil {
                exposedSecretFiles.append(path)
            }
            return text
        }
        if let name = auth?.bearerTokenFile {
            let token = try read(name, key: "auth.bearer_token_file")
            auth?.bearerToken = token
        }
        if let name = auth?.clientSecretFile {
            let secret = try read(name, key: "auth.client_secret_file")
            auth?.clientSecret = secret
        }
        if let name = proxyFile {
            proxy = try read(name, key: "proxy_file")
        }
        if let name = databasePasswordFile {
            databasePassword = try read(name, key: "database_password_file")
        }
    }

    /// Puts the password `database_password_file` holds into the `database` URL (once every source of
    /// `database` has been applied). A `database` that is no PostgreSQL URL keeps ``databasePassword`` set: the
    /// command line warns that the file is not used, and `dq migrate --to` uses it for its PostgreSQL target.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when the `database` URL has a password of its own.
    package mutating func applyDatabasePassword() throws {
        guard databasePassword != nil, let database, QueuePaths.isPostgresURL(database) else { return }
        guard URLComponents(string: database)?.password == nil else {
            throw Self.configError("\"database\" holds a password and \"database_password_file\" names one: keep one")
        }
        self.database = withDatabasePassword(database)
        databasePassword = nil
    }

    /// `url` with the password `database_password_file` holds, when it is a PostgreSQL URL without one.
    package func withDatabasePassword(_ url: String) -> String {
        guard let password = databasePassword, QueuePaths.isPostgresURL(url), var components = URLComponents(string: url),
            components.password == nil
        else { return url }
        if components.user == nil { components.user = "" }
        components.password = password
        return components.string ?? url
    }

    /// Adds the at-rest key files (from the file or `DQ_AT_REST_KEY_FILE`) that others than their owner can read
    /// to ``exposedSecretFiles``; the keys themselves are read when the settings are resolved.
    package mutating func noteExposedKeyFiles(environment: [String: String]) {
        for name in [atRest?.keyFile].compactMap({ $0 }) + (atRest?.oldKeyFiles ?? []) {
            let path = secretFilePath(name, environment: environment)
            if FilePermissions.exposedMode(path) != nil {
                exposedSecretFiles.append(path)
            }
        }
    }

    /// The TLS files the settings name (CA bundle, client certificate and key) as they are on disk now: another
    /// value once one is replaced or rewritten (a rotated key), which a reload reports and the HTTP clients follow.
    package func tlsFiles() -> [Int64] {
        (try? checkedValues()).map { HTTPClients.stamp($0.network) } ?? []
    }

    /// The settings' plain values (everything but `auth` and `encryption`), each checked, in the order
    /// ``resolve()`` checks them: the first bad one is named.

    package struct CheckedValues: Sendable {
        package var server: URL
        package var queueName: String
        package var database: String?
        package var durability: DataQueue.Durability?
        package var maximumResourceSize: Int?
        package var batchSize: Int?
        package var batchMaxBytes: Int?
        package var requestTimeout: Double?
        package var connectTimeout: Double?
        package var leaseDuration: Double?
        package var settleDelay: Double?
        package var retryInitialDelay: Double?
        package var retryMaximumDelay: Double?
        package var retryJitter: Double?
        package var caBundlePath: String?
        package var network = NetworkConfiguration()
    }

    /// Checks the plain values: a server URL dq can name a queue by, a database path, sizes and durations in
    /// range, a readable CA bundle.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key of the first bad value.
    package func checkedValues() throws -> CheckedValues {
        guard let serverText = server, !serverText.isEmpty else {
            throw Self.configError("\"server\" is missing (set it in the config file, DQ_SERVER or --server)")
        }
        guard let serverURL = URL(string: serverText) else {
            throw Self.configError("\"server\" must be an http(s) URL with a host")
        }
        let queueName: String
        do {
            queueName = try QueuePaths.queueName(for: serverURL, setting: "\"server\"")
        } catch let error as DataQueueError {
            throw Self.configError(error.message)
        }
        var values = CheckedValues(server: serverURL, queueName: queueName)
        if let database {
            try Self.checked { try SettingLimits.checkDatabasePath(database, name: "\"database\"") }
            values.database = database
        }

        values.durability = durability
        if let value = maxResourceBytes {
            guard (64...SettingLimits.maximumResourceSizeLimit).contains(value) else { throw Self.maxResourceBytesError }
            values.maximumResourceSize = value
        }
        if let value = batchSize {
            guard (1...SettingLimits.maximumBatchSize).contains(value) else { throw Self.batchSizeError }
            values.batchSize = value
        }
        if let value = batchMaxBytes {
            guard (1024...(256 << 20)).contains(value) else { throw Self.batchMaxBytesError }
            values.batchMaxBytes = value
        }
        values.requestTimeout = try Self.seconds(timeoutSeconds, "timeout_seconds", allowZero: false)
        values.connectTimeout = try Self.seconds(connectTimeoutSeconds, "connect_timeout_seconds", allowZero: false)
        if let value = try Self.seconds(leaseSeconds, "lease_seconds", allowZero: false) {
            guard value >= 1 else { throw Self.configError("\"lease_seconds\" must be at least 1") }
            values.leaseDuration = value
        }
        values.settleDelay = try Self.seconds(settleSeconds, "settle_seconds", allowZero: true)
        _ = try Self.seconds(pollIntervalSeconds, "poll_interval_seconds", allowZero: false)
        _ = try Self.seconds(drainTimeoutSeconds, "drain_timeout_seconds", allowZero: true)
        _ = try Self.seconds(readyMaxAgeSeconds, "ready_max_age_seconds", allowZero: false)
        if let metricsAddress, Self.metricsAddress(metricsAddress) == nil {
            throw Self.configError("\"metrics_address\" is \(metricsAddress): \(Self.metricsAddressForm)")
        }
        if let retry {
            values.retryInitialDelay = try Self.seconds(retry.initialSeconds, "retry.initial_seconds", allowZero: true)
            values.retryMaximumDelay = try Self.seconds(retry.maximumSeconds, "retry.maximum_seconds", allowZero: true)
            let defaults = RetryPolicy()
            let initial = values.retryInitialDelay ?? defaults.initialDelay
            let maximum = values.retryMaximumDelay ?? defaults.maximumDelay
            if initial > maximum {
                func shown(_ seconds: Double) -> String { seconds == seconds.rounded() ? "\(Int(seconds))" : "\(seconds)" }
                throw Self.configError(
                    "\"retry.initial_seconds\" (\(shown(initial))) is more than \"retry.maximum_seconds\" (\(shown(maximum))\(values.retryMaximumDelay == nil ? ", the default" : "")): the first delay cannot be longer than the longest"
                )
            }
            if let value = retry.jitter {
                guard value.isFinite, (0...1).contains(value) else {
                    throw Self.configError("\"retry.jitter\" must be between 0 and 1")
                }
                values.retryJitter = value
            }
        }
        if caBundle != nil && tls?.caBundle != nil {
            throw Self.configError("\"ca_bundle\" and \"tls.ca_bundle\" are the same setting: give one")
        }
        if let path = caBundle ?? tls?.caBundle {
            let path = inBaseDirectory(path)
            guard FileManager.default.isReadableFile(atPath: path) else {
                throw Self.configError("\"ca_bundle\" file \(path) cannot be read")
            }
            values.caBundlePath = path
        }
        values.network = try checkedNetwork(caBundle: values.caBundlePath)
        return values
    }

    /// The network settings: the environment's proxies, then `proxy` and `no_proxy`; `tls`.
    private func checkedNetwork(caBundle: String?) throws -> NetworkConfiguration {
        var network = environmentNetwork
        if let proxy {
            network.httpsProxy = proxy.isEmpty ? nil : proxy
            network.httpProxy = proxy.isEmpty ? nil : proxy
        }
        if let noProxy { network.noProxy = noProxy }
        for proxy in Set([network.httpsProxy, network.httpProxy].compactMap { $0 }) {
            try Self.checked { _ = try HTTPClients.proxy(proxy) }
        }
        network.caBundlePath = caBundle
        network.caBundleOnly = tls?.caBundleOnly ?? false
        if network.caBundleOnly && caBundle == nil {
            throw Self.configError("\"tls.ca_bundle_only\" needs \"ca_bundle\"")
        }
        switch (tls?.clientCertificate, tls?.clientKey) {
        case (nil, nil):
            break
        case (let certificate?, let key?):
            for (path, name) in [(certificate, "tls.client_certificate"), (key, "tls.client_key")] {
                guard FileManager.default.isReadableFile(atPath: keyFilePath(path)) else {
                    throw Self.configError("\"\(name)\" file \(keyFilePath(path)) cannot be read")
                }
            }
            network.clientCertificatePath = keyFilePath(certificate)
            network.clientKeyPath = keyFilePath(key)
        default:
            throw Self.configError("\"tls.client_certificate\" and \"tls.client_key\" go together")
        }
        return network
    }

    /// What `metrics_address` and `--metrics-address` take, for their errors.
    package static let metricsAddressForm =
        "it must be HOST:PORT, [IPv6]:PORT or PORT, the port a whole number from 0 to 65535 (0: any free port)"

    /// `HOST:PORT` (`[v6]:PORT`) or a bare port (on loopback) as `metrics_address` and `--metrics-address` take
    /// it; nil when it is neither.
    package static func metricsAddress(_ text: String) -> (host: String, port: Int)? {
        if let port = Int(text), (0...65535).contains(port) { return ("127.0.0.1", port) }
        guard let colon = text.lastIndex(of: ":"), let port = Int(text[text.index(after: colon)...]),
            (0...65535).contains(port)
        else { return nil }
        var host = String(text[..<colon])
        if host.hasPrefix("[") && host.hasSuffix("]") { host = String(host.dropFirst().dropLast()) }
        return host.isEmpty ? nil : (host, port)
    }

    /// `path`, relative to the settings file's directory when it is relative.
    package func inBaseDirectory(_ path: String) -> String {
        guard !path.hasPrefix("/"), let baseDirectory else { return path }
        return baseDirectory.hasSuffix("/") ? baseDirectory + path : baseDirectory + "/" + path
    }

    package static func configError(_ message: String) -> DataQueueError {
        DataQueueError(.invalidConfiguration, "configuration: \(message)")
    }

    private static func checked(_ body: () throws -> Void) throws {
        do {
            try body()
        } catch let error as DataQueueError {
            throw configError(error.message)
        }
    }

    private static func seconds(_ value: Double?, _ key: String, allowZero: Bool) throws -> Double? {
        guard let value else { return nil }
        try checked { try SettingLimits.checkSeconds(value, name: "\"\(key)\"", allowZero: allowZero) }
        return value
    }

    // MARK: - Decoding

    private enum CodingKeys: String, CodingKey, CaseIterable {
        case server, database, durability, idempotent, retry, auth, encryption
        case databasePasswordFile = "database_password_file"
        case atRest = "at_rest"
        case maxResourceBytes = "max_resource_bytes"
        case extraResourceTypes = "extra_resource_types"
        case timeoutSeconds = "timeout_seconds"
        case connectTimeoutSeconds = "connect_timeout_seconds"
        case settleSeconds = "settle_seconds"
        case leaseSeconds = "lease_seconds"
        case caBundle = "ca_bundle"
        case proxy, tls
        case noProxy = "no_proxy"
        case proxyFile = "proxy_file"
        case batchSize = "batch_size"
        case batchMaxBytes = "batch_max_bytes"
        case readyMaxAgeSeconds = "ready_max_age_seconds"
        case logFormat = "log_format"
        case logLevel = "log_level"
        case metricsAddress = "metrics_address"
        case pollIntervalSeconds = "poll_interval_seconds"
        case drainTimeoutSeconds = "drain_timeout_seconds"
        case journalRetentionDays = "journal_retention_days"
    }

    /// Decodes the file's object, refusing unknown keys and naming the key of a wrong type.
    public init(from decoder: any Decoder) throws {
        try SettingsKeys.refuseUnknown(decoder, CodingKeys.self)
        let container = try decoder.container(keyedBy: CodingKeys.self)
        server = try SettingsKeys.value(container, .server, "must be a string")
        database = try SettingsKeys.value(container, .database, "must be a string")
        databasePasswordFile = try SettingsKeys.value(container, .databasePasswordFile, "must be a string (a file holding the password)")
        durability = try SettingsKeys.choice(container, .durability, "must be \"full\" or \"normal\"") {
            DataQueue.Durability(rawValue: $0)
        }
        if let flag: Bool = try? container.decodeIfPresent(Bool.self, forKey: .idempotent) {
            idempotent = DataQueue.Idempotence(flag)
        } else {
            idempotent = try SettingsKeys.choice(container, .idempotent, "must be true, false or \"auto\"") {
                $0.lowercased() == "auto" ? .automatic : nil
            }
        }
        maxResourceBytes = try SettingsKeys.wholeNumber(container, .maxResourceBytes, Self.maxResourceBytesError)
        extraResourceTypes = try SettingsKeys.value(container, .extraResourceTypes, "must be a list of resource type names")
        timeoutSeconds = try SettingsKeys.value(container, .timeoutSeconds, "must be a number")
        connectTimeoutSeconds = try SettingsKeys.value(container, .connectTimeoutSeconds, "must be a number")
        settleSeconds = try SettingsKeys.value(container, .settleSeconds, "must be a number")
        leaseSeconds = try SettingsKeys.value(container, .leaseSeconds, "must be a number")
        batchSize = try SettingsKeys.wholeNumber(container, .batchSize, Self.batchSizeError)
        batchMaxBytes = try SettingsKeys.wholeNumber(container, .batchMaxBytes, Self.batchMaxBytesError)
        readyMaxAgeSeconds = try SettingsKeys.value(container, .readyMaxAgeSeconds, "must be a number of seconds")
        logFormat = try SettingsKeys.choice(container, .logFormat, "must be \"text\" or \"json\"") {
            LogFormat(rawValue: $0.lowercased())
        }
        logLevel = try SettingsKeys.choice(container, .logLevel, "must be one of \(Self.logLevels)") {
            Logger.Level(rawValue: $0.lowercased())
        }
        metricsAddress = try SettingsKeys.value(container, .metricsAddress, "must be a string (HOST:PORT, or a port)")
        pollIntervalSeconds = try SettingsKeys.value(container, .pollIntervalSeconds, "must be a number of seconds")
        drainTimeoutSeconds = try SettingsKeys.value(container, .drainTimeoutSeconds, "must be a number of seconds")
        journalRetentionDays = try SettingsKeys.value(container, .journalRetentionDays, "must be a number of days")
        retry = try SettingsKeys.value(container, .retry, "must be an object")
        caBundle = try SettingsKeys.value(container, .caBundle, "must be a string")
        proxy = try SettingsKeys.value(container, .proxy, "must be a string (http://host:port)")
        proxyFile = try SettingsKeys.value(container, .proxyFile, "must be a string (a file holding the proxy URL)")
        if proxy != nil && proxyFile != nil {
            throw SettingsKeys.typeError(decoder.codingPath + [CodingKeys.proxyFile], "and proxy exclude each other")
        }
        noProxy = try SettingsKeys.value(container, .noProxy, "must be a string (a comma-separated list of hosts)")
        tls = try SettingsKeys.value(container, .tls, "must be an object")
        auth = try SettingsKeys.value(container, .auth, "must be an object")
        encryption = try SettingsKeys.value(container, .encryption, "must be an object")
        atRest = try SettingsKeys.value(container, .atRest, "must be an object")
    }
}

extension DataQueueSettings.AtRest {
    private enum CodingKeys: String, CodingKey, CaseIterable {
        case keyFile = "key_file"
        case oldKeyFiles = "old_key_files"
    }

    /// Decodes the `at_rest` object, refusing unknown keys.
    public init(from decoder: any Decoder) throws {
        try SettingsKeys.refuseUnknown(decoder, CodingKeys.self)
        let container = try decoder.container(keyedBy: CodingKeys.self)
        keyFile = try SettingsKeys.value(container, .keyFile, "must be a string (a key file)")
        oldKeyFiles = try SettingsKeys.value(container, .oldKeyFiles, "must be a list of key files")
    }
}

extension DataQueueSettings.Retry {
    private enum CodingKeys: String, CodingKey, CaseIterable {
        case initialSeconds = "initial_seconds"
        case maximumSeconds = "maximum_seconds"
        case jitter
    }

    /// Decodes the `retry` object, refusing unknown keys.
    public init(from decoder: any Decoder) throws {
        try SettingsKeys.refuseUnknown(decoder, CodingKeys.self)
        let container = try decoder.container(keyedBy: CodingKeys.self)
        initialSeconds = try SettingsKeys.value(container, .initialSeconds, "must be a number")
        maximumSeconds = try SettingsKeys.value(container, .maximumSeconds, "must be a number")
        jitter = try SettingsKeys.value(container, .jitter, "must be a number")
    }
}

extension DataQueueSettings.Auth {
    private enum CodingKeys: String, CodingKey, CaseIterable {
        case scope
        case bearerToken = "bearer_token"
        case clientID = "client_id"
        case clientSecret = "client_secret"
        case bearerTokenFile = "bearer_token_file"
        case clientSecretFile = "client_secret_file"
        case authorizeURI = "authorize_uri"
        case tokenURI = "token_uri"
        case authorizeType = "authorize_type"
        case issuer
        case revocationURI = "revocation_uri"
        case registrationURI = "registration_uri"
        case clientName = "client_name"
        case tokenEndpointAuthMethod = "token_endpoint_auth_method"
        case privateKey = "private_key"
        case keyID = "key_id"
        case keyAlgorithm = "key_alg"
        case registrationFields = "registration_fields"
        case registrationHeaders = "registration_headers"
        case credentialsDirectory = "credentials_dir"
    }

    /// Decodes the `auth` object, refusing unknown keys.
    public init(from decoder: any Decoder) throws {
        try SettingsKeys.refuseUnknown(decoder, CodingKeys.self)
        let container = try decoder.container(keyedBy: CodingKeys.self)
        let string = "must be a string"
        bearerToken = try SettingsKeys.value(container, .bearerToken, string)
        clientID = try SettingsKeys.value(container, .clientID, string)
        clientSecret = try SettingsKeys.value(container, .clientSecret, string)
        bearerTokenFile = try SettingsKeys.value(container, .bearerTokenFile, string)
        clientSecretFile = try SettingsKeys.value(container, .clientSecretFile, string)
        if bearerToken != nil && bearerTokenFile != nil {
            throw SettingsKeys.typeError(decoder.codingPath + [CodingKeys.bearerTokenFile], "and bearer_token exclude each other")
        }
        if clientSecret != nil && clientSecretFile != nil {
            throw SettingsKeys.typeError(decoder.codingPath + [CodingKeys.clientSecretFile], "and client_secret exclude each other")
        }
        authorizeURI = try SettingsKeys.value(container, .authorizeURI, string)
        tokenURI = try SettingsKeys.value(container, .tokenURI, string)
        authorizeType = try SettingsKeys.choice(container, .authorizeType, DataQueueSettings.authorizeTypeError) {
            AuthorizeType(rawValue: $0)
        }
        issuer = try SettingsKeys.value(container, .issuer, string)
        revocationURI = try SettingsKeys.value(container, .revocationURI, string)
        registrationURI = try SettingsKeys.value(container, .registrationURI, string)
        clientName = try SettingsKeys.value(container, .clientName, string)
        scope = try SettingsKeys.value(container, .scope, string)
        tokenEndpointAuthMethod = try SettingsKeys.choice(container, .tokenEndpointAuthMethod, DataQueueSettings.authMethodError) {
            OAuth2Configuration.TokenEndpointAuthMethod(rawValue: $0)
        }
        privateKey = try SettingsKeys.value(container, .privateKey, string)
        keyID = try SettingsKeys.value(container, .keyID, string)
        keyAlgorithm = try SettingsKeys.choice(container, .keyAlgorithm, DataQueueSettings.keyAlgorithmError) {
            OAuth2Configuration.ClientAssertionKey.Algorithm(rawValue: $0.uppercased())
        }
        registrationFields = try SettingsKeys.value(container, .registrationFields, "must be an object")
        registrationHeaders = try SettingsKeys.value(container, .registrationHeaders, "must be an object of strings")
        credentialsDirectory = try SettingsKeys.value(container, .credentialsDirectory, string)
    }
}

extension DataQueueSettings.TLS {
    private enum CodingKeys: String, CodingKey, CaseIterable {
        case clientCertificate = "client_certificate"
        case clientKey = "client_key"
        case caBundle = "ca_bundle"
        case caBundleOnly = "ca_bundle_only"
    }

    /// Decodes the `tls` object, refusing unknown keys.
    public init(from decoder: any Decoder) throws {
        try SettingsKeys.refuseUnknown(decoder, CodingKeys.self)
        let container = try decoder.container(keyedBy: CodingKeys.self)
        clientCertificate = try SettingsKeys.value(container, .clientCertificate, "must be a string (a PEM file)")
        clientKey = try SettingsKeys.value(container, .clientKey, "must be a string (a PEM file)")
        caBundle = try SettingsKeys.value(container, .caBundle, "must be a string (a PEM file)")
        caBundleOnly = try SettingsKeys.value(container, .caBundleOnly, "must be true or false")
    }
}

extension DataQueueSettings.Encryption {
    private enum CodingKeys: String, CodingKey, CaseIterable {
        case endpoint, certificate, mode
        case inFlight = "in_flight"
        case keyID = "key_id"
        case fhirVersion = "fhir_version"
        case resourceTypes = "resource_types"
    }

    /// Decodes the `encryption` object, refusing unknown keys.
    public init(from decoder: any Decoder) throws {
        try SettingsKeys.refuseUnknown(decoder, CodingKeys.self)
        let container = try decoder.container(keyedBy: CodingKeys.self)
        let string = "must be a non-empty string"
        endpoint = try SettingsKeys.value(container, .endpoint, string)
        certificate = try SettingsKeys.value(container, .certificate, string)
        keyID = try SettingsKeys.value(container, .keyID, string)
        fhirVersion = try SettingsKeys.value(container, .fhirVersion, string)
        resourceTypes = try SettingsKeys.value(
            container, .resourceTypes, "must be a non-empty list of resource type names")
        mode = try SettingsKeys.choice(container, .mode, "must be \"c3pro\" or \"authenticated\"") { EnvelopeSealer.Format(rawValue: $0) }
        inFlight = try SettingsKeys.wholeNumber(container, .inFlight, DataQueueSettings.inFlightError)
    }
}

/// Decoding helpers that name keys the way the file writes them (`"retry.initial_seconds"`).
package enum SettingsKeys {
    struct AnyKey: CodingKey {
        var stringValue: String
        var intValue: Int? { nil }
        init(stringValue: String) { self.stringValue = stringValue }
        init?(intValue: Int) { nil }
    }

    /// The dotted name of a coding path.
    package static func name(_ path: [any CodingKey]) -> String {
        "\"" + path.filter { $0.intValue == nil }.map(\.stringValue).joined(separator: ".") + "\""
    }

    static func typeError(_ path: [any CodingKey], _ what: String) -> DataQueueError {
        DataQueueSettings.configError("\(name(path)) \(what)")
    }

    /// Throws for the first key of the object that `Keys` does not name.
    static func refuseUnknown<Keys: CodingKey & CaseIterable>(_ decoder: any Decoder, _ keys: Keys.Type) throws {
        let container: KeyedDecodingContainer<AnyKey>
        do {
            container = try decoder.container(keyedBy: AnyKey.self)
        } catch {
            let path = decoder.codingPath
            if path.isEmpty { throw error }
            throw typeError(path, "must be an object")
        }
        let known = Set(Keys.allCases.map(\.stringValue))
        for key in container.allKeys.sorted(by: { $0.stringValue < $1.stringValue }) where !known.contains(key.stringValue) {
            throw DataQueueSettings.configError("unknown key \(name(decoder.codingPath + [key]))")
        }
    }

    /// Decodes an optional member that names one of a set of values (`parse` gives nil for any other), naming it
    /// with `what` when it is not one of them.
    static func choice<T, Keys: CodingKey>(
        _ container: KeyedDecodingContainer<Keys>, _ key: Keys, _ what: String, _ parse: (String) -> T?
    ) throws -> T? {
        guard let text: String = try value(container, key, what) else { return nil }
        guard let parsed = parse(text) else {
            // The value is a name from a short list, never a secret: saying which one was given helps.
            throw typeError(container.codingPath + [key], "\(what), not \"\(text.prefix(40))\"")
        }
        return parsed
    }

    /// Decodes an optional member that must be a whole number (written as `1000` or `1000.0`), throwing `error`
    /// (which says the range) when it is not one.
    static func wholeNumber<Keys: CodingKey>(
        _ container: KeyedDecodingContainer<Keys>, _ key: Keys, _ error: DataQueueError
    ) throws -> Int? {
        guard let number: Double = try value(container, key, "must be a number") else { return nil }
        guard number.isFinite, number.rounded() == number, abs(number) < 1e15 else { throw error }
        return Int(number)
    }

    /// Decodes an optional member, naming it with `what` when its type is wrong.
    static func value<T: Decodable, Keys: CodingKey>(
        _ container: KeyedDecodingContainer<Keys>, _ key: Keys, _ what: String
    ) throws -> T? {
        do {
            return try container.decodeIfPresent(T.self, forKey: key)
        } catch let error as DataQueueError {
            throw error
        } catch {
            throw typeError(container.codingPath + [key], what)
        }
    }
}
