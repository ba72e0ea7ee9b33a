import Foundation

/// What a server's answer means for a queued item.
enum ResponseClassification: Equatable, Sendable {
    /// Accepted: the item leaves the queue for the journal.
    case success
    /// Rejected for good: the item is parked and the queue moves on.
    case permanent(String)
    /// Try again later, keeping the order: the flush stops here.
    case transient(String, retryAfter: TimeInterval?)
    /// The credentials were refused.
    case authentication(String)

    /// Classifies an HTTP answer.
    ///
    /// - 2xx is success, except on the encrypted endpoint where a C3-PRO receiver may answer 200 with an
    ///   error body (`{'error':…}`): that is a failure. An empty body or a bare `"OK"` is success.
    /// - 401 and 403 are authentication failures.
    /// - 408, 429 and 5xx are transient (with `Retry-After` when given), and so is 407: a proxy on the way
    ///   wants credentials (the server never saw the request).
    /// - Every other status (other 4xx, 3xx, 1xx) is permanent for that request.
    static func classify(
        status: Int, body: Data, retryAfter: TimeInterval?, envelope: Bool, location: String? = nil
    ) -> ResponseClassification {
        switch status {
        case 200..<300:
            if envelope, let message = envelopeErrorBody(body) {
                return .permanent("receiver answered \(status) with an error body (\(message))")
            }
            return .success
        case 401, 403:
            return .authentication("server answered \(status) \(reason(status))")
        case 400 where requiresClientCertificate(body):
            // nginx answers a TLS client without a certificate with a 400 page instead of a TLS alert: the
            // request never reached the application.
            return .transient(
                "the server wants a client certificate (set \"tls.client_certificate\" and \"tls.client_key\")", retryAfter: nil)
        case 407:
            return .transient(
                "the proxy wants credentials (407 Proxy Authentication Required; give them in the proxy URL)", retryAfter: retryAfter)
        case 408, 429, 500..<600:
            let name = reason(status)
            return .transient("server answered \(status)\(name.isEmpty ? "" : " " + name)", retryAfter: retryAfter)
        case 300..<400:
            // dq never follows a redirect: it would resend the resource (and credentials) to another address.
            // The target's origin only: its path may hold the resource's id (the text is kept with the item).
            let target = location.map { " to \(FHIRTransport.origin($0))" } ?? ""
            return .permanent(
                "server redirected the request (\(status) \(reason(status)))\(target); dq does not follow redirects: check the base URL")
        default:
            let name = reason(status)
            return .permanent("server rejected the request with \(status)\(name.isEmpty ? "" : " " + name)")
        }
    }

    /// Whether a 400 is a TLS front's page for a missing or refused client certificate (nginx: "No required SSL
    /// certificate was sent", "The SSL certificate error").
    static func requiresClientCertificate(_ body: Data) -> Bool {
        let text = String(decoding: body.prefix(4096), as: UTF8.self)
        return text.contains("No required SSL certificate was sent") || text.contains("The SSL certificate error")
    }

    /// A short, PHI-free summary of a C3-PRO error body, or nil when the body is not an error.
    static func envelopeErrorBody(_ body: Data) -> String? {
        let text = String(decoding: body, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        if text.isEmpty || text == "\"OK\"" || text == "OK" { return nil }
        let lowered = text.lowercased()
        if lowered.hasPrefix("{") && (lowered.contains("'error'") || lowered.contains("\"error\"")) {
            return "error body of \(body.count) bytes"
        }
        return nil
    }

    /// Parses `Retry-After` as delay-seconds or an HTTP date.
    static func parseRetryAfter(_ value: String?, now: Date = Date()) -> TimeInterval? {
        guard let value = value?.trimmingCharacters(in: .whitespaces), !value.isEmpty else { return nil }
        if let seconds = Double(value), seconds >= 0 { return seconds }
        let formatter = DateFormatter()
        formatter.locale = Locale(identifier: "en_US_POSIX")
        formatter.timeZone = TimeZone(identifier: "GMT")
        formatter.dateFormat = "EEE, dd MMM yyyy HH:mm:ss zzz"
        if let date = formatter.date(from: value) { return max(0, date.timeIntervalSince(now)) }
        return nil
    }

    static func reason(_ status: Int) -> String {
        switch status {
        case 301: return "Moved Permanently"
        case 302: return "Found"
        case 303: return "See Other"
        case 307: return "Temporary Redirect"
        case 308: return "Permanent Redirect"
        case 400: return "Bad Request"
        case 401: return "Unauthorized"
        case 403: return "Forbidden"
        case 404: return "Not Found"
        case 405: return "Method Not Allowed"
        case 408: return "Request Timeout"
        case 409: return "Conflict"
        case 410: return "Gone"
        case 412: return "Precondition Failed"
        case 413: return "Content Too Large"
        case 415: return "Unsupported Media Type"
        case 422: return "Unprocessable Content"
        case 429: return "Too Many Requests"
        case 500: return "Internal Server Error"
        case 502: return "Bad Gateway"
        case 503: return "Service Unavailable"
        case 504: return "Gateway Timeout"
        default: return ""
        }
    }
}
