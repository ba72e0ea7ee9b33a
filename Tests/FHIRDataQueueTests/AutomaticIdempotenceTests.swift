import Foundation
import Testing

@testable import FHIRDataQueue

/// `idempotent: auto`, the default: `If-None-Exist` on the resource's own identifier for the types whose
/// `conditionalCreate` the server's CapabilityStatement declares, nothing added to a resource, and plain creates
/// everywhere else.
@Suite("Automatic idempotence (the default)")
struct AutomaticIdempotenceTests {
    let scratch: Scratch

    init() throws { scratch = try Scratch("dq-auto-idempotent") }

    /// A CapabilityStatement of Patient and Observation that declares conditional create for `types` (and, with
    /// `transactions`, the transaction interaction).
    static func metadata(declaring types: [String], transactions: Bool = false) -> String {
        let resources = ["Patient", "Observation"].map { type in
            #"{"type":"\#(type)"\#(types.contains(type) ? #","conditionalCreate":true"# : "")}"#
        }
        let interaction = transactions ? #","interaction":[{"code":"transaction"}]"# : ""
        let rest = #"{"mode":"server","resource":[\#(resources.joined(separator: ","))]\#(interaction)}"#
        return #"{"resourceType":"CapabilityStatement","rest":[\#(rest)]}"#
    }

