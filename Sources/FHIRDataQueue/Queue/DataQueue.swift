import AsyncHTTPClient
import Crypto
import Foundation
import Logging
import Synchronization

/// A request as it will be queued: what ``DataQueue/prepareRequest(for:method:itemID:)`` makes of a resource.
///
/// It holds a path, never a URL: the URL is built when the item is sent, from the configured endpoint, so
/// a queued item can never send a resource (or the credentials with it) to a host of its own.
public struct PreparedRequest: Sendable {
    /// The HTTP method.
    public var method: FHIRMethod
    /// The request path relative to the endpoint: `Patient`, `Patient/123`, or empty for the base itself.
    public var path: String
    /// The `Content-Type` of the body.
    public var contentType: String
    /// The body bytes (the resource, or an encrypted envelope).
    public var body: Data
    /// The resource type, for listings and the journal.
    public var resourceType: String
    /// The resource id, for updates.
    public var resourceID: String?
    /// Whether the body is an encrypted envelope for the encrypted endpoint (changes where it goes and how a
    /// 2xx answer is read).
    public var encrypted: Bool

    /// Creates a prepared request.
    public init(
        method: FHIRMethod, path: String, contentType: String, body: Data, resourceType: String,
        resourceID: String? = nil, encrypted: Bool = false
    ) {
        self.method = method
        self.path = path
        self.contentType = contentType
        self.body = body
        self.resourceType = resourceType
        self.resourceID = resourceID
        self.encrypted = encrypted
    }
}

/// A FHIR server client that never loses a create or update.
///
/// Every `create`/`update` first writes the resource to a durable SQLite queue, then flushes the queue
/// for this server in order, so the new resource never overtakes older ones. When the server cannot be
/// reached, the resource stays queued and the caller is told so; it is not an error to handle. A
/// resource the server rejects for good is parked with the server's answer and the queue moves on.
///
/// ```swift
/// let queue = try await DataQueue(baseURL: URL(string: "https://fhir.example.org/r4")!)
/// defer { Task { try await queue.shutdown() } }
/// switch try await queue.create(try FHIRResource(json: data)) {
/// case .delivered(let record): print("stored as", record.location ?? "?")
/// case .queued(_, let reason): print("queued:", reason)
/// case .parked(_, let reason): print("rejected:", reason)
/// }
/// ```
///
/// Only one flush of a queue runs at a time across all processes (an `flock` on the queue's own lock file
/// beside the database); several producers may enqueue at once, and the queues of
/// different servers in one database flush independently.
///
/// > Important: call ``shutdown()`` before the queue is released.
open class DataQueue: @unchecked Sendable {  // unchecked: an open class cannot be checked Sendable; its state is lets and Mutexes
    /// The FHIR base URL.
    public let baseURL: URL
    /// The name of this server's queue in the database: the base URL in its normal form (see ``queueName(for:)``).
    public let queueName: String
    /// The configuration this queue was made with.
    public let configuration: Configuration
    /// How requests are authorized, if at all.
    public let authorization: (any AuthorizationProvider)?
    /// The file whose `flock` makes one flusher of this queue at a time: `<database>.flush-<hash>.lock`, one
    /// per queue, so that two servers in one database never wait for each other.
    package let flushLockPath: String
    let store: any QueueStorage
    let transport: FHIRTransport
    let logger: Logger
    /// Test seams (see ``TestHooks``).
    let hooks = TestHooks()
    /// Wakes a ``DataQueueService`` when this process enqueues.
    let wakeUp = WakeUp()
    /// The queue's metrics (swift-metrics; free when no backend is bootstrapped).
    let metrics: QueueMetrics
    /// Deliveries the server accepted whose journal write failed (a full disk, a file that stopped taking
    /// writes): the next flush in this process writes them before it sends anything, so that an item the server
    /// has is not sent again while the database refuses writes.
    let unrecordedDeliveries = Mutex<[CompletedDelivery]>([])

