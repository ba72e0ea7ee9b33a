import ArgumentParser
import FHIRDataQueue
import Foundation

extension DQ.Serve {
    /// `dq serve import-credentials FILE`: the clients of a C3-PRO server, from a CSV export of its `Users` table
    /// (`username`, `passwd`: the client id and the Base64 of the secret's unsalted SHA-1), stored in the queue's
    /// database so that devices that registered with that server keep their credentials. Each is verified by its
    /// old hash and re-hashed with scrypt at its first token request (``ClientSecrets``).
    struct ImportCredentials: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "import-credentials",
            abstract: "Import the clients of a C3-PRO server (a CSV export of its Users table) into the receiver's database.",
            discussion: """
                FILE is CSV (RFC 4180: commas, double quotes around a field that holds a comma, quote or line \
                break). With a header row, the columns named username and passwd are read, in any order, and the \
                others ignored; without one, the first column is the client id and the second the password hash, \
                the Base64 of the SHA-1 of the client secret, as C3-PRO's create_tables.sql and RegisterServer stored \
                it. A client already in the database is skipped, never overwritten, so the import can be run again. \
                A malformed row is refused with its line number; no id, secret or hash is printed. Exit 0 when \
                something was taken or skipped, 65 when every row was refused, 66 when FILE cannot be read.
                """)

        @OptionGroup var queueOptions: QueueOptions
        @Argument(help: "The CSV export of C3-PRO's Users table.") var file: String
        @Flag(help: "Print as JSON.") var json = false

        /// What the import did.
        struct Report: Encodable {
            struct Refusal: Encodable {
                /// The line of the file the row starts on (1 is the first).
                var line: Int
                var reason: String
            }
            var file: String
            /// Clients stored now.
            var taken = 0
            /// Clients already in the database (or earlier in the file): left as they are.
            var skipped = 0
            var refused = 0
            var refusals: [Refusal] = []
        }

        /// Rows written per transaction.
        static let batchSize = 1000

        func run() async throws {
            guard let data = FileManager.default.contents(atPath: file) else {
                printError("dq: cannot read \(file)")
                throw ExitCode(Exit.noInput)
            }
            guard var text = String(data: data, encoding: .utf8) else {
                printError("dq: \(file) is not UTF-8 text")
                throw ExitCode(Exit.dataError)
            }
            if text.hasPrefix("\u{FEFF}") { text.removeFirst() }
            var report = Report(file: file)
            let rows = Self.rows(CSVReader.records(text), report: &report)
            let total = rows.count + report.refused
            let now = Date()
            let read = report
            report = try await withQueue(queueOptions) { queue in
                var report = read
                let registry = queue.clientRegistry
                var start = 0
                while start < rows.count {
                    let batch = rows[start..<min(start + Self.batchSize, rows.count)]
                    let added = try await registry.registerAbsent(
                        Dictionary(batch.map { ($0.clientID, $0.hash) }, uniquingKeysWith: { first, _ in first }), at: now)
                    report.taken += added.count
                    report.skipped += batch.count - added.count
                    start += Self.batchSize
                }
                return report
            }
            if json {
                try printJSON(report)
            } else {
                for refusal in report.refusals { printError("dq: \(file):\(refusal.line): \(refusal.reason)") }
                print("imported \(report.taken) clients, skipped \(report.skipped) (already registered), refused \(report.refused)")
            }
            if total == 0 {
                printError("dq: \(file) holds no Users rows")
                throw ExitCode(Exit.dataError)
            }
            if report.refused == total { throw ExitCode(Exit.dataError) }
        }

        /// A row to import: the client id and its stored hash (``ClientSecrets/legacyHash(sha1Base64:)``).
        struct Row: Sendable {
            var clientID: String
            var hash: String
        }

        /// The rows of the records: the header's columns (or the first two), each row checked; a row refused is
        /// counted in `report`, and an id seen earlier in the file is skipped.
        static func rows(_ records: [CSVReader.Record], report: inout Report) -> [Row] {
            var rows: [Row] = []
            var seen: Set<String> = []
            var columns = (id: 0, hash: 1)
            var first = true
            for record in records {
                if record.fields == [""] { continue }  // a blank line
                if let problem = record.problem {
                    report.refused += 1
                    report.refusals.append(.init(line: record.line, reason: problem))
                    continue
                }
                if first {
                    first = false
                    let names = record.fields.map { $0.trimmingCharacters(in: .whitespaces).lowercased() }
                    if let id = names.firstIndex(of: "username") {
                        guard let hash = names.firstIndex(of: "passwd") ?? names.firstIndex(of: "password") else {
                            report.refused += 1
                            report.refusals.append(.init(line: record.line, reason: "a header with username but no passwd column"))
                            return []
                        }
                        columns = (id, hash)
                        continue
                    }
                }
                switch row(record.fields, columns: columns) {
                case .success(let row):
                    if seen.insert(row.clientID).inserted {
                        rows.append(row)
                    } else {
                        report.skipped += 1
                    }
                case .failure(let refusal):
                    report.refused += 1
                    report.refusals.append(.init(line: record.line, reason: refusal.reason))
                }
            }
            return rows
        }

        struct Refused: Error {
            var reason: String
        }

        /// One record as a row, or why not (never quoting the id or the hash).
        static func row(_ fields: [String], columns: (id: Int, hash: Int)) -> Result<Row, Refused> {
            guard fields.count > max(columns.id, columns.hash) else {
                return .failure(Refused(reason: "\(fields.count) column(s); the username and passwd columns are not both there"))
            }
            let id = fields[columns.id]
            guard !id.isEmpty else { return .failure(Refused(reason: "the username is empty")) }
            guard id.utf8.count <= 255 else { return .failure(Refused(reason: "the username is longer than 255 bytes")) }
            guard !id.unicodeScalars.contains(where: { $0.properties.generalCategory == .control || $0 == ":" || $0 == " " }) else {
                return .failure(Refused(reason: "the username holds a space, a colon or a control character (HTTP Basic cannot send it)"))
            }
            let encoded = fields[columns.hash].trimmingCharacters(in: .whitespaces)
            guard let digest = Data(base64Encoded: encoded), digest.count == 20 else {
                return .failure(Refused(reason: "the passwd is not the Base64 of a SHA-1 hash (20 bytes)"))
            }
            return .success(Row(clientID: id, hash: ClientSecrets.legacyHash(sha1Base64: digest.base64EncodedString())))
        }
    }
}

