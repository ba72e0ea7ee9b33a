import Foundation

// How the settings describe themselves: every field but the secrets (see `RedactedDescription`). A debug log line,
// an error or a crash report that prints the settings, or a service holding them, shows no token, client secret,
// registration header, or password of a PostgreSQL or proxy URL.

extension DataQueueSettings: RedactedDescription {
    /// Every setting; the bearer token, the client secret, registration headers and the password
    /// `database_password_file` holds redacted, and the passwords of the `database`, `proxy` and `server` URLs.
    package var redactedFields: [RedactedField] {
        [
            .url("server", server), .url("database", database), .plain("databasePasswordFile", databasePasswordFile),
            .secret("databasePassword", databasePassword), .plain("durability", durability), .plain("idempotent", idempotent),
            .plain("maxResourceBytes", maxResourceBytes), .plain("extraResourceTypes", extraResourceTypes),
            .plain("timeoutSeconds", timeoutSeconds),
            .plain("connectTimeoutSeconds", connectTimeoutSeconds), .plain("settleSeconds", settleSeconds),
            .plain("leaseSeconds", leaseSeconds), .plain("batchSize", batchSize), .plain("batchMaxBytes", batchMaxBytes),
            .plain("journalRetentionDays", journalRetentionDays),
            .plain("retry", retry), .plain("caBundle", caBundle), .url("proxy", proxy), .plain("proxyFile", proxyFile),
            .plain("noProxy", noProxy), .plain("tls", tls), .plain("environmentNetwork", environmentNetwork), .plain("auth", auth),
            .plain("encryption", encryption), .plain("atRest", atRest),
            .plain("envelopeKeyring", envelopeKeyring?.directory), .plain("duplicateWindow", duplicateWindow),
            .plain("writePolicy", writePolicy),
            .plain("envelopeBatches", envelopeBatches),
            .plain("baseDirectory", baseDirectory),
            .plain("sourcePath", sourcePath), .plain("fileHoldsSecret", fileHoldsSecret),
            .plain("exposedSecretFiles", exposedSecretFiles),
        ]
    }

    /// The settings that differ from `old`, by name in the file's style (`auth.client_secret`,
    /// `environment_network.https_proxy`), never by value: secrets are compared, and named when they changed
    /// (a rotated token), but not shown. Where the settings came from (their file, its directory, the exposed
    /// secret files) is left out.
    package func changes(since old: DataQueueSettings) -> [String] {
        let ignored: Set<String> = ["baseDirectory", "sourcePath", "fileHoldsSecret", "exposedSecretFiles"]
        func snake(_ name: String) -> String {
            name.reduce(into: "") { result, character in
                if character.isUppercase { result += "_" + character.lowercased() } else { result.append(character) }
            }
        }
        return Redaction.differences(old, self, ignoring: ignored).map { name in
            name.split(separator: ".").map { snake(String($0)) }.joined(separator: ".")
        }
    }
}

extension DataQueueSettings.Auth: RedactedDescription {
    /// Every `auth` setting; the bearer token, the client secret and the values of registration headers and
    /// fields redacted.
    package var redactedFields: [RedactedField] {
        [
            .secret("bearerToken", bearerToken), .plain("clientID", clientID), .secret("clientSecret", clientSecret),
            .plain("bearerTokenFile", bearerTokenFile), .plain("clientSecretFile", clientSecretFile),
            .url("authorizeURI", authorizeURI), .url("tokenURI", tokenURI), .plain("authorizeType", authorizeType),
            .url("issuer", issuer), .url("revocationURI", revocationURI), .url("registrationURI", registrationURI),
            .plain("clientName", clientName), .plain("scope", scope), .plain("tokenEndpointAuthMethod", tokenEndpointAuthMethod),
            .plain("privateKey", privateKey), .plain("keyID", keyID), .plain("keyAlgorithm", keyAlgorithm),
            .secretValues("registrationFields", registrationFields), .secretValues("registrationHeaders", registrationHeaders),
            .plain("credentialsDirectory", credentialsDirectory),
        ]
    }
}

extension DataQueueSettings.Resolved: RedactedDescription {
    /// The server, the queue's configuration, the authorization and the encrypted endpoint, each describing
    /// itself without its secrets.
    package var redactedFields: [RedactedField] {
        [
            .url("server", server), .plain("configuration", configuration),
            .custom("authorization", authorization, shown: authorization.map { Redaction.name(of: $0) }),
            .plain("encryption", encryption),
        ]
    }
}

extension DataQueueSettings.CheckedValues: RedactedDescription {
    /// The checked values; the password of the `server` and `database` URLs redacted.
    package var redactedFields: [RedactedField] {
        [
            .url("server", server), .plain("queueName", queueName), .url("database", database), .plain("durability", durability),
            .plain("maximumResourceSize", maximumResourceSize), .plain("batchSize", batchSize), .plain("batchMaxBytes", batchMaxBytes),
            .plain("requestTimeout", requestTimeout), .plain("connectTimeout", connectTimeout),
            .plain("leaseDuration", leaseDuration), .plain("settleDelay", settleDelay), .plain("retryInitialDelay", retryInitialDelay),
            .plain("retryMaximumDelay", retryMaximumDelay), .plain("retryJitter", retryJitter), .plain("caBundlePath", caBundlePath),
            .plain("network", network),
        ]
    }
}
