import AsyncHTTPClient
import FHIRDataQueue
import FHIRDataQueueServer
import Foundation
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import Testing

/// The C3-PRO receiver as a library: `C3PROReceiver`'s routes mounted in a Hummingbird `Application` of the test's
/// own, with the queue's `DataQueueService` beside them, in front of sekmet-fhir, over real HTTP on loopback. Here the
/// receiver's wait for delivery is the test's to choose, so a plain resource's 201 (delivered within the wait) and
/// 202 (still queued when it ends) are each checked on their own, not left to how busy the machine is.
@Suite("The C3-PRO receiver mounted in process", .serialized, .enabled(if: Peers.enabled))
struct ReceiverLibraryTests {
    let work: TemporaryDirectory
    let resources = Resources()
    let antispam = "spam-" + UUID().uuidString.lowercased()
    static let quiet = Logger(label: "dq.test", factory: { _ in SwiftLogNoOpLogHandler() })

    init() throws { work = try TemporaryDirectory() }

    /// A host application serving the receiver's routes (under `/c3pro`) and delivering the queue, on a free port.
    final class Host: Sendable {
        let queue: DataQueue
        let port: Int
        let running: Task<Void, any Error>
        var base: String { "http://127.0.0.1:\(port)/c3pro" }

        init(queue: DataQueue, port: Int, running: Task<Void, any Error>) {
            self.queue = queue
            self.port = port
            self.running = running
        }

        /// Stops the application and its delivery, then closes the queue.
        func stop() async throws {
            running.cancel()
            _ = await running.result
            try await queue.shutdown()
        }
    }

    /// Mounts a receiver that waits `deliveryWait` for a plain resource's delivery, on a queue for `server`.
    func host(
        server: String, deliveryWait: Duration, impostor: NIOLockedValueBox<String?>? = nil,
        configure: (inout FHIRDataQueueServer.C3PROReceiver.Configuration) -> Void = { _ in }
    ) async throws -> Host {
        var configuration = DataQueue.Configuration(databasePath: work.file("queue.sqlite"))
        configuration.retryPolicy = RetryPolicy(initialDelay: 0.1, maximumDelay: 0.5)
        configuration.requestTimeout = 30
        let queue = try await DataQueue(baseURL: URL(string: server)!, configuration: configuration)
        var receiving = FHIRDataQueueServer.C3PROReceiver.Configuration(antispamSecrets: [antispam], deliveryWait: deliveryWait)
        configure(&receiving)
        let receiver = try FHIRDataQueueServer.C3PROReceiver(queue: queue, configuration: receiving, logger: Self.quiet)
        let router = Router(context: ReceiverRequestContext.self)
        router.add(middleware: receiver.bodyLimitMiddleware())
        if let impostor { router.add(middleware: ImpostorMiddleware(impostor: impostor)) }
        receiver.addRoutes(to: router)
        return try await start(router, queue: queue)
    }

    /// Runs `router` with the queue's delivery beside it, on a free port.
    func start<Context: RequestContext>(_ router: Router<Context>, queue: DataQueue) async throws -> Host
    where Context.Source == ApplicationRequestContextSource {
        let (bound, binding) = AsyncStream.makeStream(of: Int.self)
        let app = Application(
            router: router, configuration: .init(address: .hostname("127.0.0.1", port: 0)),
            services: [DataQueueService(queues: [queue], configuration: .init(pollInterval: .seconds(1)), logger: Self.quiet)],
            onServerRunning: { channel in
                binding.yield(channel.localAddress?.port ?? 0)
                binding.finish()
            },
            logger: Self.quiet)
        let running = Task { try await app.run() }
        guard let port = await bound.first(where: { _ in true }), port > 0 else {
            running.cancel()
            let ended = await running.result
            throw TestFailure("the application did not start: \(ended)")
        }
        return Host(queue: queue, port: port, running: running)
    }

