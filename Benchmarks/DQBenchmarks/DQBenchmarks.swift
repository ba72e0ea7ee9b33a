import FHIRDataQueue
import Foundation
import Synchronization

/// Micro-benchmarks of the library that `Benchmarks/run.py` calls; each prints one JSON line.
///
///   dq-bench enqueue-serial DB COUNT BODY_BYTES full|normal [AT_REST_KEY_FILE]
///   dq-bench enqueue-concurrent DB COUNT BODY_BYTES PRODUCERS [AT_REST_KEY_FILE]
///   dq-bench seal CERT_PEM RESOURCE_BYTES COUNT c3pro|authenticated
///   dq-bench open KEY_PEM ENVELOPES (one a line)
@main
struct DQBenchmarks {
    static func resource(_ index: Int, size: Int) -> FHIRResource {
        let head =
            #"{"resourceType":"Observation","status":"final","identifier":[{"system":"urn:bench","value":"\#(index)"}],"code":{"text":""#
        let tail = #""}}"#
        let padding = String(repeating: "x", count: max(0, size - head.utf8.count - tail.utf8.count))
        return try! FHIRResource(json: Data((head + padding + tail).utf8))
    }

    static func report(_ name: String, count: Int, seconds: Double, extra: [String: Double] = [:]) {
        var fields = [
            "case": "\"\(name)\"", "count": "\(count)", "seconds": String(format: "%.6f", seconds),
            "per_second": String(format: "%.1f", Double(count) / seconds),
        ]
        for (key, value) in extra { fields[key] = String(format: "%.3f", value) }
        print("{" + fields.sorted { $0.key < $1.key }.map { "\"\($0.key)\": \($0.value)" }.joined(separator: ", ") + "}")
    }

