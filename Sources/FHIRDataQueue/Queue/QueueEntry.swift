import Foundation

/// A resource to queue, how to send it, and the `fullUrl` other resources may reference it by.
///
/// It reads either a plain resource or a Bundle entry, so that NDJSON lines can be written either way:
///
/// ```json
/// {"fullUrl": "urn:uuid:5f0c…", "resource": {"resourceType": "Patient", …}}
/// {"resource": {"resourceType": "Observation", "subject": {"reference": "urn:uuid:5f0c…"}, …}}
/// ```
public struct QueueEntry: Sendable {
    /// The resource.
    public var resource: FHIRResource
    /// How it is sent: `.post` (create) or `.put` (update).
    public var method: FHIRMethod
    /// The `urn:uuid:…` by which later resources reference this one, if any.
    public var fullURL: String?

    /// An entry from its parts. The defaults are a create and no fullUrl.
    public init(_ resource: FHIRResource, method: FHIRMethod = .post, fullURL: String? = nil) {
        self.resource = resource
        self.method = method
        self.fullURL = fullURL
    }

    /// The method a Bundle entry's `request.method` names, if it named one.
    public var declaredMethod: FHIRMethod?

    /// Reads JSON that is a resource, or a Bundle entry (`fullUrl`, `resource`, optional `request.method`).
    ///
    /// - Parameters:
    ///   - json: UTF-8 JSON.
    ///   - maximumSize: the largest accepted resource. The default is ``FHIRResource/defaultMaximumSize``.
    /// - Throws: ``DataQueueError`` with `.invalidResource` naming the problem.
    public init(json: Data, maximumSize: Int = FHIRResource.defaultMaximumSize) throws {
        // Most lines are resources: only a document that is not one is tried as an entry.
        do {
            self.init(try FHIRResource(json: json, maximumSize: maximumSize))
            return
        } catch let error as DataQueueError where error.message.contains("no \"resourceType\"") {
            let document: JSONScanner.Document
            do {
                document = try JSONScanner.scan(json, 0..<json.count, keys: ["fullUrl", "resource", "request"])
            } catch {
                throw error
            }
            guard let resourceRange = document.members["resource"] else { throw error }
            let start = json.startIndex + resourceRange.lowerBound
            let resource = try FHIRResource(
                json: Data(json[start..<(json.startIndex + resourceRange.upperBound)]), maximumSize: maximumSize)
            var fullURL: String?
            if let range = document.members["fullUrl"] {
                guard let text = JSONScanner.string(in: json, range) else {
                    throw DataQueueError(.invalidResource, "the entry's \"fullUrl\" is not a string")
                }
                fullURL = text
            }
            var declared: FHIRMethod?
            if let range = document.members["request"] {
                let request = try? JSONScanner.scan(json, range, keys: ["method"])
                if let text = request?.members["method"].flatMap({ JSONScanner.string(in: json, $0) }) {
                    guard let method = FHIRMethod(rawValue: text.uppercased()) else {
                        throw DataQueueError(.invalidResource, "the entry's \"request.method\" must be POST or PUT")
                    }
                    declared = method
                }
            }
            self.init(resource, method: declared ?? .post, fullURL: fullURL)
            self.declaredMethod = declared
        }
    }
}
