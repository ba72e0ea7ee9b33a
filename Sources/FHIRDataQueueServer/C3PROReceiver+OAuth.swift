import Crypto
import FHIRDataQueue
import Foundation
import Hummingbird
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore

extension C3PROReceiver {
    // MARK: - Registration and tokens

    func register(_ request: Request, from address: SocketAddress?) async throws -> Response {
        if let wait = limiter.refuse(clientAddress(request, peer: address), now: configuration.time.instant()) { return tooMany(wait) }
        let offered = request.headers[.init("Antispam")!] ?? ""
        guard !offered.isEmpty, antispam.accepts(offered) else {
            // A 401 names its scheme (RFC 9110 §11.6.1): here C3-PRO's own header.
            var refused = oauthError(.unauthorized, "unauthorized_client", "the Antispam header is missing or wrong")
            refused.headers[.wwwAuthenticate] = #"Antispam realm="dq""#
            return refused
        }
        if let wait = secretChecks.refuse(Self.everyone, now: configuration.time.instant()) { return busy(wait) }
        var request = request
        let body: ByteBuffer
        do {
            body = try await request.collectBody(upTo: Self.registrationBodyLimit)
        } catch is NIOTooManyBytesError {
            return oauthError(.contentTooLarge, "invalid_request", "the registration is too large")
        }
        guard let object = (try? JSONSerialization.jsonObject(with: Data(buffer: body))) as? [String: Any] else {
            return oauthError(.badRequest, "invalid_request", "the body is not a JSON object")
        }
        if let sandbox = object["sandbox"], !(sandbox is Bool) {
            return oauthError(.badRequest, "invalid_client_metadata", "\"sandbox\" is not a boolean")
        }
        if let receipt = object["receipt-data"], !(receipt is String) {
            return oauthError(.badRequest, "invalid_client_metadata", "\"receipt-data\" is not a string")
        }
        let clientID = ClientSecrets.newClientID()
        let secret = ClientSecrets.newSecret()
        let hash = try await ClientSecrets.hashOffPool(secret: secret)
        try await registry.register(clientID: clientID, secretHash: hash, at: configuration.time.now())
        logger.info("registered a client", metadata: ["client": "\(clientID)"])
        var response = json(
            .created,
            [
                "client_id": clientID, "client_secret": secret, "grant_types": ["client_credentials"],
                "token_endpoint_auth_method": "client_secret_basic",
            ])
        // It carries the client's secret: no cache may keep it (RFC 7591 3.2.1 points to RFC 6749 5.1's no-store).
        response.headers[.cacheControl] = "no-store"
        return response
    }

