import AsyncHTTPClient
import Foundation
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import NIOSSL

/// The HTTP side of dq's OAuth2 clients: discovery documents, form posts to token, revocation and
/// registration endpoints, and client authentication. Redirects are not followed; answers are capped at
/// 1 MiB; a request that gets no answer becomes a ``DataQueueError/Code/transport`` error naming the URL
/// without its query.
struct OAuth2HTTP: Sendable {
    /// The process's clients for the network configuration (shared with the queues that use it).
    let clients: HTTPClients?
    /// The caller's own client, which then makes every request (its configuration, its proxy, its trust).
    let callerClient: HTTPClient?
    /// The network settings the words of an error name a proxy from.
    let network: NetworkConfiguration
    let timeout: TimeInterval

    /// With `client`, the caller's own `HTTPClient` makes every request; else the process's shared clients for
    /// `network`.
    ///
    /// - Throws: ``DataQueueError`` (`.invalidConfiguration`) for a certificate, key or CA bundle that cannot be read.
    init(network: NetworkConfiguration, timeout: TimeInterval, client: HTTPClient? = nil) throws {
        self.network = network
        callerClient = client
        if client == nil {
            let shared = try HTTPClients.shared(for: network)
            shared.noteTimeout(.milliseconds(Int64(timeout * 1000)))
            clients = shared
        } else {
            clients = nil
        }
        self.timeout = timeout
    }

    /// The shared clients stay for the process.
    func shutdown() async throws {}

    /// A JSON document by GET: nil for any status but 200 or for a body that is not a JSON object; a 5xx,
    /// 408 or 429 throws a temporary error (discovery must not mistake a sick server for a missing document).
    func getJSON(_ url: String) async throws -> [String: Any]? {
        var request = HTTPClientRequest(url: url)
        request.headers.add(name: "Accept", value: "application/json, application/fhir+json")
        let (status, data) = try await execute(request)
        if status >= 500 || status == 408 || status == 429 {
            throw DataQueueError(.transport, "\(FHIRTransport.redacted(url)) answered \(status) during endpoint discovery")
        }
        guard status == 200 else { return nil }
        return (try? JSONSerialization.jsonObject(with: data)) as? [String: Any]
    }

    /// Posts `form` form-urlencoded.
    func post(_ url: URL, form: [(String, String)], headers: HTTPHeaders = [:]) async throws -> (Int, Data) {
        var request = HTTPClientRequest(url: url.absoluteString)
        request.method = .POST
        request.headers = headers
        request.headers.add(name: "Content-Type", value: "application/x-www-form-urlencoded")
        request.headers.add(name: "Accept", value: "application/json")
        let body = form.map { Self.formEncode($0.0) + "=" + Self.formEncode($0.1) }.joined(separator: "&")
        request.body = .bytes(ByteBuffer(string: body))
        return try await execute(request)
    }

    func execute(_ request: HTTPClientRequest) async throws -> (Int, Data) {
        do {
            guard let url = URL(string: request.url) else { throw HTTPClientError.invalidURL }
            let client = try callerClient ?? clients?.client(for: url) ?? HTTPClient.shared
            let response = try await client.execute(request, timeout: .seconds(Int64(timeout)))
            let body = try await response.body.collect(upTo: 1 << 20)
            return (Int(response.status.code), Data(buffer: body))
        } catch let error as DataQueueError {
            throw error
        } catch {
            throw DataQueueError(
                .transport,
                FHIRTransport.noAnswer(
                    error, url: request.url, server: FHIRTransport.redacted(request.url), network: callerClient == nil ? network : nil))
        }
    }

