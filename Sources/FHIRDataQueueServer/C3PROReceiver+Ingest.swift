import Crypto
import FHIRDataQueue
import Foundation
import Hummingbird
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore

extension C3PROReceiver {
    // MARK: - Envelopes and plain resources

    func envelope(_ request: Request, client: String, type: String?) async throws -> Response {
        let key = try Self.idempotencyKey(request)
        let body = try await collectedBody(of: request)
        // The path's type is the sender's word only (the type inside counts once opened): one this queue does not
        // take (a DSTU2 type such as DiagnosticOrder, which C3-PRO apps may name) is queued unnamed, not refused:
        // a refusal would stop the device's queue at it for good.
        let named =
            type.flatMap { FHIRResource.isValidTypeName($0) && queue.configuration.resourceTypes.accepts($0) ? $0 : nil }
            ?? SealedEnvelope.unnamedType
        let envelope: SealedEnvelope
        do {
            envelope = try SealedEnvelope(json: Data(buffer: body), resourceType: named)
        } catch let error as DataQueueError {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        if let refused = try await overQuota(client, adding: body.readableBytes) { return refused }
        // With a key: a repeat is answered as the first was (202, nothing stored again); the receipt commits with
        // the item. Without one, the queue recognises a repeat when it opens it (client and plaintext digest).
        // The fingerprint only for a request with a key (it costs a parse and a hash: a tenth of an envelope's time).
        let fingerprint = key == nil ? "" : envelopeFingerprint(envelope, client: client)
        if let key, let first = try await queue.receipt(clientID: client, key: key) {
            return try await answerRepeat(first, fingerprint: fingerprint)
        }
        let idempotency = key.map { IdempotentRequest(key: $0, fingerprint: fingerprint, answer: (202, nil, Data())) }
        do {
            let target = route(version: envelope.version, type: named)
            if case .repeated(let first) = try await target.enqueue(envelope, from: client, idempotency: idempotency) {
                return try await answerRepeat(first, fingerprint: fingerprint)
            }
        } catch let error as DataQueueError where error.code == .invalidResource {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        return Response(status: .accepted)
    }

    /// Where the receiver's answers say a delivered resource is: `<prefix>/fhir`, a path of the receiver's own (the
    /// FHIR server behind it is not a device's business, nor reachable by it).
    var locationBase: String {
        let prefix = configuration.pathPrefix.split(separator: "/").joined(separator: "/")
        return (prefix.isEmpty ? "" : "/" + prefix) + "/fhir"
    }

    /// The queue of the first route that matches, else the receiver's.
    func route(version: String?, type: String) -> DataQueue {
        configuration.routes.first { route in
            switch route.match {
            case .version(let wanted): wanted == version
            case .resourceType(let wanted): wanted == type
            }
        }?.queue ?? queue
    }

    /// The request's body, up to ``Configuration/maximumBodyBytes``, or the 413 to answer.
    /// - Throws: ``Refused`` (413) past the limit.
    func collectedBody(of request: Request) async throws -> ByteBuffer {
        var request = request
        do {
            return try await request.collectBody(upTo: configuration.maximumBodyBytes)
        } catch is NIOTooManyBytesError {
            throw Refused(
                FHIRExchange.outcome(.contentTooLarge, "too-costly", "the body is larger than \(configuration.maximumBodyBytes) bytes"))
        }
    }

    /// A batch of envelopes from a `dq serve --role edge` (`EnvelopeBatch`): each checked as ``envelope(_:type:)``
    /// checks one, then all committed in one transaction, in order, before the 202; any bad one refuses the batch
    /// (400), nothing stored. Each is kept with the client the edge took it from, under the edge's own id
    /// (`<edge>/<origin>`), so that the repeat check tells an edge's devices apart and no client can speak for another's.
    func envelopeBatch(_ request: Request, client: String) async throws -> Response {
        let body = try await collectedBody(of: request)
        var envelopes: [(envelope: SealedEnvelope, clientID: String)] = []
        do {
            let entries = try EnvelopeBatch.decode(Data(buffer: body))
            guard entries.count <= EnvelopeBatch.maximumEntries else {
                return FHIRExchange.outcome(
                    .contentTooLarge, "too-costly", "an envelope batch holds at most \(EnvelopeBatch.maximumEntries) envelopes")
            }
            // `<edge>/<origin>`, the edge's id with its `/` and `%` escaped: no client's origin can name another's.
            let edge = client.replacingOccurrences(of: "%", with: "%25").replacingOccurrences(of: "/", with: "%2F")
            for (index, entry) in entries.enumerated() {
                let named =
                    FHIRResource.isValidTypeName(entry.type) && queue.configuration.resourceTypes.accepts(entry.type)
                    ? entry.type : SealedEnvelope.unnamedType
                do {
                    let envelope = try SealedEnvelope(json: entry.envelope, resourceType: named)
                    envelopes.append((envelope, entry.origin.map { "\(edge)/\($0)" } ?? client))
                } catch let error as DataQueueError {
                    throw DataQueueError(.invalidResource, "envelope \(index + 1): \(error.message)")
                }
            }
            // One transaction per route's queue, each in the batch's order; without routes, the whole batch.
            var targets: [(queue: DataQueue, envelopes: [(envelope: SealedEnvelope, clientID: String)])] = []
            for forwarded in envelopes {
                let target = route(version: forwarded.envelope.version, type: forwarded.envelope.resourceType)
                if let index = targets.firstIndex(where: { $0.queue === target }) {
                    targets[index].envelopes.append(forwarded)
                } else {
                    targets.append((target, [forwarded]))
                }
            }
            for target in targets { _ = try await target.queue.enqueue(forwarded: target.envelopes) }
        } catch let error as DataQueueError where error.code == .invalidResource {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        return json(.accepted, ["accepted": envelopes.count])
    }

    func plain(_ request: Request, client: () async throws -> String, type: String, id: String?) async throws -> Response {
        guard configuration.acceptsPlainResources else {
            return FHIRExchange.outcome(.notFound, "not-supported", "this receiver takes encrypted envelopes only")
        }
        let client = try await client()
        let key = try Self.idempotencyKey(request)
        let resource: FHIRResource
        do {
            resource = try await FHIRExchange.resource(from: request, maximumBytes: configuration.maximumBodyBytes, types: [type])
        } catch let refusal as FHIRExchange.Refusal {
            return refusal.response
        }
        if let id, resource.id != id {
            return FHIRExchange.outcome(.badRequest, "invalid", "the resource's id is not the one in the path")
        }
        let target = route(version: nil, type: resource.resourceType)
        if let refused = try await overQuota(client, adding: resource.data.count) { return refused }
        if let refused = try await writeRefusal(resource, method: id == nil ? .post : .put, pathType: type, client: client, queue: target) {
            return refused
        }
        let path = "fhir/\(type)" + (id.map { "/\($0)" } ?? "")
        let fingerprint = key == nil ? "" : Self.plainFingerprint(method: id == nil ? "POST" : "PUT", path: path, body: resource.data)
        if let key, let first = try await queue.receipt(clientID: client, key: key) {
            return try await answerRepeat(first, fingerprint: fingerprint)
        }
        let idempotency = key.map { IdempotentRequest(key: $0, fingerprint: fingerprint) }
        let item: QueuedItem
        do {
            // A queue that seals what it takes (an edge's) posts every envelope: the update is the opener's to make.
            let sealing = queue is EncryptedDataQueue && queue.defaultMethod(for: resource) == .post
            switch try await target.enqueue(resource, method: id == nil || sealing ? .post : .put, from: client, idempotency: idempotency) {
            case .queued(let queued): item = queued
            case .repeated(let first): return try await answerRepeat(first, fingerprint: fingerprint)
            }
        } catch let error as DataQueueError where error.code == .invalidResource {
            return FHIRExchange.outcome(.badRequest, "invalid", error.message)
        }
        // Committed. The queue's delivery sends it in its turn (the enqueue woke it); the answer waits a short while
        // for that, never for a backlog or a server that is slow to answer (flushing here did: a device then waited
        // for its request timeout, and sent the resource again).
        let deadline = ContinuousClock.now + configuration.deliveryWait
        var answer: Answer
        while true {
            if let made = Answer.of(
                try await target.journalRecord(item.id.uuidString.lowercased()), item: item.id, locationBase: locationBase)
            {
                answer = made
                break
            }
            guard ContinuousClock.now < deadline else {
                answer = .queued(item.id)
                break
            }
            try await Task.sleep(for: .milliseconds(20))
        }
        if let idempotency {
            try await record(
                answer, for: Receipt(clientID: client, key: idempotency.key, fingerprint: fingerprint, itemID: item.id))
        }
        return answer.response
    }

    /// The answer to a request that would take `client` past what it may have waiting (429 by count, 507 by bytes),
    /// or nil; counts the request when it goes on. Nothing is stored for a refused request.
    func overQuota(_ client: String, adding bytes: Int) async throws -> Response? {
        let count = configuration.maximumWaitingPerClient
        let most = configuration.maximumWaitingBytesPerClient
        guard count > 0 || most > 0 else { return nil }
        let waiting = try await waitingCounts.waiting(client, now: configuration.time.instant()) {
            try await registry.waiting(clientID: client)
        }
        if count > 0 && waiting.count >= count {
            Counter(label: "dq_serve_quota_refusals_total", dimensions: [("limit", "count")]).increment()
            var response = FHIRExchange.outcome(
                .tooManyRequests, "throttled", "this device has \(count) resources waiting at the receiver; send again later")
            response.headers[.retryAfter] = "60"
            return response
        }
        if most > 0 && waiting.bytes + bytes > most {
            Counter(label: "dq_serve_quota_refusals_total", dimensions: [("limit", "bytes")]).increment()
            var response = FHIRExchange.outcome(
                .init(code: 507, reasonPhrase: "Insufficient Storage"), "too-costly",
                "this device has \(most) bytes waiting at the receiver; send again later")
            response.headers[.retryAfter] = "60"
            return response
        }
        waitingCounts.add(client, bytes: bytes)
        return nil
    }

    /// The 403 for a plain write the queue's `WritePolicy` refuses: a type devices may not write, a `DELETE` or
    /// conditional entry in a Bundle, a path that names another type, or a `PUT` over a resource another client
    /// wrote. Nil when it may be queued (whether a `PUT`'s id is new on the server is asked when it is sent).
    func writeRefusal(
        _ resource: FHIRResource, method: FHIRMethod, pathType: String, client: String, queue: DataQueue
    ) async throws -> Response? {
        switch queue.configuration.writePolicy.evaluate(resource, method: method, pathType: pathType) {
        case .refused(let why):
            Counter(label: "dq_write_policy_refusals_total").increment()
            return FHIRExchange.outcome(.forbidden, "forbidden", WritePolicy.refusalPrefix + why)
        case .allowed(let targets):
            for target in targets {
                if let owner = try await registry.resourceOwner(queue: queue.queueName, target: target.path), owner != client {
                    Counter(label: "dq_write_policy_refusals_total").increment()
                    return FHIRExchange.outcome(
                        .forbidden, "forbidden", WritePolicy.refusalPrefix + "\(target.path) was written by another client")
                }
            }
            return nil
        }
    }

    func questionnaire(_ request: Request, id: String) async throws -> Response {
        _ = try await authorize(request)
        let valid = !id.isEmpty && id.count <= 64 && id.allSatisfy { $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "-" || $0 == ".") }
        guard valid, id != ".", id != "..", let directory = configuration.questionnairesDirectory,
            let data = FileManager.default.contents(atPath: directory + "/" + id + ".json")
        else {
            return FHIRExchange.outcome(.notFound, "not-found", "no Questionnaire with this id")
        }
        return Response(
            status: .ok, headers: [.contentType: "application/fhir+json"], body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }

}
