"""The worker follows its deployment's live state in Redis and fails static: with Redis SIGKILLed,
paused (CLIENT PAUSE) or read-only it serves on the last state, no request waits on Redis, the
staleness gauge grows while Redis cannot be read, and a newer state is applied once it returns.
A real redis-server (the `redis_server` fixture) throughout."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import pytest
import redis

from specfleet_api.live_state import KBounds, LiveState, state_key
from specfleet_worker.config import EngineConfig, LiveConfig
from specfleet_worker.live import LiveStateFollower, parse_deployment, redis_client
from specfleet_worker.main import main as serve_main
from specfleet_worker.main import watch_control_file
from specfleet_worker.testing import TINY, pb, running_worker, wait_for

NS, NAME, ARM = "default", "demo", "canary"
APPLIED_WITHIN_S = 2.0  # the bar: a change reaches every worker within 2 s
FAST_S = 1.0  # a request of 8 tokens on the tiny model takes a few tens of ms; Redis's timeout is 1 s
RPC_S = 30




class Records(logging.Handler):
    """The worker's log records (its logger may not propagate once JSON logs are configured)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def count(self, msg: str) -> int:
        return sum(r.getMessage() == msg for r in self.records)


@pytest.fixture
def records():
    handler, logger = Records(), logging.getLogger("specfleet.worker")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture
def followed(redis_server):
    """A canary worker on the tiny model following default/demo's state every 0.5 s."""
    with running_worker(cfg=dataclasses.replace(TINY, role=ARM)) as r:
        m = r.worker.scheduler.metrics
        follower = LiveStateFollower(redis_client(redis_server.url), r.worker.live, NS, NAME, ARM,
                                     registry=m.registry, model=m.model).start()
        r.follower = follower
        try:
            yield r
        finally:
            follower.stop()


def write(server, state: LiveState) -> float:
    server.client().set(state_key(NS, NAME), state.to_json())
    return time.monotonic()


def bounds(r) -> tuple[bool, int, int]:
    s = r.worker.live.settings
    return s.speculation_enabled, s.k_min, s.k_max


def gauge(r, name: str) -> float:
    return r.worker.scheduler.metrics.registry.get_sample_value(name, {"model": "tiny-random"})


def timed_request(r) -> float:
    t = time.monotonic()
    resp = r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 1, 2, 3], max_tokens=8, ignore_eos=True),
                          timeout=RPC_S)
    assert len(resp.token_ids) == 8
    return time.monotonic() - t


def v(version: int, k_min: int, k_max: int, speculate: bool = True) -> LiveState:
    # the stable arm's bounds are there too: a canary worker must take only its own
    return LiveState(version=version, speculate=speculate, k={"canary": KBounds(k_min, k_max),
                                                              "stable": KBounds(0, 1)})


def test_a_state_written_is_applied_within_2s_with_this_arms_bounds_only(followed, redis_server):
    r = followed
    wait_for(lambda: r.follower.in_sync, APPLIED_WITHIN_S, "the first read of Redis")
    assert gauge(r, "spec_decode_live_state_version") == 0  # nothing written yet: engine.json stands
    assert bounds(r) == (True, 0, 8)
    t = write(redis_server, v(1, 2, 3))
    wait_for(lambda: bounds(r) == (True, 2, 3), APPLIED_WITHIN_S, "version 1's canary bounds")
    assert time.monotonic() - t < APPLIED_WITHIN_S
    # the poll thread sets the bounds, then the version it reports: the test may look in between
    wait_for(lambda: gauge(r, "spec_decode_live_state_version") == 1, 2.0, "the version gauge at 1")
    wait_for(lambda: gauge(r, "spec_decode_live_state_staleness_seconds") < 1.0, 2.0, "staleness at 0")
    t = write(redis_server, v(2, 2, 3, speculate=False))  # the deployment's fallback: the soft off
    wait_for(lambda: not r.worker.live.settings.default_speculate, APPLIED_WITHIN_S, "speculate: false")
    assert time.monotonic() - t < APPLIED_WITHIN_S
    assert bounds(r) == (True, 2, 3)

    def method(probe: bool) -> str:
        return r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, speculation_method="ngram",
                                                 probe=probe), timeout=RPC_S).speculation.method

    assert method(probe=False) == "none" and method(probe=True) == "ngram"  # the router's probe speculates


