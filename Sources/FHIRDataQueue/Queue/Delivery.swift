import Foundation
import Logging

/// How one request reaches the server and what its answer means: the credential (with one retry after a
/// 401/403 with a fresh one), the transport, and the classification of the answer. A flush sends through it;
/// it knows nothing of the queue's storage.
struct Delivery: Sendable {
    /// Sends the requests (one shared HTTP client, its proxy and TLS settings).
    let transport: FHIRTransport
    /// Supplies the `Authorization` header, if any.
    let authorization: (any AuthorizationProvider)?
    /// Whether creates go as conditional creates: always (idempotent mode), for the declared types, or never.
    let idempotence: DataQueue.Idempotence
    let logger: Logger

    /// What one request came to.
    enum Outcome {
        /// Accepted; `conditional` when it was sent as a conditional create.
        case delivered(TransportResponse, conditional: Bool)
        case rejected(status: Int?, message: String, outcome: String?)
        /// `mayHaveArrived` is false only when the request certainly never reached the server.
        case transient(status: Int?, message: String, retryAfter: TimeInterval?, mayHaveArrived: Bool)
        case authentication(status: Int?, message: String)
    }

    /// The request that sends a stored item now: the condition of a conditional create is added here, so the
    /// setting of this flush (and the item's own override) applies. `declared`: the types whose conditional
    /// create the server's CapabilityStatement declares (nil: not known), for ``DataQueue/Idempotence/automatic``.
    func outgoingRequest(for item: StoredItem, url: String, declared: Set<String>?) throws -> OutgoingRequest {
        var body = item.body
        var ifNoneExist: String?
        if item.conditionalCreate && item.info.method == .post && !item.info.encrypted {
            switch idempotence {
            case .always:
                (body, ifNoneExist) = try ConditionalCreate.prepare(body, itemID: item.info.id, isBundle: item.info.url.isEmpty)
            case .automatic:
                if let declared, !declared.isEmpty {
                    (body, ifNoneExist) = ConditionalCreate.prepareDeclared(
                        body, resourceType: item.info.resourceType, isBundle: item.info.url.isEmpty, declared: declared)
                }
            case .never:
                break
            }
        }
        return OutgoingRequest(
            method: item.info.method, url: url, contentType: item.contentType, ifNoneExist: ifNoneExist, body: body)
    }

    /// Sends one request, with one fresh credential and one retry after a 401/403, and classifies the answer.
    func deliver(_ request: OutgoingRequest, encrypted: Bool) async -> Outcome {
        var refused: (header: String, status: Int, message: String)?
        while true {
            Heartbeat.beat()
            let header: String?
            do {
                if let refused {
                    header = try await authorization?.authorizationHeader(replacing: refused.header, logger: logger)
                    // The same credential again (a static token): sending it again would only be refused again.
                    if header == refused.header {
                        return .authentication(status: refused.status, message: refused.message)
                    }
                } else {
                    header = try await authorization?.authorizationHeader(forceRefresh: false, logger: logger)
                }
            } catch let error as DataQueueError where error.code == .authentication {
                return .authentication(status: nil, message: error.message)
            } catch let error as DataQueueError {
                return .transient(status: nil, message: error.message, retryAfter: nil, mayHaveArrived: false)
            } catch {
                return .transient(status: nil, message: "cannot obtain a token", retryAfter: nil, mayHaveArrived: false)
            }
            let response: TransportResponse
            Heartbeat.beat()
            do {
                response = try await transport.send(request, authorization: header, logger: logger)
            } catch let failure as TransportFailure {
                return .transient(
                    status: nil, message: failure.message, retryAfter: nil, mayHaveArrived: failure.mayHaveArrived)
            } catch {
                return .transient(status: nil, message: "\(error)", retryAfter: nil, mayHaveArrived: true)
            }
            switch ResponseClassification.classify(
                status: response.status, body: response.body, retryAfter: response.retryAfter,
                envelope: encrypted, location: response.location ?? response.contentLocation)
            {
            case .success:
                return .delivered(response, conditional: request.ifNoneExist != nil)
            case .permanent(let message):
                let outcome = response.body.isEmpty ? nil : String(decoding: response.body, as: UTF8.self)
                return .rejected(status: response.status, message: message, outcome: outcome)
            case .transient(let message, let retryAfter):
                return .transient(status: response.status, message: message, retryAfter: retryAfter, mayHaveArrived: true)
            case .authentication(let message):
                // One retry with a fresh credential; the provider renews only if this header is still current.
                if let header, refused == nil {
                    refused = (header, response.status, message)
                    continue
                }
                return .authentication(status: response.status, message: message)
            }
        }
    }

