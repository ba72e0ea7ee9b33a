import Crypto
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Client credentials a registration endpoint issued, as stored on disk.
package struct StoredCredentials: Sendable, Codable, Equatable {
    /// The registration endpoint that issued them.
    package var registrationURI: String
    /// The issued client id.
    package var clientID: String
    /// The issued secret, if any (none for key-based clients).
    package var clientSecret: String?
    /// The token endpoint auth method the server registered.
    package var tokenEndpointAuthMethod: String?
    /// When the secret expires (`client_secret_expires_at`, 0 = never), if said.
    package var clientSecretExpiresAt: Double?
    /// When dq registered.
    package var registeredAt: Date

    enum CodingKeys: String, CodingKey {
        case registrationURI = "registration_uri", clientID = "client_id", clientSecret = "client_secret"
        case tokenEndpointAuthMethod = "token_endpoint_auth_method", clientSecretExpiresAt = "client_secret_expires_at"
        case registeredAt = "registered_at"
    }
}

extension OAuth2Configuration {
    /// Keeps credentials from dynamic registration outside the config: one file per registration endpoint,
    /// mode 0600, written atomically (a temporary file, fsync, rename), replaced on re-registration.
    public struct CredentialStore: Sendable {
        /// The directory of the credential files.
        public let directory: String

        /// The default directory: `$XDG_CONFIG_HOME/dq/credentials`, else `~/.config/dq/credentials`.
        public static func defaultDirectory(environment: [String: String] = ProcessInfo.processInfo.environment) -> String {
            if let xdg = environment["XDG_CONFIG_HOME"], xdg.hasPrefix("/") { return xdg + "/dq/credentials" }
            return (environment["HOME"] ?? NSHomeDirectory()) + "/.config/dq/credentials"
        }

        /// Creates a store in `directory` (the default is ``defaultDirectory(environment:)``).
        public init(directory: String = OAuth2Configuration.CredentialStore.defaultDirectory()) {
            self.directory = directory
        }

        /// The file that holds the credentials of `registrationURI`.
        public func path(for registrationURI: String) -> String {
            let digest = SHA256.hash(data: Data(registrationURI.utf8)).prefix(12).hexString
            return directory + "/client-" + digest + ".json"
        }

        /// The stored credentials for `registrationURI`, or nil.
        package func load(registrationURI: String) throws -> StoredCredentials? {
            let file = path(for: registrationURI)
            guard let decoded = SecretFile.read(StoredCredentials.self, from: file) else { return nil }
            guard let credentials = decoded, credentials.registrationURI == registrationURI else {
                throw DataQueueError(.invalidConfiguration, "the credential file \(file) is unreadable; remove it to register again")
            }
            return credentials
        }

        /// Stores (or replaces) credentials atomically with mode 0600.
        package func save(_ credentials: StoredCredentials) throws {
            try SecretFile.write(
                try SecretFile.encode(credentials), to: path(for: credentials.registrationURI), directory: directory,
                what: "credential file")
        }
    }
}