    /// Opens the queue for `baseURL`, creating the database if needed.
    ///
    /// - Parameters:
    ///   - baseURL: the FHIR base URL, e.g. `https://fhir.example.org/r4`: http or https, with a host, and
    ///     without a query, a fragment or credentials.
    ///   - configuration: storage, sending and retry settings. The default is `Configuration()`: a SQLite file at
    ///     ``defaultDatabasePath(environment:)``, durable commits, automatic Bundles.
    ///   - authorization: supplies the `Authorization` header. The default is none. ``shutdown()`` shuts it
    ///     down too.
    ///   - httpClient: an HTTP client of the caller's to send with. The default is nil: the queue makes its
    ///     own, on one event loop of NIO's shared group, and runs its flushes on that loop. A client passed
    ///     here is not shut down by the queue, and flushes run wherever the caller runs them.
    ///   - logger: where dq logs (never bodies or secrets). The default discards everything.
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` for a bad base URL or setting, or
    ///   `.storage` when the database cannot be opened.
    public init(
        baseURL: URL, configuration: Configuration = Configuration(),
        authorization: (any AuthorizationProvider)? = nil, httpClient: HTTPClient? = nil,
        logger: Logger = Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
    ) async throws {
        try configuration.validate()
        self.baseURL = baseURL
        self.queueName = try Self.queueName(for: baseURL, setting: "server")
        self.configuration = configuration
        self.authorization = authorization
        self.logger = logger
        self.flushLockPath = Self.flushLockPath(database: configuration.databasePath, queue: queueName)
        self.metrics = QueueMetrics(destination: queueName)
        // Opening may wait for another process's lock and migrate the schema: on a thread of its own.
        let opened = try await OwnThread.run("dq-open") {
            try Self.makeStore(
                configuration.storage, durability: configuration.durability, readOnly: configuration.readOnly,
                leaseDuration: configuration.leaseDuration, logger: logger)
        }
        do {
            // A host's PostgreSQL client may not run yet (its ServiceGroup starts after the queue is made).
            var lazily = false
            if case .postgres = configuration.storage { lazily = true }
            self.store = try await SealedStorage.open(
                opened, keys: configuration.atRest, readOnly: configuration.readOnly, lazily: lazily, logger: logger)
        } catch {
            await opened.shutdown()
            throw error
        }
        self.transport = try FHIRTransport(
            timeout: configuration.requestTimeout, connectTimeout: configuration.connectTimeout,
            network: configuration.network, client: httpClient)
    }

    /// Releases what the queue owns: its HTTP client (unless the caller passed one) and the authorization
    /// provider's resources. Call once, when done with the queue.
    public func shutdown() async throws {
        let held = unrecordedDeliveries.withLock { $0 }
        if !held.isEmpty {
            logger.error(
                "stopping with deliveries the server accepted but the journal could not record: the next flush sends them again",
                metadata: ["items": "\(held.map(\.item.id.lowercasedString).joined(separator: ","))"])
        }
        try await transport.shutdown()
        try await authorization?.shutdown()
        await store.shutdown()
    }

    /// The lock file of one queue's flushes.
    static func flushLockPath(database: String, queue: String) -> String {
        let digest = SHA256.hash(data: Data(queue.utf8)).prefix(8).hexString
        return database + ".flush-" + digest + ".lock"
    }

    // MARK: - Turning resources into requests

    /// The method `--method auto` picks for a resource: `PUT` (update) for a resource with an `id`, `POST`
    /// otherwise and for transaction and batch Bundles, as C3-PRO did. ``EncryptedDataQueue`` always picks
    /// `POST` for what it encrypts.
    open func defaultMethod(for resource: FHIRResource) -> FHIRMethod {
        resource.id != nil && !resource.isTransactionOrBatch ? .put : .post
    }

    /// Makes the request that sends `resource`: the routing decision of the queue.
    ///
    /// `DataQueue` sends `POST [base]/[type]` for a create, `PUT [base]/[type]/[id]` for an update, and
    /// `POST [base]` for a transaction or batch Bundle. Subclasses (``EncryptedDataQueue``) override it to
    /// encrypt and route elsewhere; the result is what is stored on disk. Idempotent mode's condition is not
    /// part of it: it is added when the item is sent.
    ///
    /// - Throws: ``DataQueueError`` with `.invalidResource` when an update has no `id`, or when idempotent
    ///   mode could not make the create conditional (an `identifier` that is not a list).
    open func prepareRequest(for resource: FHIRResource, method: FHIRMethod, itemID: UUID) throws -> PreparedRequest {
        switch method {
        case .put:
            guard let id = resource.id else {
                throw DataQueueError(.invalidResource, "a PUT (update) needs the resource's \"id\"")
            }
            return PreparedRequest(
                method: .put, path: "\(resource.resourceType)/\(id)", contentType: "application/fhir+json",
                body: resource.data, resourceType: resource.resourceType, resourceID: id)
        case .post:
            if configuration.idempotent {
                // Checked now so that bad input is named at enqueue; the condition itself is made at send time.
                _ = try ConditionalCreate.prepare(resource.data, itemID: itemID, isBundle: resource.isTransactionOrBatch)
            }
            if resource.isTransactionOrBatch {
                return PreparedRequest(
                    method: .post, path: "", contentType: "application/fhir+json", body: resource.data,
                    resourceType: "Bundle")
            }
            return PreparedRequest(
                method: .post, path: resource.resourceType, contentType: "application/fhir+json", body: resource.data,
                resourceType: resource.resourceType)
        }
    }

    /// The endpoint an item goes to: the base URL, or for an encrypted item the encrypted endpoint.
    open func endpoint(encrypted: Bool) throws -> String {
        guard !encrypted else {
            throw DataQueueError(.storage, "an encrypted item is queued, but this queue has no encrypted endpoint configured")
        }
        return queueName
    }

    /// The full URL of a queued item, built from the configured endpoint and the item's stored path.
    ///
    /// - Throws: ``DataQueueError`` with `.storage` when the stored path is not one dq writes (an edited or
    ///   damaged row): such an item is never sent.
    package func requestURL(for item: QueuedItem) throws -> String {
        guard Self.isValidPath(item.url, method: item.method, encrypted: item.encrypted) else {
            throw DataQueueError(
                .storage,
                "item row \(item.sequence) of the queue database is damaged (its request path is not one dq writes); "
                    + "it is not sent: inspect it with sqlite3, then fix or drop it")
        }
        let base = try endpoint(encrypted: item.encrypted)
        return item.url.isEmpty ? base : base + "/" + item.url
    }

    /// The paths dq stores: `Type` (create), `Type/id` (update), empty (a Bundle to the base).
    static func isValidPath(_ path: String, method: FHIRMethod, encrypted: Bool) -> Bool {
        if path.isEmpty { return method == .post && !encrypted }
        guard let slash = path.firstIndex(of: "/") else {
            return method == .post && FHIRResource.isValidTypeName(path)
        }
        let id = path[path.index(after: slash)...]
        return method == .put && !encrypted && !id.contains("/") && FHIRResource.isValidTypeName(String(path[..<slash]))
            && FHIRResource.isValidID(String(id))
    }

    func newItem(for resource: FHIRResource, method: FHIRMethod, fullURL: String? = nil) throws -> NewItem {
        let id = UUID.timeOrdered()
        let request = try prepareRequest(for: resource, method: method, itemID: id)
        var declared: String?
        if let fullURL {
            guard TransactionBundle.isUUIDFullURL(fullURL) else {
                throw DataQueueError(.invalidResource, "fullUrl must be urn:uuid: followed by a UUID")
            }
            guard !request.encrypted else {
                throw DataQueueError(.invalidResource, "an encrypted resource cannot declare a fullUrl (envelopes are opaque)")
            }
            declared = fullURL.lowercased()
        }
        return NewItem(
            id: id, queue: queueName, request: request, fullURL: declared,
            references: request.encrypted
                ? [] : TransactionBundle.externalReferences(in: request.body, isBundle: request.path.isEmpty))
    }

    /// Refuses references to `urn:uuid` fullUrls that no earlier entry of `items` and no queued or delivered
    /// item declares, and fullUrls declared twice: such a reference could never be resolved on the server.
    func checkReferences(_ items: [NewItem]) async throws {
        var check = ReferenceCheck()
        for (index, item) in items.enumerated() { check.add(item, index: index) }
        try check.refuseDeclaredTwice()
        try check.refuse(existing: try await store.knownFullURLs(check.lookups))
    }

    // MARK: - Filling the queue

    /// Durably queues `resource` without sending it.
    ///
    /// Returns after the item is committed to SQLite (with ``Durability/full``, on disk). Enqueues from
    /// many tasks at once share commits.
    ///
    /// The commit and its `fsync` run on the store's own writer thread, never on the calling task's thread:
    /// the caller is suspended, holding no thread of Swift's cooperative pool, until its item is durable.
    ///
    /// - Parameters:
    ///   - resource: the resource.
    ///   - method: `.post` (create, the default) or `.put` (update; needs an `id`).
    ///   - fullURL: the `urn:uuid:…` by which later resources reference this one (as a Bundle entry's
    ///     `fullUrl`). dq sends them in one Bundle where it can, and otherwise rewrites their references to
    ///     where the server put this one. The default is none.
    /// - Returns: the queued item.
    /// - Throws: ``DataQueueError`` (`.invalidResource`, `.storage`, `.storageFull`).
    @discardableResult
    nonisolated(nonsending) public func enqueue(_ resource: FHIRResource, method: FHIRMethod = .post, fullURL: String? = nil)
        async throws -> QueuedItem
    {
        let item = try newItem(for: resource, method: method, fullURL: fullURL)
        if item.fullURL != nil || !item.references.isEmpty {
            try await checkReferences([item])
        }
        let sequence = try await store.insertGrouped(item)
        metrics.enqueued.increment()
        wakeUp.signal()
        return queuedItem(item, sequence: sequence)
    }

    /// Durably queues several entries in one transaction: all of them or, on any error, none.
    ///
    /// An entry may declare a `fullUrl` (`urn:uuid:…`) and reference earlier ones (`"reference":
    /// "urn:uuid:…"`), as the entries of a transaction Bundle do; a reference that no earlier entry, queued
    /// or delivered item declares is refused.
    ///
    /// - Throws: ``DataQueueError``; on `.invalidResource` the message names the position of the bad input.
    @discardableResult
    public func enqueue(_ entries: [QueueEntry]) async throws -> [QueuedItem] {
        var items: [NewItem] = []
        items.reserveCapacity(entries.count)
        for (index, entry) in entries.enumerated() {
            do {
                items.append(try newItem(for: entry.resource, method: entry.method, fullURL: entry.fullURL))
            } catch let error as DataQueueError {
                throw DataQueueError(error.code, "input \(index + 1): \(error.message)")
            }
        }
        try await checkReferences(items)
        let sequences = try await store.insert(items)
        metrics.enqueued.increment(by: items.count)
        wakeUp.signal()
        return zip(items, sequences).map { queuedItem($0, sequence: $1) }
    }

