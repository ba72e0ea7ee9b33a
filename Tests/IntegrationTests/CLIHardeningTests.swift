import FHIRDataQueue
import Foundation
import Testing

/// The command line's answers to bad numbers, bad URLs and files it must not trust: a clear message naming
/// the setting, a sysexits code, no crash, and nothing created or changed.
@Suite(
    "Command-line hardening",
    .enabled(if: Peers.required || FileManager.default.isExecutableFile(atPath: Peers.dqBinary), "dq is not built"))
struct CLIHardeningTests {
    let work: TemporaryDirectory
    let env: [String: String]

    init() throws {
        try #require(
            FileManager.default.isExecutableFile(atPath: Peers.dqBinary),
            "the dq binary \(Peers.dqBinary) is missing or not executable: run swift build (or set DQ_BIN)")
        work = try TemporaryDirectory()
        env = ["DQ_SERVER": "http://127.0.0.1:9/fhir", "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
    }

    func patient() throws -> String { try work.write("p.json", #"{"resourceType":"Patient"}"#) }

    @Test(
        "Bad numbers in flags are usage errors naming the flag, never a crash",
        arguments: [
            (["flush", "--timeout", "nan"], "--timeout"), (["flush", "--timeout", "inf"], "--timeout"),
            (["flush", "--timeout", "1e300"], "--timeout"), (["flush", "--timeout", "0"], "--timeout"),
            (["flush", "--timeout", "-5"], "--timeout"), (["flush", "--wait", "nan"], "--wait"),
            (["flush", "--wait", "-1"], "--wait"), (["flush", "--limit", "-1"], "--limit"),
            (["flush", "--limit", "0"], "--limit"), (["status", "--timeout", "nan"], "--timeout"),
        ])
    func badFlagNumbers(arguments: [String], flag: String) async throws {
        let result = try await dq(arguments, env)
        #expect(result.status == 64, "\(arguments): \(result.stderr)")
        #expect(result.stderr.contains(flag), "\(result.stderr)")
        #expect(!result.stderr.contains("Missing value"), "\(result.stderr)")
        #expect(!result.stderr.contains("Fatal error") && !result.stderr.contains("backtrace"))
    }

    @Test(
        "Bad numbers in the config file are configuration errors naming the key",
        arguments: [
            (#"{"timeout_seconds": 1e300}"#, "timeout_seconds"), (#"{"max_resource_bytes": 1e300}"#, "max_resource_bytes"),
            (#"{"max_resource_bytes": 100.5}"#, "max_resource_bytes"), (#"{"connect_timeout_seconds": 0}"#, "connect_timeout_seconds"),
            (#"{"settle_seconds": -1}"#, "settle_seconds"), (#"{"retry": {"maximum_seconds": 1e300}}"#, "retry.maximum_seconds"),
            (#"{"timeout_seconds": true}"#, "timeout_seconds"),
        ])
    func badFileNumbers(json: String, key: String) async throws {
        let config = try work.write("dq.json", json)
        let result = try await dq(["enqueue", "--config", config, try patient()], env)
        #expect(result.status == 78, "\(json): \(result.stderr)")
        #expect(result.stderr.contains("\"\(key)\""), "\(result.stderr)")
        #expect(!FileManager.default.fileExists(atPath: work.file("queue.sqlite")), "nothing was opened")
    }

    @Test(
        "A server URL with a query, a fragment or credentials is refused, and the password is never printed",
        arguments: ["http://127.0.0.1:9/fhir?x=1", "http://127.0.0.1:9/fhir#f", "http://user:hunter2@127.0.0.1:9/fhir"])
    func badServerURL(url: String) async throws {
        var environment = env
        environment["DQ_SERVER"] = url
        let result = try await dq(["enqueue", try patient()], environment)
        #expect(result.status == 78, "\(result.stderr)")
        #expect(result.stderr.contains("\"server\""), "\(result.stderr)")
        #expect(!(result.stdout + result.stderr).contains("hunter2"))
        #expect(!FileManager.default.fileExists(atPath: work.file("queue.sqlite")))
    }

    @Test("One server however its host's case or default port is written: one queue")
    func serverSpellings() async throws {
        let file = try patient()
        for spelling in ["http://127.0.0.1:9/fhir", "HTTP://127.0.0.1:9/fhir/", "http://127.0.0.1:9/fhir"] {
            var environment = env
            environment["DQ_SERVER"] = spelling
            #expect(try await dq(["enqueue", file], environment).status == 0)
        }
        let status = try await dq(["status", "--json"], env)
        let counts = try #require(try JSONSerialization.jsonObject(with: Data(status.stdout.utf8)) as? [String: Any])
        #expect(counts["pending"] as? Int == 3)
        #expect(counts["queue"] as? String == "http://127.0.0.1:9/fhir")
    }

    @Test("Read commands on a missing database create nothing and fail with 74", arguments: ["status", "list", "log", "show 1"])
    func readCommandsNeedAQueue(command: String) async throws {
        var environment = env
        let database = work.file("nonexistent/dir/x.sqlite")
        environment["DQ_DATABASE"] = database
        let result = try await dq(command.split(separator: " ").map(String.init), environment)
        #expect(result.status == 74, "\(result.stderr)")
        #expect(result.stderr.contains("no queue database"), "\(result.stderr)")
        #expect(!FileManager.default.fileExists(atPath: work.file("nonexistent")))
    }

    @Test("A database truncated to 0 bytes is an error, never a new empty queue")
    func truncatedDatabase() async throws {
        _ = FileManager.default.createFile(atPath: work.file("queue.sqlite"), contents: Data())
        for command in [["status"], ["enqueue", try patient()], ["flush"]] {
            let result = try await dq(command, env)
            #expect(result.status == 74, "\(command): \(result.stderr)")
            #expect(result.stderr.contains("empty (0 bytes)"), "\(result.stderr)")
        }
        #expect((try FileManager.default.attributesOfItem(atPath: work.file("queue.sqlite"))[.size] as? Int) == 0)
    }

    @Test("A database URL dq does not know is a configuration error; no folder named after it appears")
    func databaseURL() async throws {
        var environment = env
        environment["DQ_DATABASE"] = "mysql://dq:secret@db.example/dq"
        let result = try await dq(["enqueue", try patient()], environment, directory: work.path)
        #expect(result.status == 78, "\(result.stderr)")
        #expect(!result.stderr.contains("secret"))
        #expect(!FileManager.default.fileExists(atPath: work.file("mysql:")))
    }

    @Test("A symbolic link planted at the flush lock is refused; its target is untouched")
    func flushLockSymlink() async throws {
        #expect(try await dq(["enqueue", try patient()], env).status == 0)
        #expect(try await dq(["flush"], env).status == 75)
        let lock = try #require(
            try FileManager.default.contentsOfDirectory(atPath: work.path).first { $0.hasPrefix("queue.sqlite.flush-") })
        try FileManager.default.removeItem(atPath: work.file(lock))
        let target = try work.write("precious.txt", "keep me")
        try FileManager.default.createSymbolicLink(atPath: work.file(lock), withDestinationPath: target)
        let result = try await dq(["flush"], env)
        #expect(result.status == 74, "\(result.stderr)")
        #expect(result.stderr.contains("symbolic link"))
        #expect(try String(contentsOfFile: target, encoding: .utf8) == "keep me")
    }

    @Test("Escaped and repeated routing keys: the type and id every receiver reads, or a named refusal")
    func routingKeys() async throws {
        let twice = try work.write("twice.json", #"{"resourceType":"Observation","resource\u0054ype":"Patient"}"#)
        let refused = try await dq(["enqueue", twice], env)
        #expect(refused.status == 65)
        #expect(refused.stderr.contains("twice.json") && refused.stderr.contains("appears twice"), "\(refused.stderr)")
        let escaped = try work.write("escaped.json", #"{"resource\u0054ype":"Patient","i\u0064":"p1"}"#)
        let queued = try await dq(["enqueue", "--json", escaped], env)
        #expect(queued.status == 0, "\(queued.stderr)")
        let items = try #require(try JSONSerialization.jsonObject(with: Data(queued.stdout.utf8)) as? [[String: Any]])
        #expect(items.first?["method"] as? String == "PUT")
        #expect(items.first?["url"] as? String == "Patient/p1")
        let bom = work.file("bom.json")
        try Data([0xEF, 0xBB, 0xBF] + Array(#"{"resourceType":"Patient"}"#.utf8)).write(to: URL(fileURLWithPath: bom))
        let bomResult = try await dq(["enqueue", bom], env)
        #expect(bomResult.status == 65 && bomResult.stderr.contains("byte order mark"), "\(bomResult.stderr)")
    }

    @Test(
        "dq's own keys (log, metrics, poll, drain, readiness) come from the file, their DQ_ variables or a flag, each shown with its origin by dq config; a misspelt one is refused (file) or warned about (variable) with the name it likely meant"
    )
    func daemonKeys() async throws {
        // Every DQ_ variable dq's own sources read beside the library's, each with a value it takes and the key it sets.
        let variables = [
            "DQ_LOG_FORMAT": ("log_format", "json"), "DQ_LOG_LEVEL": ("log_level", "info"),
            "DQ_METRICS_ADDRESS": ("metrics_address", "127.0.0.1:9464"), "DQ_POLL_INTERVAL_SECONDS": ("poll_interval_seconds", "5"),
            "DQ_DRAIN_TIMEOUT_SECONDS": ("drain_timeout_seconds", "3"), "DQ_READY_MAX_AGE_SECONDS": ("ready_max_age_seconds", "600"),
        ]
        let sources = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("../../Sources/dq")
        var read = Set<String>()
        for file in try FileManager.default.contentsOfDirectory(atPath: sources.path) where file.hasSuffix(".swift") {
            let text = try String(contentsOf: sources.appendingPathComponent(file), encoding: .utf8)
            let regex = try NSRegularExpression(pattern: "\"(DQ_[A-Z_]+)\"")
            for match in regex.matches(in: text, range: NSRange(text.startIndex..., in: text)) {
                read.insert(String(text[Range(match.range(at: 1), in: text)!]))
            }
        }
        #expect(read.subtracting(SettingKeys.library.environmentVariables) == Set(variables.keys), "\(read.sorted())")
        func shown(_ result: ProcessResult) throws -> [String: [String: String]] {
            #expect(result.status == 0, "\(result.stderr)")
            return try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: [String: String]])
        }

        // From the variables: each read, shown with its variable, none warned about as unknown.
        let fromVariables = try await dq(["config", "--json"], env.merging(variables.mapValues(\.1)) { $1 })
        let byVariable = try shown(fromVariables)
        for (variable, (key, value)) in variables {
            #expect(byVariable[key] == ["value": value, "origin": "env \(variable)"], "\(key): \(fromVariables.stdout)")
        }
        #expect(!fromVariables.stderr.contains("not a dq setting"), "\(fromVariables.stderr)")

        // From the file (beside a serve object, which dq serve reads itself); a variable over the file; the flag over both.
        let config = try work.write(
            "dq.json",
            #"""
            {"log_format": "json", "log_level": "notice", "metrics_address": "9464", "poll_interval_seconds": 2,
             "drain_timeout_seconds": 0, "ready_max_age_seconds": 30, "serve": {"listen": "127.0.0.1:0"}}
            """#)
        let byFile = try shown(try await dq(["config", "--config", config, "--json"], env))
        for (key, value) in [
            ("log_format", "json"), ("log_level", "notice"), ("metrics_address", "9464"), ("poll_interval_seconds", "2"),
            ("drain_timeout_seconds", "0"), ("ready_max_age_seconds", "30"),
        ] {
            #expect(byFile[key] == ["value": value, "origin": "\(config): \(key)"], "\(key): \(byFile)")
        }
        let over = try shown(
            try await dq(
                ["config", "--config", config, "--json", "--log-format", "text"], env.merging(["DQ_POLL_INTERVAL_SECONDS": "7"]) { $1 }))
        #expect(over["log_format"] == ["value": "text", "origin": "flag --log-format"], "\(over)")
        #expect(over["poll_interval_seconds"] == ["value": "7", "origin": "env DQ_POLL_INTERVAL_SECONDS"], "\(over)")
        #expect(over["log_level"] == ["value": "notice", "origin": "\(config): log_level"], "\(over)")

        // Misspelt: a file's key is refused (78) naming the key it likely meant; a variable is warned about.
        let typo = try await dq(["config", "--config", try work.write("typo.json", #"{"log_levl": "info"}"#)], env)
        #expect(typo.status == 78, "\(typo.stderr)")
        #expect(typo.stderr.contains(#"unknown key "log_levl" (did you mean "log_level"?)"#), "\(typo.stderr)")
        let variableTypo = try await dq(["config"], env.merging(["DQ_POLL_INTERVAL_SECOND": "1"]) { $1 })
        #expect(variableTypo.status == 0, "\(variableTypo.stderr)")
        let warning = "DQ_POLL_INTERVAL_SECOND is not a dq setting and is ignored (did you mean DQ_POLL_INTERVAL_SECONDS?)"
        #expect(variableTypo.stderr.contains(warning), "\(variableTypo.stderr)")
        // A bad value is named by its key or variable (78), at every command, not only dq run.
        for (json, variable, named) in [
            (#"{"log_level": "loud"}"#, [:], #""log_level" must be one of trace"#),
            (#"{"poll_interval_seconds": 0}"#, [:], #""poll_interval_seconds" must be a number of seconds from more than 0"#),
            (#"{"metrics_address": "here"}"#, [:], #""metrics_address" is here: it must be HOST:PORT"#),
            ("{}", ["DQ_READY_MAX_AGE_SECONDS": "soon"], "DQ_READY_MAX_AGE_SECONDS must be a number"),
        ] {
            let bad = try work.write("bad.json", json)
            for command in [["config", "--config", bad], ["enqueue", "--config", bad, try patient()]] {
                let result = try await dq(command, env.merging(variable) { $1 })
                #expect(result.status == 78 && result.stderr.contains(named), "\(command) \(json): \(result.status) \(result.stderr)")
            }
        }
    }
}