def test_redis_sigkilled_the_worker_serves_on_the_last_state_then_resyncs_on_restart(followed, redis_server,
                                                                                     records):
    r = followed
    write(redis_server, v(1, 1, 2))
    wait_for(lambda: bounds(r) == (True, 1, 2), APPLIED_WITHIN_S, "version 1")
    redis_server.kill()
    killed = time.monotonic()
    latencies = []
    while time.monotonic() - killed < 2.0:
        latencies.append(timed_request(r))
    assert max(latencies) < FAST_S, latencies
    assert bounds(r) == (True, 1, 2)  # the last state, kept
    stale = gauge(r, "spec_decode_live_state_staleness_seconds")
    assert stale > 1.0, stale
    time.sleep(0.6)
    assert gauge(r, "spec_decode_live_state_staleness_seconds") > stale  # it grows
    assert records.count("live state: Redis is unavailable; serving on the last state") == 1  # once per outage
    redis_server.start()  # the same port, empty: no persistence
    t = write(redis_server, v(2, 3, 4))
    wait_for(lambda: bounds(r) == (True, 3, 4), APPLIED_WITHIN_S, "version 2 after the restart")
    assert time.monotonic() - t < APPLIED_WITHIN_S
    # the poll thread marks the state confirmed as it applies it: the test may look in between
    wait_for(lambda: gauge(r, "spec_decode_live_state_staleness_seconds") < 1.0, 2.0, "staleness back to 0")
    assert gauge(r, "spec_decode_live_state_version") == 2
    assert records.count("live state: Redis is back") == 1


def test_redis_paused_no_request_waits_on_it_and_a_newer_state_follows_the_pause(followed, redis_server, records):
    r = followed
    write(redis_server, v(1, 1, 2))
    wait_for(lambda: bounds(r) == (True, 1, 2), APPLIED_WITHIN_S, "version 1")
    assert timed_request(r) < FAST_S
    redis_server.pause(3.0)  # every client's commands hang for 3 s
    paused = time.monotonic()
    latencies = []
    while time.monotonic() - paused < 2.5:
        latencies.append(timed_request(r))
    assert len(latencies) >= 3 and max(latencies) < FAST_S, latencies  # far below the 3 s pause
    assert bounds(r) == (True, 1, 2)
    assert gauge(r, "spec_decode_live_state_staleness_seconds") > 1.0
    assert records.count("live state: Redis is unavailable; serving on the last state") == 1
    t = write(redis_server, v(2, 0, 5))  # blocks until the pause ends, as the operator's write would
    assert time.monotonic() - paused > 2.9
    wait_for(lambda: bounds(r) == (True, 0, 5), APPLIED_WITHIN_S, "version 2 after the pause")
    assert time.monotonic() - t < APPLIED_WITHIN_S
    # the poll thread marks the state confirmed as it applies it: the test may look in between
    wait_for(lambda: gauge(r, "spec_decode_live_state_staleness_seconds") < 1.0, 2.0, "staleness back to 0")


def test_redis_read_only_the_worker_serves_on_the_state_it_reads_and_takes_the_next_one(followed, redis_server):
    r = followed
    write(redis_server, v(1, 1, 2))
    wait_for(lambda: bounds(r) == (True, 1, 2), APPLIED_WITHIN_S, "version 1")
    redis_server.read_only(True)
    with pytest.raises(redis.ResponseError, match="NOREPLICAS"):  # the writer is refused, as on a replica
        write(redis_server, v(2, 3, 4))
    started = time.monotonic()
    latencies = []
    while time.monotonic() - started < 1.5:
        latencies.append(timed_request(r))
    assert max(latencies) < FAST_S, latencies
    assert bounds(r) == (True, 1, 2)
    # reads still work, so the worker still holds Redis's (unchanged) state: not stale
    assert r.follower.in_sync and gauge(r, "spec_decode_live_state_staleness_seconds") == 0.0
    redis_server.read_only(False)
    t = write(redis_server, v(2, 3, 4))
    wait_for(lambda: bounds(r) == (True, 3, 4), APPLIED_WITHIN_S, "version 2 once writable")
    assert time.monotonic() - t < APPLIED_WITHIN_S


