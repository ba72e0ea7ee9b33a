import Foundation
import Logging
import PostgresNIO

extension DataQueue {
    /// Where a queue keeps what it has not delivered yet.
    ///
    /// ```swift
    /// .sqlite(path: "/var/lib/myapp/queue.sqlite")
    /// .postgresURL("postgres://dq@db.example.org/dq?sslmode=require")
    /// .postgres(client: client)   // a PostgresClient your ServiceGroup runs
    /// ```
    public enum Storage: Sendable {
        /// A SQLite file, created (0600, its directory 0700) on first use.
        case sqlite(path: String)
        /// A PostgreSQL database by URL; dq runs a connection pool of its own for it, and closes it in
        /// ``DataQueue/shutdown()``. What the URL leaves out comes from libpq's environment.
        case postgresURL(String)
        /// A PostgreSQL client the host runs (`client.run()` in its own `ServiceGroup`), shared with the
        /// rest of the host; dq neither starts nor closes it. `preparedStatements: false` behind a pooler
        /// that cannot keep them (PgBouncer in transaction mode before 1.21).
        case postgres(client: PostgresClient, preparedStatements: Bool = true)

        /// The storage a `database` setting names: a `postgres://` (or `postgresql://`) URL, else a SQLite path.
        public init(_ database: String) {
            self = QueuePaths.isPostgresURL(database) ? .postgresURL(database) : .sqlite(path: database)
        }

        /// Opens the store this names (not yet sealed or unsealed: see ``SealedStorage``).
        func open(durability: DataQueue.Durability, readOnly: Bool, leaseDuration: TimeInterval = 30, logger: Logger?) throws
            -> any QueueStorage
        {
            let logger = logger ?? Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
            switch self {
            case .sqlite(let path):
                return try SQLiteQueueStore(path: path, durability: durability, readOnly: readOnly, logger: logger)
            case .postgresURL(let url):
                return try PostgresQueueStore(url: url, readOnly: readOnly, leaseSeconds: leaseDuration, logger: logger)
            case .postgres(let client, let preparedStatements):
                return PostgresQueueStore(
                    client: client, preparedStatements: preparedStatements, readOnly: readOnly, leaseSeconds: leaseDuration, logger: logger)
            }
        }

        /// The path or URL (empty for a host's client).
        var location: String {
            switch self {
            case .sqlite(let path): path
            case .postgresURL(let url): url
            case .postgres: ""
            }
        }
    }

    /// Whether creates go as conditional creates (`If-None-Exist`), so that a create whose answer was lost
    /// (the connection cut, dq killed after the server committed it) finds the resource when it is sent again
    /// instead of storing it twice.
    ///
    /// The `idempotent` setting: `"auto"` (the default), `true` or `false` in `dq.json` and `DQ_IDEMPOTENT`. A
    /// Boolean converts, so `configuration.idempotent = true` reads as before.
    ///
    /// ```swift
    /// configuration.idempotent = .automatic   // the default
    /// configuration.idempotent = true         // .always
    /// ```
    public enum Idempotence: String, Sendable, Hashable, CaseIterable, ExpressibleByBooleanLiteral, CustomStringConvertible {
        /// `"auto"`, the default: a create of a type whose `conditionalCreate` the server's CapabilityStatement
        /// declares carries `If-None-Exist` on the resource's first identifier with a `system` and a `value`
        /// (each `POST` entry of a queued Bundle likewise). Nothing is added to a resource: one without such an
        /// identifier, or of a type the server does not declare, goes as a plain create, as does every create
        /// to a server that declares conditional create for no type (there dq delivers at least once). The
        /// CapabilityStatement is read as for automatic Bundles (at most once per flush, cached for
        /// ``Configuration/capabilityLifetime``).
        case automatic = "auto"
        /// `true`: idempotent mode. Every create carries `If-None-Exist` on the resource's first identifier
        /// with a `system` and a `value`, whatever the server declares; a resource without one gets one naming
        /// its queue item (`urn:ietf:rfc:3986|urn:uuid:…`); a resource whose identifier cannot be conditioned
        /// is refused at enqueue. A 200 counts as `already-present` only for the declared types.
        case always = "true"
        /// `false`: plain creates. A create whose answer was lost is sent again (at least once).
        case never = "false"

        /// `true` is ``always``, `false` ``never``.
        public init(booleanLiteral value: Bool) {
            self = value ? .always : .never
        }

