import Crypto
import Foundation
import Logging
@_spi(Reflection) import Swift
import Testing

@testable import FHIRDataQueue

/// No value that holds a secret shows it (issue 42): each secret-bearing type, given a marker for every secret,
/// is printed every way Swift prints a value (`String(describing:)`, `String(reflecting:)`, interpolation,
/// `dump(_:)`), and none of the outputs holds a marker.
@Suite("Descriptions redact secrets")
struct RedactionTests {
    /// A marker: a value no description may contain.
    static func marker(_ name: String) -> String {
        "M4RK\(name)" + UUID().uuidString.replacingOccurrences(of: "-", with: "").prefix(12)
    }

    let bearer = marker("bearer")
    let clientSecret = marker("client")
    let header = marker("header")
    let field = marker("field")
    let proxyPassword = marker("proxy")
    let environmentProxyPassword = marker("envproxy")
    let databasePassword = marker("dbpassword")
    let filePassword = marker("filepassword")
    let serverPassword = marker("server")

    var markers: [String] {
        [bearer, clientSecret, header, field, proxyPassword, environmentProxyPassword, databasePassword, filePassword, serverPassword]
    }

    /// Every way Swift prints `value`.
    static func printed(_ value: Any) -> [(String, String)] {
        var dumped = ""
        dump(value, to: &dumped)
        var mirrored = ""
        func walk(_ value: Any, depth: Int) {
            guard depth < 12 else { return }
            for child in Mirror(reflecting: value).children {
                mirrored += "\(child.label ?? "-"): \(String(describing: child.value)) \(String(reflecting: child.value))\n"
                walk(child.value, depth: depth + 1)
            }
        }
        walk(value, depth: 0)
        return [
            ("String(describing:)", String(describing: value)), ("String(reflecting:)", String(reflecting: value)),
            ("interpolation", "\(value)"), ("dump", dumped), ("mirror", mirrored),
        ]
    }

    /// Records an issue for every marker found in any way `value` is printed; returns its description.
    @discardableResult
    func expectRedacted(
        _ value: Any, _ what: String, markers extra: [String] = [], sourceLocation: SourceLocation = #_sourceLocation
    ) -> String {
        for (way, text) in Self.printed(value) {
            for marker in markers + extra where text.contains(marker) {
                Issue.record("\(what), \(way), shows a secret: \(text.prefix(2000))", sourceLocation: sourceLocation)
            }
        }
        return String(describing: value)
    }

    /// Settings with every secret set to a marker.
    func settings() async throws -> DataQueueSettings {
        let json = """
            {"server": "https://fhir.example.org/r4", "database": "postgres://dq:\(databasePassword)@db.example.org/dq?sslmode=require",
             "proxy": "http://dq:\(proxyPassword)@proxy.example.org:3128", "no_proxy": "localhost",
             "auth": {"bearer_token": "\(bearer)", "client_id": "dq-client", "client_secret": "\(clientSecret)",
                      "token_uri": "https://auth.example.org/token",
                      "registration_headers": {"Antispam": "\(header)"},
                      "registration_fields": {"software_statement": "\(field)", "sandbox": true}}}
            """
        var settings = try await DataQueueSettings.decode(
            Data(json.utf8),
            environment: [
                "HTTPS_PROXY": "http://env:\(environmentProxyPassword)@proxy.example.org:3128",
                "HTTP_PROXY": "env:\(environmentProxyPassword)@proxy.example.org:3128",
            ])
        settings.databasePassword = filePassword
        return settings
    }