    /// Adds the client's authentication to a token, refresh or revocation request: HTTP Basic, the secret in
    /// the form, a signed assertion (RFC 7523), or for a public client (`.none`) only its `client_id`.
    static func authenticate(
        _ method: OAuth2Configuration.TokenEndpointAuthMethod, clientID: String, secret: String?,
        key: OAuth2Configuration.ClientAssertionKey?, audience: URL,
        form: inout [(String, String)], headers: inout HTTPHeaders, rawBasic: Bool = false
    ) async throws {
        switch method {
        case .privateKeyJWT:
            guard let key else {
                throw DataQueueError(.invalidConfiguration, "configuration: private_key_jwt needs \"auth.private_key\"")
            }
            form.append(("client_assertion_type", "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"))
            form.append(("client_assertion", try await key.assertion(clientID: clientID, tokenURL: audience.absoluteString)))
        case .clientSecretPost:
            form.append(("client_id", clientID))
            form.append(("client_secret", secret ?? ""))
        case .clientSecretBasic:
            headers.replaceOrAdd(name: "Authorization", value: basic(clientID, secret ?? "", encoded: !rawBasic))
        case .none:
            form.append(("client_id", clientID))
        }
    }

    /// The SMART `oauth-uris` extension of a CapabilityStatement's first `rest` entry, by name
    /// (`authorize`, `token`, `register`, `revoke`, ...).
    static func oauthURIs(_ capability: [String: Any]?) -> [String: URL] {
        guard let rest = (capability?["rest"] as? [[String: Any]])?.first,
            let extensions = (rest["security"] as? [String: Any])?["extension"] as? [[String: Any]],
            let oauth = extensions.first(where: {
                $0["url"] as? String == "http://fhir-registry.smarthealthit.org/StructureDefinition/oauth-uris"
            }),
            let inner = oauth["extension"] as? [[String: Any]]
        else { return [:] }
        var uris: [String: URL] = [:]
        for entry in inner {
            if let name = entry["url"] as? String, let value = (entry["valueUri"] as? String).flatMap(URL.init(string:)) {
                uris[name] = value
            }
        }
        return uris
    }

    /// The error for a non-2xx answer of `endpoint` (e.g. "the token endpoint"): a definite refusal (4xx but
    /// 408 and 429) is `.authentication` ("`endpoint` `refused`: 400 (invalid_grant: ...)"), anything else
    /// `.transport` (try again later). `suffix` ends both messages.
    static func failure(_ endpoint: String, status: Int, body: Data, refused: String, suffix: String = "") -> DataQueueError {
        let error = errorSuffix(body)
        if (400..<500).contains(status) && status != 408 && status != 429 {
            return DataQueueError(.authentication, "\(endpoint) \(refused): \(status)\(error)\(suffix)")
        }
        return DataQueueError(.transport, "\(endpoint) answered \(status)\(error)\(suffix)")
    }

    /// The OAuth2 error code and description of a refusal (`" (invalid_grant: ...)"`), or an empty string.
    static func errorSuffix(_ body: Data) -> String {
        let object = (try? JSONSerialization.jsonObject(with: lenientJSON(body))) as? [String: Any]
        guard let error = object?["error"] as? String else { return "" }
        // The description is the server's own text for the operator; it never holds the request's secrets.
        let description = (object?["error_description"] as? String).map { ": " + $0.prefix(200) } ?? ""
        return " (\(error.prefix(64))\(description))"
    }

    static func formEncode(_ text: String) -> String {
        var allowed = CharacterSet.alphanumerics
        allowed.insert(charactersIn: "-._*")
        return (text.addingPercentEncoding(withAllowedCharacters: allowed) ?? text).replacingOccurrences(of: "%20", with: "+")
    }

    static func basic(_ id: String, _ secret: String, encoded: Bool) -> String {
        let pair = encoded ? formEncode(id) + ":" + formEncode(secret) : id + ":" + secret
        return "Basic " + Data(pair.utf8).base64EncodedString()
    }

    /// JSON with trailing commas removed (the C3-PRO registration server sends one).
    static func lenientJSON(_ data: Data) -> Data {
        let text = String(decoding: data, as: UTF8.self)
        let cleaned = text.replacingOccurrences(of: #",\s*([}\]])"#, with: "$1", options: .regularExpression)
        return Data(cleaned.utf8)
    }
}