        /// `true` is ``always``, `false` ``never``.
        public init(_ enabled: Bool) {
            self = enabled ? .always : .never
        }

        /// The setting's value as `dq.json` and `DQ_IDEMPOTENT` write it: `auto`, `true` or `false`.
        public var description: String { rawValue }
    }

    /// How a ``DataQueue`` stores, sends and retries.
    ///
    /// ```swift
    /// var configuration = DataQueue.Configuration(databasePath: "/var/lib/dq/queue.sqlite")
    /// configuration.idempotent = true
    /// ```
    public struct Configuration: Sendable {
        /// Where the queue is kept. The default is a SQLite file at ``DataQueue/defaultDatabasePath(environment:)``.
        public var storage: Storage
        /// The SQLite file or PostgreSQL URL of the queue, as the `database` setting names it (empty for a
        /// host's PostgreSQL client); setting it sets ``storage``.
        public var databasePath: String {
            get { storage.location }
            set { storage = Storage(newValue) }
        }
        /// How durable an enqueue is. The default is ``DataQueue/Durability/full``.
        public var durability: DataQueue.Durability
        /// Makes retried creates safe with conditional creates (see ``Idempotence``). The default,
        /// ``Idempotence/automatic``, sends `If-None-Exist` on the resource's own identifier for the types whose
        /// conditional create the server declares; `true` (idempotent mode) for every create, giving a resource
        /// without an identifier one that names the item's UUID (`urn:ietf:rfc:3986|urn:uuid:…`); `false` never.
        public var idempotent: Idempotence
        /// The largest resource accepted, in bytes. The default is ``FHIRResource/defaultMaximumSize``.
        public var maximumResourceSize: Int
        /// The `resourceType`s an enqueue accepts. The default is FHIR R4's: a type the server cannot know is refused
        /// at once, not parked when the server refuses it.
        public var resourceTypes: ResourceTypes = .r4(adding: [])
        /// The deadline of one request, in seconds. The default is 30.
        public var requestTimeout: TimeInterval
        /// The connect timeout, in seconds. The default is 10.
        public var connectTimeout: TimeInterval
        /// The backoff after failures. The default is ``RetryPolicy/init(initialDelay:maximumDelay:jitter:)``.
        public var retryPolicy: RetryPolicy
        /// How long `create`/`update` wait for another flusher of this queue, in seconds, before they
        /// leave their resource queued. The default is 30.
        public var lockWait: TimeInterval
        /// How long a flush waits, after finding that the previous flusher of this queue stopped while a
        /// request was on the wire (killed, crashed, cancelled), before it sends anything: the server may
        /// still be processing that orphaned request, and a server whose conditional create is not atomic
        /// would otherwise create the resource twice even in idempotent mode. Counted from when the orphaned
        /// request was sent, so it costs nothing after an orderly stop. The default is 1 second.
        public var settleDelay: TimeInterval
        /// With a PostgreSQL database: how long the right to flush a server (a lease) lasts unless its holder
        /// renews it (every third of it). A flusher that dies is replaced after at most this long; a shorter
        /// lease costs more renewals. The default is 30 seconds.
        public var leaseDuration: TimeInterval = 30
        /// Proxies, trust and the client certificate for every request (see ``NetworkConfiguration``). The
        /// default is direct connections with the system's trust store.
        public var network = NetworkConfiguration()
        /// A PEM file of CA certificates trusted in addition to the system's (private PKI; see
        /// ``NetworkConfiguration/caBundleOnly``). TLS verification is always on. The default is `nil`.
        public var caBundlePath: String? {
            get { network.caBundlePath }
            set { network.caBundlePath = newValue }
        }
        /// The most items one request carries, as the entries of a transaction Bundle. `1` sends one request
        /// per item. The default, nil, is automatic: dq reads the server's CapabilityStatement (at most once
        /// per ``capabilityLifetime``, cached in the database) and sends Bundles of up to
        /// ``defaultBatchSize`` entries when it declares the `transaction` interaction, single requests
        /// otherwise. A server that refuses large Bundles (413) or transactions is remembered either way.
        public var batchSize: Int?
        /// The most body bytes one Bundle carries (at least one item always goes). The default is 8 MiB.
        public var batchMaxBytes: Int
        /// How many encrypted items are sent to the encrypted endpoint at once. The default is 1 (in queue
        /// order, like everything else). More gives up order for that endpoint only (a C3-PRO receiver hands
        /// envelopes to an unordered message queue anyway); the journal and parking stay exact, and plain items
        /// keep their order.
        public var encryptedInFlight: Int = 1
        /// Where envelopes queued as they are (``DataQueue/enqueue(_:)->QueuedItem``) are posted, e.g.
        /// `https://example.org/c3pro/encfhir`: which endpoint an item goes to is stored with the item, so a plain
        /// ``DataQueue`` that holds no key can queue and forward envelopes sealed elsewhere. The default is none
        /// (such envelopes are refused); an ``EncryptedDataQueue`` posts to its own encrypted endpoint.
        public var encryptedEndpoint: URL?
        /// How long what a server's CapabilityStatement said is trusted before it is read again. The default
        /// is one day.
        public var capabilityLifetime: TimeInterval
        /// Opens an existing queue for reading only (status, listings, the journal): no file or directory
        /// is created and nothing is written; a missing database is an error. The default is `false`.
        public var readOnly: Bool
        /// Seals every queued item at rest (AES-256-GCM) under these keys: the body, request path, resource id,
        /// `fullUrl` and a parked item's answer are never stored readable (see the README's security model).
        /// A queue sealed once needs a key that opens it from then on; setting keys for a plain queue seals
        /// the items already there when it opens. The default is nil: items are stored as given.
        public var atRest: AtRestKeys? = nil
        /// Opens the envelopes in the queue (``DataQueue/enqueue(_:)->QueuedItem``) with these keys when they are
        /// sent, and sends the resource inside to the server, as a plain create: the receiving side of C3-PRO
        /// (`dq serve`). The plaintext exists in memory only. An envelope that does not open is quarantined:
        /// parked with a reason that begins ``DataQueue/quarantinePrefix``, never sent, holding up nothing. The
        /// default is nil: envelopes go to the encrypted endpoint as they are.
        public var envelopeKeyring: EnvelopeKeyring? = nil
        /// How long a receiver's repeats are recognised (`serve.dedupe_window_days`): an `Idempotency-Key`'s receipt,
        /// and the digest of a delivered resource of a client, by which the same resource from the same client
        /// is journaled as a duplicate and not sent again. Applies only to items a receiver queued with their
        /// client. The default is 7 days.
        public var duplicateWindow: TimeInterval = 7 * 86_400
        /// Whether the encrypted endpoint is a `dq serve` that takes several envelopes in one request
        /// (`dq serve --role edge` forwarding to the receiver inside sets it): consecutive envelopes then go as one
        /// batch of up to ``batchSize`` (100 when automatic) and ``batchMaxBytes``, committed there all or none, in
        /// order. A receiver that refuses a batch gets one envelope per request from then on. The default is false.
        public var envelopeBatches = false
        /// What a receiver's clients may write (``WritePolicy``; `serve.write_policy`): applied to every item a
        /// receiver queued with its client, when it is sent (an envelope once opened). A write the policy refuses is
        /// quarantined (parked with a reason that begins ``DataQueue/quarantinePrefix``, never sent). Items queued
        /// without a client (`dq enqueue`, a library host's own) are not subject to it. The default is
        /// ``WritePolicy/c3pro``.
        public var writePolicy: WritePolicy = .c3pro

