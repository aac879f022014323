"""SIGTERM under load, on a real worker process: readiness fails, health goes NOT_SERVING, new
requests are refused, every request in flight (running or queued) completes, and the process
exits 0 within the grace period."""
from __future__ import annotations

import json
import os
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
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc

GRACE_S = 20


def start_worker(tmp_path, *extra: str):
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"model": {"name": "tiny-random", "uri": None},
                                  "draft": {"method": "ngram"}, "role": "stable"}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specfleet_worker.main", "--config", str(config), "--grpc-port", "0",
         "--http-port", "0", "--threads", "1", "--drain-seconds", str(GRACE_S), *extra],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    lines: list[dict] = []
    ports = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        rec = json.loads(line)  # every log line is JSON
        lines.append(rec)
        if rec["msg"] == "listening":
            ports = rec
        if rec["msg"] == "ready":
            break
    else:
        proc.kill()
        pytest.fail(f"the worker did not become ready: {lines}")
    assert ports, lines
    return proc, ports["grpc_port"], ports["http_port"], lines


def test_sigterm_under_load_finishes_in_flight_requests_refuses_new_ones_and_exits(tmp_path):
    proc, grpc_port, http_port, lines = start_worker(tmp_path, "--max-batch-size", "2")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    gen = pb_grpc.GenerationStub(channel)
    n, max_tokens = 8, 480
    started = threading.Barrier(n + 1)

    def one(i: int) -> int:
        call = gen.GenerateStream(pb.GenerateRequest(prompt_token_ids=[i + 1, 2, 3], max_tokens=max_tokens,
                                                     ignore_eos=True), timeout=120)
        got, first = 0, True
        for msg in call:
            got += len(msg.token_ids)
            if first:
                first = False
                started.wait()  # the queued ones get here late: that is fine, they are in flight already
        return got

    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            # wait until all n are in the worker (2 running, 6 queued)
            admin = pb_grpc.AdminStub(channel)
            for _ in range(2000):
                s = admin.GetStats(pb.GetStatsRequest())
                if s.running + s.queue_depth == n:
                    break
                time.sleep(0.005)
            assert s.running + s.queue_depth == n
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for _ in range(500):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz")
                except urllib.error.HTTPError as e:
                    assert e.code == 503
                    break
                time.sleep(0.01)
            else:
                pytest.fail("/readyz still answers 200 after SIGTERM")
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
            # the barrier releases once all n streams have their first token, whether queued or running
            started.wait(timeout=GRACE_S)
            results = [f.result(timeout=GRACE_S) for f in futures]
        rc = proc.wait(timeout=GRACE_S + 5)
        elapsed = time.monotonic() - t0
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
    assert results == [max_tokens] * n
    assert rc == 0 and elapsed < GRACE_S
    tail = [json.loads(line) for line in proc.stderr.read().splitlines()]
    msgs = [r["msg"] for r in tail]
    assert "draining" in msgs and "drained" in msgs and msgs[-1] == "exiting"
    assert sum(1 for r in tail if r["msg"] == "request finished" and r.get("request_id")) == n


def test_a_request_in_flight_past_the_grace_period_is_cut_off_and_the_exit_code_says_so(tmp_path):
    proc, grpc_port, _, _ = start_worker(tmp_path, "--drain-seconds", "0.3", "--max-batch-size", "1")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    gen = pb_grpc.GenerationStub(channel)
    n = 6
    try:
        calls = [gen.GenerateStream(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=480,
                                                       ignore_eos=True), timeout=60) for _ in range(n)]
        next(calls[0])
        admin = pb_grpc.AdminStub(channel)
        for _ in range(2000):  # all n in the worker, some still queued behind the one running
            s = admin.GetStats(pb.GetStatsRequest())
            if s.running + s.queue_depth + s.requests_total == n and s.queue_depth:
                break
            time.sleep(0.005)
        assert s.running + s.queue_depth + s.requests_total == n and s.queue_depth, s
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
