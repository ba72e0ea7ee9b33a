import Foundation
import GRDB
import Testing

#if canImport(Glibc)
    import Glibc
#endif

/// Bad input gets a clear, specific error and exit 65; what is already queued is not changed.
/// Skipped when dq is not built, unless DQ_REQUIRE_PEERS=1 (`make test`): then a missing binary fails every test.
@Suite(
    "Bad input and configuration errors",
    .enabled(if: Peers.required || FileManager.default.isExecutableFile(atPath: Peers.dqBinary), "dq is not built"))
struct BadInputTests {
    let work: TemporaryDirectory
    let env: [String: String]

    init() throws {
        try #require(
            FileManager.default.isExecutableFile(atPath: Peers.dqBinary),
            "DQ_REQUIRE_PEERS=1 but the dq binary \(Peers.dqBinary) is missing or not executable: run swift build (or set DQ_BIN)")
        work = try TemporaryDirectory()
        env = ["DQ_SERVER": "http://127.0.0.1:9/fhir", "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
    }

    /// Every row of the queue, to compare before and after.
    func snapshot() throws -> [String] {
        let db = try DatabaseQueue(path: work.file("queue.sqlite"))
        return try db.read { db in
            try Row.fetchAll(db, sql: "SELECT seq, uuid, state, hex(body) AS b FROM item ORDER BY seq").map { "\($0)" }
        }
    }

