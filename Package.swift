// swift-tools-version:6.2
import PackageDescription

let package = Package(
    name: "dq",
    platforms: [.macOS(.v15)],
    products: [
        .library(name: "FHIRDataQueue", targets: ["FHIRDataQueue"]),
        .library(name: "FHIRDataQueueServer", targets: ["FHIRDataQueueServer"]),
        .executable(name: "dq", targets: ["dq"]),
    ],
    dependencies: [
        .package(url: "https://github.com/groue/GRDB.swift", from: "7.10.0"),
        .package(url: "https://github.com/swift-server/async-http-client", from: "1.37.0"),
        .package(url: "https://github.com/apple/swift-nio", from: "2.101.3"),
        .package(url: "https://github.com/apple/swift-nio-ssl", from: "2.37.6"),
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.8.2"),
        .package(url: "https://github.com/apple/swift-log", from: "1.16.2"),
        .package(url: "https://github.com/apple/swift-crypto", from: "4.5.2"),
        .package(url: "https://github.com/apple/swift-certificates", from: "1.21.1"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle", from: "2.13.0"),
        .package(url: "https://github.com/apple/swift-metrics", from: "2.13.0"),
        .package(url: "https://github.com/swift-server/swift-prometheus", from: "2.4.1"),
        .package(url: "https://github.com/vapor/jwt-kit", from: "5.8.0"),
        .package(url: "https://github.com/vapor/postgres-nio", from: "1.33.2"),
        .package(url: "https://github.com/apple/swift-configuration", from: "1.4.0"),
        .package(url: "https://github.com/hummingbird-project/hummingbird", from: "2.28.1"),
        // The HTTP parts Hummingbird's HTTP/1 pipeline carries (ConnectionGuard sits in it).
        .package(url: "https://github.com/apple/swift-nio-extras", from: "1.35.2"),
        .package(url: "https://github.com/swiftlang/swift-subprocess", from: "1.0.2"),
        // FilePath and FileDescriptor of swift-subprocess's API on Linux (macOS has them in its System framework).
        .package(url: "https://github.com/apple/swift-system", from: "1.8.1"),
        // `make docs`: the DocC catalog in Sources/FHIRDataQueue/FHIRDataQueue.docc.
        .package(url: "https://github.com/swiftlang/swift-docc-plugin", from: "1.5.0"),
    ],
    targets: [
        .systemLibrary(name: "CSQLite"),
        // The HTTP side shared by `dq run`, `dq serve` and hosts that embed dq: Hummingbird routes for health,
        // readiness and metrics, the FHIR request-to-resource mapping, and the C3-PRO receiver.
        .target(
            name: "FHIRDataQueueServer",
            dependencies: [
                "FHIRDataQueue",
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOHTTPTypes", package: "swift-nio-extras"),
                .product(name: "NIOHTTPTypesHTTP1", package: "swift-nio-extras"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "JWTKit", package: "jwt-kit"),
                // An edge's public keys checked when its key set is read (jwt-kit takes an EC point off its curve).
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "_CryptoExtras", package: "swift-crypto"),
            ]
        ),
        .target(
            name: "FHIRDataQueue",
            dependencies: [
                "CSQLite",
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOFoundationCompat", package: "swift-nio"),
                .product(name: "NIOTLS", package: "swift-nio"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "_CryptoExtras", package: "swift-crypto"),
                .product(name: "X509", package: "swift-certificates"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "JWTKit", package: "jwt-kit"),
                .product(name: "PostgresNIO", package: "postgres-nio"),
                .product(name: "Configuration", package: "swift-configuration"),
            ]
        ),
        // `dq`, the command line: parses, calls the library, maps errors to exit codes.
        .executableTarget(
            name: "dq",
            dependencies: [
                "FHIRDataQueue",
                "FHIRDataQueueServer",
                .product(name: "Configuration", package: "swift-configuration"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdCore", package: "hummingbird"),
                .product(name: "HummingbirdTLS", package: "hummingbird"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
                .product(name: "Subprocess", package: "swift-subprocess"),
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
            ]
        ),
        // An example service that embeds dq: a Hummingbird 2 server that accepts FHIR Observations over HTTP and
        // hands them to a DataQueue, with DataQueueService delivering in the background in the same ServiceGroup.
        .executableTarget(
            name: "Gateway",
            dependencies: [
                "FHIRDataQueue",
                "FHIRDataQueueServer",
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "Metrics", package: "swift-metrics"),
                .product(name: "Prometheus", package: "swift-prometheus"),
                .product(name: "Logging", package: "swift-log"),
            ],
            path: "Examples/Gateway/Sources/Gateway"
        ),
        // Test helpers shared by the test targets: child processes on swift-subprocess.
        .target(
            name: "DQTestSupport",
            dependencies: [
                .product(name: "Subprocess", package: "swift-subprocess"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "SystemPackage", package: "swift-system", condition: .when(platforms: [.linux])),
            ],
            path: "Tests/DQTestSupport"
        ),
        .executableTarget(
            name: "dq-bench",
            dependencies: ["FHIRDataQueue"],
            path: "Benchmarks/DQBenchmarks"
        ),
        .testTarget(
            name: "FHIRDataQueueTests",
            dependencies: [
                "FHIRDataQueue",
                "DQTestSupport",
                "CSQLite",
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "_CryptoExtras", package: "swift-crypto"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
                .product(name: "NIOHTTP1", package: "swift-nio"),
                .product(name: "NIOConcurrencyHelpers", package: "swift-nio"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "MetricsTestKit", package: "swift-metrics"),
                .product(name: "PostgresNIO", package: "postgres-nio"),
            ]
        ),
        .testTarget(
            name: "IntegrationTests",
            dependencies: [
                "FHIRDataQueue",
                // The receiver mounted in process (ReceiverLibraryTests).
                "FHIRDataQueueServer",
                .product(name: "Hummingbird", package: "hummingbird"),
                "DQTestSupport",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "GRDB", package: "GRDB.swift"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOFoundationCompat", package: "swift-nio"),
                .product(name: "Crypto", package: "swift-crypto"),
                .product(name: "_CryptoExtras", package: "swift-crypto"),
            ]
        ),
    ]
)
