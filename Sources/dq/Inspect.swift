import ArgumentParser
import FHIRDataQueue
import Foundation
import Logging

extension DQ {
    struct Status: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "status",
            abstract: "Show counts of the queue and the server's backoff state.",
            discussion: "With --all, or when no server is configured, every queue in the database is shown.")
        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Every queue in the database, whatever server is configured.") var all = false
        @Flag(help: "Print as JSON.") var json = false
        @Flag(
            help: """
                One line and a monitoring plugin's exit code (Nagios, Icinga, cron mail): 0 OK, 1 WARNING (delivery is \
                failing: the server is down or refuses), 2 CRITICAL (a --max-… limit is passed), 3 UNKNOWN (the queue \
                cannot be read), with performance data after '|'.
                """)
        var check = false
        @Option(parsing: .unconditional, help: "With --check: CRITICAL above this many pending items.") var maxPending: Int?
        @Option(help: "With --check: CRITICAL when the oldest pending item is older than this (90s, 15m, 2h, 1d).")
        var maxAge: String?
        @Option(parsing: .unconditional, help: "With --check: CRITICAL above this many parked items.") var maxParked: Int?

        func validate() throws {
            if !check && (maxPending != nil || maxAge != nil || maxParked != nil) {
                throw ValidationError("--max-pending, --max-age and --max-parked go with --check")
            }
            if let maxAge, (parseDuration(maxAge) ?? .infinity) > 3_153_600_000 {
                throw ValidationError("--max-age must be a duration like 90s, 15m, 2h or 1d")
            }
            if (maxPending ?? 0) < 0 || (maxParked ?? 0) < 0 { throw ValidationError("--max-pending and --max-parked cannot be negative") }
        }

        func run() async throws {
            if check { throw ExitCode(await checkQueue()) }
            let settings: DataQueueSettings
            do {
                settings = try await DataQueueSettings.load(options: queueOptions)
            } catch let error as DataQueueError {
                printError("dq: \(error.message)")
                throw ExitCode(Exit.code(for: error))
            }
            if all || settings.server == nil {
                let database = settings.database ?? DataQueue.defaultDatabasePath()
                let statuses: [QueueStatus]
                do {
                    statuses = try await QueueAdministration.allQueueStatuses(databasePath: database)
                } catch let error as DataQueueError {
                    printError("dq: \(error.message)")
                    throw ExitCode(Exit.code(for: error))
                }
                if json { try printJSON(statuses); return }
                for line in StatusReport.allLines(database: database, statuses: statuses) { print(line) }
                return
            }
            try await withQueue(queueOptions, readOnly: true) { queue in
                let status = try await queue.status()
                let signIn = try (queue.authorization as? AuthorizationCodeClient).map { client in
                    try client.storedSignIn().map(SignInSummary.init) ?? SignInSummary(signedIn: false)
                }
                let sealing = try await queue.sealingSummary()
                if json { try printJSON(StatusOutput(status: status, signIn: signIn, sealing: sealing)); return }
                for line in StatusReport.lines(status) { print(line) }
                // A PostgreSQL schema of an older dq (read-only here) has not the column yet: not read.
                let capabilities = (try? await queue.serverCapabilities()) ?? DataQueue.ServerCapabilities()
                print(StatusReport.capabilitiesLine(capabilities, idempotent: queue.configuration.idempotent))
                if let line = StatusReport.exactlyOnceLine(capabilities, idempotent: queue.configuration.idempotent) { print(line) }
                print(StatusReport.databaseLine(queue.configuration.databasePath))
                print(StatusReport.sealingLine(sealing))
                if let signIn { signIn.printLines() }
                for other in try await queue.allQueueStatuses(countingJournal: false)
                where StatusReport.isElsewhere(other, of: status.queue) {
                    print(StatusReport.elsewhereLine(other))
                }
            }
        }
    }

    /// `dq status --check`: prints one line and returns the plugin exit code.
    struct CheckLine {
        static func line(_ state: Int32, _ summary: String, performance: String = "") -> String {
            let name = ["OK", "WARNING", "CRITICAL", "UNKNOWN"][Int(state)]
            return "DQ \(name) - \(summary)" + (performance.isEmpty ? "" : " | \(performance)")
        }
    }

    /// `dq status --json`: the queue's status and, with authorization_code, the sign-in (never its tokens).
    struct StatusOutput: Encodable {
        let status: QueueStatus
        let signIn: SignInSummary?
        let sealing: DataQueue.SealingSummary

        enum CodingKeys: String, CodingKey {
            case signIn = "sign_in"
            case sealing = "at_rest"
        }

        func encode(to encoder: any Encoder) throws {
            try status.encode(to: encoder)
            var container = encoder.container(keyedBy: CodingKeys.self)
            try container.encodeIfPresent(signIn, forKey: .signIn)
            try container.encode(sealing, forKey: .sealing)
        }
    }

    /// What `dq status` shows of a person's sign-in: who, the SMART launch context, and the token times.
    struct SignInSummary: Encodable {
        var signedIn: Bool
        var fhirUser: String?
        var subject: String?
        var patient: String?
        var encounter: String?
        var scope: String?
        var accessTokenExpiresAt: Date?
        var renewAt: Date?
        var refreshToken: Bool?
        var signedInAt: Date?
        var refreshedAt: Date?

        init(signedIn: Bool) { self.signedIn = signedIn }

        init(_ signIn: SignIn) {
            signedIn = true
            fhirUser = signIn.fhirUser
            subject = signIn.subject
            patient = signIn.patient
            encounter = signIn.encounter
            scope = signIn.scope
            accessTokenExpiresAt = signIn.expiresAt
            renewAt = signIn.renewAt
            refreshToken = signIn.refreshToken != nil
            signedInAt = signIn.signedInAt
            refreshedAt = signIn.refreshedAt
        }

        enum CodingKeys: String, CodingKey {
            case signedIn = "signed_in", fhirUser = "fhir_user", subject = "sub", patient, encounter, scope
            case accessTokenExpiresAt = "access_token_expires_at", renewAt = "renew_at", refreshToken = "refresh_token"
            case signedInAt = "signed_in_at", refreshedAt = "refreshed_at"
        }

        func printLines() {
            guard signedIn else {
                print("sign-in:    none (run dq login)")
                return
            }
            print("signed in:  \(fhirUser ?? subject ?? "yes") since \(formatDate(signedInAt))")
            if let patient { print("patient:    \(patient)") }
            if let encounter { print("encounter:  \(encounter)") }
            if let scope { print("scope:      \(scope)") }
            let refresh = refreshToken == true ? "renewed after \(formatDate(renewAt))" : "no refresh token"
            print("token:      valid until \(formatDate(accessTokenExpiresAt)); \(refresh)")
        }
    }

    struct Doctor: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "doctor",
            abstract: "Check what dq flush needs: the settings and their files, the database, the server, proxy and token endpoint.",
            discussion: """
                Read-only. Checks the settings and the files they name (CA bundle, client certificate and key, keys), \
                the queue database's integrity and, unless --offline, that the server (GET [base]/metadata), the proxy \
                on the way, the encrypted endpoint and the token endpoint answer (a token is asked for, as a flush \
                would). Each problem is printed on standard error with what to do about it.

                Exit 0 when nothing is wrong, else the first of: 78 a setting, or a file it names, is missing, \
                unreadable or not valid; 74 the database is damaged or cannot be read (the recovery steps follow); \
                77 the token endpoint refuses the client, or nobody is signed in; 69 the server, the proxy, the token \
                or the encrypted endpoint does not answer, or the server answers with an error.
                """)
        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Print the findings and each endpoint's route as JSON (the recovery steps stay on stderr).")
        var json = false
        @Flag(help: "Check the settings, their files and the database only: connect to nothing.")
        var offline = false

        /// `--json`'s object.
        struct Report: Encodable {
            struct Route: Encodable {
                var endpoint: String
                var url: String
                /// `direct`, or the proxy's URL with its password redacted.
                var route: String
            }
            var database: String
            var ok: Bool
            /// SQLite's findings in a damaged database, then the words of every other problem.
            var problems: [String]
            /// Each problem with what it concerns, its remedy and its exit code.
            var findings: [Finding]
            var routes: [Route]
            var exitCode: Int32
        }

        func run() async throws {
            var findings: [Finding] = []
            var settings: DataQueueSettings?
            do {
                settings = try await DataQueueSettings.load(options: queueOptions)
            } catch {
                findings.append(Self.configuration(error))
            }
            let database = settings?.database ?? DataQueue.defaultDatabasePath()
            let routes = settings.map(DQ.routes) ?? []
            if !json { printRoutes(routes) }
            var damage: [String] = []
            var reached: [String] = []
            // Settings that cannot be read name no database to check: the default one would mislead.
            if let settings {
                let checked = Self.settingsFindings(settings)
                findings += checked.findings
                findings += Self.serveFindings(settings)
                if !QueuePaths.isPostgresURL(database), !FileManager.default.fileExists(atPath: database) {
                    // Before the first start (the quick start's order): dq makes the file then, where it may.
                    let folder = URL(fileURLWithPath: database).deletingLastPathComponent().path
                    if access(folder, W_OK | X_OK) == 0 {
                        if !json {
                            print("\(QueueAdministration.displayDatabase(database)): not made yet (dq makes it at its first start)")
                        }
                    } else {
                        findings.append(
                            Finding(
                                about: "database",
                                problem: "there is no queue database at \(database), and its folder \(folder) cannot be written",
                                remedy: "create \(folder) writable by dq's user, or name another \"database\"", exitCode: Exit.ioError))
                    }
                } else {
                    do {
                        let problems = try await QueueAdministration.integrityCheck(databasePath: database)
                        if problems == ["ok"] {
                            if !json { print("\(QueueAdministration.displayDatabase(database)): ok") }
                            if !json, let line = await StatusReport.doctorDeliveryLine(settings) { print(line) }
                        } else {
                            damage = Array(problems.prefix(20))
                            findings.append(
                                Finding(
                                    about: "database", problem: "\(QueueAdministration.displayDatabase(database)) is damaged",
                                    remedy: damageRemedy(database), exitCode: Exit.ioError))
                        }
                    } catch let error as DataQueueError {
                        findings.append(
                            Finding(
                                about: "database", problem: error.message,
                                remedy: "check that \"database\" (DQ_DATABASE, --database) names the queue and that this user can read it",
                                exitCode: Exit.code(for: error)))
                    }
                }
                if !offline, let values = checked.values {
                    let network = await Self.networkFindings(values, resolved: checked.resolved)
                    findings += network.findings
                    reached = network.reached
                }
            }
            let code = Self.exitCode(findings)
            if json {
                try printJSON(
                    Report(
                        database: QueueAdministration.displayDatabase(database), ok: findings.isEmpty,
                        problems: damage + findings.filter { $0.about != "database" || damage.isEmpty }.map(\.problem), findings: findings,
                        routes: routes.map { Report.Route(endpoint: $0.name, url: $0.url, route: $0.route) }, exitCode: code))
            } else {
                for line in reached { print(line) }
            }
            for finding in findings where finding.about != "database" || damage.isEmpty {
                printError("dq: \(finding.problem)")
                printError("dq: fix: \(finding.remedy)")
            }
            if !damage.isEmpty { printDamage(damage, database: database) }
            if code != Exit.ok { throw ExitCode(code) }
        }

        /// What to do about a damaged database, in one line (the steps themselves follow the findings).
        func damageRemedy(_ database: String) -> String {
            if database.hasPrefix("postgres") { return "fix or delete the rows named with psql" }
            guard QueueAdministration.schemaIsReadable(databasePath: database) else { return "restore the queue from a backup" }
            return "copy what SQLite can read into a new file: the steps are printed on standard error"
        }

        /// SQLite's findings in a damaged database and how to recover it.
        func printDamage(_ problems: [String], database: String) {
            for problem in problems { printError("dq: \(problem)") }
            if database.hasPrefix("postgres") {
                printError("dq: fix or delete the rows named above with psql (the queue's tables are dq_item and dq_delivery)")
                return
            }
            guard QueueAdministration.schemaIsReadable(databasePath: database) else {
                printError(
                    """
                    dq: the file's schema (its first page) is unreadable: SQLite cannot name its tables, so no SQLite tool
                    can read items out of it. Stop every dq process using it, move it away with its -wal and -shm files
                    (keep them), and restore the queue from a backup; items enqueued since that backup must be enqueued again.
                    """)
                return
            }
            printError(recoverySteps(database: database))
        }
    }

    /// Each endpoint dq would reach and how: directly or through which proxy (its password redacted). An
    /// endpoint dq discovers (a token endpoint, JWKS) is reached the way its discovery document's host is.
    static func printRoutes(_ routes: [(name: String, url: String, route: String)]) {
        let width = routes.map(\.name.count).max() ?? 0
        for (name, url, route) in routes {
            let padding = String(repeating: " ", count: width - name.count)
            print("\(name):\(padding) \(url) (\(route == "direct" ? route : "through proxy \(route)"))")
        }
    }

    /// Each endpoint dq would reach, its URL, and `direct` or the proxy it goes through (password redacted).
    static func routes(_ settings: DataQueueSettings) -> [(name: String, url: String, route: String)] {
        // The routes do not depend on the TLS files: one that is missing (dq doctor names it) hides no route.
        var routing = settings
        routing.caBundle = nil
        routing.tls = nil
        guard let values = try? routing.checkedValues() else { return [] }
        var endpoints: [(String, String)] = [("server", values.server.absoluteString)]
        if let endpoint = settings.encryption?.endpoint { endpoints.append(("encrypted endpoint", endpoint)) }
        if let auth = settings.auth {
            let discovered = values.server.absoluteString.trimmingSuffix("/") + "/.well-known/smart-configuration"
            if let token = auth.tokenURI ?? auth.authorizeURI { endpoints.append(("token", token)) }
            if auth.bearerToken == nil && auth.tokenURI == nil { endpoints.append(("discovery", discovered)) }
            if let registration = auth.registrationURI { endpoints.append(("registration", registration)) }
            if let issuer = auth.issuer {
                endpoints.append(("issuer (JWKS)", issuer.trimmingSuffix("/") + "/.well-known/openid-configuration"))
            }
            if let revocation = auth.revocationURI { endpoints.append(("revocation", revocation)) }
        }
        return endpoints.compactMap { name, text in
            guard let url = URL(string: text) else { return nil }
            return (name, url.absoluteString, values.network.proxy(for: url).map(NetworkConfiguration.redacted) ?? "direct")
        }
    }

    /// How to recover a damaged SQLite queue with the sqlite3 shell: copy the file with its WAL (committed
    /// items may live only there), dump what SQLite can read into a new file, and put that in place without
    /// the old WAL and shared-memory files (SQLite would replay the old WAL onto the new file). `.dump`, not
    /// `.recover`: Debian 12's sqlite3 fails every `.recover` (its SQLite lacks the `sqlite_dbpage` table);
    /// a dump that met damage ends in `ROLLBACK`, which the `sed` turns into the `COMMIT` of what it read.
    static func recoverySteps(database: String) -> String {
        let path = shellQuoted(database)
        let copy = shellQuoted(database + ".damaged")
        let recovered = shellQuoted(database + ".recovered")
        var steps = [
            "dq: \(database) is damaged. Stop every dq process and service using it (dq run, cron flushes), keep a copy",
            "of the file and its WAL, copy what SQLite can read into a new file (the sqlite3 shell, Debian package",
            "sqlite3), then put it in place without the old -wal and -shm files:",
            "  cp \(path) \(copy)",
        ]
        if FileManager.default.fileExists(atPath: database + "-wal") {
            steps.append("  cp \(shellQuoted(database + "-wal")) \(shellQuoted(database + ".damaged-wal"))")
        }
        // The new file holds PHI: readable by its owner only (umask), owned as the old one was.
        steps += [
            "  rm -f \(recovered)",
            "  (umask 077 && sqlite3 \(copy) .dump | sed 's/^ROLLBACK; -- due to errors$/COMMIT;/' | sqlite3 \(recovered))",
            "  chown --reference=\(path) \(recovered)",
            "  rm -f \(shellQuoted(database + "-wal")) \(shellQuoted(database + "-shm"))",
            "  mv \(recovered) \(path)",
            "then run dq doctor, dq status --all and dq list to see what was saved; keep the .damaged copies until you have.",
        ]
        return steps.joined(separator: "\n")
    }

    struct List: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "list", abstract: "List queued items in order.")
        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Only parked items (rejected by the server).") var parked = false
        @Flag(help: "Only pending items.") var pending = false
        @Option(parsing: .unconditional, help: "At most this many items.") var limit = 1000
        @Flag(help: "Print as JSON.") var json = false

        func validate() throws {
            if parked && pending { throw ValidationError("--parked and --pending exclude each other") }
            if limit < 1 { throw ValidationError("--limit must be at least 1") }
        }

        func run() async throws {
            try await withQueue(queueOptions, readOnly: true) { queue in
                let state: QueuedItem.State? = parked ? .parked : pending ? .pending : nil
                var items = try await queue.items(state: state, limit: limit + 1)
                let more = items.count > limit
                if more {
                    items.removeLast()
                    let status = try await queue.status(countingJournal: false)
                    let total = state == .parked ? status.parked : state == .pending ? status.pending : status.pending + status.parked
                    printError("dq: showing the first \(limit) of \(total) items; use --limit to see more", level: .notice)
                }
                if json { try printJSON(items); return }
                if items.isEmpty { print("no items"); return }
                print("SEQ\tID\tSTATE\tMETHOD\tTYPE\tATTEMPTS\tENQUEUED\tLAST ERROR")
                for item in items {
                    print(
                        "\(item.sequence)\t\(item.id.uuidString.lowercased())\t\(item.state.rawValue)\t\(item.method.rawValue)\t\(item.resourceType)\t\(item.attempts)\t\(formatDate(item.enqueuedAt))\t\(item.lastError ?? "-")"
                    )
                }
            }
        }
    }

    struct Show: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "show", abstract: "Show one queued item and the server's last answer.")
        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The item's id, a unique prefix or suffix of it (4+ characters), or its sequence number (#N: only the sequence).")
        var id: String
        @Flag(help: "Also print the stored body (may contain PHI).") var body = false
        @Flag(help: "Print as JSON.") var json = false

        func run() async throws {
            try await withQueue(queueOptions, readOnly: true) { queue in
                let item: QueuedItem
                let data: Data
                do {
                    (item, data) = try await queue.item(id)
                } catch let error as DataQueueError where error.code == .notFound {
                    // No longer queued: the journal says what became of it.
                    guard let record = try await queue.journalRecord(id) else { throw error }
                    if json { try printJSON(record); return }
                    print("id:        \(record.id.uuidString.lowercased())")
                    print("state:     \(record.event.rawValue) (from the journal; the item is no longer queued)")
                    print("request:   \(record.method.rawValue) \(record.url)")
                    print("type:      \(record.resourceType)")
                    print("at:        \(formatDate(record.at))")
                    print("status:    \(record.status.map(String.init) ?? "-")")
                    print("location:  \(record.location ?? "-")")
                    print("attempts:  \(record.attempts)")
                    if let note = record.note { print("note:      \(note)") }
                    return
                }
                if json {
                    struct Shown: Encodable { var item: QueuedItem; var body: String? }
                    try printJSON(Shown(item: item, body: body ? String(decoding: data, as: UTF8.self) : nil))
                    return
                }
                print("id:        \(item.id.uuidString.lowercased())")
                print("sequence:  \(item.sequence)")
                print("state:     \(item.state.rawValue)")
                print("request:   \(item.method.rawValue) \((try? queue.requestURL(for: item)) ?? item.url)")
                print("type:      \(item.resourceType)\(item.encrypted ? " (encrypted envelope)" : "")")
                print("size:      \(item.size) bytes")
                print("enqueued:  \(formatDate(item.enqueuedAt))")
                print("attempts:  \(item.attempts) (last \(formatDate(item.lastAttemptAt)))")
                print("last:      \(item.lastStatus.map(String.init) ?? "-") \(item.lastError ?? "")")
                if let outcome = item.outcome { print("outcome:   \(outcome)") }
                if body { print(String(decoding: data, as: UTF8.self)) }
            }
        }
    }

    struct Retry: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "retry", abstract: "Put parked items back in line for the next flush.")
        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The item's id, a unique prefix or suffix of it, or its sequence number (#N: only the sequence).") var id: String?
        @Flag(help: "Retry every parked item.") var allParked = false
        @Flag(
            inversion: .prefixedNo,
            help:
                "--no-conditional: send the item as a plain create from now on, even in idempotent mode (for a server that refuses its If-None-Exist); --conditional: let idempotent mode apply again."
        ) var conditional: Bool?

        func validate() throws {
            if (id == nil) == !allParked { throw ValidationError("give an item id or --all-parked (not both)") }
            if conditional != nil && allParked { throw ValidationError("--conditional/--no-conditional apply to one item") }
        }

        @Flag(help: "Print what was put back as JSON.") var json = false

        /// `--json`'s object: how many items were put back, and which one when it was one by id.
        struct Retried: Encodable {
            var retried: Int
            var item: String?
        }

        func run() async throws {
            try await withQueue(queueOptions) { queue in
                if allParked {
                    let count = try await queue.retryAllParked()
                    if json { try printJSON(Retried(retried: count)) } else { print("\(count) parked item(s) back in line") }
                } else if let id {
                    let item = try await queue.retry(id, conditionalCreate: conditional)
                    let name = item.id.uuidString.lowercased()
                    if json { try printJSON(Retried(retried: 1, item: name)) } else { print("item \(name) back in line") }
                }
            }
        }
    }

    struct Resolve: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "resolve",
            abstract: "Say where the server stored a delivered item whose answer did not (for the items that reference it).",
            discussion: """
                A server that answers a create without Location, Content-Location or the created resource leaves dq \
                unable to rewrite later references to it: those items are held back (parked) with a reason naming \
                the delivered item. Give its location (TYPE/ID, or TYPE/ID/_history/VERSION, as found on the \
                server), then dq retry the held items; the next flush rewrites their references to it.
                """)
        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The delivered item's id, a unique prefix or suffix of it, or its sequence number.") var id: String
        @Argument(help: "Where the server stored it: TYPE/ID or TYPE/ID/_history/VERSION.") var location: String

        func run() async throws {
            try await withQueue(queueOptions) { queue in
                let record = try await queue.resolveLocation(of: id, at: location)
                print(
                    "item \(record.id.uuidString.lowercased()) is \(record.resourceType)/\(record.serverID ?? ""); "
                        + "dq retry the items held for it (dq list --parked)")
            }
        }
    }

    struct Drop: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "drop",
            abstract: "Remove an item without sending it (recorded in the journal).")
        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The item's id, a unique prefix or suffix of it, or its sequence number (#N: only the sequence).") var id: String

        @Flag(help: "Print the dropped item as JSON.") var json = false

        func run() async throws {
            try await withQueue(queueOptions) { queue in
                let item = try await queue.drop(id)
                let name = item.id.uuidString.lowercased()
                if json {
                    try printJSON(["dropped": name, "method": item.method.rawValue, "resourceType": item.resourceType])
                } else {
                    print("dropped item \(name) (\(item.method.rawValue) \(item.resourceType))")
                }
            }
        }
    }

    struct Log: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "log",
            abstract: "Show the delivery journal: when, where, status and the server's id of each item.")
        @OptionGroup var queueOptions: QueueOptions
        @Option(parsing: .unconditional, help: "The newest this many lines.") var limit = 100
        @Flag(help: "Only deliveries that may have put a second copy on the server (sent again after a stop).")
        var possibleDuplicates = false
        @Flag(help: "Print as JSON.") var json = false

        func validate() throws {
            if limit < 1 { throw ValidationError("--limit must be at least 1") }
        }

        func run() async throws {
            try await withQueue(queueOptions, readOnly: true) { queue in
                var records = try await queue.deliveries(limit: possibleDuplicates ? max(limit, 1_000_000) : limit)
                if possibleDuplicates {
                    records = Array(
                        records.filter { $0.note?.hasPrefix(DeliveryRecord.possibleDuplicateNote) == true }.suffix(limit))
                }
                if json { try printJSON(records); return }
                if records.isEmpty { print("no deliveries"); return }
                print("AT\tEVENT\tID\tMETHOD\tTYPE\tSTATUS\tLOCATION\tATTEMPTS\tBUNDLE\tNOTE")
                for record in records {
                    print(
                        "\(formatDate(record.at))\t\(record.event.rawValue)\t\(record.id.uuidString.lowercased())\t\(record.method.rawValue)\t\(record.resourceType)\t\(record.status.map(String.init) ?? "-")\t\(record.location ?? "-")\t\(record.attempts)\t\(record.bundle.map { String($0.prefix(8)) } ?? "-")\t\(record.note ?? "-")"
                    )
                }
            }
        }
    }
}

