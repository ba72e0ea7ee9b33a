import Foundation

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif

/// One key of `dq.json`: its dotted name, the `DQ_` variable that sets it, what its value is, and whether it is a
/// secret. A ``SettingKeys`` table of them is what the reader's keys, the variables, the unknown-key check and
/// `dq config` follow.
package struct SettingKey: Sendable {
    /// What a value is, as a variable's text is checked (the reader checks the file's types).
    package enum Kind: Sendable {
        /// Text.
        case text
        /// A number.
        case number
        /// A whole number, in `range` when given (checked at the variable for `DQ_BATCH_SIZE`).
        case wholeNumber(ClosedRange<Int>?)
        /// `true` or `false` (`1`, `0`).
        case flag
        /// `true`, `false` or `auto`.
        case idempotence
        /// A list, a comma list in a variable.
        case list
        /// One of `values` (compared without case); `what` says which for errors.
        case choice([String], String)
        /// An object (a JSON object in a variable) of strings, and booleans when `booleans`.
        case object(booleans: Bool)
    }

    /// The dotted name (`auth.client_id`).
    package let name: String
    /// The variable (`DQ_CLIENT_ID`), if one sets the key.
    package let variable: String?
    /// What the value is.
    package let kind: Kind
    /// Whether the value is a secret (a token, or a URL that may hold a password): redacted by access reporters.
    package let isSecret: Bool

    /// A key named `name`, set by `variable` too when given.
    package init(_ name: String, _ variable: String?, _ kind: Kind = .text, secret: Bool = false) {
        self.name = name
        self.variable = variable
        self.kind = kind
        self.isSecret = secret
    }

    /// The library's keys, in the README's order (a command adds its own: ``SettingKeys/adding(_:objects:)``).
    package static let library: [SettingKey] = [
        .init("server", "DQ_SERVER", secret: true), .init("database", "DQ_DATABASE", secret: true),
        .init("database_password_file", "DQ_DATABASE_PASSWORD_FILE"),
        .init("durability", "DQ_DURABILITY", .choice(["full", "normal"], #"must be "full" or "normal""#)),
        .init("idempotent", "DQ_IDEMPOTENT", .idempotence),
        .init("max_resource_bytes", "DQ_MAX_RESOURCE_BYTES", .wholeNumber(nil)),
        .init("extra_resource_types", "DQ_EXTRA_RESOURCE_TYPES", .list),
        .init("timeout_seconds", "DQ_TIMEOUT_SECONDS", .number),
        .init("connect_timeout_seconds", "DQ_CONNECT_TIMEOUT_SECONDS", .number),
        .init("settle_seconds", "DQ_SETTLE_SECONDS", .number), .init("lease_seconds", "DQ_LEASE_SECONDS", .number),
        .init("batch_size", "DQ_BATCH_SIZE", .wholeNumber(1...SettingLimits.maximumBatchSize)),
        .init("batch_max_bytes", "DQ_BATCH_MAX_BYTES", .wholeNumber(nil)),
        .init("journal_retention_days", "DQ_JOURNAL_RETENTION_DAYS", .number),
        .init("retry.initial_seconds", "DQ_RETRY_INITIAL_SECONDS", .number),
        .init("retry.maximum_seconds", "DQ_RETRY_MAXIMUM_SECONDS", .number), .init("retry.jitter", "DQ_RETRY_JITTER", .number),
        .init("ca_bundle", nil), .init("proxy", "DQ_PROXY", secret: true), .init("proxy_file", "DQ_PROXY_FILE"),
        .init("no_proxy", "DQ_NO_PROXY"), .init("tls.ca_bundle", "DQ_CA_BUNDLE"), .init("tls.ca_bundle_only", "DQ_CA_BUNDLE_ONLY", .flag),
        .init("tls.client_certificate", "DQ_CLIENT_CERTIFICATE"), .init("tls.client_key", "DQ_CLIENT_KEY"),
        .init("auth.bearer_token", "DQ_TOKEN", secret: true), .init("auth.bearer_token_file", "DQ_BEARER_TOKEN_FILE"),
        .init("auth.client_id", "DQ_CLIENT_ID"), .init("auth.client_secret", "DQ_CLIENT_SECRET", secret: true),
        .init("auth.client_secret_file", "DQ_CLIENT_SECRET_FILE"), .init("auth.token_uri", "DQ_TOKEN_URI"),
        .init("auth.authorize_uri", "DQ_AUTHORIZE_URI"),
        .init("auth.authorize_type", "DQ_AUTHORIZE_TYPE", .choice(["client_credentials", "authorization_code"], authorizeTypeError)),
        .init("auth.issuer", "DQ_ISSUER"), .init("auth.revocation_uri", "DQ_REVOCATION_URI"),
        .init("auth.registration_uri", "DQ_REGISTRATION_URI"), .init("auth.client_name", "DQ_CLIENT_NAME"),
        .init("auth.scope", "DQ_SCOPE"),
        .init(
            "auth.token_endpoint_auth_method", "DQ_TOKEN_ENDPOINT_AUTH_METHOD",
            .choice(OAuth2Configuration.TokenEndpointAuthMethod.allCases.map(\.rawValue), authMethodError)),
        .init("auth.private_key", "DQ_PRIVATE_KEY"), .init("auth.key_id", "DQ_KEY_ID"),
        .init("auth.key_alg", "DQ_KEY_ALG", .choice(["rs256", "rs384", "es256", "es384"], keyAlgorithmError)),
        .init("auth.registration_fields", "DQ_REGISTRATION_FIELDS", .object(booleans: true)),
        .init("auth.registration_headers", "DQ_REGISTRATION_HEADERS", .object(booleans: false), secret: true),
        .init("auth.credentials_dir", "DQ_CREDENTIALS_DIR"),
        .init("encryption.endpoint", "DQ_ENCRYPTION_ENDPOINT"), .init("encryption.certificate", "DQ_ENCRYPTION_CERTIFICATE"),
        .init("encryption.key_id", "DQ_ENCRYPTION_KEY_ID"), .init("encryption.fhir_version", "DQ_ENCRYPTION_FHIR_VERSION"),
        .init("encryption.resource_types", "DQ_ENCRYPTION_RESOURCE_TYPES", .list),
        .init("encryption.mode", "DQ_ENCRYPTION_MODE", .choice(["c3pro", "authenticated"], #"must be "c3pro" or "authenticated""#)),
        .init("encryption.in_flight", "DQ_ENCRYPTION_IN_FLIGHT", .wholeNumber(nil)),
        .init("at_rest.key_file", "DQ_AT_REST_KEY_FILE"), .init("at_rest.old_key_files", "DQ_AT_REST_OLD_KEY_FILES", .list),
    ]

    /// The pairs of keys that are one setting in two forms (a secret or the file holding it; the CA bundle's two
    /// names): a source that gives either form hides both forms in the sources under it.
    package static let pairs = [
        ["auth.bearer_token", "auth.bearer_token_file"], ["auth.client_secret", "auth.client_secret_file"],
        ["proxy", "proxy_file"], ["tls.ca_bundle", "ca_bundle"],
    ]

    static let authorizeTypeError = #"must be "client_credentials" or "authorization_code""#
    static let authMethodError = "must be client_secret_basic, client_secret_post, none or private_key_jwt"
    static let keyAlgorithmError = "must be RS256, RS384, ES256 or ES384"

    /// Why a variable's text is not a value of this key (`nil`: it is one), for an error that names the variable.
    package func problem(with text: String) -> String? {
        let trimmed = text.trimmingCharacters(in: .whitespaces)
        switch kind {
        case .text, .list: return nil
        case .number: return Double(trimmed).map(\.isFinite) == true ? nil : "must be a number"
        case .wholeNumber(let range):
            guard let range else { return Int(trimmed) == nil ? "must be a whole number" : nil }
            return Int(trimmed).map(range.contains) == true ? nil : "must be a whole number from \(range.lowerBound) to \(range.upperBound)"
        case .flag: return ["1", "true", "0", "false"].contains(trimmed.lowercased()) ? nil : "must be true or false"
        case .idempotence:
            return ["1", "true", "0", "false", "auto"].contains(trimmed.lowercased()) ? nil : "must be true or false (or auto)"
        case .choice(let values, let what): return values.contains(text.lowercased()) ? nil : what
        case .object(let booleans):
            let what = "must be a JSON object of \(booleans ? "strings or booleans" : "strings")"
            guard let object = try? JSONDecoder().decode([String: DataQueueSettings.Auth.FieldValue].self, from: Data(text.utf8))
            else { return what }
            return booleans || object.values.allSatisfy({ if case .string = $0 { true } else { false } }) ? nil : what
        }
    }

    /// `DQ_…` names that dq's own make targets and scripts export for its tests, torture and benchmarks (and
    /// `DQ_TEST_…`): not dq settings, and not misspellings of one.
    package static let toolingVariables: Set<String> = [
        "DQ_BIN", "DQ_GATEWAY_BIN", "DQ_BENCH_BIN", "DQ_REQUIRE_PEERS", "DQ_SANITIZER", "DQ_PEERS_VENV", "DQ_GENERATOR_VENV",
    ]

    /// What is wrong with a JSON value's type for a kind that swift-configuration's JSON reading would accept
    /// leniently: `true` where a number goes (read as 1), a number where `true` or `false` goes.
    static func jsonTypeProblem(_ value: Any?, kind: Kind?) -> String? {
        guard let number = value as? NSNumber, let kind else { return nil }
        // JSONSerialization gives true and false as NSNumbers of the C type char.
        let isBoolean = String(cString: number.objCType) == "c"
        switch kind {
        case .number, .wholeNumber: return isBoolean ? "must be a number, not true or false" : nil
        case .flag: return isBoolean ? nil : "must be true or false"
        default: return nil
        }
    }

    /// The name of `names` closest to `name`, when at most two edits away.
    static func nearest(_ name: String, in names: some Collection<String>) -> String? {
        let nearest = names.map { ($0, editDistance(name, $0)) }.min { ($0.1, $0.0) < ($1.1, $1.0) }
        return nearest.flatMap { $0.1 <= 2 ? $0.0 : nil }
    }

    /// Levenshtein distance between two short ASCII names.
    private static func editDistance(_ a: String, _ b: String) -> Int {
        let a = Array(a.utf8), b = Array(b.utf8)
        var row = Array(0...b.count)
        for i in 1...max(a.count, 1) where !a.isEmpty {
            var previous = row[0]
            row[0] = i
            for j in 1...max(b.count, 1) where !b.isEmpty {
                let substitution = previous + (a[i - 1] == b[j - 1] ? 0 : 1)
                previous = row[j]
                row[j] = min(substitution, row[j] + 1, row[j - 1] + 1)
            }
        }
        return row[b.count]
    }
}

/// The keys one reader knows: the library's (``library``), or those and a command's own (`dq`'s log and daemon keys,
/// its `serve` object). A key or variable of the table is read and checked; any other is refused with the name of
/// the table's it most likely meant.
package struct SettingKeys: Sendable {
    /// Every key, in the table's order.
    package let all: [SettingKey]
    /// The keys by name.
    package let byName: [String: SettingKey]
    /// The objects of the file whose keys are in the table: each dotted key's part before the dot.
    let objects: Set<String>
    /// Objects of the file that a command reads and checks itself (`serve`): only their being objects is checked.
    let commandObjects: Set<String>
    /// Every `DQ_…` variable read (the table's, and `DQ_CONFIG`).
    package let environmentVariables: Set<String>

    private init(_ keys: [SettingKey], commandObjects: Set<String>) {
        all = keys
        byName = Dictionary(uniqueKeysWithValues: keys.map { ($0.name, $0) })
        objects = Set(keys.compactMap { $0.name.split(separator: ".").count == 2 ? String($0.name.split(separator: ".")[0]) : nil })
        self.commandObjects = commandObjects
        environmentVariables = Set(keys.compactMap(\.variable) + ["DQ_CONFIG"])
    }

    /// The library's keys (``SettingKey/library``).
    package static let library = SettingKeys(SettingKey.library, commandObjects: [])

    /// This table with a command's `keys` and the `objects` of the file it reads and checks itself.
    package func adding(_ keys: [SettingKey], objects: Set<String> = []) -> SettingKeys {
        SettingKeys(all + keys, commandObjects: commandObjects.union(objects))
    }

    /// Refuses the first key of the file's object that is not in the table (with the key it most likely meant),
    /// and an object key whose value is no object: swift-configuration reads the keys it is asked for and
    /// ignores the others.
    package func refuseUnknown(_ object: [String: Any]) throws {
        func check(_ object: [String: Any], prefix: String) throws {
            for name in object.keys.sorted() {
                let key = prefix.isEmpty ? name : prefix + "." + name
                if prefix.isEmpty && commandObjects.contains(name) {
                    // Read and checked by the command it belongs to (`dq serve`).
                    guard object[name] is [String: Any] else { throw configError("\"\(key)\" must be an object") }
                } else if prefix.isEmpty && objects.contains(name) {
                    guard let inner = object[name] as? [String: Any] else { throw configError("\"\(key)\" must be an object") }
                    try check(inner, prefix: name)
                } else if byName[key] == nil {
                    let known = all.map(\.name).filter { $0.hasPrefix(prefix) }
                    throw configError(
                        "unknown key \"\(key)\"" + (SettingKey.nearest(key, in: known).map { " (did you mean \"\($0)\"?)" } ?? ""))
                } else if case .object = byName[key]?.kind, !(object[name] is [String: Any]) {
                    throw configError("\"\(key)\" must be an object")
                } else if let problem = SettingKey.jsonTypeProblem(object[name], kind: byName[key]?.kind) {
                    throw configError("\"\(key)\" \(problem)")
                }
            }
        }
        try check(object, prefix: "")
    }

    /// The `DQ_…` names in `environment` that are not read (a misspelt `DQ_SEVER` would otherwise be ignored
    /// without a word), sorted, each with the known name it most likely meant, if one is close.
    package func unknownEnvironmentVariables(in environment: [String: String]) -> [(name: String, suggestion: String?)] {
        environment.keys.filter {
            $0.hasPrefix("DQ_") && !environmentVariables.contains($0) && !SettingKey.toolingVariables.contains($0)
                && !$0.hasPrefix("DQ_TEST_")
        }.sorted().map { ($0, SettingKey.nearest($0, in: environmentVariables)) }
    }

    private func configError(_ message: String) -> DataQueueError { DataQueueSettings.configError(message) }
}