    static func main() async throws {
        let arguments = CommandLine.arguments
        guard arguments.count >= 2 else {
            FileHandle.standardError.write(Data("usage: see Benchmarks/DQBenchmarks/DQBenchmarks.swift\n".utf8))
            exit(64)
        }
        switch arguments[1] {
        case "enqueue-serial":
            let (path, count, size) = (arguments[2], Int(arguments[3])!, Int(arguments[4])!)
            var configuration = DataQueue.Configuration(databasePath: path)
            configuration.durability = DataQueue.Durability(rawValue: arguments[5])!
            if arguments.count > 6 { configuration.atRest = AtRestKeys(current: try AtRestKey(contentsOfFile: arguments[6])) }
            let queue = try await DataQueue(baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: configuration)
            let resources = (0..<count).map { resource($0, size: size) }
            let start = ContinuousClock.now
            for resource in resources { try await queue.enqueue(resource) }
            let elapsed = ContinuousClock.now - start
            report("enqueue-serial", count: count, seconds: elapsed.seconds)
            try await queue.shutdown()
        case "enqueue-concurrent":
            let (path, count, size, producers) = (arguments[2], Int(arguments[3])!, Int(arguments[4])!, Int(arguments[5])!)
            var configuration = DataQueue.Configuration(databasePath: path)
            if arguments.count > 6 { configuration.atRest = AtRestKeys(current: try AtRestKey(contentsOfFile: arguments[6])) }
            let queue = try await DataQueue(baseURL: URL(string: "http://127.0.0.1:9/fhir")!, configuration: configuration)
            let perProducer = count / producers
            // Made before the clock starts, as the references (enqueue-serial, the Python queues) do.
            let resources = (0..<perProducer * producers).map { resource($0, size: size) }
            let start = ContinuousClock.now
            try await withThrowingTaskGroup(of: Void.self) { group in
                for producer in 0..<producers {
                    group.addTask {
                        for index in 0..<perProducer {
                            try await queue.enqueue(resources[producer * perProducer + index])
                        }
                    }
                }
                try await group.waitForAll()
            }
            let elapsed = ContinuousClock.now - start
            report("enqueue-concurrent", count: perProducer * producers, seconds: elapsed.seconds)
            try await queue.shutdown()
        case "seal":
            let recipient = try RecipientKey(contentsOfFile: arguments[2])
            let (size, count) = (Int(arguments[3])!, Int(arguments[4])!)
            let sealer = EnvelopeSealer(recipient: recipient, keyID: "bench", format: EnvelopeSealer.Format(rawValue: arguments[5])!)
            let plaintext = resource(0, size: size).data
            var bytes = 0
            let start = ContinuousClock.now
            for _ in 0..<count { bytes += try sealer.seal(plaintext).count }
            let elapsed = ContinuousClock.now - start
            report(
                "seal", count: count, seconds: elapsed.seconds,
                extra: ["mb_per_second": Double(size * count) / elapsed.seconds / 1_000_000])
            precondition(bytes > 0)
        case "open":
            // The opener alone on every core (ParallelWork, as a flush opens a batch): no queue, no network; the
            // limit of opening with dq's crypto on this machine.
            let opener = try EnvelopeOpener(privateKeyPEM: try String(contentsOfFile: arguments[2], encoding: .utf8))
            let envelopes = try String(contentsOfFile: arguments[3], encoding: .utf8).split(separator: "\n").map { Data($0.utf8) }
            let opened = Mutex(0)
            let start = ContinuousClock.now
            ParallelWork.forEach(envelopes.count) { index in
                if (try? opener.open(envelopes[index])) != nil { opened.withLock { $0 += 1 } }
            }
            let elapsed = ContinuousClock.now - start
            precondition(opened.withLock { $0 } == envelopes.count, "an envelope did not open")
            report("open", count: envelopes.count, seconds: elapsed.seconds)
        case "library-user":
            // A service using the library in-process, next to dq processes on the same queue (torture).
            let (path, server, system, count) = (arguments[2], arguments[3], arguments[4], Int(arguments[5])!)
            var configuration = DataQueue.Configuration(databasePath: path)
            configuration.idempotent = true
            configuration.retryPolicy = RetryPolicy(initialDelay: 0, maximumDelay: 0)
            let queue = try await DataQueue(baseURL: URL(string: server)!, configuration: configuration)
            for index in 0..<count {
                let json =
                    #"{"resourceType":"Observation","status":"final","identifier":[{"system":"\#(system)","value":"lib-\#(String(format: "%05d", index))"}],"code":{"text":"library"}}"#
                _ = try await queue.create(try FHIRResource(json: Data(json.utf8)))
            }
            try await queue.shutdown()
        case "fuzz":
            // Seeded mutations of valid inputs through the input parsers; any crash fails the run.
            var generator = SeededGenerator(seed: UInt64(arguments[2])!)
            let seconds = Double(arguments[3])!
            let opener = try EnvelopeOpener(privateKeyPEM: try String(contentsOfFile: arguments[4], encoding: .utf8))
            let seeds: [Data] = [
                Data(
                    #"{"resourceType":"Observation","status":"final","identifier":[{"system":"urn:x","value":"1"}],"valueQuantity":{"value":1.5}}"#
                        .utf8),
                Data(#"{"resourceType":"Bundle","type":"transaction","entry":[{"resource":{"resourceType":"Patient","id":"a"}}]}"#.utf8),
                Data(#"{"key_id":"k","symmetric_key":"AAAA","message":"AAAA","version":"1.0.2","alg":"A256GCM+RSA-OAEP-256"}"#.utf8),
            ]
            let deadline = ContinuousClock.now + .seconds(seconds)
            var count = 0
            var accepted = 0
            while ContinuousClock.now < deadline {
                var bytes = [UInt8](seeds[Int.random(in: 0..<seeds.count, using: &generator)])
                for _ in 0..<Int.random(in: 1...8, using: &generator) {
                    let position = Int.random(in: 0..<bytes.count, using: &generator)
                    switch Int.random(in: 0..<4, using: &generator) {
                    case 0: bytes[position] = UInt8.random(in: 0...255, using: &generator)
                    case 1: bytes.remove(at: position)
                    case 2: bytes.insert(contentsOf: bytes[position..<min(bytes.count, position + 8)], at: position)
                    default:
                        bytes.insert(
                            [0x7B, 0x5B, 0x22, 0x7D, 0x5D, 0x2C, 0x3A, 0xFF][Int.random(in: 0..<8, using: &generator)], at: position)
                    }
                    if bytes.isEmpty { bytes = [0x7B] }
                }
                if (try? FHIRResource(json: Data(bytes))) != nil { accepted += 1 }
                _ = try? opener.open(Data(bytes))
                count += 1
            }
            print(#"{"case": "fuzz", "count": \#(count), "accepted": \#(accepted)}"#)
        default:
            FileHandle.standardError.write(Data("unknown case \(arguments[1])\n".utf8))
            exit(64)
        }
    }
}

extension Duration {
    var seconds: Double {
        let (s, attoseconds) = components
        return Double(s) + Double(attoseconds) / 1e18
    }
}

/// SplitMix64: a seeded generator, so a fuzz run can be replayed from its seed.
struct SeededGenerator: RandomNumberGenerator {
    var state: UInt64
    init(seed: UInt64) { state = seed }
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