    /// Durably queues several resources in one transaction: all of them or, on any error, none.
    ///
    /// - Throws: ``DataQueueError``; on `.invalidResource` the message names the position of the bad input.
    @discardableResult
    package func enqueue(contentsOf resources: [(FHIRResource, FHIRMethod)]) async throws -> [QueuedItem] {
        try await enqueue(resources.map { QueueEntry($0.0, method: $0.1) })
    }

    func queuedItem(_ item: NewItem, sequence: Int64, at enqueuedAt: Date = Date(), size: Int? = nil) -> QueuedItem {
        QueuedItem(
            sequence: sequence, id: item.id, queue: item.queue, method: item.method, url: item.url,
            resourceType: item.resourceType, resourceID: item.resourceID, encrypted: item.encrypted, state: .pending,
            attempts: 0, enqueuedAt: enqueuedAt, lastAttemptAt: nil, lastStatus: nil, lastError: nil, outcome: nil,
            size: size ?? item.body.count)
    }

    // MARK: - Sending

    /// Creates `resource` on the server (`POST`), after everything queued before it.
    ///
    /// The resource is queued durably first, then the queue is flushed up to it. A transaction or batch
    /// Bundle is one `POST` to the base URL.
    ///
    /// - Returns: whether it was delivered, is queued for later (server unreachable, backing off, or
    ///   another flush running), or was parked (rejected for good).
    /// - Throws: ``DataQueueError`` for invalid input, storage failures, and `.authentication` when the
    ///   server refuses the credentials (the resource stays queued).
    public func create(_ resource: FHIRResource) async throws -> SendOutcome {
        try await send(resource, method: .post)
    }

