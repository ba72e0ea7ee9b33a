import Foundation

/// A value that describes itself without its secrets: its `description`, `debugDescription` and `customMirror`
/// all come from one list of its fields (``redactedFields``), each marked plain, secret, a URL that may hold a
/// password, or a dictionary whose values are secret.
///
/// So `String(describing:)`, `String(reflecting:)`, string interpolation, `dump(_:)` and anything else that
/// reflects the value (a log line's metadata, an error's message, swift-service-lifecycle naming a service in
/// its "Starting service" lines) show the plain fields and ``Redaction/placeholder`` for each secret: a token, a
/// client secret, a password in a PostgreSQL or proxy URL, a key. A secret no longer leaks through a line that
/// prints the whole value, whoever writes that line.
///
/// A conforming struct lists every stored property (a unit test checks that none is left out); a class or an
/// actor lists what describes it (its name, its configuration), never state that holds a credential.
package protocol RedactedDescription: CustomStringConvertible, CustomDebugStringConvertible, CustomReflectable {
    /// The fields, in declaration order, each marked with how descriptions may show it.
    var redactedFields: [RedactedField] { get }
}

extension RedactedDescription {
    /// The value's plain fields, each secret as `<redacted>` and each URL's password as `***`; unset fields are
    /// left out.
    public var description: String { Redaction.describe(String(describing: Self.self), redactedFields) }

    /// The same as `description`: never a secret.
    public var debugDescription: String { description }

    /// The value's fields for `dump(_:)` and other reflection: each secret as `<redacted>`, each URL's password
    /// as `***`.
    public var customMirror: Mirror {
        Mirror(
            self, children: redactedFields.map { (label: Optional($0.label), value: $0.shown) },
            displayStyle: Self.self is AnyClass ? .class : .struct)
    }
}

/// One field of a ``RedactedDescription`` value: its name, its value (for comparing two values inside dq), and
/// what descriptions show of it.
package struct RedactedField: CustomStringConvertible, CustomDebugStringConvertible, CustomReflectable {
    /// The property's name.
    package let label: String
    /// The value itself, secrets included: for comparisons (``Redaction/differences(_:_:ignoring:depth:)``), never
    /// shown.
    package let value: Any
    /// What descriptions and mirrors show in its place.
    package let shown: Any

    /// A field shown as it is (a value that holds a secret describes itself without it).
    package static func plain<Value>(_ label: String, _ value: Value) -> RedactedField {
        RedactedField(label: label, value: value as Any, shown: value as Any)
    }

    /// A secret: shown as ``Redaction/placeholder`` when set, `nil` when not.
    package static func secret<Value>(_ label: String, _ value: Value?) -> RedactedField {
        RedactedField(label: label, value: value as Any, shown: value == nil ? Optional<Redaction.Secret>.none as Any : Redaction.Secret())
    }

    /// A URL (PostgreSQL, a proxy, an endpoint) that may hold a password: shown with it replaced (see
    /// ``Redaction/url(_:)``).
    package static func url(_ label: String, _ value: String?) -> RedactedField {
        RedactedField(label: label, value: value as Any, shown: value.map(Redaction.url) as Any)
    }

    /// A URL that may hold a password: shown with it replaced.
    package static func url(_ label: String, _ value: URL?) -> RedactedField {
        RedactedField(label: label, value: value as Any, shown: value.map { Redaction.url($0.absoluteString) } as Any)
    }

    /// A dictionary whose keys may be shown and whose values are secret (registration headers and fields).
    package static func secretValues<Value>(_ label: String, _ value: [String: Value]?) -> RedactedField {
        RedactedField(
            label: label, value: value as Any,
            shown: value.map { dictionary in dictionary.mapValues { _ in Redaction.Secret() } } as Any)
    }

    /// A field shown as `shown`, compared by `value`.
    package static func custom<Value, Shown>(_ label: String, _ value: Value, shown: Shown) -> RedactedField {
        RedactedField(label: label, value: value as Any, shown: shown as Any)
    }

    /// The label and what is shown: never the value itself.
    package var description: String { "\(label): \(Redaction.show(shown) ?? "nil")" }
    /// The same as ``description``.
    package var debugDescription: String { description }
    /// The label and what is shown: never the value itself.
    package var customMirror: Mirror { Mirror(self, children: ["label": label, "shown": shown]) }
}

