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
///   unchanged, then answered 202. The queue opens it later with its `EnvelopeKeyring` (or forwards it as it is).
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
        /// Where the receiver reads the time: token expiry, registration times and pruning by the wall clock, rate
        /// limits, backoff and waiting counts by the monotonic one. The system's clocks by default; a test gives a
        /// source it advances. (How long a request took, for metrics, and the wait for a delivery are real time.)
        public var time: TimeSource = .system

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
    let registry: any ClientRegistry
    let tokens = TokenCache()
    /// When expired tokens were last removed (nil: not yet, by this receiver).
    let tokensPruned = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
    let limiter: RateLimiter
    /// ``Configuration/secretChecksPerMinute``: one window for every address.
    let secretChecks: RateLimiter
    /// Wrong secrets per client id (``FailureBackoff``).
    let failedSecrets = FailureBackoff()
    /// What each client has waiting, read from the database at most once a second per client.
    let waitingCounts = WaitingCounts()
    let antispam: AntispamSecrets
    let assertions: ClientAssertionVerifier
    let logger: Logger

    /// A receiver that commits to `queue` (and keeps its clients and tokens in `queue`'s database).
    /// - Throws: `DataQueueError` with `.invalidConfiguration` when a key set of
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
    /// - Throws: `DataQueueError` with `.invalidConfiguration` naming a key that cannot be used.
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
    ///
    /// Each bearer route checks the request's token itself: mount `bodyLimitMiddleware(maximumBytes:deadline:)`
    /// in front of the routes with a context that is also an ``AuthenticatedClientContext`` (as
    /// ``ReceiverRequestContext`` is) and the token is checked there once, before the body is read.
    @_disfavoredOverload  // a context that can carry the client takes the overload below
    public func addRoutes<Context: RemoteAddressRequestContext>(to router: some RouterMethods<Context>) {
        addRoutes(to: router) { _ in nil }
    }

    /// Adds the receiver's routes to `router`, whose requests carry the client their token names once
    /// `bodyLimitMiddleware(maximumBytes:deadline:)` has checked it: the routes do not check it again.
    public func addRoutes<Context: RemoteAddressRequestContext & AuthenticatedClientContext>(
        to router: some RouterMethods<Context>
    ) {
        addRoutes(to: router) { $0.authenticatedClient }
    }

    private func addRoutes<Context: RemoteAddressRequestContext>(
        to router: some RouterMethods<Context>, found: @escaping @Sendable (Context) -> String?
    ) {
        // One group under the prefix (the root when it is empty): the receiver's routes and their 405s.
        let prefix = configuration.pathPrefix.split(separator: "/").joined(separator: "/")
        let router = prefix.isEmpty ? router.group() : router.group(RouterPath(prefix))
        func path(_ rest: String) -> RouterPath { RouterPath(rest) }
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
                    return await measured(.envelopeBatch) {
                        try await envelopeBatch(request, client: client(of: request, found: found(context)))
                    }
                }
                return await measured(.envelope) {
                    try await envelope(request, client: client(of: request, found: found(context)), type: context.parameters.get("type"))
                }
            }
        }
        router.post(path("fhir/{type}")) { request, context in
            await measured(.plain) {
                try await plain(
                    request, client: { try await client(of: request, found: found(context)) }, type: context.parameters.get("type") ?? "",
                    id: nil)
            }
        }
        router.put(path("fhir/{type}/{id}")) { request, context in
            await measured(.plain) {
                try await plain(
                    request, client: { try await client(of: request, found: found(context)) }, type: context.parameters.get("type") ?? "",
                    id: context.parameters.get("id"))
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
        guard case .refused(let response) = await authenticate(request, endpointPath: endpointPath) else { return nil }
        return response
    }

    /// What the head of a request to a bearer route says of its client: refused (the 401), the client its token
    /// names, or not known here (another route, or the token could not be looked up: the route says).
    enum Authentication {
        case refused(Response)
        case client(String)
        case unknown
    }

    func authenticate(_ request: Request, endpointPath: String?) async -> Authentication {
        guard let endpoint = endpoint(of: request, route: endpointPath), [.envelope, .envelopeBatch, .plain].contains(endpoint)
        else { return .unknown }
        do {
            return .client(try await authorize(request))
        } catch let refused as Refused {
            return .refused(refused.response)
        } catch {
            return .unknown
        }
    }

    /// The ``BodyLimitMiddleware`` for a router that serves these routes: bodies up to `maximumBytes` (the
    /// configuration's ``Configuration/maximumBodyBytes`` by default) within `deadline`, the small endpoints' own
    /// limits (``bodyLimit(_:endpointPath:)``), a request with no valid token answered without its body being kept
    /// (``admit(_:endpointPath:)``), and each refusal counted with the route's answers (``countRefusal(_:endpointPath:status:)``).
    ///
    /// With a context that is an ``AuthenticatedClientContext`` the client the token names is set on it, and the
    /// routes do not check the token again.
    public func bodyLimitMiddleware<Context: AuthenticatedClientContext>(
        maximumBytes: Int? = nil, deadline: Duration? = .seconds(60)
    ) -> BodyLimitMiddleware<Context> {
        bodyLimitMiddleware(maximumBytes: maximumBytes, deadline: deadline) { $0.authenticatedClient = $1 }
    }

    /// The ``BodyLimitMiddleware`` for a router that serves these routes, as above, for a context that cannot carry
    /// the client: the routes check the token again (from the cache).
    @_disfavoredOverload  // a context that can carry the client takes the overload above
    public func bodyLimitMiddleware<Context: RequestContext>(
        maximumBytes: Int? = nil, deadline: Duration? = .seconds(60)
    ) -> BodyLimitMiddleware<Context> {
        bodyLimitMiddleware(maximumBytes: maximumBytes, deadline: deadline) { _, _ in }
    }

    /// Both: `carry` puts the client found (or nil) on the context.
    private func bodyLimitMiddleware<Context: RequestContext>(
        maximumBytes: Int?, deadline: Duration?, carry: @escaping @Sendable (inout Context, String?) -> Void
    ) -> BodyLimitMiddleware<Context> {
        BodyLimitMiddleware(
            maximumBytes: maximumBytes ?? configuration.maximumBodyBytes, deadline: deadline,
            refused: { request, context, status in countRefusal(request, endpointPath: context.endpointPath, status: status) },
            limit: { request, context in bodyLimit(request, endpointPath: context.endpointPath) },
            authenticate: { request, context in
                // What another middleware set is not trusted: the routes get only what this receiver found now
                // (or nil, and check the token themselves). The token is checked before the body is read; a token
                // that expires while a body arrives still counts for that request.
                carry(&context, nil)
                switch await authenticate(request, endpointPath: context.endpointPath) {
                case .refused(let response): return response
                case .client(let client):
                    carry(&context, client)
                    return nil
                case .unknown: return nil
                }
            })
    }

    static let registrationBodyLimit = 1 << 20
    static let tokenRequestBodyLimit = 64 << 10

    /// One answer of `endpoint`, in `dq_serve_requests_total`.
    func count(_ endpoint: Endpoint, _ status: HTTPResponse.Status) {
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

    /// The endpoint `addRoutes(to:)` counts a request to `route` under; nil for a route not its own.
    func endpoint(of request: Request, route: String?) -> Endpoint? {
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

    /// A refusal a route throws: the answer, counted and sent as it is (Hummingbird sends an `HTTPResponseError`'s
    /// response; ``measured(_:_:)`` counts it first).
    struct Refused: HTTPResponseError {
        let response: Response

        init(_ response: Response) { self.response = response }

        var status: HTTPResponse.Status { response.status }

        func response(from request: Request, context: some RequestContext) throws -> Response { response }
    }

    /// Runs a handler, counts its answer per endpoint and status, and turns an unexpected error (storage) into a
    /// 503 that names no input: the device keeps the resource and tries again.
    func measured(_ endpoint: Endpoint, _ handler: () async throws -> Response) async -> Response {
        let start = ContinuousClock.now
        let response: Response
        do {
            response = try await handler()
        } catch let refused as Refused {
            response = refused.response
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

    static func describe(_ error: any Error) -> String {
        (error as? DataQueueError).map { "\($0.code): \($0.message)" } ?? String(describing: type(of: error))
    }

    func json(_ status: HTTPResponse.Status, _ object: [String: Any]) -> Response {
        let data = (try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])) ?? Data()
        return Response(status: status, headers: [.contentType: "application/json"], body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }

    /// An RFC 6749 5.2 error answer.
    func oauthError(_ status: HTTPResponse.Status, _ error: String, _ description: String, challenge: Bool = false) -> Response {
        var response = json(status, ["error": error, "error_description": description])
        if challenge { response.headers[.wwwAuthenticate] = #"Basic realm="dq""# }
        response.headers[.cacheControl] = "no-store"
        return response
    }

    func bearerChallenge(_ description: String, error: String? = nil) -> Response {
        var response = FHIRExchange.outcome(.unauthorized, "login", description)
        response.headers[.wwwAuthenticate] = #"Bearer realm="dq""# + (error.map { #", error="\#($0)""# } ?? "")
        return response
    }

    /// The key of ``secretChecks``' one window.
    static let everyone = "*"

    /// 503 with `Retry-After`: the receiver takes no more secret checks this minute (from anyone).
    func busy(_ wait: Int) -> Response {
        var response = oauthError(
            .serviceUnavailable, "temporarily_unavailable", "the receiver is checking too many secrets now; try again later")
        response.headers[.retryAfter] = String(wait)
        return response
    }

    func tooMany(_ wait: Int) -> Response {
        var response = oauthError(.tooManyRequests, "slow_down", "too many requests from this address; try again later")
        response.headers[.retryAfter] = String(wait)
        return response
    }

}
