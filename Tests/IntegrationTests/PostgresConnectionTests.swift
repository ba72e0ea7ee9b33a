import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// PostgreSQL reached the ways libpq's users reach it: a server that logs clients in by their TLS
/// certificate, the server's Unix socket, and the password from a file systemd hands over. A private server
/// (scripts/postgres.sh, with TLS on) so that the shared one keeps answering without TLS.
@Suite("PostgreSQL as libpq connects to it", .enabled(if: Peers.enabled))
struct PostgresConnectionTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    /// A private PostgreSQL server with TLS on: a TLS login needs a client certificate the test CA signed
    /// (pg_hba's `cert` method, the CN the role); without TLS, the role's password (TCP or the socket in
    /// `directory`).
    final class TLSServer: @unchecked Sendable {
        let directory: String
        let port = Peers.freePort()
        let password: String
        let ca: String
        let client: (cert: String, key: String)
        private let script = Peers.packageRoot.appendingPathComponent("scripts/postgres.sh").path

        init(in work: TemporaryDirectory) async throws {
            // Under root the server runs as `nobody`. Its folder here is one nobody cannot traverse (as a clone in
            // `mktemp -d` or a 0700 home folder is): the script keeps the cluster where nobody can reach it.
            directory = work.file("pg")
            let tls = work.file("pg-tls")
            try FileManager.default.createDirectory(atPath: tls, withIntermediateDirectories: true)
            chmod(work.path, 0o700)
            func openssl(_ arguments: [String]) async throws {
                let result = try await ChildProcess("/usr/bin/openssl", arguments).wait()
                try #require(result.status == 0, "openssl \(arguments.first ?? ""): \(result.stderr.suffix(400))")
            }
            let ca = tls + "/ca.pem"
            try await openssl([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", tls + "/ca.key", "-out", ca, "-days", "2", "-subj",
                "/CN=dq test PostgreSQL CA",
            ])
            func signed(_ name: String, subject: String, extensions: String) async throws -> (cert: String, key: String) {
                let (cert, key, request, ext) = (tls + "/\(name).pem", tls + "/\(name).key", tls + "/\(name).csr", tls + "/\(name).ext")
                try Data(extensions.utf8).write(to: URL(fileURLWithPath: ext))
                try await openssl(["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", subject])
                try await openssl([
                    "x509", "-req", "-in", request, "-CA", ca, "-CAkey", tls + "/ca.key", "-CAcreateserial", "-out", cert, "-days", "2",
                    "-extfile", ext,
                ])
                chmod(key, 0o600)
                return (cert, key)
            }
            _ = try await signed("server", subject: "/CN=localhost", extensions: "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
            client = try await signed("client", subject: "/CN=dq", extensions: "extendedKeyUsage=clientAuth\n")
            self.ca = ca
            let started = try await ChildProcess(script, ["start", directory, String(port), tls]).wait(timeout: .seconds(180))
            try #require(started.status == 0, "the private PostgreSQL did not start: \(started.stderr.suffix(600))")
            password = try String(contentsOfFile: directory + "/password", encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
            if getuid() == 0 {
                let link = try? FileManager.default.destinationOfSymbolicLink(atPath: directory)
                #expect(link?.hasPrefix("/var/tmp/dq-postgres/") == true, "the cluster's folder: \(link ?? "not a link")")
            }
        }

        /// Stops the server and removes its files (and the folder its directory links to).
        func stop() async {
            _ = try? await ChildProcess(script, ["remove", directory]).wait(timeout: .seconds(120))
        }
    }

    /// No password from the test machine's own password file; an empty value leaves the variable out.
    func environment(_ database: String, _ extra: [String: String] = [:]) -> [String: String] {
        [
            "DQ_SERVER": "http://127.0.0.1:9/fhir", "DQ_DATABASE": database, "HOME": work.path, "PGPASSFILE": work.file("none"),
        ].merging(extra) { $1 }.filter { !$0.value.isEmpty }
    }

    func pending(_ result: ProcessResult) -> Int? {
        guard result.status == 0, let object = try? JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any]
        else { return nil }
        return object["pending"] as? Int
    }

    @Test(
        "A server that logs clients in by certificate: sslcert and sslkey (in the URL, or PGSSLCERT and PGSSLKEY) with verify-full; without them the login is refused (77); a key others can read is refused (78)"
    )
    func clientCertificate() async throws {
        let server = try await TLSServer(in: work)
        do {
            let base = "postgres://dq@127.0.0.1:\(server.port)/dq"
            let url = base + "?sslmode=verify-full&sslrootcert=\(server.ca)&sslcert=\(server.client.cert)&sslkey=\(server.client.key)"
            let file = try work.write("o.json", resources.observation(0))
            let queued = try await dq(["enqueue", file], environment(url))
            #expect(queued.status == 0, "\(queued.stderr)")
            let status = try await dq(["status", "--json"], environment(url))
            #expect(pending(status) == 1, "\(status.stdout)\(status.stderr)")

            // libpq's variables instead of the URL's options.
            let byEnvironment = try await dq(
                ["status", "--json"],
                environment(
                    base,
                    [
                        "PGSSLMODE": "verify-full", "PGSSLROOTCERT": server.ca, "PGSSLCERT": server.client.cert,
                        "PGSSLKEY": server.client.key,
                    ]))
            #expect(pending(byEnvironment) == 1, "\(byEnvironment.stdout)\(byEnvironment.stderr)")

            // Without the certificate the same TLS login is refused: the certificate is what logged in.
            let refused = try await dq(["status"], environment(base + "?sslmode=require"))
            #expect(refused.status == 77, "\(refused.stderr)")

            // verify-full checks the server against the CA given: a server certificate another CA signed fails.
            let otherCA = work.file("other-ca.pem")
            let made = try await ChildProcess(
                "/usr/bin/openssl",
                [
                    "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", work.file("other-ca.key"), "-out", otherCA, "-days", "2",
                    "-subj", "/CN=another CA",
                ]
            ).wait()
            try #require(made.status == 0)
            let untrusted = try await dq(
                ["status"],
                environment(
                    base + "?sslmode=verify-full&sslrootcert=\(otherCA)&sslcert=\(server.client.cert)&sslkey=\(server.client.key)"))
            #expect(untrusted.status != 0, "a server certificate of another CA was accepted: \(untrusted.stdout)")

            chmod(server.client.key, 0o644)
            let exposed = try await dq(["status"], environment(url))
            #expect(exposed.status == 78 && exposed.stderr.contains("can be read by others"), "\(exposed.stderr)")
            chmod(server.client.key, 0o600)

            // libpq's default files in ~/.postgresql: root.crt is the CA verify-full checks against (not the system's
            // CAs), postgresql.crt and .key the client certificate. Last: with them in place every TLS login above
            // would present the certificate.
            let defaults = work.file(".postgresql")
            try FileManager.default.createDirectory(atPath: defaults, withIntermediateDirectories: true)
            for (from, to) in [(server.ca, "root.crt"), (server.client.cert, "postgresql.crt"), (server.client.key, "postgresql.key")] {
                try FileManager.default.copyItem(atPath: from, toPath: defaults + "/" + to)
                chmod(defaults + "/" + to, 0o600)
            }
            let byDefaults = try await dq(["status", "--json"], environment(base + "?sslmode=verify-full"))
            #expect(pending(byDefaults) == 1, "\(byDefaults.stdout)\(byDefaults.stderr)")
            try FileManager.default.removeItem(atPath: defaults)
        } catch {
            await server.stop()
            throw error
        }
        await server.stop()
    }

    @Test(
        "The server's Unix socket (host=DIR, and PGHOST=DIR), with the password from database_password_file in $CREDENTIALS_DIRECTORY or PGPASSFILE; PGAPPNAME names the connections; a wrong password is refused (77); dq config names the file, never the password"
    )
    func socketAndPasswordFile() async throws {
        let server = try await TLSServer(in: work)
        do {
            let credentials = work.file("credentials")
            try FileManager.default.createDirectory(atPath: credentials, withIntermediateDirectories: true)
            _ = FileManager.default.createFile(
                atPath: credentials + "/pg-password", contents: Data((server.password + "\n").utf8), attributes: [.posixPermissions: 0o600])
            // No TCP host anywhere: the socket in the server's folder is the only way in.
            let socketURL = "postgres://dq@/dq?host=\(server.directory)&port=\(server.port)"
            let config = try work.write(
                "dq.json", #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(socketURL)", "database_password_file": "pg-password"}"#)
            let env = environment("", ["DQ_CONFIG": config, "CREDENTIALS_DIRECTORY": credentials])
            let file = try work.write("o.json", resources.observation(1))
            let queued = try await dq(["enqueue", file], env)
            #expect(queued.status == 0, "\(queued.stderr)")
            let status = try await dq(["status", "--json"], env)
            #expect(pending(status) == 1, "\(status.stdout)\(status.stderr)")

            let shown = try await dq(["config"], env)
            #expect(shown.status == 0, "\(shown.stderr)")
            #expect(shown.stdout.contains("database_password_file") && shown.stdout.contains("pg-password"), "\(shown.stdout)")
            #expect(!shown.stdout.contains(server.password) && !shown.stderr.contains(server.password))
            #expect(!status.stdout.contains(server.password) && !status.stderr.contains(server.password))

            // The same through libpq's variables: PGHOST a folder, PGPORT, and the variable form of the file.
            let byVariables = try await dq(
                ["status", "--json"],
                environment(
                    "postgres:///dq",
                    [
                        "PGHOST": server.directory, "PGPORT": String(server.port), "PGUSER": "dq",
                        "DQ_DATABASE_PASSWORD_FILE": credentials + "/pg-password",
                    ]))
            #expect(pending(byVariables) == 1, "\(byVariables.stdout)\(byVariables.stderr)")

            // libpq's password file named by PGPASSFILE, its host field the socket's folder (as libpq matches a
            // socket outside the usual folders); PGAPPNAME names the connections, as pg_stat_activity shows.
            let passfile = work.file("pgpass")
            _ = FileManager.default.createFile(
                atPath: passfile, contents: Data("\(server.directory):\(server.port):dq:dq:\(server.password)\n".utf8),
                attributes: [.posixPermissions: 0o600])
            let application = "dq-test-\(UUID().uuidString.prefix(6))"
            let libpq = environment(
                "postgres:///dq",
                [
                    "PGHOST": server.directory, "PGPORT": String(server.port), "PGUSER": "dq", "PGPASSFILE": passfile,
                    "PGAPPNAME": application, "DQ_SERVER": "http://127.0.0.1:9/fhir",
                ])
            let byPassfile = try await dq(["status", "--json"], libpq)
            #expect(pending(byPassfile) == 1, "\(byPassfile.stdout)\(byPassfile.stderr)")
            let run = try ChildProcess(Peers.dqBinary, ["run", "--poll-interval", "0.2"], environment: libpq)
            let named = try await eventually {
                let sessions = try await ChildProcess(
                    "/usr/bin/psql",
                    [
                        "-h", "127.0.0.1", "-p", String(server.port), "-U", "dq", "-d", "dq", "-tAc",
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = '\(application)'",
                    ],
                    environment: ["PGPASSWORD": server.password, "PGSSLMODE": "disable", "PATH": "/usr/bin:/bin"]
                ).wait()
                return (Int(sessions.stdout.trimmingCharacters(in: .whitespacesAndNewlines)) ?? 0) > 0
            }
            #expect(named, "dq run's connections carry PGAPPNAME")
            // SIGTERM once the service group runs (its first flush has run and failed: the server is port 9), so
            // that the stop is a running round's.
            let log = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
            #expect(try await eventually { log().contains("delivery stopped") }, "\(log())")
            run.kill(SIGTERM)
            let stopped = await run.wait(timeout: .seconds(30))
            #expect(stopped.status == 0, "dq run exited \(stopped.status): \(stopped.stderr)")

            _ = FileManager.default.createFile(
                atPath: credentials + "/pg-password", contents: Data("not-the-password\n".utf8), attributes: [.posixPermissions: 0o600])
            let wrong = try await dq(["status"], env)
            #expect(wrong.status == 77, "\(wrong.stderr)")
            #expect(!wrong.stderr.contains("not-the-password"))

            // A password file beside a database that is no PostgreSQL URL is not used, and dq says so.
            let sqlite = try await dq(
                ["enqueue", file], environment(work.file("q.sqlite"), ["DQ_DATABASE_PASSWORD_FILE": credentials + "/pg-password"]))
            #expect(
                sqlite.status == 0 && sqlite.stderr.contains("warning: \"database_password_file\" is set but \"database\" is not"),
                "\(sqlite.stderr)")
        } catch {
            await server.stop()
            throw error
        }
        await server.stop()
    }
}
