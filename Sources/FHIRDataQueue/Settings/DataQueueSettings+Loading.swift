import Configuration
import Foundation
import Logging

extension DataQueueSettings {
    // MARK: - Loading

    /// The settings of one `dq` run, read through ``SettingsReader``: `flags` (values by key), then the `DQ_*`
    /// variables of `environment`, then the config file (`config`, else `$DQ_CONFIG`, else the first of
    /// ``configSearchPath(environment:)`` that exists); then the `…_file` secrets are read, the proxy
    /// variables noted and the database password put into a PostgreSQL URL.
    ///
    /// - Parameter accessReporter: told of every value read and where it came from (`dq config`).
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key or variable of the first bad value.
    package static func load(
        config: String?, flags: [String: ConfigContent] = [:], environment: [String: String],
        accessReporter: (any AccessReporter)? = nil
    ) async throws -> DataQueueSettings {
        let (reader, file) = try SettingsReader.make(
            config: config, flags: flags, environment: environment, accessReporter: accessReporter)
        return try await DataQueueSettings(reader: reader, file: file, environment: environment)
    }

    /// The settings `reader` gives, as a run uses them: paths relative to `file`'s directory, the `…_file`
    /// secrets read, the proxy variables of `environment` noted and the database password put into a PostgreSQL URL.
    ///
    /// - Parameter file: the config file `reader` reads (see ``SettingsReader/make(config:flags:environment:keys:accessReporter:)``).
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key or variable of the first bad value.
    package init(reader: ConfigReader, file: SettingsFile?, environment: [String: String]) async throws {
        self = try await DataQueueSettings(reader: reader)
        if let path = file?.path {
            // The directory of the file as named from the working directory (`dq.json` alone names no directory,
            // and its relative paths would otherwise be read from `/`).
            let absolute = path.hasPrefix("/") ? path : FileManager.default.currentDirectoryPath + "/" + path
            baseDirectory = QueuePaths.directory(of: absolute)
            sourcePath = path
            fileHoldsSecret = file?.holdsSecret ?? false
        }
        environmentNetwork.apply(environment: environment)
        try readSecretFiles(environment: environment)
        noteExposedKeyFiles(environment: environment)
        try applyDatabasePassword()
    }

    /// Reads a settings file (with no variable or secret file); relative paths in it are relative to its directory.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when the file cannot be read, is not a JSON
    ///   object, or has an unknown key or a value of the wrong type.
    package static func load(contentsOf path: String) async throws -> DataQueueSettings {
        var settings = try await DataQueueSettings(reader: SettingsReader.make(environment: [:], file: SettingsFile(contentsOf: path)))
        let absolute = path.hasPrefix("/") ? path : FileManager.default.currentDirectoryPath + "/" + path
        settings.baseDirectory = QueuePaths.directory(of: absolute)
        settings.sourcePath = path
        settings.fileHoldsSecret = try SettingsFile(contentsOf: path).holdsSecret
        return settings
    }

    /// Reads settings from JSON bytes and the `DQ_` variables of `environment` over them (no secret file is
    /// read); `source` names the bytes in errors.
    package static func decode(
        _ data: Data, source: String = "the settings", environment: [String: String] = [:]
    ) async throws -> DataQueueSettings {
        let file = try SettingsFile(data: data, source: source)
        var settings = try await DataQueueSettings(reader: SettingsReader.make(environment: environment, file: file))
        settings.environmentNetwork.apply(environment: environment)
        return settings
    }

    /// The object JSON bytes hold, once they pass the checks swift-configuration's `JSONSnapshot` does not make:
    /// no byte order mark, strict JSON (see ``checkStrict(_:source:)``), an object at the top; where the JSON
    /// breaks is named by line and column.
    static func checkedObject(_ data: Data, source: String) throws -> [String: Any] {
        if data.starts(with: [0xEF, 0xBB, 0xBF]) {
            throw configError("\(source) starts with a byte order mark (a UTF-8 BOM): save it as UTF-8 without one")
        }
        guard let parsed = try? JSONSerialization.jsonObject(with: data) else {
            // Where the JSON breaks (never the text around it): Foundation's parser names a character offset.
            if let at = errorOffset(in: data) {
                let before = data.prefix(at)
                let line = before.reduce(1) { $1 == UInt8(ascii: "\n") ? $0 + 1 : $0 }
                let column = at - (before.lastIndex(of: UInt8(ascii: "\n")).map { $0 - data.startIndex + 1 } ?? 0) + 1
                throw configError("\(source) is not a JSON object: invalid JSON at line \(line), column \(column)")
            }
            throw configError("\(source) is not a JSON object")
        }
        guard let object = parsed as? [String: Any] else { throw configError("\(source) is not a JSON object") }
        try checkStrict(data, source: source)
        return object
    }

