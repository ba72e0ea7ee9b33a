import CSQLite
import SQLiteWALWrites

/// How dq opens a queue database: through the `dq-wal` VFS, which writes each WAL frame (SQLite's 24-byte
/// header and its page) with one `pwrite` instead of two, with the default VFS for everything else (see
/// `SQLiteWALWrites.h`).
///
/// One durable enqueue writes four or five frames: eight to ten `pwrite` calls of 24 and 4,096 bytes at
/// unaligned offsets, each a few microseconds of kernel time on a virtual machine. What reaches the file,
/// in what order, and when it is synced do not change.
enum WALWrites {
    /// Whether this process's SQLite reads URI filenames (`SQLITE_USE_URI`, as Debian's and Ubuntu's do) and
    /// the VFS is registered; without either, queues are opened by their plain path, with the default VFS.
    static let available: Bool = sqlite3_compileoption_used("USE_URI") == 1 && dq_wal_writes_register() == SQLITE_OK

    /// What to hand to `sqlite3_open_v2` for the database file at `path`: a `file:` URI naming the VFS, or
    /// `path` itself when the VFS is not available. Every queue file dq opens goes through here, so that a
    /// path that itself starts with `file:` is that file, not a URI.
    static func location(for path: String) -> String {
        guard available else { return path }
        // A URI's path: `%`, `?` and `#` (and anything outside the unreserved set) percent-encoded. A relative
        // path stays relative (`file:q.sqlite`); an absolute one takes an empty authority (`file:///…`), so that
        // a path starting with `//` is not read as a host.
        var encoded = ""
        for byte in path.utf8 {
            switch byte {
            case UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "a")...UInt8(ascii: "z"),
                UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"),
                UInt8(ascii: "~"), UInt8(ascii: "/"):
                encoded.unicodeScalars.append(Unicode.Scalar(byte))
            default:
                let digits = Array("0123456789ABCDEF".unicodeScalars)
                encoded.unicodeScalars.append("%")
                encoded.unicodeScalars.append(digits[Int(byte >> 4)])
                encoded.unicodeScalars.append(digits[Int(byte & 0x0F)])
            }
        }
        let vfs = String(cString: dq_wal_writes_vfs_name)
        return (path.hasPrefix("/") ? "file://" : "file:") + encoded + "?vfs=" + vfs
    }
}