/// How dq shows values that hold secrets (see ``RedactedDescription``).
package enum Redaction {
    /// What a description shows in place of a secret.
    package static let placeholder = "<redacted>"

    /// A secret, as descriptions show it: ``Redaction/placeholder``.
    package struct Secret: CustomStringConvertible, CustomDebugStringConvertible, CustomReflectable, Sendable {
        package var description: String { Redaction.placeholder }
        package var debugDescription: String { Redaction.placeholder }
        package var customMirror: Mirror { Mirror(self, children: [], displayStyle: .struct) }
    }

    /// `text` with a URL's password replaced by `***`, as are the values of query items that name a password,
    /// secret or token. A proxy written without a scheme (`user:password@host:3128`) is read as `http://`. Text
    /// with an `@` that is no URL is shown as ``placeholder``: it may hold credentials that cannot be told apart.
    package static func url(_ text: String) -> String {
        guard text.contains("@") || text.contains("?") else { return text }
        let schemeless = !text.contains("://")
        guard var components = URLComponents(string: schemeless ? "http://" + text : text) else {
            return text.contains("@") ? placeholder : text
        }
        if components.password != nil { components.percentEncodedPassword = "***" }
        if let items = components.queryItems {
            components.queryItems = items.map { item in
                let name = item.name.lowercased()
                guard ["pass", "secret", "token"].contains(where: name.contains), item.value != nil else { return item }
                return URLQueryItem(name: item.name, value: "***")
            }
        }
        guard var shown = components.string else { return placeholder }
        if schemeless { shown.removeFirst("http://".count) }
        return shown
    }

    /// `Type(label: value, …)` with the fields that are set, each as descriptions show it.
    package static func describe(_ typeName: String, _ fields: [RedactedField]) -> String {
        let shown = fields.compactMap { field in show(field.shown).map { "\(field.label): \($0)" } }
        return "\(typeName)(\(shown.joined(separator: ", ")))"
    }

    /// A shown value as a description writes it (`String(reflecting:)`, an optional unwrapped); nil when unset.
    package static func show(_ value: Any) -> String? {
        let mirror = Mirror(reflecting: value)
        guard mirror.displayStyle == .optional else { return String(reflecting: value) }
        return mirror.children.first.map { show($0.value) ?? "nil" }
    }

    /// How a value of a type dq may not know (an application's ``AuthorizationProvider``) is shown: its type's
    /// name, never its contents.
    package static func name(of value: Any) -> String {
        String(describing: type(of: value))
    }

    // MARK: - Comparing

    /// The named fields of `value` (its ``RedactedDescription/redactedFields`` with their values, else its
    /// mirror's labelled children) when it is a struct, an optional holding one unwrapped; nil for anything else.
    package static func fields(of value: Any) -> [(label: String, value: Any)]? {
        let unwrapped = self.unwrapped(value)
        guard let unwrapped else { return nil }
        if let redacting = unwrapped as? any RedactedDescription {
            guard !(type(of: unwrapped) is AnyClass) else { return nil }
            return redacting.redactedFields.map { ($0.label, $0.value) }
        }
        let mirror = Mirror(reflecting: unwrapped)
        guard mirror.displayStyle == .struct else { return nil }
        return mirror.children.compactMap { child in child.label.map { ($0, child.value) } }
    }

    /// The fields of `old` and `new` that differ, by their property names (nested ones as `auth.clientSecret`),
    /// compared with their secrets (see ``comparable(_:depth:)``) and named, never shown. A struct field is
    /// looked into while `depth` is above 0.
    package static func differences(_ old: Any, _ new: Any, ignoring ignored: Set<String> = [], depth: Int = 1) -> [String] {
        guard let oldFields = fields(of: old), let newFields = fields(of: new) else { return [] }
        let newValues = Dictionary(newFields.map { ($0.label, $0.value) }) { first, _ in first }
        var names: [String] = []
        for (label, value) in oldFields where !ignored.contains(label) {
            guard let other = newValues[label], comparable(value) != comparable(other) else { continue }
            if depth > 0, fields(of: value) != nil, fields(of: other) != nil {
                names += differences(value, other, ignoring: ignored, depth: depth - 1).map { label + "." + $0 }
            } else {
                names.append(label)
            }
        }
        return names
    }

    /// A text that differs whenever two values differ, secrets included (a ``RedactedDescription`` value is
    /// written by its fields' values, not its description): for comparing, never for showing.
    package static func comparable(_ value: Any, depth: Int = 0) -> String {
        guard depth < 16 else { return "…" }
        if let redacting = value as? any RedactedDescription {
            let fields = redacting.redactedFields.map { "\($0.label): \(comparable($0.value, depth: depth + 1))" }
            return "\(type(of: value))(\(fields.joined(separator: ", ")))"
        }
        let mirror = Mirror(reflecting: value)
        switch mirror.displayStyle {
        case .optional:
            return mirror.children.first.map { "some(" + comparable($0.value, depth: depth + 1) + ")" } ?? "nil"
        case .dictionary, .set:
            // In an order of their own: two equal dictionaries may list their members in different orders.
            let members = mirror.children.map { comparable($0.value, depth: depth + 1) }.sorted()
            return "[" + members.joined(separator: ", ") + "]"
        case .struct, .tuple, .collection, .enum:
            if mirror.children.isEmpty { return String(reflecting: value) }
            let members = mirror.children.map { "\($0.label ?? ""): \(comparable($0.value, depth: depth + 1))" }
            return "\(type(of: value))(\(members.joined(separator: ", ")))"
        default:
            return String(reflecting: value)
        }
    }

    private static func unwrapped(_ value: Any) -> Any? {
        let mirror = Mirror(reflecting: value)
        guard mirror.displayStyle == .optional else { return value }
        return mirror.children.first.flatMap { unwrapped($0.value) }
    }
}

extension StaticBearerToken: CustomDebugStringConvertible, CustomReflectable {
    /// The same as `description`: never the token.
    public var debugDescription: String { description }
    /// No children: the token is never reflected (`dump(_:)` shows `StaticBearerToken(<redacted>)`).
    public var customMirror: Mirror { Mirror(self, children: [], displayStyle: .struct) }
}
