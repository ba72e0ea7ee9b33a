import ArgumentParser
import FHIRDataQueue
import Foundation
import Logging
import Subprocess

#if canImport(Glibc)
    import Glibc
#endif

extension DQ {
    struct Login: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "login",
            abstract: "Sign in as a person (SMART authorization code with PKCE) and keep the tokens for unattended delivery.",
            discussion: """
                Needs "authorize_type": "authorization_code" in the auth object. dq listens on 127.0.0.1 on a free \
                port, prints the address to open (and opens a browser when there is a display, unless --no-browser), \
                and waits for the authorization server to send the browser back. The code is exchanged with the PKCE \
                verifier, the ID token is checked (signature, iss, aud, exp, iat, nonce), and only then are the tokens \
                stored, mode 0600, in the credentials directory. Tokens, codes and verifiers are never printed.

                On a machine without a browser use --no-browser: open the address elsewhere, then paste here the \
                address the browser was sent to (it begins with http://127.0.0.1 and fails to load there).

                Exit 0 signed in, 77 refused (by the person, the server, or a failed check; nothing stored), 75 no \
                answer in time or the server unreachable, 78 configuration.
                """)
        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Do not open a browser; accept the redirect address pasted on standard input.") var noBrowser = false
        @Option(help: "Seconds to wait for the sign-in.") var timeout: Double = 300
        @Option(help: "The loopback port to listen on (default: a free one).") var port: Int = 0

        func run() async throws {
            guard timeout.isFinite, timeout > 0, timeout <= 86400 else { throw ValidationError("--timeout must be 1 to 86400 seconds") }
            guard (0...65535).contains(port) else { throw ValidationError("--port must be 0 to 65535") }
            try await withSignInClient(queueOptions) { client, logger in
                let listener = try await LoopbackRedirectListener.start(port: port)
                // Closed on every path, awaited (not a Task from a defer, which nobody waits for).
                do {
                    try await signIn(client, listener: listener, logger: logger)
                } catch {
                    await listener.close()
                    throw error
                }
                await listener.close()
            }
        }

        private func signIn(_ client: AuthorizationCodeClient, listener: LoopbackRedirectListener, logger: Logger) async throws {
            let pending = try await client.prepareSignIn(redirectURI: listener.redirectURI)
            printError("dq: open this address in a browser and sign in (waiting up to \(Int(timeout)) s):", level: .notice)
            // Unbuffered, so that whoever reads the output sees the address while dq waits.
            FileHandle.standardOutput.write(Data((pending.authorizationURL.absoluteString + "\n").utf8))
            if noBrowser {
                printError(
                    "dq: then paste here the address the browser was sent to (it begins with \(listener.redirectURI)):", level: .notice)
            } else {
                openBrowser(pending.authorizationURL)
            }
            guard let redirect = await firstRedirect(listener: listener, pasted: noBrowser) else {
                throw DataQueueError(.transport, "no sign-in arrived within \(Int(timeout)) s; nothing was stored")
            }
            let signIn = try await client.completeSignIn(pending, redirect: redirect, logger: logger)
            let who = signIn.fhirUser ?? signIn.subject.map { "subject \($0)" } ?? "the person"
            print("signed in to \(signIn.fhirBaseURL) as \(who)")
            if let patient = signIn.patient { print("patient:       \(patient)") }
            if let encounter = signIn.encounter { print("encounter:     \(encounter)") }
            print("access token:  valid until \(formatDate(signIn.expiresAt)), renewed after \(formatDate(signIn.renewAt))")
            print(
                signIn.refreshToken != nil
                    ? "refresh token: kept; dq renews the access token unattended"
                    : "refresh token: none (ask for offline_access); run dq login again when the access token expires")
            print("stored in:     \(client.store.path)")
        }

        /// The redirect from the listener or, with `pasted`, a line on standard input, whichever comes first.
        private func firstRedirect(listener: LoopbackRedirectListener, pasted: Bool) async -> URL? {
            await withTaskGroup(of: URL?.self) { group in
                group.addTask { await listener.redirect() }
                if pasted {
                    group.addTask {
                        for await line in standardInputLines() {
                            let text = line.trimmingCharacters(in: .whitespaces)
                            if text.isEmpty { continue }
                            if let url = URL(string: text), url.query != nil, text.hasPrefix("http") { return url }
                            printError("dq: that is not the address the browser was sent to; paste the whole address", level: .notice)
                        }
                        return nil
                    }
                }
                group.addTask {
                    try? await Task.sleep(for: .seconds(timeout))
                    return nil
                }
                var result: URL?
                for await candidate in group {
                    if let candidate {
                        result = candidate
                        break
                    }
                    if Task.isCancelled { break }
                    // The paste stream ended (standard input closed): wait for the listener or the deadline.
                }
                group.cancelAll()
                return result
            }
        }

        /// Starts `xdg-open` when there is a display and it is installed (found on `PATH`); stays quiet otherwise.
        /// Not awaited: an opener may stay until the browser closes, and the sign-in goes on meanwhile.
        private func openBrowser(_ url: URL) {
            let environment = ProcessInfo.processInfo.environment
            guard environment["DISPLAY"] != nil || environment["WAYLAND_DISPLAY"] != nil else { return }
            Task {
                _ = try? await Subprocess.run(.name("xdg-open"), arguments: [url.absoluteString], output: .discarded, error: .discarded)
            }
        }
    }

    struct Logout: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "logout",
            abstract: "Revoke the signed-in person's tokens at the server (RFC 7009) and delete them.",
            discussion: """
                When the server cannot be reached or refuses the revocation, the tokens are kept and dq exits 75 \
                or 77; --local deletes them without telling the server (they then stay valid there until they expire).
                """)
        @OptionGroup var queueOptions: QueueOptions
        @Flag(help: "Delete the tokens here without revoking them at the server.") var local = false

        func run() async throws {
            try await withSignInClient(queueOptions) { client, logger in
                switch try await client.signOut(revoke: !local, logger: logger) {
                case .notSignedIn:
                    print("not signed in to \(client.store.fhirBaseURL); nothing to do")
                case .revoked:
                    print("signed out: the server revoked the tokens and \(client.store.path) was deleted")
                case .deletedLocally:
                    print(
                        local
                            ? "signed out here: \(client.store.path) was deleted; the server was not told, the tokens stay valid there until they expire"
                            : "signed out here: \(client.store.path) was deleted; the server offers no revocation endpoint, the tokens stay valid there until they expire"
                    )
                }
            }
        }
    }
}