/// `text` as one word for a POSIX shell: unchanged when it holds only safe characters, else in single quotes.
func shellQuoted(_ text: String) -> String {
    let safe = text.unicodeScalars.allSatisfy {
        $0.isASCII && (CharacterSet.alphanumerics.contains($0) || "/._-+:@%,=".unicodeScalars.contains($0))
    }
    if safe && !text.isEmpty { return text }
    return "'" + text.replacingOccurrences(of: "'", with: #"'\''"#) + "'"
}

extension DQ.Status {
    fileprivate func checkQueue() async -> Int32 {
        let found: [QueueStatus]
        do {
            // With --all, or no server (as `dq status` then shows every queue): every queue of the database, summed.
            let settings = try await DataQueueSettings.load(options: queueOptions)
            if all || settings.server == nil {
                found = try await QueueAdministration.allQueueStatuses(
                    databasePath: settings.database ?? DataQueue.defaultDatabasePath())
            } else {
                let values = try settings.checkedValues()
                let statuses = try await QueueAdministration.allQueueStatuses(
                    databasePath: values.database ?? DataQueue.defaultDatabasePath())
                found = statuses.filter { $0.queue == values.queueName }
            }
        } catch {
            print(DQ.CheckLine.line(3, (error as? DataQueueError)?.message ?? "\(error)"))
            return 3
        }
        // A queue with no rows yet: nothing pending, nothing failing. Several: the sums, the oldest, the worst.
        let failing = found.max { $0.consecutiveFailures < $1.consecutiveFailures }
        let status = (
            pending: found.reduce(0) { $0 + $1.pending }, parked: found.reduce(0) { $0 + $1.parked },
            oldestPendingAt: found.compactMap(\.oldestPendingAt).min(),
            consecutiveFailures: failing?.consecutiveFailures ?? 0, lastError: failing?.lastError
        )
        let age = status.oldestPendingAt.map { max(0, Int(Date().timeIntervalSince($0))) } ?? 0
        let ageLimit = maxAge.flatMap(parseDuration).map { Int($0) }
        var critical: [String] = []
        if let maxPending, status.pending > maxPending { critical.append("\(status.pending) pending (limit \(maxPending))") }
        if let ageLimit, age > ageLimit { critical.append("the oldest pending item waits \(age) s (limit \(ageLimit) s)") }
        if let maxParked, status.parked > maxParked { critical.append("\(status.parked) parked (limit \(maxParked))") }
        let performance = [
            "pending=\(status.pending);;\(maxPending.map(String.init) ?? "");0",
            "parked=\(status.parked);;\(maxParked.map(String.init) ?? "");0",
            "oldest_age=\(age)s;;\(ageLimit.map(String.init) ?? "");0",
            "failures=\(status.consecutiveFailures);;;0",
        ].joined(separator: " ")
        let counts = "\(status.pending) pending, \(status.parked) parked, oldest \(age) s"
        if !critical.isEmpty {
            print(DQ.CheckLine.line(2, critical.joined(separator: "; "), performance: performance))
            return 2
        }
        if status.consecutiveFailures > 0 {
            let reason = status.lastError.map { ": \($0)" } ?? ""
            print(
                DQ.CheckLine.line(
                    1, "delivery failing (\(status.consecutiveFailures) in a row)\(reason); \(counts)", performance: performance))
            return 1
        }
        print(DQ.CheckLine.line(0, counts, performance: performance))
        return 0
    }
}

extension String {
    /// The string without one trailing `suffix`, if it ends with it.
    func trimmingSuffix(_ suffix: String) -> String { hasSuffix(suffix) ? String(dropLast(suffix.count)) : self }
}

/// `90s`, `15m`, `2h`, `30d`, or plain seconds; nil for anything else.
func parseDuration(_ text: String) -> Double? {
    let units: [Character: Double] = ["s": 1, "m": 60, "h": 3600, "d": 86400]
    let (number, unit) = text.last.flatMap { units[$0] }.map { (text.dropLast(), $0) } ?? (Substring(text), 1)
    guard let value = Double(number), value.isFinite, value >= 0 else { return nil }
    return value * unit
}
