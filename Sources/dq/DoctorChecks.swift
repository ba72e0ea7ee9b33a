import FHIRDataQueue
import Foundation
import Logging

/// What `dq doctor` checks besides the database: what a flush needs before it sends anything.
extension DQ.Doctor {
    /// One thing a flush needs that is missing or wrong: what it concerns, the problem in words, what to do, and
    /// the exit code it gives `dq doctor`.
    struct Finding: Encodable {
        /// `configuration`, `database`, `server`, `proxy`, `token endpoint`, `encrypted endpoint` or `sign-in`.
        var about: String
        var problem: String
        var remedy: String
        var exitCode: Int32
    }

    /// `dq doctor`'s exit code for `findings`: 0 for none, else the first of 78 (configuration), 74 (database),
    /// 77 (credentials), 69 (an endpoint or proxy does not answer) among them.
    static func exitCode(_ findings: [Finding]) -> Int32 {
        let order = [Exit.configuration, Exit.ioError, Exit.permissionDenied, Exit.unavailable]
        return order.first { code in findings.contains { $0.exitCode == code } } ?? findings.first?.exitCode ?? Exit.ok
    }

    /// The remedy of a setting that cannot be used.
    static let settingRemedy =
        "correct it where it is set (dq config shows each setting's value and where it came from); until then dq flush stops with exit 78"

    /// A setting that cannot be used.
    static func configuration(_ error: any Error) -> Finding {
        let message = (error as? DataQueueError)?.message ?? "configuration: \(error)"
        let unreadable = message.contains("cannot be read") || message.contains("cannot read")
        return Finding(
            about: "configuration", problem: message,
            remedy: unreadable
                ? "make the file readable by the user dq runs as, or correct the path where it is set (dq config shows where)"
                : settingRemedy,
            exitCode: Exit.configuration)
    }

    /// What the settings name, checked as a flush checks them before it connects: every value, the files (CA
    /// bundle, client certificate and key as PEM, keys, the encryption certificate), the authorization.
    /// `values` is nil when the network cannot be checked; `resolved` when the authorization cannot.
    static func settingsFindings(_ settings: DataQueueSettings) -> (
        findings: [Finding], values: DataQueueSettings.CheckedValues?, resolved: DataQueueSettings.Resolved?
    ) {
        let values: DataQueueSettings.CheckedValues
        do {
            values = try settings.checkedValues()
        } catch {
            return ([configuration(error)], nil, nil)
        }
        do {
            try EndpointCheck.readTLSFiles(values.network)
        } catch {
            var finding = configuration(error)
            finding.remedy =
                "give a PEM file (openssl x509 -in FILE -noout -subject reads a certificate; a key must be unencrypted PEM), or remove the setting"
            return ([finding], nil, nil)
        }
        do {
            return ([], values, try settings.resolve())
        } catch {
            return ([configuration(error)], values, nil)
        }
    }

