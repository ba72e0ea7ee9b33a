import Hummingbird
import NIOCore

/// The request context of a router that mounts ``C3PROReceiver``: Hummingbird's own context plus the address of the
/// peer a request came from, which the receiver limits `register` and `oauth` by.
///
/// `C3PROReceiver/addRoutes(to:)` takes any context that knows its remote address (`RemoteAddressRequestContext`);
/// this one is the smallest such, and the one `dq serve` and the `Examples/Gateway` program use. A host with a
/// context of its own makes it conform to `RemoteAddressRequestContext` instead.
///
/// ```swift
/// let router = Router(context: ReceiverRequestContext.self)
/// let receiver = try C3PROReceiver(queue: queue, configuration: .init(antispamSecrets: [antispam]))
/// receiver.addRoutes(to: router)  // POST /c3pro/register, /c3pro/oauth, /c3pro/encfhir/…, /c3pro/fhir/…
/// let app = Application(router: router, services: [DataQueueService(queues: [queue])])
/// try await app.runService()
/// ```
///
/// The address is the TCP peer's: behind a proxy every request has the proxy's, and the rate limit counts them
/// together unless the proxy is one of ``C3PROReceiver/Configuration/trustedProxies`` (its `X-Forwarded-For` then
/// names the device).
public struct ReceiverRequestContext: RequestContext, RemoteAddressRequestContext, AuthenticatedClientContext {
    /// Hummingbird's per-request storage (the request's decoder, encoder, logger and route parameters).
    public var coreContext: CoreRequestContextStorage
    /// The address of the peer the request came from; nil when the channel does not know it (a Unix socket).
    public let remoteAddress: SocketAddress?
    /// The client the request's bearer token names, once `C3PROReceiver/bodyLimitMiddleware(maximumBytes:deadline:)`
    /// has checked it; nil before, and on the routes that take no token.
    public var authenticatedClient: String?

    /// The context of a request that arrived on `source`'s channel.
    public init(source: ApplicationRequestContextSource) {
        coreContext = .init(source: source)
        remoteAddress = source.channel.remoteAddress
    }
}

/// A request context that carries the client a bearer token names from the middleware that checked it to the
/// receiver's routes: the token is checked once per request (`C3PROReceiver/bodyLimitMiddleware(maximumBytes:deadline:)`
/// sets it, `C3PROReceiver/addRoutes(to:)` reads it). Only that middleware should set it.
public protocol AuthenticatedClientContext: RequestContext {
    /// The client id the request's bearer token was issued to; nil until checked.
    var authenticatedClient: String? { get set }
}
