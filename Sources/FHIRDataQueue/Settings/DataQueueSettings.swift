import Foundation
import Logging

/// The `dq.json` settings file, as the `dq` command line and an embedding service both read it.
///
/// Decoding checks names and types (an unknown key or a wrong type is an error that names the key);
/// ``resolve()`` checks values and builds the pieces of a queue. Environment variables (`DQ_*`) are applied
/// with ``apply(environment:)``; an application applies its own overrides by setting the properties.
///
/// ```swift
/// var settings = try DataQueueSettings.load(contentsOf: "/etc/dq/dq.json")
/// try settings.apply(environment: ProcessInfo.processInfo.environment)
/// let queue = try settings.makeQueue(logger: logger)
/// ```
///
/// Every error is a ``DataQueueError`` with code `.invalidConfiguration` and a message that starts with
/// `configuration:` and names the key, never its secret value.
public struct DataQueueSettings: Sendable, Decodable {
    /// `server`: the FHIR base URL.
    public var server: String?
    /// `database`: the queue's SQLite file. The default is ``DataQueue/defaultDatabasePath(environment:)``.
    public var database: String?
    /// `durability`: `full` or `normal`.
    public var durability: String?
    /// `idempotent`: conditional create on retries.
    public var idempotent: Bool?
    /// `max_resource_bytes`: the largest resource accepted.
    public var maxResourceBytes: Double?
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
    public var batchSize: Double?
    /// `batch_max_bytes`: the most body bytes per Bundle.
    public var batchMaxBytes: Double?
    /// `retry`: the backoff after failures.
    public var retry: Retry?
    /// `ca_bundle`: PEM CAs to trust instead of the system's.
    public var caBundle: String?
    /// `auth`: how requests are authorized.
    public var auth: Auth?
    /// `encryption`: the encrypted endpoint (see ``EncryptedDataQueue``).
    public var encryption: Encryption?
    /// The directory that relative paths in the file (keys, certificates, credentials) are relative to: the
    /// file's own directory when loaded with ``load(contentsOf:)``. Not read from the file.
    public var baseDirectory: String?
    /// The file the settings were loaded from, if any. Not read from the file.
    public var sourcePath: String?
    /// Whether the file itself (not the environment) holds a secret: a bearer token or a client secret.
    public var fileHoldsSecret = false

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
        /// `authorize_uri`: with `client_credentials` C3-PRO's name for the token endpoint; with
        /// `authorization_code` the authorization endpoint.
        public var authorizeURI: String?
        /// `token_uri`.
        public var tokenURI: String?
        /// `authorize_type`: `client_credentials` (unattended, the default) or `authorization_code` (a
        /// person signs in once with `dq login`; SMART standalone launch with PKCE).
        public var authorizeType: String?
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
        /// `token_endpoint_auth_method`.
        public var tokenEndpointAuthMethod: String?
        /// `private_key`: a PEM file for private_key_jwt.
        public var privateKey: String?
        /// `key_id` of the private key.
        public var keyID: String?
        /// `key_alg`: the JWS algorithm of an RSA private key, `RS384` (the default) or `RS256`; an EC key's
        /// curve decides its own (`ES256`, `ES384`).
        public var keyAlgorithm: String?
        /// `registration_fields`: extra members of the registration request (strings or booleans).
        public var registrationFields: [String: FieldValue]?
        /// `registration_headers`: extra headers of the registration request.
        public var registrationHeaders: [String: String]?
        /// `credentials_dir`: where registered credentials are kept.
        public var credentialsDirectory: String?

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
        public var mode: String?
        /// `in_flight`: envelopes sent at once (default 1; more gives up order for the encrypted endpoint).
        public var inFlight: Double?
    }

    /// Empty settings (every key unset).
    public init() {}

    // MARK: - Loading

    /// Reads and decodes a settings file; relative paths in it are relative to its directory.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when the file cannot be read, is not a JSON
    ///   object, or has an unknown key or a value of the wrong type.
    public static func load(contentsOf path: String) throws -> DataQueueSettings {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw configError("cannot read the config file \(path)")
        }
        var settings = try decode(data, source: path)
        settings.baseDirectory = (path as NSString).deletingLastPathComponent
        settings.sourcePath = path
        settings.fileHoldsSecret =
            settings.auth?.bearerToken != nil || settings.auth?.clientSecret != nil
            || settings.database.flatMap { URLComponents(string: $0)?.password } != nil
        return settings
    }

    /// Decodes settings from JSON bytes; `source` names them in errors.
    public static func decode(_ data: Data, source: String = "the settings") throws -> DataQueueSettings {
        do {
            return try JSONDecoder().decode(DataQueueSettings.self, from: data)
        } catch let error as DataQueueError {
            throw error
        } catch DecodingError.typeMismatch(_, let context) where !context.codingPath.isEmpty {
            throw configError("\(SettingsKeys.name(context.codingPath)) has the wrong type")
        } catch DecodingError.dataCorrupted {
            // Where the JSON breaks (never the text around it): Foundation's parser names a character offset.
            if let at = errorOffset(in: data) {
                let before = data.prefix(at)
                let line = before.reduce(1) { $1 == UInt8(ascii: "\n") ? $0 + 1 : $0 }
                let column = at - (before.lastIndex(of: UInt8(ascii: "\n")).map { $0 - data.startIndex + 1 } ?? 0) + 1
                throw configError("\(source) is not a JSON object: invalid JSON at line \(line), column \(column)")
            }
            throw configError("\(source) is not a JSON object")
        } catch {
            throw configError("\(source) is not a JSON object")
        }
    }

    /// The byte offset where `data` stops being JSON, as Foundation's parser reports it.
    private static func errorOffset(in data: Data) -> Int? {
        do {
            _ = try JSONSerialization.jsonObject(with: data)
            return nil
        } catch {
            let text = (error as NSError).userInfo[NSDebugDescriptionErrorKey] as? String ?? ""
            guard let range = text.range(of: #"character \d+"#, options: String.CompareOptions.regularExpression),
                let offset = Int(text[range].dropFirst("character ".count))
            else { return nil }
            return min(offset, data.count)
        }
    }

    /// Applies the `DQ_*` environment variables over the file: `DQ_SERVER`, `DQ_DATABASE`, `DQ_DURABILITY`,
    /// `DQ_IDEMPOTENT`, `DQ_CA_BUNDLE`, `DQ_TOKEN`, `DQ_CLIENT_SECRET`.
    ///
    /// - Throws: ``DataQueueError`` for a `DQ_IDEMPOTENT` that is not a boolean.
    public mutating func apply(environment: [String: String]) throws {
        if let value = environment["DQ_SERVER"] { server = value }
        if let value = environment["DQ_DATABASE"] { database = value }
        if let value = environment["DQ_DURABILITY"] { durability = value }
        if let text = environment["DQ_IDEMPOTENT"] {
            guard let flag = ["1": true, "true": true, "0": false, "false": false][text.lowercased()] else {
                throw Self.configError("DQ_IDEMPOTENT must be true or false")
            }
            idempotent = flag
        }
        if let value = environment["DQ_CA_BUNDLE"] { caBundle = value }
        if let text = environment["DQ_BATCH_SIZE"] {
            guard let value = Double(text) else { throw Self.configError("DQ_BATCH_SIZE must be a whole number") }
            batchSize = value
        }
        if let text = environment["DQ_LEASE_SECONDS"] {
            guard let value = Double(text) else { throw Self.configError("DQ_LEASE_SECONDS must be a number of seconds") }
            leaseSeconds = value
        }
        if let value = environment["DQ_TOKEN"] {
            auth = auth ?? Auth()
            auth?.bearerToken = value
        }
        if let value = environment["DQ_CLIENT_SECRET"] {
            auth = auth ?? Auth()
            auth?.clientSecret = value
        }
    }

    // MARK: - Resolving

    /// What the settings make: the pieces of a queue, each value checked.
    public struct Resolved: Sendable {
        /// The FHIR base URL.
        public var server: URL
        /// The queue's configuration.
        public var configuration: DataQueue.Configuration
        /// How requests are authorized, if at all.
        public var authorization: (any AuthorizationProvider)?
        /// The encrypted endpoint, if any.
        public var encryption: ResolvedEncryption?
    }

    /// The `encryption` object, resolved.
    public struct ResolvedEncryption: Sendable {
        /// Where envelopes go.
        public var endpoint: URL
        /// The sealer with the receiver's key.
        public var sealer: EnvelopeSealer
        /// The types to encrypt; nil: every resource.
        public var resourceTypes: Set<String>?
    }

    /// Checks every value and builds the queue's pieces. No file other than the certificate and keys named
    /// in the settings is read, and nothing is written.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key of the first bad value.
    public func resolve() throws -> Resolved {
        guard let serverText = server, !serverText.isEmpty else {
            throw Self.configError("\"server\" is missing (set it in the config file, DQ_SERVER or --server)")
        }
        guard let serverURL = URL(string: serverText) else {
            throw Self.configError("\"server\" must be an http(s) URL with a host")
        }
        do {
            _ = try DataQueue.queueName(for: serverURL)
        } catch let error as DataQueueError {
            throw Self.configError("\"" + error.message.replacingOccurrences(of: "server: ", with: "server\": "))
        }
        var configuration = DataQueue.Configuration()
        if let database {
            try Self.checked { try DataQueue.Configuration.checkDatabasePath(database, name: "\"database\"") }
            configuration.databasePath = database
        }
        if let durability {
            guard let value = Durability(rawValue: durability) else {
                throw Self.configError("\"durability\" must be \"full\" or \"normal\"")
            }
            configuration.durability = value
        }
        if let idempotent { configuration.idempotent = idempotent }
        if let value = maxResourceBytes {
            let limit = DataQueue.Configuration.maximumResourceSizeLimit
            guard value.isFinite, value.rounded() == value, value >= 64, value <= Double(limit) else {
                throw Self.configError("\"max_resource_bytes\" must be a whole number of bytes from 64 to \(limit)")
            }
            configuration.maximumResourceSize = Int(value)
        }
        if let value = batchSize {
            let limit = DataQueue.Configuration.maximumBatchSize
            guard value.isFinite, value.rounded() == value, value >= 1, value <= Double(limit) else {
                throw Self.configError("\"batch_size\" must be a whole number from 1 to \(limit)")
            }
            configuration.batchSize = Int(value)
        }
        if let value = batchMaxBytes {
            guard value.isFinite, value.rounded() == value, value >= 1024, value <= Double(256 << 20) else {
                throw Self.configError("\"batch_max_bytes\" must be a whole number of bytes from 1024 to \(256 << 20)")
            }
            configuration.batchMaxBytes = Int(value)
        }
        if let value = try Self.seconds(timeoutSeconds, "timeout_seconds", allowZero: false) {
            configuration.requestTimeout = value
        }
        if let value = try Self.seconds(connectTimeoutSeconds, "connect_timeout_seconds", allowZero: false) {
            configuration.connectTimeout = value
        }
        if let value = try Self.seconds(leaseSeconds, "lease_seconds", allowZero: false) {
            guard value >= 1 else { throw Self.configError("\"lease_seconds\" must be at least 1") }
            configuration.leaseDuration = value
        }
        if let value = try Self.seconds(settleSeconds, "settle_seconds", allowZero: true) {
            configuration.settleDelay = value
        }
        if let retry {
            if let value = try Self.seconds(retry.initialSeconds, "retry.initial_seconds", allowZero: true) {
                configuration.retryPolicy.initialDelay = value
            }
            if let value = try Self.seconds(retry.maximumSeconds, "retry.maximum_seconds", allowZero: true) {
                configuration.retryPolicy.maximumDelay = value
            }
            if let value = retry.jitter {
                guard value.isFinite, (0...1).contains(value) else {
                    throw Self.configError("\"retry.jitter\" must be between 0 and 1")
                }
                configuration.retryPolicy.jitter = value
            }
        }
        if let path = caBundle {
            guard FileManager.default.isReadableFile(atPath: path) else {
                throw Self.configError("\"ca_bundle\" file \(path) cannot be read")
            }
            configuration.caBundlePath = path
        }
        var authorization: (any AuthorizationProvider)?
        if let auth {
            if let token = auth.bearerToken {
                guard !token.isEmpty else { throw Self.configError("\"auth.bearer_token\" is empty") }
                authorization = StaticBearerToken(token)
            } else if auth.authorizeType == "authorization_code" {
                authorization = try resolveAuthorizationCode(auth, server: serverURL, caBundle: configuration.caBundlePath)
            } else if auth.authorizeType != nil || auth.clientID != nil || auth.registrationURI != nil {
                authorization = try resolveOAuth2(auth, server: serverURL, caBundle: configuration.caBundlePath)
            }
        }
        if let value = encryption?.inFlight {
            guard value.isFinite, value.rounded() == value, (1...64).contains(value) else {
                throw Self.configError("\"encryption.in_flight\" must be a whole number from 1 to 64")
            }
            configuration.encryptedInFlight = Int(value)
        }
        return Resolved(
            server: serverURL, configuration: configuration, authorization: authorization,
            encryption: try encryption.map(resolveEncryption))
    }

    /// Builds the queue the settings describe: an ``EncryptedDataQueue`` when `encryption` is set, else a
    /// ``DataQueue``.
    ///
    /// - Parameters:
    ///   - readOnly: open an existing queue for reading only (see ``DataQueue/Configuration/readOnly``).
    ///     The default is `false`.
    ///   - logger: where the queue logs.
    /// - Throws: ``DataQueueError``: `.invalidConfiguration` for a bad setting, `.storage` when the database
    ///   cannot be opened.
    public func makeQueue(readOnly: Bool = false, logger: Logger) throws -> DataQueue {
        var resolved = try resolve()
        resolved.configuration.readOnly = readOnly
        if let encryption = resolved.encryption {
            let types = encryption.resourceTypes
            return try EncryptedDataQueue(
                baseURL: resolved.server, encryptedBaseURL: encryption.endpoint, sealer: encryption.sealer,
                shouldEncrypt: { resource in types?.contains(resource.resourceType) ?? true },
                configuration: resolved.configuration, authorization: resolved.authorization, logger: logger)
        }
        return try DataQueue(
            baseURL: resolved.server, configuration: resolved.configuration, authorization: resolved.authorization,
            logger: logger)
    }

    // MARK: - Pieces

    private func relative(_ path: String) -> String {
        if path.hasPrefix("/") { return path }
        guard let baseDirectory, !baseDirectory.isEmpty else { return path }
        return (baseDirectory as NSString).appendingPathComponent(path)
    }

    /// An `auth` URL key's value: nil when absent, else an http(s) URL with a host.
    private static func authURL(_ text: String?, _ key: String) throws -> URL? {
        guard let text else { return nil }
        guard let url = URL(string: text), let scheme = url.scheme?.lowercased(), scheme == "http" || scheme == "https",
            url.host != nil
        else { throw configError("\"auth.\(key)\" must be an http(s) URL") }
        return url
    }

    /// `token_endpoint_auth_method`, `private_key`, `key_id` and `key_alg`, checked.
    private func clientAuthentication(_ auth: Auth, allowNone: Bool) throws -> (TokenEndpointAuthMethod?, ClientAssertionKey?) {
        var method: TokenEndpointAuthMethod?
        if let text = auth.tokenEndpointAuthMethod {
            guard let parsed = TokenEndpointAuthMethod(rawValue: text), allowNone || parsed != .none else {
                throw Self.configError(
                    "\"auth.token_endpoint_auth_method\" must be client_secret_basic, client_secret_post\(allowNone ? ", none" : "") or private_key_jwt"
                )
            }
            method = parsed
        }
        var keyAlgorithm: ClientAssertionKey.Algorithm?
        if let name = auth.keyAlgorithm {
            guard let parsed = ClientAssertionKey.Algorithm(rawValue: name.uppercased()) else {
                throw Self.configError("\"auth.key_alg\" must be RS256, RS384, ES256 or ES384")
            }
            keyAlgorithm = parsed
        }
        var key: ClientAssertionKey?
        if let path = auth.privateKey {
            key = try ClientAssertionKey(pemFile: relative(path), keyID: auth.keyID, algorithm: keyAlgorithm)
        } else if keyAlgorithm != nil {
            throw Self.configError("\"auth.key_alg\" is set but \"auth.private_key\" is not")
        }
        return (method, key)
    }

    private func resolveAuthorizationCode(_ auth: Auth, server: URL, caBundle: String?) throws -> AuthorizationCodeClient {
        for (key, set) in [("registration_uri", auth.registrationURI != nil), ("registration_fields", auth.registrationFields != nil)]
        where set {
            throw Self.configError("\"auth.\(key)\" is for client_credentials; with authorization_code give \"auth.client_id\"")
        }
        guard let clientID = auth.clientID, !clientID.isEmpty else {
            throw Self.configError("\"auth.client_id\" is missing (authorization_code needs the client id the server registered)")
        }
        var configuration = AuthorizationCodeConfiguration(fhirBaseURL: server, clientID: clientID)
        configuration.clientSecret = auth.clientSecret
        (configuration.authMethod, configuration.assertionKey) = try clientAuthentication(auth, allowNone: true)
        switch configuration.effectiveAuthMethod {
        case .privateKeyJWT where configuration.assertionKey == nil:
            throw Self.configError("\"auth.private_key\" is missing (needed for private_key_jwt)")
        case .clientSecretBasic, .clientSecretPost:
            if configuration.clientSecret == nil {
                throw Self.configError(
                    "\"auth.client_secret\" is missing (or set DQ_CLIENT_SECRET) for \(configuration.effectiveAuthMethod.rawValue)")
            }
        default: break
        }
        if let scope = auth.scope {
            guard !scope.trimmingCharacters(in: .whitespaces).isEmpty else { throw Self.configError("\"auth.scope\" is empty") }
            configuration.scope = scope
        }
        configuration.authorizationURL = try Self.authURL(auth.authorizeURI, "authorize_uri")
        configuration.tokenURL = try Self.authURL(auth.tokenURI, "token_uri")
        configuration.revocationURL = try Self.authURL(auth.revocationURI, "revocation_uri")
        if let issuer = auth.issuer {
            _ = try Self.authURL(issuer, "issuer")
            configuration.issuer = issuer
        }
        if let directory = auth.credentialsDirectory { configuration.credentialsDirectory = relative(directory) }
        configuration.caBundlePath = caBundle
        return AuthorizationCodeClient(configuration: configuration)
    }

    private func resolveOAuth2(_ auth: Auth, server: URL, caBundle: String?) throws -> OAuth2ClientCredentials {
        if auth.issuer != nil || auth.revocationURI != nil {
            throw Self.configError("\"auth.issuer\" and \"auth.revocation_uri\" belong to \"authorize_type\": \"authorization_code\"")
        }
        if let type = auth.authorizeType, type != "client_credentials" {
            throw Self.configError(
                "\"auth.authorize_type\" must be \"client_credentials\" or \"authorization_code\", not \"\(type)\"")
        }
        let url = Self.authURL
        var oauth = OAuth2Configuration(fhirBaseURL: server)
        oauth.clientID = auth.clientID
        oauth.clientSecret = auth.clientSecret
        oauth.tokenURL = try url(auth.tokenURI, "token_uri") ?? url(auth.authorizeURI, "authorize_uri")
        oauth.registrationURI = try url(auth.registrationURI, "registration_uri")
        if let name = auth.clientName { oauth.clientName = name }
        oauth.scope = auth.scope
        oauth.caBundlePath = caBundle
        (oauth.authMethod, oauth.assertionKey) = try clientAuthentication(auth, allowNone: false)
        if oauth.effectiveAuthMethod == .privateKeyJWT && oauth.assertionKey == nil {
            throw Self.configError("\"auth.private_key\" is missing (needed for private_key_jwt)")
        }
        if oauth.effectiveAuthMethod != .privateKeyJWT && oauth.clientID != nil && oauth.clientSecret == nil {
            throw Self.configError("\"auth.client_secret\" is missing (or set DQ_CLIENT_SECRET, or \"auth.private_key\")")
        }
        for (key, value) in auth.registrationFields ?? [:] {
            switch value {
            case .bool(let flag): oauth.registrationFlags[key] = flag
            case .string(let text): oauth.registrationFields[key] = text
            }
        }
        if let headers = auth.registrationHeaders { oauth.registrationHeaders = headers }
        if let directory = auth.credentialsDirectory {
            oauth.credentialStore = CredentialStore(directory: relative(directory))
        }
        if oauth.clientID == nil && oauth.registrationURI == nil && oauth.tokenURL != nil {
            throw Self.configError("\"auth.client_id\" is missing (or set \"auth.registration_uri\" to register dynamically)")
        }
        return try OAuth2ClientCredentials(configuration: oauth)
    }

    private func resolveEncryption(_ object: Encryption) throws -> ResolvedEncryption {
        func text(_ value: String?, _ key: String, required: Bool) throws -> String? {
            guard let value else {
                if required { throw Self.configError("\"encryption.\(key)\" is missing") }
                return nil
            }
            guard !value.isEmpty else { throw Self.configError("\"encryption.\(key)\" must be a non-empty string") }
            return value
        }
        let endpointText = try text(object.endpoint, "endpoint", required: true)!
        guard let endpoint = URL(string: endpointText) else {
            throw Self.configError("\"encryption.endpoint\" must be an http(s) URL with a host")
        }
        do {
            _ = try DataQueue.queueName(for: endpoint, setting: "\"encryption.endpoint\"")
        } catch let error as DataQueueError {
            throw Self.configError(error.message)
        }
        let certificatePath = relative(try text(object.certificate, "certificate", required: true)!)
        let keyID = try text(object.keyID, "key_id", required: true)!
        let version = try text(object.fhirVersion, "fhir_version", required: false) ?? "1.0.2"
        let modeText = try text(object.mode, "mode", required: false) ?? "c3pro"
        guard let format = EnvelopeFormat(rawValue: modeText) else {
            throw Self.configError("\"encryption.mode\" must be \"c3pro\" or \"authenticated\"")
        }
        var types: Set<String>?
        if let list = object.resourceTypes {
            guard !list.isEmpty else {
                throw Self.configError("\"encryption.resource_types\" must be a non-empty list of resource type names")
            }
            types = Set(list)
        }
        let recipient: RecipientKey
        do {
            recipient = try RecipientKey(contentsOfFile: certificatePath)
        } catch let error as DataQueueError {
            throw Self.configError(error.message.replacingOccurrences(of: "encryption: ", with: "\"encryption.certificate\": "))
        }
        return ResolvedEncryption(
            endpoint: endpoint,
            sealer: EnvelopeSealer(recipient: recipient, keyID: keyID, fhirVersion: version, format: format),
            resourceTypes: types)
    }

    static func configError(_ message: String) -> DataQueueError {
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
        try checked { try DataQueue.Configuration.checkSeconds(value, name: "\"\(key)\"", allowZero: allowZero) }
        return value
    }

    // MARK: - Decoding

    private enum CodingKeys: String, CodingKey, CaseIterable {
        case server, database, durability, idempotent, retry, auth, encryption
        case maxResourceBytes = "max_resource_bytes"
        case timeoutSeconds = "timeout_seconds"
        case connectTimeoutSeconds = "connect_timeout_seconds"
        case settleSeconds = "settle_seconds"
        case leaseSeconds = "lease_seconds"
        case caBundle = "ca_bundle"
        case batchSize = "batch_size"
        case batchMaxBytes = "batch_max_bytes"
    }

    /// Decodes the file's object, refusing unknown keys and naming the key of a wrong type.
    public init(from decoder: any Decoder) throws {
        try SettingsKeys.refuseUnknown(decoder, CodingKeys.self)
        let container = try decoder.container(keyedBy: CodingKeys.self)
        server = try SettingsKeys.value(container, .server, "must be a string")
        database = try SettingsKeys.value(container, .database, "must be a string")
        durability = try SettingsKeys.value(container, .durability, "must be \"full\" or \"normal\"")
        idempotent = try SettingsKeys.value(container, .idempotent, "must be true or false")
        maxResourceBytes = try SettingsKeys.value(container, .maxResourceBytes, "must be a number")
        timeoutSeconds = try SettingsKeys.value(container, .timeoutSeconds, "must be a number")
        connectTimeoutSeconds = try SettingsKeys.value(container, .connectTimeoutSeconds, "must be a number")
        settleSeconds = try SettingsKeys.value(container, .settleSeconds, "must be a number")
        leaseSeconds = try SettingsKeys.value(container, .leaseSeconds, "must be a number")
        batchSize = try SettingsKeys.value(container, .batchSize, "must be a number")
        batchMaxBytes = try SettingsKeys.value(container, .batchMaxBytes, "must be a number")
        retry = try SettingsKeys.value(container, .retry, "must be an object")
        caBundle = try SettingsKeys.value(container, .caBundle, "must be a string")
        auth = try SettingsKeys.value(container, .auth, "must be an object")
        encryption = try SettingsKeys.value(container, .encryption, "must be an object")
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
        authorizeURI = try SettingsKeys.value(container, .authorizeURI, string)
        tokenURI = try SettingsKeys.value(container, .tokenURI, string)
        authorizeType = try SettingsKeys.value(container, .authorizeType, string)
        issuer = try SettingsKeys.value(container, .issuer, string)
        revocationURI = try SettingsKeys.value(container, .revocationURI, string)
        registrationURI = try SettingsKeys.value(container, .registrationURI, string)
        clientName = try SettingsKeys.value(container, .clientName, string)
        scope = try SettingsKeys.value(container, .scope, string)
        tokenEndpointAuthMethod = try SettingsKeys.value(container, .tokenEndpointAuthMethod, string)
        privateKey = try SettingsKeys.value(container, .privateKey, string)
        keyID = try SettingsKeys.value(container, .keyID, string)
        keyAlgorithm = try SettingsKeys.value(container, .keyAlgorithm, string)
        registrationFields = try SettingsKeys.value(container, .registrationFields, "must be an object")
        registrationHeaders = try SettingsKeys.value(container, .registrationHeaders, "must be an object of strings")
        credentialsDirectory = try SettingsKeys.value(container, .credentialsDirectory, string)
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
        mode = try SettingsKeys.value(container, .mode, "must be \"c3pro\" or \"authenticated\"")
        inFlight = try SettingsKeys.value(container, .inFlight, "must be a number")
    }
}

/// Decoding helpers that name keys the way the file writes them (`"retry.initial_seconds"`).
enum SettingsKeys {
    struct AnyKey: CodingKey {
        var stringValue: String
        var intValue: Int? { nil }
        init(stringValue: String) { self.stringValue = stringValue }
        init?(intValue: Int) { nil }
    }

    /// The dotted name of a coding path.
    static func name(_ path: [any CodingKey]) -> String {
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