    func token(_ request: Request, from address: SocketAddress?) async throws -> Response {
        if let wait = limiter.refuse(clientAddress(request, peer: address), now: configuration.time.instant()) { return tooMany(wait) }
        var request = request
        let body: ByteBuffer
        do {
            body = try await request.collectBody(upTo: Self.tokenRequestBodyLimit)
        } catch is NIOTooManyBytesError {
            return oauthError(.contentTooLarge, "invalid_request", "the request is too large")
        }
        // grant_type from the form body or the query (C3-PRO read it with getParameter: either works). A body that is
        // not a form reads as an empty one, as it did when C3-PRO's servlet read it: the query may still carry the grant.
        let form = (try? URLEncodedFormDecoder().decode(TokenRequestForm.self, from: String(buffer: body))) ?? TokenRequestForm()
        let grant = form.grantType ?? request.uri.queryParameters.get("grant_type")
        guard let grant else { return oauthError(.badRequest, "invalid_request", "grant_type is missing") }
        guard grant == "client_credentials" else {
            return oauthError(.badRequest, "unsupported_grant_type", "only client_credentials is supported")
        }
        if form.clientAssertion != nil || form.clientAssertionType != nil {
            return try await tokenForAssertion(form, path: request.uri.path)
        }
        guard let (id, secret) = Self.basicCredentials(request.headers[.authorization]) else {
            return oauthError(.unauthorized, "invalid_client", "HTTP Basic client authentication is required", challenge: true)
        }
        // The id and secret raw, or form-encoded before Base64 (RFC 6749 2.3.1, as p2/OAuth2 sends them).
        var candidates = [(id, secret)]
        if let decodedID = Self.formDecode(id), let decodedSecret = Self.formDecode(secret), (decodedID, decodedSecret) != (id, secret) {
            candidates.append((decodedID, decodedSecret))
        }
        // An id that failed too often waits, whoever asks for it: guessing one client's secret from many addresses
        // spends that id's turns, not the secret checks every device shares.
        if let wait = failedSecrets.refuse(id, now: configuration.time.instant()) { return tooMany(wait) }
        var registered: [(id: String, secret: String, stored: String?)] = []
        for (id, secret) in candidates {
            if let stored = try await registry.secretHash(clientID: id) { registered.append((id, secret, stored)) }
        }
        // An id no client has is checked as a known one is (a hash of nothing, the same cost and budget), so that its
        // answer comes in the same time: imported C3-PRO ids need not be random.
        if registered.isEmpty { registered = [(id, secret, nil)] }
        if let wait = secretChecks.refuse(Self.everyone, now: configuration.time.instant()) { return busy(wait) }
        var client: String?
        for (id, secret, stored) in registered {
            guard try await ClientSecrets.verifyOffPool(secret: secret, against: stored), let stored else { continue }
            if ClientSecrets.isLegacy(stored) {
                // A secret imported from the C3-PRO server's unsalted hash, re-hashed on its first use.
                _ = try await registry.replaceSecretHash(
                    clientID: id, old: stored, new: try await ClientSecrets.hashOffPool(secret: secret))
            }
            client = id
            break
        }
        guard let client else {
            failedSecrets.failed(id, now: configuration.time.instant())
            return oauthError(.unauthorized, "invalid_client", "the client id or secret is wrong", challenge: true)
        }
        failedSecrets.succeeded(id)
        return try await issueToken(to: client)
    }

    /// A token for a client with a key set (SMART Backend Services): the form's signed assertion instead of a secret.
    func tokenForAssertion(_ form: TokenRequestForm, path: String) async throws -> Response {
        guard form.clientAssertionType == ClientAssertionVerifier.assertionType, let assertion = form.clientAssertion else {
            return oauthError(
                .badRequest, "invalid_request",
                "client_assertion and client_assertion_type (\(ClientAssertionVerifier.assertionType)) go together")
        }
        let client: String
        switch await assertions.verify(assertion, tokenPath: path, now: configuration.time.now()) {
        case .success(let id): client = id
        case .failure(let refusal):
            logger.notice("a client assertion was refused", metadata: ["reason": "\(refusal.description)"])
            return oauthError(.unauthorized, "invalid_client", refusal.description, challenge: true)
        }
        // Tokens belong to a registered client: one with a key set gets a row whose hash no secret matches.
        if try await registry.secretHash(clientID: client) == nil {
            do {
                try await registry.register(clientID: client, secretHash: Self.keySetOnly, at: configuration.time.now())
            } catch {
                // Another request (or receiver) registered it first, or the store is down: the token's insert says.
            }
        }
        return try await issueToken(to: client)
    }

    /// The stored "hash" of a client that authenticates with its key set only: no secret verifies against it.
    static let keySetOnly = "private_key_jwt"

    func issueToken(to client: String) async throws -> Response {
        let token = ClientSecrets.newToken()
        let lifetime = Int(configuration.tokenLifetime.components.seconds)
        let expiresAt = configuration.time.now().addingTimeInterval(Double(lifetime))
        try await registry.issueToken(tokenHash: ClientSecrets.tokenHash(token), clientID: client, expiresAt: expiresAt)
        pruneTokensWhenDue()
        var response = json(.ok, ["access_token": token, "token_type": "bearer", "expires_in": lifetime])
        response.headers[.cacheControl] = "no-store"
        return response
    }