    /// Where the server stored a created or updated resource, and what said so: `Location`, else
    /// `Content-Location`, else the answer's own resource (`id` and `meta.versionId`, when the server answers
    /// with the representation and it is of `resourceType`), else, for an update, the id it was sent to.
    struct ServerIdentity: Equatable {
        var id: String?
        var version: String?
        /// A PHI-free note for the journal when the id did not come from `Location`.
        var note: String?
    }

    static func serverIdentity(
        location: String?, contentLocation: String?, etag: String?, answer: Data?, resourceType: String, method: FHIRMethod,
        resourceID: String?
    ) -> ServerIdentity {
        let version = TransactionBundle.version(fromETag: etag)
        for (header, note) in [(location, nil), (contentLocation, "server id from Content-Location (the answer had no Location)")] {
            // `[base]/Type/id[/_history/vid]` of this resource's type: a header naming anything else (the type's
            // endpoint, another resource) is not where this one was stored.
            guard let header, let url = URL(string: header) else { continue }
            let parts = url.path.split(separator: "/").map(String.init)
            let history = parts.lastIndex(of: "_history")
            let idIndex = history.map { $0 - 1 } ?? parts.count - 1
            guard idIndex >= 1, parts[idIndex - 1] == resourceType, FHIRResource.isValidID(parts[idIndex]) else { continue }
            let headerVersion = history.flatMap { $0 + 1 < parts.count ? parts[$0 + 1] : nil }
            return ServerIdentity(id: parts[idIndex], version: headerVersion ?? version, note: note)
        }
        if let answer, !answer.isEmpty, let object = (try? JSONSerialization.jsonObject(with: answer)) as? [String: Any],
            object["resourceType"] as? String == resourceType, let id = object["id"] as? String, FHIRResource.isValidID(id)
        {
            let bodyVersion = (object["meta"] as? [String: Any])?["versionId"] as? String
            return ServerIdentity(
                id: id, version: bodyVersion ?? version, note: "server id from the answer's resource (the answer had no Location)")
        }
        if method == .put, let resourceID { return ServerIdentity(id: resourceID, version: version, note: nil) }
        return ServerIdentity(
            id: nil, version: version,
            note: "the server did not say where it stored it (no Location, Content-Location or resource id in its answer)")
    }

    /// Splits `[base]/[type]/[id]/_history/[vid]` into id and version id.
    static func parseLocation(_ location: String?) -> (String?, String?) {
        guard let location, let url = URL(string: location) else { return (nil, nil) }
        let parts = url.path.split(separator: "/").map(String.init)
        if let history = parts.lastIndex(of: "_history"), history >= 1 {
            return (parts[history - 1], history + 1 < parts.count ? parts[history + 1] : nil)
        }
        return (parts.last, nil)
    }

    /// What `base/metadata` answered (nil when no answer came), with the current credential.
    /// Whether a resource is on the server, as a `GET` of `url` answers: for the write policy's `PUT` targets.
    func existence(of url: String) async -> Existence {
        let header: String?
        do {
            header = try await authorization?.authorizationHeader(forceRefresh: false, logger: logger)
        } catch {
            return .authentication(status: nil, message: "cannot get a token to read the server")
        }
        let response: TransportResponse
        do {
            response = try await transport.get(url, authorization: header, logger: logger)
        } catch {
            return .unknown(status: nil, message: "the server did not answer whether the resource exists")
        }
        switch response.status {
        case 200...299: return .present
        case 404: return .absent
        case 410: return .deleted
        case 401, 403:
            return .authentication(status: response.status, message: "the server refused dq's credentials (HTTP \(response.status))")
        default:
            return .unknown(status: response.status, message: "the server answered HTTP \(response.status) to whether the resource exists")
        }
    }

    /// What a `GET` of a resource said (``existence(of:)``).
    enum Existence: Equatable {
        case present, absent, deleted
        case authentication(status: Int?, message: String)
        case unknown(status: Int?, message: String)
    }

    func capabilityStatement(base: String) async -> TransportResponse? {
        let header = try? await authorization?.authorizationHeader(forceRefresh: false, logger: logger)
        return try? await transport.get(base + "/metadata", authorization: header, logger: logger)
    }
}
