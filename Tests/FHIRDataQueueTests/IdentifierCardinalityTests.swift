import Foundation
import Testing

@testable import FHIRDataQueue

/// Idempotent mode's generated identifier against an independent R4 validator (fhirkit-rs, installed by
/// scripts/peers.sh): for every R4 resource type, the body dq would send has an `identifier` of the shape R4
/// gives that type (a single object where it is 0..1, a list elsewhere, none where the type has none).
@Suite("Idempotent mode's identifier on every R4 resource type")
struct IdentifierCardinalityTests {
    static var venv: String? {
        let environment = ProcessInfo.processInfo.environment
        if let venv = environment["DQ_PEERS_VENV"] { return venv }
        return environment["DQ_REQUIRE_PEERS"] == "1" ? "" : nil
    }

    /// Runs `tool` with `arguments`; its standard output and exit status.
    func run(_ tool: String, _ arguments: [String]) async throws -> (String, Int32) {
        let output = FileManager.default.temporaryDirectory.appendingPathComponent("dq-fhirkit-\(UUID().uuidString).txt")
        _ = FileManager.default.createFile(atPath: output.path, contents: nil)
        defer { try? FileManager.default.removeItem(at: output) }
        let handle = try FileHandle(forWritingTo: output)
        let status = try await runToExit(tool, arguments, stdout: .descriptor(handle.fileDescriptor))
        try handle.close()
        return (try String(contentsOf: output, encoding: .utf8), status)
    }

    @Test(
        "A generated identifier validates as R4 on all 146 resource types",
        .enabled(if: venv != nil, "fhirkit-rs is installed by scripts/peers.sh (make test)"))
    func everyType() async throws {
        let venv = try #require(Self.venv.flatMap { $0.isEmpty ? nil : $0 }, "DQ_PEERS_VENV is not set: run make test")
        let (listing, listed) = try await run(
            venv + "/bin/python", ["-c", "import fhirkit; print('\\n'.join(sorted(fhirkit.RESOURCE_TYPES)))"])
        #expect(listed == 0)
        let types = listing.split(separator: "\n").map(String.init)
        #expect(types.count == 146, "R4 has 146 resource types")
        #expect(IdentifierCardinality.single.isSubset(of: types) && IdentifierCardinality.none.isSubset(of: types))

        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-cardinality-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)

        defer { try? FileManager.default.removeItem(at: directory) }
        var files: [String] = []
        var conditions = 0
        for type in types {
            let (body, condition) = try ConditionalCreate.prepare(
                Data(#"{"resourceType":"\#(type)"}"#.utf8), itemID: UUID(), isBundle: false)
            let text = String(decoding: body, as: UTF8.self)
            if IdentifierCardinality.none.contains(type) {
                #expect(condition == nil && !text.contains("identifier"), "\(type): \(text)")
            } else {
                conditions += condition == nil ? 0 : 1
            }
            let file = directory.appendingPathComponent(type + ".json").path
            try body.write(to: URL(fileURLWithPath: file))
            files.append(file)
        }
        #expect(conditions == 146 - IdentifierCardinality.none.count)
        let (report, _) = try await run(venv + "/bin/fhirkit", ["validate"] + files)
        // Each file gets its own report; other required elements are missing from these bare resources, but
        // no problem may concern the identifier.
        #expect(report.components(separatedBy: ": ").count > types.count, "fhirkit reported on every file")
        let problems = report.split(separator: "\n").filter { $0.contains(".identifier") }
        #expect(problems.isEmpty, "\(problems.prefix(10))")
    }

    /// The validator itself tells the shapes apart (a test that would pass with any table is no test).
    @Test(
        "fhirkit refuses a list where R4 has one identifier, and an object where it has a list",
        .enabled(if: venv != nil, "fhirkit-rs is installed by scripts/peers.sh (make test)"))
    func validatorSeesTheDifference() async throws {
        let venv = try #require(Self.venv.flatMap { $0.isEmpty ? nil : $0 }, "DQ_PEERS_VENV is not set: run make test")
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-cardinality-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let list = directory.appendingPathComponent("qr.json")
        try Data(#"{"resourceType":"QuestionnaireResponse","status":"completed","identifier":[{"system":"a","value":"b"}]}"#.utf8)
            .write(to: list)
        let object = directory.appendingPathComponent("patient.json")
        try Data(#"{"resourceType":"Patient","identifier":{"system":"a","value":"b"}}"#.utf8).write(to: object)
        let (report, status) = try await run(venv + "/bin/fhirkit", ["validate", list.path, object.path])
        #expect(status != 0)
        #expect(report.contains("QuestionnaireResponse.identifier") && report.contains("Patient.identifier"), "\(report)")
    }
}