    /// Updates `resource` on the server (`PUT [base]/[type]/[id]`), after everything queued before it.
    ///
    /// - Returns: see ``create(_:)``.
    /// - Throws: see ``create(_:)``; `.invalidResource` when the resource has no `id`.
    public func update(_ resource: FHIRResource) async throws -> SendOutcome {
        try await send(resource, method: .put)
    }

    /// Queues `resource` and flushes up to it.
    public func send(_ resource: FHIRResource, method: FHIRMethod) async throws -> SendOutcome {
        let item = try await enqueue(resource, method: method)
        let (report, outcome) = try await flush(
            limit: nil, force: false, through: item.sequence, tracking: item.sequence,
            lockWait: configuration.lockWait, progress: nil)
        if let outcome { return outcome }
        // Another flush (a service's, another process's) may have handled the item while this one waited for
        // the flush right: its journal line says so.
        if let record = try await store.journalLine(ItemReference.sequence(item.sequence)) {
            switch record.event {
            case .delivered, .alreadyPresent: return .delivered(record)
            case .parked: return .parked(item, reason: record.note ?? "the server rejected it")
            case .dropped: break
            }
        }
        if case .authentication(let message) = report.stop {
            throw DataQueueError(.authentication, message)
        }
        let reason: String
        switch report.stop {
        case .transient(let message, let retryAt): reason = "\(message); next try after \(retryAt)"
        case .backoff(let until): reason = "server is backing off until \(until)"
        case .busy: reason = "another flush of this queue is running"
        case .authentication(let message): reason = message
        case .limit, nil: reason = "not sent yet"
        }
        return .queued(item, reason: reason)
    }

    /// Sends queued items of this server in order until the queue is empty or a transient failure stops it.
    ///
    /// Cancelling the task stops the flush before its next item: what was delivered is journaled first, the
    /// rest stays queued, and the flush throws `CancellationError`.
    ///
    /// - Parameters:
    ///   - limit: the largest number of items to handle. The default is no limit.
    ///   - force: try even while the server is backing off after failures. The default is `false`.
    ///   - lockWait: how long to wait for another flusher of this queue, in seconds. The default is 0
    ///     (report `.busy`).
    ///   - progress: called after each item.
    /// - Returns: counts and why the flush stopped.
    /// - Throws: ``DataQueueError`` for storage failures and damaged rows (transport failures are reported,
    ///   not thrown), `CancellationError` when the task was cancelled.
    public func flush(
        limit: Int? = nil, force: Bool = false, lockWait: TimeInterval = 0,
        progress: (@Sendable (FlushProgress) -> Void)? = nil
    ) async throws -> FlushReport {
        // With dq's own HTTP client, the flush runs on the client's event loop (no thread hop per answer).
        try await withTaskExecutorPreference(transport.taskExecutor) {
            try await flush(limit: limit, force: force, through: nil, tracking: nil, lockWait: lockWait, progress: progress).0
        }
    }

    private func flush(
        limit: Int?, force: Bool, through: Int64?, tracking: Int64?, lockWait: TimeInterval,
        progress: (@Sendable (FlushProgress) -> Void)?
    ) async throws -> (FlushReport, SendOutcome?) {
        var report = FlushReport()
        guard let lock = try await store.acquireFlush(queue: queueName, until: .now + .milliseconds(Int64(lockWait * 1000)))
        else {
            report.stop = .busy
            try await fillCounts(&report)
            return (report, nil)
        }
        let outcome: Result<(FlushReport, SendOutcome?), any Error>
        do {
            outcome = .success(
                try await flush(owning: lock, limit: limit, force: force, through: through, tracking: tracking, progress: progress))
        } catch {
            outcome = .failure(error)
        }
        await lock.release()
        return try outcome.get()
    }

    private func flush(
        owning lock: any FlushOwnership, limit: Int?, force: Bool, through: Int64?, tracking: Int64?,
        progress: (@Sendable (FlushProgress) -> Void)?
    ) async throws -> (FlushReport, SendOutcome?) {
        var report = FlushReport()
        if !force {
            let state = try await store.serverState(queue: queueName)
            if let next = state.nextAttemptAt, next > Date() {
                report.stop = .backoff(until: next)
                try await fillCounts(&report)
                return (report, nil)
            }
        }

        // A damaged row stops the flush before anything is sent, so nothing overtakes it.
        try await store.checkStates(queue: queueName)

        // A flusher that died with a request on the wire left a marker: let the server finish that request
        // before sending it (or anything) again, or a non-atomic conditional create could run twice.
        if let orphan = try await lock.inFlight() {
            let wait = orphan.sentAt.addingTimeInterval(configuration.settleDelay).timeIntervalSinceNow
            if wait > 0 {
                logger.warning(
                    "a previous flush stopped while sending; letting the server settle its request first",
                    metadata: ["item": "\(orphan.sequence)", "seconds": "\(String(format: "%.1f", wait))"])
                try await Task.sleep(for: .milliseconds(Int64(min(wait, configuration.settleDelay) * 1000)))
            } else {
                logger.warning(
                    "a previous flush stopped while sending; its request has had time to settle",
                    metadata: ["item": "\(orphan.sequence)"])
            }
            try await lock.clearInFlight()
        }

        let flusher = Flusher(
            queue: self, lock: lock, limit: limit, through: through, tracking: tracking, progress: progress)
        try await flusher.run()
        report = flusher.report
        try await fillCounts(&report)
        return (report, flusher.tracked)
    }