    /// The JSON rules resource files follow, for settings too: no key twice in any object, at any depth (jq and
    /// Python take the last, Foundation the first), no trailing comma.
    private static func checkStrict(_ data: Data, source: String) throws {
        // Every key the settings use, at any depth: the scanner records where the members it is asked for lie.
        func keys(_ value: Any) -> Set<String> {
            if let object = value as? [String: Any] {
                return object.reduce(into: Set(object.keys)) { $0.formUnion(keys($1.value)) }
            }
            return (value as? [Any])?.reduce(into: Set()) { $0.formUnion(keys($1)) } ?? []
        }
        let names = keys((try? JSONSerialization.jsonObject(with: data)) ?? [:])
        func check(_ range: Range<Int>, in object: String?) throws {
            let document: JSONScanner.Document
            do {
                document = try JSONScanner.scan(data, range, keys: names)
            } catch {
                if case .duplicateKey(let key) = error {
                    let name = (object.map { $0 + "." } ?? "") + FHIRResource.printable(key)
                    throw configError("\"\(name)\" appears twice in \(source) (give it once)")
                }
                throw configError("\(source) is not strict JSON (a trailing comma, or a comment?)")
            }
            for (name, member) in document.members where data[data.startIndex + member.lowerBound] == UInt8(ascii: "{") {
                try check(member, in: (object.map { $0 + "." } ?? "") + FHIRResource.printable(name))
            }
        }
        try check(0..<data.count, in: nil)
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

    // MARK: - Resolving

    /// What the settings make: the pieces of a queue, each value checked.
    package struct Resolved: Sendable {
        /// The FHIR base URL.
        package var server: URL
        /// The queue's configuration.
        package var configuration: DataQueue.Configuration
        /// How requests are authorized, if at all.
        package var authorization: (any AuthorizationProvider)?
        /// The encrypted endpoint, if any.
        package var encryption: ResolvedEncryption?
    }

    /// The `encryption` object, resolved.
    package struct ResolvedEncryption: Sendable {
        /// Where envelopes go.
        package var endpoint: URL
        /// The sealer with the receiver's key.
        package var sealer: EnvelopeSealer
        /// The types to encrypt; nil: every resource.
        package var resourceTypes: Set<String>?
    }

    /// Checks every value and builds the queue's pieces. No file other than the certificate and keys named
    /// in the settings is read, and nothing is written.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key of the first bad value.
    package func resolve() throws -> Resolved {
        let values = try checkedValues()
        var configuration = try queueConfiguration(values)
        let serverURL = values.server
        var authorization: (any AuthorizationProvider)?
        if let auth {
            if let token = auth.bearerToken {
                guard !token.isEmpty else { throw Self.configError("\"auth.bearer_token\" is empty") }
                authorization = StaticBearerToken(token)
            } else if auth.authorizeType == .authorizationCode {
                authorization = AuthorizationCodeClient(
                    configuration: try authorizationCodeConfiguration(auth, server: serverURL, network: configuration.network))
            } else if auth.authorizeType != nil || auth.clientID != nil || auth.registrationURI != nil {
                authorization = try OAuth2ClientCredentials(
                    configuration: oauth2Configuration(auth, server: serverURL, network: configuration.network))
            }
        }
        configuration.atRest = try resolveAtRest()
        configuration.envelopeKeyring = envelopeKeyring
        if let duplicateWindow { configuration.duplicateWindow = duplicateWindow }
        if let writePolicy { configuration.writePolicy = writePolicy }
        configuration.envelopeBatches = envelopeBatches
        return Resolved(
            server: serverURL, configuration: configuration, authorization: authorization,
            encryption: try encryption.map(resolveEncryption))
    }

    /// The queue's configuration (every key but `server`, `auth` and `encryption`'s others), checked; the at-rest
    /// keys are read from their files.
    package func queueConfiguration() throws -> DataQueue.Configuration {
        // No server is needed for the queue's own values: a placeholder stands in for the check of the others.
        var values = CheckedValues(server: URL(fileURLWithPath: "/"), queueName: "")
        try checkOptions(&values)
        var configuration = try queueConfiguration(values)
        configuration.atRest = try resolveAtRest()
        configuration.envelopeKeyring = envelopeKeyring
        if let duplicateWindow { configuration.duplicateWindow = duplicateWindow }
        if let writePolicy { configuration.writePolicy = writePolicy }
        configuration.envelopeBatches = envelopeBatches
        return configuration
    }

    private func queueConfiguration(_ values: CheckedValues) throws -> DataQueue.Configuration {
        var configuration = DataQueue.Configuration()
        if let value = values.database { configuration.databasePath = value }
        if let value = values.durability { configuration.durability = value }
        if let idempotent { configuration.idempotent = idempotent }
        if let value = values.maximumResourceSize { configuration.maximumResourceSize = value }
        if let extra = extraResourceTypes {
            if let bad = extra.first(where: { $0 != "*" && !FHIRResource.isValidTypeName($0) }) {
                throw Self.configError(
                    "\"extra_resource_types\" holds \(FHIRResource.printable(bad)), not a resource type name (or \"*\" for any)")
            }
            configuration.resourceTypes = extra.contains("*") ? .any : .r4(adding: Set(extra))
        }
        if let value = values.batchSize { configuration.batchSize = value }
        if let value = values.batchMaxBytes { configuration.batchMaxBytes = value }
        if let value = values.requestTimeout { configuration.requestTimeout = value }
        if let value = values.connectTimeout { configuration.connectTimeout = value }
        if let value = values.leaseDuration { configuration.leaseDuration = value }
        if let value = values.settleDelay { configuration.settleDelay = value }
        if let value = values.retryInitialDelay { configuration.retryPolicy.initialDelay = value }
        if let value = values.retryMaximumDelay { configuration.retryPolicy.maximumDelay = value }
        if let value = values.retryJitter { configuration.retryPolicy.jitter = value }
        configuration.network = values.network
        if let value = encryption?.inFlight {
            guard (1...64).contains(value) else { throw Self.inFlightError }
            configuration.encryptedInFlight = value
        }
        return configuration
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
    package func makeQueue(readOnly: Bool = false, logger: Logger) async throws -> DataQueue {
        var resolved = try resolve()
        resolved.configuration.readOnly = readOnly
        if let encryption = resolved.encryption {
            let types = encryption.resourceTypes
            return try await EncryptedDataQueue(
                baseURL: resolved.server, encryptedBaseURL: encryption.endpoint, sealer: encryption.sealer,
                shouldEncrypt: { resource in types?.contains(resource.resourceType) ?? true },
                configuration: resolved.configuration, authorization: resolved.authorization, logger: logger)
        }
        return try await DataQueue(
            baseURL: resolved.server, configuration: resolved.configuration, authorization: resolved.authorization,
            logger: logger)
    }

    // MARK: - Pieces

    /// The `at_rest` keys, read from their files (found as other `…_file` secrets are).
    private func resolveAtRest() throws -> AtRestKeys? {
        guard let atRest else { return nil }
        guard let name = atRest.keyFile, !name.isEmpty else {
            throw Self.configError("\"at_rest.key_file\" is missing (make a key with dq keygen --at-rest --out FILE)")
        }
        let environment = ProcessInfo.processInfo.environment
        let current = try AtRestKey(contentsOfFile: secretFilePath(name, environment: environment), setting: "at_rest.key_file")
        let old = try (atRest.oldKeyFiles ?? []).map {
            try AtRestKey(contentsOfFile: secretFilePath($0, environment: environment), setting: "at_rest.old_key_files")
        }
        return AtRestKeys(current: current, old: old)
    }

    private func relative(_ path: String) -> String {
        if path.hasPrefix("/") { return path }
        guard let baseDirectory, !baseDirectory.isEmpty else { return path }
        return (baseDirectory as NSString).appendingPathComponent(path)
    }

    /// An `auth` URL key's value: nil when absent, else an http(s) URL with a host.
    private static func authURL(_ text: String?, _ key: String) throws -> URL? {
        guard let text else { return nil }
        try URLPort.check(text, setting: "configuration: \"auth.\(key)\"")
        guard let url = URL(string: text), let scheme = url.scheme?.lowercased(), scheme == "http" || scheme == "https",
            url.host != nil
        else { throw configError("\"auth.\(key)\" must be an http(s) URL") }
        if let port = url.port, !(1...65535).contains(port) {
            throw configError("\"auth.\(key)\" has port \(port), not one from 1 to 65535")
        }
        return url
    }

    /// `token_endpoint_auth_method`, `private_key`, `key_id` and `key_alg`, checked.
    private func clientAuthentication(_ auth: Auth, allowNone: Bool) throws -> (
        OAuth2Configuration.TokenEndpointAuthMethod?, OAuth2Configuration.ClientAssertionKey?
    ) {
        var method: OAuth2Configuration.TokenEndpointAuthMethod?
        if let parsed = auth.tokenEndpointAuthMethod {
            guard allowNone || parsed != .none else {
                throw Self.configError(
                    "\"auth.token_endpoint_auth_method\" must be client_secret_basic, client_secret_post\(allowNone ? ", none" : "") or private_key_jwt"
                )
            }
            method = parsed
        }
        let keyAlgorithm = auth.keyAlgorithm
        var key: OAuth2Configuration.ClientAssertionKey?
        if let path = auth.privateKey {
            key = try OAuth2Configuration.ClientAssertionKey(pemFile: keyFilePath(path), keyID: auth.keyID, algorithm: keyAlgorithm)
        } else if keyAlgorithm != nil {
            throw Self.configError("\"auth.key_alg\" is set but \"auth.private_key\" is not")
        }
        return (method, key)
    }

    /// The `auth` object for `authorization_code`, checked.
    func authorizationCodeConfiguration(
        _ auth: Auth, server: URL, network: NetworkConfiguration
    ) throws -> AuthorizationCodeClient.Configuration {
        for (key, set) in [("registration_uri", auth.registrationURI != nil), ("registration_fields", auth.registrationFields != nil)]
        where set {
            throw Self.configError("\"auth.\(key)\" is for client_credentials; with authorization_code give \"auth.client_id\"")
        }
        guard let clientID = auth.clientID, !clientID.isEmpty else {
            throw Self.configError("\"auth.client_id\" is missing (authorization_code needs the client id the server registered)")
        }
        var configuration = AuthorizationCodeClient.Configuration(fhirBaseURL: server, clientID: clientID)
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
        configuration.network = network
        return configuration
    }

    /// The `auth` object for `client_credentials`, checked.
    func oauth2Configuration(_ auth: Auth, server: URL, network: NetworkConfiguration) throws -> OAuth2Configuration {
        if auth.issuer != nil || auth.revocationURI != nil {
            throw Self.configError("\"auth.issuer\" and \"auth.revocation_uri\" belong to \"authorize_type\": \"authorization_code\"")
        }
        let url = Self.authURL
        var oauth = OAuth2Configuration(fhirBaseURL: server)
        oauth.clientID = auth.clientID
        oauth.clientSecret = auth.clientSecret
        oauth.tokenURL = try url(auth.tokenURI, "token_uri") ?? url(auth.authorizeURI, "authorize_uri")
        oauth.registrationURI = try url(auth.registrationURI, "registration_uri")
        if let name = auth.clientName { oauth.clientName = name }
        oauth.scope = auth.scope
        oauth.network = network
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
            oauth.credentialStore = OAuth2Configuration.CredentialStore(directory: relative(directory))
        }
        if oauth.clientID == nil && oauth.registrationURI == nil && oauth.tokenURL != nil {
            throw Self.configError("\"auth.client_id\" is missing (or set \"auth.registration_uri\" to register dynamically)")
        }
        return oauth
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
        let format = object.mode ?? .c3pro
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

}