/// A small RFC 4180 reader: fields separated by commas, records by CRLF or LF; a field in double quotes may hold
/// commas, line breaks and doubled quotes.
enum CSVReader {
    struct Record: Equatable {
        /// The line the record starts on (1 is the first).
        var line: Int
        var fields: [String]
        /// Why the record is malformed (a quote not closed, text after a closing quote), if it is.
        var problem: String?
    }

    static func records(_ text: String) -> [Record] {
        var records: [Record] = []
        var fields: [String] = []
        var field = ""
        var line = 1
        var start = 1
        var quoted = false
        var wasQuoted = false
        var problem: String?
        var scalars = text.unicodeScalars.makeIterator()
        var pending: Unicode.Scalar? = scalars.next()
        func endRecord() {
            fields.append(field)
            records.append(Record(line: start, fields: fields, problem: problem))
            fields = []
            field = ""
            wasQuoted = false
            problem = nil
        }
        while let scalar = pending {
            pending = scalars.next()
            if quoted {
                if scalar == "\"" {
                    if pending == "\"" {
                        field.unicodeScalars.append("\"")
                        pending = scalars.next()
                    } else {
                        quoted = false
                    }
                } else {
                    if scalar == "\n" { line += 1 }
                    field.unicodeScalars.append(scalar)
                }
                continue
            }
            switch scalar {
            case ",":
                fields.append(field)
                field = ""
                wasQuoted = false
            case "\r" where pending == "\n":
                continue
            case "\n":
                endRecord()
                line += 1
                start = line
            case "\"" where field.isEmpty && !wasQuoted:
                quoted = true
                wasQuoted = true
            default:
                if wasQuoted && problem == nil { problem = "text after a closing double quote" }
                if scalar == "\"" && problem == nil { problem = "a double quote inside an unquoted field" }
                field.unicodeScalars.append(scalar)
            }
        }
        if quoted { problem = "a double quote is not closed before the end of the file" }
        if quoted || !field.isEmpty || !fields.isEmpty || wasQuoted { endRecord() }
        return records
    }
}
