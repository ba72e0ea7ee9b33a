import Foundation
import Testing

/// `serve.routes`: resources go to another FHIR server by the envelope's version or the resource type, each route
/// its own queue (order, backoff) in the receiver's database.
extension ServeTrustSuite {
    @Test(
        "Routes by version and by resource type to two sekmet servers and one that is down: the others' resources flow, each server gets its own in order, the down route's wait"
    )
    func routes() async throws {
        let main = try await FHIRServer.start()
        let observations = try await FHIRServer.start()
        let down = "http://127.0.0.1:\(Peers.freePort())/fhir"
        let keys = try await TestKeys()
        try await install(keys, as: "k1", layout: .pem)
        let config = try await configure(
            server: main.base,
            serve: [
                "routes": [["version": "1.0.2", "server": down], ["resource_type": "Observation", "server": observations.base]]
            ])
        let receiver = try await start(config)
        let device = try await register(receiver.base)
        let token = try await self.token(receiver.base, device)
        func sealed(_ resource: String, path: String, version: String) -> Step {
            var step = self.sealed(path, resource, certificate: keys.certificate, keyID: "k1", token: token)
            var seal = step["seal"] as? [String: Any] ?? [:]
            seal["version"] = version
            step["seal"] = seal
            return step
        }
        let answers = try await client(
            receiver.base,
            [
                sealed(questionnaireResponse("r0"), path: "/c3pro/encfhir/QuestionnaireResponse", version: "3.0.0"),
                sealed(observation("r1"), path: "/c3pro/encfhir/Observation", version: "3.0.0"),
                sealed(questionnaireResponse("r2"), path: "/c3pro/encfhir/QuestionnaireResponse", version: "1.0.2"),
                plain("/c3pro/fhir/Observation", observation("r3"), token: token),
                sealed(questionnaireResponse("r4"), path: "/c3pro/encfhir/QuestionnaireResponse", version: "3.0.0"),
                sealed(observation("r5"), path: "/c3pro/fhirenc/Observation", version: "1.0.2"),
            ])
        #expect(answers.count == 6 && answers.allSatisfy { [201, 202].contains($0.status) }, "\(answers)")
        let arrived = try await eventually(timeout: .seconds(60)) {
            let first = try await values(main).count
            let second = try await values(observations).count
            return first >= 2 && second >= 2
        }
        #expect(arrived, "\(receiver.log.suffix(2000))")
        #expect(try await values(main) == ["r0", "r4"], "the unrouted, in order")
        #expect(try await values(observations) == ["r1", "r3"], "the Observation route's, in order")
        // The down route's two (the first route matches r5 before its type's) wait in their own queue.
        let status = try await dqCommand(["status", "--json", "--all"], config: config)
        let queues = (try? JSONSerialization.jsonObject(with: Data(status.stdout.utf8))) as? [[String: Any]] ?? []
        let waiting = queues.first { ($0["queue"] as? String ?? $0["server"] as? String ?? "").hasPrefix(down) }
        #expect(waiting?["pending"] as? Int == 2, "\(status.stdout) \(status.stderr)")
        _ = await receiver.stop()
    }

    @Test("serve.routes is checked: a route needs one of version and resource_type, and a server URL")
    func routesChecked() async throws {
        for (routes, expected) in [
            ([["server": "http://127.0.0.1:9/fhir"]], "\"serve.routes\" must be a list"),
            (
                [["version": "1.0.2", "resource_type": "Observation", "server": "http://127.0.0.1:9/fhir"]],
                "\"serve.routes\" must be a list"
            ),
            ([["version": "1.0.2", "server": "ftp://x"]], "must be an http(s) URL"),
            ([["version": "1.0.2", "server": "http://127.0.0.1:9/fhir", "color": "red"]], "\"serve.routes\" must be a list"),
        ] {
            let config = try await configure(server: "http://127.0.0.1:9/fhir", serve: ["routes": routes])
            let result = try await dqCommand(["serve"], config: config)
            #expect(result.status == 78 && result.stderr.contains(expected), "\(routes): \(result.status) \(result.stderr)")
        }
    }
}
