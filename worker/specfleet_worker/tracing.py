"""OpenTelemetry traces after the GenAI semantic conventions, one span per request.

With OTEL_EXPORTER_OTLP_ENDPOINT set, spans go out through the OTLP/gRPC exporter in batches;
unset, the tracer is the API's no-op one and a request pays nothing. Tests pass their own
exporter (the SDK's in-memory one). An incoming W3C traceparent in the gRPC metadata is continued.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
# the batching SDK providers made here: the worker's exit path flushes them (flush_tracing), as it ends
# with os._exit, which runs no atexit hook
_PROVIDERS: list = []


def make_tracer(service_name: str, exporter=None, endpoint: str | None = None) -> trace.Tracer:
    """A tracer that exports to `exporter`, else to the OTLP endpoint, else nowhere at no cost."""
    endpoint = endpoint if endpoint is not None else os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter is None and not endpoint:
        return trace.NoOpTracer()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        _PROVIDERS.append(provider)  # batched: spans may wait for the exit's flush
    return provider.get_tracer("specfleet.worker")


def flush_tracing(timeout_s: float = 3.0) -> bool:
    """Exports the spans still batched and shuts the providers down; False when the flush did not
    finish within timeout_s (an OTLP collector that does not answer)."""
    ok = True
    while _PROVIDERS:
        provider = _PROVIDERS.pop()
        ok = provider.force_flush(int(timeout_s * 1000)) and ok
        provider.shutdown()
    return ok


def incoming_context(metadata) -> object | None:
    """The caller's trace context from gRPC invocation metadata (traceparent, tracestate)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier) if "traceparent" in carrier else None


def request_attributes(model: str, req) -> dict:
    p = req.params
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.system": "specfleet",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": p.max_tokens,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.top_k": p.top_k,
        "gen_ai.request.id": req.request_id,
        "specfleet.prompt_type": req.prompt_type,
        "specfleet.speculation.method": req.method,
    }


def result_attributes(req) -> dict:
    seq = req.seq
    s = seq.stats
    return {
        "gen_ai.response.id": req.request_id,
        "gen_ai.response.finish_reasons": [seq.finish_reason or "abort"],
        "gen_ai.usage.input_tokens": seq.prompt_len,
        "gen_ai.usage.output_tokens": len(seq.output),
        "specfleet.speculation.k": seq.k,
        "specfleet.speculation.k_mean": req.k_sum / max(req.k_steps, 1),
        "specfleet.speculation.draft_tokens": s.num_draft_tokens,
        "specfleet.speculation.draft_nodes": s.num_draft_nodes,
        "specfleet.speculation.accepted_tokens": s.num_accepted_tokens,
        "specfleet.speculation.alpha": s.acceptance_rate,
        "specfleet.speculation.mean_accepted_length": s.mean_accepted_length,
        "specfleet.speculation.draft_errors": s.draft_errors,
    }