    private func fillCounts(_ report: inout FlushReport) async throws {
        let status = try await store.status(queue: queueName)
        metrics.update(from: status)
        report.remaining = status.pending
        report.parkedTotal = status.parked
    }

    enum DeliveryResult {
        /// Accepted; `conditional` when it was sent as a conditional create.
        case delivered(TransportResponse, conditional: Bool)
        case rejected(status: Int?, message: String, outcome: String?)
        /// `mayHaveArrived` is false only when the request certainly never reached the server.
        case transient(status: Int?, message: String, retryAfter: TimeInterval?, mayHaveArrived: Bool)
        case authentication(status: Int?, message: String)
    }

    /// The request that sends a stored item now: idempotent mode's condition is added here, so the setting
    /// of this flush (and the item's own override) applies.
    func outgoingRequest(for item: StoredItem, url: String) throws -> OutgoingRequest {
        var body = item.body
        var ifNoneExist: String?
        if configuration.idempotent && item.conditionalCreate && item.info.method == .post && !item.info.encrypted {
            (body, ifNoneExist) = try ConditionalCreate.prepare(body, itemID: item.info.id, isBundle: item.info.url.isEmpty)
        }
        return OutgoingRequest(
            method: item.info.method, url: url, contentType: item.contentType, ifNoneExist: ifNoneExist, body: body)
    }

    /// Sends one request, with one fresh credential and one retry after a 401/403, and classifies the answer.
    func deliver(_ request: OutgoingRequest, encrypted: Bool) async -> DeliveryResult {
        var refused: String?
        while true {
            Heartbeat.beat()
            let header: String?
            do {
                if let refused {
                    header = try await authorization?.authorizationHeader(replacing: refused, logger: logger)
                } else {
                    header = try await authorization?.authorizationHeader(forceRefresh: false, logger: logger)
                }
            } catch let error as DataQueueError where error.code == .authentication {
                return .authentication(status: nil, message: error.message)
            } catch let error as DataQueueError {
                return .transient(status: nil, message: error.message, retryAfter: nil, mayHaveArrived: false)
            } catch {
                return .transient(status: nil, message: "cannot obtain a token", retryAfter: nil, mayHaveArrived: false)
            }
            let response: TransportResponse
            Heartbeat.beat()
            do {
                response = try await transport.send(request, authorization: header, logger: logger)
            } catch let failure as TransportFailure {
                return .transient(
                    status: nil, message: failure.message, retryAfter: nil, mayHaveArrived: failure.mayHaveArrived)
            } catch {
                return .transient(status: nil, message: "\(error)", retryAfter: nil, mayHaveArrived: true)
            }
            switch ResponseClassification.classify(
                status: response.status, body: response.body, retryAfter: response.retryAfter,
                envelope: encrypted, location: response.location ?? response.contentLocation)
            {
            case .success:
                return .delivered(response, conditional: request.ifNoneExist != nil)
            case .permanent(let message):
                let outcome = response.body.isEmpty ? nil : String(decoding: response.body, as: UTF8.self)
                return .rejected(status: response.status, message: message, outcome: outcome)
            case .transient(let message, let retryAfter):
                return .transient(status: response.status, message: message, retryAfter: retryAfter, mayHaveArrived: true)
            case .authentication(let message):
                // One retry with a fresh credential; the provider renews only if this header is still current.
                if let header, refused == nil {
                    refused = header
                    continue
                }
                return .authentication(status: response.status, message: message)
            }
        }
    }

    /// Where the server stored a created or updated resource, and what said so: `Location`, else
    /// `Content-Location`, else the answer's own resource (`id` and `meta.versionId`, when the server answers
    /// with the representation and it is of `resourceType`), else, for an update, the id it was sent to.
    struct ServerIdentity: Equatable {
        var id: String?
        var version: String?
        /// A PHI-free note for the journal when the id did not come from `Location`.
        var note: String?
    }