    @Test("DataQueueSettings and its auth object: every secret redacted, the plain settings shown")
    func settingsRedacted() async throws {
        let settings = try await settings()
        let text = expectRedacted(settings, "DataQueueSettings")
        #expect(text.contains("https://fhir.example.org/r4") && text.contains("dq-client") && text.contains("<redacted>"), "\(text)")
        #expect(text.contains("postgres://dq:***@db.example.org/dq?sslmode=require"), "\(text)")
        #expect(text.contains("http://dq:***@proxy.example.org:3128") && text.contains("env:***@proxy.example.org:3128"), "\(text)")
        #expect(text.contains("Antispam") && text.contains("software_statement"), "the keys are shown: \(text)")
        let auth = expectRedacted(try #require(settings.auth), "DataQueueSettings.Auth")
        #expect(auth.contains("bearerToken: <redacted>") && auth.contains("clientSecret: <redacted>"), "\(auth)")
        expectRedacted(settings.environmentNetwork, "NetworkConfiguration")
        // A URL password in the server, where it is refused, is not shown either.
        var withServerPassword = settings
        withServerPassword.server = "https://user:\(serverPassword)@fhir.example.org/r4"
        expectRedacted(withServerPassword, "DataQueueSettings with a password in its server URL")
        // Unset secrets are shown as unset.
        #expect(!String(describing: DataQueueSettings()).contains("<redacted>"))
    }

    @Test("What the settings resolve to, and the checked values: no secret")
    func resolvedRedacted() async throws {
        var settings = try await settings()
        settings.databasePassword = nil
        let resolved = try settings.resolve()
        let text = expectRedacted(resolved, "DataQueueSettings.Resolved")
        #expect(text.contains("StaticBearerToken") && text.contains("fhir.example.org"), "\(text)")
        expectRedacted(try settings.checkedValues(), "DataQueueSettings.CheckedValues")
        expectRedacted(resolved.configuration, "DataQueue.Configuration")
        expectRedacted(try #require(resolved.authorization), "StaticBearerToken")
    }

    @Test("DataQueue.Configuration and Storage: the PostgreSQL URL's password, proxies and at-rest keys redacted")
    func configurationRedacted() throws {
        let (key, file) = AtRestKey.generate()
        let keyText = String(file.dropFirst(AtRestKey.filePrefix.count).dropLast())
        let keyBytes = try #require(Data(base64Encoded: keyText))
        let keyMarkers = [keyText, keyBytes.hexString]
        var configuration = DataQueue.Configuration(databasePath: "postgres://dq:\(databasePassword)@db.example.org/dq")
        configuration.network.httpsProxy = "http://dq:\(proxyPassword)@proxy.example.org:3128"
        configuration.network.httpProxy = "dq:\(proxyPassword)@proxy.example.org:3128"
        configuration.atRest = AtRestKeys(current: key)
        let text = expectRedacted(configuration, "DataQueue.Configuration", markers: keyMarkers)
        #expect(text.contains("postgres://dq:***@db.example.org/dq") && text.contains(key.id), "\(text)")
        expectRedacted(configuration.storage, "DataQueue.Storage")
        expectRedacted(DataQueue.Storage.postgresURL("postgresql://db.example.org/dq?password=\(databasePassword)"), "Storage")
        expectRedacted(key, "AtRestKey", markers: keyMarkers)
        expectRedacted(AtRestKeys(current: key), "AtRestKeys", markers: keyMarkers)
    }

    @Test("OAuth2 and sign-in configurations, their clients and the signing key: no secret, no key")
    func authRedacted() async throws {
        let privateKey = P256.Signing.PrivateKey()
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-redaction-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let keyFile = directory.appendingPathComponent("key.pem").path
        try Data(privateKey.pemRepresentation.utf8).write(to: URL(fileURLWithPath: keyFile))
        let keyBody = privateKey.pemRepresentation.split(separator: "\n").dropFirst().dropLast().joined()
        let keyMarkers = [String(keyBody.prefix(40)), privateKey.rawRepresentation.hexString]
        let assertionKey = try OAuth2Configuration.ClientAssertionKey(pemFile: keyFile, keyID: "key-1")

        var oauth = OAuth2Configuration(fhirBaseURL: URL(string: "https://fhir.example.org/r4")!)
        oauth.clientID = "dq-client"
        oauth.clientSecret = clientSecret
        oauth.registrationHeaders = ["Antispam": header]
        oauth.registrationFields = ["software_statement": field]
        oauth.network.httpsProxy = "http://dq:\(proxyPassword)@proxy.example.org:3128"
        oauth.assertionKey = assertionKey
        let text = expectRedacted(oauth, "OAuth2Configuration", markers: keyMarkers)
        #expect(text.contains("dq-client") && text.contains("key-1") && text.contains("<redacted>"), "\(text)")
        expectRedacted(assertionKey, "ClientAssertionKey", markers: keyMarkers)
        let client = try OAuth2ClientCredentials(configuration: oauth)
        expectRedacted(client, "OAuth2ClientCredentials", markers: keyMarkers)
        try await client.shutdown()

        var code = AuthorizationCodeClient.Configuration(fhirBaseURL: URL(string: "https://fhir.example.org/r4")!, clientID: "app")
        code.clientSecret = clientSecret
        code.assertionKey = assertionKey
        code.network.httpProxy = "http://dq:\(proxyPassword)@proxy.example.org:3128"
        code.credentialsDirectory = directory.path
        expectRedacted(code, "AuthorizationCodeClient.Configuration", markers: keyMarkers)
        let signIn = AuthorizationCodeClient(configuration: code)
        expectRedacted(signIn, "AuthorizationCodeClient", markers: keyMarkers)
        try await signIn.shutdown()

        let token = StaticBearerToken(bearer)
        #expect(expectRedacted(token, "StaticBearerToken") == "StaticBearerToken(<redacted>)")
    }

    @Test("A queue and the service that delivers it describe themselves by the queue's name")
    func queueAndServiceRedacted() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-redaction-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        var configuration = DataQueue.Configuration(databasePath: directory.appendingPathComponent("queue.sqlite").path)
        configuration.network.httpsProxy = "http://dq:\(proxyPassword)@proxy.example.org:3128"
        let queue = try await DataQueue(
            baseURL: URL(string: "https://fhir.example.org/r4")!, configuration: configuration, authorization: StaticBearerToken(bearer))
        let service = DataQueueService(queues: [queue])
        #expect(expectRedacted(service, "DataQueueService") == "DataQueueService(queue: https://fhir.example.org/r4)")
        #expect(expectRedacted(queue, "DataQueue") == "DataQueue(queue: https://fhir.example.org/r4)")
        try await queue.shutdown()
    }

    @Test("A PostgreSQL store shows its URL without the password, never its client")
    func postgresStoreRedacted() async throws {
        // The pool connects on the first query: none is made.
        let store = try PostgresQueueStore(
            url: "postgres://dq:\(databasePassword)@127.0.0.1:1/dq?sslmode=disable", logger: Logger(label: "test"))
        let text = expectRedacted(store, "PostgresQueueStore")
        #expect(text == "PostgresQueueStore(postgres://dq@127.0.0.1:1/dq)", "\(text)")
        await store.shutdown()
    }

    /// The names of `type`'s stored properties, read from its metadata (not its mirror, which is redacted).
    static func storedProperties(of type: Any.Type) -> [String] {
        var names: [String] = []
        _ = _forEachField(of: type) { name, _, _, _ in
            names.append(String(cString: name))
            return true
        }
        return names
    }

    @Test("Each redacting struct lists every stored property: a new one is shown (or redacted) and compared")
    func everyPropertyListed() async throws {
        let settings = try await settings()
        var oauth = OAuth2Configuration(fhirBaseURL: URL(string: "https://fhir.example.org")!)
        oauth.clientSecret = "s"
        let values: [(Any.Type, any RedactedDescription)] = [
            (DataQueueSettings.self, settings), (DataQueueSettings.Auth.self, try #require(settings.auth)),
            (NetworkConfiguration.self, settings.environmentNetwork), (DataQueue.Configuration.self, DataQueue.Configuration()),
            (OAuth2Configuration.self, oauth),
            (
                AuthorizationCodeClient.Configuration.self,
                AuthorizationCodeClient.Configuration(fhirBaseURL: URL(string: "https://fhir.example.org")!, clientID: "c")
            ),
            (DataQueueSettings.CheckedValues.self, try settings.checkedValues()),
        ]
        for (type, value) in values {
            let stored = Self.storedProperties(of: type)
            #expect(!stored.isEmpty)
            #expect(value.redactedFields.map(\.label) == stored, "\(type): list every stored property, in order")
        }
        var resolvable = settings
        resolvable.databasePassword = nil
        #expect(try resolvable.resolve().redactedFields.map(\.label) == Self.storedProperties(of: DataQueueSettings.Resolved.self))
    }

    @Test("Changed settings are named, secrets among them, and never shown")
    func changesNamed() async throws {
        let old = try await settings()
        #expect(old.changes(since: old).isEmpty)
        var new = old
        new.auth?.bearerToken = Self.marker("rotated")
        #expect(new.changes(since: old) == ["auth.bearer_token"])
        new = old
        new.proxy = "http://dq:\(Self.marker("rotated"))@proxy.example.org:3128"
        new.auth?.registrationHeaders = ["Antispam": "other"]
        new.environmentNetwork.httpsProxy = "http://env:other@proxy.example.org:3128"
        #expect(new.changes(since: old) == ["proxy", "environment_network.https_proxy", "auth.registration_headers"])
        new = old
        new.databasePassword = "other"
        new.retry = DataQueueSettings.Retry()
        new.sourcePath = "/elsewhere/dq.json"
        #expect(new.changes(since: old) == ["database_password", "retry"])
        new = old
        new.auth = nil
        #expect(new.changes(since: old) == ["auth"])
    }

    @Test(
        "URLs are shown without their password",
        arguments: [
            ("http://dq:pw@proxy.example.org:3128", "http://dq:***@proxy.example.org:3128"),
            ("dq:pw@proxy.example.org:3128", "dq:***@proxy.example.org:3128"),
            ("postgres://dq:pw@db/dq?sslmode=disable", "postgres://dq:***@db/dq?sslmode=disable"),
            ("postgres://dq@db/dq?password=pw&sslmode=disable", "postgres://dq@db/dq?password=***&sslmode=disable"),
            ("postgres://dq@db/dq", "postgres://dq@db/dq"), ("https://fhir.example.org/r4", "https://fhir.example.org/r4"),
            ("http://dq:pw@[proxy:3128", "<redacted>"),
        ])
    func urlRedacted(url: String, shown: String) {
        #expect(Redaction.url(url) == shown)
    }
}
