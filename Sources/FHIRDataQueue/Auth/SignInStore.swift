import Crypto
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// What `dq login` keeps after a person signed in: the tokens, when they were issued, and the SMART
/// launch context. Written by ``SignInStore``; never printed.
package struct SignIn: Sendable, Codable, Equatable {
    /// The FHIR base URL the sign-in is for.
    package var fhirBaseURL: String
    /// The client that signed in.
    package var clientID: String
    /// The issuer whose ID token was checked, if an ID token was asked for.
    package var issuer: String?
    /// The token endpoint, for refreshes.
    package var tokenEndpoint: String
    /// The RFC 7009 revocation endpoint, if the server offers one.
    package var revocationEndpoint: String?
    /// The access token.
    package var accessToken: String
    /// The refresh token, if granted (`offline_access` or `online_access`).
    package var refreshToken: String?
    /// When the access token was issued (by this host's clock, when the answer arrived).
    package var issuedAt: Date
    /// The access token's lifetime in seconds (`expires_in`).
    package var expiresIn: Double
    /// The scope granted.
    package var scope: String?
    /// The SMART launch context: `patient`.
    package var patient: String?
    /// The SMART launch context: `encounter`.
    package var encounter: String?
    /// The person: the ID token's `fhirUser` claim.
    package var fhirUser: String?
    /// The person: the ID token's `sub` claim.
    package var subject: String?
    /// When the person signed in.
    package var signedInAt: Date
    /// When the tokens were last refreshed, if ever.
    package var refreshedAt: Date?

    /// When the access token expires.
    package var expiresAt: Date { issuedAt.addingTimeInterval(expiresIn) }
    /// When dq renews the access token: half of its lifetime (the SMART rule dq follows).
    package var renewAt: Date { issuedAt.addingTimeInterval(expiresIn / 2) }

    /// Creates a record; ``refreshedAt`` starts nil.
    package init(
        fhirBaseURL: String, clientID: String, issuer: String?, tokenEndpoint: String, revocationEndpoint: String?,
        accessToken: String, refreshToken: String?, issuedAt: Date, expiresIn: Double, scope: String?,
        patient: String?, encounter: String?, fhirUser: String?, subject: String?, signedInAt: Date
    ) {
        self.fhirBaseURL = fhirBaseURL
        self.clientID = clientID
        self.issuer = issuer
        self.tokenEndpoint = tokenEndpoint
        self.revocationEndpoint = revocationEndpoint
        self.accessToken = accessToken
        self.refreshToken = refreshToken
        self.issuedAt = issuedAt
        self.expiresIn = expiresIn
        self.scope = scope
        self.patient = patient
        self.encounter = encounter
        self.fhirUser = fhirUser
        self.subject = subject
        self.signedInAt = signedInAt
    }

    enum CodingKeys: String, CodingKey {
        case fhirBaseURL = "fhir_base", clientID = "client_id", issuer, tokenEndpoint = "token_endpoint"
        case revocationEndpoint = "revocation_endpoint", accessToken = "access_token", refreshToken = "refresh_token"
        case issuedAt = "issued_at", expiresIn = "expires_in", scope, patient, encounter, fhirUser = "fhir_user"
        case subject = "sub", signedInAt = "signed_in_at", refreshedAt = "refreshed_at"
    }
}

