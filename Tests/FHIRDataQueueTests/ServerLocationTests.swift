import Foundation
import NIOConcurrencyHelpers
import Testing

@testable import FHIRDataQueue

/// Where the server stored a created resource, when its answer has no `Location`: a Patient with a fullUrl and
/// an Observation that references it, sent one by one to a scripted server that answers the Patient's create
/// in each of the ways servers do.
@Suite("Server locations without Location")
struct ServerLocationTests {
    let directory: URL
    let scratch: Scratch

    init() throws {
        scratch = try Scratch("dq-location")
        directory = scratch.url
    }

    /// How the server answers the Patient's create.
    enum Answer: String, CaseIterable, Sendable, CustomTestStringConvertible {
        case location, contentLocation, body, bodyWithOtherType, endpointNotResource, nothing
        var testDescription: String { rawValue }

        var response: ScriptedServer.Response {
            switch self {
            case .location:
                return .init(status: 201, headers: [("Location", "http://s/fhir/Patient/p1/_history/2")], body: "")
            case .contentLocation:
                return .init(status: 201, headers: [("Content-Location", "http://s/fhir/Patient/p1/_history/2")], body: "")
            case .body:
                return .init(
                    status: 200, headers: [("Content-Type", "application/fhir+json")],
                    body: #"{"resourceType":"Patient","id":"p1","meta":{"versionId":"2"}}"#)
            case .bodyWithOtherType:
                return .init(status: 200, body: #"{"resourceType":"OperationOutcome","id":"p1"}"#)
            case .endpointNotResource:
                // The type's endpoint, not a resource: "Patient" is no id.
                return .init(status: 201, headers: [("Content-Location", "http://s/fhir/Patient")], body: "")
            case .nothing:
                return .init(status: 200, body: "")
            }
        }

        /// The journal's note on the Patient's delivery.
        var note: String? {
            switch self {
            case .location: nil
            case .contentLocation: "server id from Content-Location (the answer had no Location)"
            case .body: "server id from the answer's resource (the answer had no Location)"
            case .bodyWithOtherType, .endpointNotResource, .nothing:
                "the server did not say where it stored it (no Location, Content-Location or resource id in its answer)"
            }
        }
    }

    func queue(_ server: ScriptedServer) async throws -> DataQueue {
        var configuration = DataQueue.Configuration(databasePath: directory.appendingPathComponent("q.sqlite").path)
        configuration.batchSize = 1
        configuration.idempotent = false  // plain creates, so that no CapabilityStatement is read: the server counts requests
        configuration.retryPolicy = RetryPolicy(initialDelay: 60, maximumDelay: 600, jitter: 0)
        return try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
    }

    @Test(
        "The id comes from Location, else Content-Location, else the answer's resource; without any the reference waits, held and named",
        arguments: Answer.allCases)
    func fallbacks(answer: Answer) async throws {
        let answered = NIOLockedValueBox(0)
        let server = try await ScriptedServer { _ in
            let index = answered.withLockedValue { value in
                defer { value += 1 }
                return value
            }
            return index == 0 ? .respond(answer.response) : .respond(.created(location: "Observation/o\(index)/_history/1"))
        }
        let queue = try await queue(server)
        let fullURL = "urn:uuid:" + UUID().uuidString.lowercased()
        let patient = try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)), fullURL: fullURL)
        let observation = try await queue.enqueue(
            try FHIRResource(
                json: Data(
                    #"{"resourceType":"Observation","status":"final","code":{"text":"x"},"subject":{"reference":"\#(fullURL)"}}"#.utf8)))
        let report = try await queue.flush()
        let line = try #require(try await queue.journalRecord(patient.id.uuidString))
        #expect(line.note == answer.note)
        switch answer {
        case .location, .contentLocation, .body:
            #expect(report.delivered == 2 && report.parked == 0)
            #expect(line.serverID == "p1" && line.versionID == "2")
            #expect(server.requests.count == 2)
            let sent = try #require(server.requests.last).bodyText
            #expect(sent.contains(#""reference":"Patient/p1""#), "\(sent)")
        case .bodyWithOtherType, .endpointNotResource, .nothing:
            // The Observation was never sent: it is held with a true reason, not counted as rejected.
            #expect(report.delivered == 1 && report.parked == 1 && report.held == 1 && report.rejected == 0)
            #expect(server.requests.count == 1)
            #expect(line.serverID == nil)
            let (held, _) = try await queue.item(observation.id.uuidString)
            #expect(held.state == .parked && held.lastStatus == nil)
            let reason = held.lastError ?? ""
            #expect(reason.contains("did not say where it stored item \(patient.id.uuidString.lowercased())"), "\(reason)")
            #expect(!reason.contains("not delivered"))

            // An operator finds the Patient on the server and says where it is; the held item can then go.
            await #expect(throws: DataQueueError.self) { try await queue.resolveLocation(of: patient.id.uuidString, at: "Observation/1") }
            let resolved = try await queue.resolveLocation(of: patient.id.uuidString, at: "Patient/123")
            #expect(resolved.serverID == "123" && resolved.note == "location given by an operator (dq resolve)")
            await #expect(throws: DataQueueError.self) { try await queue.resolveLocation(of: patient.id.uuidString, at: "Patient/124") }
            _ = try await queue.retry(observation.id.uuidString)
            let again = try await queue.flush()
            #expect(again.delivered == 1 && again.parked == 0)
            #expect(server.requests.count == 2)
            let sent = try #require(server.requests.last).bodyText
            #expect(sent.contains(#""reference":"Patient/123""#), "\(sent)")
        }
        try await queue.shutdown()
        try await server.shutdown()
    }

    @Test("An item whose referenced item was parked keeps that reason, and is held, not rejected")
    func parkedReference() async throws {
        let server = try await ScriptedServer { request in
            request.bodyText.contains("Patient")
                ? .respond(.init(status: 422, body: #"{"resourceType":"OperationOutcome"}"#))
                : .respond(.created(location: "Observation/o1"))
        }
        let queue = try await queue(server)
        let fullURL = "urn:uuid:" + UUID().uuidString.lowercased()
        try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)), fullURL: fullURL)
        let observation = try await queue.enqueue(
            try FHIRResource(
                json: Data(
                    #"{"resourceType":"Observation","status":"final","code":{"text":"x"},"subject":{"reference":"\#(fullURL)"}}"#.utf8)))
        let report = try await queue.flush()
        #expect(report.parked == 2 && report.held == 1 && report.rejected == 1)
        #expect(server.requests.count == 1)
        let (held, _) = try await queue.item(observation.id.uuidString)
        #expect(held.lastError?.contains("was not delivered (parked or dropped)") == true)
        try await queue.shutdown()
        try await server.shutdown()
    }
}

/// Idempotent mode trusts a 200 to a conditional create (the resource was already there) only where the server's
/// CapabilityStatement declares `conditionalCreate` for the type: a server that ignores `If-None-Exist` answers
/// 200 to every create.
@Suite("Conditional create, where the server declares it")
struct ConditionalCreateTrustTests {
    let directory: URL
    let scratch: Scratch

    init() throws {
        scratch = try Scratch("dq-conditional")
        directory = scratch.url
    }

    /// What `/metadata` answers.
    enum Metadata: String, CaseIterable, Sendable, CustomTestStringConvertible {
        case declaresPatient, declaresNothing, notACapabilityStatement
        var testDescription: String { rawValue }

        var body: String {
            switch self {
            case .declaresPatient:
                #"{"resourceType":"CapabilityStatement","rest":[{"mode":"server","resource":[{"type":"Patient","conditionalCreate":true},{"type":"Observation"}]}]}"#
            case .declaresNothing:
                #"{"resourceType":"CapabilityStatement","rest":[{"mode":"server","resource":[{"type":"Patient"}]}]}"#
            case .notACapabilityStatement:
                "<html>FHIR server</html>"
            }
        }
    }

    @Test("A 200 to a conditional create is already-present only for a declared type; else it is a delivery", arguments: Metadata.allCases)
    func trust(metadata: Metadata) async throws {
        let server = try await ScriptedServer { request in
            request.method == "GET"
                ? .respond(.init(status: 200, body: metadata.body))
                : .respond(.init(status: 200, headers: [("Location", "Patient/p1/_history/1")], body: ""))
        }
        var configuration = DataQueue.Configuration(databasePath: directory.appendingPathComponent("q.sqlite").path, idempotent: true)
        configuration.batchSize = 1
        let queue = try await DataQueue(baseURL: URL(string: server.baseURL + "/fhir")!, configuration: configuration)
        let patient = try await queue.enqueue(try FHIRResource(json: Data(#"{"resourceType":"Patient"}"#.utf8)))
        let report = try await queue.flush()
        #expect(report.delivered == 1)
        let posted = try #require(server.requests.first { $0.method == "POST" })
        #expect(posted.header("If-None-Exist") != nil, "idempotent mode sent a conditional create")
        #expect(server.requests.filter { $0.method == "GET" }.count == 1, "the CapabilityStatement is read once")
        let line = try #require(try await queue.journalRecord(patient.id.uuidString))
        #expect(line.event == (metadata == .declaresPatient ? .alreadyPresent : .delivered))
        let capabilities = try await queue.serverCapabilities()
        #expect(capabilities.conditionalCreate == (metadata == .declaresPatient ? ["Patient"] : []))
        try await queue.shutdown()
        try await server.shutdown()
    }
}
