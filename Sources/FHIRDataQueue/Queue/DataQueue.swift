import Foundation
import Logging

/// A request as it will be queued and sent: what ``DataQueue/prepareRequest(for:method:itemID:)`` makes
/// of a resource.
public struct PreparedRequest: Sendable {
    /// The HTTP method.
    public var method: FHIRMethod
    /// The full request URL.
    public var url: String
    /// The `Content-Type` of the body.
    public var contentType: String
    /// The `If-None-Exist` header for conditional create, if any.
    public var ifNoneExist: String?
    /// The body bytes (the resource, or an encrypted envelope).
    public var body: Data
    /// The resource type, for listings and the journal.
    public var resourceType: String
    /// The resource id, for updates.
    public var resourceID: String?
    /// Whether the body is an encrypted envelope (changes how a 2xx answer is read).
    public var encrypted: Bool

    /// Creates a prepared request.
    public init(
        method: FHIRMethod, url: String, contentType: String, ifNoneExist: String? = nil, body: Data,
        resourceType: String, resourceID: String? = nil, encrypted: Bool = false
    ) {
        self.method = method
        self.url = url
        self.contentType = contentType
        self.ifNoneExist = ifNoneExist
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
/// let queue = try DataQueue(baseURL: URL(string: "https://fhir.example.org/r4")!)
/// defer { Task { try await queue.shutdown() } }
/// switch try await queue.create(try FHIRResource(json: data)) {
/// case .delivered(let record): print("stored as", record.location ?? "?")
/// case .queued(_, let reason): print("queued:", reason)
/// case .parked(_, let reason): print("rejected:", reason)
/// }
/// ```
///
/// Only one flush of a queue runs at a time across all processes (an `flock` on
/// `<database>.flush.lock`); several producers may enqueue at once.
///
/// > Important: call ``shutdown()`` before the queue is released.
open class DataQueue: @unchecked Sendable {
    /// The FHIR base URL.
    public let baseURL: URL
    /// The name of this server's queue in the database: the full base URL (see ``queueName(for:)``).
    public let queueName: String
    /// The configuration this queue was made with.
    public let configuration: Configuration
    /// How requests are authorized, if at all.
    public let authorization: (any AuthorizationProvider)?
    let store: QueueStore
    let transport: FHIRTransport
    let logger: Logger

    /// Opens the queue for `baseURL`, creating the database if needed.
    ///
    /// - Parameters:
    ///   - baseURL: the FHIR base URL, e.g. `https://fhir.example.org/r4`.
    ///   - configuration: storage, sending and retry settings. The default is ``Configuration/init(databasePath:durability:idempotent:maximumResourceSize:requestTimeout:connectTimeout:retryPolicy:lockWait:caBundlePath:)``.
    ///   - authorization: supplies the `Authorization` header. The default is none.
    ///   - logger: where dq logs (never bodies or secrets). The default discards everything.
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` for a base URL that is not http(s), or
    ///   `.storage` when the database cannot be opened.
    public init(
        baseURL: URL, configuration: Configuration = Configuration(),
        authorization: (any AuthorizationProvider)? = nil,
        logger: Logger = Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
    ) throws {
        guard let scheme = baseURL.scheme?.lowercased(), scheme == "http" || scheme == "https", baseURL.host != nil else {
            throw DataQueueError(.invalidConfiguration, "server: the base URL must be an http or https URL with a host")
        }
        self.baseURL = baseURL
        self.queueName = Self.queueName(for: baseURL)
        self.configuration = configuration
        self.authorization = authorization
        self.logger = logger
        self.store = try QueueStore(path: configuration.databasePath, durability: configuration.durability)
        self.transport = try FHIRTransport(
            timeout: configuration.requestTimeout, connectTimeout: configuration.connectTimeout,
            caBundlePath: configuration.caBundlePath)
    }

    /// Releases the HTTP client. Call once, when done with the queue.
    public func shutdown() async throws {
        store.stopWriters()
        try await transport.shutdown()
    }

    // MARK: - Turning resources into requests

    /// Makes the request that sends `resource`: the routing decision of the queue.
    ///
    /// `DataQueue` sends `POST [base]/[type]` for a create, `PUT [base]/[type]/[id]` for an update, and
    /// `POST [base]` for a transaction or batch Bundle. Subclasses (``EncryptedDataQueue``) override it to
    /// encrypt and route elsewhere; the result is what is stored on disk.
    ///
    /// - Throws: ``DataQueueError`` with `.invalidResource` when an update has no `id`.
    open func prepareRequest(for resource: FHIRResource, method: FHIRMethod, itemID: UUID) throws -> PreparedRequest {
        var resource = resource
        let base = queueName
        switch method {
        case .put:
            guard let id = resource.id else {
                throw DataQueueError(.invalidResource, "a PUT (update) needs the resource's \"id\"")
            }
            return PreparedRequest(
                method: .put, url: "\(base)/\(resource.resourceType)/\(id)", contentType: "application/fhir+json",
                body: resource.data, resourceType: resource.resourceType, resourceID: id)
        case .post:
            if resource.isTransactionOrBatch {
                return PreparedRequest(
                    method: .post, url: base, contentType: "application/fhir+json", body: resource.data,
                    resourceType: "Bundle")
            }
            var ifNoneExist: String?
            if configuration.idempotent {
                if resource.identifier == nil && !resource.hasIdentifierElement {
                    resource = try resource.addingIdentifier(
                        system: "urn:ietf:rfc:3986", value: "urn:uuid:\(itemID.lowercasedString)")
                }
                if let identifier = resource.identifier {
                    ifNoneExist = "identifier=" + Self.searchEscape(identifier.system) + "|" + Self.searchEscape(identifier.value)
                }
            }
            return PreparedRequest(
                method: .post, url: "\(base)/\(resource.resourceType)", contentType: "application/fhir+json",
                ifNoneExist: ifNoneExist, body: resource.data, resourceType: resource.resourceType)
        }
    }

    static func searchEscape(_ text: String) -> String {
        var allowed = CharacterSet.urlQueryAllowed
        allowed.remove(charactersIn: "&=+,|$#?\\ ")
        return text.addingPercentEncoding(withAllowedCharacters: allowed) ?? text
    }

    private func newItem(for resource: FHIRResource, method: FHIRMethod) throws -> NewItem {
        let id = UUID.timeOrdered()
        let request = try prepareRequest(for: resource, method: method, itemID: id)
        return NewItem(
            id: id, queue: queueName, method: request.method, url: request.url, resourceType: request.resourceType,
            resourceID: request.resourceID, encrypted: request.encrypted, contentType: request.contentType,
            ifNoneExist: request.ifNoneExist, body: request.body)
    }

    // MARK: - Filling the queue

    /// Durably queues `resource` without sending it.
    ///
    /// Returns after the item is committed to SQLite (with ``Durability/full``, on disk). Enqueues from
    /// many tasks at once share commits.
    ///
    /// - Parameters:
    ///   - resource: the resource.
    ///   - method: `.post` (create, the default) or `.put` (update; needs an `id`).
    /// - Returns: the queued item.
    /// - Throws: ``DataQueueError`` (`.invalidResource`, `.storage`, `.storageFull`).
    @discardableResult
    public func enqueue(_ resource: FHIRResource, method: FHIRMethod = .post) async throws -> QueuedItem {
        let item = try newItem(for: resource, method: method)
        let sequence = try await store.insertGrouped(item)
        return queuedItem(item, sequence: sequence)
    }

    /// Durably queues several resources in one transaction: all of them or, on any error, none.
    ///
    /// - Throws: ``DataQueueError``; on `.invalidResource` the message names the position of the bad input.
    @discardableResult
    public func enqueue(contentsOf resources: [(FHIRResource, FHIRMethod)]) async throws -> [QueuedItem] {
        var items: [NewItem] = []
        items.reserveCapacity(resources.count)
        for (index, entry) in resources.enumerated() {
            do {
                items.append(try newItem(for: entry.0, method: entry.1))
            } catch let error as DataQueueError {
                throw DataQueueError(error.code, "input \(index + 1): \(error.message)")
            }
        }
        let sequences = try await store.insert(items)
        return zip(items, sequences).map { queuedItem($0, sequence: $1) }
    }

    private func queuedItem(_ item: NewItem, sequence: Int64) -> QueuedItem {
        QueuedItem(
            sequence: sequence, id: item.id, queue: item.queue, method: item.method, url: item.url,
            resourceType: item.resourceType, resourceID: item.resourceID, encrypted: item.encrypted, state: .pending,
            attempts: 0, enqueuedAt: Date(), lastAttemptAt: nil, lastStatus: nil, lastError: nil, outcome: nil,
            size: item.body.count)
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
    /// - Parameters:
    ///   - limit: the largest number of items to handle. The default is no limit.
    ///   - force: try even while the server is backing off after failures. The default is `false`.
    ///   - lockWait: how long to wait for another flusher, in seconds. The default is 0 (report `.busy`).
    ///   - progress: called after each item.
    /// - Returns: counts and why the flush stopped.
    /// - Throws: ``DataQueueError`` for storage failures (transport failures are reported, not thrown).
    public func flush(
        limit: Int? = nil, force: Bool = false, lockWait: TimeInterval = 0,
        progress: (@Sendable (FlushProgress) -> Void)? = nil
    ) async throws -> FlushReport {
        try await withTaskExecutorPreference(transport.taskExecutor) {
            try await flush(limit: limit, force: force, through: nil, tracking: nil, lockWait: lockWait, progress: progress).0
        }
    }

    private var flushLockPath: String { configuration.databasePath + ".flush.lock" }

    private func flush(
        limit: Int?, force: Bool, through: Int64?, tracking: Int64?, lockWait: TimeInterval,
        progress: (@Sendable (FlushProgress) -> Void)?
    ) async throws -> (FlushReport, SendOutcome?) {
        var report = FlushReport()
        var tracked: SendOutcome?
        // A new descriptor per flush: flock excludes other flushes in this process too.
        let lock = try FileLock(path: flushLockPath)
        guard try await lock.lock(until: .now + .milliseconds(Int64(lockWait * 1000))) else {
            report.stop = .busy
            try await fillCounts(&report)
            return (report, nil)
        }
        defer { lock.unlock() }

        if !force {
            let state = try await store.serverState(queue: queueName)
            if let next = state.nextAttemptAt, next > Date() {
                report.stop = .backoff(until: next)
                try await fillCounts(&report)
                return (report, nil)
            }
        }

        // A flusher that died with a request on the wire left a marker: let the server finish that request
        // before sending it (or anything) again, or a non-atomic conditional create could run twice.
        if let orphan = lock.inFlight() {
            let wait = orphan.sentAt.addingTimeInterval(configuration.settleDelay).timeIntervalSinceNow
            if wait > 0 {
                logger.warning(
                    "a previous flush stopped while sending; letting the server settle its request first",
                    metadata: ["item": "\(orphan.sequence)", "seconds": "\(wait)"])
                try await Task.sleep(for: .milliseconds(Int64(min(wait, configuration.settleDelay) * 1000)))
            }
            lock.clearInFlight()
        }

        var last: Int64 = 0
        var prefetched: ArraySlice<StoredItem> = []
        // Journal commits run while the next items are on the wire, several deliveries per commit; a
        // failed commit stops the flush at the next delivery, and the flush returns only once all are committed.
        let recorder = DeliveryRecorder(store: store)
        do {
            loop: while true {
                if let limit, report.delivered + report.parked >= limit {
                    report.stop = .limit
                    break
                }
                if prefetched.isEmpty {
                    prefetched = ArraySlice(
                        try await store.pendingBatch(queue: queueName, after: last, maxCount: 16, maxBytes: 4 << 20))
                }
                guard let stored = prefetched.popFirst() else { break }
                if let through, stored.info.sequence > through { break }
                last = stored.info.sequence
                let item = stored.info
                lock.markInFlight(sequence: item.sequence)
                let result = await deliver(stored)
                // Without an answer (connection lost, timeout) the request may still be at the server: the
                // marker stays, so that the next flush lets it settle first.
                if case .transient(nil, _, _) = result {} else { lock.clearInFlight() }
                switch result {
                case .delivered(let response):
                    let (serverID, versionID) = Self.parseLocation(response.location)
                    try recorder.record(
                        QueueStore.Delivery(
                            item: item, status: response.status, location: response.location, serverID: serverID,
                            versionID: versionID))
                    if recorder.backlog >= 32 { try await recorder.finish() }
                    report.delivered += 1
                    logger.debug("delivered", metadata: ["item": "\(item.id.lowercasedString)", "status": "\(response.status)"])
                    if item.sequence == tracking {
                        tracked = .delivered(
                            DeliveryRecord(
                                sequence: 0, id: item.id, event: .delivered, queue: item.queue, method: item.method,
                                url: item.url, resourceType: item.resourceType, status: response.status,
                                location: response.location, serverID: serverID, versionID: versionID,
                                attempts: item.attempts + 1, enqueuedAt: item.enqueuedAt, at: Date()))
                    }
                case .rejected(let status, let message, let outcome):
                    try await store.park(item, status: status, error: message, outcome: outcome)
                    report.parked += 1
                    logger.warning("parked", metadata: ["item": "\(item.id.lowercasedString)", "reason": "\(message)"])
                    if item.sequence == tracking { tracked = .parked(item, reason: message) }
                case .transient(let status, let message, let retryAfter):
                    let failures = (try await store.serverState(queue: queueName).failures) + 1
                    let retryAt = Date().addingTimeInterval(
                        configuration.retryPolicy.delay(afterFailures: failures, retryAfter: retryAfter))
                    try await store.recordFailure(
                        queue: queueName, item: item, status: status, error: message, nextAttemptAt: retryAt)
                    report.stop = .transient(message, retryAt: retryAt)
                    logger.notice("flush stopped", metadata: ["reason": "\(message)"])
                    break loop
                case .authentication(let status, let message):
                    try await store.recordFailure(queue: queueName, item: item, status: status, error: message, nextAttemptAt: nil)
                    report.stop = .authentication(message)
                    logger.error("authentication failed", metadata: ["reason": "\(message)"])
                    break loop
                }
                progress?(FlushProgress(delivered: report.delivered, parked: report.parked, item: item))
            }
        } catch {
            // Whatever stopped the flush, deliveries already made reach the journal first.
            try? await recorder.finish()
            throw error
        }
        try await recorder.finish()
        try await fillCounts(&report)
        return (report, tracked)
    }

    private func fillCounts(_ report: inout FlushReport) async throws {
        let status = try await store.status(queue: queueName)
        report.remaining = status.pending
        report.parkedTotal = status.parked
    }

    enum DeliveryResult {
        case delivered(TransportResponse)
        case rejected(status: Int?, message: String, outcome: String?)
        case transient(status: Int?, message: String, retryAfter: TimeInterval?)
        case authentication(status: Int?, message: String)
    }

    /// Sends one item, with one fresh credential and one retry after a 401/403.
    private func deliver(_ item: StoredItem) async -> DeliveryResult {
        let request = OutgoingRequest(
            method: item.info.method, url: item.info.url, contentType: item.contentType,
            ifNoneExist: item.ifNoneExist, body: item.body)
        var refreshed = false
        while true {
            let header: String?
            do {
                header = try await authorization?.authorizationHeader(forceRefresh: refreshed, logger: logger)
            } catch let error as DataQueueError where error.code == .authentication {
                return .authentication(status: nil, message: error.message)
            } catch {
                return .transient(status: nil, message: "cannot obtain a token: \(error)", retryAfter: nil)
            }
            let response: TransportResponse
            do {
                response = try await transport.send(request, authorization: header, logger: logger)
            } catch {
                return .transient(status: nil, message: "\(error)", retryAfter: nil)
            }
            switch ResponseClassification.classify(
                status: response.status, body: response.body, retryAfter: response.retryAfter,
                envelope: item.info.encrypted)
            {
            case .success:
                return .delivered(response)
            case .permanent(let message):
                let outcome = response.body.isEmpty ? nil : String(decoding: response.body, as: UTF8.self)
                return .rejected(status: response.status, message: message, outcome: outcome)
            case .transient(let message, let retryAfter):
                return .transient(status: response.status, message: message, retryAfter: retryAfter)
            case .authentication(let message):
                if authorization != nil && !refreshed {
                    refreshed = true
                    continue
                }
                return .authentication(status: response.status, message: message)
            }
        }
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
        try await store.status(queue: queueName)
    }

    /// Items of this queue in order, optionally only those in `state`.
    public func items(state: ItemState? = nil, limit: Int = 1000) async throws -> [QueuedItem] {
        try await store.items(queue: queueName, state: state, limit: limit)
    }

    /// One item by UUID (or a unique prefix of at least 4 characters) or by sequence number, with its body.
    public func item(_ reference: String) async throws -> (QueuedItem, Data) {
        let stored = try await store.item(reference)
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
    /// - Throws: `.notFound` when no parked item matches.
    public func retry(_ reference: String) async throws -> QueuedItem {
        let stored = try await store.item(reference)
        guard try await store.retry(sequence: stored.info.sequence) else {
            throw DataQueueError(.notFound, "item \(stored.info.id.lowercasedString) is not parked")
        }
        return stored.info
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
        let lock = try FileLock(path: flushLockPath)
        guard try await lock.lock(until: .now + .milliseconds(Int64(configuration.lockWait * 1000))) else {
            throw DataQueueError(.busy, "a flush of this queue is running; try again when it ends")
        }
        defer { lock.unlock() }
        let stored = try await store.item(reference)
        try await store.drop(stored.info)
        return stored.info
    }

    /// The delivery journal of this queue, oldest first (the newest `limit` lines).
    public func deliveries(limit: Int = 1000) async throws -> [DeliveryRecord] {
        try await store.deliveries(queue: queueName, limit: limit)
    }
}
