import AsyncHTTPClient
import Crypto
import Foundation
import Logging

extension DataQueue {
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
/// do {
///     switch try await queue.create(try FHIRResource(json: data)) {
///     case .delivered(let record): print("stored as", record.location ?? "?")
///     case .queued(_, let reason): print("queued:", reason)
///     case .parked(_, let reason): print("rejected:", reason)
///     }
/// } catch {
///     try? await queue.shutdown()
///     throw error
/// }
/// try await queue.shutdown()  // awaited, on every path: not a Task nobody waits for
/// ```
///
/// Only one flush of a queue runs at a time across all processes (an `flock` on the queue's own lock file
/// beside the database); several producers may enqueue at once, and the queues of
/// different servers in one database flush independently.
///
/// > Important: call ``shutdown()`` before the queue is released.
open class DataQueue: @unchecked Sendable {  // unchecked: an open class cannot be checked Sendable; its state is lets and locked boxes
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
    /// Deliveries the server accepted whose journal write failed, written by the next flush of this process.
    let heldDeliveries = HeldDeliveries()
    /// ``Configuration/encryptedEndpoint`` in its normal form.
    private let configuredEncryptedEndpoint: String?

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
        self.configuredEncryptedEndpoint = try configuration.encryptedEndpoint.map {
            try Self.queueName(for: $0, setting: "encryptedEndpoint")
        }
        self.configuration = configuration
        self.authorization = authorization
        self.logger = logger
        self.flushLockPath = Self.flushLockPath(database: configuration.databasePath, queue: queueName)
        self.metrics = QueueMetrics(destination: queueName)
        // Opening may wait for another process's lock and migrate the schema: on a thread of its own.
        let opened = try await OwnThread.run("dq-open") {
            try configuration.storage.open(
                durability: configuration.durability, readOnly: configuration.readOnly,
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

    /// Opens the queue for `baseURL` kept in `storage`: a SQLite file, or PostgreSQL by URL or through a
    /// `PostgresClient` the host runs in its own `ServiceGroup`.
    ///
    /// ```swift
    /// let queue = try await DataQueue(baseURL: server, storage: .postgres(client: client))
    /// ```
    ///
    /// - Parameters:
    ///   - baseURL: the FHIR base URL (see ``init(baseURL:configuration:authorization:httpClient:logger:)``).
    ///   - storage: where the queue is kept; it replaces `configuration.storage`.
    ///   - configuration: the other settings. The default is `Configuration()`.
    ///   - authorization: supplies the `Authorization` header. The default is none.
    ///   - httpClient: an HTTP client of the caller's to send with. The default is nil: the queue makes its own.
    ///   - logger: where dq logs (never bodies or secrets). The default discards everything.
    /// - Throws: as ``init(baseURL:configuration:authorization:httpClient:logger:)``.
    public convenience init(
        baseURL: URL, storage: Storage, configuration: Configuration = Configuration(),
        authorization: (any AuthorizationProvider)? = nil, httpClient: HTTPClient? = nil,
        logger: Logger = Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
    ) async throws {
        var configuration = configuration
        configuration.storage = storage
        try await self.init(
            baseURL: baseURL, configuration: configuration, authorization: authorization, httpClient: httpClient, logger: logger)
    }

    /// Releases what the queue owns: its HTTP client (unless the caller passed one) and the authorization
    /// provider's resources. Call once, when done with the queue.
    public func shutdown() async throws {
        let held = heldDeliveries.all
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
    open func prepareRequest(for resource: FHIRResource, method: FHIRMethod, itemID: UUID) throws -> DataQueue.PreparedRequest {
        switch method {
        case .put:
            guard let id = resource.id else {
                throw DataQueueError(.invalidResource, "a PUT (update) needs the resource's \"id\"")
            }
            return DataQueue.PreparedRequest(
                method: .put, path: "\(resource.resourceType)/\(id)", contentType: "application/fhir+json",
                body: resource.data, resourceType: resource.resourceType, resourceID: id)
        case .post:
            if configuration.idempotent == .always {
                // Checked now so that bad input is named at enqueue; the condition itself is made at send time.
                _ = try ConditionalCreate.prepare(resource.data, itemID: itemID, isBundle: resource.isTransactionOrBatch)
            }
            if resource.isTransactionOrBatch {
                return DataQueue.PreparedRequest(
                    method: .post, path: "", contentType: "application/fhir+json", body: resource.data,
                    resourceType: "Bundle")
            }
            return DataQueue.PreparedRequest(
                method: .post, path: resource.resourceType, contentType: "application/fhir+json", body: resource.data,
                resourceType: resource.resourceType)
        }
    }

    /// The endpoint an item goes to: the base URL, or for an encrypted item the encrypted endpoint.
    open func endpoint(encrypted: Bool) throws -> String {
        guard encrypted else { return queueName }
        guard let configuredEncryptedEndpoint else {
            throw DataQueueError(.storage, "an encrypted item is queued, but this queue has no encrypted endpoint configured")
        }
        return configuredEncryptedEndpoint
    }

    /// The full URL of a queued item, built from the configured endpoint and the item's stored path.
    ///
    /// - Throws: ``DataQueueError`` with `.storage` when the stored path is not one dq writes (an edited or
    ///   damaged row): such an item is never sent.
    package func requestURL(for item: QueuedItem) throws -> String {
        try endpoints().url(for: item)
    }

    /// This queue's endpoints, as ``endpoint(encrypted:)`` names them.
    func endpoints() -> Endpoints {
        Endpoints(
            plain: (try? endpoint(encrypted: false)) ?? queueName,
            encrypted: Result { try endpoint(encrypted: true) }.mapError {
                $0 as? DataQueueError ?? DataQueueError(.invalidConfiguration, "\($0)")
            })
    }

    /// What a flush of this queue works with.
    func flushContext() -> FlushContext {
        FlushContext(
            queueName: queueName, configuration: configuration, store: store,
            delivery: Delivery(
                transport: transport, authorization: authorization, idempotence: configuration.idempotent, logger: logger),
            endpoints: endpoints(), logger: logger, metrics: metrics, heldDeliveries: heldDeliveries, hooks: hooks)
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

    /// Refuses a `resourceType` the configuration does not accept (see ``Configuration/resourceTypes``).
    private func checkType(_ type: String) throws {
        guard configuration.resourceTypes.accepts(type) else {
            throw DataQueueError(
                .invalidResource,
                "\"\(FHIRResource.printable(type))\" is not a FHIR R4 resource type (a type of the server's own goes in \"extra_resource_types\")"
            )
        }
    }

    func newItem(for resource: FHIRResource, method: FHIRMethod, fullURL: String? = nil) throws -> NewItem {
        try checkType(resource.resourceType)
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
    /// Returns after the item is committed to SQLite (with ``DataQueue/Durability/full``, on disk). Enqueues from
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
        return try await commit(item)
    }

    /// Commits one item (grouped with other single enqueues), counts it and wakes the service.
    private func commit(_ item: NewItem) async throws -> QueuedItem {
        let sequence = try await store.insertGrouped(item)
        metrics.enqueued.increment()
        wakeUp.signal()
        return queuedItem(item, sequence: sequence)
    }

    /// Durably queues an envelope sealed elsewhere, unchanged, for the encrypted endpoint (an
    /// ``EncryptedDataQueue``'s, or ``Configuration/encryptedEndpoint``), in its place in this queue's order; or,
    /// with a ``Configuration/envelopeKeyring``, to be opened when it is sent and its resource sent to the server.
    ///
    /// Its shape was checked when the ``SealedEnvelope`` was made; the receiver (or the keyring) opens it. Sealed
    /// at rest like any item when the queue is.
    ///
    /// - Returns: the queued item (`encrypted`, posted to `{encrypted endpoint}/{resourceType}`).
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` when the queue has no encrypted endpoint and no
    ///   keyring, and as ``enqueue(_:method:fullURL:)`` otherwise.
    @discardableResult
    public func enqueue(_ envelope: SealedEnvelope) async throws -> QueuedItem {
        try await commit(try newItem(for: envelope))
    }

    /// The new item of an envelope, checked as the `enqueue` of an envelope checks it.
    func newItem(for envelope: SealedEnvelope) throws -> NewItem {
        // `Resource`: the sender did not say (a device posting to the bare encrypted endpoint).
        if envelope.resourceType != SealedEnvelope.unnamedType { try checkType(envelope.resourceType) }
        do {
            if configuration.envelopeKeyring == nil { _ = try endpoint(encrypted: true) }
        } catch {
            throw DataQueueError(
                .invalidConfiguration, "this queue has no encrypted endpoint to send envelopes to (Configuration.encryptedEndpoint)")
        }
        let request = DataQueue.PreparedRequest(
            method: .post, path: envelope.resourceType, contentType: "application/json", body: envelope.data,
            resourceType: envelope.resourceType, encrypted: true)
        return NewItem(id: UUID.timeOrdered(), queue: queueName, request: request, fullURL: nil, references: [])
    }

    /// How the reason of a quarantined item begins: an envelope the queue's ``Configuration/envelopeKeyring``
    /// could not open, parked with the reason after this prefix.
    public static let quarantinePrefix = "quarantined: "

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
            size: size ?? item.body.count, clientID: item.clientID)
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
            case .dropped, .duplicate: break
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
        progress: (@Sendable (FlushReport.Progress) -> Void)? = nil
    ) async throws -> FlushReport {
        // With dq's own HTTP client, the flush runs on the client's event loop (no thread hop per answer).
        try await withTaskExecutorPreference(transport.taskExecutor) {
            try await flush(limit: limit, force: force, through: nil, tracking: nil, lockWait: lockWait, progress: progress).0
        }
    }

    private func flush(
        limit: Int?, force: Bool, through: Int64?, tracking: Int64?, lockWait: TimeInterval,
        progress: (@Sendable (FlushReport.Progress) -> Void)?
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
        progress: (@Sendable (FlushReport.Progress) -> Void)?
    ) async throws -> (FlushReport, SendOutcome?) {
        var report = FlushReport()
        if !force {
            let state = try await store.serverState(queue: queueName)
            if let next = state.nextAttemptAt, next > Date() {
                // Refused credentials are not an outage: the flush says so (77 for dq), not "try later" (75).
                if let error = state.lastError, error.hasPrefix(FlushReport.Stop.refusedCredentials) {
                    report.stop = .authentication(
                        "\(error.dropFirst(FlushReport.Stop.refusedCredentials.count)) (the last try, \(state.failures) in a row; "
                            + "mend the credentials, then flush with force (dq flush --now))")
                } else {
                    report.stop = .backoff(until: next)
                    logger.debug(
                        "the server is backed off; nothing sent",
                        metadata: ["queue": "\(queueName)", "until": "\(ISO8601DateFormatter().string(from: next))"])
                }
                try await fillCounts(&report)
                return (report, nil)
            }
        }

        // A damaged row stops the flush before anything is sent, so nothing overtakes it.
        try await store.checkStates(queue: queueName)

        // A flusher that died with a request on the wire left a marker: let the server finish that request
        // before sending it (or anything) again, or a non-atomic conditional create could run twice.
        let orphan = try await lock.inFlight()
        if let orphan {
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
            // The flusher clears the note once every item it names is sent again (or gone): a stop before then leaves
            // them marked as possibly delivered for the next flush.
        }

        let flusher = Flusher(
            context: flushContext(), lock: lock, limit: limit, through: through, tracking: tracking, progress: progress,
            resentThrough: orphan?.sequence)
        try await flusher.run()
        report = flusher.report
        try await fillCounts(&report)
        return (report, flusher.tracked)
    }

    /// The counts a flush reports (and the gauges), without counting the journal: a flush runs after each few
    /// enqueues on a busy receiver, and the journal holds months of deliveries.
    private func fillCounts(_ report: inout FlushReport) async throws {
        let status = try await status(countingJournal: false)
        report.remaining = status.pending
        report.parkedTotal = status.parked
    }
}
