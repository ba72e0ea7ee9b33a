/// The one error type of FHIRDataQueue.
///
/// Every error carries a ``Code`` that says what kind of failure happened, so that callers (and the
/// `dq` command line, which maps codes to sysexits exit codes) can decide what to do without parsing
/// text. The ``description`` never contains resource bodies, secrets or tokens.
///
/// ```swift
/// do { try await queue.enqueue(resource) }
/// catch let error as DataQueueError where error.code == .invalidResource { … }
/// ```
public struct DataQueueError: Error, Sendable, CustomStringConvertible, Equatable {
    /// What kind of failure an error is. New codes may be added without breaking callers.
    public struct Code: Sendable, Hashable, CustomStringConvertible {
        private enum Value: String, Sendable {
            case invalidResource, invalidConfiguration, storage, transport, authentication
            case notFound, busy, encryption, storageFull, damaged
        }
        private let value: Value
        private init(_ value: Value) { self.value = value }

        /// The input is not an acceptable FHIR resource (malformed JSON, no `resourceType`, too large…).
        public static let invalidResource = Code(.invalidResource)
        /// The configuration is missing a value or has a wrong one.
        public static let invalidConfiguration = Code(.invalidConfiguration)
        /// The SQLite queue could not be opened, read or written.
        public static let storage = Code(.storage)
        /// The disk (or the file-size limit) is full; nothing was written.
        public static let storageFull = Code(.storageFull)
        /// The queue database is damaged (SQLite finds a malformed page, or a file that is not a database):
        /// `dq doctor` says how to recover what can be read.
        public static let damaged = Code(.damaged)
        /// The FHIR server could not be reached or answered with a transient failure.
        public static let transport = Code(.transport)
        /// The server refused the credentials, even after one fresh token.
        public static let authentication = Code(.authentication)
        /// No queued item has the given identifier.
        public static let notFound = Code(.notFound)
        /// Another process holds the flush lock of this queue.
        public static let busy = Code(.busy)
        /// A resource could not be encrypted or an envelope decrypted.
        public static let encryption = Code(.encryption)

        /// The code's name, e.g. `invalidResource`.
        public var description: String { value.rawValue }
    }

    /// What kind of failure this is.
    public let code: Code
    /// A human-readable, PHI-free explanation.
    public let message: String

    /// Creates an error with a code and a PHI-free message.
    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    /// The PHI-free message.
    public var description: String { message }
}
