import Foundation

/// What a device may write to the FHIR server through a receiver (`dq serve`): the resource types it may create or
/// update, expressed as SMART v2 scopes (`system/Observation.c`, `Patient.cu`).
///
/// A receiver forwards what a device sends; the Antispam secret ships in every app build, so "a device" is anyone
/// holding the app. The policy keeps such a client to its own writes:
/// - a type may be created (`c`: `POST Type`, or `PUT Type/id` of an id that is not on the server yet) or updated
///   (`u`: `PUT Type/id` of a resource the same client created through the receiver), and nothing else;
/// - no `DELETE`, `PATCH` or conditional write, ever (a scope with `d` is refused);
/// - a transaction or batch Bundle only when every entry is allowed by the same rules;
/// - the type a request's path names is the type of what it holds.
///
/// A `PUT` is a ``Target``: before it is sent the queue asks the server whether `Type/id` exists, and records
/// which client wrote it (as the SHA-256 of the server and `Type/id`, in the queue's database). A `PUT` over a
/// resource that another client wrote, or that exists on the server and no client of the receiver wrote, is refused.
///
/// The default (``c3pro``) is what the receiver C3-PRO deployed accepted (`POST QuestionnaireResponse`,
/// `Contract`, `Observation`, `PUT Patient/{id}`), plus `Consent`.
public struct WritePolicy: Sendable, Equatable, CustomStringConvertible {
    /// What a scope grants on a type.
    public struct Permission: OptionSet, Sendable, Hashable {
        public let rawValue: Int
        /// Creates the permission set with the raw bits.
        public init(rawValue: Int) { self.rawValue = rawValue }
        /// `c`: create (`POST`, or `PUT` of a new id).
        public static let create = Permission(rawValue: 1)
        /// `u`: update a resource the same client created through the receiver.
        public static let update = Permission(rawValue: 2)
    }

    /// How a quarantine reason of the policy's begins (after ``DataQueue/quarantinePrefix``).
    public static let refusalPrefix = "refused by the write policy: "

    /// The permissions per resource type; `*` for every type.
    public private(set) var permissions: [String: Permission]

    /// C3-PRO's writes plus Consent: `Contract`, `Consent`, `Observation`, `Patient` and `QuestionnaireResponse`, each
    /// created or updated (updates of a device's own resources only).
    public static let c3pro = WritePolicy(
        permissions: Dictionary(
            uniqueKeysWithValues: ["Contract", "Consent", "Observation", "Patient", "QuestionnaireResponse"].map {
                ($0, [.create, .update])
            }))

    private init(permissions: [String: Permission]) { self.permissions = permissions }

    /// A policy of SMART v2 scopes: `[system/]Type.c`, `.u` or `.cu`, `Type` a FHIR type name or `*`.
    /// - Throws: ``DataQueueError`` with `.invalidConfiguration` for a scope that is not one, or grants a delete,
    ///   read or search (a device only writes its own).
    public init(scopes: [String]) throws(DataQueueError) {
        var permissions: [String: Permission] = [:]
        for scope in scopes {
            var text = Substring(scope)
            if text.hasPrefix("system/") { text = text.dropFirst("system/".count) }
            let parts = text.split(separator: ".", omittingEmptySubsequences: false)
            guard parts.count == 2, parts[0] == "*" || FHIRResource.isValidTypeName(String(parts[0])), !parts[1].isEmpty else {
                throw DataQueueError(
                    .invalidConfiguration,
                    "write policy scope \(FHIRResource.printable(scope)) is not [system/]Type.c, .u or .cu (e.g. system/Observation.c)")
            }
            var granted: Permission = []
            for letter in parts[1] {
                switch letter {
                case "c": granted.insert(.create)
                case "u": granted.insert(.update)
                case "d":
                    throw DataQueueError(
                        .invalidConfiguration, "write policy scope \(FHIRResource.printable(scope)): a device may never delete")
                default:
                    throw DataQueueError(
                        .invalidConfiguration,
                        "write policy scope \(FHIRResource.printable(scope)): only c (create) and u (update) can be granted")
                }
            }
            permissions[String(parts[0]), default: []].formUnion(granted)
        }
        self.permissions = permissions
    }

    /// The policy as scopes, sorted (`system/Observation.cu`).
    public var scopes: [String] {
        permissions.keys.sorted().map { type in
            let granted = permissions[type] ?? []
            return "system/\(type)." + (granted.contains(.create) ? "c" : "") + (granted.contains(.update) ? "u" : "")
        }
    }

