import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// A Unix datagram socket where a child process's sd_notify messages arrive: what systemd listens on as
/// `NOTIFY_SOCKET`. Closed with the value.
final class NotifySocket: Sendable {
    /// The socket's path, for the child's `NOTIFY_SOCKET`.
    let path: String
    private let fd: Int32

    /// Binds a socket at `path`.
    init(path: String) throws {
        self.path = path
        fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            for (index, byte) in path.utf8.enumerated() { raw[index] = byte }
        }
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        guard fd >= 0, bound == 0 else {
            if fd >= 0 { close(fd) }
            throw POSIXError(.init(rawValue: errno) ?? .EIO)
        }
    }

    deinit { close(fd) }

    /// The next message, or "" after `timeout`: polled without blocking, so that no thread of the test run's small
    /// cooperative pool waits in recv (blocking it starved the other suites' tasks for seconds).
    func receive(timeout: Duration = .seconds(20)) async -> String {
        let deadline = ContinuousClock.now + timeout
        while ContinuousClock.now < deadline {
            if let message = next() { return message }
            try? await Task.sleep(for: .milliseconds(20))
        }
        return ""
    }

    /// The messages that arrive until `count` of them contain `text`, or `timeout` passes.
    func messages(until count: Int, contain text: String, timeout: Duration = .seconds(25)) async -> [String] {
        var messages: [String] = []
        let started = ContinuousClock.now
        while messages.filter({ $0.contains(text) }).count < count && ContinuousClock.now - started < timeout {
            let message = await receive(timeout: .seconds(1))
            if !message.isEmpty { messages.append(message) }
        }
        return messages
    }

    /// What is waiting in the socket now, without waiting for more.
    func waiting() -> [String] {
        var messages: [String] = []
        while let message = next() { messages.append(message) }
        return messages
    }

    private func next() -> String? {
        var buffer = [UInt8](repeating: 0, count: 512)
        let count = recv(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT))
        return count > 0 ? String(decoding: buffer[0..<count], as: UTF8.self) : nil
    }
}