/// Builds the sign-in client from the settings, runs `body`, and turns errors into messages and exit codes.
/// The queue database is not opened.
func withSignInClient(_ options: QueueOptions, _ body: (AuthorizationCodeClient, Logger) async throws -> Void) async throws {
    let logger: Logger
    let client: AuthorizationCodeClient
    do {
        let (settings, daemon) = try await DaemonSettings.load(options: options)
        try bootstrapLogging(options, daemon)
        logger = Logger(label: "dq")
        warnAboutExposure(settings)
        guard let found = try settings.resolve().authorization as? AuthorizationCodeClient else {
            throw DataQueueError(
                .invalidConfiguration,
                "configuration: dq login needs \"auth\": {\"authorize_type\": \"authorization_code\", \"client_id\": ...}")
        }
        client = found
    } catch let error as DataQueueError {
        printError("dq: \(error.message)")
        throw ExitCode(Exit.code(for: error))
    }
    do {
        try await body(client, logger)
        try? await client.shutdown()
    } catch let error as DataQueueError {
        try? await client.shutdown()
        printError("dq: \(error.message)")
        throw ExitCode(Exit.code(for: error))
    } catch {
        try? await client.shutdown()
        throw error
    }
}

/// Lines of standard input, read on a thread of their own so that no task blocks in `read`.
func standardInputLines() -> AsyncStream<String> {
    AsyncStream { continuation in
        let thread = Thread {
            while let line = readLine() { continuation.yield(line) }
            continuation.finish()
        }
        thread.start()
    }
}
