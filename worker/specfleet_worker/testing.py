"""Test helpers: a real worker (gRPC and HTTP on loopback ports) around the tiny random model,
in this process (`running_worker`) or as a `specfleet serve` child process (`WorkerProcess`).

Used by tests/worker and handy in a REPL; nothing here runs in production.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specfleet_engine.engine import Engine
from specfleet_engine.proposers import NgramProposer, default_proposers
from specfleet_worker.app import WorkerServer
from specfleet_worker.config import EngineConfig
from specfleet_worker.main import make_worker
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc
from specfleet_worker.tracing import make_tracer
from specfleet_engine.testing import CharTokenizer, tiny_model

TINY = EngineConfig(model_name="tiny-random", k_min=0, k_max=8, k_initial=4)

__all__ = ["TINY", "CharTokenizer", "Running", "WorkerProcess", "listening_ports", "pb", "pb_grpc", "running_worker",
           "tiny_engine", "wait_idle"]


def tiny_engine(tokenizer=None, proposers=None, **kw) -> Engine:
    kw.setdefault("k_policy", "fixed")  # the scheduler's K controller owns K, as in serving
    return Engine(tiny_model(seed=0, scale=4.0), tokenizer,
                  proposers=proposers if proposers is not None else default_proposers(), **kw)


class SlowProposer(NgramProposer):
    """An n-gram proposer that takes its time: keeps requests running while a test looks."""

    name = "slow"

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def propose(self, seqs, ks):
        time.sleep(self.delay_s)
        return super().propose(seqs, ks)


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.01, seen=None):
    """Polls condition() until it returns something true, and returns that; fails the calling
    test (pytest.fail) after timeout_s. `seen()`, where given, says what was last observed: the
    failure message carries it."""
    import pytest

    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            last = f"; last seen: {seen()}" if seen is not None else ""
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}{last}")
        time.sleep(poll_s)


class Running:
    """A started worker and a client channel to it."""

    def __init__(self, server: WorkerServer, exporter: InMemorySpanExporter):
        self.server, self.exporter = server, exporter
        self.worker = server.worker
        self.engine = self.worker.engine
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.admin_channel = grpc.insecure_channel(f"127.0.0.1:{server.admin_port}")
        self.admin = pb_grpc.AdminStub(self.admin_channel)
        self.http = f"http://127.0.0.1:{server.http_port}"

    def stats(self) -> pb.WorkerStats:
        return self.admin.GetStats(pb.GetStatsRequest())


@contextlib.contextmanager
def running_worker(engine: Engine | None = None, cfg: EngineConfig = TINY, **kw):
    exporter = InMemorySpanExporter()
    engine = engine if engine is not None else tiny_engine()
    server = WorkerServer("127.0.0.1", 0, 0, admin_port=0, max_workers=48).start()
    worker = make_worker(engine, cfg, tracer=make_tracer("test", exporter=exporter), **kw)
    server.attach(worker)
    r = Running(server, exporter)
    try:
        yield r
    finally:
        r.channel.close()
        r.admin_channel.close()
        server.stop(0)


def wait_idle(r: Running, timeout_s: float = 5.0) -> pb.WorkerStats:
    """Stats once nothing is queued or running (cancellations land at the next step)."""
    end = time.monotonic() + timeout_s
    while True:
        s = r.stats()
        if (s.queue_depth == 0 and s.running == 0 and s.kv_blocks_used == 0) or time.monotonic() > end:
            return s
        time.sleep(0.01)


def listening_ports(record: dict) -> tuple[int, int] | None:
    """(gRPC port, HTTP port) from `specfleet serve`'s `listening` log line (a JSON object on
    stderr, logged once both ports are open, before the model loads), else None."""
    if record.get("msg") != "listening":
        return None
    return int(record["grpc_port"]), int(record["http_port"])


class WorkerProcess:
    """`specfleet serve --config <config> --grpc-port 0 --http-port 0 --admin-port 0` as a child process: a thread
    reads its JSON log lines as they come (a full pipe never blocks the worker, no read blocks the
    test); `start` returns once it logged `ready`, with the ports from its `listening` line."""

    def __init__(self, config: str | os.PathLike, *args: str, env: dict[str, str] | None = None):
        self.cmd = [sys.executable, "-m", "specfleet_worker.main", "--config", str(config), "--grpc-port", "0",
                    "--http-port", "0", "--admin-port", "0", *args]
        self.env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "", **(env or {})}
        self.records: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        self.proc: subprocess.Popen | None = None
        self.grpc_port = self.http_port = self.admin_port = 0

    def start(self, timeout_s: float = 60.0) -> WorkerProcess:
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, text=True, env=self.env)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            for rec in self.until("ready", timeout_s):
                if listening_ports(rec):
                    self.grpc_port, self.http_port = listening_ports(rec)
                    self.admin_port = int(rec["admin_port"])
        except BaseException:
            self.kill()
            raise
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.admin_channel = grpc.insecure_channel(f"127.0.0.1:{self.admin_port}")
        self.admin = pb_grpc.AdminStub(self.admin_channel)
        self.http = f"http://127.0.0.1:{self.http_port}"
        return self

    def _read(self) -> None:
        for line in self.proc.stderr:
            try:
                self.records.put(json.loads(line))
            except ValueError:  # not ours (a library printing): keep it readable anyway
                self.records.put({"msg": line.rstrip("\n")})

    def until(self, msg: str, timeout_s: float) -> list[dict]:
        """The records up to and including the next one with this msg; TimeoutError after timeout_s."""
        out, deadline = [], time.monotonic() + timeout_s
        while not out or out[-1].get("msg") != msg:
            try:
                out.append(self.records.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise TimeoutError(f"no {msg!r} log line within {timeout_s}s; got {out}") from None
            self.seen.append(out[-1])
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain, then exit); its exit code. Killed after timeout_s."""
        if hasattr(self, "channel"):
            self.channel.close()
            self.admin_channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
