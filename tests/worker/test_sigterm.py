"""SIGTERM under load, on a real worker process: readiness fails, health goes NOT_SERVING, new
requests are refused, every request in flight (running or queued) completes, and the process
exits 0 within the grace period."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc
from specfleet_worker.testing import wait_for

GRACE_S = 20
RPC_S = 5  # any one control call (stats, health, a refused request) answers within this


class Worker:
    """A worker process; a thread reads its JSON log lines as they come, so no read blocks the
    test and a full pipe never blocks the worker."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.records: queue.Queue[dict] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:  # a line that is not JSON is kept, not fatal: a dead reader
            try:                         # would fill the pipe and stall the worker
                self.records.put(json.loads(line))
            except ValueError:
                self.records.put({"msg": None, "not_json": line.rstrip()})

    def until(self, msg: str, timeout_s: float) -> list[dict]:
        """The records up to and including the first with this msg."""
        seen, deadline = [], time.monotonic() + timeout_s
        while not seen or seen[-1]["msg"] != msg:
            try:
                seen.append(self.records.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"no {msg!r} log line within {timeout_s}s; got {seen}")
        return seen

    def drain(self) -> list[dict]:
        """The records logged so far and not yet read."""
        out = []
        while not self.records.empty():
            out.append(self.records.get_nowait())
        return out

    def rest(self) -> list[dict]:
        """Every record after the ones read so far; call once the process has exited."""
        self.reader.join(timeout=RPC_S)
        assert not self.reader.is_alive(), "the worker's stderr stayed open after it exited"
        return self.drain()


def start_worker(tmp_path, *extra: str):
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"model": {"name": "tiny-random", "uri": None},
                                  "draft": {"method": "ngram"}, "role": "stable"}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specfleet_worker.main", "--config", str(config), "--grpc-port", "0",
         "--http-port", "0", "--admin-port", "0", "--threads", "1", "--drain-seconds", str(GRACE_S), *extra],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    worker = Worker(proc)
    try:
        lines = worker.until("ready", timeout_s=60)
    except BaseException:
        proc.kill()
        raise
    ports = next((r for r in lines if r["msg"] == "listening"), None)
    assert ports, lines
    worker.admin_port = ports["admin_port"]
    return worker, ports["grpc_port"], ports["http_port"]




def test_sigterm_under_load_finishes_in_flight_requests_refuses_new_ones_and_exits(tmp_path):
    worker, grpc_port, http_port = start_worker(tmp_path, "--max-batch-size", "2")
    proc = worker.proc
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    gen = pb_grpc.GenerationStub(channel)
    admin = pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{worker.admin_port}"))
    n, max_tokens = 8, 480
    # every wait on it times out: a drain that never starts a queued request fails, not hangs
    started = threading.Barrier(n + 1, timeout=GRACE_S)
    calls = []

    def one(i: int) -> int:
        call = gen.GenerateStream(pb.GenerateRequest(prompt_token_ids=[i + 1, 2, 3], max_tokens=max_tokens,
                                                     ignore_eos=True), timeout=120)
        calls.append(call)
        got, first = 0, True
        for msg in call:
            got += len(msg.token_ids)
            if first:
                first = False
                started.wait()  # the queued ones get here late: that is fine, they are in flight already
        return got

    try:
        with ThreadPoolExecutor(n) as pool:
            try:
                futures = [pool.submit(one, i) for i in range(n)]

                def all_in() -> bool:  # 2 running, 6 queued
                    s = admin.GetStats(pb.GetStatsRequest(), timeout=RPC_S)
                    return s.running + s.queue_depth == n

                wait_for(all_in, 30, f"all {n} requests in the worker")
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)

                def not_ready() -> bool:
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=RPC_S)
                    except urllib.error.HTTPError as e:
                        assert e.code == 503
                        return True
                    return False

                wait_for(not_ready, 5, "/readyz to answer 503 after SIGTERM")
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_S)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.RpcError) as e:
                    gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2), timeout=RPC_S)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
                # the barrier releases once all n streams have their first token, whether queued or running
                try:
                    started.wait()
                except threading.BrokenBarrierError:
                    pytest.fail(f"not every request in flight had its first token within {GRACE_S}s of SIGTERM")
                results = [f.result(timeout=GRACE_S) for f in futures]
            finally:
                started.abort()  # a thread still waiting (the test failed) leaves at once
                for call in calls:
                    call.cancel()  # no effect on a finished stream
        rc = proc.wait(timeout=GRACE_S + 5)
        elapsed = time.monotonic() - t0
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
    assert results == [max_tokens] * n
    assert rc == 0 and elapsed < GRACE_S
    tail = worker.rest()
    assert not [r for r in tail if "not_json" in r], "every log line is JSON"
    msgs = [r["msg"] for r in tail]
    assert "draining" in msgs and "drained" in msgs and msgs[-1] == "exiting"
    assert sum(1 for r in tail if r["msg"] == "request finished" and r.get("request_id")) == n


def test_a_request_in_flight_past_the_grace_period_is_cut_off_and_the_exit_code_says_so(tmp_path):
    worker, grpc_port, _ = start_worker(tmp_path, "--drain-seconds", "0.3", "--max-batch-size", "1")
    proc = worker.proc
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    gen = pb_grpc.GenerationStub(channel)
    n = 12  # a backlog of several seconds: the poll sees it even when the requests trickle in under load
    try:
        calls = [gen.GenerateStream(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=480,
                                                       ignore_eos=True), timeout=60) for _ in range(n)]
        next(calls[0])
        admin = pb_grpc.AdminStub(grpc.insecure_channel(f"127.0.0.1:{worker.admin_port}"))

        last = []

        def some_queued():  # one running, some queued behind it (the rest may still be on their way)
            last[:] = [admin.GetStats(pb.GetStatsRequest(), timeout=RPC_S)]
            return last[0] if last[0].running and last[0].queue_depth else None

        s = wait_for(some_queued, 30, "a request running with some queued behind it",
                     seen=lambda: f"stats {text_format.MessageToString(last[0], as_one_line=True) if last else None}, "
                                  f"worker log {worker.drain()}")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
        elapsed = time.monotonic() - t0
        codes = []
        for call in calls:
            try:
                for _ in call:
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
    assert rc == 1 and elapsed < 10
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
    assert codes.count(grpc.StatusCode.UNAVAILABLE) >= s.queue_depth
