import ArgumentParser
import FHIRDataQueue
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

extension DQ {
    struct Keygen: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "keygen",
            abstract: "Make a key pair for SMART Backend Services (private_key_jwt), or with --at-rest a key that seals the queue.",
            discussion:
                "The private key is written mode 0600 and never printed; register the printed JWKS with the server. With --at-rest the key file is written mode 0600 and its key id printed."
        )

        @Option(help: "ES384 (P-384), ES256 (P-256), RS384 or RS256 (RSA 2048).") var alg: String = "ES384"
        @Option(help: "Where to write the private key (PEM), or the at-rest key. Refuses to overwrite.") var out: String
        @Option(help: "The key id (default: the key's RFC 7638 thumbprint).") var kid: String?
        @Flag(help: "Make a 256-bit key that seals the queue at rest (\"at_rest.key_file\"), and print its key id.")
        var atRest = false

        func run() async throws {
            // A refusal to overwrite is the operator's to mend (EX_CANTCREAT), not an I/O failure.
            var existing = stat()
            if lstat(out, &existing) == 0 {
                printError("dq: \(out) exists: dq keygen never overwrites a key (name another --out, or move the file away)")
                throw ExitCode(Exit.cannotCreate)
            }
            if atRest {
                do {
                    let key = try AtRestKey.generate(writingTo: out)
                    print("at-rest key \(key.id) written to \(out) (mode 0600); keep a copy: without it the queue cannot be read")
                } catch let error as DataQueueError {
                    printError("dq: \(error.message)")
                    throw ExitCode(Exit.ioError)
                }
                return
            }
            guard let algorithm = OAuth2Configuration.ClientAssertionKey.Algorithm(rawValue: alg.uppercased()) else {
                throw ValidationError("--alg must be ES384, ES256, RS384 or RS256")
            }
            let (key, pem) = try OAuth2Configuration.ClientAssertionKey.generate(algorithm, keyID: kid)
            let fd = open(out, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0o600)
            guard fd >= 0 else {
                printError("dq: cannot create \(out): \(String(cString: strerror(errno)))")
                throw ExitCode(Exit.cannotCreate)
            }
            let data = Data(pem.utf8)
            let written = data.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            fsync(fd)
            close(fd)
            guard written == data.count else {
                printError("dq: cannot write \(out)")
                throw ExitCode(Exit.ioError)
            }
            print(key.publicJWKS)
            if algorithm == .rs256 {
                // A PEM file does not say which hash an RSA key signs with; RS384 is the default.
                printError("dq: an RSA key signs RS384 unless the auth object says \"key_alg\": \"RS256\"")
            }
        }
    }

    struct Register: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "register",
            abstract: "Register this client now (RFC 7591) and store the credentials (replacing earlier ones).")
        @OptionGroup var queueOptions: QueueOptions

        func run() async throws {
            try await withQueue(queueOptions) { queue in
                guard let oauth = queue.authorization as? OAuth2ClientCredentials else {
                    throw DataQueueError(.invalidConfiguration, "configuration: \"auth.registration_uri\" is not set")
                }
                let stored = try await oauth.register()
                let path = oauth.configuration.credentialStore.path(for: stored.registrationURI)
                print("registered as client \(stored.clientID); credentials stored in \(path)")
            }
        }
    }
}