/// Keeps one ``SignIn`` per FHIR server and client in the credentials directory: mode 0600, written
/// atomically (temporary file, fsync, rename), so that a reader sees the old tokens or the new ones, never
/// a mix. Refreshes by several processes (`dq run` and a `dq flush` from cron) are serialized with an
/// exclusive `flock` on a lock file beside it, so that a rotated refresh token is used once.
package struct SignInStore: Sendable {
    /// The directory of the files.
    package let directory: String
    /// The FHIR base URL.
    package let fhirBaseURL: String
    /// The client id.
    package let clientID: String

    /// Creates the store of `clientID` at `fhirBaseURL` in `directory`.
    package init(directory: String, fhirBaseURL: String, clientID: String) {
        self.directory = directory
        self.fhirBaseURL = fhirBaseURL
        self.clientID = clientID
    }

    /// The file: `login-<12 bytes of SHA-256 of the base URL and client id>.json`.
    package var path: String {
        let digest = SHA256.hash(data: Data((fhirBaseURL + "\n" + clientID).utf8)).prefix(12)
        return directory + "/login-" + digest.hexString + ".json"
    }

    /// The stored sign-in, or nil when there is none.
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when the file is unreadable or belongs to
    ///   another server or client.
    package func load() throws -> SignIn? {
        guard let decoded = SecretFile.read(SignIn.self, from: path) else { return nil }
        guard let signIn = decoded, signIn.fhirBaseURL == fhirBaseURL, signIn.clientID == clientID else {
            throw DataQueueError(.invalidConfiguration, "the sign-in file \(path) is unreadable; run `dq login` again")
        }
        return signIn
    }

    /// Stores `signIn`, replacing the earlier one atomically.
    package func save(_ signIn: SignIn) throws {
        try SecretFile.write(try SecretFile.encode(signIn), to: path, directory: directory, what: "sign-in file")
    }

    /// Deletes the stored sign-in; true when there was one.
    @discardableResult
    package func delete() throws -> Bool {
        if unlink(path) == 0 { return true }
        if errno == ENOENT { return false }
        throw DataQueueError(.storage, "cannot delete the sign-in file \(path): \(String(cString: strerror(errno)))")
    }

    /// Runs `body` holding the store's exclusive lock (other processes wait; polled, so that no thread of
    /// the cooperative pool blocks in `flock`).
    nonisolated(nonsending) func withLock<T>(_ body: nonisolated(nonsending) () async throws -> T) async throws -> T {
        try SecretFile.makeDirectory(directory)
        let fd = open(path + ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw DataQueueError(.storage, "cannot open the lock file \(path).lock") }
        defer { close(fd) }
        while flock(fd, LOCK_EX | LOCK_NB) != 0 {
            guard errno == EWOULDBLOCK || errno == EINTR else {
                throw DataQueueError(.storage, "cannot lock \(path).lock: \(String(cString: strerror(errno)))")
            }
            try await Task.sleep(for: .milliseconds(20))
        }
        defer { flock(fd, LOCK_UN) }
        return try await body()
    }
}

/// Files that hold secrets: a 0700 directory, mode 0600, written atomically.
enum SecretFile {
    static func makeDirectory(_ directory: String) throws {
        do {
            try FileManager.default.createDirectory(
                atPath: directory, withIntermediateDirectories: true, attributes: [.posixPermissions: 0o700])
        } catch {
            throw DataQueueError(.storage, "cannot create the credential directory \(directory)")
        }
    }

    /// The file's JSON: nil when there is no file, `.some(nil)` when it does not decode.
    static func read<T: Decodable>(_ type: T.Type, from path: String) -> T?? {
        guard let data = FileManager.default.contents(atPath: path) else { return nil }
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .iso8601
        return .some(try? decoder.decode(type, from: data))
    }

    /// Sorted, indented JSON with ISO 8601 dates.
    static func encode<T: Encodable>(_ value: T) throws -> Data {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys, .prettyPrinted, .withoutEscapingSlashes]
        encoder.dateEncodingStrategy = .iso8601
        return try encoder.encode(value)
    }

    /// Writes `data` to a temporary file (0600), fsyncs it, renames it over `file` and fsyncs `directory`.
    static func write(_ data: Data, to file: String, directory: String, what: String) throws {
        try makeDirectory(directory)
        let temporary = file + ".tmp-\(getpid())-\(UUID().uuidString.prefix(8))"
        let fd = open(temporary, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
        guard fd >= 0 else { throw DataQueueError(.storage, "cannot write the \(what) \(file)") }
        let written = data.withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
        let synced = fsync(fd)
        close(fd)
        guard written == data.count, synced == 0, rename(temporary, file) == 0 else {
            unlink(temporary)
            throw DataQueueError(.storage, "cannot write the \(what) \(file)")
        }
        // The rename is durable once the directory is: else a power loss could bring back the old file (a
        // refresh token the server has already rotated out). File systems that cannot sync a directory
        // (EINVAL on some FUSE and network mounts) keep the rename as they can; only an I/O error is
        // reported (the new file is in place either way).
        let directoryFD = open(directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard directoryFD >= 0 else { return }
        defer { close(directoryFD) }
        if fsync(directoryFD) != 0 && errno == EIO {
            throw DataQueueError(.storage, "cannot sync the directory of the \(what) \(file) (I/O error)")
        }
    }
}
