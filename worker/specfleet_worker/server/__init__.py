"""The gRPC worker: the engine as a service (docs/worker.md)."""
