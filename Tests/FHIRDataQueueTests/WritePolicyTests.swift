import Foundation
import Testing

@testable import FHIRDataQueue

/// The receiver's write policy as decisions (no I/O): what a device may write, which `PUT`s wait for the server's
/// and the receiver's word on whose the resource is. The integration tests (`ServeTests.writePolicy`) prove it on a
/// running `dq serve` in front of sekmet.
@Suite("Write policy decisions")
struct WritePolicyTests {
    func resource(_ json: String) throws -> FHIRResource { try FHIRResource(json: Data(json.utf8)) }

    func transaction(_ entries: [[String: Any]]) throws -> FHIRResource {
        let bundle: [String: Any] = ["resourceType": "Bundle", "type": "transaction", "entry": entries]
        return try FHIRResource(json: JSONSerialization.data(withJSONObject: bundle))
    }

    func refusal(_ decision: WritePolicy.Decision) -> String? {
        if case .refused(let why) = decision { return why }
        return nil
    }

    @Test("Scopes: system/ optional, c and u only, a delete or read never granted, bad forms named")
    func scopes() throws {
        let policy = try WritePolicy(scopes: ["system/Observation.c", "Patient.cu", "Consent.u"])
        #expect(policy.allows("Observation", .create) && !policy.allows("Observation", .update))
        #expect(policy.allows("Patient", [.create, .update]))
        #expect(policy.allows("Consent", .update) && !policy.allows("Consent", .create))
        #expect(!policy.allows("Basic", .create))
        #expect(policy.scopes == ["system/Consent.u", "system/Observation.c", "system/Patient.cu"])
        let any = try WritePolicy(scopes: ["*.c"])
        #expect(any.allows("Basic", .create) && !any.allows("Basic", .update))
        for bad in [
            "Observation.d", "Observation.cud", "Observation.r", "Observation", "observation.c", "system/.c", "Observation.", "a/b.c",
        ] {
            #expect(throws: DataQueueError.self, "\(bad)") { try WritePolicy(scopes: [bad]) }
        }
        do {
            _ = try WritePolicy(scopes: ["system/Patient.cud"])
            Issue.record("a delete was granted")
        } catch {
            #expect(error.message.contains("never delete"), "\(error.message)")
        }
        #expect(WritePolicy.c3pro.scopes.count == 5)
        for type in ["Contract", "Consent", "Observation", "Patient", "QuestionnaireResponse"] {
            #expect(WritePolicy.c3pro.allows(type, [.create, .update]), "\(type)")
        }
        #expect(!WritePolicy.c3pro.allows("Bundle", .create) && !WritePolicy.c3pro.allows("Basic", .create))
    }

