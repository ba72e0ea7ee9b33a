import Crypto
import FHIRDataQueue
import Foundation
import Hummingbird
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore

/// The receiving half of the C3-PRO system as Hummingbird routes: what deployed C3-PRO apps post to, unchanged.
///
/// Under ``Configuration/pathPrefix`` (`/c3pro`):
/// - `POST /register`: dynamic client registration behind the `Antispam` header (201 with `client_id` and
///   `client_secret`; the secret is stored only as a slow salted hash, in the queue's database).
/// - `POST /oauth`: client credentials for a bearer token (200; valid across restarts and on every receiver
///   sharing the database until it expires).
/// - `POST /encfhir`, `/encfhir/{type}`, `/fhirenc/{type}`: an encrypted envelope, checked for shape, committed
///   unchanged, then answered 202. The queue opens it later with its ``EnvelopeKeyring`` (or forwards it as it is).
/// - `POST /fhir/{type}`, `PUT /fhir/{type}/{id}`: a plain resource, committed, then forwarded by the queue's
///   delivery (a `DataQueueService` beside the routes): 201 with the server's `Location` when it is delivered within
///   ``Configuration/deliveryWait``, 202 when it is still queued then (or the server rejected it: parked).
/// - `GET /fhir/Questionnaire/{id}`: a questionnaire from ``Configuration/questionnairesDirectory``.
///
/// Every answer is given after the commit: what a device was told is taken is on disk. Nothing a device sent
/// appears in a log line or an error answer.
public struct C3PROReceiver: Sendable {
    /// How the receiver answers.
    public struct Configuration: Sendable {
        /// Where the routes are (C3-PRO's WAR context `/c3pro` by default; `""` for the root).
        public var pathPrefix: String
        /// The `Antispam` header values `register` accepts at first (compared in constant time); see
        /// ``C3PROReceiver/replaceAntispamSecrets(_:)``.
        public var antispamSecrets: [String]
        /// How long an issued token is valid (C3-PRO: 1,800 s).
        public var tokenLifetime: Duration
        /// Where `GET /fhir/Questionnaire/{id}` reads `{id}.json`; nil: no questionnaires.
        public var questionnairesDirectory: String?
        /// The largest body taken (413 above it).
        public var maximumBodyBytes: Int
        /// Whether `/fhir` takes plain resources (they are PHI: the queue should seal them at rest).
        public var acceptsPlainResources: Bool
        /// Requests per minute one source address may make to `register` and `oauth` (429 above it).
        public var authRequestsPerMinute: Int
        /// Secret hashings and checks (scrypt: tens of milliseconds of CPU and 32 MiB each) per minute, for all
        /// addresses together: a registration is one, a token request with a secret one. Past it, 503 with
        /// `Retry-After`: many addresses, each within ``authRequestsPerMinute``, cannot take every core from the
        /// ingest. 1,200 by default (20 a second); 0: no limit.
        public var secretChecksPerMinute: Int = 1200
        /// The addresses of proxies in front of the receiver (e.g. `["127.0.0.1"]` for a TLS proxy on the same host)
        /// whose `X-Forwarded-For` names the device: a request from one of them is limited by the address that header
        /// gives (the rightmost that is not itself a trusted proxy), not by the proxy's. From any other peer the header
        /// is ignored (a device could write anything there). Empty by default.
        public var trustedProxies: Set<String> = []
        /// How long a plain resource's answer waits for the queue's delivery to send it (201 then; 202 after). The
        /// wait does not grow with a backlog or a slow server: a device is answered in about this time at most. The
        /// default is 2 s.
        public var deliveryWait: Duration
        /// Clients that authenticate to `oauth` with a signed assertion (SMART Backend Services, `private_key_jwt`)
        /// instead of a secret: client id → its public key set (JWKS JSON). Edges forwarding to a decrypting
        /// receiver are such clients. Empty by default.
        public var clientKeySets: [String: String] = [:]
        /// Where resources go by the envelope's `version` or the resource type (C3-PRO deployments forwarded by
        /// version): the first route that matches names the queue (its own server, order, backoff and metrics);
        /// unmatched resources go to the receiver's queue. An envelope's type is the one its path names (it is
        /// sealed); a plain resource has no version. Empty by default.
        public var routes: [Route] = []
        /// How often expired tokens are removed from the database: when a token is issued and this long has passed
        /// since the last removal (each receiver sharing the database removes them; what has expired is never valid
        /// again, so nothing valid goes). One hour by default.
        public var tokenPruneInterval: Duration = .seconds(3600)
        /// The most items one client may have waiting in the database (pending, parked or quarantined): past it a
        /// request is answered 429 with `Retry-After`, and the device keeps it for later. 10,000 by default; 0: no
        /// limit. Envelope batches from an edge are not limited here (the edge limits its devices).
        public var maximumWaitingPerClient: Int = 10_000
        /// The most bytes (as stored) one client may have waiting: past it, 507. 256 MiB by default; 0: no limit.
        public var maximumWaitingBytesPerClient: Int = 256 << 20

        /// A configuration with C3-PRO's defaults.
        public init(
            pathPrefix: String = "/c3pro", antispamSecrets: [String], tokenLifetime: Duration = .seconds(1800),
            questionnairesDirectory: String? = nil, maximumBodyBytes: Int = 10 << 20, acceptsPlainResources: Bool = true,
            authRequestsPerMinute: Int = 60, deliveryWait: Duration = .seconds(2)
        ) {
            self.pathPrefix = pathPrefix
            self.antispamSecrets = antispamSecrets
            self.tokenLifetime = tokenLifetime
            self.questionnairesDirectory = questionnairesDirectory
            self.maximumBodyBytes = maximumBodyBytes
            self.acceptsPlainResources = acceptsPlainResources
            self.authRequestsPerMinute = authRequestsPerMinute
            self.deliveryWait = deliveryWait
        }
    }

