import Crypto
import Foundation
import Synchronization

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// Random 96-bit AES-GCM nonces for sealing at rest, read from the kernel's random source 4 KiB at a time.
///
/// swift-crypto's `AES.GCM.Nonce()` makes each nonce with two `getrandom(2)` calls of 8 bytes (the standard
/// library's random number generator); sealing an item seals up to three values, so a bulk enqueue spent six
/// system calls per item on nonces alone (about 0.5 µs each here). The bytes are the same kernel CSPRNG output,
/// taken in larger reads; each is used once and wiped, and a process made by `fork` refills before its first
/// nonce, so that parent and child never share one.
final class NonceSource: Sendable {
    static let shared = NonceSource()

    private struct Pool {
        var bytes = [UInt8](repeating: 0, count: 4096)
        var offset = 4096
        var owner: pid_t = 0
    }

    private let pool = Mutex(Pool())

    /// A fresh random nonce.
    func next() -> AES.GCM.Nonce {
        pool.withLock { pool in
            if pool.offset + 12 > pool.bytes.count || pool.owner != getpid() {
                Self.fill(&pool.bytes)
                pool.offset = 0
                pool.owner = getpid()
            }
            let range = pool.offset..<pool.offset + 12
            pool.offset += 12
            // A 12-byte nonce is always the right size.
            let nonce = try! AES.GCM.Nonce(data: pool.bytes[range])
            for index in range { pool.bytes[index] = 0 }
            return nonce
        }
    }

    /// Fills `bytes` from `/dev/urandom` (the kernel's CSPRNG, the same as `getrandom(2)`, which Swift's Glibc
    /// module does not export): one open and one read per 341 nonces.
    private static func fill(_ bytes: inout [UInt8]) {
        bytes.withUnsafeMutableBytes { buffer in
            let fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC)
            precondition(fd >= 0, "cannot open /dev/urandom: \(String(cString: strerror(errno)))")
            defer { close(fd) }
            var filled = 0
            while filled < buffer.count {
                let count = read(fd, buffer.baseAddress! + filled, buffer.count - filled)
                if count < 0 && errno == EINTR { continue }
                // No kernel random source: dq cannot seal without one.
                precondition(count > 0, "cannot read /dev/urandom: \(String(cString: strerror(errno)))")
                filled += count
            }
        }
    }
}