        /// Creates a configuration. Every parameter has the default stated on its property.
        public init(
            databasePath: String = DataQueue.defaultDatabasePath(),
            durability: DataQueue.Durability = .full,
            idempotent: Idempotence = .automatic,
            maximumResourceSize: Int = FHIRResource.defaultMaximumSize,
            requestTimeout: TimeInterval = 30,
            connectTimeout: TimeInterval = 10,
            retryPolicy: RetryPolicy = RetryPolicy(),
            lockWait: TimeInterval = 30,
            settleDelay: TimeInterval = 1,
            caBundlePath: String? = nil,
            readOnly: Bool = false,
            batchSize: Int? = nil,
            batchMaxBytes: Int = 8 << 20,
            capabilityLifetime: TimeInterval = 86_400
        ) {
            self.storage = Storage(databasePath)
            self.durability = durability
            self.idempotent = idempotent
            self.maximumResourceSize = maximumResourceSize
            self.requestTimeout = requestTimeout
            self.connectTimeout = connectTimeout
            self.retryPolicy = retryPolicy
            self.lockWait = lockWait
            self.settleDelay = settleDelay
            self.readOnly = readOnly
            self.batchSize = batchSize
            self.batchMaxBytes = batchMaxBytes
            self.capabilityLifetime = capabilityLifetime
            self.network.caBundlePath = caBundlePath
        }