    @Test("Creates: an allowed type goes; another type, or a path that names another type, is refused")
    func creates() throws {
        let policy = WritePolicy.c3pro
        let observation = try resource(#"{"resourceType":"Observation","status":"final"}"#)
        #expect(policy.evaluate(observation, method: .post, pathType: "Observation") == .allowed([]))
        #expect(policy.evaluate(observation, method: .post, pathType: nil) == .allowed([]))
        let why = try #require(refusal(policy.evaluate(observation, method: .post, pathType: "QuestionnaireResponse")))
        #expect(why.contains("path names QuestionnaireResponse"), "\(why)")
        let basic = try resource(#"{"resourceType":"Basic"}"#)
        #expect(refusal(policy.evaluate(basic, method: .post, pathType: nil))?.contains("may not create Basic") == true)
        let foo = try resource(#"{"resourceType":"Foo"}"#)
        #expect(refusal(policy.evaluate(foo, method: .post, pathType: nil)) != nil, "a type no FHIR server has")
    }

    @Test("A PUT is a target: allowed only once it is found new or the client's own")
    func updates() throws {
        let patient = try resource(#"{"resourceType":"Patient","id":"p1"}"#)
        #expect(
            WritePolicy.c3pro.evaluate(patient, method: .put, pathType: "Patient")
                == .allowed([.init(type: "Patient", id: "p1", mayCreate: true, mayUpdate: true)]))
        let createOnly = try WritePolicy(scopes: ["Patient.c"])
        #expect(
            createOnly.evaluate(patient, method: .put, pathType: nil)
                == .allowed([.init(type: "Patient", id: "p1", mayCreate: true, mayUpdate: false)]))
        let none = try WritePolicy(scopes: ["Observation.cu"])
        #expect(refusal(none.evaluate(patient, method: .put, pathType: nil))?.contains("may not write Patient") == true)
    }

    @Test("Bundles: every entry by the same rules; DELETE, PATCH, conditional and absolute urls, nested transactions refused")
    func bundles() throws {
        let policy = WritePolicy.c3pro
        let good = try transaction([
            ["request": ["method": "POST", "url": "Observation"], "resource": ["resourceType": "Observation"]],
            ["request": ["method": "PUT", "url": "Patient/p1"], "resource": ["resourceType": "Patient", "id": "p1"]],
            ["request": ["method": "PUT", "url": "Patient/p1"], "resource": ["resourceType": "Patient", "id": "p1"]],
        ])
        #expect(
            policy.evaluate(good, method: .post, pathType: nil)
                == .allowed([.init(type: "Patient", id: "p1", mayCreate: true, mayUpdate: true)]), "one target per id")
        #expect(refusal(policy.evaluate(good, method: .post, pathType: "Observation")) != nil, "a Bundle under another type's path")
        let cases: [([String: Any], String)] = [
            (["request": ["method": "DELETE", "url": "Patient/r2"]], "DELETE"),
            (["request": ["method": "PATCH", "url": "Patient/r2"], "resource": ["resourceType": "Patient", "id": "r2"]], "PATCH"),
            (["request": ["method": "GET", "url": "Patient/r2"]], "GET"),
            (["request": ["method": "PUT", "url": "Patient?identifier=x"], "resource": ["resourceType": "Patient"]], "conditional"),
            (
                ["request": ["method": "POST", "url": "http://other/fhir/Observation"], "resource": ["resourceType": "Observation"]],
                "absolute"
            ),
            (["request": ["method": "POST", "url": "Basic"], "resource": ["resourceType": "Basic"]], "may not create Basic"),
            (["request": ["method": "POST", "url": "Observation"], "resource": ["resourceType": "Patient"]], "goes to Patient"),
            (["request": ["method": "PUT", "url": "Patient/p2"], "resource": ["resourceType": "Patient", "id": "p3"]], "own id"),
            (["request": ["method": "POST", "url": "Observation"]], "no resource"),
            (["resource": ["resourceType": "Observation"]], "no request"),
            (
                ["request": ["method": "POST", "url": "Bundle"], "resource": ["resourceType": "Bundle", "type": "transaction"]],
                "nested"
            ),
        ]
        for (entry, expected) in cases {
            let bundle = try transaction([
                ["request": ["method": "POST", "url": "Observation"], "resource": ["resourceType": "Observation"]], entry,
            ])
            let why = try #require(refusal(policy.evaluate(bundle, method: .post, pathType: nil)), "\(expected)")
            #expect(why.contains("entry 2"), "\(expected): \(why)")
            #expect(why.lowercased().contains(expected.lowercased()), "\(expected): \(why)")
        }
    }
}

/// `meta.source` put into a receiver's create (the condition of its exactly-once send), bytes otherwise unchanged.
@Suite("meta.source stamping")
struct SourceStampTests {
    func stamped(_ json: String) -> String? {
        ConditionalCreate.stampingSource(Data(json.utf8), source: "urn:uuid:1").map { String(decoding: $0, as: UTF8.self) }
    }

    @Test("Added as the first member, into an existing meta (empty or not); a meta.source of the app's own is left, and nothing is stamped")
    func cases() throws {
        #expect(
            stamped(#"{"resourceType":"Observation","valueQuantity":{"value":1.50}}"#)
                == #"{"meta":{"source":"urn:uuid:1"},"resourceType":"Observation","valueQuantity":{"value":1.50}}"#)
        #expect(
            stamped(#" {"resourceType":"Observation","meta":{}}"#) == #" {"resourceType":"Observation","meta":{"source":"urn:uuid:1"}}"#)
        #expect(
            stamped(#"{"resourceType":"Observation","meta":{"tag":[]}}"#)
                == #"{"resourceType":"Observation","meta":{"source":"urn:uuid:1","tag":[]}}"#)
        #expect(stamped(#"{"resourceType":"Observation","meta":{"source":"app#1"}}"#) == nil)
        #expect(stamped(#"["resourceType"]"#) == nil)
        for json in [#"{"resourceType":"Observation","meta":{}}"#, #"{"resourceType":"Observation","meta":{"tag":[]}}"#] {
            let data = try #require(stamped(json))
            let object = try #require(try JSONSerialization.jsonObject(with: Data(data.utf8)) as? [String: Any])
            #expect((object["meta"] as? [String: Any])?["source"] as? String == "urn:uuid:1")
        }
    }
}
