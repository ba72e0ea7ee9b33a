import Foundation

/// A directory of its own for one test, removed with everything in it when the test's suite instance goes
/// (Swift Testing makes one instance per test), so that `make test` leaves nothing in the temporary directory.
final class Scratch: Sendable {
    let url: URL

    init(_ prefix: String) throws {
        url = FileManager.default.temporaryDirectory.appendingPathComponent("\(prefix)-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
    }

    deinit { try? FileManager.default.removeItem(at: url) }
}
