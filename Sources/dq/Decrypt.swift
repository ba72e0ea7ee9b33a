import ArgumentParser
import FHIRDataQueue
import Foundation

extension DQ {
    struct Decrypt: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            commandName: "decrypt",
            abstract: "Decrypt an envelope (C3-PRO or authenticated format) and print the resource.",
            discussion:
                "For receivers and operators. Exit 65 for a corrupt envelope, 66 for an envelope file that cannot be read, 78 for an unreadable key."
        )

        @Option(help: "The receiver's RSA private key (PEM).") var key: String
        @Argument(help: "The envelope file, or - for standard input.") var file: String

        func run() async throws {
            guard let pem = FileManager.default.contents(atPath: key) else {
                printError("dq: cannot read the private key file \(key)")
                throw ExitCode(Exit.configuration)
            }
            let envelope: Data
            if file == "-" {
                envelope = FileHandle.standardInput.readDataToEndOfFile()
            } else {
                guard let data = FileManager.default.contents(atPath: file) else {
                    printError("dq: \(file): cannot be read")
                    throw ExitCode(Exit.noInput)
                }
                envelope = data
            }
            do {
                let opener = try EnvelopeOpener(privateKeyPEM: String(decoding: pem, as: UTF8.self))
                let resource = try opener.open(envelope)
                FileHandle.standardOutput.write(resource)
                if resource.last != 0x0A { FileHandle.standardOutput.write(Data("\n".utf8)) }
            } catch let error as DataQueueError {
                printError("dq: \(file == "-" ? "<stdin>" : file): \(error.message)")
                throw ExitCode(Exit.code(for: error))
            }
        }
    }
}
