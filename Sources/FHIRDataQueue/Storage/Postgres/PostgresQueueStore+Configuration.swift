import Foundation
import Logging
import NIOSSL
import PostgresNIO

// The database URL and libpq's environment, read into postgres-nio's configuration.
extension PostgresQueueStore {
    /// The client's configuration, the URL without its password, and whether statements may be prepared
    /// (`prepared_statements=off` says no).
    static func configuration(
        url text: String, environment: [String: String]
    ) throws -> (PostgresClient.Configuration, String, Bool, PostgresConnection.Configuration) {
        // What the URL leaves out comes from libpq's environment, as psql would take it: PGHOST, PGPORT, PGUSER,
        // PGPASSWORD (else the password file), PGDATABASE, PGSSLMODE, PGSSLROOTCERT, PGSSLCERT, PGSSLKEY, PGAPPNAME.
        guard let components = URLComponents(string: text), let scheme = components.scheme,
            scheme == "postgres" || scheme == "postgresql"
        else {
            throw DataQueueError(
                .invalidConfiguration, "database URL must be postgres://user@host[:port]/database (or postgres:///database with PGHOST)")
        }
        let options = Dictionary((components.queryItems ?? []).map { ($0.name, $0.value ?? "") }, uniquingKeysWith: { $1 })
        for name in options.keys where !supportedOptions.contains(name) {
            throw DataQueueError(.invalidConfiguration, "database URL option \"\(name)\" is not supported")
        }
        // libpq: a host that starts with "/" is the directory of the server's Unix socket; none at all is the
        // packaged server's socket directory.
        let host =
            nonEmpty(options["host"]) ?? nonEmpty(components.percentEncodedHost?.removingPercentEncoding)
            ?? nonEmpty(environment["PGHOST"]) ?? defaultSocketDirectory
        let socketDirectory = host.hasPrefix("/") ? host : nil
        let portText = nonEmpty(options["port"]) ?? components.port.map(String.init) ?? nonEmpty(environment["PGPORT"]) ?? "5432"
        guard let port = Int(portText), (1...65535).contains(port) else {
            throw DataQueueError(.invalidConfiguration, "database port \(portText) is not a port number (1-65535)")
        }
        // libpq's default user is the name of the user dq runs as (what peer authentication on a socket expects).
        let user =
            nonEmpty(options["user"]) ?? nonEmpty(components.percentEncodedUser?.removingPercentEncoding) ?? nonEmpty(environment["PGUSER"])
            ?? Self.systemUserName() ?? "postgres"
        var database = nonEmpty(options["dbname"]) ?? String(components.path.drop(while: { $0 == "/" })).removingPercentEncoding ?? ""
        if database.isEmpty { database = environment["PGDATABASE"] ?? "" }
        guard !database.isEmpty else {
            throw DataQueueError(.invalidConfiguration, "database URL names no database (postgres://user@host/DATABASE, or PGDATABASE)")
        }
        // A socket in the packaged server's directory is "localhost" to the password file, as libpq has it.
        let passwordHost = socketDirectory.map { knownSocketDirectories.contains($0) ? "localhost" : $0 } ?? host
        let password =
            // An empty PGPASSWORD is unset, as libpq has it: the password file is read then.
            components.percentEncodedPassword.flatMap { $0.removingPercentEncoding } ?? nonEmpty(environment["PGPASSWORD"])
            ?? PasswordFile.password(
                host: passwordHost, port: port, database: database, user: user,
                file: nonEmpty(options["passfile"]) ?? nonEmpty(environment["PGPASSFILE"]), environment: environment)
        var display = URLComponents()
        display.scheme = scheme
        display.user = user
        display.path = "/" + database
        if let socketDirectory {
            display.host = ""
            display.queryItems =
                [URLQueryItem(name: "host", value: socketDirectory)]
                + (port == 5432 ? [] : [URLQueryItem(name: "port", value: String(port))])
        } else {
            display.host = host
            display.port = port == 5432 ? nil : port
        }
        let prepared: Bool
        switch options["prepared_statements"] ?? "on" {
        case "on", "true", "1": prepared = true
        case "off", "false", "0": prepared = false
        case let other:
            throw DataQueueError(.invalidConfiguration, "database URL prepared_statements \"\(other)\" is not on or off")
        }
        var tls = TLSConfiguration.makeClientConfiguration()
        // libpq's CA file: sslrootcert, else PGSSLROOTCERT, else ~/.postgresql/root.crt when it exists (then, as
        // with libpq, sslmode=require checks the server's certificate against it too).
        let defaultRoot = nonEmpty(environment["HOME"]).map { $0 + "/.postgresql/root.crt" }
            .flatMap { FileManager.default.isReadableFile(atPath: $0) ? $0 : nil }
        let rootCertificate = options["sslrootcert"] ?? environment["PGSSLROOTCERT"] ?? defaultRoot
        if let root = rootCertificate {
            guard FileManager.default.isReadableFile(atPath: root) else {
                throw DataQueueError(.invalidConfiguration, "database URL sslrootcert \(root) cannot be read")
            }
            tls.trustRoots = .file(root)
        }
        let sslmode = options["sslmode"] ?? environment["PGSSLMODE"] ?? "prefer"
        // A client certificate for servers that ask for one (pg_hba's `cert` method, or `clientcert=verify-full`),
        // read only where TLS may be used, as libpq reads it: not for a Unix socket nor with sslmode=disable.
        if socketDirectory == nil && sslmode != "disable" {
            try Self.loadClientCertificate(into: &tls, options: options, environment: environment)
        }
        let mode: PostgresClient.Configuration.TLS
        let required: Bool?  // nil: no TLS
        switch sslmode {
        case "disable":
            mode = .disable
            required = nil
        case "allow", "prefer":
            tls.certificateVerification = .none  // libpq: encryption if offered, no verification
            mode = .prefer(tls)
            required = false
        case "require":
            tls.certificateVerification = rootCertificate == nil ? .none : .noHostnameVerification
            mode = .require(tls)
            required = true
        case "verify-ca":
            tls.certificateVerification = .noHostnameVerification
            mode = .require(tls)
            required = true
        case "verify-full":
            tls.certificateVerification = .fullVerification
            mode = .require(tls)
            required = true
        case let other:
            throw DataQueueError(
                .invalidConfiguration,
                "database URL sslmode \"\(other)\" is not one of disable, allow, prefer, require, verify-ca, verify-full")
        }
        // As libpq: sslmode does not apply to a Unix socket (nothing leaves the machine).
        let socketPath = socketDirectory.map { "\($0)/.s.PGSQL.\(port)" }
        var configuration =
            socketPath.map { PostgresClient.Configuration(unixSocketPath: $0, username: user, password: password, database: database) }
            ?? PostgresClient.Configuration(host: host, port: port, username: user, password: password, database: database, tls: mode)
        configuration.options.maximumConnections = 16
        configuration.options.connectTimeout = .seconds(Int64(options["connect_timeout"].flatMap(Int.init) ?? 10))
        if let name = options["application_name"] ?? environment["PGAPPNAME"] {
            configuration.options.additionalStartupParameters = [("application_name", name)]
        }
        let probeTLS: PostgresConnection.Configuration.TLS
        do {
            switch required {
            case nil: probeTLS = .disable
            case false?: probeTLS = .prefer(try NIOSSLContext(configuration: tls))
            case true?: probeTLS = .require(try NIOSSLContext(configuration: tls))
            }
        } catch {
            throw DataQueueError(.invalidConfiguration, "database URL: TLS cannot be set up (\(error))")
        }
        var probe =
            socketPath.map { PostgresConnection.Configuration(unixSocketPath: $0, username: user, password: password, database: database) }
            ?? PostgresConnection.Configuration(
                host: host, port: port, username: user, password: password, database: database, tls: probeTLS)
        probe.options.connectTimeout = .seconds(configuration.options.connectTimeout.components.seconds)
        return (configuration, display.string ?? "postgres://\(host)/\(database)", prepared, probe)
    }

