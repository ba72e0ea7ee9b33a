import Configuration
import Foundation
import NIOConcurrencyHelpers

/// The `ConfigReader` of one `dq` run: its flags, then the `DQ_` variables, then the settings file, each a
/// swift-configuration provider; a host that reads its own configuration with swift-configuration gives the
/// library its own reader instead (see ``DataQueue/Configuration/init(reader:)``).
package enum SettingsReader {
    /// The flags' provider's name, which ``OriginRecorder`` reports as `flag`.
    package static let flagsName = InMemoryProvider(name: "dq flags", values: [:]).providerName
    /// The variables' provider's name.
    package static let environmentName = "dq environment"
    /// The settings file's provider's name.
    package static let fileName = "dq file"

    /// A reader over `flags` (values by key, as the flags give them), then the `DQ_` variables of `environment`
    /// that `keys` names, then `file`: each key is answered by the first of them that holds it. A source that gives
    /// either form of a setting with two (`auth.bearer_token` and `auth.bearer_token_file`, …) hides both in the
    /// sources under it.
    package static func make(
        flags: [String: ConfigContent] = [:], environment: [String: String], file: SettingsFile?, keys: SettingKeys = .library,
        accessReporter: (any AccessReporter)? = nil
    ) -> ConfigReader {
        var hiddenInEnvironment = Set<String>()
        var hiddenInFile = Set<String>()
        let variables = SettingsEnvironmentProvider.known(environment, keys: keys)
        for pair in SettingKey.pairs {
            if pair.contains(where: { flags[$0] != nil }) {
                hiddenInEnvironment.formUnion(pair)
                hiddenInFile.formUnion(pair)
            } else {
                let given = pair.filter { keys.byName[$0]?.variable.map { variables[$0] != nil } == true }
                if !given.isEmpty { hiddenInFile.formUnion(pair) }
                // Both forms in the environment: the value itself wins.
                if given.count == 2 { hiddenInEnvironment.insert(pair[1]) }
            }
        }
        let flagValues = flags.map { key, content in
            (AbsoluteConfigKey(ConfigKey(key)), ConfigValue(content, isSecret: keys.byName[key]?.isSecret ?? false))
        }
        var providers: [any ConfigProvider] = [
            InMemoryProvider(name: "dq flags", values: Dictionary(uniqueKeysWithValues: flagValues)),
            SettingsEnvironmentProvider(environment: variables, hidden: hiddenInEnvironment, keys: keys),
        ]
        if var file {
            file.hidden = hiddenInFile
            providers.append(file)
        }
        return ConfigReader(providers: providers, accessReporter: accessReporter)
    }

    /// The reader of one `dq` run, and its config file: `flags`, then the `DQ_` variables of `environment`, then
    /// the file `config` names (else `$DQ_CONFIG`, else the first of
    /// ``DataQueueSettings/configSearchPath(environment:)`` that exists), its keys and variables those of `keys`.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) for a file that cannot be read, is no strict JSON
    ///   object or holds a key not in `keys`.
    package static func make(
        config: String?, flags: [String: ConfigContent] = [:], environment: [String: String], keys: SettingKeys = .library,
        accessReporter: (any AccessReporter)? = nil
    ) throws -> (reader: ConfigReader, file: SettingsFile?) {
        let path =
            config ?? environment["DQ_CONFIG"]
            ?? DataQueueSettings.configSearchPath(environment: environment).first { FileManager.default.fileExists(atPath: $0) }
        let file = try path.map { try SettingsFile(contentsOf: $0, keys: keys) }
        return (make(flags: flags, environment: environment, file: file, keys: keys, accessReporter: accessReporter), file)
    }
}