    /// The network as a flush meets it: the server's CapabilityStatement (and the proxy on the way), the
    /// encrypted endpoint, and the token endpoint (a token is asked for, as a flush asks; a client that has still
    /// to register is not registered). Returns the problems and a line for each endpoint that answered.
    static func networkFindings(
        _ values: DataQueueSettings.CheckedValues, resolved: DataQueueSettings.Resolved?
    ) async -> (findings: [Finding], reached: [String]) {
        var findings: [Finding] = []
        var reached: [String] = []
        let logger = Logger(label: "dq", factory: { _ in SwiftLogNoOpLogHandler() })
        // The deadlines a flush would have.
        var deadlines = resolved?.configuration ?? DataQueue.Configuration()
        if resolved == nil {
            if let value = values.requestTimeout { deadlines.requestTimeout = value }
            if let value = values.connectTimeout { deadlines.connectTimeout = value }
        }
        /// GET `url`: its status, or nil with a finding about `name` (or the proxy) when no answer came. The words
        /// of a failure name the server by its origin, as a flush's do; another endpoint by its URL too.
        func get(_ url: URL, name: String, fix: String) async -> Int? {
            do {
                return try await EndpointCheck.get(
                    url, network: values.network, timeout: deadlines.requestTimeout, connectTimeout: deadlines.connectTimeout,
                    logger: logger)
            } catch var failure as EndpointCheck.Failure {
                if name != "server" { failure.message = "the \(name) \(shown(url)): \(failure.message)" }
                findings.append(noAnswer(failure, name: name, fix: fix))
            } catch {
                findings.append(configuration(error))
            }
            return nil
        }

        let base = values.server.absoluteString.trimmingSuffix("/")
        if let url = URL(string: base + "/metadata"),
            let status = await get(url, name: "server", fix: "start the server, or correct \"server\" (DQ_SERVER, --server)")
        {
            if status >= 500 {
                findings.append(
                    Finding(
                        about: "server", problem: "the server \(base) answered HTTP \(status) to GET [base]/metadata",
                        remedy: "the server is up but failing: see its log; meanwhile dq flush keeps the items queued (exit 75)",
                        exitCode: Exit.unavailable))
            } else if status == 404 {
                findings.append(
                    Finding(
                        about: "server",
                        problem: "the server \(base) answered HTTP 404 to GET [base]/metadata: no CapabilityStatement there",
                        remedy: "set \"server\" to the FHIR base URL (the one whose /metadata is the server's CapabilityStatement)",
                        exitCode: Exit.unavailable))
            } else {
                reached.append("server answers (HTTP \(status) to GET [base]/metadata)")
            }
        }
        if let endpoint = resolved?.encryption?.endpoint,
            let status = await get(endpoint, name: "encrypted endpoint", fix: "start the receiver, or correct \"encryption.endpoint\"")
        {
            reached.append("encrypted endpoint answers (HTTP \(status) to GET)")
        }
        /// client_credentials: the token endpoint answers (when configured), then gives this client a token.
        func checkClientCredentials(_ client: OAuth2ClientCredentials) async {
            let fix = "start the authorization server, or correct \"auth.token_uri\""
            if let url = client.configuration.tokenURL, await get(url, name: "token endpoint", fix: fix) == nil { return }
            do {
                if let url = try await client.checkTokenEndpoint(logger: logger) {
                    reached.append("token endpoint \(shown(url)) issued a token")
                } else {
                    reached.append("token endpoint found; the client registers at the first flush (or dq register)")
                }
            } catch {
                findings.append(tokenFinding(error, fix: fix))
            }
        }
        /// authorization_code: someone is signed in, with a token that can be renewed, and the token endpoint answers.
        func checkSignIn(_ client: AuthorizationCodeClient) async {
            let signIn: SignIn?
            do {
                signIn = try client.storedSignIn()
            } catch {
                findings.append(tokenFinding(error, fix: "run dq login again"))
                return
            }
            guard let signIn else {
                findings.append(
                    Finding(
                        about: "sign-in", problem: "nobody is signed in to \(base)", remedy: "run dq login",
                        exitCode: Exit.permissionDenied))
                return
            }
            if signIn.refreshToken == nil && signIn.expiresAt <= Date() {
                findings.append(
                    Finding(
                        about: "sign-in",
                        problem: "the access token expired at \(formatDate(signIn.expiresAt)) and there is no refresh token",
                        remedy: "run dq login again (a scope with offline_access gets a refresh token)", exitCode: Exit.permissionDenied))
            }
            if let url = URL(string: signIn.tokenEndpoint),
                let status = await get(url, name: "token endpoint", fix: "start the authorization server, or run dq login again")
            {
                reached.append("token endpoint answers (HTTP \(status) to GET)")
            }
        }
        if let client = resolved?.authorization as? OAuth2ClientCredentials {
            await checkClientCredentials(client)
        } else if let client = resolved?.authorization as? AuthorizationCodeClient {
            await checkSignIn(client)
        }
        return (findings, reached)
    }

    /// `url` without user, password, query or fragment.
    static func shown(_ url: URL) -> String {
        guard var components = URLComponents(url: url, resolvingAgainstBaseURL: false) else { return "" }
        components.user = nil
        components.password = nil
        components.query = nil
        components.fragment = nil
        return components.string ?? ""
    }

    /// A GET of `name` that got no answer: the proxy's problem when the connection to the proxy failed.
    static func noAnswer(_ failure: EndpointCheck.Failure, name: String, fix: String) -> Finding {
        let proxyFix =
            "start the proxy, or correct \"proxy\" (DQ_PROXY, --proxy; else HTTPS_PROXY or HTTP_PROXY); hosts reached without it go in \"no_proxy\""
        let (about, remedy): (String, String) =
            switch failure.cause {
            case .proxyConnection: ("proxy", proxyFix)
            case .proxyRefused:
                ("proxy", "give the proxy's credentials in its URL (http://user:password@host:port) and have it allow CONNECT to the port")
            case .connection: (name, fix)
            case .tls:
                (
                    name,
                    "renew or correct the certificate, trust its issuer with \"ca_bundle\", or set \"tls.client_certificate\" and \"tls.client_key\", as the message says"
                )
            case .other: (name, "\(fix); check the network on the way")
            }
        return Finding(about: about, problem: failure.message, remedy: remedy, exitCode: Exit.unavailable)
    }

    /// What the token endpoint's answer (or its absence) means.
    static func tokenFinding(_ error: any Error, fix: String) -> Finding {
        guard let error = error as? DataQueueError else {
            return Finding(about: "token endpoint", problem: "\(error)", remedy: fix, exitCode: Exit.unavailable)
        }
        switch error.code {
        case .authentication:
            return Finding(
                about: "token endpoint", problem: error.message,
                remedy: "check \"auth.client_id\" and its secret or key against the client's registration at the authorization server",
                exitCode: Exit.permissionDenied)
        case .invalidConfiguration:
            return configuration(error)
        default:
            return Finding(about: "token endpoint", problem: error.message, remedy: fix, exitCode: Exit.unavailable)
        }
    }
}