class FakeClient:
    def __init__(self):
        self.value, self.down = None, False

    def get(self, key):
        if self.down:
            raise redis.ConnectionError("Connection refused")
        return self.value


def follower(client, clock=None) -> tuple[LiveStateFollower, LiveConfig]:
    live = LiveConfig(EngineConfig(k_min=0, k_max=8), ["ngram"])
    return LiveStateFollower(client, live, NS, NAME, ARM, clock=clock or time.monotonic), live


def test_bad_documents_are_ignored_and_logged_once_and_the_last_state_kept(records):
    client = FakeClient()
    f, live = follower(client)
    client.value = v(1, 2, 3).to_json()
    assert f.poll_once() and (live.settings.k_min, live.settings.k_max) == (2, 3)
    client.value = json.dumps({"version": 2, "k": {"canary": {"kMin": 5, "kMax": 1}}})
    assert not f.poll_once() and not f.poll_once()
    assert records.count("live state: ignoring a bad document") == 1
    assert not f.in_sync and f.version == 1 and (live.settings.k_min, live.settings.k_max) == (2, 3)
    client.value = v(3, 4, 4).to_json()
    assert f.poll_once() and f.version == 3 and (live.settings.k_min, live.settings.k_max) == (4, 4)


def test_a_version_that_went_back_is_applied_and_an_outage_reapplies_the_state():
    now = [100.0]
    client = FakeClient()
    f, live = follower(client, clock=lambda: now[0])
    client.value = v(7, 2, 3).to_json()
    assert f.poll_once() and f.staleness() == 0.0
    client.value = v(1, 1, 1).to_json()  # Redis lost its data and the writer counts again
    assert f.poll_once() and f.version == 1 and live.settings.k_max == 1
    client.down = True
    now[0] += 4.0
    assert not f.poll_once() and f.staleness() == 4.0
    live.apply_control_file({"speculate": True, "kMin": 0, "kMax": 6})  # control.json moved it meanwhile
    client.down = False
    assert f.poll_once() and (live.settings.k_min, live.settings.k_max) == (1, 1)  # Redis's state again
    assert f.staleness() == 0.0


def test_control_json_changes_wait_while_the_redis_state_is_in_force(tmp_path):
    live = LiveConfig(EngineConfig(k_min=1, k_max=8), ["ngram"])
    path = tmp_path / "control.json"
    path.write_text(json.dumps({"speculate": True, "kMin": 1, "kMax": 2}))
    in_force, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=watch_control_file, args=(path, live, stop, 0.01),
                         kwargs={"deferred": in_force.is_set}, daemon=True)
    t.start()
    try:
        wait_for(lambda: live.settings.k_max == 2, 5, "control.json at start")
        in_force.set()
        path.write_text(json.dumps({"speculate": True, "kMin": 1, "kMax": 3}))
        time.sleep(0.2)
        assert live.settings.k_max == 2  # Redis's state is in force
        in_force.clear()  # Redis away: the next change of the file applies
        path.write_text(json.dumps({"speculate": True, "kMin": 1, "kMax": 4}))
        wait_for(lambda: live.settings.k_max == 4, 5, "control.json while Redis is away")
    finally:
        stop.set()
        t.join(5)


def test_a_malformed_deployment_is_a_bad_configuration(monkeypatch, capsys):
    assert parse_deployment("prod/chat") == ("prod", "chat")
    for bad in ("chat", "/chat", "prod/", "a/b/c"):
        with pytest.raises(ValueError, match="SPECFLEET_DEPLOYMENT"):
            parse_deployment(bad)
    monkeypatch.setenv("SPECFLEET_DEPLOYMENT", "chat")
    assert serve_main(["--grpc-port", "0", "--http-port", "0"]) == 2
    rec = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert rec["msg"] == "bad configuration" and "SPECFLEET_DEPLOYMENT" in rec["error"]
