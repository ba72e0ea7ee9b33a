import Foundation

extension DataQueue {
    /// How a ``DataQueue`` stores, sends and retries.
    ///
    /// ```swift
    /// var configuration = DataQueue.Configuration(databasePath: "/var/lib/dq/queue.sqlite")
    /// configuration.idempotent = true
    /// ```
    public struct Configuration: Sendable {
        /// The SQLite file of the queue. The default is ``defaultDatabasePath()``.
        public var databasePath: String
        /// How durable an enqueue is. The default is ``Durability/full``.
        public var durability: Durability
        /// Makes retried creates safe: each `POST` carries `If-None-Exist` on the resource's first
        /// identifier, and a resource without any identifier gets one naming the item's UUID
        /// (`urn:ietf:rfc:3986|urn:uuid:…`). Needs a server with conditional create. The default is `false`.
        public var idempotent: Bool
        /// The largest resource accepted, in bytes. The default is ``FHIRResource/defaultMaximumSize``.
        public var maximumResourceSize: Int
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
        /// A PEM file of CA certificates to trust instead of the system's (private PKI). TLS
        /// verification is always on. The default is `nil` (the system trust store).
        public var caBundlePath: String?

        /// Creates a configuration. Every parameter has the default stated on its property.
        public init(
            databasePath: String = DataQueue.defaultDatabasePath(),
            durability: Durability = .full,
            idempotent: Bool = false,
            maximumResourceSize: Int = FHIRResource.defaultMaximumSize,
            requestTimeout: TimeInterval = 30,
            connectTimeout: TimeInterval = 10,
            retryPolicy: RetryPolicy = RetryPolicy(),
            lockWait: TimeInterval = 30,
            settleDelay: TimeInterval = 1,
            caBundlePath: String? = nil
        ) {
            self.databasePath = databasePath
            self.durability = durability
            self.idempotent = idempotent
            self.maximumResourceSize = maximumResourceSize
            self.requestTimeout = requestTimeout
            self.connectTimeout = connectTimeout
            self.retryPolicy = retryPolicy
            self.lockWait = lockWait
            self.settleDelay = settleDelay
            self.caBundlePath = caBundlePath
        }
    }

    /// The default database: `$XDG_DATA_HOME/dq/queue.sqlite`, else `~/.local/share/dq/queue.sqlite`.
    public static func defaultDatabasePath(environment: [String: String] = ProcessInfo.processInfo.environment) -> String {
        if let xdg = environment["XDG_DATA_HOME"], xdg.hasPrefix("/") {
            return xdg + "/dq/queue.sqlite"
        }
        let home = environment["HOME"] ?? NSHomeDirectory()
        return home + "/.local/share/dq/queue.sqlite"
    }

    /// The queue name of a base URL: scheme, host, port and path, without a trailing slash.
    ///
    /// Two servers on one host have different queues.
    public static func queueName(for baseURL: URL) -> String {
        var text = baseURL.absoluteString
        while text.hasSuffix("/") { text.removeLast() }
        return text
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

/// Why a flush stopped before the queue was empty.
public enum FlushStop: Sendable, Equatable {
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
}

/// The result of a flush.
public struct FlushReport: Sendable, Equatable {
    /// Items the server accepted in this flush.
    public var delivered = 0
    /// Items the server rejected for good in this flush (now parked).
    public var parked = 0
    /// Items still pending after the flush.
    public var remaining = 0
    /// Parked items in the queue after the flush (from this and earlier flushes).
    public var parkedTotal = 0
    /// Why the flush stopped early, or nil when it reached the end of the queue.
    public var stop: FlushStop?

    /// Creates an empty report.
    public init() {}
}

/// Progress of a running flush, for a terminal display.
public struct FlushProgress: Sendable {
    /// Items delivered so far.
    public var delivered: Int
    /// Items parked so far.
    public var parked: Int
    /// The item just handled.
    public var item: QueuedItem
}
