/// The port of a URL as it is written, read as a bounded number.
///
/// Foundation's URL parsers on Linux read a port that overflows an `Int` (`:99999999999999999999`, 2^63, 2^64) as no
/// port at all, so `http://host:99999999999999999999/fhir` would name `http://host/fhir` and be sent to port 80.
/// Every URL dq reads from its settings (the FHIR server, the token and registration endpoints, the proxy) has its
/// port checked here, on the text, before a URL type sees it.
package enum URLPort {
    /// The text after the authority's last `:` (outside an IPv6 literal's brackets), as written; nil when the URL
    /// writes no port. `text` may omit the scheme (`host:port`, as a proxy may be written).
    static func written(in text: String) -> Substring? {
        var rest = Substring(text)
        if let scheme = rest.range(of: "://") { rest = rest[scheme.upperBound...] }
        if let end = rest.firstIndex(where: { $0 == "/" || $0 == "?" || $0 == "#" }) { rest = rest[..<end] }
        if let at = rest.lastIndex(of: "@") { rest = rest[rest.index(after: at)...] }
        if rest.hasPrefix("["), let close = rest.firstIndex(of: "]") { rest = rest[rest.index(after: close)...] }
        guard let colon = rest.lastIndex(of: ":") else { return nil }
        let port = rest[rest.index(after: colon)...]
        return port.isEmpty ? nil : port
    }

    /// Throws a configuration error naming `setting` and the port as written when `text` writes a port that is not
    /// a whole number from 1 to 65535.
    package static func check(_ text: String, setting: String) throws {
        guard let port = written(in: text) else { return }
        let digits = port.allSatisfy { $0.isASCII && $0.isNumber }
        if digits, let value = Int(port), (1...65535).contains(value) { return }
        // Only digits are echoed: text that is not a number may be part of a password the parser misread as a port.
        throw DataQueueError(
            .invalidConfiguration,
            "\(setting): the URL has port \(digits ? String(port) : "that is not a number"), not one from 1 to 65535")
    }
}
