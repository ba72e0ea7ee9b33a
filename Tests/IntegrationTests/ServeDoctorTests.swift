import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// `dq doctor` on `dq serve`'s settings: what would stop it, found before it starts.
@Suite("dq doctor checks the serve settings", .serialized, .enabled(if: Peers.enabled))
struct ServeDoctorTests {
    let work: TemporaryDirectory

    init() throws { work = try TemporaryDirectory() }

    private func serveFindings(_ config: String) async throws -> (status: Int32, problems: [String]) {
        let result = try await dq(["doctor", "--offline", "--json", "--config", config], ["HOME": work.path])
        let report = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any], "\(result.stderr)")
        let findings = try #require(report["findings"] as? [[String: Any]])
        return (
            result.status,
            findings.filter {
                // The serve object's own findings, and a setting of it that cannot be read.
                $0["about"] as? String == "serve" || ($0["problem"] as? String)?.contains("\"serve.") == true
            }.compactMap { $0["problem"] as? String }
        )
    }

    @Test(
        "a missing Antispam file, a keys directory with no key, plain resources unsealed and a listen address in use are each named; a good serve object gives none"
    )
    func findings() async throws {
        try FileManager.default.createDirectory(atPath: work.file("keys"), withIntermediateDirectories: true)
        let port = Peers.freePort()
        let config = try work.write(
            "bad.json",
            #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(work.file("q.sqlite"))", "serve": {"listen": "127.0.0.1:\#(port)", "keys_dir": "keys", "antispam_file": "missing"}}"#
        )
        // Something listens on the address.
        let holder = try ChildProcess(
            "/usr/bin/env",
            [
                "python3", "-c",
                "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', \(port))); s.listen(); print('up', flush=True); sys.stdin.readline()",
            ], keepStdinOpen: true)
        #expect(try await eventually { holder.outputSoFar.contains("up") })
        let bad = try await serveFindings(config)
        holder.closeStdin()
        _ = await holder.wait(timeout: .seconds(10))
        #expect(bad.status == 78)
        #expect(bad.problems.count == 4, "\(bad.problems)")
        #expect(bad.problems.contains { $0.contains("serve.antispam_file") }, "\(bad.problems)")
        #expect(bad.problems.contains { $0.contains("holds no key") }, "\(bad.problems)")
        #expect(bad.problems.contains { $0.contains("plain FHIR resources") }, "\(bad.problems)")
        #expect(bad.problems.contains { $0.contains("address is in use") }, "\(bad.problems)")

        // The same with what dq serve needs: no serve finding.
        let openssl = await (try ChildProcess("/usr/bin/openssl", ["genrsa", "-out", work.file("keys/k1.pem"), "2048"])).wait()
        #expect(openssl.status == 0)
        _ = try work.write("antispam", "secret\n")
        chmod(work.file("antispam"), 0o600)
        let good = try work.write(
            "good.json",
            #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(work.file("q.sqlite"))", "serve": {"listen": "127.0.0.1:\#(port)", "keys_dir": "keys", "antispam_file": "antispam", "plain_fhir": false, "auth_requests_per_minute": 0}}"#
        )
        // 0 is a number (no limit), not false: JSONSerialization gives both as NSNumbers.
        #expect(try await serveFindings(good).problems == [])
        let numberForFlag = try work.write(
            "flag.json",
            #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(work.file("q.sqlite"))", "serve": {"keys_dir": "keys", "antispam_file": "antispam", "plain_fhir": 0}}"#
        )
        let refused = try await dq(["doctor", "--offline", "--config", numberForFlag], ["HOME": work.path])
        #expect(refused.status == 78 && refused.stderr.contains("\"serve.plain_fhir\" must be true or false"), "\(refused.stderr)")
    }

    @Test(
        "Secrets others can read (a 0644 Antispam file, a 0644 private key) are named by dq doctor (78), dq serve keys and dq serve at start; 0600 ones are not"
    )
    func exposedSecrets() async throws {
        try FileManager.default.createDirectory(atPath: work.file("keys"), withIntermediateDirectories: true)
        let openssl = await (try ChildProcess("/usr/bin/openssl", ["genrsa", "-out", work.file("keys/k1.pem"), "2048"])).wait()
        #expect(openssl.status == 0)
        _ = try work.write("antispam", "secret\n")
        chmod(work.file("antispam"), 0o644)
        chmod(work.file("keys/k1.pem"), 0o644)
        let config = try work.write(
            "exposed.json",
            #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(work.file("q.sqlite"))", "serve": {"listen": "127.0.0.1:\#(Peers.freePort())", "keys_dir": "keys", "antispam_file": "antispam", "plain_fhir": false}}"#
        )
        let found = try await serveFindings(config)
        #expect(found.status == 78, "\(found.problems)")
        #expect(found.problems.count == 2, "\(found.problems)")
        #expect(
            found.problems.contains { $0.contains("the Antispam file") && $0.contains("readable by others (mode 644)") },
            "\(found.problems)")
        #expect(found.problems.contains { $0.contains("the private key") && $0.contains("k1.pem") }, "\(found.problems)")
        let keys = try await dq(["serve", "keys", "--config", config], ["HOME": work.path])
        #expect(keys.status == 0, "\(keys.stderr)")
        #expect(keys.stderr.contains("the Antispam file") && keys.stderr.contains("k1.pem is readable by others"), "\(keys.stderr)")

        // dq serve says the same at start, and serves.
        let port = Peers.freePort()
        let serve = try ChildProcess(
            Peers.dqBinary, ["serve", "--config", config, "--listen", "127.0.0.1:\(port)"], environment: ["HOME": work.path])
        #expect(try await eventually(timeout: .seconds(60)) { (try? await HTTP.get("http://127.0.0.1:\(port)/readyz"))?.0 == 200 })
        // Before, the address in use by this very receiver was a finding (69): now it is dq serve's own.
        let running = try await dq(["doctor", "--offline", "--json", "--config", config], ["HOME": work.path])
        #expect(!running.stdout.contains("address is in use"), "\(running.stdout)")
        serve.kill(SIGTERM)
        let stopped = await serve.wait(timeout: .seconds(60))
        #expect(
            stopped.stderr.contains("the Antispam file") && stopped.stderr.contains("readable by others"), "\(stopped.stderr.suffix(2000))")

        chmod(work.file("antispam"), 0o600)
        chmod(work.file("keys/k1.pem"), 0o600)
        #expect(try await serveFindings(config).problems == [])
    }

    @Test(
        "dq doctor before the first start (no database yet, as the quick start goes) passes; a database folder that cannot be written is named (74)"
    )
    func beforeFirstStart() async throws {
        try FileManager.default.createDirectory(atPath: work.file("keys"), withIntermediateDirectories: true)
        let openssl = await (try ChildProcess("/usr/bin/openssl", ["genrsa", "-out", work.file("keys/k1.pem"), "2048"])).wait()
        #expect(openssl.status == 0)
        _ = try work.write("antispam", "secret\n")
        chmod(work.file("antispam"), 0o600)
        let fresh = try work.write(
            "fresh.json",
            #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(work.file("never.sqlite"))", "serve": {"listen": "127.0.0.1:\#(Peers.freePort())", "keys_dir": "keys", "antispam_file": "antispam", "plain_fhir": false}}"#
        )
        let first = try await dq(["doctor", "--offline", "--config", fresh], ["HOME": work.path])
        #expect(first.status == 0, "\(first.stdout) \(first.stderr)")
        #expect(first.stdout.contains("not made yet"), "\(first.stdout)")
        #expect(!FileManager.default.fileExists(atPath: work.file("never.sqlite")), "doctor makes nothing")
        // dq config shows the serve object's settings too, each with its origin.
        let shown = try await dq(["config", "--json", "--config", fresh], ["HOME": work.path])
        #expect(shown.status == 0, "\(shown.stderr)")
        let entries = try #require(try JSONSerialization.jsonObject(with: Data(shown.stdout.utf8)) as? [String: [String: String]])
        #expect(entries["serve.keys_dir"]?["origin"]?.hasSuffix("serve.keys_dir") == true, "\(entries["serve.keys_dir"] ?? [:])")
        #expect(entries["serve.plain_fhir"]?["value"] == "false", "\(entries["serve.plain_fhir"] ?? [:])")
        #expect(entries["serve.write_policy"]?["origin"] == "default", "\(entries["serve.write_policy"] ?? [:])")
        #expect(entries["serve.write_policy"]?["value"]?.contains("system/Patient.cu") == true, "\(entries["serve.write_policy"] ?? [:])")
        #expect(entries["serve.max_connections_per_address"]?["value"] == "256")
        let nowhere = try work.write(
            "nowhere.json",
            #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(work.file("absent-folder/q.sqlite"))", "serve": {"listen": "127.0.0.1:\#(Peers.freePort())", "keys_dir": "keys", "antispam_file": "antispam", "plain_fhir": false}}"#
        )
        let missing = try await dq(["doctor", "--offline", "--config", nowhere], ["HOME": work.path])
        #expect(missing.status == 74, "\(missing.stdout) \(missing.stderr)")
        #expect(missing.stderr.contains("cannot be written"), "\(missing.stderr)")
    }

    @Test(
        "a key file that is not an RSA private key, and one that cannot be read, are each named as such, not as a missing key"
    )
    func unreadableKeys() async throws {
        _ = try work.write("antispam", "secret\n")
        chmod(work.file("antispam"), 0o600)
        // keys-a: k1.pem holds no key; keys-b: k1.pem cannot be read as a file (a directory: root reads any file).
        try FileManager.default.createDirectory(atPath: work.file("keys-a"), withIntermediateDirectories: true)
        _ = try work.write("keys-a/k1.pem", "-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
        chmod(work.file("keys-a/k1.pem"), 0o600)
        try FileManager.default.createDirectory(atPath: work.file("keys-b/k1.pem"), withIntermediateDirectories: true)
        for keys in ["keys-a", "keys-b"] {
            let config = try work.write(
                "\(keys).json",
                #"{"server": "http://127.0.0.1:9/fhir", "database": "\#(work.file("q.sqlite"))", "serve": {"listen": "127.0.0.1:\#(Peers.freePort())", "keys_dir": "\#(keys)", "antispam_file": "antispam", "plain_fhir": false}}"#
            )
            let found = try await serveFindings(config)
            #expect(found.status == 78, "\(keys): \(found.problems)")
            #expect(found.problems.count == 1, "\(keys): \(found.problems)")
            #expect(
                found.problems.first?.contains("the key of key_id k1 is not a readable RSA private key") == true,
                "\(keys): \(found.problems)")
        }
    }
}