    /// Removes the expired tokens once per ``Configuration/tokenPruneInterval``: every token request adds a row,
    /// and a fleet asks for one each token lifetime, so without this the table grows for good. It runs beside the
    /// answer, not before it, in transactions of at most ``tokenPruneBatch`` rows, so that the commits of the
    /// ingest go between them (the first run after an upgrade may find a year of tokens).
    func pruneTokensWhenDue() {
        let now = configuration.time.instant()
        let due = tokensPruned.withLockedValue { last in
            guard last.map({ last in last.duration(to: now) >= configuration.tokenPruneInterval }) ?? true else { return false }
            last = now
            return true
        }
        guard due else { return }
        Task { [registry, logger, time = configuration.time] in
            let cutoff = time.now()
            var removed = 0
            do {
                while true {
                    let batch = try await registry.pruneTokens(before: cutoff, limit: Self.tokenPruneBatch)
                    removed += batch
                    if batch < Self.tokenPruneBatch { break }
                }
            } catch {
                logger.warning(
                    "cannot remove expired tokens; tried again in an interval",
                    metadata: ["error": "\((error as? DataQueueError)?.message ?? "\(type(of: error))")"])
            }
            if removed > 0 { logger.info("removed expired tokens", metadata: ["tokens": "\(removed)"]) }
        }
    }

    /// The most expired tokens removed in one transaction.
    static let tokenPruneBatch = 10_000

    /// The client a request's bearer token was issued to.
    /// - Throws: ``Refused``, the 401 to answer; a storage error when the token could not be looked up.
    func authorize(_ request: Request) async throws -> String {
        guard let header = request.headers[.authorization] else {
            throw Refused(bearerChallenge("a bearer token is required"))
        }
        let parts = header.split(separator: " ", omittingEmptySubsequences: true)
        guard parts.count == 2, parts[0].lowercased() == "bearer" else {
            throw Refused(bearerChallenge("a bearer token is required"))
        }
        let hash = ClientSecrets.tokenHash(String(parts[1]))
        let now = configuration.time.now()
        if let client = tokens.client(tokenHash: hash, now: now) { return client }
        guard let token = try await registry.token(hash: hash, now: now) else {
            throw Refused(bearerChallenge("the token is unknown or expired", error: "invalid_token"))
        }
        tokens.remember(tokenHash: hash, clientID: token.clientID, expiresAt: token.expiresAt, now: now)
        return token.clientID
    }

    /// The client of a request on a bearer route: the one `bodyLimitMiddleware(maximumBytes:deadline:)` found
    /// (``AuthenticatedClientContext``), so that the token is checked once per request, else checked here.
    func client(of request: Request, found: String?) async throws -> String {
        if let found { return found }
        return try await authorize(request)
    }

    // MARK: - Parsing

    /// A form-encoded value decoded (`+` is a space, `%XX` a byte); nil when it is not valid.
    static func formDecode(_ text: String) -> String? {
        text.replacingOccurrences(of: "+", with: " ").removingPercentEncoding
    }

    /// The id and secret of an HTTP Basic `Authorization` header (scheme in any case), as sent.
    static func basicCredentials(_ header: String?) -> (String, String)? {
        guard let header else { return nil }
        let parts = header.split(separator: " ", omittingEmptySubsequences: true)
        guard parts.count == 2, parts[0].lowercased() == "basic", let decoded = Data(base64Encoded: String(parts[1])),
            let text = String(data: decoded, encoding: .utf8), let colon = text.firstIndex(of: ":")
        else { return nil }
        return (String(text[..<colon]), String(text[text.index(after: colon)...]))
    }
}

/// The fields of a token request's form body the receiver reads (RFC 6749 4.4, RFC 7523 2.2); others are ignored.
struct TokenRequestForm: Decodable {
    var grantType: String?
    var clientAssertion: String?
    var clientAssertionType: String?

    enum CodingKeys: String, CodingKey {
        case grantType = "grant_type"
        case clientAssertion = "client_assertion"
        case clientAssertionType = "client_assertion_type"
    }
}