    /// A route: resources that match go to its queue instead of the receiver's (``Configuration/routes``).
    public struct Route: Sendable {
        /// What a route matches.
        public enum Match: Sendable, Equatable {
            /// An envelope of this `version` (0.5.0, 1.0.2, 3.0.0...).
            case version(String)
            /// A resource of this type (an envelope: the type its path names).
            case resourceType(String)
        }

        /// What it matches.
        public var match: Match
        /// Where what it matches is queued; the same database as the receiver's queue (its clients, tokens and
        /// receipts are there).
        public var queue: DataQueue

        /// A route of `match` to `queue`.
        public init(_ match: Match, to queue: DataQueue) {
            self.match = match
            self.queue = queue
        }
    }

    /// The queue envelopes and resources are committed to (unless a route takes them).
    public let queue: DataQueue
    /// How the receiver answers.
    public let configuration: Configuration
    private let registry: any ClientRegistry
    private let tokens = TokenCache()
    /// When expired tokens were last removed (nil: not yet, by this receiver).
    private let tokensPruned = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
    private let limiter: RateLimiter
    /// ``Configuration/secretChecksPerMinute``: one window for every address.
    private let secretChecks: RateLimiter
    /// Wrong secrets per client id (``FailureBackoff``).
    private let failedSecrets = FailureBackoff()
    /// What each client has waiting, read from the database at most once a second per client.
    private let waitingCounts = WaitingCounts()
    private let antispam: AntispamSecrets
    private let assertions: ClientAssertionVerifier
    private let logger: Logger

    /// A receiver that commits to `queue` (and keeps its clients and tokens in `queue`'s database).
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` when a key set of
    ///   ``Configuration/clientKeySets`` is not a JWKS with a signing key.
    public init(queue: DataQueue, configuration: Configuration, logger: Logger = Logger(label: "dq.serve")) throws {
        do {
            self.assertions = try ClientAssertionVerifier(keySets: configuration.clientKeySets)
        } catch {
            throw DataQueueError(.invalidConfiguration, error.description)
        }
        self.queue = queue
        self.configuration = configuration
        self.registry = queue.clientRegistry
        self.limiter = RateLimiter(perMinute: configuration.authRequestsPerMinute)
        self.secretChecks = RateLimiter(perMinute: configuration.secretChecksPerMinute)
        self.antispam = AntispamSecrets(configuration.antispamSecrets)
        self.logger = logger
    }

    /// Loads the key sets of ``Configuration/clientKeySets`` (a host calls it once, before serving).
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` naming a key that cannot be used.
    public func loadClientKeySets() async throws {
        do {
            try await assertions.load()
        } catch {
            throw DataQueueError(.invalidConfiguration, error.description)
        }
    }

    /// Replaces the `Antispam` values `register` accepts, while it serves (the antispam file read again on SIGHUP).
    public func replaceAntispamSecrets(_ secrets: [String]) {
        antispam.replace(secrets)
    }

    /// Adds the receiver's routes to `router`.
    public func addRoutes<Context: RemoteAddressRequestContext>(to router: some RouterMethods<Context>) {
        let prefix = configuration.pathPrefix.split(separator: "/").joined(separator: "/")
        func path(_ rest: String) -> RouterPath { prefix.isEmpty ? RouterPath(rest) : RouterPath("\(prefix)/\(rest)") }
        router.post(path("register")) { request, context in
            await measured(.register) { try await register(request, from: context.remoteAddress) }
        }
        router.post(path("oauth")) { request, context in
            await measured(.oauth) { try await token(request, from: context.remoteAddress) }
        }
        for route in ["encfhir", "encfhir/{type}", "fhirenc", "fhirenc/{type}"] {
            router.post(path(route)) { request, context in
                // Envelopes forwarded in batches by a dq edge (EnvelopeBatch), or one from a device.
                if EnvelopeBatch.isBatch(contentType: request.headers[.contentType]) {
                    return await measured(.envelopeBatch) { try await envelopeBatch(request) }
                }
                return await measured(.envelope) {
                    try await envelope(request, type: context.parameters.get("type"))
                }
            }
        }
        router.post(path("fhir/{type}")) { request, context in
            await measured(.plain) { try await plain(request, type: context.parameters.get("type") ?? "", id: nil) }
        }
        router.put(path("fhir/{type}/{id}")) { request, context in
            await measured(.plain) {
                try await plain(request, type: context.parameters.get("type") ?? "", id: context.parameters.get("id"))
            }
        }
        router.get(path("fhir/Questionnaire/{id}")) { request, context in
            await measured(.questionnaire) { try await questionnaire(request, id: context.parameters.get("id") ?? "") }
        }
        // Another method on a path the receiver serves is 405 with the methods it takes (RFC 9110 15.5.6), not 404.
        let posts = ["register", "oauth", "encfhir", "encfhir/{type}", "fhirenc", "fhirenc/{type}", "fhir/{type}"]
        for route in posts {
            for method in [HTTPRequest.Method.get, .head, .put, .delete, .patch] {
                router.on(path(route), method: method) { _, _ in Self.methodNotAllowed("POST") }
            }
        }
        for method in [HTTPRequest.Method.get, .head, .post, .delete, .patch] {
            router.on(path("fhir/{type}/{id}"), method: method) { _, _ in Self.methodNotAllowed("PUT") }
        }
    }

