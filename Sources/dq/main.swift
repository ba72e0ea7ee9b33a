// dq, the command line. This small front answers `dq status` (the command monitoring runs most often) by
// reading the queue file itself, in a few milliseconds; every other command, and every status it cannot
// answer exactly as the engine would (sign-in, encryption, PostgreSQL, a bad setting, a damaged file, any
// flag it does not know), it hands to `dq-engine` with exec(2): same process, same arguments.
import FHIRDataQueueCore

#if canImport(FoundationEssentials)
    import FoundationEssentials
#else
    import Foundation
#endif
#if canImport(Glibc)
    import Glibc
#endif

let arguments = CommandLine.arguments
let environment = ProcessInfo.processInfo.environment

if let output = StatusFront.answer(arguments: Array(arguments.dropFirst()), environment: environment) {
    exit(writeAll(output, to: 1) ? 0 : 74)
}
Engine.exec(arguments: arguments, environment: environment)
