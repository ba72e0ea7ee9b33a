import FHIRDataQueue
import Foundation
import Hummingbird
import NIOCore

/// The FHIR side of an HTTP exchange, shared by every receiver built on dq (`dq serve`, the Gateway example, a
/// host's own routes): a request's body read as one FHIR resource, a write's outcome as the answer a FHIR
/// client expects, and refusals as `OperationOutcome`s.
///
/// No answer carries resource content: a refusal says what is wrong with the input, never what it holds.
public enum FHIRExchange {
    /// A request that cannot be taken, with the answer that says why.
    public struct Refusal: Error, Sendable {
        /// The HTTP status of the answer.
        public let status: HTTPResponse.Status
        /// The OperationOutcome's `issue.code` (FHIR's IssueType: `invalid`, `not-supported`, `too-costly`, …).
        public let code: String
        /// What is wrong, for the client; no resource content.
        public let diagnostics: String

        /// A refusal answered with `status` and one issue of `code`.
        public init(_ status: HTTPResponse.Status, _ code: String, _ diagnostics: String) {
            self.status = status
            self.code = code
            self.diagnostics = diagnostics
        }

        /// The answer: an `OperationOutcome` with one error issue.
        public var response: Response { FHIRExchange.outcome(status, code, diagnostics) }
    }

    /// Reads the request's body as one FHIR resource, as `dq enqueue` checks input.
    ///
    /// - Parameters:
    ///   - request: the request whose body is read.
    ///   - maximumBytes: the largest body taken; a larger one is refused with 413.
    ///   - types: the resource types taken (nil: any); another is refused with 400 `not-supported`.
    /// - Throws: ``Refusal`` for a body that is too large, not JSON, not one resource, or of a type not taken.
    public static func resource(
        from request: Request, maximumBytes: Int, types: Set<String>? = nil
    ) async throws -> FHIRResource {
        var request = request
        let body: ByteBuffer
        do {
            body = try await request.collectBody(upTo: maximumBytes)
        } catch is NIOTooManyBytesError {
            throw Refusal(.contentTooLarge, "too-costly", "the body is larger than \(maximumBytes) bytes")
        }
        let resource: FHIRResource
        do {
            resource = try FHIRResource(json: Data(buffer: body))
        } catch let error as DataQueueError {
            throw Refusal(.badRequest, "invalid", error.message)
        } catch {
            throw Refusal(.badRequest, "invalid", "the body is not a FHIR resource in JSON")
        }
        if let types, !types.contains(resource.resourceType) {
            let taken = types.sorted().joined(separator: ", ")
            throw Refusal(.badRequest, "not-supported", "this endpoint takes \(taken), not \(resource.resourceType)")
        }
        return resource
    }

    /// The answer to a write: `201 Created` with the FHIR server's `Location` when it took the resource,
    /// `202 Accepted` with the queued item's id when it is safely queued for later, `422` when the server
    /// rejected it for good (parked for an operator).
    public static func response(for result: SendOutcome) -> Response {
        switch result {
        case .delivered(let record):
            var headers = HTTPFields()
            if let location = record.location { headers[.location] = location }
            return Response(status: .created, headers: headers)
        case .queued(let item, _):
            return Response(
                status: .accepted, headers: [.contentType: "application/json"],
                body: .init(byteBuffer: ByteBuffer(string: #"{"queued":"\#(item.id.uuidString.lowercased())"}"#)))
        case .parked(_, let reason):
            return outcome(.unprocessableContent, "processing", "the FHIR server rejected it: \(reason)")
        }
    }

    /// Writes `resource` through `queue` (durable before the answer) and answers as ``response(for:)`` does;
    /// a resource the queue refuses is a 400, credentials the server refused a 202 (the resource is queued; an
    /// operator must fix them).
    public static func create(_ resource: FHIRResource, in queue: DataQueue) async throws -> Response {
        do {
            return response(for: try await queue.create(resource))
        } catch let error as DataQueueError where error.code == .invalidResource {
            return outcome(.badRequest, "invalid", error.message)
        } catch let error as DataQueueError where error.code == .authentication {
            return outcome(.accepted, "security", "queued; the FHIR server refused dq's credentials")
        }
    }

    /// A FHIR `OperationOutcome` answer with one error issue.
    public static func outcome(_ status: HTTPResponse.Status, _ code: String, _ diagnostics: String) -> Response {
        let issue: [String: Any] = ["severity": "error", "code": code, "diagnostics": diagnostics]
        let json =
            (try? JSONSerialization.data(
                withJSONObject: ["resourceType": "OperationOutcome", "issue": [issue]], options: [.sortedKeys])) ?? Data()
        return Response(
            status: status, headers: [.contentType: "application/fhir+json"],
            body: .init(byteBuffer: ByteBuffer(bytes: json)))
    }
}