    /// Adds the client certificate and key to `tls`: the URL's `sslcert`/`sslkey`, else `PGSSLCERT`/`PGSSLKEY`,
    /// else libpq's default files `~/.postgresql/postgresql.crt` and `.key` when both are there. A certificate
    /// named (in the URL or the environment) that cannot be used is a configuration error; default files that
    /// cannot be used are left aside (libpq would go on without TLS under `prefer`).
    static func loadClientCertificate(
        into tls: inout TLSConfiguration, options: [String: String], environment: [String: String]
    ) throws {
        let named = nonEmpty(options["sslcert"]) ?? nonEmpty(environment["PGSSLCERT"])
        let home = nonEmpty(environment["HOME"]).map { $0 + "/.postgresql/" }
        let certificatePath: String
        let keyPath: String
        if let named {
            certificatePath = named
            guard let key = nonEmpty(options["sslkey"]) ?? nonEmpty(environment["PGSSLKEY"]) ?? home.map({ $0 + "postgresql.key" }) else {
                throw DataQueueError(.invalidConfiguration, "database sslcert \(named) has no sslkey")
            }
            keyPath = key
        } else if let home, FileManager.default.fileExists(atPath: home + "postgresql.crt"),
            FileManager.default.fileExists(atPath: home + "postgresql.key")
        {
            certificatePath = home + "postgresql.crt"
            keyPath = home + "postgresql.key"
        } else {
            return
        }
        do {
            var candidate = tls
            candidate.certificateChain = try NIOSSLCertificate.fromPEMFile(certificatePath).map { .certificate($0) }
            guard !candidate.certificateChain.isEmpty else {
                throw DataQueueError(.invalidConfiguration, "database sslcert \(certificatePath) holds no certificate")
            }
            // libpq refuses a key file that others can read (following a symbolic link, as stat(2) does); so
            // does dq: the key proves who the client is.
            guard let (owner, mode) = FilePermissions.ownerAndMode(keyPath) else {
                throw DataQueueError(.invalidConfiguration, "database sslkey \(keyPath) cannot be read")
            }
            guard FilePermissions.isPrivate(owner: owner, mode: mode) else {
                throw DataQueueError(
                    .invalidConfiguration,
                    "database sslkey \(keyPath) can be read by others (mode \(String(mode, radix: 8))); chmod 600 it, as libpq asks")
            }
            do {
                candidate.privateKey = .privateKey(try NIOSSLPrivateKey(file: keyPath, format: .pem))
            } catch {
                throw DataQueueError(.invalidConfiguration, "database sslkey \(keyPath) cannot be read as a PEM private key")
            }
            tls = candidate
        } catch let error as DataQueueError {
            if named != nil { throw error }
        } catch {
            if named != nil {
                throw DataQueueError(.invalidConfiguration, "database sslcert \(certificatePath) cannot be read as PEM certificates")
            }
        }
    }

