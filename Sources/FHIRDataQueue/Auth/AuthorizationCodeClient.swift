import AsyncHTTPClient
import Crypto
import Foundation
import Logging
import NIOHTTP1

/// A sign-in started by ``AuthorizationCodeClient/prepareSignIn(redirectURI:)``: the URL the person opens,
/// and the secrets that tie the answer to it (kept in memory only).
package struct PendingSignIn: Sendable {
    /// The URL to open in a browser.
    package let authorizationURL: URL
    /// The redirect URI sent (the loopback listener's).
    package let redirectURI: String
    let state: String
    let nonce: String?
    let codeVerifier: String
    let endpoints: AuthorizationCodeClient.Endpoints
}

/// What ``AuthorizationCodeClient/signOut(revoke:logger:)`` did.
package enum SignOutOutcome: Sendable, Equatable {
    /// There was no sign-in to remove.
    case notSignedIn
    /// The server revoked the tokens (RFC 7009) and the local copy was deleted.
    case revoked
    /// The local copy was deleted without telling the server (it offers no revocation, or not asked to).
    case deletedLocally
}

/// A person's sign-in for unattended delivery: the SMART App Launch standalone flow (OAuth2 authorization
/// code with PKCE S256, `state`, and with `openid` a `nonce` and a checked ID token), then refresh tokens.
///
/// `dq login` prepares the sign-in, sends the person to the URL, and hands the redirect back to the client,
/// which checks `state` (and `iss`, RFC 9207), exchanges the code,
/// verifies the ID token (signature against the issuer's JWKS, `iss`, `aud`, `exp`, `nonce`) and only then stores the tokens
/// (0600, in the sign-in directory).
/// As an ``AuthorizationProvider`` it then supplies the access token and renews it with the refresh token
/// once half of its lifetime has passed, or after a 401; a rotated refresh token replaces the old one
/// atomically, under a lock shared with other dq processes. A refused refresh token is an
/// ``DataQueueError/Code/authentication`` error telling the operator to sign in again; nothing queued
/// is touched. Tokens, codes and verifiers are never logged or put in errors.
public actor AuthorizationCodeClient: AuthorizationProvider {
    struct Endpoints: Sendable {
        var authorization: URL?
        var token: URL?
        var revocation: URL?
        var issuer: String?
        var jwks: URL?

        mutating func fill(from document: [String: Any]) {
            func url(_ key: String) -> URL? {
                (document[key] as? String).flatMap(URL.init(string:)).flatMap { $0.scheme?.hasPrefix("http") == true ? $0 : nil }
            }
            authorization = authorization ?? url("authorization_endpoint")
            token = token ?? url("token_endpoint")
            revocation = revocation ?? url("revocation_endpoint")
            issuer = issuer ?? (document["issuer"] as? String)
            jwks = jwks ?? url("jwks_uri")
        }
    }

    /// The settings.
    public nonisolated let configuration: AuthorizationCodeClient.Configuration
    /// Where the sign-in is kept.
    package nonisolated let store: SignInStore
    private var httpClient: OAuth2HTTP?
    private var endpoints: Endpoints?
    private var verifier: IDTokenVerifier?
    private var current: SignIn?
    private var inflight: Task<String, any Error>?
    /// A refresh token the server refused, with its refusal: asked again only after `dq login` stores another.
    private var refusedRefresh: (token: String, error: DataQueueError)?
    private var isShutDown = false
    /// How many token requests (code exchanges and refreshes) this instance made.
    package private(set) var tokenRequests = 0

    /// The caller's own HTTP client, if it gave one.
    private let callerClient: HTTPClient?

    /// Creates the client. No request is made and no file read until needed.
    ///
    /// - Parameters:
    ///   - configuration: the issuer, client and where the sign-in is kept.
    ///   - httpClient: an HTTP client of the caller's for discovery, token, JWKS and revocation requests (give the
    ///     queue the same one). The default is nil: the process's shared client for `configuration.network`.
    public init(configuration: AuthorizationCodeClient.Configuration, httpClient: HTTPClient? = nil) {
        self.configuration = configuration
        callerClient = httpClient
        self.store = SignInStore(
            directory: configuration.credentialsDirectory, fhirBaseURL: configuration.fhirBaseURL.absoluteString,
            clientID: configuration.clientID)
    }

    /// The HTTP client, made on first use: reading the stored sign-in (`dq status`) starts no threads.
    private var http: OAuth2HTTP {
        get throws {
            try makeHTTP()
        }
    }

    private func makeHTTP() throws -> OAuth2HTTP {
        if let httpClient { return httpClient }
        let made = try OAuth2HTTP(network: configuration.network, timeout: configuration.timeout, client: callerClient)
        httpClient = made
        return made
    }

    /// Releases the HTTP client. Calling it again does nothing.
    public func shutdown() async throws {
        guard !isShutDown else { return }
        isShutDown = true
        try await httpClient?.shutdown()
    }

    // MARK: - Signing in

    /// Discovers the endpoints and builds the authorization URL for `redirectURI`, with a fresh `state`,
    /// PKCE verifier and (with `openid`) `nonce`.
    package func prepareSignIn(redirectURI: String) async throws -> PendingSignIn {
        let endpoints = try await resolveEndpoints()
        guard let authorization = endpoints.authorization else {
            throw DataQueueError(.invalidConfiguration, "configuration: no authorization endpoint: set \"auth.authorize_uri\"")
        }
        let state = Self.randomToken(16)
        let verifier = Self.randomToken(32)
        let nonce = configuration.asksForIDToken ? Self.randomToken(16) : nil
        let challenge = Self.codeChallenge(for: verifier)
        var parameters: [(String, String)] = [
            ("response_type", "code"), ("client_id", configuration.clientID), ("redirect_uri", redirectURI),
            ("scope", configuration.scope), ("state", state), ("aud", configuration.fhirBaseURL.absoluteString),
            ("code_challenge", challenge), ("code_challenge_method", "S256"),
        ]
        if let nonce { parameters.append(("nonce", nonce)) }
        // Spaces as %20, not "+": both form decoders and plain URI decoders read it as a space.
        var unreserved = CharacterSet.alphanumerics
        unreserved.insert(charactersIn: "-._~")
        func encode(_ text: String) -> String { text.addingPercentEncoding(withAllowedCharacters: unreserved) ?? text }
        let query = parameters.map { encode($0.0) + "=" + encode($0.1) }.joined(separator: "&")
        let separator = authorization.query == nil ? "?" : "&"
        guard let url = URL(string: authorization.absoluteString + separator + query) else {
            throw DataQueueError(.invalidConfiguration, "configuration: the authorization endpoint is not a URL")
        }
        return PendingSignIn(
            authorizationURL: url, redirectURI: redirectURI, state: state, nonce: nonce, codeVerifier: verifier,
            endpoints: endpoints)
    }

    /// Completes the sign-in from the redirect the browser was sent to: checks `state` (and `iss`),
    /// exchanges the code, checks the ID token, and stores the tokens.
    ///
    /// - Throws: ``DataQueueError`` with code `.authentication` for a refusal, a forged or stale redirect, a
    ///   refused code or a failed ID-token check (nothing is stored then); `.transport` when the token
    ///   endpoint cannot be reached.
    @discardableResult
    package func completeSignIn(_ pending: PendingSignIn, redirect: URL, logger: Logger? = nil) async throws -> SignIn {
        let items = URLComponents(url: redirect, resolvingAgainstBaseURL: false)?.queryItems ?? []
        func value(_ name: String) -> String? { items.first(where: { $0.name == name })?.value }
        guard value("state") == pending.state else {
            throw DataQueueError(
                .authentication,
                "the redirect's state does not match the sign-in dq started (a stale or forged redirect); nothing was stored")
        }
        if let error = value("error") {
            let reason = value("error_description").map { ": " + String($0.prefix(200)) } ?? ""
            throw DataQueueError(.authentication, "the authorization server refused the sign-in (\(error.prefix(64)))\(reason)")
        }
        if let iss = value("iss"), let issuer = pending.endpoints.issuer, iss != issuer {
            throw DataQueueError(.authentication, "the redirect comes from another issuer (iss, RFC 9207); nothing was stored")
        }
        guard let code = value("code"), !code.isEmpty else {
            throw DataQueueError(.authentication, "the redirect carries no authorization code; nothing was stored")
        }
        guard let tokenURL = pending.endpoints.token else {
            throw DataQueueError(.invalidConfiguration, "configuration: no token endpoint: set \"auth.token_uri\"")
        }
        let log = logger ?? Self.silent
        log.debug("exchanging the authorization code", metadata: ["endpoint": "\(tokenURL.absoluteString)"])
        let answer = try await tokenRequest(
            tokenURL,
            [
                ("grant_type", "authorization_code"), ("code", code), ("redirect_uri", pending.redirectURI),
                ("code_verifier", pending.codeVerifier),
            ],
            refusal: "refused the authorization code")
        var claims: IDTokenClaims?
        if configuration.asksForIDToken {
            guard let idToken = answer.object["id_token"] as? String else {
                throw DataQueueError(
                    .authentication, "the token answer has no ID token although the scope asks for openid; nothing was stored")
            }
            claims = try await verifyIDToken(idToken, endpoints: pending.endpoints, nonce: pending.nonce)
        }
        let now = Date()
        let signIn = SignIn(
            fhirBaseURL: store.fhirBaseURL, clientID: configuration.clientID, issuer: pending.endpoints.issuer,
            tokenEndpoint: tokenURL.absoluteString, revocationEndpoint: pending.endpoints.revocation?.absoluteString,
            accessToken: answer.accessToken, refreshToken: answer.object["refresh_token"] as? String, issuedAt: now,
            expiresIn: answer.expiresIn, scope: answer.object["scope"] as? String,
            patient: answer.object["patient"] as? String, encounter: answer.object["encounter"] as? String,
            fhirUser: claims?.fhirUser, subject: claims?.sub, signedInAt: now)
        try await store.withLock { try store.save(signIn) }
        current = signIn
        log.info("signed in", metadata: ["expires_in": "\(Int(answer.expiresIn))", "refresh_token": "\(signIn.refreshToken != nil)"])
        return signIn
    }

    /// The stored sign-in, if any (for `dq status`; tokens must not be shown).
    package nonisolated func storedSignIn() throws -> SignIn? { try store.load() }

    // MARK: - Signing out

    /// Revokes the refresh and access tokens where the server offers RFC 7009 revocation (unless `revoke`
    /// is false), then deletes the stored sign-in.
    ///
    /// - Throws: ``DataQueueError``: `.transport` when the revocation endpoint cannot be reached or answers
    ///   5xx, `.authentication` when it refuses the client; the sign-in is kept in both cases.
    package func signOut(revoke: Bool = true, logger: Logger? = nil) async throws -> SignOutOutcome {
        guard let signIn = try store.load() else { return .notSignedIn }
        var outcome = SignOutOutcome.deletedLocally
        if revoke, let endpoint = signIn.revocationEndpoint.flatMap(URL.init(string:)) {
            let tokens = [(signIn.refreshToken, "refresh_token"), (signIn.accessToken, "access_token")]
            for case (let token?, let hint) in tokens {
                var form = [("token", token), ("token_type_hint", hint)]
                var headers = HTTPHeaders()
                // A client assertion's audience is the token endpoint for every endpoint (OIDC Core 9).
                try await authenticate(audience: URL(string: signIn.tokenEndpoint) ?? endpoint, form: &form, headers: &headers)
                let (status, body) = try await http.post(endpoint, form: form, headers: headers)
                if status == 200 { continue }
                if hint == "access_token" && status == 400 { continue }  // unsupported_token_type: it expires alone
                throw OAuth2HTTP.failure(
                    "the revocation endpoint", status: status, body: body, refused: "refused", suffix: "; the sign-in is kept")
            }
            outcome = .revoked
            (logger ?? Self.silent).info("tokens revoked", metadata: ["endpoint": "\(endpoint.absoluteString)"])
        }
        try store.delete()
        current = nil
        return outcome
    }

    // MARK: - AuthorizationProvider

    /// `Bearer <access token>`, renewed first when half of its lifetime has passed or `forceRefresh`.
    public nonisolated func authorizationHeader(forceRefresh: Bool, logger: Logger) async throws -> String? {
        "Bearer " + (try await accessToken(forceRefresh: forceRefresh, refused: nil, logger: logger))
    }

    /// After the server refused `refused`: the current token if a concurrent sender already renewed it,
    /// else a refreshed one.
    public func authorizationHeader(replacing refused: String, logger: Logger) async throws -> String? {
        if inflight == nil, let current, "Bearer " + current.accessToken != refused, current.renewAt > Date() {
            return "Bearer " + current.accessToken
        }
        return "Bearer " + (try await accessToken(forceRefresh: true, refused: refused, logger: logger))
    }

    /// A valid access token: the stored one, or a refreshed one.
    public func accessToken(forceRefresh: Bool = false, logger: Logger? = nil) async throws -> String {
        try await accessToken(forceRefresh: forceRefresh, refused: nil, logger: logger ?? Self.silent)
    }

    private func accessToken(forceRefresh: Bool, refused: String?, logger: Logger) async throws -> String {
        if let inflight { return try await inflight.value }
        if current == nil { current = try store.load() }
        guard let signIn = current else {
            throw DataQueueError(.authentication, "not signed in to \(store.fhirBaseURL): run `dq login` first")
        }
        let now = Date()
        if !forceRefresh && (signIn.renewAt > now || (signIn.refreshToken == nil && signIn.expiresAt > now)) {
            return signIn.accessToken
        }
        let task = Task { try await self.refresh(refused: refused, logger: logger) }
        inflight = task
        defer { inflight = nil }
        return try await task.value
    }

    /// Renews the access token under the store's lock, unless another process already did.
    private func refresh(refused: String?, logger: Logger) async throws -> String {
        try await store.withLock {
            guard var signIn = try store.load() else {
                throw DataQueueError(.authentication, "not signed in to \(store.fhirBaseURL) (signed out meanwhile): run `dq login`")
            }
            let now = Date()
            if signIn.accessToken != current?.accessToken, signIn.renewAt > now, "Bearer " + signIn.accessToken != refused {
                current = signIn  // another dq process refreshed while this one waited for the lock
                return signIn.accessToken
            }
            guard let refreshToken = signIn.refreshToken else {
                if signIn.expiresAt > now && refused == nil { return signIn.accessToken }
                throw DataQueueError(
                    .authentication,
                    "the access token has expired and there is no refresh token (ask for offline_access): run `dq login` again; queued items stay queued"
                )
            }
            guard let tokenURL = URL(string: signIn.tokenEndpoint) else {
                throw DataQueueError(.invalidConfiguration, "the sign-in file names no valid token endpoint: run `dq login` again")
            }
            if let refusedRefresh, refusedRefresh.token == refreshToken { throw refusedRefresh.error }  // one refusal, one request
            logger.debug("refreshing the access token", metadata: ["endpoint": "\(tokenURL.absoluteString)"])
            let answer: (accessToken: String, expiresIn: Double, object: [String: Any])
            do {
                answer = try await tokenRequest(
                    tokenURL, [("grant_type", "refresh_token"), ("refresh_token", refreshToken)],
                    refusal: "refused the refresh token; run `dq login` again (queued items stay queued)")
            } catch let error as DataQueueError where error.code == .authentication {
                refusedRefresh = (refreshToken, error)
                throw error
            }
            let rotated = answer.object["refresh_token"] as? String
            if let idToken = answer.object["id_token"] as? String, configuration.asksForIDToken {
                let claims: IDTokenClaims
                do {
                    claims = try await verifyIDToken(idToken, endpoints: try await resolveEndpoints(), nonce: nil)
                } catch let error as DataQueueError where error.code == .transport {
                    // Discovery or the JWKS cannot be reached, and the server has already rotated the refresh
                    // token: the new refresh token is kept for the next try; the unchecked access token is not.
                    if let rotated {
                        signIn.refreshToken = rotated
                        signIn.expiresIn = 0  // renew at the next use
                        try store.save(signIn)
                        current = signIn
                    }
                    throw error
                }
                guard signIn.subject == nil || claims.sub == signIn.subject else {
                    throw DataQueueError(.authentication, "the refreshed ID token names another person (sub); run `dq login` again")
                }
            }
            signIn.accessToken = answer.accessToken
            if let rotated { signIn.refreshToken = rotated }
            signIn.issuedAt = Date()
            signIn.expiresIn = answer.expiresIn
            if let scope = answer.object["scope"] as? String { signIn.scope = scope }
            if let patient = answer.object["patient"] as? String { signIn.patient = patient }
            if let encounter = answer.object["encounter"] as? String { signIn.encounter = encounter }
            signIn.refreshedAt = signIn.issuedAt
            try store.save(signIn)
            current = signIn
            logger.info("access token refreshed", metadata: ["expires_in": "\(Int(answer.expiresIn))"])
            return signIn.accessToken
        }
    }

    // MARK: - Token endpoint

    private func tokenRequest(
        _ url: URL, _ grant: [(String, String)], refusal: String
    ) async throws -> (accessToken: String, expiresIn: Double, object: [String: Any]) {
        var form = grant
        var headers = HTTPHeaders()
        try await authenticate(audience: url, form: &form, headers: &headers)
        tokenRequests += 1
        let (status, body) = try await http.post(url, form: form, headers: headers)
        guard (200..<300).contains(status) else {
            throw OAuth2HTTP.failure("the token endpoint", status: status, body: body, refused: refusal)
        }
        guard let object = (try? JSONSerialization.jsonObject(with: OAuth2HTTP.lenientJSON(body))) as? [String: Any],
            let token = object["access_token"] as? String, !token.isEmpty
        else {
            throw DataQueueError(.authentication, "the token endpoint's answer has no access_token; nothing was stored")
        }
        if let type = object["token_type"] as? String, type.lowercased() != "bearer" {
            throw DataQueueError(.authentication, "the token endpoint issued a \(type.prefix(32)) token; dq sends bearer tokens only")
        }
        var expiresIn = 3600.0
        if let number = object["expires_in"] as? NSNumber {
            expiresIn = number.doubleValue
        } else if let text = object["expires_in"] as? String, let value = Double(text) {
            expiresIn = value
        }
        guard expiresIn.isFinite else { throw DataQueueError(.authentication, "the token endpoint's expires_in is not a number") }
        return (token, min(max(expiresIn, 1), 10 * 365 * 86400), object)
    }

    private func authenticate(audience: URL, form: inout [(String, String)], headers: inout HTTPHeaders) async throws {
        try await OAuth2HTTP.authenticate(
            configuration.effectiveAuthMethod, clientID: configuration.clientID, secret: configuration.clientSecret,
            key: configuration.assertionKey, audience: audience, form: &form, headers: &headers)
    }

    private func verifyIDToken(_ token: String, endpoints: Endpoints, nonce: String?) async throws -> IDTokenClaims {
        guard let issuer = endpoints.issuer else {
            throw DataQueueError(
                .invalidConfiguration, "configuration: the ID token cannot be checked: the server names no issuer (set \"auth.issuer\")")
        }
        return try await idTokenVerifier(endpoints).verify(token, issuer: issuer, clientID: configuration.clientID, nonce: nonce)
    }

    /// The verifier of the issuer's ID tokens, made once (it caches the JWKS).
    private func idTokenVerifier(_ endpoints: Endpoints) throws -> IDTokenVerifier {
        if let verifier { return verifier }
        guard endpoints.issuer != nil, let jwks = endpoints.jwks else {
            throw DataQueueError(
                .invalidConfiguration,
                "configuration: the ID token cannot be checked: the server names no issuer and jwks_uri (set \"auth.issuer\")")
        }
        let http = try self.http
        let made = IDTokenVerifier(jwksURL: jwks) { url in
            var request = HTTPClientRequest(url: url.absoluteString)
            request.headers.add(name: "Accept", value: "application/json, application/jwk-set+json")
            let (status, data) = try await http.execute(request)
            guard status == 200 else { throw DataQueueError(.transport, "the issuer's JWKS answered \(status)") }
            return data
        }
        verifier = made
        return made
    }

    // MARK: - Discovery

    /// The endpoints: those configured, then the SMART configuration at the FHIR base, then the OpenID
    /// configuration of the issuer (or at the FHIR base), then the CapabilityStatement's `oauth-uris`.
    private func resolveEndpoints() async throws -> Endpoints {
        if let endpoints { return endpoints }
        var found = Endpoints(
            authorization: configuration.authorizationURL, token: configuration.tokenURL, revocation: configuration.revocationURL,
            issuer: configuration.issuer)
        let oidc = configuration.asksForIDToken
        func complete() -> Bool {
            found.authorization != nil && found.token != nil && (!oidc || (found.issuer != nil && found.jwks != nil))
        }
        let base = try DataQueue.queueName(for: configuration.fhirBaseURL)
        if !complete(), let smart = try await http.getJSON(base + "/.well-known/smart-configuration") {
            found.fill(from: smart)
        }
        if !complete() {
            let root = found.issuer.map { $0.hasSuffix("/") ? String($0.dropLast()) : $0 } ?? base
            if let openID = try await http.getJSON(root + "/.well-known/openid-configuration") { found.fill(from: openID) }
        }
        if found.authorization == nil || found.token == nil, let capability = try await http.getJSON(base + "/metadata") {
            let uris = OAuth2HTTP.oauthURIs(capability)
            found.authorization = found.authorization ?? uris["authorize"]
            found.token = found.token ?? uris["token"]
            found.revocation = found.revocation ?? uris["revoke"]
        }
        guard found.authorization != nil, found.token != nil else {
            throw DataQueueError(
                .invalidConfiguration,
                "configuration: no authorization or token endpoint: set \"auth.authorize_uri\" and \"auth.token_uri\" (the server offers no SMART or OpenID configuration)"
            )
        }
        endpoints = found
        return found
    }

    // MARK: - Helpers

    static let silent = Logger(label: "dq.auth", factory: { _ in SwiftLogNoOpLogHandler() })

    /// `count` random bytes (the system's CSPRNG), base64url without padding.
    static func randomToken(_ count: Int) -> String {
        var generator = SystemRandomNumberGenerator()
        return base64URL(Data((0..<count).map { _ in UInt8.random(in: 0...255, using: &generator) }))
    }

    /// The PKCE S256 challenge of `verifier` (RFC 7636 4.2): base64url(SHA-256(ASCII(verifier))).
    static func codeChallenge(for verifier: String) -> String {
        base64URL(Data(SHA256.hash(data: Data(verifier.utf8))))
    }

    static func base64URL(_ data: Data) -> String {
        data.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }
}
