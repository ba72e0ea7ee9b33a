import Foundation
import Testing

/// Keys and certificates made with the openssl CLI for one test.
struct TestKeys {
    let directory: TemporaryDirectory
    var privateKey: String { directory.file("private.pem") }
    var certificate: String { directory.file("cert.pem") }
    var certificateDER: String { directory.file("cert.der") }
    var publicKey: String { directory.file("public.pem") }

    init() async throws {
        directory = try TemporaryDirectory()
        try await Self.openssl(["genrsa", "-out", directory.file("private.pem"), "2048"])
        try await Self.openssl([
            "req", "-x509", "-new", "-key", directory.file("private.pem"), "-subj", "/CN=dq-test-receiver", "-days", "30",
            "-out", directory.file("cert.pem"),
        ])
        try await Self.openssl(["x509", "-in", directory.file("cert.pem"), "-outform", "DER", "-out", directory.file("cert.der")])
        try await Self.openssl(["rsa", "-in", directory.file("private.pem"), "-pubout", "-out", directory.file("public.pem")])
    }

    /// A certificate with a 1024-bit RSA key.
    func smallCertificate() async throws -> String {
        let key = directory.file("small.pem")
        try await Self.openssl(["genrsa", "-out", key, "1024"])
        try await Self.openssl([
            "req", "-x509", "-new", "-key", key, "-subj", "/CN=small", "-days", "30", "-out", directory.file("small.crt"),
        ])
        return directory.file("small.crt")
    }

    /// A certificate with an EC P-256 key.
    func ecCertificate() async throws -> String {
        let key = directory.file("ec.pem")
        try await Self.openssl(["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key])
        try await Self.openssl(["req", "-x509", "-new", "-key", key, "-subj", "/CN=ec", "-days", "30", "-out", directory.file("ec.crt")])
        return directory.file("ec.crt")
    }

    @discardableResult
    static func openssl(_ arguments: [String], stdin: Data? = nil) async throws -> ProcessResult {
        let result = try await ChildProcess("/usr/bin/openssl", arguments, stdin: stdin).wait()
        if result.status != 0 { throw TestFailure("openssl \(arguments.first ?? "") failed: \(result.stderr)") }
        return result
    }
}

/// scripts/c3pro_receiver.py: decrypts envelopes with Python `cryptography` and forwards them to a FHIR server.
final class C3PROReceiver: @unchecked Sendable {
    let port: Int
    var base: String { "http://127.0.0.1:\(port)/c3pro/encfhir" }
    private let child: ChildProcess

    init(key: String, forwardTo server: FHIRServer, reply: String = "empty") async throws {
        port = Peers.freePort()
        let script = Peers.packageRoot.appendingPathComponent("scripts/c3pro_receiver.py").path
        child = try ChildProcess(
            Peers.venv + "/bin/python",
            [script, "serve", "--listen", String(port), "--key", key, "--forward", server.base, "--reply", reply])
        let ready = try await eventually(timeout: .seconds(20)) {
            (try? await HTTP.get("http://127.0.0.1:\(port)/__receiver/stats"))?.0 == 200
        }
        if !ready {
            let result = await child.stop()
            throw TestFailure("receiver did not start: \(result.stderr)")
        }
    }

    func stats() async throws -> [String: Any] {
        try await HTTP.json("http://127.0.0.1:\(port)/__receiver/stats")
    }

    /// Runs the receiver script's `seal` or `open` command.
    static func tool(_ arguments: [String]) async throws -> ProcessResult {
        let script = Peers.packageRoot.appendingPathComponent("scripts/c3pro_receiver.py").path
        return try await ChildProcess(Peers.venv + "/bin/python", [script] + arguments).wait()
    }

    deinit {
        child.killInBackground()
    }
}
