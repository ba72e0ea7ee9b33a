import FHIRDataQueue
import Foundation

/// The settings of one `dq` run: the config file, then `DQ_*` environment variables, then flags.
struct DQSettings {
    var server: URL
    var configuration: DataQueue.Configuration
    var authorization: (any AuthorizationProvider)?
    var configPath: String?
    var encryption: Encryption?

    /// The `encryption` object: where and how envelopes go.
    struct Encryption {
        var endpoint: URL
        var sealer: EnvelopeSealer
        /// nil: every resource is encrypted.
        var resourceTypes: Set<String>?
    }

    /// Keys a config file may hold.
    static let topLevelKeys: Set<String> = [
        "server", "database", "durability", "idempotent", "max_resource_bytes", "timeout_seconds",
        "connect_timeout_seconds", "settle_seconds", "retry", "ca_bundle", "auth", "encryption",
    ]
    static let encryptionKeys: Set<String> = [
        "endpoint", "certificate", "key_id", "fhir_version", "resource_types", "mode",
    ]
    static let authKeys: Set<String> = [
        "bearer_token", "client_id", "client_secret", "authorize_uri", "token_uri", "authorize_type",
        "registration_uri", "client_name", "scope", "token_endpoint_auth_method", "private_key", "key_id",
        "registration_fields", "registration_headers", "credentials_dir",
    ]

    static func configError(_ message: String) -> DataQueueError {
        DataQueueError(.invalidConfiguration, "configuration: \(message)")
    }

