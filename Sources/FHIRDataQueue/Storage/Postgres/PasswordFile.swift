import Foundation
import Logging
import NIOSSL
import PostgresNIO

/// libpq's password file: the URL's `passfile`, else `$PGPASSFILE`, else `~/.pgpass`; lines `host:port:database:user:password`, `*`
/// matching anything, `\:` and `\\` escaped; the first matching line wins. Like libpq, a file others can
/// read or write is not used.
enum PasswordFile {
    static func password(
        host: String, port: Int, database: String, user: String, file: String?, environment: [String: String]
    ) -> String? {
        guard let path = file ?? environment["HOME"].map({ $0 + "/.pgpass" }),
            let (_, mode) = FilePermissions.ownerAndMode(path), mode & 0o077 == 0,
            let text = try? String(contentsOfFile: path, encoding: .utf8)
        else { return nil }
        for line in text.split(whereSeparator: \.isNewline) where !line.hasPrefix("#") {
            let fields = split(line)
            guard fields.count == 5 else { continue }
            let wanted = [host, String(port), database, user]
            if zip(fields.prefix(4), wanted).allSatisfy({ $0 == "*" || $0 == $1 }) { return fields[4] }
        }
        return nil
    }

    /// A line's fields: split at unescaped colons, with `\:` and `\\` unescaped.
    private static func split(_ line: Substring) -> [String] {
        var fields: [String] = []
        var current = ""
        var escaped = false
        for character in line {
            if escaped {
                current.append(character)
                escaped = false
            } else if character == "\\" {
                escaped = true
            } else if character == ":" && fields.count < 4 {
                fields.append(current)
                current = ""
            } else {
                current.append(character)
            }
        }
        fields.append(current)
        return fields
    }
}
