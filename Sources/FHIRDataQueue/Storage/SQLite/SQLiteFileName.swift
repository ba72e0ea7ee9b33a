import CSQLite

/// What dq hands to `sqlite3_open_v2` for a queue file, so that the file opened is the one at the path given.
///
/// Debian's SQLite reads URI filenames (`SQLITE_USE_URI`): a path that starts with `file:` would be read as a
/// URI, with `?` and `#` ending its path. Every queue file dq opens goes through here, as a `file:` URI of
/// that very path (percent-encoded); a SQLite that does not read URIs gets the plain path. Queues are opened
/// with SQLite's own default VFS.
enum SQLiteFileName {
    /// Whether this process's SQLite reads URI filenames.
    static let readsURIs: Bool = sqlite3_compileoption_used("USE_URI") == 1

    /// The name for the database file at `path`: a `file:` URI, or `path` itself when SQLite reads no URIs.
    static func location(for path: String) -> String {
        guard readsURIs else { return path }
        // A URI's path: `%`, `?` and `#` (and anything outside the unreserved set) percent-encoded. A relative
        // path stays relative (`file:q.sqlite`); an absolute one takes an empty authority (`file:///…`), so that
        // a path starting with `//` is not read as a host.
        var encoded = ""
        let digits = Array("0123456789ABCDEF".unicodeScalars)
        for byte in path.utf8 {
            switch byte {
            case UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "a")...UInt8(ascii: "z"),
                UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"),
                UInt8(ascii: "~"), UInt8(ascii: "/"):
                encoded.unicodeScalars.append(Unicode.Scalar(byte))
            default:
                encoded.unicodeScalars.append("%")
                encoded.unicodeScalars.append(digits[Int(byte >> 4)])
                encoded.unicodeScalars.append(digits[Int(byte & 0x0F)])
            }
        }
        return (path.hasPrefix("/") ? "file://" : "file:") + encoded
    }
}