    /// 405 naming the methods a path takes.
    static func methodNotAllowed(_ allowed: String) -> Response {
        var response = FHIRExchange.outcome(.methodNotAllowed, "not-supported", "this path takes \(allowed) only")
        response.headers[.allow] = allowed
        return response
    }

    // MARK: - Registration and tokens

    private func register(_ request: Request, from address: SocketAddress?) async throws -> Response {
        if let wait = limiter.refuse(clientAddress(request, peer: address)) { return tooMany(wait) }
        let offered = request.headers[.init("Antispam")!] ?? ""
        guard !offered.isEmpty, antispam.accepts(offered) else {
            // A 401 names its scheme (RFC 9110 §11.6.1): here C3-PRO's own header.
            var refused = oauthError(.unauthorized, "unauthorized_client", "the Antispam header is missing or wrong")
            refused.headers[.wwwAuthenticate] = #"Antispam realm="dq""#
            return refused
        }
        if let wait = secretChecks.refuse(Self.everyone) { return busy(wait) }
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
        try await registry.register(clientID: clientID, secretHash: hash, at: Date())
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

    private func token(_ request: Request, from address: SocketAddress?) async throws -> Response {
        if let wait = limiter.refuse(clientAddress(request, peer: address)) { return tooMany(wait) }
        var request = request
        let body: ByteBuffer
        do {
            body = try await request.collectBody(upTo: Self.tokenRequestBodyLimit)
        } catch is NIOTooManyBytesError {
            return oauthError(.contentTooLarge, "invalid_request", "the request is too large")
        }
        // grant_type from the form body or the query (C3-PRO read it with getParameter: either works).
        let form = Self.formFields(String(buffer: body))
        let grant = form["grant_type"] ?? request.uri.queryParameters.get("grant_type")
        guard let grant else { return oauthError(.badRequest, "invalid_request", "grant_type is missing") }
        guard grant == "client_credentials" else {
            return oauthError(.badRequest, "unsupported_grant_type", "only client_credentials is supported")
        }
        if form["client_assertion"] != nil || form["client_assertion_type"] != nil {
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
        if let wait = failedSecrets.refuse(id) { return tooMany(wait) }
        var registered: [(id: String, secret: String, stored: String?)] = []
        for (id, secret) in candidates {
            if let stored = try await registry.secretHash(clientID: id) { registered.append((id, secret, stored)) }
        }
        // An id no client has is checked as a known one is (a hash of nothing, the same cost and budget), so that its
        // answer comes in the same time: imported C3-PRO ids need not be random.
        if registered.isEmpty { registered = [(id, secret, nil)] }
        if let wait = secretChecks.refuse(Self.everyone) { return busy(wait) }
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
            failedSecrets.failed(id)
            return oauthError(.unauthorized, "invalid_client", "the client id or secret is wrong", challenge: true)
        }
        failedSecrets.succeeded(id)
        return try await issueToken(to: client)
    }

    /// A token for a client with a key set (SMART Backend Services): the form's signed assertion instead of a secret.
    private func tokenForAssertion(_ form: [String: String], path: String) async throws -> Response {
        guard form["client_assertion_type"] == ClientAssertionVerifier.assertionType, let assertion = form["client_assertion"] else {
            return oauthError(
                .badRequest, "invalid_request",
                "client_assertion and client_assertion_type (\(ClientAssertionVerifier.assertionType)) go together")
        }
        let client: String
        switch await assertions.verify(assertion, tokenPath: path) {
        case .success(let id): client = id
        case .failure(let refusal):
            logger.notice("a client assertion was refused", metadata: ["reason": "\(refusal.description)"])
            return oauthError(.unauthorized, "invalid_client", refusal.description, challenge: true)
        }
        // Tokens belong to a registered client: one with a key set gets a row whose hash no secret matches.
        if try await registry.secretHash(clientID: client) == nil {
            do {
                try await registry.register(clientID: client, secretHash: Self.keySetOnly, at: Date())
            } catch {
                // Another request (or receiver) registered it first, or the store is down: the token's insert says.
            }
        }
        return try await issueToken(to: client)
    }

    /// The stored "hash" of a client that authenticates with its key set only: no secret verifies against it.
    static let keySetOnly = "private_key_jwt"

    private func issueToken(to client: String) async throws -> Response {
        let token = ClientSecrets.newToken()
        let lifetime = Int(configuration.tokenLifetime.components.seconds)
        try await registry.issueToken(
            tokenHash: ClientSecrets.tokenHash(token), clientID: client, expiresAt: Date().addingTimeInterval(Double(lifetime)))
        pruneTokensWhenDue()
        var response = json(.ok, ["access_token": token, "token_type": "bearer", "expires_in": lifetime])
        response.headers[.cacheControl] = "no-store"
        return response
    }

    /// Removes the expired tokens once per ``Configuration/tokenPruneInterval``: every token request adds a row,
    /// and a fleet asks for one each token lifetime, so without this the table grows for good. It runs beside the
    /// answer, not before it, in transactions of at most ``tokenPruneBatch`` rows, so that the commits of the
    /// ingest go between them (the first run after an upgrade may find a year of tokens).
    private func pruneTokensWhenDue() {
        let now = ContinuousClock.now
        let due = tokensPruned.withLockedValue { last in
            guard last.map({ last in last.duration(to: now) >= configuration.tokenPruneInterval }) ?? true else { return false }
            last = now
            return true
        }
        guard due else { return }
        Task { [registry, logger] in
            let cutoff = Date()
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

    /// The client a request's bearer token was issued to, or the 401 to answer.
    private func authorize(_ request: Request) async throws -> Result<String, Refused> {
        guard let header = request.headers[.authorization] else {
            return .failure(Refused(response: bearerChallenge("a bearer token is required")))
        }
        let parts = header.split(separator: " ", omittingEmptySubsequences: true)
        guard parts.count == 2, parts[0].lowercased() == "bearer" else {
            return .failure(Refused(response: bearerChallenge("a bearer token is required")))
        }
        let hash = ClientSecrets.tokenHash(String(parts[1]))
        let now = Date()
        if let client = tokens.client(tokenHash: hash, now: now) { return .success(client) }
        guard let token = try await registry.token(hash: hash, now: now) else {
            return .failure(Refused(response: bearerChallenge("the token is unknown or expired", error: "invalid_token")))
        }
        tokens.remember(tokenHash: hash, clientID: token.clientID, expiresAt: token.expiresAt, now: now)
        return .success(token.clientID)
    }

    /// The client a request's bearer token was issued to and the request's `Idempotency-Key` (if any), or the
    /// refusal to answer (401, or 400 for a malformed key).
    private func authorizedWithKey(_ request: Request) async throws -> Result<(client: String, key: String?), Refused> {
        switch try await authorize(request) {
        case .failure(let refused): return .failure(refused)
        case .success(let client): return Self.idempotencyKey(request).map { (client, $0) }
        }
    }

    // MARK: - Envelopes and plain resources

    private func envelope(_ request: Request, type: String?) async throws -> Response {
        let client: String
        let key: String?
        switch try await authorizedWithKey(request) {
        case .failure(let refused): return refused.response
        case .success(let given): (client, key) = given
        }
        let body: ByteBuffer
        switch try await collectedBody(of: request) {
        case .failure(let refused): return refused.response
        case .success(let collected): body = collected
        }
        // The path's type is the sender's word only (the type inside counts once opened): one this queue does not
        // take (a DSTU2 type such as DiagnosticOrder, which C3-PRO apps may name) is queued unnamed, not refused:
        // a refusal would stop the device's queue at it for good.
        let named =
            type.flatMap { FHIRResource.isValidTypeName($0) && queue.configuration.resourceTypes.accepts($0) ? $0 : nil }
            ?? SealedEnvelope.unnamedType
        let envelope: SealedEnvelope
        do {
            envelope = try SealedEnvelope(json: Data(buffer: body), resourceType: named)
        } catch let error as DataQueueError {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        if let refused = try await overQuota(client, adding: body.readableBytes) { return refused }
        // With a key: a repeat is answered as the first was (202, nothing stored again); the receipt commits with
        // the item. Without one, the queue recognises a repeat when it opens it (client and plaintext digest).
        // The fingerprint only for a request with a key (it costs a parse and a hash: a tenth of an envelope's time).
        let fingerprint = key == nil ? "" : envelopeFingerprint(envelope, client: client)
        if let key, let first = try await queue.receipt(clientID: client, key: key) {
            return try await answerRepeat(first, fingerprint: fingerprint)
        }
        let idempotency = key.map { IdempotentRequest(key: $0, fingerprint: fingerprint, answer: (202, nil, Data())) }
        do {
            let target = route(version: envelope.version, type: named)
            if case .repeated(let first) = try await target.enqueue(envelope, from: client, idempotency: idempotency) {
                return try await answerRepeat(first, fingerprint: fingerprint)
            }
        } catch let error as DataQueueError where error.code == .invalidResource {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        return Response(status: .accepted)
    }

    /// Where the receiver's answers say a delivered resource is: `<prefix>/fhir`, a path of the receiver's own (the
    /// FHIR server behind it is not a device's business, nor reachable by it).
    var locationBase: String {
        let prefix = configuration.pathPrefix.split(separator: "/").joined(separator: "/")
        return (prefix.isEmpty ? "" : "/" + prefix) + "/fhir"
    }

    /// The queue of the first route that matches, else the receiver's.
    private func route(version: String?, type: String) -> DataQueue {
        configuration.routes.first { route in
            switch route.match {
            case .version(let wanted): wanted == version
            case .resourceType(let wanted): wanted == type
            }
        }?.queue ?? queue
    }

    /// The request's body, up to ``Configuration/maximumBodyBytes``, or the 413 to answer.
    private func collectedBody(of request: Request) async throws -> Result<ByteBuffer, Refused> {
        var request = request
        do {
            return .success(try await request.collectBody(upTo: configuration.maximumBodyBytes))
        } catch is NIOTooManyBytesError {
            return .failure(
                Refused(
                    response: FHIRExchange.outcome(
                        .contentTooLarge, "too-costly", "the body is larger than \(configuration.maximumBodyBytes) bytes")))
        }
    }

    /// A batch of envelopes from a `dq serve --role edge` (``EnvelopeBatch``): each checked as ``envelope(_:type:)``
    /// checks one, then all committed in one transaction, in order, before the 202; any bad one refuses the batch
    /// (400), nothing stored. Each is kept with the client the edge took it from, under the edge's own id
    /// (`<edge>/<origin>`), so that the repeat check tells an edge's devices apart and no client can speak for another's.
    private func envelopeBatch(_ request: Request) async throws -> Response {
        let client: String
        switch try await authorize(request) {
        case .failure(let refused): return refused.response
        case .success(let authorized): client = authorized
        }
        let body: ByteBuffer
        switch try await collectedBody(of: request) {
        case .failure(let refused): return refused.response
        case .success(let collected): body = collected
        }
        var envelopes: [(envelope: SealedEnvelope, clientID: String)] = []
        do {
            let entries = try EnvelopeBatch.decode(Data(buffer: body))
            guard entries.count <= EnvelopeBatch.maximumEntries else {
                return FHIRExchange.outcome(
                    .contentTooLarge, "too-costly", "an envelope batch holds at most \(EnvelopeBatch.maximumEntries) envelopes")
            }
            // `<edge>/<origin>`, the edge's id with its `/` and `%` escaped: no client's origin can name another's.
            let edge = client.replacingOccurrences(of: "%", with: "%25").replacingOccurrences(of: "/", with: "%2F")
            for (index, entry) in entries.enumerated() {
                let named =
                    FHIRResource.isValidTypeName(entry.type) && queue.configuration.resourceTypes.accepts(entry.type)
                    ? entry.type : SealedEnvelope.unnamedType
                do {
                    let envelope = try SealedEnvelope(json: entry.envelope, resourceType: named)
                    envelopes.append((envelope, entry.origin.map { "\(edge)/\($0)" } ?? client))
                } catch let error as DataQueueError {
                    throw DataQueueError(.invalidResource, "envelope \(index + 1): \(error.message)")
                }
            }
            // One transaction per route's queue, each in the batch's order; without routes, the whole batch.
            var targets: [(queue: DataQueue, envelopes: [(envelope: SealedEnvelope, clientID: String)])] = []
            for forwarded in envelopes {
                let target = route(version: forwarded.envelope.version, type: forwarded.envelope.resourceType)
                if let index = targets.firstIndex(where: { $0.queue === target }) {
                    targets[index].envelopes.append(forwarded)
                } else {
                    targets.append((target, [forwarded]))
                }
            }
            for target in targets { _ = try await target.queue.enqueue(forwarded: target.envelopes) }
        } catch let error as DataQueueError where error.code == .invalidResource {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        return json(.accepted, ["accepted": envelopes.count])
    }

    private func plain(_ request: Request, type: String, id: String?) async throws -> Response {
        guard configuration.acceptsPlainResources else {
            return FHIRExchange.outcome(.notFound, "not-supported", "this receiver takes encrypted envelopes only")
        }
        let client: String
        let key: String?
        switch try await authorizedWithKey(request) {
        case .failure(let refused): return refused.response
        case .success(let given): (client, key) = given
        }
        let resource: FHIRResource
        do {
            resource = try await FHIRExchange.resource(from: request, maximumBytes: configuration.maximumBodyBytes, types: [type])
        } catch let refusal as FHIRExchange.Refusal {
            return refusal.response
        }
        if let id, resource.id != id {
            return FHIRExchange.outcome(.badRequest, "invalid", "the resource's id is not the one in the path")
        }
        let target = route(version: nil, type: resource.resourceType)
        if let refused = try await overQuota(client, adding: resource.data.count) { return refused }
        if let refused = try await writeRefusal(resource, method: id == nil ? .post : .put, pathType: type, client: client, queue: target) {
            return refused
        }
        let path = "fhir/\(type)" + (id.map { "/\($0)" } ?? "")
        let fingerprint = key == nil ? "" : Self.plainFingerprint(method: id == nil ? "POST" : "PUT", path: path, body: resource.data)
        if let key, let first = try await queue.receipt(clientID: client, key: key) {
            return try await answerRepeat(first, fingerprint: fingerprint)
        }
        let idempotency = key.map { IdempotentRequest(key: $0, fingerprint: fingerprint) }
        let item: QueuedItem
        do {
            // A queue that seals what it takes (an edge's) posts every envelope: the update is the opener's to make.
            let sealing = queue is EncryptedDataQueue && queue.defaultMethod(for: resource) == .post
            switch try await target.enqueue(resource, method: id == nil || sealing ? .post : .put, from: client, idempotency: idempotency) {
            case .queued(let queued): item = queued
            case .repeated(let first): return try await answerRepeat(first, fingerprint: fingerprint)
            }
        } catch let error as DataQueueError where error.code == .invalidResource {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        // Committed. The queue's delivery sends it in its turn (the enqueue woke it); the answer waits a short while
        // for that, never for a backlog or a server that is slow to answer (flushing here did: a device then waited
        // for its request timeout, and sent the resource again).
        let deadline = ContinuousClock.now + configuration.deliveryWait
        var answer: Answer
        while true {
            if let made = Answer.of(
                try await target.journalRecord(item.id.uuidString.lowercased()), item: item.id, locationBase: locationBase)
            {
                answer = made
                break
            }
            guard ContinuousClock.now < deadline else {
                answer = .queued(item.id)
                break
            }
            try await Task.sleep(for: .milliseconds(20))
        }
        if let idempotency {
            try await record(
                answer, for: Receipt(clientID: client, key: idempotency.key, fingerprint: fingerprint, itemID: item.id))
        }
        return answer.response
    }

    /// The answer to a request that would take `client` past what it may have waiting (429 by count, 507 by bytes),
    /// or nil; counts the request when it goes on. Nothing is stored for a refused request.
    private func overQuota(_ client: String, adding bytes: Int) async throws -> Response? {
        let count = configuration.maximumWaitingPerClient
        let most = configuration.maximumWaitingBytesPerClient
        guard count > 0 || most > 0 else { return nil }
        let waiting = try await waitingCounts.waiting(client) { try await registry.waiting(clientID: client) }
        if count > 0 && waiting.count >= count {
            Counter(label: "dq_serve_quota_refusals_total", dimensions: [("limit", "count")]).increment()
            var response = FHIRExchange.outcome(
                .tooManyRequests, "throttled", "this device has \(count) resources waiting at the receiver; send again later")
            response.headers[.retryAfter] = "60"
            return response
        }
        if most > 0 && waiting.bytes + bytes > most {
            Counter(label: "dq_serve_quota_refusals_total", dimensions: [("limit", "bytes")]).increment()
            var response = FHIRExchange.outcome(
                .init(code: 507, reasonPhrase: "Insufficient Storage"), "too-costly",
                "this device has \(most) bytes waiting at the receiver; send again later")
            response.headers[.retryAfter] = "60"
            return response
        }
        waitingCounts.add(client, bytes: bytes)
        return nil
    }

    /// The 403 for a plain write the queue's ``WritePolicy`` refuses: a type devices may not write, a `DELETE` or
    /// conditional entry in a Bundle, a path that names another type, or a `PUT` over a resource another client
    /// wrote. Nil when it may be queued (whether a `PUT`'s id is new on the server is asked when it is sent).
    private func writeRefusal(
        _ resource: FHIRResource, method: FHIRMethod, pathType: String, client: String, queue: DataQueue
    ) async throws -> Response? {
        switch queue.configuration.writePolicy.evaluate(resource, method: method, pathType: pathType) {
        case .refused(let why):
            Counter(label: "dq_write_policy_refusals_total").increment()
            return FHIRExchange.outcome(.forbidden, "forbidden", WritePolicy.refusalPrefix + why)
        case .allowed(let targets):
            for target in targets {
                if let owner = try await registry.resourceOwner(queue: queue.queueName, target: target.path), owner != client {
                    Counter(label: "dq_write_policy_refusals_total").increment()
                    return FHIRExchange.outcome(
                        .forbidden, "forbidden", WritePolicy.refusalPrefix + "\(target.path) was written by another client")
                }
            }
            return nil
        }
    }

    private func questionnaire(_ request: Request, id: String) async throws -> Response {
        if case .failure(let refused) = try await authorize(request) { return refused.response }
        let valid = !id.isEmpty && id.count <= 64 && id.allSatisfy { $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "-" || $0 == ".") }
        guard valid, id != ".", id != "..", let directory = configuration.questionnairesDirectory,
            let data = FileManager.default.contents(atPath: directory + "/" + id + ".json")
        else {
            return FHIRExchange.outcome(.notFound, "not-found", "no Questionnaire with this id")
        }
        return Response(
            status: .ok, headers: [.contentType: "application/fhir+json"], body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }

    // MARK: - Answers

    /// Counts an answer given to one of the receiver's routes before it ran (by ``BodyLimitMiddleware``: a body
    /// refused, 413 or 408, or a request ``admit(_:endpointPath:)`` answered) as the route's own answers are counted:
    /// per endpoint and status.
    /// `endpointPath` is the route the router resolved (`RequestContext.endpointPath`); another route's is not counted.
    public func countRefusal(_ request: Request, endpointPath: String?, status: HTTPResponse.Status) {
        guard let endpoint = endpoint(of: request, route: endpointPath) else { return }
        count(endpoint, status)
    }

    /// The body limit of a request to one of the receiver's routes whose bodies are small (`register` 1 MiB, `oauth`
    /// 64 KiB), for ``BodyLimitMiddleware``'s `limit`: what a client that has not authenticated can make the receiver
    /// hold. Nil for the others (the host's maximum).
    public func bodyLimit(_ request: Request, endpointPath: String?) -> Int? {
        switch endpoint(of: request, route: endpointPath) {
        case .register: Self.registrationBodyLimit
        case .oauth: Self.tokenRequestBodyLimit
        default: nil
        }
    }

    /// The answer to a request to a bearer route (`encfhir`, `fhir`) whose token is missing, unknown or expired, from
    /// its head alone, for ``BodyLimitMiddleware``'s `admit`: its body is then read and thrown away, never kept.
    /// Nil for a request that goes on (the route checks the token again, from the cache). The middleware tells
    /// ``countRefusal(_:endpointPath:status:)`` of what it answers in the end (this 401, or a 413 or 408 while the
    /// body was being read).
    public func admit(_ request: Request, endpointPath: String?) async -> Response? {
        guard let endpoint = endpoint(of: request, route: endpointPath),
            [.envelope, .envelopeBatch, .plain].contains(endpoint),
            case .failure(let refused) = try? await authorize(request)
        else { return nil }
        return refused.response
    }

    /// The ``BodyLimitMiddleware`` for a router that serves these routes: bodies up to `maximumBytes` (the
    /// configuration's ``Configuration/maximumBodyBytes`` by default) within `deadline`, the small endpoints' own
    /// limits (``bodyLimit(_:endpointPath:)``), a request with no valid token answered without its body being kept
    /// (``admit(_:endpointPath:)``), and each refusal counted with the route's answers (``countRefusal(_:endpointPath:status:)``).
    public func bodyLimitMiddleware<Context: RequestContext>(
        maximumBytes: Int? = nil, deadline: Duration? = .seconds(60)
    ) -> BodyLimitMiddleware<Context> {
        BodyLimitMiddleware(
            maximumBytes: maximumBytes ?? configuration.maximumBodyBytes, deadline: deadline,
            refused: { request, context, status in countRefusal(request, endpointPath: context.endpointPath, status: status) },
            limit: { request, context in bodyLimit(request, endpointPath: context.endpointPath) },
            admit: { request, context in await admit(request, endpointPath: context.endpointPath) })
    }

    static let registrationBodyLimit = 1 << 20
    static let tokenRequestBodyLimit = 64 << 10

    /// One answer of `endpoint`, in `dq_serve_requests_total`.
    private func count(_ endpoint: Endpoint, _ status: HTTPResponse.Status) {
        Counter(label: "dq_serve_requests_total", dimensions: [("endpoint", endpoint.rawValue), ("status", String(status.code))])
            .increment()
    }

    /// The endpoints as `dq_serve_requests_total` names them: one name for each kind of request, whichever of its
    /// paths it came by.
    enum Endpoint: String {
        case register, oauth
        case envelope = "encfhir"
        case envelopeBatch = "encfhir_batch"
        case plain = "fhir"
        case questionnaire

        /// Whether its answers are timed in `dq_serve_ingest_duration_seconds`: the two that commit what a device sends.
        var isIngest: Bool { self == .envelope || self == .plain }
    }

    /// The endpoint ``addRoutes(to:)`` counts a request to `route` under; nil for a route not its own.
    private func endpoint(of request: Request, route: String?) -> Endpoint? {
        let prefix = configuration.pathPrefix.split(separator: "/")
        guard var parts = route?.split(separator: "/"), parts.starts(with: prefix) else { return nil }
        parts.removeFirst(prefix.count)
        // A method the path does not take is none of these (its route answers 405).
        switch (parts.first, request.method) {
        case ("register", .post): return .register
        case ("oauth", .post): return .oauth
        case ("encfhir", .post), ("fhirenc", .post):
            return EnvelopeBatch.isBatch(contentType: request.headers[.contentType]) ? .envelopeBatch : .envelope
        case ("fhir", .get): return .questionnaire
        case ("fhir", .post), ("fhir", .put): return .plain
        default: return nil
        }
    }

    struct Refused: Error {
        let response: Response
    }

    /// Runs a handler, counts its answer per endpoint and status, and turns an unexpected error (storage) into a
    /// 503 that names no input: the device keeps the resource and tries again.
    private func measured(_ endpoint: Endpoint, _ handler: () async throws -> Response) async -> Response {
        let start = ContinuousClock.now
        let response: Response
        do {
            response = try await handler()
        } catch {
            logger.error(
                "a request could not be committed", metadata: ["endpoint": "\(endpoint.rawValue)", "error": "\(Self.describe(error))"])
            response = FHIRExchange.outcome(.serviceUnavailable, "transient", "the receiver cannot store it now; try again later")
        }
        count(endpoint, response.status)
        if endpoint.isIngest {
            let elapsed = ContinuousClock.now - start
            Timer(label: "dq_serve_ingest_duration_seconds", dimensions: [("endpoint", endpoint.rawValue)])
                .recordNanoseconds(elapsed.components.seconds * 1_000_000_000 + elapsed.components.attoseconds / 1_000_000_000)
        }
        return response
    }

    private static func describe(_ error: any Error) -> String {
        (error as? DataQueueError).map { "\($0.code): \($0.message)" } ?? String(describing: type(of: error))
    }

    private func json(_ status: HTTPResponse.Status, _ object: [String: Any]) -> Response {
        let data = (try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])) ?? Data()
        return Response(status: status, headers: [.contentType: "application/json"], body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }

    /// An RFC 6749 5.2 error answer.
    private func oauthError(_ status: HTTPResponse.Status, _ error: String, _ description: String, challenge: Bool = false) -> Response {
        var response = json(status, ["error": error, "error_description": description])
        if challenge { response.headers[.wwwAuthenticate] = #"Basic realm="dq""# }
        response.headers[.cacheControl] = "no-store"
        return response
    }

    private func bearerChallenge(_ description: String, error: String? = nil) -> Response {
        var response = FHIRExchange.outcome(.unauthorized, "login", description)
        response.headers[.wwwAuthenticate] = #"Bearer realm="dq""# + (error.map { #", error="\#($0)""# } ?? "")
        return response
    }

    /// The key of ``secretChecks``' one window.
    private static let everyone = "*"

    /// 503 with `Retry-After`: the receiver takes no more secret checks this minute (from anyone).
    private func busy(_ wait: Int) -> Response {
        var response = oauthError(
            .serviceUnavailable, "temporarily_unavailable", "the receiver is checking too many secrets now; try again later")
        response.headers[.retryAfter] = String(wait)
        return response
    }

    private func tooMany(_ wait: Int) -> Response {
        var response = oauthError(.tooManyRequests, "slow_down", "too many requests from this address; try again later")
        response.headers[.retryAfter] = String(wait)
        return response
    }

    // MARK: - Parsing

    /// `application/x-www-form-urlencoded` fields (the first of each name).
    static func formFields(_ text: String) -> [String: String] {
        var fields: [String: String] = [:]
        for pair in text.split(separator: "&") {
            let parts = pair.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
            guard let name = formDecode(String(parts[0])), fields[name] == nil else { continue }
            fields[name] = parts.count > 1 ? formDecode(String(parts[1])) : ""
        }
        return fields
    }

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

/// Whether two byte sequences of the same length are equal, in time that depends on that length only.
func constantTimeEquals(_ x: [UInt8], _ y: [UInt8]) -> Bool {
    guard x.count == y.count else { return false }
    var difference: UInt8 = 0
    for (a, b) in zip(x, y) { difference |= a ^ b }
    return difference == 0
}

/// The `Antispam` values `register` accepts, replaceable while the receiver serves. Each is kept as its SHA-256, and
/// an offered value is hashed and compared with each in constant time: the time an answer takes depends on the
/// offered value's length only, never on a secret's content or length.
final class AntispamSecrets: Sendable {
    private let digests: NIOLockedValueBox<[[UInt8]]>

    init(_ secrets: [String]) { digests = NIOLockedValueBox(secrets.map(Self.digest)) }

    /// Accepts `secrets` from now on (and no other).
    func replace(_ secrets: [String]) { digests.withLockedValue { $0 = secrets.map(Self.digest) } }

    /// Whether `offered` is one of the secrets. Every secret is compared, whichever matches.
    func accepts(_ offered: String) -> Bool {
        let candidate = Self.digest(offered)
        return digests.withLockedValue { $0 }.reduce(false) { found, digest in constantTimeEquals(digest, candidate) || found }
    }

    private static func digest(_ secret: String) -> [UInt8] { Array(SHA256.hash(data: Data(secret.utf8))) }
}

extension C3PROReceiver {
    /// The address a request is limited by: the peer's, or, from a trusted proxy, the rightmost address of
    /// `X-Forwarded-For` that is not a trusted proxy itself ("unknown" without a peer address).
    func clientAddress(_ request: Request, peer: SocketAddress?) -> String {
        let address = peer?.ipAddress ?? "unknown"
        let trusted = configuration.trustedProxies
        guard trusted.contains(address) else { return address }
        let forwarded = request.headers[values: .init("X-Forwarded-For")!].flatMap { $0.split(separator: ",") }
            .map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
        return forwarded.last { !trusted.contains($0) } ?? forwarded.first ?? address
    }
}

/// A fixed window per source address: at most `perMinute` requests in each minute.
///
/// An IPv6 address is counted by its /64 (what one host or subscriber is given: counting each address would give
/// it 2^64 budgets), an IPv4-mapped one as its IPv4 address. The table is bounded: windows over a minute old are
/// swept at most once a second once it holds more than ``sweepAbove``, and past ``capacity`` addresses a new one
/// shares one window with every other new one (under a flood from many addresses, new addresses are limited
/// together rather than the table growing, and the addresses already counted keep their own windows).
final class RateLimiter: Sendable {
    /// The most addresses with their own window.
    static let capacity = 100_000
    /// The size above which expired windows are swept (at most once a second).
    static let sweepAbove = 10_000
    /// The window new addresses share once the table is full.
    static let overflow = "(overflow)"

    private struct State {
        var windows: [String: (start: ContinuousClock.Instant, count: Int)] = [:]
        var swept: ContinuousClock.Instant?
    }

    private let perMinute: Int
    private let capacity: Int
    private let state = NIOLockedValueBox(State())

    init(perMinute: Int, capacity: Int = RateLimiter.capacity) {
        self.perMinute = perMinute
        self.capacity = capacity
    }

    /// How many addresses have a window now (for tests).
    var count: Int { state.withLockedValue { $0.windows.count } }

    /// Nil when a request from `address` (a client address) may go at `now`; else the seconds to wait.
    func refuse(_ address: String, now: ContinuousClock.Instant = .now) -> Int? {
        guard perMinute > 0 else { return nil }
        var key = Self.bucket(address)
        return state.withLockedValue { state in
            if state.windows.count > min(Self.sweepAbove, capacity), state.swept.map({ now - $0 >= .seconds(1) }) ?? true {
                state.windows = state.windows.filter { now - $0.value.start < .seconds(60) }
                state.swept = now
            }
            if state.windows[key] == nil, state.windows.count >= capacity { key = Self.overflow }
            var window = state.windows[key] ?? (now, 0)
            if now - window.start >= .seconds(60) { window = (now, 0) }
            window.count += 1
            state.windows[key] = window
            guard window.count > perMinute else { return nil }
            return max(1, Int((window.start + .seconds(60) - now).components.seconds) + 1)
        }
    }

    /// What `address` is counted as: an IPv6 address's /64 (`2001:db8:0:1::/64`), an IPv4-mapped IPv6 address's
    /// IPv4 address, anything else itself.
    static func bucket(_ address: String) -> String {
        var bytes = [UInt8](repeating: 0, count: 16)
        guard address.contains(":"), inet_pton(AF_INET6, address, &bytes) == 1 else { return address }
        if bytes[0..<10].allSatisfy({ $0 == 0 }) && bytes[10] == 0xff && bytes[11] == 0xff {
            return bytes[12...].map(String.init).joined(separator: ".")
        }
        let groups = stride(from: 0, to: 8, by: 2).map { String(UInt16(bytes[$0]) << 8 | UInt16(bytes[$0 + 1]), radix: 16) }
        return groups.joined(separator: ":") + "::/64"
    }
}

/// Bearer tokens found valid, by their hash, so that a device's requests do not each read the database (on SQLite
/// that read waits its turn behind the commits on the one connection). A token can only expire (there is no
/// revocation), so an entry is good until its token's expiry; it is kept at most ``longest`` all the same, so that a
/// removal made in the database takes effect within that time. An unknown token is not remembered: one issued by
/// another receiver on the same database is found there on its first use.
final class TokenCache: Sendable {
    /// The longest an entry is trusted without reading the database again.
    static let longest: TimeInterval = 300
    /// The most entries kept (one per device token in use); past it, the expired go, then all.
    static let capacity = 20_000
    private let entries = NIOLockedValueBox<[String: (clientID: String, until: Date)]>([:])

    /// The client of a cached token still valid at `now`, or nil.
    func client(tokenHash: String, now: Date) -> String? {
        entries.withLockedValue { entries in
            guard let entry = entries[tokenHash] else { return nil }
            guard entry.until > now else {
                entries[tokenHash] = nil
                return nil
            }
            return entry.clientID
        }
    }

    /// How many entries are kept.
    var count: Int { entries.withLockedValue { $0.count } }

    /// Remembers a token the database found valid until `expiresAt`.
    func remember(tokenHash: String, clientID: String, expiresAt: Date, now: Date) {
        let until = min(expiresAt, now.addingTimeInterval(Self.longest))
        entries.withLockedValue { entries in
            if entries.count >= Self.capacity {
                entries = entries.filter { $0.value.until > now }
                if entries.count >= Self.capacity { entries.removeAll(keepingCapacity: true) }
            }
            entries[tokenHash] = (clientID, until)
        }
    }
}
