import Foundation

extension AuthorizationCodeClient {
    /// The settings of a person's sign-in: SMART standalone launch with the OAuth2 authorization code flow,
    /// PKCE and, with `openid` in the scope, an ID token (see ``AuthorizationCodeClient``).
    ///
    /// ```swift
    /// var configuration = AuthorizationCodeClient.Configuration(fhirBaseURL: base, clientID: "my-app")
    /// configuration.scope = "launch/patient openid fhirUser offline_access patient/*.cruds"
    /// ```
    public struct Configuration: Sendable {
        /// The scope dq asks for unless told otherwise: the patient's context, the person's identity, a
        /// refresh token for unattended work, and access to the patient's data.
        public static let defaultScope = "launch/patient openid fhirUser offline_access patient/*.cruds"

        /// The FHIR base URL: where discovery starts, the `aud` of the authorization request, and (with the
        /// client id) the key under which the sign-in is stored.
        public var fhirBaseURL: URL
        /// The client id registered with the authorization server.
        public var clientID: String
        /// The client secret of a confidential client. The default is nil (a public client).
        public var clientSecret: String?
        /// How the client authenticates at the token and revocation endpoints. The default is nil:
        /// `private_key_jwt` with a key, `client_secret_basic` with a secret, else `none` (a public client).
        public var authMethod: OAuth2Configuration.TokenEndpointAuthMethod?
        /// The signing key for `private_key_jwt`. The default is nil.
        public var assertionKey: OAuth2Configuration.ClientAssertionKey?
        /// The scope asked for. The default is ``defaultScope``.
        public var scope: String
        /// The OpenID issuer. nil: from the SMART configuration. It must equal the ID token's `iss`.
        public var issuer: String?
        /// The authorization endpoint. nil: discovered.
        public var authorizationURL: URL?
        /// The token endpoint. nil: discovered.
        public var tokenURL: URL?
        /// The RFC 7009 revocation endpoint. nil: discovered, if the server offers one.
        public var revocationURL: URL?
        /// Where the sign-in is kept. The default is ``OAuth2Configuration/CredentialStore/defaultDirectory(environment:)``.
        public var credentialsDirectory: String
        /// The deadline of each request to the authorization server, in seconds. The default is 30.
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
        public init(fhirBaseURL: URL, clientID: String) {
            self.fhirBaseURL = fhirBaseURL
            self.clientID = clientID
            self.scope = Self.defaultScope
            self.credentialsDirectory = OAuth2Configuration.CredentialStore.defaultDirectory()
            self.timeout = 30
        }

        /// The method in use (see ``authMethod``).
        public var effectiveAuthMethod: OAuth2Configuration.TokenEndpointAuthMethod {
            authMethod ?? (assertionKey != nil ? .privateKeyJWT : clientSecret != nil ? .clientSecretBasic : .none)
        }

        /// Whether the scope asks for an ID token.
        public var asksForIDToken: Bool { scope.split(separator: " ").contains("openid") }
    }
}

extension AuthorizationCodeClient.Configuration: RedactedDescription {
    /// Every setting; the client secret and the signing key redacted, and the password of any URL.
    package var redactedFields: [RedactedField] {
        [
            .url("fhirBaseURL", fhirBaseURL), .plain("clientID", clientID), .secret("clientSecret", clientSecret),
            .plain("authMethod", authMethod), .plain("assertionKey", assertionKey), .plain("scope", scope),
            .url("issuer", issuer), .url("authorizationURL", authorizationURL), .url("tokenURL", tokenURL),
            .url("revocationURL", revocationURL), .plain("credentialsDirectory", credentialsDirectory),
            .plain("timeout", timeout), .plain("network", network),
        ]
    }
}

extension AuthorizationCodeClient: RedactedDescription {
    /// Its configuration, without secrets; never the sign-in (tokens) it holds.
    package nonisolated var redactedFields: [RedactedField] { [.plain("configuration", configuration)] }
}
