// swift-tools-version:6.2
// An example service that embeds dq: a Hummingbird 2 server that accepts FHIR Observations over HTTP and hands
// them to a DataQueue, with DataQueueService delivering in the background in the same ServiceGroup.
import PackageDescription

let package = Package(
    name: "Gateway",
    platforms: [.macOS(.v15)],
    dependencies: [
        .package(name: "dq", path: "../.."),
        .package(url: "https://github.com/hummingbird-project/hummingbird", from: "2.28.1", traits: []),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle", from: "2.13.0"),
        .package(url: "https://github.com/apple/swift-metrics", from: "2.13.0"),
        .package(url: "https://github.com/swift-server/swift-prometheus", from: "2.4.1"),
        .package(url: "https://github.com/apple/swift-log", from: "1.16.2"),
    ],
    targets: [
        .executableTarget(
            name: "Gateway",
            dependencies: [
                .product(name: "FHIRDataQueue", package: "dq"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "Logging", package: "swift-log"),
            ]
        )
    ]
)
