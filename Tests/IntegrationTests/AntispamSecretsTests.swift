import Testing

@testable import FHIRDataQueueServer

/// The `Antispam` values `register` accepts (one decision: which offered values match). That a wrong or missing
/// header gets 401 end to end is ServeTests' part.
@Suite("The Antispam secrets a receiver accepts")
struct AntispamSecretsTests {
    @Test("Each secret is accepted exactly: not a prefix, an extension, another case, nor after it was replaced")
    func exactMatch() {
        let secrets = AntispamSecrets(["first-secret", "second"])
        #expect(secrets.accepts("first-secret") && secrets.accepts("second"))
        for offered in ["first-secre", "first-secretx", "First-secret", "secon", "second ", "", "third"] {
            #expect(!secrets.accepts(offered), "\(offered)")
        }
        secrets.replace(["third"])
        #expect(secrets.accepts("third"))
        #expect(!secrets.accepts("first-secret") && !secrets.accepts("second"), "a removed secret is refused from then on")
        secrets.replace([])
        #expect(!secrets.accepts("third") && !secrets.accepts(""))
    }

    @Test("Bytes are equal only when every byte is, whatever their lengths")
    func comparison() {
        #expect(constantTimeEquals([1, 2, 3], [1, 2, 3]))
        #expect(constantTimeEquals([], []))
        #expect(!constantTimeEquals([1, 2, 3], [1, 2, 4]))
        #expect(!constantTimeEquals([1, 2, 3], [1, 2]))
        #expect(!constantTimeEquals([0], []))
    }
}
