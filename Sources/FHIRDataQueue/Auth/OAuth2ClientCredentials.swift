import AsyncHTTPClient
import Foundation
import Logging
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import NIOSSL

/// OAuth2 client_credentials (with a client secret or a SMART Backend Services signed assertion), with
/// endpoint discovery, RFC 7591 dynamic registration, and a token cache.
///
/// One token request is in flight at a time however many sends wait on it; a token is renewed
/// ``OAuth2Configuration/renewalSkew`` seconds before it expires, and after a 401 the queue asks for a
/// fresh one once. Secrets, assertions and tokens are never logged or put in error messages.
///
/// ```swift
/// var configuration = OAuth2Configuration(fhirBaseURL: base)
/// configuration.clientID = "c1"; configuration.clientSecret = secret
/// let auth = try OAuth2ClientCredentials(configuration: configuration)
/// let queue = try await DataQueue(baseURL: base, authorization: auth)
/// ```
///
/// > Important: call ``shutdown()`` when done.
public actor OAuth2ClientCredentials: AuthorizationProvider {
    /// The settings.
    public nonisolated let configuration: OAuth2Configuration
    private let http: OAuth2HTTP
    private var token: (value: String, renewAt: Date)?
    private var inflight: Task<String, any Error>?
    private var endpoints: (token: URL, registration: URL?)?
    private var credentials: (id: String, secret: String?)?
    /// Set when the token endpoint accepted HTTP Basic credentials only without form-urlencoding.
    private var rawBasicCredentials = false
    /// How many token requests were made (for tests and `dq status`).
    package private(set) var tokenRequests = 0

    /// Creates the client. No request is made until a token is needed.
    ///
    /// - Parameters:
    ///   - configuration: the token endpoint, the client's credentials or registration, and the scope.
    ///   - httpClient: an HTTP client of the caller's for the token and registration requests (give the queue the
    ///     same one). The default is nil: the process's shared client for `configuration.network`.
    public init(configuration: OAuth2Configuration, httpClient: HTTPClient? = nil) throws {
        guard configuration.effectiveAuthMethod != .none else {
            throw DataQueueError(.invalidConfiguration, "configuration: client_credentials needs a client secret or key, not \"none\"")
        }
        self.configuration = configuration
        self.http = try OAuth2HTTP(network: configuration.network, timeout: configuration.timeout, client: httpClient)
        if let id = configuration.clientID { credentials = (id, configuration.clientSecret) }
    }

    private var isShutDown = false

    /// Releases the HTTP client. Calling it again does nothing.
    public func shutdown() async throws {
        guard !isShutDown else { return }
        isShutDown = true
        try await http.shutdown()
    }

    /// `Bearer <token>`, from the cache or a new token request (see ``accessToken(forceRefresh:logger:)``).
    public nonisolated func authorizationHeader(forceRefresh: Bool, logger: Logger) async throws -> String? {
        "Bearer " + (try await accessToken(forceRefresh: forceRefresh, logger: logger))
    }

    /// After the server refused `refused`: a new token, unless the cached token is already another one (a
    /// concurrent sender renewed it), so that many refusals of one token cost one token request.
    public func authorizationHeader(replacing refused: String, logger: Logger) async throws -> String? {
        if inflight == nil, let token, "Bearer " + token.value != refused, token.renewAt > Date() {
            return "Bearer " + token.value
        }
        return "Bearer " + (try await accessToken(forceRefresh: true, logger: logger))
    }

    /// A valid access token, from the cache or a new token request.
    public func accessToken(forceRefresh: Bool = false, logger: Logger? = nil) async throws -> String {
        if let inflight { return try await inflight.value }
        if !forceRefresh, let token, token.renewAt > Date() {
            return token.value
        }
        let log = logger ?? Logger(label: "dq.auth", factory: { _ in SwiftLogNoOpLogHandler() })
        let task = Task { try await self.requestToken(logger: log) }
        inflight = task
        do {
            let value = try await task.value
            inflight = nil
            return value
        } catch {
            inflight = nil
            throw error
        }
    }

    /// For `dq doctor`: asks the token endpoint (discovered if need be) for a new token, as a flush would. A
    /// client that has still to register (no `client_id`, no stored registration) is not registered here: then
    /// only the token endpoint is found, and nil is returned.
    ///
    /// - Returns: the token endpoint that issued a token, or nil when the client is not registered yet.
    /// - Throws: ``DataQueueError``: `.transport` when an endpoint does not answer, `.authentication` when the
    ///   token endpoint refuses the client, `.invalidConfiguration` when no token endpoint can be found.
    package func checkTokenEndpoint(logger: Logger) async throws -> URL? {
        let endpoints = try await resolveEndpoints()
        if credentials == nil {
            guard let registration = endpoints.registration else { throw Self.noRegistration }
            guard let stored = try configuration.credentialStore.load(registrationURI: registration.absoluteString) else { return nil }
            credentials = (stored.clientID, stored.clientSecret)
        }
        _ = try await accessToken(forceRefresh: true, logger: logger)
        return endpoints.token
    }

    // MARK: - Token request

    private func requestToken(logger: Logger) async throws -> String {
        let tokenURL = try await resolveEndpoints().token
        let (clientID, secret) = try await clientCredentials(logger: logger)
        var form: [(String, String)] = [("grant_type", "client_credentials")]
        if let scope = configuration.scope { form.append(("scope", scope)) }
        var headers = HTTPHeaders()
        let method = configuration.effectiveAuthMethod
        try await OAuth2HTTP.authenticate(
            method, clientID: clientID, secret: secret, key: configuration.assertionKey, audience: tokenURL, form: &form,
            headers: &headers, rawBasic: rawBasicCredentials)
        logger.debug("requesting a token", metadata: ["endpoint": "\(tokenURL.absoluteString)", "method": "\(method.rawValue)"])
        tokenRequests += 1
        var (status, body) = try await http.post(tokenURL, form: form, headers: headers)
        if method == .clientSecretBasic, status == 401, !rawBasicCredentials,
            OAuth2HTTP.formEncode(clientID) != clientID || OAuth2HTTP.formEncode(secret ?? "") != (secret ?? "")
        {
            // Some servers do not form-urldecode Basic credentials (RFC 6749 §2.3.1); try them raw once.
            headers.replaceOrAdd(name: "Authorization", value: OAuth2HTTP.basic(clientID, secret ?? "", encoded: false))
            tokenRequests += 1
            (status, body) = try await http.post(tokenURL, form: form, headers: headers)
            if (200..<300).contains(status) { rawBasicCredentials = true }
        }
        let parsed = try Self.parseTokenResponse(status: status, body: body)
        // Renew ahead of expiry by the skew, but never by more than a quarter of a short lifetime.
        let skew = min(configuration.renewalSkew, parsed.expiresIn / 4)
        token = (parsed.token, Date().addingTimeInterval(parsed.expiresIn - skew))
        logger.debug("token obtained", metadata: ["expires_in": "\(Int(parsed.expiresIn))"])
        return parsed.token
    }

    /// Reads a token response: 200 or 202, `access_token`, `expires_in` as a number or a string.
    static func parseTokenResponse(status: Int, body: Data) throws -> (token: String, expiresIn: TimeInterval) {
        guard (200..<300).contains(status) else {
            throw OAuth2HTTP.failure("the token endpoint", status: status, body: body, refused: "refused the client")
        }
        let object = (try? JSONSerialization.jsonObject(with: OAuth2HTTP.lenientJSON(body))) as? [String: Any]
        guard let token = object?["access_token"] as? String, !token.isEmpty else {
            throw DataQueueError(.authentication, "the token endpoint's answer has no access_token")
        }
        var expiresIn: TimeInterval = 300
        if let number = object?["expires_in"] as? NSNumber {
            expiresIn = number.doubleValue
        } else if let text = object?["expires_in"] as? String, let value = Double(text) {
            expiresIn = value
        }
        return (token, max(expiresIn, 1))
    }

    // MARK: - Credentials and registration

    private func clientCredentials(logger: Logger) async throws -> (String, String?) {
        if let credentials { return credentials }
        guard let registration = try await resolveEndpoints().registration else { throw Self.noRegistration }
        if let stored = try configuration.credentialStore.load(registrationURI: registration.absoluteString) {
            logger.debug("using stored registered credentials")
            credentials = (stored.clientID, stored.clientSecret)
            return (stored.clientID, stored.clientSecret)
        }
        let stored = try await register(at: registration, logger: logger)
        return (stored.clientID, stored.clientSecret)
    }

    /// No `client_id`, and nowhere to register one.
    static let noRegistration = DataQueueError(
        .invalidConfiguration, "configuration: \"auth.client_id\" is missing and there is no \"auth.registration_uri\" to register with")

    /// Registers this client now (RFC 7591) and stores the credentials, replacing earlier ones.
    @discardableResult
    package func register(logger: Logger? = nil) async throws -> StoredCredentials {
        guard let registration = try await resolveEndpoints().registration else {
            throw DataQueueError(.invalidConfiguration, "configuration: \"auth.registration_uri\" is missing")
        }
        return try await register(
            at: registration, logger: logger ?? Logger(label: "dq.auth", factory: { _ in SwiftLogNoOpLogHandler() }))
    }

    private func register(at url: URL, logger: Logger) async throws -> StoredCredentials {
        let method = configuration.effectiveAuthMethod
        var body: [String: Any] = [
            "client_name": configuration.clientName, "grant_types": ["client_credentials"],
            "token_endpoint_auth_method": method.rawValue,
        ]
        if let scope = configuration.scope { body["scope"] = scope }
        if let key = configuration.assertionKey { body["jwks"] = ["keys": [key.publicJWK]] }
        for (key, value) in configuration.registrationFields { body[key] = value }
        for (key, value) in configuration.registrationFlags { body[key] = value }
        var request = HTTPClientRequest(url: url.absoluteString)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        request.headers.add(name: "Accept", value: "application/json")
        for (name, value) in configuration.registrationHeaders { request.headers.add(name: name, value: value) }
        request.body = .bytes(ByteBuffer(data: try JSONSerialization.data(withJSONObject: body, options: [.withoutEscapingSlashes])))
        logger.info("registering the client", metadata: ["endpoint": "\(url.absoluteString)"])
        let (status, data) = try await http.execute(request)
        guard (200..<300).contains(status) else {
            throw OAuth2HTTP.failure("the registration endpoint", status: status, body: data, refused: "refused the registration")
        }
        guard let object = (try? JSONSerialization.jsonObject(with: OAuth2HTTP.lenientJSON(data))) as? [String: Any],
            let clientID = object["client_id"] as? String, !clientID.isEmpty
        else {
            throw DataQueueError(.authentication, "the registration answer has no client_id")
        }
        let stored = StoredCredentials(
            registrationURI: url.absoluteString, clientID: clientID, clientSecret: object["client_secret"] as? String,
            tokenEndpointAuthMethod: object["token_endpoint_auth_method"] as? String,
            clientSecretExpiresAt: (object["client_secret_expires_at"] as? NSNumber)?.doubleValue, registeredAt: Date())
        try configuration.credentialStore.save(stored)
        credentials = (stored.clientID, stored.clientSecret)
        token = nil
        return stored
    }

    // MARK: - Discovery

    private func resolveEndpoints() async throws -> (token: URL, registration: URL?) {
        if let endpoints { return endpoints }
        if let tokenURL = configuration.tokenURL {
            endpoints = (tokenURL, configuration.registrationURI)
            return endpoints!
        }
        let base = try DataQueue.queueName(for: configuration.fhirBaseURL)
        // No answer (network down) is a temporary failure, not a missing endpoint: it is thrown as is.
        let smart = try await http.getJSON(base + "/.well-known/smart-configuration")
        var capability: [String: Any]?
        if Self.endpoints(smartConfiguration: smart, capabilityStatement: nil).token == nil {
            capability = try await http.getJSON(base + "/metadata")
        }
        let found = Self.endpoints(smartConfiguration: smart, capabilityStatement: capability)
        guard let token = found.token else {
            throw DataQueueError(
                .invalidConfiguration,
                "configuration: no token endpoint: set \"auth.token_uri\" (the server offers neither .well-known/smart-configuration nor oauth-uris)"
            )
        }
        endpoints = (token, configuration.registrationURI ?? found.registration)
        return endpoints!
    }

    /// The discovery order: the SMART configuration document first, then the CapabilityStatement's
    /// `oauth-uris` extension.
    static func endpoints(smartConfiguration: [String: Any]?, capabilityStatement: [String: Any]?) -> (token: URL?, registration: URL?) {
        if let smart = smartConfiguration, let token = (smart["token_endpoint"] as? String).flatMap(URL.init(string:)) {
            return (token, (smart["registration_endpoint"] as? String).flatMap(URL.init(string:)))
        }
        let uris = OAuth2HTTP.oauthURIs(capabilityStatement)
        return (uris["token"], uris["register"])
    }
}
