"""The control loop through Redis faults (SIGKILLed, paused, read-only) under a load of 200
requests: the router loses no request, the loop takes no decision on data it could not read (no
new state, no event, its memory unchanged), and it decides again once Redis is back."""
from __future__ import annotations

import time

import pytest

from specfleet_local.state import ControlLoop, StateWriter, initial_state
from specfleet_operator.spec import with_defaults
from specfleet_router.faults import run_load
from specfleet_worker.fleet import FleetPublisher
from specfleet_worker.live import redis_client

NS, NAME = "team-a", "loop"
SPEC = with_defaults({"model": {"name": "tiny-random", "uri": "tiny-random"}, "replicas": 1,
                      "slo": {"window": "1s", "minDraftTokens": 20,
                              "fallback": {"minDwell": "1s", "recoverAfter": "2s"}}})
PAUSE_S = 8.0  # outlasts the load and the checks after it


def wait(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("fault", ["kill", "pause", "read_only"])
def test_the_loop_takes_no_decision_while_redis_is_away_and_resumes_after(fault, h, redis_server):
    client = redis_server.client()
    loop = ControlLoop(SPEC)
    writer = StateWriter(client, NS, NAME, initial_state(SPEC), loop=loop, period_s=0.1)
    writer.write()
    with h.text_worker() as stable:
        publisher = FleetPublisher(redis_client(redis_server.url), stable.worker, name="stable-0",
                                   deployment=(NS, NAME), period_s=0.2, window_s=1.0).start()
        writer.start()
        try:
            with h.router_over([stable], [], redis_url=redis_server.url, namespace=NS, name=NAME,
                               redis_poll_s=0.1) as r:
                warm = run_load(r.base_url, model=NAME, requests=40, clients=8, max_tokens=16)
                assert not warm.failed(), warm.summary()
                wait(lambda: loop.memory.keys, 10, "the loop to judge the first windows")

                def inject():
                    if fault == "kill":
                        redis_server.kill()
                    elif fault == "pause":
                        redis_server.pause(PAUSE_S)
                    else:
                        redis_server.read_only(True)

                report = run_load(r.base_url, model=NAME, requests=200, clients=16, max_tokens=8, fault=inject,
                                  timeout_s=30)
                print(report.summary())
                assert not report.failed(), report.summary()
                if fault != "read_only":  # nothing can be read: nothing is decided
                    time.sleep(0.5)  # a tick that read before the fault has ended
                    decided, events, version, memory = loop.decided, list(loop.events), writer.state.version, loop.memory
                    time.sleep(1.5)
                    assert loop.decided == decided, "the loop decided on data it could not read"
                    assert loop.memory == memory and list(loop.events) == events
                    assert writer.state.version == version
                else:  # reads work, writes fail: the state in force stays the last one written
                    time.sleep(1.0)
                    assert client.get(writer.key) is not None

                if fault == "kill":
                    redis_server.start()
                elif fault == "pause":
                    time.sleep(max(0.0, report.fault_at + PAUSE_S - time.monotonic()))
                else:
                    redis_server.read_only(False)
                after = run_load(r.base_url, model=NAME, requests=40, clients=8, max_tokens=16)
                assert not after.failed(), after.summary()
                resumed = loop.decided
                wait(lambda: loop.decided > resumed + 3, 10, "the loop to decide again")
                wait(lambda: client.get(writer.key) is not None, 10, "the state key written back")
        finally:
            writer.stop()
            publisher.stop()