        /// The Bundle size automatic batching uses with a server that takes transactions: 100 entries.
        public static let defaultBatchSize = 100
        /// The largest `batchSize` accepted.
        public static let maximumBatchSize = SettingLimits.maximumBatchSize

        /// The largest number of seconds a duration setting takes (one day).
        public static let maximumSeconds: TimeInterval = SettingLimits.maximumSeconds
        /// The largest resource size a queue can be set to accept (1 GiB).
        public static let maximumResourceSizeLimit = SettingLimits.maximumResourceSizeLimit

        /// Checks every setting: durations finite and between their bounds, sizes in range, a database path
        /// that is a file path.
        ///
        /// ``DataQueue/init(baseURL:configuration:authorization:httpClient:logger:)`` calls it, so a bad value
        /// is refused before anything is opened.
        /// - Throws: ``DataQueueError`` with `.invalidConfiguration` naming the setting.
        public func validate() throws {
            try Self.checkSeconds(requestTimeout, name: "requestTimeout", allowZero: false)
            try Self.checkSeconds(connectTimeout, name: "connectTimeout", allowZero: false)
            try Self.checkSeconds(lockWait, name: "lockWait", allowZero: true)
            try Self.checkSeconds(settleDelay, name: "settleDelay", allowZero: true)
            try Self.checkSeconds(leaseDuration, name: "leaseDuration", allowZero: false)
            guard leaseDuration >= 1 else { throw DataQueueError(.invalidConfiguration, "leaseDuration must be at least 1 second") }
            try Self.checkSeconds(retryPolicy.initialDelay, name: "retryPolicy.initialDelay", allowZero: true)
            try Self.checkSeconds(retryPolicy.maximumDelay, name: "retryPolicy.maximumDelay", allowZero: true)
            guard retryPolicy.jitter.isFinite, (0...1).contains(retryPolicy.jitter) else {
                throw DataQueueError(.invalidConfiguration, "retryPolicy.jitter must be between 0 and 1")
            }
            guard (64...Self.maximumResourceSizeLimit).contains(maximumResourceSize) else {
                throw DataQueueError(
                    .invalidConfiguration, "maximumResourceSize must be between 64 and \(Self.maximumResourceSizeLimit) bytes")
            }
            if case .postgres = storage {
            } else {
                try Self.checkDatabasePath(databasePath, name: "databasePath")
            }
            if let batchSize, !(1...Self.maximumBatchSize).contains(batchSize) {
                throw DataQueueError(.invalidConfiguration, "batchSize must be from 1 to \(Self.maximumBatchSize)")
            }
            guard (1024...(256 << 20)).contains(batchMaxBytes) else {
                throw DataQueueError(.invalidConfiguration, "batchMaxBytes must be from 1024 to \(256 << 20) bytes")
            }
            try Self.checkSeconds(capabilityLifetime, name: "capabilityLifetime", allowZero: true)
            guard (1...64).contains(encryptedInFlight) else {
                throw DataQueueError(.invalidConfiguration, "encryptedInFlight must be from 1 to 64")
            }
        }

        /// Refuses a duration that is not finite, negative (or zero when `allowZero` is false), or over a day:
        /// the one check of every duration, whether it comes from code, a config file, the environment or a flag.
        ///
        /// - Parameters:
        ///   - value: the duration in seconds.
        ///   - name: the setting as the user wrote it (`timeout_seconds`, `--timeout`), for the message.
        ///   - allowZero: whether 0 is a valid value.
        /// - Throws: ``DataQueueError`` with `.invalidConfiguration` naming the setting.
        public static func checkSeconds(_ value: Double, name: String, allowZero: Bool) throws {
            try SettingLimits.checkSeconds(value, name: name, allowZero: allowZero)
        }

        /// Refuses a database setting that is empty or a URL other than `postgres://…` (a SQLite file path, or
        /// a PostgreSQL database).
        ///
        /// - Throws: ``DataQueueError`` with `.invalidConfiguration` naming the setting.
        public static func checkDatabasePath(_ path: String, name: String) throws {
            try SettingLimits.checkDatabasePath(path, name: name)
        }
    }

