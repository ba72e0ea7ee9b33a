import Foundation
import Testing

@testable import FHIRDataQueue

/// Where settings and queues live.
@Suite("Settings files and queue paths")
struct CoreTests {
    @Test(
        "A config file's directory is what NSString.deletingLastPathComponent gives",
        arguments: [
            "dq.json", "./dq.json", "/dq.json", "/etc/dq/dq.json", "etc/dq/dq.json", "/etc/dq/", "/etc//dq//dq.json",
            "../dq.json", "/", "a/b/", "",
        ])
    func directoryOfPath(path: String) {
        #expect(QueuePaths.directory(of: path) == (path as NSString).deletingLastPathComponent, "\(path)")
    }

    @Test("Loading a config file records its directory, its path and whether it holds a secret")
    func settingsRecordTheirDirectory() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("dq-core-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let path = directory.appendingPathComponent("dq.json").path
        try Data(#"{"server": "http://127.0.0.1:9/fhir", "auth": {"client_secret": "s"}}"#.utf8).write(to: URL(fileURLWithPath: path))
        let settings = try await DataQueueSettings.load(contentsOf: path)
        #expect(settings.baseDirectory == directory.path)
        #expect(settings.sourcePath == path)
        #expect(settings.fileHoldsSecret)
    }
}