    static func serverIdentity(
        location: String?, contentLocation: String?, etag: String?, answer: Data?, resourceType: String, method: FHIRMethod,
        resourceID: String?
    ) -> ServerIdentity {
        let version = TransactionBundle.version(fromETag: etag)
        for (header, note) in [(location, nil), (contentLocation, "server id from Content-Location (the answer had no Location)")] {
            // `[base]/Type/id[/_history/vid]` of this resource's type: a header naming anything else (the type's
            // endpoint, another resource) is not where this one was stored.
            guard let header, let url = URL(string: header) else { continue }
            let parts = url.path.split(separator: "/").map(String.init)
            let history = parts.lastIndex(of: "_history")
            let idIndex = history.map { $0 - 1 } ?? parts.count - 1
            guard idIndex >= 1, parts[idIndex - 1] == resourceType, FHIRResource.isValidID(parts[idIndex]) else { continue }
            let headerVersion = history.flatMap { $0 + 1 < parts.count ? parts[$0 + 1] : nil }
            return ServerIdentity(id: parts[idIndex], version: headerVersion ?? version, note: note)
        }
        if let answer, !answer.isEmpty, let object = (try? JSONSerialization.jsonObject(with: answer)) as? [String: Any],
            object["resourceType"] as? String == resourceType, let id = object["id"] as? String, FHIRResource.isValidID(id)
        {
            let bodyVersion = (object["meta"] as? [String: Any])?["versionId"] as? String
            return ServerIdentity(
                id: id, version: bodyVersion ?? version, note: "server id from the answer's resource (the answer had no Location)")
        }
        if method == .put, let resourceID { return ServerIdentity(id: resourceID, version: version, note: nil) }
        return ServerIdentity(
            id: nil, version: version,
            note: "the server did not say where it stored it (no Location, Content-Location or resource id in its answer)")
    }

    /// Splits `[base]/[type]/[id]/_history/[vid]` into id and version id.
    static func parseLocation(_ location: String?) -> (String?, String?) {
        guard let location, let url = URL(string: location) else { return (nil, nil) }
        let parts = url.path.split(separator: "/").map(String.init)
        if let history = parts.lastIndex(of: "_history"), history >= 1 {
            return (parts[history - 1], history + 1 < parts.count ? parts[history + 1] : nil)
        }
        return (parts.last, nil)
    }

    // MARK: - Operator views

    /// Counts for this queue.
    public func status() async throws -> QueueStatus {
        let status = try await store.status(queue: queueName)
        metrics.update(from: status)
        return status
    }

    /// What dq last read of this queue's server from its CapabilityStatement (nil values: not read yet).
    public func serverCapabilities() async throws -> ServerCapabilities {
        let support = try await store.bundleSupport(queue: queueName)
        return ServerCapabilities(
            transactions: support.transactions, conditionalCreate: support.conditionalCreate.map { $0.sorted() },
            readAt: support.checkedAt)
    }

    /// Items of this queue in order, optionally only those in `state`.
    public func items(state: ItemState? = nil, limit: Int = 1000) async throws -> [QueuedItem] {
        try await store.items(queue: queueName, state: state, limit: limit)
    }

    /// One item by UUID (or a unique prefix or suffix of at least 4 characters) or by sequence number, with its
    /// body. Digits alone are tried both ways and throw when they name two different items; `#42` is sequence 42.
    public func item(_ reference: String) async throws -> (QueuedItem, Data) {
        let stored = try await store.item(reference)
        if let reason = stored.unreadable {
            // Sealed at rest: without its key a configuration error, with a seal that does not verify damage.
            throw DataQueueError(reason.contains("at_rest.key_file") ? .invalidConfiguration : .damaged, reason)
        }
        return (stored.info, stored.body)
    }

    /// The state of an item, or nil when it is no longer queued (delivered or dropped: see the journal).
    public func state(of id: UUID) async throws -> ItemState? {
        do {
            return try await store.item(id.lowercasedString).info.state
        } catch let error as DataQueueError where error.code == .notFound {
            return nil
        }
    }

    /// Puts a parked item back in line (it keeps its place in the order).
    ///
    /// - Parameters:
    ///   - reference: the item's UUID, a unique prefix or suffix of it, or its sequence number.
    ///   - conditionalCreate: `false` sends the item as a plain create from now on, even in idempotent mode
    ///     (for a server that refuses its `If-None-Exist`); `true` lets idempotent mode apply to it again. The
    ///     default, nil, keeps the item's setting.
    /// - Throws: `.notFound` when no parked item matches.
    public func retry(_ reference: String, conditionalCreate: Bool? = nil) async throws -> QueuedItem {
        let stored = try await store.item(reference)
        guard try await store.retry(sequence: stored.info.sequence, conditionalCreate: conditionalCreate) else {
            throw DataQueueError(.notFound, "item \(stored.info.id.lowercasedString) is not parked")
        }
        return stored.info
    }

    /// Records where the server stored a delivered item whose answer did not say (no `Location`,
    /// `Content-Location` or resource id), so that the items referencing its `fullUrl` can be sent: retry them
    /// after this.
    ///
    /// - Parameters:
    ///   - reference: the delivered item's UUID, a unique prefix or suffix of it, or its sequence number.
    ///   - location: `Type/id` or `Type/id/_history/version`, of the item's resource type.
    /// - Returns: the journal line, updated.
    /// - Throws: `.notFound` when no delivered item matches; `.invalidResource` when `location` is not of that form
    ///   or type, or the journal already knows where the item is.
    public func resolveLocation(of reference: String, at location: String) async throws -> DeliveryRecord {
        guard let record = try await store.journalLine(reference), [.delivered, .alreadyPresent].contains(record.event) else {
            throw DataQueueError(.notFound, "no delivered item matches \(reference)")
        }
        let parts = location.split(separator: "/", omittingEmptySubsequences: false).map(String.init)
        guard parts.count == 2 || (parts.count == 4 && parts[2] == "_history" && FHIRResource.isValidID(parts[3])),
            parts[0] == record.resourceType, FHIRResource.isValidID(parts[1])
        else {
            throw DataQueueError(
                .invalidResource, "the location must be \(record.resourceType)/ID or \(record.resourceType)/ID/_history/VERSION")
        }
        if let known = record.serverID {
            throw DataQueueError(
                .invalidResource, "the journal already has item \(record.id.lowercasedString) at \(record.resourceType)/\(known)")
        }
        guard
            try await store.resolveLocation(
                itemID: record.id, location: location, serverID: parts[1], versionID: parts.count == 4 ? parts[3] : nil,
                note: "location given by an operator (dq resolve)")
        else {
            throw DataQueueError(.notFound, "no delivered item matches \(reference)")
        }
        guard let updated = try await store.journalLine(record.id.lowercasedString) else {
            throw DataQueueError(.notFound, "no delivered item matches \(reference)")
        }
        logger.notice("location given by an operator", metadata: ["item": "\(record.id.lowercasedString)"])
        return updated
    }

