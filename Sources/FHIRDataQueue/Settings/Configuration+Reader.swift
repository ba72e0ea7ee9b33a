import Configuration
import Foundation

// The library's configurations read through swift-configuration, under the keys of `dq.json`, as Hummingbird's
// `ApplicationConfiguration(reader:)` reads its own: a host that reads its configuration with a `ConfigReader`
// configures dq from the same sources (pass `reader.scoped(to: "dq")` to keep dq's keys under `dq.`).

extension DataQueue.Configuration {
    /// Reads the queue's configuration from `reader`, under the keys of `dq.json`.
    ///
    /// The keys: `database`, `database_password_file`, `durability` (`full`, `normal`), `idempotent` (`true`,
    /// `false`, `"auto"`), `max_resource_bytes`, `extra_resource_types` (a list), `timeout_seconds`,
    /// `connect_timeout_seconds`, `settle_seconds`, `lease_seconds`, `batch_size`, `batch_max_bytes`,
    /// `retry.initial_seconds`, `retry.maximum_seconds`, `retry.jitter`, `proxy`, `proxy_file`, `no_proxy`,
    /// `tls.ca_bundle` (or `ca_bundle`), `tls.ca_bundle_only`, `tls.client_certificate`, `tls.client_key`,
    /// `encryption.in_flight`, `at_rest.key_file` and `at_rest.old_key_files`. An unset key keeps the default
    /// its property states; secrets (`database` and `proxy` URLs) are read as secrets, so access reporters
    /// redact them. A `…_file` names a file read now (a relative name in `$CREDENTIALS_DIRECTORY` when set).
    ///
    /// ```swift
    /// let reader = ConfigReader(providers: [
    ///     EnvironmentVariablesProvider(),
    ///     try await FileProvider<JSONSnapshot>(filePath: "/etc/gateway/config.json"),
    /// ])
    /// let configuration = try await DataQueue.Configuration(reader: reader.scoped(to: "dq"))
    /// ```
    ///
    /// - Parameter reader: where the values are read; the other keys of the reader are not looked at.
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key of a value of the wrong type or out
    ///   of range, or a file it names that cannot be read.
    public init(reader: ConfigReader) async throws {
        self = try await DataQueueSettings.withSecretFiles(reader).queueConfiguration()
    }
}

extension OAuth2Configuration {
    /// Reads OAuth2 client_credentials from `reader`, under the keys of `dq.json`: `server` (the FHIR base URL
    /// whose SMART configuration names the token endpoint), `auth.client_id`, `auth.client_secret` (a secret;
    /// or `auth.client_secret_file`), `auth.token_uri` (or `auth.authorize_uri`), `auth.scope`,
    /// `auth.token_endpoint_auth_method`, `auth.private_key`, `auth.key_id`, `auth.key_alg`,
    /// `auth.registration_uri`, `auth.client_name`, `auth.registration_fields` and `auth.registration_headers`
    /// (JSON objects), `auth.credentials_dir`, and the network keys of ``DataQueue/Configuration/init(reader:)``.
    ///
    /// ```swift
    /// let oauth = try await OAuth2Configuration(reader: reader.scoped(to: "dq"))
    /// let authorization = try OAuth2ClientCredentials(configuration: oauth)
    /// ```
    ///
    /// - Parameter reader: where the values are read.
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key of the first bad or missing value.
    public init(reader: ConfigReader) async throws {
        let settings = try await DataQueueSettings.withSecretFiles(reader)
        let values = try settings.checkedValues()
        self = try settings.oauth2Configuration(settings.auth ?? .init(), server: values.server, network: values.network)
    }
}

extension AuthorizationCodeClient.Configuration {
    /// Reads a sign-in client (`authorize_type` `authorization_code`) from `reader`, under the keys of
    /// `dq.json`: `server`, `auth.client_id` (required), `auth.client_secret` (a secret; or
    /// `auth.client_secret_file`), `auth.authorize_uri`, `auth.token_uri`, `auth.issuer`, `auth.revocation_uri`,
    /// `auth.scope`, `auth.token_endpoint_auth_method`, `auth.private_key`, `auth.key_id`, `auth.key_alg`,
    /// `auth.credentials_dir`, and the network keys of ``DataQueue/Configuration/init(reader:)``.
    ///
    /// ```swift
    /// let client = AuthorizationCodeClient(configuration: try await .init(reader: reader))
    /// ```
    ///
    /// - Parameter reader: where the values are read.
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the key of the first bad or missing value.
    public init(reader: ConfigReader) async throws {
        let settings = try await DataQueueSettings.withSecretFiles(reader)
        let values = try settings.checkedValues()
        self = try settings.authorizationCodeConfiguration(settings.auth ?? .init(), server: values.server, network: values.network)
    }
}

extension DataQueueSettings {
    /// The settings `reader` gives, with the `…_file` secrets read and the database password in its URL.
    static func withSecretFiles(_ reader: ConfigReader) async throws -> DataQueueSettings {
        var settings = try await DataQueueSettings(reader: reader)
        let environment = ProcessInfo.processInfo.environment
        try settings.readSecretFiles(environment: environment)
        try settings.applyDatabasePassword()
        return settings
    }
}