    /// Loads settings. `requireServer` is false for commands that only read the database.
    static func load(options: QueueOptions, environment: [String: String] = ProcessInfo.processInfo.environment)
        throws -> DQSettings
    {
        var file: [String: Any] = [:]
        var configPath = options.config ?? environment["DQ_CONFIG"]
        if configPath == nil, FileManager.default.fileExists(atPath: "dq.json") { configPath = "dq.json" }
        if let configPath {
            guard let data = FileManager.default.contents(atPath: configPath) else {
                throw configError("cannot read the config file \(configPath)")
            }
            guard let object = try? JSONSerialization.jsonObject(with: data) as? [String: Any] else {
                throw configError("\(configPath) is not a JSON object")
            }
            for key in object.keys where !topLevelKeys.contains(key) {
                throw configError("unknown key \"\(key)\" in \(configPath)")
            }
            file = object
        }
        func string(_ key: String) throws -> String? {
            guard let value = file[key] else { return nil }
            guard let text = value as? String else { throw configError("\"\(key)\" must be a string") }
            return text
        }
        func number(_ key: String, in object: [String: Any]? = nil, name: String? = nil) throws -> Double? {
            guard let value = (object ?? file)[key] else { return nil }
            guard let number = value as? NSNumber, !CFGetTypeIDIsBool(value), number.doubleValue.isFinite else {
                throw configError("\"\(name ?? key)\" must be a number")
            }
            return number.doubleValue
        }
        /// A duration from the file, checked as every duration is (finite, in range).
        func seconds(_ key: String, in object: [String: Any]? = nil, name: String? = nil, allowZero: Bool) throws
            -> Double?
        {
            guard let value = try number(key, in: object, name: name) else { return nil }
            do {
                try DataQueue.Configuration.checkSeconds(value, name: "\"\(name ?? key)\"", allowZero: allowZero)
            } catch let error as DataQueueError {
                throw configError(error.message)
            }
            return value
        }

        // Server
        let serverText = try options.server ?? environment["DQ_SERVER"] ?? string("server")
        guard let serverText, !serverText.isEmpty else {
            throw configError("\"server\" is missing (set it in the config file, DQ_SERVER or --server)")
        }
        guard let server = URL(string: serverText) else {
            throw configError("\"server\" must be an http(s) URL with a host")
        }
        do {
            _ = try DataQueue.queueName(for: server)
        } catch let error as DataQueueError {
            throw configError("\"" + error.message.replacingOccurrences(of: "server: ", with: "server\": "))
        }

        var configuration = DataQueue.Configuration()
        if let database = try options.database ?? environment["DQ_DATABASE"] ?? string("database") {
            do {
                try DataQueue.Configuration.checkDatabasePath(database, name: "\"database\"")
            } catch let error as DataQueueError {
                throw configError(error.message)
            }
            configuration.databasePath = database
        }
        if let text = try options.durability ?? environment["DQ_DURABILITY"] ?? string("durability") {
            guard let durability = Durability(rawValue: text) else {
                throw configError("\"durability\" must be \"full\" or \"normal\"")
            }
            configuration.durability = durability
        }
        if let value = file["idempotent"] {
            guard let flag = value as? Bool else { throw configError("\"idempotent\" must be true or false") }
            configuration.idempotent = flag
        }
        if let text = environment["DQ_IDEMPOTENT"] {
            guard let flag = ["1": true, "true": true, "0": false, "false": false][text.lowercased()] else {
                throw configError("DQ_IDEMPOTENT must be true or false")
            }
            configuration.idempotent = flag
        }
        if options.idempotent { configuration.idempotent = true }
        if let value = try number("max_resource_bytes") {
            let limit = DataQueue.Configuration.maximumResourceSizeLimit
            guard value.rounded() == value, value >= 64, value <= Double(limit) else {
                throw configError("\"max_resource_bytes\" must be a whole number of bytes from 64 to \(limit)")
            }
            configuration.maximumResourceSize = Int(value)
        }
        if let value = try seconds("timeout_seconds", allowZero: false) { configuration.requestTimeout = value }
        // Flags are checked by argument parsing (QueueOptions.validate), with the same check.
        if let value = options.timeout { configuration.requestTimeout = value }
        if let value = try seconds("connect_timeout_seconds", allowZero: false) { configuration.connectTimeout = value }
        if let value = try seconds("settle_seconds", allowZero: true) { configuration.settleDelay = value }
        if let retry = file["retry"] {
            guard let retry = retry as? [String: Any] else { throw configError("\"retry\" must be an object") }
            for key in retry.keys where !["initial_seconds", "maximum_seconds", "jitter"].contains(key) {
                throw configError("unknown key \"retry.\(key)\"")
            }
            if let value = try seconds("initial_seconds", in: retry, name: "retry.initial_seconds", allowZero: true) {
                configuration.retryPolicy.initialDelay = value
            }
            if let value = try seconds("maximum_seconds", in: retry, name: "retry.maximum_seconds", allowZero: true) {
                configuration.retryPolicy.maximumDelay = value
            }
            if let value = try number("jitter", in: retry, name: "retry.jitter") {
                guard (0...1).contains(value) else { throw configError("\"retry.jitter\" must be between 0 and 1") }
                configuration.retryPolicy.jitter = value
            }
        }
        if let path = try environment["DQ_CA_BUNDLE"] ?? string("ca_bundle") {
            guard FileManager.default.isReadableFile(atPath: path) else {
                throw configError("\"ca_bundle\" file \(path) cannot be read")
            }
            configuration.caBundlePath = path
        }

        // Auth
        var authorization: (any AuthorizationProvider)?
        var auth: [String: Any] = [:]
        if let value = file["auth"] {
            guard let object = value as? [String: Any] else { throw configError("\"auth\" must be an object") }
            for key in object.keys where !authKeys.contains(key) {
                throw configError("unknown key \"auth.\(key)\"")
            }
            for (key, value) in object where !(value is String) && !["registration_fields", "registration_headers"].contains(key) {
                throw configError("\"auth.\(key)\" must be a string")
            }
            auth = object
        }
        if let token = environment["DQ_TOKEN"] ?? auth["bearer_token"] as? String {
            guard !token.isEmpty else { throw configError("\"auth.bearer_token\" is empty") }
            authorization = StaticBearerToken(token)
        } else if auth["authorize_type"] != nil || auth["client_id"] != nil || auth["registration_uri"] != nil {
            authorization = try loadOAuth2(
                auth, server: server, environment: environment, configPath: configPath,
                caBundle: configuration.caBundlePath)
        }
        var encryption: Encryption?
        if let value = file["encryption"] {
            encryption = try loadEncryption(value, configPath: configPath)
        }
        return DQSettings(
            server: server, configuration: configuration, authorization: authorization, configPath: configPath,
            encryption: encryption)
    }