    /// Puts every parked item of this queue back in line. Returns how many.
    public func retryAllParked() async throws -> Int {
        try await store.retryAllParked(queue: queueName)
    }

    /// Removes an item without sending it; the journal records the drop.
    ///
    /// Takes the flush lock (waiting up to ``Configuration/lockWait``), so an item is never dropped while a
    /// flush is sending it.
    /// - Throws: `.notFound`, or `.busy` when a flush holds the lock longer.
    public func drop(_ reference: String) async throws -> QueuedItem {
        guard
            let lock = try await store.acquireFlush(
                queue: queueName, until: .now + .milliseconds(Int64(configuration.lockWait * 1000)))
        else {
            throw DataQueueError(.busy, "a flush of this queue is running; try again when it ends")
        }
        do {
            let stored = try await store.item(reference)
            try await store.drop(stored.info, url: (try? requestURL(for: stored.info)) ?? stored.info.url)
            await lock.release()
            return stored.info
        } catch {
            await lock.release()
            throw error
        }
    }

    /// The newest journal line of an item that is no longer queued (delivered, already present or dropped),
    /// or its parking: by UUID, a unique prefix or suffix, or sequence number. Nil when the journal has none.
    public func journalRecord(_ reference: String) async throws -> DeliveryRecord? {
        try await store.journalLine(reference)
    }

    /// Every queue in this queue's database with its counts (servers other than this one included), so that
    /// an operator sees all that is pending whatever server they name.
    public func allQueueStatuses() async throws -> [QueueStatus] {
        try await store.allStatuses()
    }

    /// Every queue in the database at `databasePath` with its counts, read without naming a server: the
    /// database is opened read-only and nothing is created.
    /// - Throws: ``DataQueueError`` with `.storage` when there is no queue database there.
    package static func allQueueStatuses(databasePath: String) async throws -> [QueueStatus] {
        try await withReadOnlyStore(databasePath) { try await $0.allStatuses() }
    }

    /// How the database at `databasePath` is sealed at rest, read without a key (opened read-only).
    package static func sealingSummary(databasePath: String) async throws -> SealingSummary {
        try await withReadOnlyStore(databasePath) { try await summary(of: $0) }
    }

    /// Runs `body` on the store of `databasePath` opened read-only, then closes it.
    private static func withReadOnlyStore<T: Sendable>(
        _ databasePath: String, _ body: (any QueueStorage) async throws -> T
    ) async throws -> T {
        let store = try makeStore(Storage(databasePath), durability: .full, readOnly: true, logger: nil)
        do {
            let result = try await body(store)
            await store.shutdown()
            return result
        } catch {
            await store.shutdown()
            throw error
        }
    }

    /// What ``migrate(from:to:lockWait:logger:)`` moved.
    package struct MigrationReport: Sendable, Encodable {
        /// Items added to PostgreSQL (pending and parked).
        package var items = 0
        /// Of them, pending.
        package var pending = 0
        /// Of them, parked.
        package var parked = 0
        /// Items already in PostgreSQL (a migration run again): removed from SQLite, not added twice.
        package var alreadyThere = 0
        /// Journal lines added.
        package var journalLines = 0
        /// Items that arrived in SQLite while the migration ran and stay there (producers still running).
        package var leftBehind = 0
    }

