import Foundation

extension OAuth2Configuration {
    /// How ``OAuth2ClientCredentials`` authenticates to the token endpoint.
    public enum TokenEndpointAuthMethod: String, Sendable, CaseIterable {
        /// HTTP Basic with the client id and secret, each form-urlencoded first (RFC 6749 §2.3.1).
        case clientSecretBasic = "client_secret_basic"
        /// `client_id` and `client_secret` in the form body.
        case clientSecretPost = "client_secret_post"
        /// A signed JWT client assertion (RFC 7523, SMART Backend Services).
        case privateKeyJWT = "private_key_jwt"
        /// No client authentication: a public client sends only its `client_id` (authorization code flow
        /// with PKCE; not allowed for client_credentials).
        case none = "none"
    }
}

/// The settings of an OAuth2 client_credentials client (and of its dynamic registration).
///
/// ```swift
/// var configuration = OAuth2Configuration(fhirBaseURL: base)
/// configuration.clientID = "c1"
/// configuration.clientSecret = secret
/// ```
public struct OAuth2Configuration: Sendable {
    /// The FHIR base URL, for discovery and as the default `aud`.
    public var fhirBaseURL: URL
    /// The client id; nil with a ``registrationURI`` makes dq register itself. The default is nil.
    public var clientID: String?
    /// The client secret, for the secret methods. The default is nil.
    public var clientSecret: String?
    /// The token endpoint. nil: discovered from `[base]/.well-known/smart-configuration`, then the
    /// CapabilityStatement's `oauth-uris` extension. The default is nil.
    public var tokenURL: URL?
    /// The token endpoint auth method. The default is `client_secret_basic`, or `private_key_jwt` with a key.
    public var authMethod: OAuth2Configuration.TokenEndpointAuthMethod?
    /// The signing key for `private_key_jwt`. The default is nil.
    public var assertionKey: OAuth2Configuration.ClientAssertionKey?
    /// The scope requested. The default is `system/*.cruds`... unless the server grants less.
    public var scope: String?
    /// The RFC 7591 registration endpoint. nil: discovered when registration is needed. The default is nil.
    public var registrationURI: URL?
    /// The `client_name` sent when registering. The default is `dq`.
    public var clientName: String
    /// Extra members of the registration request body (e.g. C3-PRO's `sandbox`, `receipt-data`,
    /// or `software_statement`). The default is none.
    public var registrationFields: [String: String]
    /// Boolean extra members of the registration body (e.g. `"sandbox": true`). The default is none.
    public var registrationFlags: [String: Bool]
    /// Extra headers of the registration request (e.g. C3-PRO's `Antispam`). The default is none.
    public var registrationHeaders: [String: String]
    /// Where registered credentials are kept. The default is ``OAuth2Configuration/CredentialStore/init(directory:)``.
    public var credentialStore: OAuth2Configuration.CredentialStore
    /// Renew a token this many seconds before it expires. The default is 60.
    public var renewalSkew: TimeInterval
    /// The deadline of a token or registration request, in seconds. The default is 30.
    public var timeout: TimeInterval
    /// Proxies, trust and the client certificate for requests to the authorization server. The default is
    /// direct connections with the system's trust store.
    public var network = NetworkConfiguration()
    /// A PEM file of CA certificates trusted in addition to the system's (private PKI). The default is nil.
    public var caBundlePath: String? {
        get { network.caBundlePath }
        set { network.caBundlePath = newValue }
    }

    /// Creates a configuration; every other property has the default stated on it.
    public init(fhirBaseURL: URL) {
        self.fhirBaseURL = fhirBaseURL
        self.clientName = "dq"
        self.registrationFields = [:]
        self.registrationFlags = [:]
        self.registrationHeaders = [:]
        self.credentialStore = OAuth2Configuration.CredentialStore()
        self.renewalSkew = 60
        self.timeout = 30
    }

    /// The method in use: ``authMethod``, else `private_key_jwt` with a key, else `client_secret_basic`.
    public var effectiveAuthMethod: OAuth2Configuration.TokenEndpointAuthMethod {
        authMethod ?? (assertionKey != nil ? .privateKeyJWT : .clientSecretBasic)
    }
}

extension OAuth2Configuration: RedactedDescription {
    /// Every setting; the client secret, the signing key and the values of registration fields and headers
    /// redacted, and the password of any URL.
    package var redactedFields: [RedactedField] {
        [
            .url("fhirBaseURL", fhirBaseURL), .plain("clientID", clientID), .secret("clientSecret", clientSecret),
            .url("tokenURL", tokenURL), .plain("authMethod", authMethod), .plain("assertionKey", assertionKey),
            .plain("scope", scope), .url("registrationURI", registrationURI), .plain("clientName", clientName),
            .secretValues("registrationFields", registrationFields), .plain("registrationFlags", registrationFlags),
            .secretValues("registrationHeaders", registrationHeaders), .plain("credentialStore", credentialStore),
            .plain("renewalSkew", renewalSkew), .plain("timeout", timeout), .plain("network", network),
        ]
    }
}

extension OAuth2Configuration.ClientAssertionKey: RedactedDescription {
    /// The key's id and algorithm; the private key itself redacted.
    package var redactedFields: [RedactedField] {
        [.custom("backing", thumbprint, shown: Redaction.Secret()), .plain("keyID", keyID), .plain("algorithm", algorithm)]
    }
}

extension OAuth2ClientCredentials: RedactedDescription {
    /// Its configuration, without secrets; never a token or registered credentials it holds.
    package nonisolated var redactedFields: [RedactedField] { [.plain("configuration", configuration)] }
}