/// The `DQ_` variables as a provider: each key of its table read under its own variable (`auth.client_id` as
/// `DQ_CLIENT_ID`, see ``SettingKey``) through swift-configuration's `EnvironmentVariablesProvider`; a value that
/// is not one of the key's is refused naming the variable.
package struct SettingsEnvironmentProvider: StaticSettingsProvider {
    private let upstream: EnvironmentVariablesProvider
    private let variables: [String: String]
    private let hidden: Set<String>
    private let keys: SettingKeys

    /// The provider's name.
    package var providerName: String { SettingsReader.environmentName }

    init(environment variables: [String: String], hidden: Set<String>, keys: SettingKeys) {
        let secrets = Set(keys.all.filter(\.isSecret).compactMap(\.variable))
        upstream = EnvironmentVariablesProvider(environmentVariables: variables, secretsSpecifier: .specific(secrets))
        self.variables = variables
        self.hidden = hidden
        self.keys = keys
    }

    /// The variables of `keys` in `environment`, trimmed where a number or flag is read from them.
    static func known(_ environment: [String: String], keys: SettingKeys) -> [String: String] {
        var known: [String: String] = [:]
        for key in keys.all {
            guard let name = key.variable, let value = environment[name] else { continue }
            switch key.kind {
            case .number, .wholeNumber, .flag, .idempotence: known[name] = value.trimmingCharacters(in: .whitespaces)
            default: known[name] = value
            }
        }
        return known
    }

    /// The variable's value for `key`, checked.
    package func value(forKey key: AbsoluteConfigKey, type: ConfigType) throws -> LookupResult {
        guard let setting = keys.byName[key.description], let name = setting.variable, !hidden.contains(setting.name) else {
            return LookupResult(encodedKey: key.description, value: nil)
        }
        if let text = variables[name], let problem = setting.problem(with: text) {
            throw DataQueueSettings.configError("\(name) \(problem)")
        }
        // A flag or number asked as text (`idempotent` is read as text first) is the variable's text.
        let result = try upstream.value(forKey: AbsoluteConfigKey([name]), type: type)
        guard case .list = setting.kind, case .stringArray(let items)? = result.value?.content else { return result }
        let kept = items.filter { !$0.isEmpty }
        return LookupResult(encodedKey: name, value: ConfigValue(.stringArray(kept), isSecret: setting.isSecret))
    }
}

/// A `dq.json` file as a provider: swift-configuration's `JSONSnapshot` of its bytes, once they pass the checks
/// `JSONSnapshot` does not make (strict JSON as resource files follow it, no byte order mark, no key its table
/// does not know).
/// `auth.registration_fields` and `auth.registration_headers`, objects whose names are the user's, are answered
/// as JSON text, as their variables give them.
package struct SettingsFile: StaticSettingsProvider {
    private let json: JSONSnapshot
    private let objects: [String: String]
    private let keys: SettingKeys
    /// Keys a source over the file gave (see ``SettingsReader/make(flags:environment:file:accessReporter:)``).
    var hidden: Set<String> = []
    /// The file's path, when read from one.
    package let path: String?
    /// Whether the file itself holds a secret: a bearer token, a client secret, or a password in a URL.
    package let holdsSecret: Bool

    /// The provider's name.
    package var providerName: String { SettingsReader.fileName }

    /// Checks `data` and makes its snapshot; `source` names it in errors.
    ///
    /// - Parameter keys: the keys the file may hold (the library's, or those and a command's).
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) for bytes that are no strict JSON object, and for
    ///   a key not in `keys` (naming the key it most likely meant).
    package init(data: Data, source: String, path: String? = nil, keys: SettingKeys = .library) throws {
        let object = try DataQueueSettings.checkedObject(data, source: source)
        try keys.refuseUnknown(object)
        let auth = object["auth"] as? [String: Any] ?? [:]
        var objects: [String: String] = [:]
        for name in ["registration_fields", "registration_headers"] {
            if let value = auth[name], let text = try? JSONSerialization.data(withJSONObject: value) {
                objects["auth." + name] = String(decoding: text, as: UTF8.self)
            }
        }
        // `idempotent` is `true`, `false` or text, never a number (JSONSnapshot reads `1` as `true` too).
        if object["idempotent"] != nil {
            struct Probe: Decodable { var idempotent: DataQueueSettings.Auth.FieldValue? }
            switch try? JSONDecoder().decode(Probe.self, from: data).idempotent {
            case .bool(let flag): objects["idempotent"] = String(flag)
            case .string(let text): objects["idempotent"] = text
            case nil: throw DataQueueSettings.configError(#""idempotent" must be true, false or "auto""#)
            }
        }
        self.objects = objects
        self.keys = keys
        let secrets = Set(keys.all.filter(\.isSecret).map(\.name))
        // A command's own object (`serve`, with its lists of objects such as routes) is read by the command: the
        // snapshot, which takes lists of plain values only, gets the rest.
        var snapshot = data
        if object.keys.contains(where: keys.commandObjects.contains) {
            snapshot = try JSONSerialization.data(withJSONObject: object.filter { !keys.commandObjects.contains($0.key) })
        }
        do {
            json = try JSONSnapshot(
                data: snapshot.bytes, providerName: SettingsReader.fileName, parsingOptions: .init(secretsSpecifier: .specific(secrets)))
        } catch {
            throw DataQueueSettings.configError("\(source) holds a value dq cannot read (a list of lists, or of mixed types?)")
        }
        self.path = path
        func hasPassword(_ value: Any?) -> Bool {
            (value as? String).flatMap { NetworkConfiguration.components($0)?.password } != nil
        }
        holdsSecret =
            auth["bearer_token"] != nil || auth["client_secret"] != nil || hasPassword(object["database"]) || hasPassword(object["proxy"])
    }

    /// Reads and checks the file at `path`, whose keys are `keys`.
    package init(contentsOf path: String, keys: SettingKeys = .library) throws {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw DataQueueSettings.configError("cannot read the config file \(path)")
        }
        try self.init(data: data, source: path, path: path, keys: keys)
    }

    package func value(forKey key: AbsoluteConfigKey, type: ConfigType) throws -> LookupResult {
        let name = key.description
        if hidden.contains(name) { return LookupResult(encodedKey: name, value: nil) }
        if let text = objects[name], type == .string {
            return LookupResult(encodedKey: name, value: ConfigValue(.string(text), isSecret: keys.byName[name]?.isSecret ?? false))
        }
        return try json.value(forKey: key, type: type)
    }
}

