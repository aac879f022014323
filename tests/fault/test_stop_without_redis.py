"""Stopping never waits on a dead Redis: a `specfleet serve` worker (following the live state,
publishing its windows) and `specfleet up` stop within their drain bound when their Redis was
killed, frozen (SIGSTOP: connections open, nothing answers) or made unreachable (frozen, its
accept queue full: a new connection's connect times out), every shutdown step within its own
bound. (The router's own stop is tests/router's.)"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from specfleet_local import runfile
from specfleet_local.redis_server import Unreachable, freeze, thaw
from specfleet_worker.testing import WorkerProcess

FAULTS = ["kill", "freeze", "unreachable"]
DRAIN_S = 10.0  # --drain-seconds: nothing is in flight, so none of it should be needed
BLOCKED_S = 2.5  # after the fault, before SIGTERM: every Redis thread is inside a call by then
# each Redis client gives up on a call after 2 s (connect, then the read): a step that talks to
# Redis once takes at most that, plus this much for a loaded machine
SLACK_S = 2.0


@contextlib.contextmanager
def redis_fault(kind: str, pid: int, host: str, port: int):
    """Kills, freezes or cuts off the redis-server at pid (listening on host:port) until the end."""
    cut = None
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
    elif kind == "freeze":
        freeze(pid)
    else:
        cut = Unreachable(host, port, pid)
    try:
        yield
    finally:
        if cut is not None:
            cut.close()
        elif kind == "freeze":
            thaw(pid)


def wait(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.1)
    return value


@pytest.mark.parametrize("fault", FAULTS)
def test_a_worker_stops_within_its_bound_when_redis_is_dead(fault, h, tmp_path, redis_server):
    client = redis_server.client()
    worker = WorkerProcess(h.worker_config(tmp_path / "stable.json"), "--threads", "1",
                           "--drain-seconds", str(DRAIN_S), "--live-state-period", "0.2",
                           env={"SPECFLEET_REDIS_URL": redis_server.url, "SPECFLEET_DEPLOYMENT": "team-a/stop",
                                "SPECFLEET_FLEET_WINDOW_S": "1", "POD_NAME": "stop-0"}).start(120)
    try:
        wait(lambda: client.exists("specfleet:v1:team-a/stop:worker:stop-0"), 30, "the worker's first fleet statistics")
        with redis_fault(fault, redis_server.proc.pid, redis_server.host, redis_server.port):
            time.sleep(BLOCKED_S)
            t0 = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            try:
                rc = worker.proc.wait(timeout=DRAIN_S + 30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the worker did not exit within {DRAIN_S + 30} s of SIGTERM with Redis {fault}: "
                            f"{worker.seen[-10:]}")
            elapsed = time.monotonic() - t0
            print(f"the worker stopped {elapsed:.1f} s after SIGTERM with Redis {fault}")
    finally:
        worker.kill()
    records = []
    with contextlib.suppress(TimeoutError):
        records = worker.until("exiting", 10)
    steps = {r["step"]: r for r in records if "step" in r}
    assert rc == 0, records
    assert not [r for r in records if r["msg"] == "shutdown step timed out; going on without it"], records
    for name in ("live-state follower", "fleet publisher"):
        assert steps[name]["msg"] == "shutdown step" and steps[name]["seconds"] <= 2.0 + SLACK_S, steps[name]
    assert elapsed < DRAIN_S, f"{elapsed:.1f} s from SIGTERM to exit with Redis {fault}: {records}"


SPEC = {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
        "metadata": {"name": "stop", "namespace": "team-a"},
        "spec": {"model": {"name": "tiny-random", "uri": "tiny-random"}, "draft": {"method": "ngram"},
                 "replicas": 1, "slo": {"window": "2s"}}}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("fault", FAULTS)
def test_up_stops_within_its_bound_when_its_redis_is_dead(fault, tmp_path):
    """`up` with its loop writing the live state every 0.2 s: with Redis killed it stops on its own
    (naming why), frozen or unreachable it stops on SIGTERM; either way within the drain of the
    router and the workers plus the Redis calls it was in, and nothing it started is left."""
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(SPEC))
    run_file, out = tmp_path / "run" / "up.json", tmp_path / "up.out"
    env = {k: v for k, v in os.environ.items() if k not in ("SPECFLEET_REDIS_URL", runfile.ENV)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(f), "--http-port", "0", "--grpc-port", "0",
         "--worker-threads", "1", "--run-file", str(run_file), "--drain-seconds", str(DRAIN_S),
         "--loop-period", "0.2"], stdout=open(out, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        doc = wait(lambda: (d := runfile.read(run_file)) is not None and d.get("phase") == "serving" and d
                   or (proc.poll() is not None and pytest.fail(out.read_text())), 180, "up to serve")
        pids = {"redis": doc["redis"]["pid"], "router": doc["router"]["pid"],
                **{w["name"]: w["pid"] for w in doc["workers"]}}
        host, port = doc["redis"]["url"].removeprefix("redis://").split("/")[0].split(":")
        with redis_fault(fault, pids["redis"], host, int(port)):
            t0 = time.monotonic()
            if fault != "kill":  # killed, it stops on its own (a SIGTERM could land in its exit)
                time.sleep(BLOCKED_S)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
            # nothing is in flight: the router and the workers need none of their drain; what is
            # left is each one's exit, the Redis call the loop's thread is in, and Redis itself
            bound = DRAIN_S
            try:
                rc = proc.wait(timeout=bound + 30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"up did not exit within {bound + 30} s of SIGTERM with Redis {fault}:\n{out.read_text()}")
            elapsed = time.monotonic() - t0
            print(f"up stopped {elapsed:.1f} s after {'the kill' if fault == 'kill' else 'SIGTERM'} with Redis {fault}")
        wait(lambda: all(gone(p) for p in pids.values()), 10, f"every process up started to be gone: {pids}")
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert elapsed < bound, f"{elapsed:.1f} s from SIGTERM to exit with Redis {fault}:\n{text}"
    if fault == "kill":
        assert rc == 1 and "redis-server exited" in text, text
    else:
        assert rc == 0, text
    assert "Stopped: router (exit 0), stop-stable-0 (exit 0), redis-server" in text, text
