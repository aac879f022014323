"""Test helpers: a real worker (gRPC and HTTP on loopback ports) around the tiny random model.

Used by tests/worker and handy in a REPL; nothing here runs in production.
"""
from __future__ import annotations

import contextlib

import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specfleet_engine.engine import Engine
from specfleet_engine.proposers import default_proposers
from specfleet_worker.app import WorkerServer
from specfleet_worker.config import EngineConfig
from specfleet_worker.main import make_worker
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc
from specfleet_worker.tracing import make_tracer
from specfleet_engine.testing import tiny_model

TINY = EngineConfig(model_name="tiny-random", k_min=0, k_max=8, k_initial=4)


class CharTokenizer:
    """Ids 0..94 are printable ASCII; 95..109 decode to nothing; 110 (the tiny model's EOS) ends."""

    eos_token_ids = [110]

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 if 32 <= ord(c) < 127 else ord("?") - 32 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i) for i in ids if i < 95)

    def chat(self, user: str, system: str | None = None) -> list[int]:
        return self.encode(f"<user>{user}</user>")


def tiny_engine(tokenizer=None, proposers=None, **kw) -> Engine:
    kw.setdefault("k_policy", "fixed")  # the scheduler's K controller owns K, as in serving
    return Engine(tiny_model(seed=0, scale=4.0), tokenizer,
                  proposers=proposers if proposers is not None else default_proposers(), **kw)


class Running:
    """A started worker and a client channel to it."""

    def __init__(self, server: WorkerServer, exporter: InMemorySpanExporter):
        self.server, self.exporter = server, exporter
        self.worker = server.worker
        self.engine = self.worker.engine
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.http = f"http://127.0.0.1:{server.http_port}"

    def stats(self) -> pb.WorkerStats:
        return self.admin.GetStats(pb.GetStatsRequest())


@contextlib.contextmanager
def running_worker(engine: Engine | None = None, cfg: EngineConfig = TINY, **kw):
    exporter = InMemorySpanExporter()
    engine = engine if engine is not None else tiny_engine()
    server = WorkerServer("127.0.0.1", 0, 0, max_workers=48).start()
    worker = make_worker(engine, cfg, tracer=make_tracer("test", exporter=exporter), **kw)
    server.attach(worker)
    r = Running(server, exporter)
    try:
        yield r
    finally:
        r.channel.close()
        server.stop(0)


def wait_idle(r: Running, timeout_s: float = 5.0) -> pb.WorkerStats:
    """Stats once nothing is queued or running (cancellations land at the next step)."""
    import time

    end = time.monotonic() + timeout_s
    while True:
        s = r.stats()
        if (s.queue_depth == 0 and s.running == 0 and s.kv_blocks_used == 0) or time.monotonic() > end:
            return s
        time.sleep(0.01)
