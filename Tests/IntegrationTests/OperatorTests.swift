import Foundation
import GRDB
import Testing

/// What an operator with cron, a terminal and monitoring relies on: exit codes, quiet runs, one view of every
/// queue, the journal's whole story, and messages in words.
@Suite("Operator experience", .serialized, .enabled(if: Peers.enabled))
struct OperatorTests {
    let work: TemporaryDirectory
    let resources = Resources()

    init() throws { work = try TemporaryDirectory() }

    func environment(_ server: String) -> [String: String] {
        ["DQ_SERVER": server, "DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
    }

    func json(_ text: String) throws -> [String: Any] {
        try #require(try JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any])
    }

    @Test("dq config: each setting with its origin (file and key, variable, flag, default), no secret printed; --json; a bad value is 78")
    func configOrigins() async throws {
        let config = try work.write(
            "dq.json",
            #"""
            {"server": "https://fhir.example.org/r4", "database": "postgres://dq:pg-S3CRET@db.example/dq", "timeout_seconds": 12,
             "retry": {"jitter": 0.2}, "auth": {"client_id": "app", "client_secret": "client-S3CRET", "token_uri": "https://auth.example/token"}}
            """#)
        chmod(config, 0o600)
        let env = ["HOME": work.path, "DQ_SETTLE_SECONDS": "3", "HTTPS_PROXY": "http://u:proxy-S3CRET@proxy.example:3128"]
        let shown = try await dq(["config", "--config", config, "--log-format", "json"], env)
        #expect(shown.status == 0, "\(shown.stderr)")
        var origins: [String: (value: String, origin: String)] = [:]
        for line in shown.stdout.split(separator: "\n") {
            let parts = line.split(separator: " ", maxSplits: 1)
            guard parts.count == 2, let open = parts[1].range(of: "  (", options: .backwards) else { continue }
            origins[String(parts[0])] = (
                String(parts[1][..<open.lowerBound]).trimmingCharacters(in: .whitespaces), String(parts[1][open.upperBound...].dropLast())
            )
        }
        #expect(origins.count >= 25, "\(shown.stdout)")
        #expect(origins["timeout_seconds"]?.value == "12" && origins["timeout_seconds"]?.origin == "\(config): timeout_seconds")
        #expect(origins["retry.jitter"]?.origin == "\(config): retry.jitter")
        #expect(origins["settle_seconds"]?.value == "3" && origins["settle_seconds"]?.origin == "env DQ_SETTLE_SECONDS")
        #expect(origins["proxy"]?.origin == "env HTTPS_PROXY" && origins["proxy"]?.value == "http://u:***@proxy.example:3128")
        #expect(origins["log_format"]?.origin == "flag --log-format")
        #expect(origins["connect_timeout_seconds"]?.value == "10" && origins["connect_timeout_seconds"]?.origin == "default")
        #expect(origins["auth.client_secret"]?.value == "(set)")
        #expect(origins["database"]?.value == "postgres://dq:***@db.example/dq")
        for secret in ["pg-S3CRET", "client-S3CRET", "proxy-S3CRET"] {
            #expect(!shown.stdout.contains(secret) && !shown.stderr.contains(secret), "\(secret) printed")
        }

        let asJSON = try await dq(["config", "--config", config, "--json"], env)
        let object = try json(asJSON.stdout)
        #expect((object["settle_seconds"] as? [String: String])?["origin"] == "env DQ_SETTLE_SECONDS", "\(asJSON.stdout)")
        #expect(!asJSON.stdout.contains("S3CRET"))

        let bad = try await dq(["config", "--config", config], env.merging(["DQ_TIMEOUT_SECONDS": "soon"]) { $1 })
        #expect(bad.status == 78 && bad.stderr.contains("DQ_TIMEOUT_SECONDS"), "\(bad.status) \(bad.stderr)")

        // Every other setting is shown too, with the value in effect: the log format from DQ_LOG_FORMAT (it showed
        // the file's or "text"), dq run's settings, the auth and encryption keys; a registration header's value never.
        let more = try work.write(
            "more.json",
            #"""
            {"server": "https://fhir.example.org/r4", "log_format": "text", "log_level": "info", "metrics_address": "127.0.0.1:9464",
             "auth": {"client_id": "app", "client_secret": "client-S3CRET", "registration_uri": "https://auth.example/register",
                      "registration_headers": {"Authorization": "Bearer reg-S3CRET"}, "key_id": "k1"}}
            """#)
        chmod(more, 0o600)
        let moreEnv = [
            "HOME": work.path, "DQ_LOG_FORMAT": "json", "DQ_POLL_INTERVAL_SECONDS": "5",
            "DQ_REGISTRATION_FIELDS": #"{"software_id": "dq-test", "jwks_uri_enabled": false}"#,
        ]
        let full = try await dq(["config", "--config", more, "--json"], moreEnv)
        #expect(full.status == 0, "\(full.stderr)")
        let fullObject = try json(full.stdout)
        func entry(_ key: String) -> [String: String]? { fullObject[key] as? [String: String] }
        #expect(entry("log_format") == ["value": "json", "origin": "env DQ_LOG_FORMAT"], "\(full.stdout)")
        #expect(entry("log_level") == ["value": "info", "origin": "\(more): log_level"])
        #expect(entry("metrics_address") == ["value": "127.0.0.1:9464", "origin": "\(more): metrics_address"])
        #expect(entry("poll_interval_seconds") == ["value": "5", "origin": "env DQ_POLL_INTERVAL_SECONDS"])
        #expect(entry("drain_timeout_seconds") == ["value": "10", "origin": "default"])
        #expect(entry("auth.registration_uri")?["value"] == "https://auth.example/register")
        #expect(entry("auth.key_id") == ["value": "k1", "origin": "\(more): auth.key_id"])
        #expect(entry("auth.registration_headers") == ["value": "Authorization: (set)", "origin": "\(more): auth.registration_headers"])
        #expect(
            entry("auth.registration_fields")
                == ["value": "jwks_uri_enabled=false, software_id=dq-test", "origin": "env DQ_REGISTRATION_FIELDS"])
        for key in ["auth.issuer", "auth.private_key", "auth.credentials_dir", "encryption.mode", "at_rest.old_key_files"] {
            #expect(entry(key) != nil, "\(key) not shown")
        }
        #expect(!full.stdout.contains("S3CRET") && !full.stderr.contains("S3CRET"))
        for (variables, named) in [
            (["DQ_LOG_LEVEL": "loud"], "DQ_LOG_LEVEL"), (["DQ_METRICS_ADDRESS": "here"], "metrics_address"),
            (["DQ_REGISTRATION_HEADERS": "[1]"], "DQ_REGISTRATION_HEADERS"), (["DQ_DRAIN_TIMEOUT_SECONDS": "-1"], "drain_timeout_seconds"),
        ] {
            let refused = try await dq(["config", "--config", more], moreEnv.merging(variables) { $1 })
            #expect(refused.status == 78 && refused.stderr.contains(named), "\(variables): \(refused.status) \(refused.stderr)")
        }
    }

    @Test(
        "Key files named relatively (tls.client_key and _certificate, auth.private_key) are found in $CREDENTIALS_DIRECTORY when it holds them, else beside the config file"
    )
    func keyFilesFromCredentials() async throws {
        let credentials = work.file("credentials")
        try FileManager.default.createDirectory(atPath: credentials, withIntermediateDirectories: true)
        let folder = work.file("etc")
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        // auth.private_key is read when the settings resolve: a real P-256 key, in both places.
        let made = try await ChildProcess(
            "/usr/bin/openssl", ["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", folder + "/jwt.key"]
        ).wait()
        try #require(made.status == 0, "\(made.stderr)")
        chmod(folder + "/jwt.key", 0o600)
        let jwtKey = try #require(FileManager.default.contents(atPath: folder + "/jwt.key"))
        let certified = try await ChildProcess(
            "/usr/bin/openssl",
            [
                "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", folder + "/client.key",
                "-out", folder + "/client.pem", "-days", "2", "-subj", "/CN=dq-client",
            ]
        ).wait()
        try #require(certified.status == 0, "\(certified.stderr)")
        chmod(folder + "/client.key", 0o600)
        _ = FileManager.default.createFile(
            atPath: credentials + "/client.key", contents: FileManager.default.contents(atPath: folder + "/client.key"),
            attributes: [.posixPermissions: 0o600])
        _ = FileManager.default.createFile(atPath: credentials + "/jwt.key", contents: jwtKey, attributes: [.posixPermissions: 0o600])
        let config = folder + "/dq.json"
        try Data(
            #"""
            {"server": "https://fhir.example.org/r4", "tls": {"client_certificate": "client.pem", "client_key": "client.key"},
             "auth": {"client_id": "app", "private_key": "jwt.key", "token_endpoint_auth_method": "private_key_jwt"}}
            """#.utf8
        ).write(to: URL(fileURLWithPath: config))
        let shown = try await dq(["config", "--config", config, "--json"], ["HOME": work.path, "CREDENTIALS_DIRECTORY": credentials])
        // The PEM contents are not checked by dq config; where each file is found is what is shown.
        guard shown.status == 0, let object = try? json(shown.stdout) else {
            Issue.record("dq config: \(shown.status) \(shown.stderr)")
            return
        }
        func value(_ key: String) -> String? { (object[key] as? [String: String])?["value"] }
        #expect(value("tls.client_key") == credentials + "/client.key", "\(shown.stdout)")
        #expect(value("auth.private_key") == credentials + "/jwt.key")
        #expect(value("tls.client_certificate") == folder + "/client.pem", "not in the credentials: beside the config file")
        let without = try await dq(["config", "--config", config, "--json"], ["HOME": work.path])
        #expect((try? json(without.stdout)).flatMap { ($0["tls.client_key"] as? [String: String])?["value"] } == folder + "/client.key")
    }

    @Test("A flush that parked items exits 65; one with nothing to do prints nothing; -q prints errors only")
    func flushExitCodesAndQuiet() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        let empty = try await dq(["flush"], env)
        #expect(empty.status == 0 && empty.stdout.isEmpty && empty.stderr.isEmpty, "\(empty.stdout)\(empty.stderr)")

        let lines = [resources.observation(0), resources.invalid(1), resources.observation(2)]
        let file = try work.write("mixed.ndjson", lines.joined(separator: "\n"))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let parked = try await dq(["flush", "--json"], env)
        #expect(parked.status == 65, "\(parked.stderr)")
        let summary = try json(parked.stdout)
        #expect(summary["parked"] as? Int == 1 && summary["delivered"] as? Int == 2 && summary["exitCode"] as? Int == 65)

        // The next run parks nothing new: 0, and a reminder on stderr (not with -q).
        let again = try await dq(["flush"], env)
        #expect(again.status == 0)
        #expect(again.stdout.isEmpty, "nothing happened: \(again.stdout)")
        #expect(again.stderr.contains("1 parked item(s) need an operator"))
        let quiet = try await dq(["flush", "-q"], env)
        #expect(quiet.status == 0 && quiet.stdout.isEmpty && quiet.stderr.isEmpty)

        let more = try work.write("more.ndjson", resources.ndjson(3..<5))
        #expect(try await dq(["enqueue", "--ndjson", more], env).status == 0)
        let quietDelivery = try await dq(["flush", "--quiet"], env)
        #expect(quietDelivery.status == 0 && quietDelivery.stdout.isEmpty, "\(quietDelivery.stdout)")
        #expect(try await server.values("Observation", system: resources.system) == ["0", "2", "3", "4"])
    }

    @Test("status --all shows every queue; a flush for a server with nothing says where items wait")
    func everyQueue() async throws {
        let server = try await FHIRServer.start()
        let down = "http://127.0.0.1:\(Peers.freePort())/fhir"
        let file = try work.write("two.ndjson", resources.ndjson(0..<2))
        #expect(try await dq(["enqueue", "--ndjson", file], environment(down)).status == 0)
        #expect(try await dq(["enqueue", "--ndjson", file], environment(server.base)).status == 0)
        #expect(try await dq(["flush"], environment(server.base)).status == 0)

        let flush = try await dq(["flush"], environment(server.base))
        #expect(flush.status == 0)
        #expect(flush.stderr.contains("2 item(s) wait for \(down)"), "\(flush.stderr)")

        let all = try await dq(["status", "--all", "--json"], environment(server.base))
        let statuses = try #require(try JSONSerialization.jsonObject(with: Data(all.stdout.utf8)) as? [[String: Any]])
        #expect(statuses.count == 2)
        let byQueue = Dictionary(uniqueKeysWithValues: statuses.map { ($0["queue"] as? String ?? "", $0) })
        #expect(byQueue[down]?["pending"] as? Int == 2)
        #expect(byQueue[server.base]?["delivered"] as? Int == 2)
        // No server configured at all: every queue, too.
        let noServer = try await dq(["status"], ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path])
        #expect(noServer.status == 0, "\(noServer.stderr)")
        #expect(noServer.stdout.contains(down) && noServer.stdout.contains(server.base))
    }

    @Test("show reads a delivered item from the journal; log shows parked and dropped events with their status")
    func journalStory() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        let file = try work.write("two.ndjson", [resources.observation(0), resources.invalid(1)].joined(separator: "\n"))
        let queued = try await dq(["enqueue", "--ndjson", "--json", file], env)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(queued.stdout.utf8)) as? [[String: Any]])
        let delivered = try #require(items.first?["id"] as? String)
        let rejected = try #require(items.last?["id"] as? String)
        #expect(try await dq(["flush"], env).status == 65)

        let show = try await dq(["show", delivered], env)
        #expect(show.status == 0, "\(show.stderr)")
        #expect(show.stdout.contains("delivered (from the journal"))
        #expect(show.stdout.contains(server.base + "/Observation/"))

        let retried = try await dq(["retry", "--json", rejected], env)
        #expect(
            try json(retried.stdout)["item"] as? String == rejected && json(retried.stdout)["retried"] as? Int == 1, "\(retried.stdout)")
        #expect(try await dq(["flush"], env).status == 65, "rejected again: parked again")
        let dropped = try await dq(["drop", "--json", rejected], env)
        #expect(try json(dropped.stdout)["dropped"] as? String == rejected, "\(dropped.stdout)\(dropped.stderr)")
        let log = try await dq(["log", "--json"], env)
        let journal = try #require(try JSONSerialization.jsonObject(with: Data(log.stdout.utf8)) as? [[String: Any]])
        #expect(journal.map { $0["event"] as? String } == ["delivered", "parked", "parked", "dropped"], "\(log.stdout)")
        #expect(journal[1]["status"] as? Int == 400 && (journal[1]["note"] as? String)?.contains("400") == true)
        #expect(journal[3]["status"] as? Int == 400, "a dropped item keeps its last status")
        let shown = try await dq(["show", rejected], env)
        #expect(shown.status == 0 && shown.stdout.contains("dropped"))
    }

    @Test("list says when it shows only part of the queue")
    func listNotice() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        let file = try work.write("three.ndjson", resources.ndjson(0..<3))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        let list = try await dq(["list", "--limit", "2", "--json"], env)
        #expect(list.status == 0)
        let items = try #require(try JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [[String: Any]])
        #expect(items.count == 2)
        #expect(list.stderr.contains("showing the first 2 of 3 items"), "\(list.stderr)")
        let all = try await dq(["list"], env)
        #expect(all.stderr.isEmpty)
    }

    @Test("A missing input file exits 66; a pipe given as a path (process substitution) is read")
    func inputFiles() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        let missing = try await dq(["enqueue", work.file("nope.json")], env)
        #expect(missing.status == 66, "\(missing.stderr)")
        #expect(missing.stderr.contains("nope.json: no such file"))
        let piped = try await dq(["enqueue", "/dev/stdin"], env, stdin: Data(#"{"resourceType":"Patient"}"#.utf8))
        #expect(piped.status == 0, "\(piped.stderr)")
    }

    @Test("Malformed JSON in the config file names the line and column")
    func configLineColumn() async throws {
        let config = try work.write("dq.json", "{\n  \"server\": \"http://127.0.0.1:9/fhir\",\n  oops\n}")
        let result = try await dq(["status", "--config", config], environment("http://127.0.0.1:9/fhir"))
        #expect(result.status == 78)
        #expect(result.stderr.contains("line 3"), "\(result.stderr)")
    }

    @Test("Help and usage: dq alone is a usage error, read commands offer no sending options, version prints")
    func helpAndUsage() async throws {
        let bare = try await dq([], [:])
        #expect(bare.status == 64)
        #expect(bare.stderr.contains("SUBCOMMANDS"))
        let statusHelp = try await dq(["status", "--help"], [:])
        #expect(statusHelp.status == 0)
        #expect(!statusHelp.stdout.contains("--idempotent") && !statusHelp.stdout.contains("--durability"))
        #expect(!statusHelp.stdout.contains("(default: "), "no doubled defaults")
        let showHelp = try await dq(["show", "--help"], [:])
        #expect(showHelp.stdout.contains("suffix"))
        let flushHelp = try await dq(["flush", "--help"], [:])
        #expect(flushHelp.stdout.contains("--quiet") && flushHelp.stdout.contains("--idempotent"))
        let version = try await dq(["version"], [:])
        #expect(version.status == 0 && version.stdout.hasPrefix("dq "))
        let completion = try await dq(["--generate-completion-script", "bash"], [:])
        #expect(completion.status == 0 && completion.stdout.contains("_dq"))
    }

    @Test("Warnings: a config file with a secret readable by others, a token over plain http to another host")
    func exposureWarnings() async throws {
        let config = try work.write(
            "dq.json", #"{"server":"http://fhir.example.invalid/fhir","auth":{"bearer_token":"s3cr3t-value"}}"#)
        chmod(config, 0o644)
        let result = try await dq(
            ["enqueue", "--config", config, "-"], ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path],
            stdin: Data(#"{"resourceType":"Patient"}"#.utf8))
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stderr.contains("readable by others") && result.stderr.contains("chmod 600"))
        #expect(result.stderr.contains("plain http to fhir.example.invalid"))
        #expect(!result.stderr.contains("s3cr3t-value"))
        chmod(config, 0o600)
        let quiet = try await dq(["status", "--config", config], ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path])
        #expect(!quiet.stderr.contains("readable by others"))
        // Readable by its group only and owned by root, as the Debian package installs /etc/dq/dq.json (root:dq
        // 0640, for the dq user's units): no warning, as libpq accepts such a key; chmod 600 would lock the
        // service out. Anyone else's file readable by its group: a warning.
        chmod(config, 0o640)
        let grouped = try await dq(["status", "--config", config], ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path])
        #expect(grouped.stderr.contains("readable by others") == (getuid() != 0), "uid \(getuid()): \(grouped.stderr)")
        chmod(config, 0o600)
        // A config file mounted as a link (a ConfigMap, /etc/dq/dq.json -> a managed file) is judged by the file it
        // names: a link's own mode is always 0777, and a private file behind it draws no warning.
        let link = work.file("linked.json")
        try FileManager.default.createSymbolicLink(atPath: link, withDestinationPath: config)
        let linked = try await dq(["status", "--config", link], ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path])
        #expect(linked.status == 0 && !linked.stderr.contains("readable by others"), "\(linked.stderr)")
        chmod(config, 0o644)
        let exposed = try await dq(["status", "--config", link], ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path])
        #expect(exposed.stderr.contains("\(link) holds a secret and is readable by others"), "\(exposed.stderr)")
    }

    @Test("doctor: a sound database is ok (0); a damaged one exits 74 with the recovery steps")
    func doctor() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        let file = try work.write("many.ndjson", resources.ndjson(0..<400))
        #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
        // Nothing answers at port 9: --offline checks the settings and the database only.
        let sound = try await dq(["doctor", "--offline"], env)
        #expect(sound.status == 0 && sound.stdout.contains(": ok"), "\(sound.stderr)")
        let soundJSON = try await dq(["doctor", "--json", "--offline"], env)
        let report = try json(soundJSON.stdout)
        #expect(report["ok"] as? Bool == true && (report["problems"] as? [Any])?.isEmpty == true, "\(soundJSON.stdout)")
        let routes = report["routes"] as? [[String: String]] ?? []
        #expect(routes.first?["endpoint"] == "server" && routes.first?["route"] == "direct", "\(soundJSON.stdout)")
        // Overwrite pages in the middle of the file (the item table's b-tree), as a failing disk would.
        let handle = try FileHandle(forWritingTo: URL(fileURLWithPath: work.file("queue.sqlite")))
        try handle.seek(toOffset: 4096 * 4)
        try handle.write(contentsOf: Data(repeating: 0xA5, count: 4096 * 3))
        try handle.close()
        let damaged = try await dq(["doctor"], env)
        #expect(damaged.status == 74, "\(damaged.stdout)\(damaged.stderr)")
        #expect(damaged.stderr.contains(".dump") && damaged.stderr.contains("rm -f"), "\(damaged.stderr)")
        let damagedJSON = try await dq(["doctor", "--json"], env)
        #expect(damagedJSON.status == 74)
        let damage = try json(damagedJSON.stdout)
        #expect(damage["ok"] as? Bool == false && !((damage["problems"] as? [String]) ?? []).isEmpty, "\(damagedJSON.stdout)")
    }

    @Test(
        "Config discovery: --config, $DQ_CONFIG, ./dq.json, then $XDG_CONFIG_HOME/dq/dq.json (else ~/.config/dq/dq.json); secrets from files, found in $CREDENTIALS_DIRECTORY"
    )
    func configDiscoveryAndSecretFiles() async throws {
        let server = try FHIRServer(tokens: ["file-t0ken-value"], readerToken: "file-t0ken-value")
        try await server.start()
        let home = work.file("home")
        try FileManager.default.createDirectory(atPath: home + "/.config/dq", withIntermediateDirectories: true)
        let credentials = work.file("creds")
        try FileManager.default.createDirectory(atPath: credentials, withIntermediateDirectories: true)
        _ = FileManager.default.createFile(
            atPath: credentials + "/token", contents: Data("file-t0ken-value\n".utf8), attributes: [.posixPermissions: 0o600])
        let config = #"{"server": "\#(server.base)", "auth": {"bearer_token_file": "token"}}"#
        _ = FileManager.default.createFile(atPath: home + "/.config/dq/dq.json", contents: Data(config.utf8))
        var env = ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": home, "CREDENTIALS_DIRECTORY": credentials]
        let directory = work.file("elsewhere")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let file = try work.write("one.json", resources.observation(0))
        #expect(try await dq(["enqueue", file], env, directory: directory).status == 0, "the server comes from ~/.config/dq/dq.json")
        let flushed = try await dq(["flush"], env, directory: directory)
        #expect(flushed.status == 0, "the token comes from $CREDENTIALS_DIRECTORY/token: \(flushed.stderr)")
        #expect(try await server.values("Observation", system: resources.system) == ["0"])
        #expect(!flushed.stdout.contains("file-t0ken-value") && !flushed.stderr.contains("file-t0ken-value"))

        // $XDG_CONFIG_HOME wins over ~/.config; ./dq.json wins over both.
        let xdg = work.file("xdg")
        try FileManager.default.createDirectory(atPath: xdg + "/dq", withIntermediateDirectories: true)
        _ = FileManager.default.createFile(atPath: xdg + "/dq/dq.json", contents: Data(#"{"server": "http://xdg.invalid/fhir"}"#.utf8))
        env["XDG_CONFIG_HOME"] = xdg
        #expect(try await dq(["doctor"], env, directory: directory).stdout.contains("http://xdg.invalid/fhir"))
        _ = FileManager.default.createFile(atPath: directory + "/dq.json", contents: Data(#"{"server": "http://here.invalid/fhir"}"#.utf8))
        #expect(try await dq(["doctor"], env, directory: directory).stdout.contains("http://here.invalid/fhir"))
        // $DQ_CONFIG wins over every file found, and --config over $DQ_CONFIG; dq config names the file.
        let named = try work.write("named.json", #"{"server": "http://named.invalid/fhir"}"#)
        let flagged = try work.write("flagged.json", #"{"server": "http://flagged.invalid/fhir"}"#)
        let byVariable = try await dq(["config"], env.merging(["DQ_CONFIG": named]) { $1 }, directory: directory)
        #expect(
            byVariable.stdout.contains("http://named.invalid/fhir") && byVariable.stdout.contains("\(named): server"),
            "\(byVariable.stdout)")
        let byFlag = try await dq(["config", "--config", flagged], env.merging(["DQ_CONFIG": named]) { $1 }, directory: directory)
        #expect(byFlag.stdout.contains("http://flagged.invalid/fhir"), "\(byFlag.stdout)")
        try FileManager.default.removeItem(atPath: directory + "/dq.json")
        env["XDG_CONFIG_HOME"] = nil

        // A secret mounted as a link (systemd's credentials, a Kubernetes secret volume) is judged by the file it
        // names: a link to a private file draws no warning.
        try FileManager.default.moveItem(atPath: credentials + "/token", toPath: work.file("token-store"))
        try FileManager.default.createSymbolicLink(atPath: credentials + "/token", withDestinationPath: work.file("token-store"))
        let linked = try await dq(["status"], env, directory: directory)
        #expect(linked.status == 0 && !linked.stderr.contains("readable by others"), "\(linked.stderr)")
        // A secret file others can read (here through the link): a warning; a missing one: 78 naming the setting;
        // both forms: 78.
        chmod(credentials + "/token", 0o644)
        let warned = try await dq(["status"], env, directory: directory)
        #expect(warned.stderr.contains("the secret file \(credentials)/token is readable by others"), "\(warned.stderr)")
        try FileManager.default.removeItem(atPath: credentials + "/token")
        let missing = try await dq(["flush"], env, directory: directory)
        #expect(missing.status == 78 && missing.stderr.contains("auth.bearer_token_file"), "\(missing.stderr)")
        let both = try work.write(
            "both.json", #"{"server": "http://h.invalid/fhir", "auth": {"bearer_token": "x", "bearer_token_file": "t"}}"#)
        let refused = try await dq(["status", "--config", both], env)
        #expect(refused.status == 78 && refused.stderr.contains("bearer_token_file"), "\(refused.stderr)")
    }

    @Test("dq prune deletes only journal lines older than asked; journal_retention_days applies at every dq flush")
    func pruneJournal() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        #expect(try await dq(["enqueue", "--ndjson", try work.write("three.ndjson", resources.ndjson(0..<3))], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        let kept = try await dq(["prune", "--journal-older-than", "1d"], env)
        #expect(kept.status == 0 && kept.stdout.contains("pruned 0 journal line(s)"), "\(kept.stdout)\(kept.stderr)")
        #expect(try await dq(["log", "--json"], env).stdout.components(separatedBy: "\"delivered\"").count == 4)
        #expect(try await dq(["enqueue", try work.write("late.json", resources.observation(3))], env).status == 0)
        let all = try await dq(["prune", "--journal-older-than", "0s", "--vacuum", "--json"], env)
        #expect(
            all.status == 0 && (all.stdout.contains(#""journalLines" : 3"#) || all.stdout.contains(#""journalLines":3"#)),
            "\(all.status) \(all.stdout)")
        let status = try await dq(["status", "--json"], env)
        #expect(
            status.stdout.contains(#""pending" : 1"#) || status.stdout.contains(#""pending":1"#), "the queued item stays: \(status.stdout)")
        #expect(try await dq(["prune", "--journal-older-than", "soon"], env).status == 64)

        // Retention at flush time: a line older than journal_retention_days goes at the next dq flush.
        #expect(try await dq(["flush"], env).status == 0)
        let config = try work.write("dq.json", #"{"journal_retention_days": 0.00001}"#)
        try await Task.sleep(for: .seconds(1.2))  // older than 0.864 s
        #expect(try await dq(["flush", "--config", config], env).status == 0)
        let log = try await dq(["log", "--json"], env)
        #expect(!log.stdout.contains("\"delivered\""), "the line went with the retention: \(log.stdout)")
        let bad = try await dq(["flush", "--config", try work.write("bad.json", #"{"journal_retention_days": -1}"#)], env)
        #expect(bad.status == 78 && bad.stderr.contains("journal_retention_days"), "\(bad.stderr)")

        // Retention under dq run: applied when it starts (then daily); the lines go, the queued item stays.
        #expect(try await dq(["enqueue", "--ndjson", try work.write("more.ndjson", resources.ndjson(4..<6))], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        #expect(try await dq(["log", "--json"], env).stdout.components(separatedBy: "\"delivered\"").count == 3)
        try await Task.sleep(for: .seconds(1.2))
        let run = try ChildProcess(
            Peers.dqBinary, ["run", "--config", config, "--poll-interval", "0.2"],
            environment: env.merging(["DQ_LOG_LEVEL": "notice"]) { $1 })
        let runLog = { (try? String(contentsOfFile: run.stderrPath, encoding: .utf8)) ?? "" }
        #expect(try await eventually { runLog().contains("pruned the delivery journal") }, "\(runLog())")
        run.kill(SIGTERM)
        let ran = await run.wait(timeout: .seconds(30))
        #expect(ran.status == 0 && ran.stderr.contains("lines=2"), "\(ran.stderr)")
        #expect(!(try await dq(["log", "--json"], env).stdout.contains("\"delivered\"")), "the lines went under dq run")
    }

    @Test(
        "dq prune --vacuum gives the space of delivered items and pruned lines back to the file system; without it the file keeps its size")
    func pruneVacuum() async throws {
        let server = try await FHIRServer.start()
        let env = environment(server.base)
        let padding = String(repeating: "p", count: 4000)
        let bulk = (0..<500).map { resources.observation($0, extra: padding) }.joined(separator: "\n")
        #expect(try await dq(["enqueue", "--ndjson", try work.write("bulk.ndjson", bulk)], env).status == 0)
        #expect(try await dq(["flush"], env).status == 0)
        #expect(try await server.values("Observation", system: resources.system).count == 500)
        let database = work.file("queue.sqlite")
        func size() throws -> Int { try #require(try FileManager.default.attributesOfItem(atPath: database)[.size] as? Int) }
        let delivered = try size()
        #expect(delivered > 2_000_000, "the delivered items' pages are still in the file: \(delivered)")
        let pruned = try await dq(["prune", "--journal-older-than", "0s"], env)
        #expect(pruned.status == 0 && pruned.stdout.contains("pruned 500 journal line(s)"), "\(pruned.stdout)\(pruned.stderr)")
        #expect(try size() >= delivered, "without --vacuum SQLite keeps the free pages")
        let vacuumed = try await dq(["prune", "--journal-older-than", "0s", "--vacuum"], env)
        #expect(vacuumed.status == 0 && vacuumed.stdout.contains("vacuumed"), "\(vacuumed.stdout)\(vacuumed.stderr)")
        let after = try size()
        #expect(after < delivered / 4, "the space went back: \(delivered) then \(after) bytes")
        let status = try await dq(["status", "--json"], env)
        #expect(try json(status.stdout)["pending"] as? Int == 0, "\(status.stdout)")
    }

    @Test("status --check: a monitoring plugin's line and exit codes (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN) on crafted queues")
    func statusCheck() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        let empty = try await dq(["status", "--check"], env)
        #expect(empty.status == 3 && empty.stdout.hasPrefix("DQ UNKNOWN - "), "no database yet: \(empty.stdout)")
        // A check that cannot run for a bad argument is UNKNOWN too, not a usage error (64) a plugin misreads.
        let misused = try await dq(["status", "--check", "--max-pending", "many"], env)
        #expect(misused.status == 3 && misused.stderr.contains("--max-pending"), "\(misused.status) \(misused.stderr)")
        #expect(try await dq(["status", "--max-pending", "many"], env).status == 64, "without --check: a usage error")
        #expect(try await dq(["enqueue", "--ndjson", try work.write("three.ndjson", resources.ndjson(0..<3))], env).status == 0)
        let ok = try await dq(["status", "--check", "--max-pending", "10"], env)
        #expect(ok.status == 0 && ok.stdout.hasPrefix("DQ OK - 3 pending, 0 parked"), "\(ok.stdout)")
        #expect(ok.stdout.contains("| pending=3;;10;0 parked=0;;;0"), "performance data: \(ok.stdout)")
        let many = try await dq(["status", "--check", "--max-pending", "2"], env)
        #expect(many.status == 2 && many.stdout.hasPrefix("DQ CRITICAL - 3 pending (limit 2)"), "\(many.stdout)")

        // Two hours old, one parked: the age and parked limits.
        let db = try DatabaseQueue(path: work.file("queue.sqlite"))
        try await db.write { db in
            try db.execute(sql: "UPDATE item SET enqueued_at = enqueued_at - 7200")
            try db.execute(sql: "UPDATE item SET state = 'parked' WHERE seq = (SELECT max(seq) FROM item)")
        }
        try db.close()
        let old = try await dq(["status", "--check", "--max-age", "1h"], env)
        #expect(old.status == 2 && old.stdout.contains("the oldest pending item waits 720"), "\(old.stdout)")
        #expect(try await dq(["status", "--check", "--max-age", "3h"], env).status == 0)
        let parked = try await dq(["status", "--check", "--max-parked", "0"], env)
        #expect(parked.status == 2 && parked.stdout.contains("1 parked (limit 0)"), "\(parked.stdout)")

        // A flush that cannot reach the server: WARNING, delivery failing.
        #expect(try await dq(["flush"], env).status == 75)
        let failing = try await dq(["status", "--check", "--max-pending", "10"], env)
        #expect(failing.status == 1 && failing.stdout.hasPrefix("DQ WARNING - delivery failing (1 in a row)"), "\(failing.stdout)")
        let usage = try await dq(["status", "--max-pending", "1"], env)
        #expect(usage.status != 0 && usage.stderr.contains("go with --check"), "\(usage.stderr)")
    }

    @Test("doctor shows how each endpoint is reached: through which proxy (password redacted) or directly")
    func doctorRoutes() async throws {
        let config = try work.write(
            "dq.json",
            #"""
            {"server": "https://fhir.example.invalid/fhir", "proxy": "http://ops:pr0xy-s3cret@proxy.example.invalid:3128",
             "no_proxy": ".internal.invalid",
             "auth": {"client_id": "c", "token_uri": "https://login.internal.invalid/token",
                      "registration_uri": "https://register.example.invalid/register", "issuer": "https://id.example.invalid"},
             "encryption": {"endpoint": "https://receiver.internal.invalid/envelopes"}}
            """#)
        chmod(config, 0o600)
        var env = ["DQ_DATABASE": work.file("queue.sqlite"), "HOME": work.path]
        _ = try await dq(["enqueue", "--config", config, try work.write("p.json", #"{"resourceType":"Patient"}"#)], env)
        env["HTTPS_PROXY"] = "http://ignored.invalid:1"  // the file's proxy wins
        let doctor = try await dq(["doctor", "--config", config], env)
        let lines = doctor.stdout.split(separator: "\n").map(String.init)
        let proxy = "(through proxy http://ops:***@proxy.example.invalid:3128)"
        #expect(
            lines.contains { $0.hasPrefix("server:") && $0.hasSuffix("https://fhir.example.invalid/fhir \(proxy)") }, "\(doctor.stdout)")
        #expect(lines.contains { $0.hasPrefix("token:") && $0.hasSuffix("https://login.internal.invalid/token (direct)") }, "\(lines)")
        #expect(lines.contains { $0.hasPrefix("registration:") && $0.hasSuffix(proxy) }, "\(lines)")
        #expect(
            lines.contains { $0.hasPrefix("issuer (JWKS):") && $0.contains("id.example.invalid/.well-known/openid-configuration \(proxy)") }
        )
        #expect(lines.contains { $0.hasPrefix("encrypted endpoint:") && $0.hasSuffix("(direct)") }, "\(lines)")
        #expect(!doctor.stdout.contains("pr0xy-s3cret") && !doctor.stderr.contains("pr0xy-s3cret"), "the proxy password is never printed")
    }

    @Test("doctor: the printed steps, run as printed, recover the readable items of a damaged file and of its WAL")
    func doctorRecovers() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        let database = work.file("queue.sqlite")
        #expect(try await dq(["enqueue", "--ndjson", try work.write("a.ndjson", resources.ndjson(0..<300))], env).status == 0)
        // Ten more committed only to the WAL (a read transaction keeps them from being checkpointed), and the
        // file and WAL copied as a crash would leave them.
        var configuration = Configuration()
        configuration.allowsUnsafeTransactions = true
        let reader = try DatabaseQueue(path: database, configuration: configuration)
        try await reader.writeWithoutTransaction { db in try db.execute(sql: "BEGIN; SELECT count(*) FROM item") }
        #expect(try await dq(["enqueue", "--ndjson", try work.write("b.ndjson", resources.ndjson(300..<310))], env).status == 0)
        let crash = work.file("crash")
        try FileManager.default.createDirectory(atPath: crash, withIntermediateDirectories: true)
        for suffix in ["", "-wal"] { try FileManager.default.copyItem(atPath: database + suffix, toPath: crash + "/queue.sqlite" + suffix) }
        try await reader.writeWithoutTransaction { db in try db.execute(sql: "COMMIT") }
        try reader.close()

        // One page of queued bodies in the middle of the item table overwritten, as a failing disk would.
        let damagedFile = crash + "/queue.sqlite"
        let bytes = try Data(contentsOf: URL(fileURLWithPath: damagedFile))
        let bodyPages = stride(from: 0, to: bytes.count, by: 4096).filter {
            bytes[$0..<min($0 + 4096, bytes.count)].range(of: Data(#""resourceType""#.utf8)) != nil
        }
        #expect(bodyPages.count > 5, "the item table's pages are in the file")
        let handle = try FileHandle(forWritingTo: URL(fileURLWithPath: damagedFile))
        try handle.seek(toOffset: UInt64(bodyPages[bodyPages.count / 2]))
        try handle.write(contentsOf: Data(repeating: 0xA5, count: 4096))
        try handle.close()
        var crashEnv = env
        crashEnv["DQ_DATABASE"] = damagedFile
        let damaged = try await dq(["doctor"], crashEnv)
        #expect(damaged.status == 74, "\(damaged.stdout)\(damaged.stderr)")
        let steps = damaged.stderr.split(separator: "\n").filter { $0.hasPrefix("  ") }.map { String($0.dropFirst(2)) }
        #expect(steps.count == 7, "copy, copy the WAL, clear, dump, owner, remove the old WAL and SHM, put in place: \(damaged.stderr)")
        for step in steps {
            let ran = try await ChildProcess("/bin/sh", ["-c", step]).wait()
            #expect(ran.status == 0, "\(step): \(ran.stderr)")
        }

        let mode = try FileManager.default.attributesOfItem(atPath: damagedFile)[.posixPermissions] as? Int
        #expect(mode == 0o600, "the recovered file is its owner's only: \(String(mode ?? 0, radix: 8))")
        let healed = try await dq(["doctor", "--offline"], crashEnv)
        #expect(healed.status == 0 && healed.stdout.contains(": ok"), "\(healed.stdout)\(healed.stderr)")
        let listed = try await dq(["list", "--json"], crashEnv)
        #expect(listed.status == 0, "\(listed.stderr)")
        let items = try JSONSerialization.jsonObject(with: Data(listed.stdout.utf8)) as? [[String: Any]] ?? []
        let sequences = items.compactMap { $0["sequence"] as? Int }
        #expect(sequences.count > 250 && sequences.count < 310, "all but the damaged page's items: \(sequences.count)")
        #expect(Set(301...310).isSubset(of: Set(sequences)), "the items only the WAL held are saved")
        #expect(sequences == sequences.sorted() && Set(sequences).count == sequences.count, "in order, once each")
        // The recovered queue takes new items after every number it ever handed out.
        #expect(try await dq(["enqueue", "--ndjson", try work.write("c.ndjson", resources.ndjson(310..<311))], crashEnv).status == 0)
        let after = try await dq(["list", "--json"], crashEnv)
        let last = (try JSONSerialization.jsonObject(with: Data(after.stdout.utf8)) as? [[String: Any]])?.last?["sequence"] as? Int
        #expect(last == 311, "\(after.stdout.suffix(300))")
    }

    @Test("doctor: a file whose schema page is damaged cannot be read by any SQLite tool: it says so, and to restore a backup")
    func doctorSchemaDamaged() async throws {
        let env = environment("http://127.0.0.1:9/fhir")
        #expect(try await dq(["enqueue", "--ndjson", try work.write("a.ndjson", resources.ndjson(0..<50))], env).status == 0)
        let handle = try FileHandle(forWritingTo: URL(fileURLWithPath: work.file("queue.sqlite")))
        try handle.seek(toOffset: 100)
        try handle.write(contentsOf: Data(repeating: 0, count: 4096 - 100))
        try handle.close()
        let status = try await dq(["status"], env)
        #expect(status.status == 74, "\(status.stderr)")
        #expect(status.stderr.contains("the queue database is damaged") && status.stderr.contains("dq doctor"), "\(status.stderr)")
        let doctor = try await dq(["doctor"], env)
        #expect(doctor.status == 74, "\(doctor.stdout)\(doctor.stderr)")
        #expect(doctor.stderr.contains("schema") && doctor.stderr.contains("restore the queue from a backup"), "\(doctor.stderr)")
        #expect(!doctor.stderr.contains("dq doctor says"), "doctor does not send the reader to itself")
    }

    /// A self-signed certificate and its key (made by the openssl CLI) in the work directory: their paths.
    func certificate(name: String, alternativeNames: String) async throws -> (String, String) {
        let cert = work.file("tls.crt")
        let key = work.file("tls.key")
        let made = try await ChildProcess(
            "/usr/bin/openssl",
            [
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj",
                "/CN=\(name)", "-addext", "subjectAltName=\(alternativeNames)",
            ]
        ).wait()
        #expect(made.status == 0, "\(made.stderr)")
        return (cert, key)
    }

    @Test("Over TLS with a trusted certificate, items reach the server by IP address and by host name, in order")
    func tlsDelivery() async throws {
        let server = try await FHIRServer.start()
        let (cert, key) = try await certificate(name: "localhost", alternativeNames: "DNS:localhost,IP:127.0.0.1")
        let proxy = try await FaultProxy(upstreamPort: server.port, tls: (cert, key))
        for (round, host) in ["127.0.0.1", "localhost"].enumerated() {
            var env = environment("https://\(host):\(proxy.port)/fhir")
            env["DQ_CA_BUNDLE"] = cert
            let lines = (0..<3).map { resources.observation(round * 3 + $0) }
            let file = try work.write("tls-\(round).ndjson", lines.joined(separator: "\n"))
            #expect(try await dq(["enqueue", "--ndjson", file], env).status == 0)
            let flushed = try await dq(["flush", "--now"], env)
            #expect(flushed.status == 0, "\(flushed.stderr)")
        }
        #expect(try await server.values("Observation", system: resources.system) == (0..<6).map(String.init))
    }

    @Test("TLS failures are named in words: an untrusted issuer, a name mismatch")
    func tlsInWords() async throws {
        let server = try await FHIRServer.start()
        let (cert, key) = try await certificate(name: "elsewhere.example", alternativeNames: "DNS:elsewhere.example")
        let proxy = try await FaultProxy(upstreamPort: server.port, tls: (cert, key))
        let env = environment("https://127.0.0.1:\(proxy.port)/fhir")
        let sample = try work.write("p.json", resources.observation(0))
        let untrusted = try await dq(["send", sample], env)
        #expect(untrusted.status == 75)
        #expect(untrusted.stderr.contains("not from a trusted issuer"), "\(untrusted.stderr)")
        #expect(!untrusted.stderr.contains("CNIOBoring") && !untrusted.stderr.contains("swift-nio-ssl"))
        var trusted = env
        trusted["DQ_CA_BUNDLE"] = cert
        let mismatch = try await dq(["flush", "--now"], trusted)
        #expect(mismatch.status == 75)
        #expect(mismatch.stderr.contains("does not name this host"), "\(mismatch.stderr)")
    }
}
