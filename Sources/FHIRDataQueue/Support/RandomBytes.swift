import Crypto
import NIOConcurrencyHelpers

#if canImport(Glibc)
    import Glibc
#endif

/// Random bytes from the kernel's generator, taken 4 KiB at a time.
///
/// Swift's `SystemRandomNumberGenerator` (and swift-crypto's `AES.GCM.Nonce()`, which uses it) asks the
/// kernel for 8 bytes per call: one system call per item id and two per at-rest nonce, which together were
/// about a tenth of a sealed bulk enqueue's time. Here one `getentropy` call serves 256 bytes, and each byte
/// is handed out once. The bytes are as random as the kernel's; dq never forks (children start with
/// `posix_spawn` and `exec`), so no copy of the pool outlives its process.
enum RandomBytes {
    private struct Pool {
        var bytes = [UInt8](repeating: 0, count: 4096)
        var next = 4096

        mutating func take(_ count: Int) -> ArraySlice<UInt8> {
            if next + count > bytes.count {
                bytes.withUnsafeMutableBytes { buffer in
                    for offset in stride(from: 0, to: buffer.count, by: 256) {
                        // getentropy fails only for a length above 256 or a bad address.
                        precondition(getentropy(buffer.baseAddress! + offset, min(256, buffer.count - offset)) == 0)
                    }
                }
                next = 0
            }
            defer { next += count }
            return bytes[next..<next + count]
        }
    }

    private static let pool = NIOLockedValueBox(Pool())

    /// A random 64-bit value.
    static func uint64() -> UInt64 {
        pool.withLockedValue { pool in
            pool.take(8).withUnsafeBytes { $0.loadUnaligned(as: UInt64.self) }
        }
    }

    /// A fresh random 96-bit AES-GCM nonce.
    static func nonce() -> AES.GCM.Nonce {
        pool.withLockedValue { pool in
            // 12 bytes are a valid nonce: this cannot throw.
            try! AES.GCM.Nonce(data: pool.take(12))
        }
    }
}
