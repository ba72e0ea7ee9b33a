/// The delivery loop's heartbeat, carried into the work a loop starts (a task-local value: the flush's task and
/// its children inherit it). Long steps inside a flush, or inside the first open of a queue that a flush does
/// (PostgreSQL opens lazily), call ``beat()``: each request, each batch sealed, each journal batch hashed or
/// pruned. A loop busy with many of them is then not taken for a stuck one by ``DataQueueService/liveness()``.
package enum Heartbeat {
    /// The loop's beat; nil outside a delivery loop (a one-shot `dq flush`, a producer).
    @TaskLocal package static var current: Beat?

    package struct Beat: Sendable {
        package let call: @Sendable () -> Void
        package init(call: @escaping @Sendable () -> Void) { self.call = call }
    }

    /// Says "alive" for the loop this task works for, if any.
    package static func beat() { current?.call() }
}