    /// The default database: `$XDG_DATA_HOME/dq/queue.sqlite`, else `~/.local/share/dq/queue.sqlite`.
    public static func defaultDatabasePath(environment: [String: String] = ProcessInfo.processInfo.environment) -> String {
        QueuePaths.defaultDatabasePath(environment: environment)
    }

    /// The queue name of a base URL: its normal form, which names its queue in the database.
    ///
    /// Scheme and host in lowercase, the port only when it is not the scheme's default, the path as written
    /// without a trailing slash: `HTTPS://FHIR.example.org:443/r4/` and `https://fhir.example.org/r4` are one
    /// server and one queue; two paths on one host are two.
    ///
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` for a URL that is not http(s) with a host, or
    ///   that has a query, a fragment, or a user or password (credentials belong in `auth`, never in a URL
    ///   that dq prints and stores).
    public static func queueName(for baseURL: URL) throws -> String {
        try queueName(for: baseURL, setting: "server")
    }

    static func queueName(for baseURL: URL, setting: String) throws -> String {
        try QueuePaths.queueName(for: baseURL, setting: setting)
    }
}

/// What happened to a resource handed to ``DataQueue/create(_:)`` or ``DataQueue/update(_:)``.
public enum SendOutcome: Sendable, Equatable {
    /// The server accepted it; the journal line says where it is.
    case delivered(DeliveryRecord)
    /// It is safely queued and will be sent by a later flush; the reason is PHI-free.
    case queued(QueuedItem, reason: String)
    /// The server rejected it for good; it is parked for an operator with the server's answer.
    case parked(QueuedItem, reason: String)
}

extension FlushReport {
    /// Why a flush stopped before the queue was empty.
    public enum Stop: Sendable, Equatable {
        /// A transient failure (network, 5xx, 408, 429); the queue is kept in order for a later flush.
        case transient(String, retryAt: Date)
        /// The server refused the credentials.
        case authentication(String)
        /// The server is backing off after earlier failures; `force` tries anyway.
        case backoff(until: Date)
        /// Another process or task is flushing this queue.
        case busy
        /// The item limit was reached.
        case limit

        /// When the server may be tried again, when the flush stopped for a failure or a backoff.
        public var retryDate: Date? {
            switch self {
            case .transient(_, let retryAt): retryAt
            case .backoff(let until): until
            default: nil
            }
        }
    }
}

extension FlushReport.Stop {
    /// How a refused credential's failure starts in the server state (`dq status`'s last error): a flush inside its
    /// backoff stops with ``authentication(_:)`` again rather than ``backoff(until:)``.
    static let refusedCredentials = "authentication failed: "
}

extension FlushReport.Stop: CustomStringConvertible {
    /// Why the flush stopped, in words (PHI-free): `no answer from …: timed out; next try after 2026-11-26T06:10:04Z`.
    public var description: String {
        switch self {
        case .transient(let message, let retryAt): "\(message); next try after \(Self.format(retryAt))"
        case .authentication(let message): "authentication failed: \(message)"
        case .backoff(let until): "the server is backing off after failures until \(Self.format(until))"
        case .busy: "another flush of this queue is running"
        case .limit: "the item limit was reached"
        }
    }

    private static func format(_ date: Date) -> String {
        let formatter = ISO8601DateFormatter()
        formatter.formatOptions = [.withInternetDateTime]
        return formatter.string(from: date)
    }
}

/// The result of a flush.
public struct FlushReport: Sendable, Equatable {
    /// Items the server accepted in this flush.
    public var delivered = 0
    /// Items parked in this flush: rejected for good by the server, or held back unsent by dq (``held``).
    public var parked = 0
    /// Of ``parked``, the items dq parked without sending them: a reference to a resource whose location is not
    /// known (the server did not say where it stored it, or its item was not delivered), or a body dq cannot send.
    /// The server never saw them.
    public var held = 0
    /// Items the server rejected for good in this flush: ``parked`` less ``held``.
    public var rejected: Int { parked - held }
    /// Items still pending after the flush.
    public var remaining = 0
    /// Parked items in the queue after the flush (from this and earlier flushes).
    public var parkedTotal = 0
    /// Why the flush stopped early, or nil when it reached the end of the queue.
    public var stop: FlushReport.Stop?
    /// HTTP requests this flush made to the server (a Bundle is one; the CapabilityStatement read too).
    public var requests = 0
    /// Items sent as entries of transaction Bundles (including Bundles split after a refusal).
    public var bundleEntries = 0

    /// Creates an empty report.
    public init() {}
}

extension FlushReport {
    /// Progress of a running flush, for a terminal display.
    public struct Progress: Sendable {
        /// Items delivered so far.
        public var delivered: Int
        /// Items parked so far.
        public var parked: Int
        /// The item just handled.
        public var item: QueuedItem
    }
}

extension DataQueue.Storage: CustomStringConvertible, CustomDebugStringConvertible, CustomReflectable {
    /// `sqlite(path: "…")`, `postgresURL("…")` with the URL's password redacted, or `postgres(client: PostgresClient,
    /// preparedStatements: …)`: a host's client is named, never reflected (its configuration holds the password).
    public var description: String {
        switch self {
        case .sqlite(let path): "sqlite(path: \(String(reflecting: path)))"
        case .postgresURL(let url): "postgresURL(\(String(reflecting: Redaction.url(url))))"
        case .postgres(_, let prepared): "postgres(client: PostgresClient, preparedStatements: \(prepared))"
        }
    }

    /// The same as `description`: never a password.
    public var debugDescription: String { description }

    /// The case and its values as `description` shows them.
    public var customMirror: Mirror {
        switch self {
        case .sqlite(let path): Mirror(self, children: ["sqlite": path], displayStyle: .enum)
        case .postgresURL(let url): Mirror(self, children: ["postgresURL": Redaction.url(url)], displayStyle: .enum)
        case .postgres(_, let prepared):
            Mirror(self, children: ["postgres": (client: "PostgresClient", preparedStatements: prepared)], displayStyle: .enum)
        }
    }
}

extension DataQueue.Configuration: RedactedDescription {
    /// Every setting; the password of a PostgreSQL or proxy URL redacted, and the at-rest keys shown by their ids.
    package var redactedFields: [RedactedField] {
        [
            .plain("storage", storage), .plain("durability", durability), .plain("idempotent", idempotent),
            .plain("maximumResourceSize", maximumResourceSize), .plain("resourceTypes", resourceTypes),
            .plain("requestTimeout", requestTimeout),
            .plain("connectTimeout", connectTimeout), .plain("retryPolicy", retryPolicy), .plain("lockWait", lockWait),
            .plain("settleDelay", settleDelay), .plain("leaseDuration", leaseDuration), .plain("network", network),
            .plain("batchSize", batchSize), .plain("batchMaxBytes", batchMaxBytes), .plain("encryptedInFlight", encryptedInFlight),
            .url("encryptedEndpoint", encryptedEndpoint),
            .plain("capabilityLifetime", capabilityLifetime), .plain("readOnly", readOnly),
            .custom("atRest", atRest.map(\.ids), shown: atRest.map(\.ids)),
            .custom("envelopeKeyring", envelopeKeyring.map(\.directory), shown: envelopeKeyring.map(\.directory)),
            .plain("duplicateWindow", duplicateWindow), .plain("envelopeBatches", envelopeBatches),
            .plain("writePolicy", writePolicy),
        ]
    }
}

extension DataQueue: RedactedDescription {
    /// `DataQueue(queue: http://host/fhir)` (or the subclass's name): the queue's name, nothing it holds.
    public var description: String { "\(type(of: self))(queue: \(queueName))" }

    /// The queue's name, its configuration (without secrets) and the type of its authorization: never the
    /// credentials, the store or the HTTP client.
    package var redactedFields: [RedactedField] {
        [
            .plain("queueName", queueName), .plain("configuration", configuration),
            .custom("authorization", authorization.map { Redaction.name(of: $0) }, shown: authorization.map { Redaction.name(of: $0) }),
        ]
    }
}

extension DataQueue.Configuration {
    /// Which `resourceType`s an enqueue accepts.
    public enum ResourceTypes: Sendable, Hashable {
        /// FHIR R4's resource types, and `adding` (types a server defines of its own).
        case r4(adding: Set<String>)
        /// Any type name: the server decides.
        case any

        /// Whether `type` is accepted.
        public func accepts(_ type: String) -> Bool {
            switch self {
            case .any: true
            case .r4(let adding): IdentifierCardinality.allTypes.contains(type) || adding.contains(type)
            }
        }
    }
}
