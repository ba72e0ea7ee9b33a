import Foundation
import Testing

/// Generated real-world data against sekmet-fhir: the transaction Bundles of `carebundle` (Fixtures/carebundle,
/// 10 synthetic patients, 209 resources whose references name their Bundle's fullUrls), queued while the server
/// is down, as Bundles and as their entries in NDJSON form. After the flush every resource is on the server once
/// and every reference there points at a resource that exists there.
@Suite("Generated transaction Bundles against sekmet-fhir", .serialized, .enabled(if: Peers.enabled))
struct RealDataTests {
    let work: TemporaryDirectory

    init() throws { work = try TemporaryDirectory() }

    static var fixtureFiles: [URL] {
        let folder = Peers.packageRoot.appendingPathComponent("Fixtures/carebundle")
        return ((try? FileManager.default.contentsOfDirectory(at: folder, includingPropertiesForKeys: nil)) ?? [])
            .filter { $0.pathExtension == "json" }.sorted { $0.path < $1.path }
    }

    /// Every `reference` string in `value`.
    static func references(in value: Any) -> [String] {
        if let object = value as? [String: Any] {
            return object.flatMap { key, member in
                key == "reference" ? [member as? String].compactMap { $0 } : references(in: member)
            }
        }
        if let array = value as? [Any] { return array.flatMap(references(in:)) }
        return []
    }

    /// Every resource of `type` on the server.
    func resources(_ server: FHIRServer, _ type: String) async throws -> [[String: Any]] {
        var all: [[String: Any]] = []
        while true {
            let page = try await HTTP.json("\(server.base)/\(type)/_history?_count=500&_offset=\(all.count)")
            let entries = page["entry"] as? [[String: Any]] ?? []
            if entries.isEmpty { return all }
            all += entries.compactMap { $0["resource"] as? [String: Any] }
        }
    }

    /// The server holds each resource of the fixtures once (by type), and every reference it holds resolves there.
    func expectDelivered(_ server: FHIRServer, expected: [String: Int]) async throws {
        var held: [String: [[String: Any]]] = [:]
        for type in expected.keys { held[type] = try await resources(server, type) }
        #expect(held.mapValues(\.count) == expected)
        let existing = Set(held.flatMap { type, resources in resources.compactMap { ($0["id"] as? String).map { "\(type)/\($0)" } } })
        let references = held.values.flatMap { $0.flatMap(Self.references(in:)) }
        #expect(references.count == 560, "the fixtures hold 560 references")
        let dangling = references.filter { !existing.contains($0) }
        #expect(dangling.isEmpty, "\(dangling.count) references point at nothing on the server: \(dangling.prefix(5))")
    }

    @Test("The Bundle of the issue, queued while the server is down, arrives with its reference resolved")
    func miniTransaction() async throws {
        let server = try FHIRServer()
        let file = try work.write(
            "mini-tx.json",
            """
            {"resourceType":"Bundle","type":"transaction","entry":[
             {"fullUrl":"urn:uuid:11111111-1111-4111-8111-111111111111","resource":{"resourceType":"Patient","identifier":[{"system":"urn:example:mrn","value":"MINI-1"}]},"request":{"method":"POST","url":"Patient"}},
             {"fullUrl":"urn:uuid:22222222-2222-4222-8222-222222222222","resource":{"resourceType":"Observation","status":"final","code":{"text":"HR"},"subject":{"reference":"urn:uuid:11111111-1111-4111-8111-111111111111"}},"request":{"method":"POST","url":"Observation"}}]}
            """)
        let env = ["DQ_SERVER": server.base, "DQ_DATABASE": work.file("q.db"), "HOME": work.path]
        let queued = try await dq(["enqueue", file], env)
        #expect(queued.status == 0, "\(queued.stderr)")
        let early = try await dq(["flush"], env)
        #expect(early.status == 75, "the server is down: \(early.stderr)")
        try await server.start()
        let flushed = try await dq(["flush", "--now"], env)
        #expect(flushed.status == 0, "\(flushed.stdout) \(flushed.stderr)")
        let patients = try await resources(server, "Patient")
        let observations = try await resources(server, "Observation")
        #expect(patients.count == 1 && observations.count == 1)
        let patientID = try #require(patients.first?["id"] as? String)
        #expect(Self.references(in: observations[0]) == ["Patient/\(patientID)"])
    }

    /// How the generated data is queued.
    enum Form: String, CaseIterable, Sendable, CustomTestStringConvertible {
        /// Each Bundle file as one item.
        case bundles
        /// Every entry as an NDJSON line `{"fullUrl": …, "resource": …, "request": …}`: dq groups and rewrites.
        case entries
        var testDescription: String { rawValue }
    }

    @Test("Every generated resource is on the server once and every reference there resolves", arguments: Form.allCases)
    func generated(form: Form) async throws {
        let files = Self.fixtureFiles
        try #require(files.count == 10, "Fixtures/carebundle holds the generated Bundles (scripts/make-fixtures.sh)")
        var expected: [String: Int] = [:]
        var lines: [String] = []
        for file in files {
            let bundle = try #require(try JSONSerialization.jsonObject(with: Data(contentsOf: file)) as? [String: Any])
            for entry in try #require(bundle["entry"] as? [[String: Any]]) {
                let type = try #require((entry["resource"] as? [String: Any])?["resourceType"] as? String)
                expected[type, default: 0] += 1
                lines.append(String(decoding: try JSONSerialization.data(withJSONObject: entry), as: UTF8.self))
            }
        }
        #expect(expected.values.reduce(0, +) == 209)

        let server = try FHIRServer()
        let env = ["DQ_SERVER": server.base, "DQ_DATABASE": work.file("q.db"), "HOME": work.path]
        let queued: ProcessResult
        switch form {
        case .bundles: queued = try await dq(["enqueue"] + files.map(\.path), env)
        case .entries: queued = try await dq(["enqueue", "--ndjson", try work.write("entries.ndjson", lines.joined(separator: "\n"))], env)
        }
        #expect(queued.status == 0, "\(queued.stderr)")
        #expect(try await dq(["flush"], env).status == 75, "the server is down")
        try await server.start()
        let flushed = try await dq(["flush", "--now", "--json"], env)
        #expect(flushed.status == 0, "\(flushed.stdout) \(flushed.stderr)")
        let summary = try #require(try JSONSerialization.jsonObject(with: Data(flushed.stdout.utf8)) as? [String: Any])
        #expect(summary["delivered"] as? Int == (form == .bundles ? 10 : 209) && summary["parked"] as? Int == 0)
        try await expectDelivered(server, expected: expected)
    }
}
