"""specfleet's worker: a lossless speculative-decoding engine and the gRPC service around it."""

__version__ = "0.1.0"