    /// `value` unless it is empty (libpq treats an empty setting as no setting).
    private static func nonEmpty(_ value: String?) -> String? { value.flatMap { $0.isEmpty ? nil : $0 } }

    /// The URL's options dq reads (libpq's names).
    static let supportedOptions: Set<String> = [
        "sslmode", "sslrootcert", "sslcert", "sslkey", "application_name", "connect_timeout", "prepared_statements", "host", "port",
        "user", "dbname", "passfile",
    ]

    /// Where Debian's and most distributions' PostgreSQL puts its socket.
    static let defaultSocketDirectory = "/var/run/postgresql"
    /// The packaged server's socket folder (Debian's libpq is built with /var/run/postgresql, a link to
    /// /run/postgresql): a socket there is "localhost" to the password file.
    static let knownSocketDirectories: Set<String> = ["/var/run/postgresql", "/run/postgresql"]

    /// The name of the user dq runs as, from the password database.
    static func systemUserName() -> String? {
        var buffer = [CChar](repeating: 0, count: 4096)
        return buffer.withUnsafeMutableBufferPointer { storage -> String? in
            var entry = passwd()
            var found: UnsafeMutablePointer<passwd>?
            guard let base = storage.baseAddress, getpwuid_r(geteuid(), &entry, base, storage.count, &found) == 0, found != nil,
                let name = entry.pw_name
            else { return nil }
            let text = String(cString: name)
            return text.isEmpty ? nil : text
        }
    }
}

extension PostgresQueueStore: RedactedDescription {
    /// `PostgresQueueStore(postgres://user@host/database)`: the URL without its password, never the client or
    /// its configuration (which hold it).
    var description: String { "PostgresQueueStore(\(displayURL))" }

    /// The URL without its password, whether it is read-only, and its lease.
    package var redactedFields: [RedactedField] {
        [.url("displayURL", displayURL), .plain("readOnly", readOnly), .plain("leaseSeconds", leaseSeconds)]
    }
}