    /// An answer's status, headers and body.
    struct Answer: CustomStringConvertible {
        let status: Int
        let headers: HTTPHeaders
        let body: Data
        var object: [String: Any] { (try? JSONSerialization.jsonObject(with: body)) as? [String: Any] ?? [:] }
        var description: String { "\(status) \(String(decoding: body.prefix(600), as: UTF8.self))" }
    }

    func send(_ method: HTTPMethod, _ url: String, headers: [(String, String)] = [], body: String) async throws -> Answer {
        var request = HTTPClientRequest(url: url)
        request.method = method
        for (name, value) in headers { request.headers.add(name: name, value: value) }
        request.body = .bytes(ByteBuffer(string: body))
        let response = try await HTTPClient.shared.execute(request, timeout: .seconds(300))
        let collected = try await response.body.collect(upTo: 1 << 20)
        return Answer(status: Int(response.status.code), headers: response.headers, body: Data(buffer: collected))
    }

    /// Registers with the antispam secret and gets a token, as a C3-PRO app does; the bearer token.
    func bearer(_ host: Host) async throws -> String {
        let (id, secret) = try await register(host)
        return try await bearer(host, id: id, secret: secret)
    }

    /// Registers with the antispam secret, as a C3-PRO app does: the client id and secret.
    func register(_ host: Host) async throws -> (id: String, secret: String) {
        let registered = try await send(
            .POST, host.base + "/register", headers: [("Antispam", antispam), ("Content-Type", "application/json")],
            body: #"{"sandbox": false, "receipt-data": "NO-APP-RECEIPT"}"#)
        #expect(registered.status == 201, "\(registered)")
        let id = try #require(registered.object["client_id"] as? String, "\(registered)")
        let secret = try #require(registered.object["client_secret"] as? String, "\(registered)")
        return (id, secret)
    }

    /// A token for the client `id` with `secret`, sent in HTTP Basic.
    func bearer(_ host: Host, id: String, secret: String) async throws -> String {
        let basic = Data("\(id):\(secret)".utf8).base64EncodedString()
        let token = try await send(
            .POST, host.base + "/oauth",
            headers: [("Authorization", "Basic \(basic)"), ("Content-Type", "application/x-www-form-urlencoded")],
            body: "grant_type=client_credentials")
        #expect(token.status == 200, "\(token)")
        return try #require(token.object["access_token"] as? String, "\(token)")
    }

    func postObservation(_ host: Host, _ index: Int, token: String) async throws -> Answer {
        try await send(
            .POST, host.base + "/fhir/Observation",
            headers: [("Authorization", "Bearer \(token)"), ("Content-Type", "application/fhir+json")],
            body: resources.observation(index))
    }

    @Test(
        "With a long delivery wait, a plain Observation is answered 201 with a Location that names the resource sekmet stored"
    )
    func deliveredWithinTheWait() async throws {
        let server = try await FHIRServer.start()
        // Far longer than any delivery to a running sekmet: the answer cannot be a 202 because the machine is busy.
        let host = try await host(server: server.base, deliveryWait: .seconds(120))
        let token = try await bearer(host)

        let answer = try await postObservation(host, 7, token: token)
        #expect(answer.status == 201, "\(answer)")
        let location = try #require(answer.headers.first(name: "Location"), "\(answer.headers)")
        // Under the receiver's own path: the FHIR server behind it is not the device's business.
        #expect(location.hasPrefix("/c3pro/fhir/Observation/") && location.contains("/_history/"), "\(location)")
        #expect(!location.contains("127.0.0.1"), "\(location)")

        // The Location names the resource sekmet stored: the one Observation of this test, posted once.
        let parts = location.split(separator: "/")
        let storedID = try #require(parts.firstIndex(of: "Observation").map { String(parts[$0 + 1]) })
        let (status, body) = try await HTTP.get(server.base + "/Observation/" + storedID)
        #expect(status == 200, "GET \(location)")
        let stored = try #require(try JSONSerialization.jsonObject(with: body) as? [String: Any])
        let identifier = (stored["identifier"] as? [[String: Any]])?.first
        #expect(identifier?["system"] as? String == resources.system && identifier?["value"] as? String == "7", "\(stored)")
        #expect(try await server.values("Observation", system: resources.system) == ["7"])
        #expect(location.contains("/Observation/\(stored["id"] as? String ?? "-")"), "\(location) \(stored)")
        let queueStatus = try await host.queue.status()
        #expect(queueStatus.pending == 0 && queueStatus.delivered == 1, "\(queueStatus)")
        try await host.stop()
    }

    @Test(
        "With the FHIR server down and a short delivery wait, a plain Observation is answered 202 naming its queued item, which the service delivers once the server is up"
    )
    func queuedWhenTheServerIsDown() async throws {
        let server = try FHIRServer()  // not started: its port refuses connections
        let host = try await host(server: server.base, deliveryWait: .milliseconds(500))
        let token = try await bearer(host)

        let answer = try await postObservation(host, 3, token: token)
        #expect(answer.status == 202, "\(answer)")
        #expect(answer.headers.first(name: "Location") == nil, "\(answer.headers)")
        let queued = try #require(answer.object["queued"] as? String, "\(answer)")
        // Committed before the answer, and still waiting: the server has not seen it.
        let pending = try await host.queue.items(state: .pending).map { $0.id.uuidString.lowercased() }
        #expect(pending == [queued], "\(pending)")
        #expect(try await host.queue.journalRecord(queued) == nil, "not delivered, parked or dropped")

        try await server.start()
        // The journal, not the server, says when delivery is done: sekmet stores the resource before its answer
        // reaches the flusher, which records the delivery only then. Waiting on the server's copy and reading the
        // journal at once raced that commit (a CI run on a busy machine saw no record yet).
        let delivered = try await eventually(timeout: .seconds(60)) {
            try await host.queue.journalRecord(queued)?.event == .delivered
        }
        #expect(delivered, "the DataQueueService beside the routes delivered it without another request")
        #expect(try await server.values("Observation", system: resources.system) == ["3"])
        try await host.stop()
        #expect(try await server.values("Observation", system: resources.system) == ["3"], "once")
    }

    @Test("Expired tokens are removed from the database when a token is issued (every prune interval); the valid one stays")
    func expiredTokensRemoved() async throws {
        let server = try FHIRServer()  // no delivery is needed
        let host = try await host(server: server.base, deliveryWait: .milliseconds(100)) {
            $0.tokenLifetime = .seconds(1)
            $0.tokenPruneInterval = .zero
        }
        let (id, secret) = try await register(host)
        let registry = host.queue.clientRegistry
        _ = try await bearer(host, id: id, secret: secret)
        _ = try await bearer(host, id: id, secret: secret)
        try await Task.sleep(for: .milliseconds(1100))  // both expire (their lifetime is 1 s of wall clock)
        let fresh = try await bearer(host, id: id, secret: secret)
        #expect(try await registry.token(hash: ClientSecrets.tokenHash(fresh), now: Date()) != nil, "the new token is valid")
        // The removal runs beside the answer: the two expired rows go, the valid one stays (read by sqlite3).
        func rows() async throws -> String {
            let counted = try await ChildProcess(
                "/usr/bin/sqlite3", ["-cmd", ".timeout 10000", work.file("queue.sqlite"), "SELECT count(*) FROM dq_tokens"]
            ).wait(timeout: .seconds(60))
            return counted.stdout.trimmingCharacters(in: .whitespacesAndNewlines)
        }
        let pruned = try await eventually(timeout: .seconds(30)) { try await rows() == "1" }
        let left = try await rows()
        #expect(pruned, "rows left: \(left)")
        #expect(try await registry.token(hash: ClientSecrets.tokenHash(fresh), now: Date()) != nil, "the one left is the new one")
        try await host.stop()
    }

    @Test(
        "Mounted with its body middleware: a 3 MiB envelope with no valid token is answered 401 with its challenge (its body read and dropped, no route run), a 2 MiB registration 413; a valid client is served meanwhile"
    )
    func refusedFromTheHead() async throws {
        let server = try await FHIRServer.start()
        let host = try await host(server: server.base, deliveryWait: .seconds(120))
        let big = String(repeating: "A", count: 3 << 20)
        for authorization in [[], [("Authorization", "Bearer not-a-token")], [("Authorization", "Basic eDp5")]] {
            let refused = try await send(
                .POST, host.base + "/encfhir/Observation", headers: authorization + [("Content-Type", "application/json")], body: big)
            #expect(refused.status == 401, "\(refused)")
            #expect(refused.headers.first(name: "WWW-Authenticate")?.hasPrefix("Bearer") == true, "\(refused.headers)")
        }
        let registration = try await send(
            .POST, host.base + "/register", headers: [("Antispam", antispam), ("Content-Type", "application/json")],
            body: #"{"receipt-data": ""# + String(repeating: "A", count: 2 << 20) + #""}"#)
        #expect(registration.status == 413, "\(registration)")
        let token = try await bearer(host)
        let answer = try await postObservation(host, 5, token: token)
        #expect(answer.status == 201, "\(answer)")
        #expect(try await server.values("Observation", system: resources.system) == ["5"])
        let queueStatus = try await host.queue.status()
        #expect(queueStatus.pending == 0 && queueStatus.delivered == 1, "nothing of the refused was queued: \(queueStatus)")
        try await host.stop()
    }

    /// Set after the receiver's body middleware: whatever client it found, the routes are told it is `impostor`.
    struct ImpostorMiddleware: RouterMiddleware {
        let impostor: NIOLockedValueBox<String?>

        func handle(
            _ request: Request, context: ReceiverRequestContext, next: (Request, ReceiverRequestContext) async throws -> Response
        ) async throws -> Response {
            var context = context
            if context.authenticatedClient != nil, let impostor = impostor.withLockedValue({ $0 }) {
                context.authenticatedClient = impostor
            }
            return try await next(request, context)
        }
    }

    @Test(
        "The bearer token is checked once per request: the routes take the client the body middleware found on the context (a middleware that changes it changes the stored client), and do not read the token again"
    )
    func tokenCheckedOnce() async throws {
        let server = try FHIRServer()  // not started: what is posted stays queued, with its client
        let impostor = NIOLockedValueBox<String?>(nil)
        let host = try await host(server: server.base, deliveryWait: .milliseconds(100), impostor: impostor)
        let (id, secret) = try await register(host)
        let token = try await bearer(host, id: id, secret: secret)
        let other = try await register(host).id
        impostor.withLockedValue { $0 = other }
        let plain = try await postObservation(host, 1, token: token)
        #expect(plain.status == 202, "\(plain)")
        let waiting = try await host.queue.items(state: .pending)
        #expect(waiting.count == 1, "\(waiting.map(\.clientID))")
        #expect(waiting.first?.clientID == other, "the route used the context's client: \(waiting.map(\.clientID)) \(other)")
        // Without a token the middleware answers 401 before any route runs: nothing more is stored.
        let refused = try await postObservation(host, 2, token: "not-a-token")
        #expect(refused.status == 401, "\(refused)")
        #expect(try await host.queue.items(state: .pending).count == 1)
        try await host.stop()
    }

    /// A host's own context that knows its peer's address and cannot carry the client.
    struct AddressOnlyContext: RequestContext, RemoteAddressRequestContext {
        var coreContext: CoreRequestContextStorage
        let remoteAddress: SocketAddress?
        init(source: ApplicationRequestContextSource) {
            coreContext = .init(source: source)
            remoteAddress = source.channel.remoteAddress
        }
    }

    @Test(
        "With a context that cannot carry the client and no body middleware, the routes check the bearer token themselves: 401 without one, and the token's own client stored with one"
    )
    func routesCheckTheTokenWithoutMiddleware() async throws {
        let server = try FHIRServer()  // not started
        var configuration = DataQueue.Configuration(databasePath: work.file("plain-context.sqlite"))
        configuration.retryPolicy = RetryPolicy(initialDelay: 0.1, maximumDelay: 0.5)
        let queue = try await DataQueue(baseURL: URL(string: server.base)!, configuration: configuration)
        let receiver = try FHIRDataQueueServer.C3PROReceiver(
            queue: queue, configuration: .init(antispamSecrets: [antispam], deliveryWait: .milliseconds(100)), logger: Self.quiet)
        let router = Router(context: AddressOnlyContext.self)
        receiver.addRoutes(to: router)
        let host = try await start(router, queue: queue)
        let (id, secret) = try await register(host)
        let token = try await bearer(host, id: id, secret: secret)
        let refused = try await postObservation(host, 1, token: "not-a-token")
        #expect(refused.status == 401, "\(refused)")
        let taken = try await postObservation(host, 2, token: token)
        #expect(taken.status == 202, "\(taken)")
        let waiting = try await host.queue.items(state: .pending)
        #expect(waiting.count == 1 && waiting.first?.clientID == id, "\(waiting.map(\.clientID)) \(id)")
        try await host.stop()
    }

    /// A time source the test moves: the wall clock and the monotonic instant both advance by what it is told.
    final class ManualTime: Sendable {
        private let offset = NIOLockedValueBox<Duration>(.zero)
        private let start = Date()
        private let startInstant = ContinuousClock.now

        func advance(_ by: Duration) { offset.withLockedValue { $0 += by } }

        var source: TimeSource {
            TimeSource(
                now: { [self] in
                    let moved = offset.withLockedValue { $0 }.components
                    return start.addingTimeInterval(Double(moved.seconds) + Double(moved.attoseconds) / 1e18)
                },
                instant: { [self] in startInstant + offset.withLockedValue { $0 } })
        }
    }

    @Test(
        "The receiver reads the time from its time source: a token is taken until its lifetime has passed on that source and refused (401, invalid_token) after, and a rate-limit window passes when the source moves a minute, with no sleep"
    )
    func timeSource() async throws {
        let server = try FHIRServer()  // not started
        let time = ManualTime()
        let host = try await host(server: server.base, deliveryWait: .milliseconds(100)) {
            $0.time = time.source
            $0.authRequestsPerMinute = 3
            $0.tokenLifetime = .seconds(600)
        }
        let (id, secret) = try await register(host)
        let token = try await bearer(host, id: id, secret: secret)
        let third = try await send(
            .POST, host.base + "/register", headers: [("Antispam", antispam), ("Content-Type", "application/json")],
            body: #"{"sandbox": false, "receipt-data": "NO-APP-RECEIPT"}"#)
        #expect(third.status == 201, "\(third)")
        let fourth = try await send(
            .POST, host.base + "/register", headers: [("Antispam", antispam), ("Content-Type", "application/json")],
            body: #"{"sandbox": false, "receipt-data": "NO-APP-RECEIPT"}"#)
        #expect(fourth.status == 429, "the fourth in the minute: \(fourth)")
        #expect(try await postObservation(host, 1, token: token).status == 202)

        // A minute later on the source: the window has passed.
        time.advance(.seconds(61))
        #expect(try await register(host).id.isEmpty == false)
        // Still within the token's 600 s: taken (from the cache and from the database alike).
        time.advance(.seconds(500))
        #expect(try await postObservation(host, 2, token: token).status == 202)
        // Past it: refused, and nothing more stored.
        time.advance(.seconds(40))
        let expired = try await postObservation(host, 3, token: token)
        #expect(expired.status == 401, "\(expired)")
        #expect(expired.headers.first(name: "WWW-Authenticate")?.contains("invalid_token") == true, "\(expired.headers)")
        #expect(try await host.queue.items(state: .pending).count == 2)
        try await host.stop()
    }
}