    /// Moves a SQLite queue into PostgreSQL, in order: the journal first (so that references to resources
    /// delivered earlier still resolve), then every item with its state, attempts and last answer, in
    /// batches; each batch is committed in PostgreSQL before it is removed from SQLite, and an item already
    /// there is not added twice, so a migration that stopped half-way can be run again. Every queue's flush
    /// lock is held meanwhile, so nothing is sent from the SQLite file while its items move.
    ///
    /// - Parameter progress: told after each batch how many items moved so far, and how many there were.
    /// - Throws: ``DataQueueError``: `.busy` when a flush of the SQLite queue runs longer than `lockWait`,
    ///   `.invalidConfiguration` for a source that is not a SQLite file or a target that is not PostgreSQL.
    package static func migrate(
        from path: String, to url: String, lockWait: TimeInterval = 10, logger: Logger,
        progress: (@Sendable (_ moved: Int, _ total: Int) -> Void)? = nil
    ) async throws -> MigrationReport {
        guard !PostgresQueueStore.isURL(path) else {
            throw DataQueueError(.invalidConfiguration, "dq migrate moves a SQLite queue; the configured database is PostgreSQL already")
        }
        guard PostgresQueueStore.isURL(url) else {
            throw DataQueueError(.invalidConfiguration, "the migration target must be a postgres:// URL")
        }
        guard FileManager.default.fileExists(atPath: path) else {
            throw DataQueueError(.storage, "no queue database at \(path): nothing to migrate")
        }
        let source = try SQLiteQueueStore(path: path, durability: .full)
        let target = try PostgresQueueStore(url: url, logger: logger)
        var locks: [any FlushOwnership] = []
        func releaseAll() async {
            for lock in locks { await lock.release() }
            await target.shutdown()
        }
        do {
            for queue in try await source.queues() {
                guard let lock = try await source.acquireFlush(queue: queue, until: .now + .milliseconds(Int64(lockWait * 1000))) else {
                    throw DataQueueError(.busy, "a flush of \(queue) is running; stop dq run and cron flushes, then migrate")
                }
                locks.append(lock)
            }
            // A sealed queue stays sealed: its items move as they are, with the keys that open them.
            for record in try await source.sealKeys() { try await target.addSealKey(record) }
            var report = MigrationReport()
            let journal = try await source.deliveries(queue: nil, limit: Int(Int32.max))
            for start in stride(from: 0, to: journal.count, by: 1000) {
                report.journalLines += try await target.importJournal(Array(journal[start..<min(start + 1000, journal.count)]))
            }
            var total = 0
            for queue in try await source.queues() {
                let status = try await source.status(queue: queue)
                total += status.pending + status.parked
            }
            var after: Int64 = 0
            while true {
                let batch = try await source.exportBatch(after: after, limit: 500)
                guard let last = batch.last else { break }
                let added = try await target.importItems(batch)
                try await source.deleteMoved(batch.map(\.info.sequence))
                report.items += added
                report.alreadyThere += batch.count - added
                report.pending += batch.filter { $0.info.state == .pending }.count
                report.parked += batch.filter { $0.info.state == .parked }.count
                after = last.info.sequence
                logger.info("moved items", metadata: ["through": "\(after)", "total": "\(report.items)"])
                progress?(report.items + report.alreadyThere, max(total, report.items + report.alreadyThere))
            }
            report.leftBehind = try await source.exportBatch(after: 0, limit: Int(Int32.max)).count
            await releaseAll()
            return report
        } catch {
            await releaseAll()
            throw error
        }
    }

    /// `databasePath` as it may be shown: a PostgreSQL URL without its password.
    package static func displayDatabase(_ databasePath: String) -> String {
        QueuePaths.displayDatabase(databasePath)
    }

    /// The store `storage` names.
    static func makeStore(
        _ storage: Storage, durability: Durability, readOnly: Bool, leaseDuration: TimeInterval = 30, logger: Logger?
    ) throws -> any QueueStorage {
        let logger = logger ?? Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
        switch storage {
        case .sqlite(let path):
            return try SQLiteQueueStore(path: path, durability: durability, readOnly: readOnly)
        case .postgresURL(let url):
            return try PostgresQueueStore(url: url, readOnly: readOnly, leaseSeconds: leaseDuration, logger: logger)
        case .postgres(let client, let preparedStatements):
            return PostgresQueueStore(
                client: client, preparedStatements: preparedStatements, readOnly: readOnly, leaseSeconds: leaseDuration, logger: logger)
        }
    }

    /// Checks the database at `databasePath`, opened read-only: SQLite's `PRAGMA integrity_check`, or for
    /// PostgreSQL (which checks its own pages) that every row is in a state dq knows. `["ok"]` when it is
    /// sound, else the problems found.
    /// - Throws: ``DataQueueError`` with `.storage` when there is no queue database there or it cannot be read.
    package static func integrityCheck(databasePath: String) async throws -> [String] {
        do {
            return try await withReadOnlyStore(databasePath) { try await $0.integrityCheck() }
        } catch let error as DataQueueError where error.code == .damaged {
            // Damage that stops the file from opening (its schema pages) is a finding too.
            return [error.message.replacingOccurrences(of: SQLiteQueueStore.doctorHint, with: "")]
        }
    }

    /// Whether SQLite can still read a damaged queue file's schema: without it no SQLite tool can name the
    /// tables, and a dump recovers nothing. Always true for PostgreSQL.
    package static func schemaIsReadable(databasePath: String) -> Bool {
        if QueuePaths.isPostgresURL(databasePath) { return true }
        return SQLiteQueueStore.schemaIsReadable(path: databasePath)
    }

    /// The delivery journal of this queue, oldest first (the newest `limit` lines).
    public func deliveries(limit: Int = 1000) async throws -> [DeliveryRecord] {
        try await store.deliveries(queue: queueName, limit: limit)
    }

    /// Deletes the journal lines older than `age` seconds, of every queue in the database (never a queued
    /// item); returns how many. A delivered item's line is what resolves later references to its `fullUrl`
    /// and what `dq show` finds once it has left the queue: past the retention both are gone. `progress` is
    /// told how many lines are deleted so far, after each short transaction.
    public func pruneJournal(olderThan age: TimeInterval, progress: @Sendable (Int) -> Void = { _ in }) async throws -> Int {
        try await store.pruneJournal(before: Date().addingTimeInterval(-age), progress: progress)
    }

    /// Gives the space of deleted journal lines and items back to the file system (SQLite's `VACUUM`, which
    /// needs free space for a copy of the file). PostgreSQL's autovacuum does this on its own: a no-op there.
    public func vacuum() async throws {
        try await store.vacuum()
    }
}
