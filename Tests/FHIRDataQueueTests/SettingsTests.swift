import Foundation
import Testing

@testable import FHIRDataQueue

/// The dq.json schema as the library reads it: what an embedding service and the CLI share.
@Suite("Settings file")
struct SettingsTests {
    @Test("A full file decodes and resolves to the queue's configuration")
    func fullFile() throws {
        let json = #"""
            {"server": "HTTPS://FHIR.example.org:443/r4/", "database": "/tmp/dq-settings-test/q.sqlite",
             "durability": "normal", "idempotent": true, "max_resource_bytes": 1048576, "timeout_seconds": 12,
             "connect_timeout_seconds": 3, "settle_seconds": 0.5,
             "retry": {"initial_seconds": 1, "maximum_seconds": 60, "jitter": 0},
             "auth": {"bearer_token": "t0k3n"}}
            """#
        let resolved = try DataQueueSettings.decode(Data(json.utf8)).resolve()
        #expect(resolved.server.absoluteString == "HTTPS://FHIR.example.org:443/r4/")
        let configuration = resolved.configuration
        #expect(configuration.databasePath == "/tmp/dq-settings-test/q.sqlite")
        #expect(configuration.durability == .normal && configuration.idempotent)
        #expect(configuration.maximumResourceSize == 1_048_576)
        #expect(configuration.requestTimeout == 12 && configuration.connectTimeout == 3 && configuration.settleDelay == 0.5)
        #expect(configuration.retryPolicy.initialDelay == 1 && configuration.retryPolicy.maximumDelay == 60)
        #expect(resolved.authorization is StaticBearerToken)
        #expect(resolved.encryption == nil)
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
            (#"[1]"#, "is not a JSON object"),
            ("not json", "is not a JSON object"),
        ])
    func namedErrors(json: String, message: String) throws {
        let error = try #require(throws: DataQueueError.self) {
            _ = try DataQueueSettings.decode(Data(json.utf8)).resolve()
        }
        #expect(error.code == .invalidConfiguration)
        #expect(error.message.hasPrefix("configuration: "))
        #expect(error.message.contains(message), "\(error.message)")
    }

    @Test("DQ_* variables win over the file; a secret from the environment is never in an error")
    func environment() throws {
        var settings = try DataQueueSettings.decode(Data(#"{"server":"http://a/fhir","idempotent":true}"#.utf8))
        try settings.apply(environment: [
            "DQ_SERVER": "http://b/fhir", "DQ_IDEMPOTENT": "0", "DQ_TOKEN": "env-secret", "DQ_DATABASE": "/tmp/x.sqlite",
        ])
        let resolved = try settings.resolve()
        #expect(resolved.server.absoluteString == "http://b/fhir")
        #expect(!resolved.configuration.idempotent)
        #expect(resolved.configuration.databasePath == "/tmp/x.sqlite")
        let error = try #require(throws: DataQueueError.self) { try settings.apply(environment: ["DQ_IDEMPOTENT": "maybe"]) }
        #expect(error.message.contains("DQ_IDEMPOTENT"))
        settings.timeoutSeconds = .nan
        let bad = try #require(throws: DataQueueError.self) { try settings.resolve() }
        #expect(bad.message.contains("\"timeout_seconds\""))
        #expect(!bad.message.contains("env-secret"))
    }

    @Test("Relative paths in a file are relative to the file's directory")
    func relativePaths() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-settings-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let file = directory.appendingPathComponent("dq.json")
        try Data(
            #"{"server":"http://a/fhir","encryption":{"endpoint":"http://a/enc","certificate":"missing.pem","key_id":"k"}}"#.utf8
        ).write(to: file)
        let settings = try DataQueueSettings.load(contentsOf: file.path)
        #expect(settings.baseDirectory == directory.path)
        let error = try #require(throws: DataQueueError.self) { try settings.resolve() }
        #expect(error.message.contains("encryption.certificate"), "\(error.message)")
    }
}
