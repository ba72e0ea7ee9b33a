import FHIRDataQueue
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// What `dq doctor` checks of `dq serve`'s settings, when the file has a `serve` object: what `dq serve` needs
/// before it listens.
extension DQ.Doctor {
    static func serveFindings(_ settings: DataQueueSettings) -> [Finding] {
        let serve: ServeSettings
        do {
            serve = try ServeSettings.load(from: settings.sourcePath)
        } catch {
            return [configuration(error)]
        }
        guard serve.present else { return [] }
        var findings: [Finding] = []
        func problem(_ text: String, _ remedy: String) {
            findings.append(Finding(about: "serve", problem: text, remedy: remedy, exitCode: Exit.configuration))
        }
        do {
            _ = try serve.antispamSecrets()
        } catch let error as DataQueueError {
            problem(error.message, "write the Antispam secrets the apps send, one per line, in a file only dq's user can read")
        } catch {}
        if let keys = serve.keysDirectory {
            let keyring = EnvelopeKeyring(directory: keys, defaultKeyID: serve.defaultKeyID)
            do {
                if try keyring.check().isEmpty {
                    problem(
                        "\"serve.keys_dir\" \(keys) holds no key: every envelope would be quarantined",
                        "put each private key there as <key_id>.pem or <key_id>/private-c3pro.der")
                }
            } catch {
                problem(
                    "\"serve.keys_dir\" \(keys): \(error)",
                    "put the key as <key_id>.pem (PEM) or <key_id>/private-c3pro.der (PKCS#8 DER), readable by dq's user")
            }
        } else {
            problem("\"serve.keys_dir\" is not set", "name the directory of the private keys envelopes are opened with")
        }
        if serve.plainFHIR && settings.atRest == nil && !serve.plainAtRest {
            problem(
                "plain FHIR resources would be stored readable: \"serve.plain_fhir\" is on and there is no \"at_rest\" key",
                "set \"at_rest\" (dq keygen --at-rest), or \"serve.plain_fhir\": false")
        }
        for secret in serve.exposedSecrets() {
            findings.append(
                Finding(
                    about: "serve", problem: "\(secret.what) \(secret.path) is readable by others (mode \(String(secret.mode, radix: 8)))",
                    remedy: "chmod 600 \(secret.path) (or 0640 owned by root, group dq)", exitCode: Exit.configuration))
        }
        findings += tlsFindings(serve)
        if let (host, port) = ListenAddress.parse(serve.listen), let reason = addressProblem(host: host, port: port),
            !isDQServe(host: host, port: port)
        {
            findings.append(
                Finding(
                    about: "serve", problem: "cannot listen on \(serve.listen): \(reason)",
                    remedy: "free the address (is dq serve already running there?) or choose another \"serve.listen\"",
                    exitCode: Exit.unavailable))
        }
        return findings
    }

    /// Whether what listens on `host:port` is a dq serve (its `/metrics` names `dq_build_info`): then the address is
    /// in use by the receiver these settings are for, not a problem. Plain HTTP only, two seconds at most.
    static func isDQServe(host: String, port: Int) -> Bool {
        var hints = addrinfo()
        hints.ai_flags = AI_NUMERICSERV
        hints.ai_socktype = Int32(SOCK_STREAM.rawValue)
        var found: UnsafeMutablePointer<addrinfo>?
        let target = ["0.0.0.0", "::", ""].contains(host) ? "localhost" : host
        guard getaddrinfo(target, String(port), &hints, &found) == 0, let address = found else { return false }
        defer { freeaddrinfo(found) }
        let socket = Glibc.socket(address.pointee.ai_family, address.pointee.ai_socktype, address.pointee.ai_protocol)
        guard socket >= 0 else { return false }
        defer { close(socket) }
        var wait = timeval(tv_sec: 2, tv_usec: 0)
        setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &wait, socklen_t(MemoryLayout<timeval>.size))
        setsockopt(socket, SOL_SOCKET, SO_SNDTIMEO, &wait, socklen_t(MemoryLayout<timeval>.size))
        guard connect(socket, address.pointee.ai_addr, address.pointee.ai_addrlen) == 0 else { return false }
        let request = Array("GET /metrics HTTP/1.1\r\nHost: \(target)\r\nConnection: close\r\n\r\n".utf8)
        guard send(socket, request, request.count, Int32(MSG_NOSIGNAL)) == request.count else { return false }
        var answer: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65_536)
        while answer.count < 4 << 20 {
            let count = recv(socket, &buffer, buffer.count, 0)
            if count <= 0 { break }
            answer += buffer[0..<count]
            if answer.count > 64, String(decoding: answer, as: UTF8.self).contains("dq_build_info") { return true }
        }
        return String(decoding: answer, as: UTF8.self).contains("dq_build_info")
    }

    /// Why `host:port` cannot be listened on now (bound and released at once), or nil when it can.
    static func addressProblem(host: String, port: Int) -> String? {
        var hints = addrinfo()
        hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV
        hints.ai_socktype = Int32(SOCK_STREAM.rawValue)
        var found: UnsafeMutablePointer<addrinfo>?
        guard getaddrinfo(host, String(port), &hints, &found) == 0, let address = found else {
            return "the host cannot be resolved"
        }
        defer { freeaddrinfo(found) }
        let socket = Glibc.socket(address.pointee.ai_family, address.pointee.ai_socktype, address.pointee.ai_protocol)
        guard socket >= 0 else { return String(cString: strerror(errno)) }
        defer { close(socket) }
        var on: Int32 = 1
        setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &on, socklen_t(MemoryLayout<Int32>.size))
        guard bind(socket, address.pointee.ai_addr, address.pointee.ai_addrlen) == 0 else {
            return errno == EADDRINUSE ? "the address is in use" : String(cString: strerror(errno))
        }
        return nil
    }
}
