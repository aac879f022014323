"""specfleet's engine: a lossless speculative-decoding library (model, paged KV cache, proposers,
verification, K policies, step costs, kernels). No gRPC, no OpenTelemetry: the worker
(`specfleet_worker`) serves it."""