    static let cases: [(String, [UInt8])] = [
        ("malformed JSON", Array(#"{"resourceType":"Patient","#.utf8)),
        ("non-object JSON", Array(#"["resourceType","Patient"]"#.utf8)),
        ("missing resourceType", Array(#"{"id":"x"}"#.utf8)),
        ("resourceType not a type name", Array(#"{"resourceType":"patient record"}"#.utf8)),
        ("invalid UTF-8", [0x7B, 0x22, 0x72, 0xFF, 0xFE, 0x22, 0x7D]),
        ("empty", []),
        ("binary", [0x00, 0x01, 0x02, 0x89, 0x50, 0x4E, 0x47]),
        ("number beyond a double", Array(#"{"resourceType":"Observation","valueQuantity":{"value":1e999999}}"#.utf8)),
        ("number of 1,000 digits", Array((#"{"resourceType":"Patient","n":1"# + String(repeating: "0", count: 1000) + "}").utf8)),
    ]

    @Test("A bad file is named with its reason, exits 65, and leaves the queue unchanged", arguments: 0..<cases.count)
    func badFile(index: Int) async throws {
        let (name, bytes) = Self.cases[index]
        let good = try work.write("good.json", #"{"resourceType":"Patient"}"#)
        #expect(try await dq(["enqueue", good], env).status == 0)
        let before = try snapshot()
        let bad = work.file("bad.json")
        try Data(bytes).write(to: URL(fileURLWithPath: bad))
        let result = try await dq(["enqueue", good, bad], env)
        #expect(result.status == 65, "\(name)")
        #expect(result.stderr.contains("bad.json:"), "\(name): \(result.stderr)")
        #expect(result.stderr.contains("nothing was queued"))
        #expect(try snapshot() == before, "\(name): the queue changed")
    }

    @Test(
        "Reasons are specific",
        arguments: [
            (#"{"resourceType":"Patient","#, "not valid JSON"),
            ("[1]", "not an object"),
            (#"{"id":"x"}"#, "no \"resourceType\""),
            (#"{"resourceType":"Patient","id":"has space"}"#, "not a valid FHIR id"),
        ])
    func specificReasons(input: String, reason: String) async throws {
        let bad = try work.write("bad.json", input)
        let result = try await dq(["enqueue", bad], env)
        #expect(result.status == 65)
        #expect(result.stderr.contains(reason), "\(result.stderr)")
    }

    @Test("A file over the size limit is rejected with exit 65; a directory and a missing file with 66 (EX_NOINPUT)")
    func filesystemProblems() async throws {
        let good = try work.write("good.json", #"{"resourceType":"Patient"}"#)
        #expect(try await dq(["enqueue", good], env).status == 0)
        let before = try snapshot()
        let big = try work.write("big.json", #"{"resourceType":"Patient","text":{"div":"\#(String(repeating: "x", count: 5000))"}}"#)
        let over = try await dq(["enqueue", "--max-bytes", "1000", big], env)
        #expect(over.status == 65)
        #expect(over.stderr.contains("over the limit of 1000 bytes"))
        let directory = try await dq(["enqueue", work.path], env)
        #expect(directory.status == 66)
        #expect(directory.stderr.contains("is a directory"))
        let missing = try await dq(["enqueue", work.file("nope.json")], env)
        #expect(missing.status == 66)
        #expect(missing.stderr.contains("no such file"))
        #expect(try snapshot() == before)
    }

    @Test("NDJSON names the bad line and queues none of the good ones")
    func ndjsonBadLine() async throws {
        let file = try work.write(
            "in.ndjson", "{\"resourceType\":\"Patient\"}\n{\"resourceType\":\"Patient\"}\n{broken\n\n{\"resourceType\":\"Patient\"}\n")
        let result = try await dq(["enqueue", "--ndjson", file], env)
        #expect(result.status == 65)
        #expect(result.stderr.contains("in.ndjson:3:"))
        #expect(try snapshot().isEmpty)
    }

    @Test("NDJSON with CRLF line ends and blank lines: lines are numbered as in the file and stored without the CR")
    func ndjsonLineEnds() async throws {
        let bad = try work.write(
            "crlf.ndjson", "{\"resourceType\":\"Patient\"}\r\n \t\r\n\r\n{\"resourceType\":\"Patient\",}\r\n{\"resourceType\":\"Patient\"}")
        let refused = try await dq(["enqueue", "--ndjson", bad], env)
        #expect(refused.status == 65)
        #expect(refused.stderr.contains("crlf.ndjson:4:") && !refused.stderr.contains("crlf.ndjson:1:"), "\(refused.stderr)")
        #expect(try snapshot().isEmpty)

        let good = try work.write(
            "ok.ndjson",
            "{\"resourceType\":\"Patient\",\"id\":\"a\"}\r\n\r\n  \n{\"resourceType\":\"Observation\"}\n{\"resourceType\":\"Basic\"}")
        let queued = try await dq(["enqueue", "--ndjson", good], env)
        #expect(queued.status == 0, "\(queued.stderr)")
        let bodies = try await DatabaseQueue(path: work.file("queue.sqlite")).read { db in
            try String.fetchAll(db, sql: "SELECT CAST(body AS TEXT) FROM item ORDER BY seq")
        }
        #expect(bodies == [#"{"resourceType":"Patient","id":"a"}"#, #"{"resourceType":"Observation"}"#, #"{"resourceType":"Basic"}"#])
    }

    @Test("PUT without an id is rejected; standard input works")
    func putWithoutID() async throws {
        let result = try await dq(["enqueue", "--method", "PUT", "-"], env, stdin: Data(#"{"resourceType":"Patient"}"#.utf8))
        #expect(result.status == 65)
        #expect(result.stderr.contains("<stdin>: a PUT (update) needs the resource's \"id\""))
        let ok = try await dq(["enqueue", "-"], env, stdin: Data(#"{"resourceType":"Patient"}"#.utf8))
        #expect(ok.status == 0)
        #expect(try snapshot().count == 1)
    }

    @Test(
        "Configuration errors exit 78 and name the key",
        arguments: [
            (#"{"server":"http://127.0.0.1:9/fhir","durability":"sometimes"}"#, "\"durability\""),
            (#"{"server":42}"#, "\"server\" must be a string"),
            (#"{"server":"ftp://x"}"#, "\"server\": the URL must be an http or https URL"),
            (#"{"server":"http://127.0.0.1:9/fhir","sever":"typo"}"#, "unknown key \"sever\""),
            (#"{"server":"http://127.0.0.1:9/fhir","settle_seconds":-1}"#, "\"settle_seconds\" must be a number of seconds from 0"),
            (#"{"server":"http://127.0.0.1:9/fhir","auth":{"client_secret":5}}"#, "\"auth.client_secret\" must be a string"),
            (#"{"server":"http://127.0.0.1:9/fhir","retry":{"initial_seconds":"x"}}"#, "\"retry.initial_seconds\" must be a number"),
            ("not json", "is not a JSON object"),
        ])
    func configErrors(config: String, message: String) async throws {
        let path = try work.write("dq.json", config)
        let result = try await dq(["status", "--config", path], ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path])
        #expect(result.status == 78, "\(result.stderr)")
        #expect(result.stderr.contains(message), "\(result.stderr)")
    }

    @Test("A missing server setting exits 78 naming \"server\"; ./dq.json is read when present")
    func missingServer() async throws {
        // (dq status needs no server: without one it shows every queue; flush needs one.)
        let result = try await dq(["flush"], ["HOME": work.path], directory: work.path)
        #expect(result.status == 78)
        #expect(result.stderr.contains("\"server\" is missing"))
        _ = try work.write("dq.json", #"{"server":"http://127.0.0.1:9/fhir","database":"\#(work.file("cfg.sqlite"))"}"#)
        // flush (a writing command) creates the database the file names; nothing is pending, so it exits 0.
        let fromFile = try await dq(["flush", "--json"], ["HOME": work.path], directory: work.path)
        #expect(fromFile.status == 0, "\(fromFile.stderr)")
        #expect(FileManager.default.fileExists(atPath: work.file("cfg.sqlite")))
    }

    @Test("The default database follows XDG and every file is created 0600 in a 0700 directory")
    func defaultLocationAndModes() async throws {
        let xdg = work.file("xdg")
        let result = try await dq(
            ["enqueue", "-"], ["DQ_SERVER": "http://127.0.0.1:9/fhir", "XDG_DATA_HOME": xdg, "HOME": work.path],
            stdin: Data(#"{"resourceType":"Patient"}"#.utf8))
        #expect(result.status == 0, "\(result.stderr)")
        let database = xdg + "/dq/queue.sqlite"
        #expect(FileManager.default.fileExists(atPath: database))
        let flush = try await dq(["flush"], ["DQ_SERVER": "http://127.0.0.1:9/fhir", "XDG_DATA_HOME": xdg, "HOME": work.path])
        #expect(flush.status == 75)
        let files = try FileManager.default.contentsOfDirectory(atPath: xdg + "/dq")
        #expect(files.contains("queue.sqlite"))
        #expect(files.contains { $0.hasPrefix("queue.sqlite.flush-") && $0.hasSuffix(".lock") }, "\(files)")
        for file in files {
            let mode = try FileManager.default.attributesOfItem(atPath: xdg + "/dq/" + file)[.posixPermissions] as? Int
            #expect(mode == 0o600, "\(file) has mode \(String(mode ?? 0, radix: 8))")
        }
        let directoryMode = try FileManager.default.attributesOfItem(atPath: xdg + "/dq")[.posixPermissions] as? Int
        #expect(directoryMode == 0o700)
    }

    @Test("Unknown items give exit 65 with a clear message; usage errors exit 64")
    func unknownItemsAndUsage() async throws {
        #expect(try await dq(["enqueue", "-"], env, stdin: Data(#"{"resourceType":"Patient"}"#.utf8)).status == 0)
        let show = try await dq(["show", "00000000-0000-0000-0000-000000000000"], env)
        #expect(show.status == 65)
        #expect(show.stderr.contains("no queued item"))
        let usage = try await dq(["retry"], env)
        #expect(usage.status == 64)
        let noFiles = try await dq(["enqueue"], env)
        #expect(noFiles.status == 64)
    }

    @Test("A password on the command line, and a client key others can read, are warned about and never printed")
    func exposedSecrets() async throws {
        let password = "pw-\(UUID().uuidString.prefix(8))"
        let status = try await dq(["status", "--database", "postgres://dq:\(password)@127.0.0.1:9/dq"], env)
        #expect(status.stderr.contains("the password in --database is visible to every user in ps"), "\(status.stderr)")
        let proxied = try await dq(["status", "--proxy", "http://u:\(password)@127.0.0.1:9"], env)
        #expect(proxied.stderr.contains("the password in --proxy is visible"), "\(proxied.stderr)")
        for output in [status, proxied] { #expect(!(output.stdout + output.stderr).contains(password)) }

        let key = try work.write("client.key", "not a key")
        chmod(key, 0o644)
        let certificate = try work.write("client.pem", "not a certificate")
        let config = try work.write("dq.json", #"{"tls": {"client_certificate": "client.pem", "client_key": "client.key"}}"#)
        _ = certificate
        let warned = try await dq(["enqueue", "--config", config, try work.write("p.json", #"{"resourceType":"Patient"}"#)], env)
        #expect(warned.stderr.contains("the client key \(key) is readable by others"), "\(warned.stderr)")
        #expect(warned.status == 78 && warned.stderr.contains("client certificate"), "an unreadable certificate: \(warned.stderr)")
    }

    @Test("A server or token URL with a port above 65535 is a configuration error when it is read (78), for every command")
    func portOutOfRange() async throws {
        for command in [["flush"], ["send", try work.write("p.json", #"{"resourceType":"Patient"}"#)], ["status"]] {
            let result = try await dq(command, env.merging(["DQ_SERVER": "http://127.0.0.1:70000/fhir"]) { $1 })
            #expect(result.status == 78, "\(command): \(result.stderr)")
            #expect(result.stderr.contains("port 70000"), "\(result.stderr)")
        }
        let config = try work.write(
            "dq.json", #"{"auth": {"client_id": "c", "client_secret": "s", "token_uri": "http://127.0.0.1:99999/token"}}"#)
        let token = try await dq(["flush", "--config", config], env)
        #expect(token.status == 78 && token.stderr.contains("port 99999"), "\(token.stderr)")
    }

    @Test("An unknown DQ_ variable is warned about with the name it likely meant; the command still runs")
    func unknownEnvironmentVariable() async throws {
        let file = try work.write("p.json", #"{"resourceType":"Patient"}"#)
        let result = try await dq(
            ["enqueue", file], env.merging(["DQ_SEVER": "http://127.0.0.1:9/other", "DQ_TOKEN": "s3cret-token"]) { $1 })
        #expect(result.status == 0, "\(result.stderr)")
        #expect(try snapshot().count == 1, "the enqueue ran")
        #expect(result.stderr.contains("DQ_SEVER is not a dq setting and is ignored (did you mean DQ_SERVER?)"), "\(result.stderr)")
        #expect(
            !result.stderr.contains("DQ_TOKEN") && !result.stderr.contains("/other"),
            "only the unknown name, never a value: \(result.stderr)")
    }

    @Test("A metrics address already in use is a configuration error in words (78), not a socket call's name")
    func metricsAddressInUse() async throws {
        let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(listener) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = 0
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { generic in
                bind(listener, generic, length) == 0 && listen(listener, 1) == 0 && getsockname(listener, generic, &length) == 0
            }
        }
        try #require(bound)
        let port = Int(UInt16(bigEndian: address.sin_port))
        let result = try await dq(["run", "--metrics-address", "127.0.0.1:\(port)"], env)
        #expect(result.status == 78, "\(result.stderr)")
        #expect(result.stderr.contains("cannot serve metrics on 127.0.0.1:\(port): the address is in use"), "\(result.stderr)")
        #expect(!result.stderr.contains("bind(descriptor"))
    }
}
