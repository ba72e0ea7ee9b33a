import Configuration
import Foundation
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// The dq.json schema as the library reads it: what an embedding service and the CLI share.
@Suite("Settings file")
struct SettingsTests {
    @Test("A full file decodes and resolves to the queue's configuration")
    func fullFile() async throws {
        let json = #"""
            {"server": "HTTPS://FHIR.example.org:443/r4/", "database": "/tmp/dq-settings-test/q.sqlite",
             "durability": "normal", "idempotent": true, "max_resource_bytes": 1048576, "timeout_seconds": 12,
             "connect_timeout_seconds": 3, "settle_seconds": 0.5,
             "retry": {"initial_seconds": 1, "maximum_seconds": 60, "jitter": 0},
             "auth": {"bearer_token": "t0k3n"}}
            """#
        let resolved = try await DataQueueSettings.decode(Data(json.utf8)).resolve()
        #expect(resolved.server.absoluteString == "HTTPS://FHIR.example.org:443/r4/")
        let configuration = resolved.configuration
        #expect(configuration.databasePath == "/tmp/dq-settings-test/q.sqlite")
        #expect(configuration.durability == .normal && configuration.idempotent == .always)
        #expect(configuration.maximumResourceSize == 1_048_576)
        #expect(configuration.requestTimeout == 12 && configuration.connectTimeout == 3 && configuration.settleDelay == 0.5)
        #expect(configuration.retryPolicy.initialDelay == 1 && configuration.retryPolicy.maximumDelay == 60)
        #expect(resolved.authorization is StaticBearerToken)
        #expect(resolved.encryption == nil)
    }

    @Test("Settings that are a choice or a whole number are typed so, from the file and from the environment")
    func typedFields() async throws {
        let json = #"""
            {"server": "http://127.0.0.1:9/fhir", "durability": "normal", "batch_size": 20.0,
             "batch_max_bytes": 4096, "max_resource_bytes": 65536}
            """#
        var settings = try await DataQueueSettings.decode(Data(json.utf8))
        #expect(settings.durability == .normal)
        #expect(settings.batchSize == 20 && settings.batchMaxBytes == 4096 && settings.maxResourceBytes == 65_536)
        settings = try await DataQueueSettings.decode(
            Data(json.utf8),
            environment: [
                "DQ_DURABILITY": "full", "DQ_BATCH_SIZE": "7",
                "DQ_BATCH_MAX_BYTES": "2048", "DQ_MAX_RESOURCE_BYTES": "128",
            ])
        #expect(settings.durability == .full)
        #expect(settings.batchSize == 7 && settings.batchMaxBytes == 2048 && settings.maxResourceBytes == 128)
        // Set in code, out of range: refused where the file's value would be.
        settings.batchSize = 0
        let range = #expect(throws: DataQueueError.self) { try settings.resolve() }
        #expect(range?.message.contains(#""batch_size" must be a whole number from 1 to"#) == true, "\(range?.message ?? "")")
        for (text, message) in [
            (#"{"batch_size": 2.5}"#, #""batch_size" must be a whole number from 1 to"#),
            (#"{"batch_max_bytes": "big"}"#, #""batch_max_bytes" must be a number"#),
            (#"{"journal_retention_days": "long"}"#, #""journal_retention_days" must be a number of days"#),
            (#"{"durability": "sometimes"}"#, #""durability" must be "full" or "normal""#),
        ] {
            let error = await #expect(throws: DataQueueError.self) { try await DataQueueSettings.decode(Data(text.utf8)) }
            #expect(error?.message.contains(message) == true, "\(text): \(error?.message ?? "")")
        }
        let variable = await #expect(throws: DataQueueError.self) {
            try await DataQueueSettings.decode(Data(json.utf8), environment: ["DQ_BATCH_MAX_BYTES": "4k"])
        }
        #expect(variable?.message.contains("DQ_BATCH_MAX_BYTES must be a whole number") == true)

        let choices = #"""
            {"auth": {"authorize_type": "authorization_code", "token_endpoint_auth_method": "none", "key_alg": "es256"},
             "encryption": {"mode": "authenticated", "in_flight": 3}}
            """#
        var chosen = try await DataQueueSettings.decode(Data(choices.utf8))
        #expect(
            chosen.auth?.authorizeType == .authorizationCode
                && chosen.auth?.tokenEndpointAuthMethod == OAuth2Configuration.TokenEndpointAuthMethod.none)
        #expect(chosen.auth?.keyAlgorithm == .es256 && chosen.encryption?.mode == .authenticated && chosen.encryption?.inFlight == 3)
        chosen = try await DataQueueSettings.decode(
            Data(choices.utf8),
            environment: [
                "DQ_AUTHORIZE_TYPE": "client_credentials", "DQ_TOKEN_ENDPOINT_AUTH_METHOD": "private_key_jwt", "DQ_KEY_ALG": "RS256",
                "DQ_ENCRYPTION_MODE": "c3pro", "DQ_ENCRYPTION_IN_FLIGHT": "2",
            ])
        #expect(chosen.auth?.authorizeType == .clientCredentials && chosen.auth?.tokenEndpointAuthMethod == .privateKeyJWT)
        #expect(chosen.auth?.keyAlgorithm == .rs256 && chosen.encryption?.mode == .c3pro && chosen.encryption?.inFlight == 2)
        for (text, message) in [
            (#"{"auth": {"authorize_type": "password"}}"#, #""auth.authorize_type" must be "client_credentials" or"#),
            (#"{"auth": {"token_endpoint_auth_method": "tls"}}"#, #""auth.token_endpoint_auth_method" must be client_secret_basic"#),
            (#"{"encryption": {"mode": "rot13"}}"#, #""encryption.mode" must be "c3pro" or "authenticated""#),
            (#"{"encryption": {"in_flight": 1.5}}"#, #""encryption.in_flight" must be a whole number from 1 to 64"#),
        ] {
            let error = await #expect(throws: DataQueueError.self) { try await DataQueueSettings.decode(Data(text.utf8)) }
            #expect(error?.message.contains(message) == true, "\(text): \(error?.message ?? "")")
        }
        let mode = await #expect(throws: DataQueueError.self) {
            try await DataQueueSettings.decode(Data(choices.utf8), environment: ["DQ_ENCRYPTION_MODE": "rot13"])
        }
        #expect(mode?.message.contains("DQ_ENCRYPTION_MODE must be") == true, "\(mode?.message ?? "")")
    }

    @Test(
        "Unknown keys and wrong types are named as the file writes them",
        arguments: [
            (#"{"sever": "x"}"#, #"unknown key "sever""#),
            (#"{"retry": {"initial": 1}}"#, #"unknown key "retry.initial""#),
            (#"{"auth": {"token": "x"}}"#, #"unknown key "auth.token""#),
            (#"{"server": 42}"#, #""server" must be a string"#),
            (#"{"retry": {"jitter": "x"}}"#, #""retry.jitter" must be a number"#),
            (#"{"auth": {"registration_fields": {"a": 1}}}"#, #""auth.registration_fields.a" must be a string or a boolean"#),
            (#"{"encryption": []}"#, #""encryption" must be an object"#),
            (
                #"{"server": "http://h/fhir", "auth": {"client_id": "c", "client_secret": "s", "key_alg": "HS256"}}"#,
                #""auth.key_alg" must be RS256, RS384, ES256 or ES384"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"client_id": "c", "client_secret": "s", "key_alg": "RS256"}}"#,
                #""auth.key_alg" is set but "auth.private_key" is not"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"authorize_type": "authorization_code"}}"#,
                #""auth.client_id" is missing (authorization_code"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"authorize_type": "authorization_code", "client_id": "c", "registration_uri": "http://h/r"}}"#,
                #""auth.registration_uri" is for client_credentials"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"authorize_type": "authorization_code", "client_id": "c", "token_endpoint_auth_method": "client_secret_post"}}"#,
                #""auth.client_secret" is missing"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"authorize_type": "authorization_code", "client_id": "c", "issuer": "not a url"}}"#,
                #""auth.issuer" must be an http(s) URL"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"authorize_type": "authorization_code", "client_id": "c", "scope": " "}}"#,
                #""auth.scope" is empty"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"client_id": "c", "client_secret": "s", "issuer": "http://h"}}"#,
                #""auth.issuer" and "auth.revocation_uri" belong to "authorize_type": "authorization_code""#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"client_id": "c", "client_secret": "s", "token_endpoint_auth_method": "none"}}"#,
                #"must be client_secret_basic, client_secret_post or private_key_jwt"#
            ),
            (
                #"{"server": "http://h/fhir", "auth": {"authorize_type": "implicit", "client_id": "c"}}"#,
                #"must be "client_credentials" or "authorization_code", not "implicit""#
            ),
            (#"[1]"#, "is not a JSON object"),
            ("not json", "is not a JSON object"),
        ])
    func namedErrors(json: String, message: String) async throws {
        let error = try await #require(throws: DataQueueError.self) {
            _ = try await DataQueueSettings.decode(Data(json.utf8)).resolve()
        }
        #expect(error.code == .invalidConfiguration)
        #expect(error.message.hasPrefix("configuration: "))
        #expect(error.message.contains(message), "\(error.message)")
    }

    @Test("authorize_type authorization_code makes a public sign-in client with the SMART default scope")
    func authorizationCode() async throws {
        let json =
            #"{"server": "http://h/fhir", "auth": {"authorize_type": "authorization_code", "client_id": "app", "credentials_dir": "/tmp/x"}}"#
        let resolved = try await DataQueueSettings.decode(Data(json.utf8)).resolve()
        let client = try #require(resolved.authorization as? AuthorizationCodeClient)
        #expect(client.configuration.effectiveAuthMethod == .none)
        #expect(client.configuration.scope == "launch/patient openid fhirUser offline_access patient/*.cruds")
        #expect(client.store.path.hasPrefix("/tmp/x/login-"))
        let secret =
            #"{"server": "http://h/fhir", "auth": {"authorize_type": "authorization_code", "client_id": "app", "client_secret": "s"}}"#
        let confidential = try #require(
            try await DataQueueSettings.decode(Data(secret.utf8)).resolve().authorization as? AuthorizationCodeClient)
        #expect(confidential.configuration.effectiveAuthMethod == .clientSecretBasic)
    }

    @Test("DQ_* variables win over the file; a secret from the environment is never in an error")
    func environment() async throws {
        let file = Data(#"{"server":"http://a/fhir","idempotent":true}"#.utf8)
        var settings = try await DataQueueSettings.decode(
            file,
            environment: [
                "DQ_SERVER": "http://b/fhir", "DQ_IDEMPOTENT": "0", "DQ_TOKEN": "env-secret", "DQ_DATABASE": "/tmp/x.sqlite",
            ])
        let resolved = try settings.resolve()
        #expect(resolved.server.absoluteString == "http://b/fhir")
        #expect(resolved.configuration.idempotent == .never)
        #expect(resolved.configuration.databasePath == "/tmp/x.sqlite")
        let error = try await #require(throws: DataQueueError.self) {
            try await DataQueueSettings.decode(file, environment: ["DQ_IDEMPOTENT": "maybe"])
        }
        #expect(error.message.contains("DQ_IDEMPOTENT"))
        settings.timeoutSeconds = .nan
        let bad = try #require(throws: DataQueueError.self) { try settings.resolve() }
        #expect(bad.message.contains("\"timeout_seconds\""))
        #expect(!bad.message.contains("env-secret"))
    }

    @Test("Where dq looks for its config file: ./dq.json, $XDG_CONFIG_HOME (else ~/.config), then /etc/dq/dq.json")
    func searchPath() {
        #expect(
            DataQueueSettings.configSearchPath(environment: ["HOME": "/home/a"])
                == ["dq.json", "/home/a/.config/dq/dq.json", "/etc/dq/dq.json"])
        #expect(
            DataQueueSettings.configSearchPath(environment: ["HOME": "/home/a", "XDG_CONFIG_HOME": "/x"])
                == ["dq.json", "/x/dq/dq.json", "/etc/dq/dq.json"])
        #expect(DataQueueSettings.configSearchPath(environment: [:]) == ["dq.json", "/etc/dq/dq.json"])
    }

    @Test(
        "PostgreSQL as libpq reads it: a host that starts with / is a socket folder (URL, host=, PGHOST), none is /var/run/postgresql; the password's order"
    )
    func postgresConnection() async throws {
        func parse(_ url: String, _ environment: [String: String] = [:]) throws -> (
            socket: String?, host: String?, password: String?, display: String
        ) {
            let (configuration, display, _, _) = try PostgresQueueStore.configuration(
                url: url, environment: environment.merging(["PGPASSFILE": "/nonexistent"]) { $1 })
            return (configuration.unixSocketPath, configuration.host, configuration.password, display)
        }
        let byOption = try parse("postgres://dq@/queue?host=/run/pg&port=6000")
        #expect(byOption.socket == "/run/pg/.s.PGSQL.6000" && byOption.host == nil)
        #expect(byOption.display == "postgres://dq@/queue?host=/run/pg&port=6000", "\(byOption.display)")
        #expect(try parse("postgres://dq@%2Frun%2Fpg/queue").socket == "/run/pg/.s.PGSQL.5432")
        #expect(try parse("postgres:///queue", ["PGHOST": "/run/pg", "PGPORT": "7000"]).socket == "/run/pg/.s.PGSQL.7000")
        #expect(try parse("postgres:///queue").socket == "/var/run/postgresql/.s.PGSQL.5432", "libpq's default: the socket")
        let tcp = try parse("postgres://dq@db.internal:5433/queue", ["PGHOST": "/run/pg"])
        #expect(tcp.socket == nil && tcp.host == "db.internal", "the URL's host over PGHOST")
        #expect(try parse("postgres://dq@db/queue?host=other").host == "other", "host= over the URL's, as libpq")
        #expect(throws: DataQueueError.self) { try parse("postgres://dq@db/queue?port=70000") }
        #expect(throws: DataQueueError.self) { try parse("postgres://dq@db/queue?sslcert=/nonexistent/c.pem&sslkey=/nonexistent/k.pem") }

        // The URL's password, else database_password_file's (put into the URL), else PGPASSWORD.
        #expect(try parse("postgres://dq:in%40url@db/queue", ["PGPASSWORD": "env"]).password == "in@url")
        #expect(try parse("postgres://dq@db/queue", ["PGPASSWORD": "env"]).password == "env")
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-pgpw-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let awkward = "p@ss:w/rd%?#&= é"
        try Data((awkward + "\n").utf8).write(to: directory.appendingPathComponent("pw"))
        var settings = try await DataQueueSettings.decode(
            Data(#"{"server": "http://h/fhir", "database": "postgres://dq@db/queue", "database_password_file": "pw"}"#.utf8))
        settings.baseDirectory = directory.path
        try settings.readSecretFiles(environment: [:])
        try settings.applyDatabasePassword()
        let database = try #require(settings.database)
        #expect(try parse(database, ["PGPASSWORD": "env"]).password == awkward, "every character survives the URL")
        #expect(!QueuePaths.displayDatabase(database).contains("p@ss"), "\(QueuePaths.displayDatabase(database))")
        // An empty PGPASSWORD is unset (libpq): the password file answers.
        let passfile = directory.appendingPathComponent("pgpass").path
        _ = FileManager.default.createFile(
            atPath: passfile, contents: Data("db:5432:queue:dq:from-file\n".utf8), attributes: [.posixPermissions: 0o600])
        let (emptyVariable, _, _, _) = try PostgresQueueStore.configuration(
            url: "postgres://dq@db/queue", environment: ["PGPASSWORD": "", "PGPASSFILE": passfile])
        #expect(emptyVariable.password == "from-file")
        // libpq's default user is the user dq runs as; a key or password file is judged through its symbolic link.
        let (anonymous, _, _, _) = try PostgresQueueStore.configuration(
            url: "postgres://db/queue", environment: ["PGPASSFILE": "/nonexistent"])
        #expect(anonymous.username == PostgresQueueStore.systemUserName(), "\(anonymous.username)")
        let secret = directory.appendingPathComponent("secret").path
        _ = FileManager.default.createFile(atPath: secret, contents: Data("x".utf8), attributes: [.posixPermissions: 0o600])
        try FileManager.default.createSymbolicLink(atPath: directory.appendingPathComponent("link").path, withDestinationPath: secret)
        #expect(FilePermissions.ownerAndMode(directory.appendingPathComponent("link").path)?.mode == 0o600)
        // libpq's default certificate files are not read for a socket or sslmode=disable, and default files that
        // cannot be used are left aside; a certificate named that cannot be used is an error.
        let home = directory.appendingPathComponent("home")
        try FileManager.default.createDirectory(at: home.appendingPathComponent(".postgresql"), withIntermediateDirectories: true)
        try Data("not a certificate".utf8).write(to: home.appendingPathComponent(".postgresql/postgresql.crt"))
        try Data("not a key".utf8).write(to: home.appendingPathComponent(".postgresql/postgresql.key"))
        for url in ["postgres://dq@db/queue?sslmode=disable", "postgres://dq@/queue?host=/run/pg", "postgres://dq@db/queue"] {
            #expect(throws: Never.self, "\(url)") { try parse(url, ["HOME": home.path]) }
        }
        #expect(throws: DataQueueError.self) {
            try parse("postgres://dq@db/queue?sslcert=\(home.path)/.postgresql/postgresql.crt", ["HOME": home.path])
        }

        var both = try await DataQueueSettings.decode(
            Data(#"{"server": "http://h/fhir", "database": "postgres://dq:x@db/queue", "database_password_file": "pw"}"#.utf8))
        both.baseDirectory = directory.path
        try both.readSecretFiles(environment: [:])
        #expect(throws: DataQueueError.self) { try both.applyDatabasePassword() }
    }

    @Test("Every auth and encryption key has its variable: DQ_ and the key (auth), DQ_ENCRYPTION_ and the key (encryption)")
    func everyKeyHasAVariable() async throws {
        let settings = try await DataQueueSettings.decode(
            Data("{}".utf8),
            environment: [
                "DQ_AUTHORIZE_URI": "https://a/authorize", "DQ_AUTHORIZE_TYPE": "client_credentials",
                "DQ_REVOCATION_URI": "https://a/revoke",
                "DQ_REGISTRATION_URI": "https://a/register", "DQ_CLIENT_NAME": "gateway 7",
                "DQ_TOKEN_ENDPOINT_AUTH_METHOD": "private_key_jwt",
                "DQ_PRIVATE_KEY": "/k.pem", "DQ_KEY_ID": "k1", "DQ_KEY_ALG": "ES384", "DQ_CREDENTIALS_DIR": "/creds",
                "DQ_ENCRYPTION_ENDPOINT": "https://r/envelopes", "DQ_ENCRYPTION_CERTIFICATE": "/r.crt", "DQ_ENCRYPTION_KEY_ID": "r1",
                "DQ_ENCRYPTION_MODE": "authenticated", "DQ_ENCRYPTION_FHIR_VERSION": "4.0.1", "DQ_ENCRYPTION_IN_FLIGHT": "4",
                "DQ_ENCRYPTION_RESOURCE_TYPES": "Observation, Patient",
            ])
        let auth = try #require(settings.auth)
        #expect(auth.authorizeURI == "https://a/authorize" && auth.authorizeType == .clientCredentials)
        #expect(auth.revocationURI == "https://a/revoke" && auth.registrationURI == "https://a/register" && auth.clientName == "gateway 7")
        #expect(auth.tokenEndpointAuthMethod == .privateKeyJWT && auth.privateKey == "/k.pem" && auth.keyID == "k1")
        #expect(auth.keyAlgorithm == .es384 && auth.credentialsDirectory == "/creds")
        let encryption = try #require(settings.encryption)
        #expect(encryption.endpoint == "https://r/envelopes" && encryption.certificate == "/r.crt" && encryption.keyID == "r1")
        #expect(encryption.mode == .authenticated && encryption.fhirVersion == "4.0.1" && encryption.inFlight == 4)
        #expect(encryption.resourceTypes == ["Observation", "Patient"])
        let names = [
            "DQ_AUTHORIZE_URI", "DQ_KEY_ALG", "DQ_CREDENTIALS_DIR", "DQ_ENCRYPTION_ENDPOINT", "DQ_ENCRYPTION_RESOURCE_TYPES",
            "DQ_ENCRYPTION_IN_FLIGHT", "DQ_DATABASE_PASSWORD_FILE",
        ]
        #expect(SettingKeys.library.unknownEnvironmentVariables(in: Dictionary(uniqueKeysWithValues: names.map { ($0, "x") })).isEmpty)
        await #expect(throws: DataQueueError.self) {
            try await DataQueueSettings.decode(Data("{}".utf8), environment: ["DQ_ENCRYPTION_IN_FLIGHT": "many"])
        }
    }

    @Test("Relative paths in a file are relative to the file's directory")
    func relativePaths() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-settings-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let file = directory.appendingPathComponent("dq.json")
        try Data(
            #"{"server":"http://a/fhir","encryption":{"endpoint":"http://a/enc","certificate":"missing.pem","key_id":"k"}}"#.utf8
        ).write(to: file)
        let settings = try await DataQueueSettings.load(contentsOf: file.path)
        #expect(settings.baseDirectory == directory.path)
        let error = try #require(throws: DataQueueError.self) { try settings.resolve() }
        #expect(error.message.contains("encryption.certificate"), "\(error.message)")
    }

    @Test(
        "A settings file follows the JSON rules resource files do: a key given twice, at the top or in an object, and a trailing comma are refused, named",
        arguments: [
            (#"{"server": "http://a/fhir", "server": "http://b/fhir"}"#, #""server" appears twice"#),
            (#"{"server": "http://a/fhir", "auth": {"bearer_token": "x", "bearer_token": "y"}}"#, #""auth.bearer_token" appears twice"#),
            (#"{"server": "http://a/fhir",}"#, "not strict JSON"),
            (#"{"server": "http://a/fhir", "retry": {"jitter": 0,}}"#, "not strict JSON"),
        ])
    func strictJSON(file: String, expected: String) async throws {
        let error = await #expect(throws: DataQueueError.self) { try await DataQueueSettings.decode(Data(file.utf8), source: "dq.json") }
        #expect(error?.code == .invalidConfiguration)
        #expect(error?.message.contains(expected) == true, "\(error?.message ?? "")")
        #expect(error?.message.contains("x") == false || !expected.contains("bearer"), "no value in the error")
    }

    @Test("Every number setting, retry, no_proxy, ca_bundle_only and auth's names have a DQ_ variable that wins over the file")
    func environmentForEverySetting() async throws {
        let file =
            #"{"server":"http://a/fhir","timeout_seconds":5,"retry":{"jitter":0.1},"#
            + #""auth":{"client_id":"file-id","token_uri":"http://t/x"}}"#
        let settings = try await DataQueueSettings.decode(
            Data(file.utf8),
            environment: [
                "DQ_MAX_RESOURCE_BYTES": "4096", "DQ_TIMEOUT_SECONDS": "12.5", "DQ_CONNECT_TIMEOUT_SECONDS": "3",
                "DQ_SETTLE_SECONDS": "2", "DQ_BATCH_MAX_BYTES": "65536",
                "DQ_JOURNAL_RETENTION_DAYS": "7",
                "DQ_RETRY_INITIAL_SECONDS": "0.5", "DQ_RETRY_MAXIMUM_SECONDS": "60", "DQ_RETRY_JITTER": "0",
                "DQ_NO_PROXY": "localhost,.internal", "DQ_CA_BUNDLE_ONLY": "false", "DQ_CLIENT_ID": "env-id", "DQ_SCOPE": "system/*.write",
                "DQ_CLIENT_SECRET": "s3cret", "DQ_LEASE_SECONDS": "7",
            ])
        let resolved = try settings.resolve()
        let configuration = resolved.configuration
        #expect(configuration.maximumResourceSize == 4096)
        #expect(configuration.requestTimeout == 12.5 && configuration.connectTimeout == 3 && configuration.settleDelay == 2)
        #expect(configuration.batchMaxBytes == 65536 && configuration.leaseDuration == 7)
        #expect(try settings.journalRetention() == 7 * 86_400)
        #expect(configuration.retryPolicy.initialDelay == 0.5 && configuration.retryPolicy.maximumDelay == 60)
        #expect(configuration.retryPolicy.jitter == 0)
        #expect(configuration.network.noProxy == "localhost,.internal" && !configuration.network.caBundleOnly)
        let client = try #require(resolved.authorization as? OAuth2ClientCredentials)
        #expect(client.configuration.clientID == "env-id" && client.configuration.scope == "system/*.write")
        for name in ["DQ_TIMEOUT_SECONDS", "DQ_RETRY_JITTER", "DQ_CA_BUNDLE_ONLY"] {
            let error = try await #require(throws: DataQueueError.self) {
                try await DataQueueSettings.decode(Data(file.utf8), environment: [name: "soon"])
            }
            #expect(error.message.contains(name), "\(error.message)")
        }
        #expect(SettingKeys.library.unknownEnvironmentVariables(in: ["DQ_RETRY_JITTER": "0", "DQ_NO_PROXY": ""]).isEmpty)
    }

    @Test("A bad DQ_DURABILITY or DQ_BATCH_SIZE is named by the variable, not the file's key")
    func environmentNamed() async throws {
        func read(_ environment: [String: String]) async throws {
            _ = try await DataQueueSettings.decode(Data("{}".utf8), environment: environment)
        }
        let durability = await #expect(throws: DataQueueError.self) { try await read(["DQ_DURABILITY": "bogus"]) }
        #expect(durability?.message.contains("DQ_DURABILITY") == true, "\(durability?.message ?? "")")
        let batch = await #expect(throws: DataQueueError.self) { try await read(["DQ_BATCH_SIZE": "0"]) }
        #expect(batch?.message.contains("DQ_BATCH_SIZE") == true, "\(batch?.message ?? "")")
    }

    @Test(
        "Every DQ_ variable the library's sources read is a known name, and an unknown one is reported with the name it likely meant, of the library's keys and of those a command adds"
    )
    func unknownEnvironmentVariables() async throws {
        // The list must follow the code: a variable read but not listed would be warned about as unknown (the dq
        // command's own variables: CLIHardeningTests.daemonKeys).
        let sources = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../../Sources")
        var read = Set<String>()
        let files = try #require(FileManager.default.enumerator(atPath: sources.path)).compactMap { $0 as? String }
        for file in files where file.hasSuffix(".swift") && !file.hasPrefix("dq/") {
            let text = try String(contentsOf: sources.appendingPathComponent(file), encoding: .utf8)
            let regex = try NSRegularExpression(pattern: "\"(DQ_[A-Z_]+)\"")
            for match in regex.matches(in: text, range: NSRange(text.startIndex..., in: text)) {
                read.insert(String(text[Range(match.range(at: 1), in: text)!]))
            }
        }
        #expect(read.count >= 12, "the scan found the variables: \(read.sorted())")
        let unlisted = read.subtracting(SettingKeys.library.environmentVariables).subtracting(SettingKey.toolingVariables)
        #expect(unlisted.subtracting(["DQ_TEST_"]).isEmpty, "\(unlisted)")
        let environment = [
            "DQ_SEVER": "x", "DQ_SERVER": "y", "DQ_FROBNICATE": "z", "PATH": "/bin", "DQ_LOG_LEVL": "debug",
            "DQ_BIN": "/x/dq", "DQ_TEST_FHIR_BASE": "http://t", "DQ_LOG_LEVEL": "info",
        ]
        let unknown = SettingKeys.library.unknownEnvironmentVariables(in: environment)
        #expect(unknown.map(\.name) == ["DQ_FROBNICATE", "DQ_LOG_LEVEL", "DQ_LOG_LEVL", "DQ_SEVER"])
        #expect(unknown.map(\.suggestion) == [nil, nil, nil, "DQ_SERVER"], "the library has no log keys")
        // A command's table: its own variables are known, and a misspelling of one gets its suggestion.
        let command = SettingKeys.library.adding([SettingKey("log_level", "DQ_LOG_LEVEL")])
        let unknownToCommand = command.unknownEnvironmentVariables(in: environment)
        #expect(unknownToCommand.map(\.name) == ["DQ_FROBNICATE", "DQ_LOG_LEVL", "DQ_SEVER"])
        #expect(unknownToCommand.map(\.suggestion) == [nil, "DQ_LOG_LEVEL", "DQ_SERVER"])
    }

    @Test("auth.client_secret_file: read from $CREDENTIALS_DIRECTORY (a relative name), without its newline; not a secret in the file")
    func clientSecretFile() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-creds-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        try Data("s3cret+/=\n".utf8).write(to: directory.appendingPathComponent("client-secret"))
        chmod(directory.appendingPathComponent("client-secret").path, 0o600)
        let config = directory.appendingPathComponent("dq.json").path
        try Data(#"{"auth": {"client_id": "c", "client_secret_file": "client-secret"}}"#.utf8).write(to: URL(fileURLWithPath: config))
        var settings = try await DataQueueSettings.load(config: config, flags: ["server": .string("http://h/fhir")], environment: [:])
        #expect(settings.auth?.clientSecret == "s3cret+/=", "beside the config file when no credentials directory is set")
        #expect(!settings.fileHoldsSecret && settings.exposedSecretFiles.isEmpty)
        let elsewhere = directory.appendingPathComponent("systemd")
        try FileManager.default.createDirectory(at: elsewhere, withIntermediateDirectories: true)
        try Data("from-systemd".utf8).write(to: elsewhere.appendingPathComponent("client-secret"))
        settings = try await DataQueueSettings.load(
            config: config, flags: ["server": .string("http://h/fhir")], environment: ["CREDENTIALS_DIRECTORY": elsewhere.path])
        #expect(settings.auth?.clientSecret == "from-systemd")
        try Data("from-windows\r\n".utf8).write(to: elsewhere.appendingPathComponent("client-secret"))
        settings = try await DataQueueSettings.load(
            config: config, flags: ["server": .string("http://h/fhir")], environment: ["CREDENTIALS_DIRECTORY": elsewhere.path])
        #expect(settings.auth?.clientSecret == "from-windows", "a CRLF line end (one Character in Swift) is dropped too")
        // A credential mounted as a link is judged by the file it names (a link's own mode is 0777).
        try FileManager.default.moveItem(
            at: elsewhere.appendingPathComponent("client-secret"), to: directory.appendingPathComponent("store"))
        chmod(directory.appendingPathComponent("store").path, 0o600)
        try FileManager.default.createSymbolicLink(
            at: elsewhere.appendingPathComponent("client-secret"), withDestinationURL: directory.appendingPathComponent("store"))
        settings = try await DataQueueSettings.load(
            config: config, flags: ["server": .string("http://h/fhir")], environment: ["CREDENTIALS_DIRECTORY": elsewhere.path])
        #expect(settings.auth?.clientSecret == "from-windows" && settings.exposedSecretFiles.isEmpty, "\(settings.exposedSecretFiles)")
        chmod(directory.appendingPathComponent("store").path, 0o644)
        settings = try await DataQueueSettings.load(
            config: config, flags: ["server": .string("http://h/fhir")], environment: ["CREDENTIALS_DIRECTORY": elsewhere.path])
        #expect(settings.exposedSecretFiles == [elsewhere.appendingPathComponent("client-secret").path])
        let error = await #expect(throws: DataQueueError.self) {
            try await DataQueueSettings.load(
                config: config, flags: ["server": .string("http://h/fhir")], environment: ["CREDENTIALS_DIRECTORY": "/nonexistent"])
        }
        #expect(error?.code == .invalidConfiguration && error?.message.contains("auth.client_secret_file") == true)
    }

    @Test(
        "proxy_file and the DQ_…_FILE variables: the file is read (the environment's name over the file's secret), proxy and proxy_file exclude each other"
    )
    func secretFilesFromEnvironment() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-creds-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        for (name, text) in [("proxy-url", "http://user:pr0xy-pass@proxy.example:3128\n"), ("token", "env-file-token\n")] {
            try Data(text.utf8).write(to: directory.appendingPathComponent(name))
            chmod(directory.appendingPathComponent(name).path, 0o600)
        }
        let config = directory.appendingPathComponent("dq.json").path
        try Data(#"{"proxy_file": "proxy-url", "auth": {"bearer_token": "file-token"}}"#.utf8).write(to: URL(fileURLWithPath: config))
        func load(_ environment: [String: String]) async throws -> DataQueueSettings {
            try await DataQueueSettings.load(config: config, flags: ["server": .string("http://h/fhir")], environment: environment)
        }
        var settings = try await load([:])
        #expect(settings.proxy == "http://user:pr0xy-pass@proxy.example:3128", "read beside the config file, without its newline")
        #expect(settings.auth?.bearerToken == "file-token")
        settings = try await load(["DQ_BEARER_TOKEN_FILE": directory.appendingPathComponent("token").path, "DQ_PROXY": "http://other:8080"])
        #expect(settings.auth?.bearerToken == "env-file-token", "the variable's file over the config file's token")
        #expect(settings.proxy == "http://other:8080", "DQ_PROXY over the config file's proxy_file")
        let resolved = try settings.resolve()
        #expect(resolved.configuration.network.proxy(for: URL(string: "https://h/fhir")!) == "http://other:8080")

        try Data(#"{"proxy": "http://a:1", "proxy_file": "proxy-url"}"#.utf8).write(to: URL(fileURLWithPath: config))
        let both = await #expect(throws: DataQueueError.self) { try await load([:]) }
        #expect(both?.message.contains("proxy_file") == true, "\(both?.message ?? "")")
        try Data(#"{"proxy_file": "missing"}"#.utf8).write(to: URL(fileURLWithPath: config))
        let missing = await #expect(throws: DataQueueError.self) { try await load([:]) }
        #expect(missing?.message.contains("\"proxy_file\"") == true && missing?.message.contains("pr0xy") == false)
    }

    @Test("DataQueue.Configuration(reader:) and the auth configurations read dq.json's keys from any ConfigReader")
    func configurationFromReader() async throws {
        let memory = InMemoryProvider(values: [
            "database": "/tmp/dq-reader/q.sqlite", "durability": "normal", "timeout_seconds": 12.5, "batch_size": 20.0,
            "retry.jitter": 0.0, "extra_resource_types": .init(.stringArray(["Device"]), isSecret: false),
            "idempotent": .init(.bool(false), isSecret: false), "no_proxy": "localhost",
        ])
        let configuration = try await DataQueue.Configuration(reader: ConfigReader(provider: memory))
        #expect(configuration.databasePath == "/tmp/dq-reader/q.sqlite" && configuration.durability == .normal)
        #expect(configuration.requestTimeout == 12.5 && configuration.batchSize == 20 && configuration.retryPolicy.jitter == 0)
        #expect(configuration.idempotent == .never && configuration.network.noProxy == "localhost")
        if case .r4(let adding) = configuration.resourceTypes {
            #expect(adding == ["Device"])
        } else {
            Issue.record("\(configuration.resourceTypes)")
        }

        // The same keys under a host's prefix, from a JSON file; a value of the wrong type is named by its key.
        let file = try SettingsFile(
            data: Data(#"{"server": "https://h/fhir", "settle_seconds": 2, "auth": {"client_id": "c", "client_secret": "s"}}"#.utf8),
            source: "host.json")
        let reader = ConfigReader(provider: file)
        #expect(try await DataQueue.Configuration(reader: reader).settleDelay == 2)
        let oauth = try await OAuth2Configuration(reader: reader)
        #expect(oauth.clientID == "c" && oauth.clientSecret == "s" && oauth.fhirBaseURL.absoluteString == "https://h/fhir")
        let scoped = ConfigReader(provider: InMemoryProvider(values: ["dq.lease_seconds": "soon"])).scoped(to: "dq")
        let error = await #expect(throws: DataQueueError.self) { try await DataQueue.Configuration(reader: scoped) }
        #expect(error?.message == #"configuration: "lease_seconds" must be a number"#, "\(error?.message ?? "")")
        let signIn = ConfigReader(provider: InMemoryProvider(values: ["server": "https://h/fhir", "auth.client_id": "app"]))
        #expect(try await AuthorizationCodeClient.Configuration(reader: signIn).clientID == "app")
    }

    @Test("dq's reader: a flag over its DQ_ variable over the file, each value's origin reported by the reader")
    func precedenceThroughTheReader() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-reader-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let config = directory.appendingPathComponent("dq.json").path
        try Data(#"{"server": "http://file/fhir", "timeout_seconds": 5, "settle_seconds": 1, "retry": {"jitter": 0.5}}"#.utf8)
            .write(to: URL(fileURLWithPath: config))
        let recorder = OriginRecorder()
        let settings = try await DataQueueSettings.load(
            config: config, flags: ["server": .string("http://flag/fhir")],
            environment: ["DQ_SERVER": "http://env/fhir", "DQ_TIMEOUT_SECONDS": "7", "DQ_SETTLE_SECONDS": "3"], accessReporter: recorder)
        #expect(settings.server == "http://flag/fhir" && settings.timeoutSeconds == 7 && settings.settleSeconds == 3)
        #expect(settings.retry?.jitter == 0.5 && settings.connectTimeoutSeconds == nil)
        // Where each value came from is what the reader reported (nothing is reported when it is bypassed).
        #expect(recorder.origin(of: "server")?.provider == SettingsReader.flagsName)
        #expect(
            recorder.origin(of: "timeout_seconds").map { [$0.provider, $0.encodedKey] } == [
                SettingsReader.environmentName, "DQ_TIMEOUT_SECONDS",
            ])
        #expect(recorder.origin(of: "retry.jitter").map { [$0.provider, $0.encodedKey] } == [SettingsReader.fileName, "retry.jitter"])
        #expect(recorder.origin(of: "connect_timeout_seconds") == nil)
        // A secret is read as one: an access logger redacts it.
        let secrets = SecretsSeen()
        let reader = SettingsReader.make(
            environment: ["DQ_TOKEN": "t0k3n", "DQ_CLIENT_ID": "c"], file: nil, accessReporter: secrets)
        _ = try await DataQueueSettings(reader: reader)
        #expect(secrets.secret["auth.bearer_token"] == true && secrets.secret["auth.client_id"] == false, "\(secrets.secret)")
    }

    @Test(
        "An unknown key is refused through the file's provider, with the key it likely meant",
        arguments: [
            (#"{"sever": "x"}"#, #"unknown key "sever" (did you mean "server"?)"#),
            (#"{"retry": {"jiter": 1}}"#, #"unknown key "retry.jiter" (did you mean "retry.jitter"?)"#),
            (#"{"frobnicate": 1}"#, #"unknown key "frobnicate""#),
        ])
    func unknownKeySuggestion(json: String, message: String) async throws {
        let error = #expect(throws: DataQueueError.self) { try SettingsFile(data: Data(json.utf8), source: "dq.json") }
        #expect(error?.message.hasSuffix(message) == true, "\(error?.message ?? "")")
    }

    @Test(
        "A command adds its keys to the library's table: they are read through the same reader with their origin, a misspelling of one gets its suggestion, the library alone refuses them; an object the command reads itself is only checked to be one"
    )
    func commandKeys() async throws {
        let command = SettingKeys.library.adding([SettingKey("log_level", "DQ_LOG_LEVEL")], objects: ["serve"])
        let file = try SettingsFile(
            data: Data(#"{"log_level": "info", "timeout_seconds": 5, "serve": {"listen": "8080"}}"#.utf8), source: "dq.json", keys: command)
        let recorder = OriginRecorder()
        var read = DataQueueSettings.Read(
            reader: SettingsReader.make(environment: [:], file: file, keys: command, accessReporter: recorder), keys: command)
        #expect(try await read.text("log_level") == "info")
        #expect(recorder.origin(of: "log_level").map { [$0.provider, $0.encodedKey] } == [SettingsReader.fileName, "log_level"])
        read = DataQueueSettings.Read(
            reader: SettingsReader.make(environment: ["DQ_LOG_LEVEL": "debug"], file: file, keys: command, accessReporter: recorder),
            keys: command)
        #expect(try await read.text("log_level") == "debug")
        let reader = SettingsReader.make(environment: ["DQ_LOG_LEVEL": "debug"], file: file, keys: command)
        #expect(try await DataQueueSettings(reader: reader).timeoutSeconds == 5, "the library's keys from the same reader")

        for (json, keys, message) in [
            (#"{"log_levl": "info"}"#, command, #"unknown key "log_levl" (did you mean "log_level"?)"#),
            (#"{"log_level": "info"}"#, SettingKeys.library, #"unknown key "log_level""#),
            (#"{"serve": {"listen": "8080"}}"#, SettingKeys.library, #"unknown key "serve" (did you mean "server"?)"#),
            (#"{"serve": 8080}"#, command, #""serve" must be an object"#),
        ] {
            let error = #expect(throws: DataQueueError.self) { try SettingsFile(data: Data(json.utf8), source: "dq.json", keys: keys) }
            #expect(error?.message.hasSuffix(message) == true, "\(json): \(error?.message ?? "")")
        }
        let choice = SettingKeys.library.adding([
            SettingKey("log_level", "DQ_LOG_LEVEL", .choice(["info", "debug"], "must be info or debug"))
        ])
        let variable = await #expect(throws: DataQueueError.self) {
            try await DataQueueSettings.Read(
                reader: SettingsReader.make(environment: ["DQ_LOG_LEVEL": "loud"], file: nil, keys: choice), keys: choice
            ).text("log_level")
        }
        #expect(variable?.message == "configuration: DQ_LOG_LEVEL must be info or debug", "\(variable?.message ?? "")")
    }

    @Test("The default database: $STATE_DIRECTORY (systemd), else $XDG_DATA_HOME, else ~/.local/share")
    func defaultDatabase() {
        #expect(
            QueuePaths.defaultDatabasePath(environment: ["STATE_DIRECTORY": "/var/lib/dq:/var/lib/other", "HOME": "/h"])
                == "/var/lib/dq/queue.sqlite")
        #expect(QueuePaths.defaultDatabasePath(environment: ["XDG_DATA_HOME": "/x", "HOME": "/h"]) == "/x/dq/queue.sqlite")
        #expect(QueuePaths.defaultDatabasePath(environment: ["HOME": "/h"]) == "/h/.local/share/dq/queue.sqlite")
    }
}

/// Which keys were read as secrets.
private final class SecretsSeen: AccessReporter, Sendable {
    private let seen = NIOLockedValueBox<[String: Bool]>([:])
    var secret: [String: Bool] { seen.withLockedValue { $0 } }
    func report(_ event: AccessEvent) {
        if case .success(let value?) = event.result { seen.withLockedValue { $0[event.metadata.key.description] = value.isSecret } }
    }
}