    /// A transaction-response with one `201` for each entry of the posted Bundle; `201` with a Location for a
    /// single create.
    static func answer(_ request: ScriptedServer.Request) -> ScriptedServer.Response {
        guard request.path.hasSuffix("/fhir") else { return .created(location: "Patient/p1/_history/1") }
        let bundle = (try? JSONSerialization.jsonObject(with: request.body)) as? [String: Any]
        let count = (bundle?["entry"] as? [Any])?.count ?? 0
        let entries = (0..<count).map { #"{"response":{"status":"201 Created","location":"Patient/e\#($0)/_history/1"}}"# }
        return .init(
            status: 200, body: #"{"resourceType":"Bundle","type":"transaction-response","entry":[\#(entries.joined(separator: ","))]}"#)
    }

    func queue(_ server: ScriptedServer, batchSize: Int?, database: String = "q.sqlite") async throws -> DataQueue {
        var configuration = DataQueue.Configuration(databasePath: scratch.url.appendingPathComponent(database).path)
        #expect(configuration.idempotent == .automatic, "auto is the default")
        configuration.batchSize = batchSize
        return try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
    }

    static let patientWithIdentifier = #"{"resourceType":"Patient","identifier":[{"value":"no-system"},{"system":"urn:s","value":"p 1"}]}"#
    static let patientWithoutIdentifier = #"{"resourceType":"Patient","gender":"other"}"#
    static let observationWithIdentifier =
        #"{"resourceType":"Observation","identifier":[{"system":"urn:s","value":"o1"}],"status":"final","code":{"text":"x"}}"#

    @Test("One by one: If-None-Exist only for a declared type and a resource with an identifier; no resource is changed")
    func single() async throws {
        let server = try await ScriptedServer { request in
            request.method == "GET"
                ? .respond(.init(status: 200, body: Self.metadata(declaring: ["Patient"]))) : .respond(Self.answer(request))
        }
        let queue = try await queue(server, batchSize: 1)
        for json in [Self.patientWithIdentifier, Self.patientWithoutIdentifier, Self.observationWithIdentifier] {
            _ = try await queue.enqueue(try FHIRResource(json: Data(json.utf8)))
        }
        let report = try await queue.flush()
        #expect(report.delivered == 3)
        let posts = server.requests.filter { $0.method == "POST" }
        #expect(posts.map { $0.header("If-None-Exist") } == ["identifier=urn:s|p%201", nil, nil])
        #expect(
            posts.map(\.bodyText) == [Self.patientWithIdentifier, Self.patientWithoutIdentifier, Self.observationWithIdentifier],
            "every body is sent as it was queued")
        #expect(server.requests.filter { $0.method == "GET" }.count == 1, "the CapabilityStatement is read once, with batch_size 1 too")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A server that declares no conditional create, or whose /metadata is not a CapabilityStatement, gets plain creates")
    func nothingDeclared() async throws {
        for (index, metadata) in [Self.metadata(declaring: []), "<html>FHIR server</html>"].enumerated() {
            let server = try await ScriptedServer { request in
                request.method == "GET" ? .respond(.init(status: 200, body: metadata)) : .respond(Self.answer(request))
            }
            let queue = try await queue(server, batchSize: 1, database: "q\(index).sqlite")
            _ = try await queue.enqueue(try FHIRResource(json: Data(Self.patientWithIdentifier.utf8)))
            #expect(try await queue.flush().delivered == 1)
            let post = try #require(server.requests.first { $0.method == "POST" })
            #expect(post.header("If-None-Exist") == nil)
            #expect(try await queue.serverCapabilities().conditionalCreate == [])
            try await queue.shutdown()
            try await server.shutdown()
        }
    }

    @Test("In a Bundle dq composes, each entry of a declared type with an identifier carries ifNoneExist; the others none")
    func composedBundle() async throws {
        let server = try await ScriptedServer { request in
            request.method == "GET"
                ? .respond(.init(status: 200, body: Self.metadata(declaring: ["Patient"], transactions: true)))
                : .respond(Self.answer(request))
        }
        let queue = try await queue(server, batchSize: nil)
        for json in [Self.patientWithIdentifier, Self.patientWithoutIdentifier, Self.observationWithIdentifier] {
            _ = try await queue.enqueue(try FHIRResource(json: Data(json.utf8)))
        }
        #expect(try await queue.flush().delivered == 3)
        let posts = server.requests.filter { $0.method == "POST" }
        try #require(posts.count == 1, "one transaction Bundle")
        let bundle = try #require(try JSONSerialization.jsonObject(with: posts[0].body) as? [String: Any])
        let entries = try #require(bundle["entry"] as? [[String: Any]])
        let conditions = entries.map { ($0["request"] as? [String: Any])?["ifNoneExist"] as? String }
        #expect(conditions == ["identifier=urn:s|p%201", nil, nil])
        let identifiers = entries.map { ($0["resource"] as? [String: Any])?["identifier"] != nil }
        #expect(identifiers == [true, false, true], "no identifier is added")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("A queued transaction Bundle: its POST entries of declared types with an identifier get ifNoneExist, nothing else changes")
    func queuedBundle() async throws {
        let server = try await ScriptedServer { request in
            request.method == "GET"
                ? .respond(.init(status: 200, body: Self.metadata(declaring: ["Patient"]))) : .respond(Self.answer(request))
        }
        let queue = try await queue(server, batchSize: 1)
        let entries = [
            #"{"resource":\#(Self.patientWithIdentifier),"request":{"method":"POST","url":"Patient"}}"#,
            #"{"resource":\#(Self.patientWithoutIdentifier),"request":{"method":"POST","url":"Patient"}}"#,
            #"{"resource":\#(Self.observationWithIdentifier),"request":{"method":"POST","url":"Observation"}}"#,
            #"{"resource":\#(Self.patientWithIdentifier),"request":{"method":"POST","url":"Patient","ifNoneExist":"identifier=mine"}}"#,
        ]
        let bundle = #"{"resourceType":"Bundle","type":"transaction","entry":[\#(entries.joined(separator: ","))]}"#
        _ = try await queue.enqueue(try FHIRResource(json: Data(bundle.utf8)))
        #expect(try await queue.flush().delivered == 1)
        let post = try #require(server.requests.first { $0.method == "POST" })
        #expect(post.header("If-None-Exist") == nil)
        let expected = bundle.replacingOccurrences(
            of: #""request":{"method":"POST","url":"Patient"}}"#,
            with: #""request":{"ifNoneExist":"identifier=urn:s|p%201","method":"POST","url":"Patient"}}"#, options: [],
            range: bundle.range(of: #""request":{"method":"POST","url":"Patient"}}"#))
        #expect(post.bodyText == expected, "one condition inserted, every other byte as queued")
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("The setting: \"auto\", true and false in the file and DQ_IDEMPOTENT; auto when unset; anything else refused")
    func setting() async throws {
        func resolved(_ file: String, _ environment: [String: String] = [:]) async throws -> DataQueue.Idempotence {
            let settings = try await DataQueueSettings.decode(Data(#"{"server":"http://a/fhir"\#(file)}"#.utf8), environment: environment)
            return try settings.resolve().configuration.idempotent
        }
        #expect(try await resolved("") == .automatic)
        #expect(try await resolved(#","idempotent":"auto""#) == .automatic)
        #expect(try await resolved(#","idempotent":true"#) == .always)
        #expect(try await resolved(#","idempotent":false"#) == .never)
        #expect(try await resolved(#","idempotent":false"#, ["DQ_IDEMPOTENT": "AUTO"]) == .automatic)
        #expect(try await resolved("", ["DQ_IDEMPOTENT": "1"]) == .always)
        #expect(try await resolved(#","idempotent":"auto""#, ["DQ_IDEMPOTENT": "false"]) == .never)
        for bad in [#","idempotent":"yes""#, #","idempotent":1"#] {
            let error = try await #require(throws: DataQueueError.self) { try await resolved(bad) }
            #expect(error.message.contains("\"idempotent\"") && error.message.contains("auto"), "\(error.message)")
        }
        let error = try await #require(throws: DataQueueError.self) { try await resolved("", ["DQ_IDEMPOTENT": "maybe"]) }
        #expect(error.message.contains("DQ_IDEMPOTENT") && error.message.contains("auto"), "\(error.message)")
        var configuration = DataQueue.Configuration()
        configuration.idempotent = true
        #expect(configuration.idempotent == .always && "\(configuration.idempotent)" == "true")
    }
}
