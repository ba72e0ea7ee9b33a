import Foundation
import Logging
import NIOSSL
import PostgresNIO
import Synchronization

// The database URL and libpq's environment, read into postgres-nio's configuration.
extension PostgresQueueStore {
    /// The client's configuration, the URL without its password, and whether statements may be prepared
    /// (`prepared_statements=off` says no).
    static func configuration(
        url text: String, environment: [String: String]
    ) throws -> (PostgresClient.Configuration, String, Bool, PostgresConnection.Configuration) {
        // What the URL leaves out comes from libpq's environment, as psql would take it: PGHOST, PGPORT, PGUSER,
        // PGPASSWORD (else the password file), PGDATABASE, PGSSLMODE, PGSSLROOTCERT, PGAPPNAME.
        guard let components = URLComponents(string: text), let scheme = components.scheme,
            scheme == "postgres" || scheme == "postgresql",
            let host = components.host.flatMap({ $0.isEmpty ? nil : $0 }) ?? environment["PGHOST"].flatMap({ $0.isEmpty ? nil : $0 })
        else {
            throw DataQueueError(
                .invalidConfiguration, "database URL must be postgres://user@host[:port]/database (or set PGHOST for postgres:///database)")
        }
        guard !host.hasPrefix("/") else {
            throw DataQueueError(.invalidConfiguration, "database host \(host): Unix-socket connections are not supported; use a TCP host")
        }
        let port = components.port ?? environment["PGPORT"].flatMap(Int.init) ?? 5432
        let user = components.percentEncodedUser.flatMap { $0.removingPercentEncoding } ?? environment["PGUSER"] ?? "postgres"
        var database = String(components.path.drop(while: { $0 == "/" })).removingPercentEncoding ?? ""
        if database.isEmpty { database = environment["PGDATABASE"] ?? "" }
        guard !database.isEmpty else {
            throw DataQueueError(.invalidConfiguration, "database URL names no database (postgres://user@host/DATABASE, or PGDATABASE)")
        }
        let password =
            components.percentEncodedPassword.flatMap { $0.removingPercentEncoding } ?? environment["PGPASSWORD"]
            ?? PasswordFile.password(host: host, port: port, database: database, user: user, environment: environment)
        var display = URLComponents()
        display.scheme = scheme
        display.user = user
        display.host = host
        display.port = port == 5432 ? nil : port
        display.path = "/" + database
        let options = Dictionary((components.queryItems ?? []).map { ($0.name, $0.value ?? "") }, uniquingKeysWith: { $1 })
        for name in options.keys
        where !["sslmode", "sslrootcert", "application_name", "connect_timeout", "prepared_statements"].contains(name) {
            throw DataQueueError(.invalidConfiguration, "database URL option \"\(name)\" is not supported")
        }
        let prepared: Bool
        switch options["prepared_statements"] ?? "on" {
        case "on", "true", "1": prepared = true
        case "off", "false", "0": prepared = false
        case let other:
            throw DataQueueError(.invalidConfiguration, "database URL prepared_statements \"\(other)\" is not on or off")
        }
        var tls = TLSConfiguration.makeClientConfiguration()
        if let root = options["sslrootcert"] ?? environment["PGSSLROOTCERT"] {
            guard FileManager.default.isReadableFile(atPath: root) else {
                throw DataQueueError(.invalidConfiguration, "database URL sslrootcert \(root) cannot be read")
            }
            tls.trustRoots = .file(root)
        }
        let mode: PostgresClient.Configuration.TLS
        let required: Bool?  // nil: no TLS
        switch options["sslmode"] ?? environment["PGSSLMODE"] ?? "prefer" {
        case "disable":
            mode = .disable
            required = nil
        case "allow", "prefer":
            tls.certificateVerification = .none  // libpq: encryption if offered, no verification
            mode = .prefer(tls)
            required = false
        case "require":
            tls.certificateVerification = (options["sslrootcert"] ?? environment["PGSSLROOTCERT"]) == nil ? .none : .noHostnameVerification
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
        var configuration = PostgresClient.Configuration(
            host: host, port: port, username: user, password: password, database: database, tls: mode)
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
        var probe = PostgresConnection.Configuration(
            host: host, port: port, username: user, password: password, database: database, tls: probeTLS)
        probe.options.connectTimeout = .seconds(configuration.options.connectTimeout.components.seconds)
        return (configuration, display.string ?? "postgres://\(host)/\(database)", prepared, probe)
    }
}