/// A provider whose values do not change under a reader (the environment, a file read once): everything
/// `ConfigProvider` asks besides its synchronous lookup is that lookup.
package protocol StaticSettingsProvider: ConfigProvider {
    func value(forKey key: AbsoluteConfigKey, type: ConfigType) throws -> LookupResult
}

extension StaticSettingsProvider {
    package func fetchValue(forKey key: AbsoluteConfigKey, type: ConfigType) async throws -> LookupResult {
        try value(forKey: key, type: type)
    }

    nonisolated(nonsending) package func watchValue<Return: ~Copyable>(
        forKey key: AbsoluteConfigKey, type: ConfigType,
        updatesHandler:
            nonisolated(nonsending) (_ updates: ConfigUpdatesAsyncSequence<Result<LookupResult, any Error>, Never>) async throws -> Return
    ) async throws -> Return {
        try await watchValueFromValue(forKey: key, type: type, updatesHandler: updatesHandler)
    }

    package func snapshot() -> any ConfigSnapshot { SettingsSnapshot(provider: self) }

    nonisolated(nonsending) package func watchSnapshot<Return: ~Copyable>(
        updatesHandler: nonisolated(nonsending) (_ updates: ConfigUpdatesAsyncSequence<any ConfigSnapshot, Never>) async throws -> Return
    ) async throws -> Return {
        try await watchSnapshotFromSnapshot(updatesHandler: updatesHandler)
    }
}

/// A provider's values as they are now (the environment and the file do not change under a reader).
private struct SettingsSnapshot: ConfigSnapshot {
    let provider: any ConfigProvider
    var providerName: String { provider.providerName }
    func value(forKey key: AbsoluteConfigKey, type: ConfigType) throws -> LookupResult {
        try provider.value(forKey: key, type: type)
    }
}

/// An access reporter that keeps where each key's value came from, as `dq config` shows it: `flag`, `env
/// DQ_…`, or the file's path and key.
package final class OriginRecorder: AccessReporter, Sendable {
    private let origins = NIOLockedValueBox<[String: (provider: String, encodedKey: String)]>([:])

    package init() {}

    package func report(_ event: AccessEvent) {
        let key = event.metadata.key.description
        for result in event.providerResults {
            guard case .success(let lookup) = result.result, lookup.value != nil else { continue }
            origins.withLockedValue { origins in
                if origins[key] == nil { origins[key] = (result.providerName, lookup.encodedKey) }
            }
            return
        }
    }

    /// Which provider answered `key`, and under which name (a variable's, the file's key), if one did.
    package func origin(of key: String) -> (provider: String, encodedKey: String)? {
        origins.withLockedValue { $0[key] }
    }
}
