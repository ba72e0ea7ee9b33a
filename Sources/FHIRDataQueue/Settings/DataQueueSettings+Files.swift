import Configuration
import Foundation
import NIOConcurrencyHelpers

/// Where the settings' files are: the config file's search path, secret and key files, the database password.
extension DataQueueSettings {
    /// Where dq looks for its config file when neither `--config` nor `$DQ_CONFIG` names one, in order:
    /// `./dq.json`, `$XDG_CONFIG_HOME/dq/dq.json` (else `~/.config/dq/dq.json`), `/etc/dq/dq.json`.
    package static func configSearchPath(environment: [String: String]) -> [String] {
        var paths = ["dq.json"]
        if let xdg = environment["XDG_CONFIG_HOME"], xdg.hasPrefix("/") {
            paths.append(xdg + "/dq/dq.json")
        } else if let home = environment["HOME"], !home.isEmpty {
            paths.append(home + "/.config/dq/dq.json")
        }
        paths.append("/etc/dq/dq.json")
        return paths
    }

    /// Where a `…_file` secret is: an absolute path as given; a relative one in `$CREDENTIALS_DIRECTORY`
    /// (systemd's `LoadCredential=`) when that is set, else beside the config file.
    package func secretFilePath(_ name: String, environment: [String: String]) -> String {
        if !name.hasPrefix("/"), let credentials = environment["CREDENTIALS_DIRECTORY"], !credentials.isEmpty {
            return credentials + "/" + name
        }
        return inBaseDirectory(name)
    }

    /// Where a key or certificate file of the settings is (`tls.client_certificate`, `tls.client_key`,
    /// `auth.private_key`): an absolute path as given; a relative one in `$CREDENTIALS_DIRECTORY` (systemd's
    /// `LoadCredential=`) when that is set and holds it, else beside the config file.
    package func keyFilePath(_ name: String, environment: [String: String] = ProcessInfo.processInfo.environment) -> String {
        if !name.hasPrefix("/"), let credentials = environment["CREDENTIALS_DIRECTORY"], !credentials.isEmpty,
            FileManager.default.fileExists(atPath: credentials + "/" + name)
        {
            return credentials + "/" + name
        }
        return inBaseDirectory(name)
    }

    /// Reads `auth.bearer_token_file`, `auth.client_secret_file`, `proxy_file` and `database_password_file` into
    /// the secrets they hold
    /// (without a trailing newline), and remembers which secret files others can read (``exposedSecretFiles``).
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) naming the setting of a file that cannot be read
    ///   or is empty, never its content.
    package mutating func readSecretFiles(environment: [String: String]) throws {
        func read(_ name: String, key: String) throws -> String {
            let path = secretFilePath(name, environment: environment)
            guard let data = FileManager.default.contents(atPath: path) else {
                throw Self.configError("cannot read \"\(key)\" (\(path))")
            }
            var text = String(decoding: data, as: UTF8.self)
            // Line ends dropped one scalar at a time: "\r\n" is one Character.
            while let last = text.unicodeScalars.last, last == "\n" || last == "\r" { text.unicodeScalars.removeLast() }
            guard !text.isEmpty else { throw Self.configError("\"\(key)\" (\(path)) is empty") }
            if FilePermissions.exposedMode(path) != nil {
                exposedSecretFiles.append(path)
            }
            return text
        }
        if let name = auth?.bearerTokenFile {
            let token = try read(name, key: "auth.bearer_token_file")
            auth?.bearerToken = token
        }
        if let name = auth?.clientSecretFile {
            let secret = try read(name, key: "auth.client_secret_file")
            auth?.clientSecret = secret
        }
        if let name = proxyFile {
            proxy = try read(name, key: "proxy_file")
        }
        if let name = databasePasswordFile {
            databasePassword = try read(name, key: "database_password_file")
        }
    }

    /// Puts the password `database_password_file` holds into the `database` URL (once every source of
    /// `database` has been applied). A `database` that is no PostgreSQL URL keeps ``databasePassword`` set: the
    /// command line warns that the file is not used, and `dq migrate --to` uses it for its PostgreSQL target.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) when the `database` URL has a password of its own.
    package mutating func applyDatabasePassword() throws {
        guard databasePassword != nil, let database, QueuePaths.isPostgresURL(database) else { return }
        guard URLComponents(string: database)?.password == nil else {
            throw Self.configError("\"database\" holds a password and \"database_password_file\" names one: keep one")
        }
        self.database = withDatabasePassword(database)
        databasePassword = nil
    }

    /// `url` with the password `database_password_file` holds, when it is a PostgreSQL URL without one.
    package func withDatabasePassword(_ url: String) -> String {
        guard let password = databasePassword, QueuePaths.isPostgresURL(url), var components = URLComponents(string: url),
            components.password == nil
        else { return url }
        if components.user == nil { components.user = "" }
        components.password = password
        return components.string ?? url
    }

    /// Adds the at-rest key files (from the file or `DQ_AT_REST_KEY_FILE`) that others than their owner can read
    /// to ``exposedSecretFiles``; the keys themselves are read when the settings are resolved.
    package mutating func noteExposedKeyFiles(environment: [String: String]) {
        for name in [atRest?.keyFile].compactMap({ $0 }) + (atRest?.oldKeyFiles ?? []) {
            let path = secretFilePath(name, environment: environment)
            if FilePermissions.exposedMode(path) != nil {
                exposedSecretFiles.append(path)
            }
        }
    }

    /// The TLS files the settings name (CA bundle, client certificate and key) as they are on disk now: another
    /// value once one is replaced or rewritten (a rotated key), which a reload reports and the HTTP clients follow.
    package func tlsFiles() -> [Int64] {
        (try? checkedValues()).map { HTTPClients.stamp($0.network) } ?? []
    }
}
