// The errors, settings and status types live in FHIRDataQueueCore (no network or crypto, so that the `dq`
// front can read a queue's status without loading the rest); users of FHIRDataQueue see them as its own.
@_exported import FHIRDataQueueCore