    static func loadOAuth2(
        _ auth: [String: Any], server: URL, environment: [String: String], configPath: String?, caBundle: String?
    ) throws -> OAuth2ClientCredentials {
        if let type = auth["authorize_type"] as? String, type != "client_credentials" {
            throw configError("\"auth.authorize_type\" \"\(type)\" is not supported: dq runs unattended and uses \"client_credentials\"")
        }
        func url(_ key: String) throws -> URL? {
            guard let text = auth[key] as? String else { return nil }
            guard let url = URL(string: text), let scheme = url.scheme?.lowercased(), scheme == "http" || scheme == "https",
                url.host != nil
            else { throw configError("\"auth.\(key)\" must be an http(s) URL") }
            return url
        }
        func relative(_ path: String) -> String {
            if path.hasPrefix("/") { return path }
            guard let configPath else { return path }
            return ((configPath as NSString).deletingLastPathComponent as NSString).appendingPathComponent(path)
        }
        var oauth = OAuth2Configuration(fhirBaseURL: server)
        oauth.clientID = auth["client_id"] as? String
        oauth.clientSecret = environment["DQ_CLIENT_SECRET"] ?? auth["client_secret"] as? String
        oauth.tokenURL = try url("token_uri") ?? url("authorize_uri")
        oauth.registrationURI = try url("registration_uri")
        if let name = auth["client_name"] as? String { oauth.clientName = name }
        oauth.scope = auth["scope"] as? String
        oauth.caBundlePath = caBundle
        if let method = auth["token_endpoint_auth_method"] as? String {
            guard let parsed = TokenEndpointAuthMethod(rawValue: method) else {
                throw configError("\"auth.token_endpoint_auth_method\" must be client_secret_basic, client_secret_post or private_key_jwt")
            }
            oauth.authMethod = parsed
        }
        if let path = auth["private_key"] as? String {
            oauth.assertionKey = try ClientAssertionKey(pemFile: relative(path), keyID: auth["key_id"] as? String)
        }
        if oauth.effectiveAuthMethod == .privateKeyJWT && oauth.assertionKey == nil {
            throw configError("\"auth.private_key\" is missing (needed for private_key_jwt)")
        }
        if oauth.effectiveAuthMethod != .privateKeyJWT && oauth.clientID != nil && oauth.clientSecret == nil {
            throw configError("\"auth.client_secret\" is missing (or set DQ_CLIENT_SECRET, or \"auth.private_key\")")
        }
        if let fields = auth["registration_fields"] {
            guard let object = fields as? [String: Any] else { throw configError("\"auth.registration_fields\" must be an object") }
            for (key, value) in object {
                if let flag = value as? Bool, CFGetTypeIDIsBool(value) {
                    oauth.registrationFlags[key] = flag
                } else if let text = value as? String {
                    oauth.registrationFields[key] = text
                } else {
                    throw configError("\"auth.registration_fields.\(key)\" must be a string or a boolean")
                }
            }
        }
        if let headers = auth["registration_headers"] {
            guard let object = headers as? [String: String] else {
                throw configError("\"auth.registration_headers\" must be an object of strings")
            }
            oauth.registrationHeaders = object
        }
        if let directory = auth["credentials_dir"] as? String {
            oauth.credentialStore = CredentialStore(directory: relative(directory))
        }
        if oauth.clientID == nil && oauth.registrationURI == nil && oauth.tokenURL != nil {
            throw configError("\"auth.client_id\" is missing (or set \"auth.registration_uri\" to register dynamically)")
        }
        return try OAuth2ClientCredentials(configuration: oauth)
    }

    /// Whether a JSON value is a boolean (not the numbers 0 and 1).
    static func CFGetTypeIDIsBool(_ value: Any) -> Bool {
        guard let number = value as? NSNumber else { return false }
        return String(cString: number.objCType) == "c" || type(of: value) == Bool.self
    }

    static func loadEncryption(_ value: Any, configPath: String?) throws -> Encryption {
        guard let object = value as? [String: Any] else { throw configError("\"encryption\" must be an object") }
        for key in object.keys where !encryptionKeys.contains(key) {
            throw configError("unknown key \"encryption.\(key)\"")
        }
        func text(_ key: String, required: Bool) throws -> String? {
            guard let value = object[key] else {
                if required { throw configError("\"encryption.\(key)\" is missing") }
                return nil
            }
            guard let string = value as? String, !string.isEmpty else {
                throw configError("\"encryption.\(key)\" must be a non-empty string")
            }
            return string
        }
        let endpointText = try text("endpoint", required: true)!
        guard let endpoint = URL(string: endpointText), let scheme = endpoint.scheme?.lowercased(),
            scheme == "http" || scheme == "https", endpoint.host != nil
        else { throw configError("\"encryption.endpoint\" must be an http(s) URL with a host") }
        var certificatePath = try text("certificate", required: true)!
        if !certificatePath.hasPrefix("/"), let configPath {
            // A relative certificate path is relative to the config file.
            certificatePath = ((configPath as NSString).deletingLastPathComponent as NSString)
                .appendingPathComponent(certificatePath)
        }
        let keyID = try text("key_id", required: true)!
        let version = try text("fhir_version", required: false) ?? "1.0.2"
        let modeText = try text("mode", required: false) ?? "c3pro"
        guard let format = EnvelopeFormat(rawValue: modeText) else {
            throw configError("\"encryption.mode\" must be \"c3pro\" or \"authenticated\"")
        }
        var types: Set<String>?
        if let list = object["resource_types"] {
            guard let array = list as? [String], !array.isEmpty else {
                throw configError("\"encryption.resource_types\" must be a non-empty list of resource type names")
            }
            types = Set(array)
        }
        let recipient: RecipientKey
        do {
            recipient = try RecipientKey(contentsOfFile: certificatePath)
        } catch let error as DataQueueError {
            throw configError(error.message.replacingOccurrences(of: "encryption: ", with: "\"encryption.certificate\": "))
        }
        return Encryption(
            endpoint: endpoint, sealer: EnvelopeSealer(recipient: recipient, keyID: keyID, fhirVersion: version, format: format),
            resourceTypes: types)
    }
}
