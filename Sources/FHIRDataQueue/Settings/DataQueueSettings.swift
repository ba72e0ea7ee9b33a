import Configuration
import Foundation
import NIOConcurrencyHelpers

/// The settings of `dq.json`, its `DQ_` variables and the command line's flags, as one `ConfigReader` gives them
/// (see ``SettingsReader``): each key as it was given, before ``resolve()`` checks the values and builds the
/// queue's pieces. The library's public way in is ``DataQueue/Configuration/init(reader:)`` and the auth
/// configurations' `init(reader:)`; this value is what they, `dq` and its tests share.
///
/// Every error is a ``DataQueueError`` with code `.invalidConfiguration` and a message that starts with
/// `configuration:` and names the key (or the variable), never its secret value.
package struct DataQueueSettings: Sendable {
    /// `server`: the FHIR base URL.
    package var server: String?
    /// `database`: the queue's SQLite file or PostgreSQL URL. The default is ``DataQueue/defaultDatabasePath(environment:)``.
    package var database: String?
    /// `database_password_file`: a file holding the PostgreSQL password, for a `database` URL without one.
    package var databasePasswordFile: String?
    /// The password `database_password_file` holds, read by ``readSecretFiles(environment:)``.
    package var databasePassword: String?
    /// `durability`: `full` or `normal`.
    package var durability: DataQueue.Durability?
    /// `idempotent`: `"auto"`, `true` or `false` (see ``DataQueue/Idempotence``).
    package var idempotent: DataQueue.Idempotence?
    /// `max_resource_bytes`: the largest resource accepted.
    package var maxResourceBytes: Int?
    /// `extra_resource_types`: resource types a server adds to FHIR R4's; `"*"` accepts any.
    package var extraResourceTypes: [String]?
    /// `timeout_seconds`: the deadline of one request.
    package var timeoutSeconds: Double?
    /// `connect_timeout_seconds`: the connect timeout.
    package var connectTimeoutSeconds: Double?
    /// `settle_seconds`: see ``DataQueue/Configuration/settleDelay``.
    package var settleSeconds: Double?
    /// `lease_seconds`: see ``DataQueue/Configuration/leaseDuration``.
    package var leaseSeconds: Double?
    /// `batch_size`: the most items per request; unset: automatic (see ``DataQueue/Configuration/batchSize``).
    package var batchSize: Int?
    /// `batch_max_bytes`: the most body bytes per Bundle.
    package var batchMaxBytes: Int?
    /// `journal_retention_days`: delivery journal lines older than this are deleted. The default is 90; 0 keeps every line.
    package var journalRetentionDays: Double?
    /// `retry`: the backoff after failures.
    package var retry: Retry?
    /// `ca_bundle`: PEM CAs to trust in addition to the system's (also `tls.ca_bundle`).
    package var caBundle: String?
    /// `proxy`: the proxy for every request; over `HTTPS_PROXY` and `HTTP_PROXY`.
    package var proxy: String?
    /// `proxy_file`: a file holding the proxy URL; excludes `proxy`.
    package var proxyFile: String?
    /// `no_proxy`: hosts reached without the proxy; over `NO_PROXY`.
    package var noProxy: String?
    /// `tls`: the client certificate and trust.
    package var tls: TLS?
    /// The proxy variables of the environment (`HTTPS_PROXY`, `HTTP_PROXY`, `NO_PROXY`). Not a key.
    package var environmentNetwork = NetworkConfiguration()
    /// `auth`: how requests are authorized.
    package var auth: Auth?
    /// `encryption`: the encrypted endpoint (see ``EncryptedDataQueue``).
    package var encryption: Encryption?
    /// `at_rest`: the keys that seal queued items on disk (see ``DataQueue/Configuration/atRest``).
    package var atRest: AtRest?
    /// The keys `dq serve` opens envelopes with (from `serve.keys_dir`; see ``DataQueue/Configuration/envelopeKeyring``).
    package var envelopeKeyring: EnvelopeKeyring?
    /// How long `dq serve` recognises repeats (from `serve.dedupe_window_days`; see
    /// ``DataQueue/Configuration/duplicateWindow``); nil: the default.
    package var duplicateWindow: TimeInterval?
    /// What a receiver's clients may write (`serve.write_policy`, ``DataQueue/Configuration/writePolicy``); nil: the
    /// default.
    package var writePolicy: WritePolicy?
    /// Whether envelopes go to the encrypted endpoint in batches (`dq serve --role edge`; see
    /// ``DataQueue/Configuration/envelopeBatches``).
    package var envelopeBatches = false
    /// The directory that relative paths (keys, certificates, credentials) are relative to: the settings file's.
    package var baseDirectory: String?
    /// The file the settings were read from, if any.
    package var sourcePath: String?
    /// Whether the file itself (not the environment) holds a secret: a bearer token or a client secret.
    package var fileHoldsSecret = false
    /// Secret files (`…_file` settings) that others than their owner can read.
    package var exposedSecretFiles: [String] = []

    /// The `retry` object.
    package struct Retry: Sendable {
        /// `initial_seconds`.
        package var initialSeconds: Double?
        /// `maximum_seconds`.
        package var maximumSeconds: Double?
        /// `jitter`, from 0 to 1.
        package var jitter: Double?
        /// Empty `retry` settings.
        package init() {}
    }

    /// The `auth` object: a static bearer token, or OAuth2 client_credentials or authorization_code.
    package struct Auth: Sendable {
        /// `bearer_token`.
        package var bearerToken: String?
        /// `client_id`.
        package var clientID: String?
        /// `client_secret`.
        package var clientSecret: String?
        /// `bearer_token_file`: a file holding the bearer token.
        package var bearerTokenFile: String?
        /// `client_secret_file`: a file holding the client secret.
        package var clientSecretFile: String?
        /// `authorize_uri`: the token endpoint (client_credentials), the authorization endpoint (authorization_code).
        package var authorizeURI: String?
        /// `token_uri`.
        package var tokenURI: String?
        /// `authorize_type`: `client_credentials` (the default) or `authorization_code`.
        package var authorizeType: AuthorizeType?
        /// `issuer`: the OpenID issuer whose ID tokens are accepted (authorization_code).
        package var issuer: String?
        /// `revocation_uri`: the RFC 7009 revocation endpoint (authorization_code).
        package var revocationURI: String?
        /// `registration_uri`: RFC 7591 dynamic registration.
        package var registrationURI: String?
        /// `client_name` for registration.
        package var clientName: String?
        /// `scope`.
        package var scope: String?
        /// `token_endpoint_auth_method`.
        package var tokenEndpointAuthMethod: OAuth2Configuration.TokenEndpointAuthMethod?
        /// `private_key`: a PEM file for private_key_jwt.
        package var privateKey: String?
        /// `key_id` of the private key.
        package var keyID: String?
        /// `key_alg`: the JWS algorithm of an RSA private key.
        package var keyAlgorithm: OAuth2Configuration.ClientAssertionKey.Algorithm?
        /// `registration_fields`: extra members of the registration request (strings or booleans).
        package var registrationFields: [String: FieldValue]?
        /// `registration_headers`: extra headers of the registration request.
        package var registrationHeaders: [String: String]?
        /// `credentials_dir`: where registered credentials are kept.
        package var credentialsDirectory: String?

        /// Empty `auth` settings.
        package init() {}

        /// How requests are authorized with OAuth2 (`authorize_type`).
        package enum AuthorizeType: String, Sendable, CaseIterable {
            /// Unattended: the client's own credentials (the default).
            case clientCredentials = "client_credentials"
            /// A person signs in once with `dq login`; refresh tokens after that.
            case authorizationCode = "authorization_code"
        }

        /// A registration field's value.
        package enum FieldValue: Sendable, Decodable, Equatable {
            /// A string.
            case string(String)
            /// A boolean.
            case bool(Bool)

            /// Decodes a string or a boolean.
            package init(from decoder: any Decoder) throws {
                let container = try decoder.singleValueContainer()
                if let flag = try? container.decode(Bool.self) {
                    self = .bool(flag)
                } else {
                    self = .string(try container.decode(String.self))
                }
            }
        }
    }

    /// The `tls` object.
    package struct TLS: Sendable {
        /// `client_certificate`: a PEM certificate (chain) for servers that require one.
        package var clientCertificate: String?
        /// `client_key`: its PEM private key.
        package var clientKey: String?
        /// `ca_bundle`: PEM CAs trusted in addition to the system's.
        package var caBundle: String?
        /// `ca_bundle_only`: trust only `ca_bundle`, not the system's CAs.
        package var caBundleOnly: Bool?
        /// Empty `tls` settings.
        package init() {}
    }

    /// The `at_rest` object.
    package struct AtRest: Sendable {
        /// `key_file`: the key that seals new items, made by `dq keygen --at-rest`.
        package var keyFile: String?
        /// `old_key_files`: keys that open items sealed before a rekey.
        package var oldKeyFiles: [String]?
        /// Empty `at_rest` settings.
        package init() {}
    }

    /// The `encryption` object.
    package struct Encryption: Sendable {
        /// `endpoint`: where envelopes are posted.
        package var endpoint: String?
        /// `certificate`: the receiver's X.509 certificate (PEM or DER).
        package var certificate: String?
        /// `key_id`: the receiver's name for its key.
        package var keyID: String?
        /// `fhir_version` written into envelopes. The default is `1.0.2`.
        package var fhirVersion: String?
        /// `resource_types` to encrypt. The default is every resource.
        package var resourceTypes: [String]?
        /// `mode`: `c3pro` (the default) or `authenticated`.
        package var mode: EnvelopeSealer.Format?
        /// `in_flight`: envelopes sent at once (default 1).
        package var inFlight: Int?
        /// Empty `encryption` settings.
        package init() {}
    }

    /// Empty settings (every key unset).
    package init() {}

    /// Reads every key of the library from `reader` (see ``SettingKey/library``), each with its type; a secret is read as one, so
    /// that access reporters redact it. Values are checked by ``resolve()``.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key of a value of the wrong type (a
    ///   provider may name its own source, as the `DQ_` variables do), and for the two forms of one setting
    ///   given together.
    package init(reader: ConfigReader) async throws {
        let read = Read(reader: reader)
        server = try await read.text("server")
        database = try await read.text("database")
        databasePasswordFile = try await read.text("database_password_file", "must be a string (a file holding the password)")
        durability = try await read.choice("durability", #"must be "full" or "normal""#) { DataQueue.Durability(rawValue: $0) }
        idempotent = try await read.idempotence()
        maxResourceBytes = try await read.wholeNumber("max_resource_bytes", Self.maxResourceBytesError)
        extraResourceTypes = try await read.list("extra_resource_types", "must be a list of resource type names")
        timeoutSeconds = try await read.number("timeout_seconds")
        connectTimeoutSeconds = try await read.number("connect_timeout_seconds")
        settleSeconds = try await read.number("settle_seconds")
        leaseSeconds = try await read.number("lease_seconds")
        batchSize = try await read.wholeNumber("batch_size", Self.batchSizeError)
        batchMaxBytes = try await read.wholeNumber("batch_max_bytes", Self.batchMaxBytesError)
        journalRetentionDays = try await read.number("journal_retention_days", "must be a number of days")
        var retry = Retry()
        retry.initialSeconds = try await read.number("retry.initial_seconds")
        retry.maximumSeconds = try await read.number("retry.maximum_seconds")
        retry.jitter = try await read.number("retry.jitter")
        self.retry = read.found(["retry"]) ? retry : nil
        caBundle = try await read.text("ca_bundle")
        proxy = try await read.text("proxy", "must be a string (http://host:port)")
        proxyFile = try await read.text("proxy_file", "must be a string (a file holding the proxy URL)")
        try read.exclusive("proxy_file", "proxy")
        noProxy = try await read.text("no_proxy", "must be a string (a comma-separated list of hosts)")
        var tls = TLS()
        tls.clientCertificate = try await read.text("tls.client_certificate", "must be a string (a PEM file)")
        tls.clientKey = try await read.text("tls.client_key", "must be a string (a PEM file)")
        tls.caBundle = try await read.text("tls.ca_bundle", "must be a string (a PEM file)")
        tls.caBundleOnly = try await read.flag("tls.ca_bundle_only")
        self.tls = read.found(["tls"]) ? tls : nil
        auth = try await Self.readAuth(read)
        encryption = try await Self.readEncryption(read)
        var atRest = AtRest()
        atRest.keyFile = try await read.text("at_rest.key_file", "must be a string (a key file)")
        atRest.oldKeyFiles = try await read.list("at_rest.old_key_files", "must be a list of key files")
        self.atRest = read.found(["at_rest"]) ? atRest : nil
    }

    private static func readAuth(_ read: Read) async throws -> Auth? {
        var auth = Auth()
        auth.bearerToken = try await read.text("auth.bearer_token")
        auth.clientID = try await read.text("auth.client_id")
        auth.clientSecret = try await read.text("auth.client_secret")
        auth.bearerTokenFile = try await read.text("auth.bearer_token_file")
        auth.clientSecretFile = try await read.text("auth.client_secret_file")
        try read.exclusive("auth.bearer_token_file", "bearer_token")
        try read.exclusive("auth.client_secret_file", "client_secret")
        auth.authorizeURI = try await read.text("auth.authorize_uri")
        auth.tokenURI = try await read.text("auth.token_uri")
        auth.authorizeType = try await read.choice("auth.authorize_type", SettingKey.authorizeTypeError) {
            Auth.AuthorizeType(rawValue: $0)
        }
        auth.issuer = try await read.text("auth.issuer")
        auth.revocationURI = try await read.text("auth.revocation_uri")
        auth.registrationURI = try await read.text("auth.registration_uri")
        auth.clientName = try await read.text("auth.client_name")
        auth.scope = try await read.text("auth.scope")
        auth.tokenEndpointAuthMethod = try await read.choice("auth.token_endpoint_auth_method", SettingKey.authMethodError) {
            OAuth2Configuration.TokenEndpointAuthMethod(rawValue: $0)
        }
        auth.privateKey = try await read.text("auth.private_key")
        auth.keyID = try await read.text("auth.key_id")
        auth.keyAlgorithm = try await read.choice("auth.key_alg", SettingKey.keyAlgorithmError) {
            OAuth2Configuration.ClientAssertionKey.Algorithm(rawValue: $0.uppercased())
        }
        auth.registrationFields = try await read.object("auth.registration_fields", "must be an object")
        if let headers: [String: Auth.FieldValue] = try await read.object("auth.registration_headers", "must be an object of strings") {
            auth.registrationHeaders = try headers.mapValues {
                guard case .string(let text) = $0 else { throw configError("\"auth.registration_headers\" must be an object of strings") }
                return text
            }
        }
        auth.credentialsDirectory = try await read.text("auth.credentials_dir")
        return read.found(["auth"]) ? auth : nil
    }

    private static func readEncryption(_ read: Read) async throws -> Encryption? {
        var encryption = Encryption()
        let text = "must be a non-empty string"
        encryption.endpoint = try await read.text("encryption.endpoint", text)
        encryption.certificate = try await read.text("encryption.certificate", text)
        encryption.keyID = try await read.text("encryption.key_id", text)
        encryption.fhirVersion = try await read.text("encryption.fhir_version", text)
        encryption.resourceTypes = try await read.list("encryption.resource_types", "must be a non-empty list of resource type names")
        encryption.mode = try await read.choice("encryption.mode", #"must be "c3pro" or "authenticated""#) {
            EnvelopeSealer.Format(rawValue: $0)
        }
        encryption.inFlight = try await read.wholeNumber("encryption.in_flight", inFlightError)
        return read.found(["encryption"]) ? encryption : nil
    }

    /// Reads typed values, naming the key of one of the wrong type, and remembers which keys were found; a
    /// command reads its own keys (``SettingKeys/adding(_:objects:)``) with it too.
    package final class Read: Sendable {
        let reader: ConfigReader
        private let table: SettingKeys
        private let keys = NIOLockedValueBox<Set<String>>([])

        /// Reads from `reader` the keys of `table` (which says which are secrets).
        package init(reader: ConfigReader, keys table: SettingKeys = .library) {
            self.reader = reader
            self.table = table
        }

        /// Whether a key of one of `objects` (`auth`, …) was found.
        func found(_ objects: [String]) -> Bool {
            keys.withLockedValue { keys in keys.contains { objects.contains(String($0.prefix { $0 != "." })) } }
        }

        /// Throws when both `key` and its other form `other` (a key of the same object) were found.
        func exclusive(_ key: String, _ other: String) throws {
            let prefix = key.contains(".") ? String(key.prefix { $0 != "." }) + "." : ""
            if keys.withLockedValue({ $0.contains(key) && $0.contains(prefix + other) }) {
                throw configError("\"\(key)\" and \(other) exclude each other")
            }
        }

        private func value<T>(_ key: String, _ what: String, _ fetch: (ConfigKey, Bool) async throws -> T?) async throws -> T? {
            let value: T?
            do {
                value = try await fetch(ConfigKey(key), table.byName[key]?.isSecret ?? false)
            } catch let error as DataQueueError {
                throw error
            } catch {
                throw configError("\"\(key)\" \(what)")
            }
            if value != nil { _ = keys.withLockedValue { $0.insert(key) } }
            return value
        }

        /// Text; `what` (`must be …`) follows the key in the error for a value of another type.
        package func text(_ key: String, _ what: String = "must be a string") async throws -> String? {
            try await value(key, what) { try await reader.fetchString(forKey: $0, isSecret: $1) }
        }

        /// A number; `what` follows the key in the error for a value of another type.
        package func number(_ key: String, _ what: String = "must be a number") async throws -> Double? {
            try await value(key, what) { try await reader.fetchDouble(forKey: $0, isSecret: $1) }
        }

        func flag(_ key: String) async throws -> Bool? {
            try await value(key, "must be true or false") { try await reader.fetchBool(forKey: $0, isSecret: $1) }
        }

        func list(_ key: String, _ what: String) async throws -> [String]? {
            try await value(key, what) { try await reader.fetchStringArray(forKey: $0, isSecret: $1) }
        }

        /// A whole number, written `1000` or `1000.0`; `error` (which says the range) when it is not one.
        func wholeNumber(_ key: String, _ error: DataQueueError) async throws -> Int? {
            guard let number = try await number(key) else { return nil }
            guard number.isFinite, number.rounded() == number, abs(number) < 1e15 else { throw error }
            return Int(number)
        }

        /// A value from a set (`parse` gives nil for any other), refused saying which was given (never a secret).
        package func choice<T>(_ key: String, _ what: String, _ parse: (String) -> T?) async throws -> T? {
            guard let text = try await text(key, what) else { return nil }
            guard let parsed = parse(text) else { throw configError("\"\(key)\" \(what), not \"\(text.prefix(40))\"") }
            return parsed
        }

        /// `idempotent`: `true`, `false` or `"auto"` (a variable's `1` and `0` too).
        func idempotence() async throws -> DataQueue.Idempotence? {
            let what = #"must be true, false or "auto""#
            let text: String?
            do {
                text = try await reader.fetchString(forKey: "idempotent")
            } catch let error as DataQueueError {
                throw error
            } catch {
                text = nil  // a boolean, from a reader that keeps it as one
            }
            if let text {
                _ = keys.withLockedValue { $0.insert("idempotent") }
                switch text.lowercased() {
                case "auto": return .automatic
                case "true", "1": return .always
                case "false", "0": return .never
                default: throw configError("\"idempotent\" \(what)")
                }
            }
            let flag = try await value("idempotent", what) { try await reader.fetchBool(forKey: $0, isSecret: $1) }
            return flag.map { DataQueue.Idempotence($0) }
        }

        /// An object of strings or booleans, given as JSON text (see ``SettingsFile``).
        func object(_ key: String, _ what: String) async throws -> [String: Auth.FieldValue]? {
            guard let text = try await text(key, what) else { return nil }
            guard let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any] else {
                throw configError("\"\(key)\" \(what)")
            }
            var fields: [String: Auth.FieldValue] = [:]
            for (name, value) in object.sorted(by: { $0.key < $1.key }) {
                guard let member = try? JSONSerialization.data(withJSONObject: [value]),
                    let field = try? JSONDecoder().decode([Auth.FieldValue].self, from: member).first
                else { throw configError("\"\(key).\(name)\" must be a string or a boolean") }
                fields[name] = field
            }
            return fields
        }
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

    static var maxResourceBytesError: DataQueueError {
        configError("\"max_resource_bytes\" must be a whole number of bytes from 64 to \(SettingLimits.maximumResourceSizeLimit)")
    }

    static var batchSizeError: DataQueueError {
        configError("\"batch_size\" must be a whole number from 1 to \(SettingLimits.maximumBatchSize)")
    }

    static var batchMaxBytesError: DataQueueError {
        configError("\"batch_max_bytes\" must be a whole number of bytes from 1024 to \(256 << 20)")
    }

    static var inFlightError: DataQueueError { configError("\"encryption.in_flight\" must be a whole number from 1 to 64") }

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
        try checkOptions(&values)
        return values
    }

    /// Checks the values other than the server (see ``checkedValues()``).
    func checkOptions(_ values: inout CheckedValues) throws {
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

}