    /// The scopes, comma-separated.
    public var description: String { scopes.joined(separator: ",") }

    /// Whether the policy grants `permission` on `type`.
    public func allows(_ type: String, _ permission: Permission) -> Bool {
        (permissions[type] ?? []).union(permissions["*"] ?? []).isSuperset(of: permission)
    }

    /// A `PUT Type/id` the policy allows only once the server and the receiver's records say whose it is.
    public struct Target: Sendable, Hashable {
        /// The resource type.
        public var type: String
        /// The resource id.
        public var id: String
        /// Whether it may be a new resource (the type may be created).
        public var mayCreate: Bool
        /// Whether it may be an update of the client's own resource (the type may be updated).
        public var mayUpdate: Bool
        /// `Type/id`.
        public var path: String { "\(type)/\(id)" }
    }

    /// What the policy says of a write.
    public enum Decision: Sendable, Equatable {
        /// Allowed, once each `PUT` target is found to be new or the client's own.
        case allowed([Target])
        /// Refused, with why (no resource content: types, methods and ids only).
        case refused(String)
    }

    /// The decision on `resource` written with `method` (a `PUT` to `resource.id`), sent to a path that names
    /// `pathType` (nil: none, or a name the receiver does not take).
    public func evaluate(_ resource: FHIRResource, method: FHIRMethod, pathType: String?) -> Decision {
        if let pathType, pathType != resource.resourceType {
            return .refused("the path names \(pathType), but the resource is a \(resource.resourceType)")
        }
        if resource.isTransactionOrBatch {
            return evaluateEntries(of: resource)
        }
        switch method {
        case .post:
            return allows(resource.resourceType, .create)
                ? .allowed([]) : .refused("devices may not create \(resource.resourceType) resources")
        case .put:
            return target(type: resource.resourceType, id: resource.id ?? "")
        }
    }

    private func target(type: String, id: String) -> Decision {
        let target = Target(type: type, id: id, mayCreate: allows(type, .create), mayUpdate: allows(type, .update))
        guard target.mayCreate || target.mayUpdate else { return .refused("devices may not write \(type) resources") }
        guard FHIRResource.isValidID(id) else { return .refused("a \(type) update needs a valid id") }
        return .allowed([target])
    }

    /// Every entry of a transaction or batch Bundle, by the same rules as a write of its own.
    private func evaluateEntries(of bundle: FHIRResource) -> Decision {
        guard let object = (try? JSONSerialization.jsonObject(with: bundle.data)) as? [String: Any] else {
            return .refused("the Bundle cannot be read")
        }
        let entries = object["entry"] as? [Any] ?? []
        var targets: [Target] = []
        var seen: Set<String> = []
        for (index, element) in entries.enumerated() {
            let number = index + 1
            guard let entry = element as? [String: Any], let request = entry["request"] as? [String: Any],
                let method = request["method"] as? String, let url = request["url"] as? String
            else { return .refused("Bundle entry \(number) has no request method and url") }
            guard method == "POST" || method == "PUT" else {
                return .refused("Bundle entry \(number) is a \(FHIRResource.printable(method)): devices may only create and update")
            }
            guard !url.contains("?"), !url.contains("#"), !url.contains("://"), !url.hasPrefix("/") else {
                return .refused("Bundle entry \(number): conditional or absolute request urls are not allowed")
            }
            guard let resource = entry["resource"] as? [String: Any], let type = resource["resourceType"] as? String,
                FHIRResource.isValidTypeName(type)
            else { return .refused("Bundle entry \(number) has no resource") }
            if type == "Bundle", let inner = resource["type"] as? String, ["transaction", "batch"].contains(inner) {
                return .refused("Bundle entry \(number) is a nested transaction")
            }
            let parts = url.split(separator: "/", omittingEmptySubsequences: false).map(String.init)
            if method == "POST" {
                guard parts == [type] else {
                    return .refused("Bundle entry \(number): a POST of a \(type) goes to \(type)")
                }
                guard allows(type, .create) else { return .refused("Bundle entry \(number): devices may not create \(type) resources") }
            } else {
                guard parts.count == 2, parts[0] == type, resource["id"] as? String == parts[1] else {
                    return .refused("Bundle entry \(number): a PUT of a \(type) goes to \(type)/ its own id")
                }
                switch target(type: type, id: parts[1]) {
                case .refused(let why): return .refused("Bundle entry \(number): \(why)")
                case .allowed(let found):
                    for target in found where seen.insert(target.path).inserted { targets.append(target) }
                }
            }
        }
        return .allowed(targets)
    }
}
