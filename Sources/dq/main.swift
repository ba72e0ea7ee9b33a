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

// Only `status` is the front's: every other command goes to the engine before anything else starts.
if arguments.count > 1, arguments[1] == "status",
    let output = StatusFront.answer(arguments: Array(arguments.dropFirst()), environment: ProcessInfo.processInfo.environment)
{
    exit(writeAll(output, to: 1) ? 0 : 74)
}
Engine.exec(arguments: arguments)
