"""Redis fails mid-load (SIGKILLed, paused with CLIENT PAUSE, made read-only): the router keeps
serving every request on the last state it read, and a state written after Redis returns is
applied (resync)."""
from __future__ import annotations

import time

import pytest

from specfleet_api.live_state import LiveState, state_key
from specfleet_router.faults import run_load

KEY = state_key("team-a", "chat")
PAUSE_S = 4.0  # outlasts the load, so that the router has noticed before the load after it


@pytest.mark.parametrize("fault", ["kill", "pause", "read_only"])
def test_a_redis_fault_mid_load_loses_nothing_and_resyncs_after(fault, h, arms, redis_server):
    state = LiveState().next(canary_weight=100.0)  # everything to the canary: the last state is visible per request
    redis_server.client().set(KEY, state.to_json())
    with h.router_over([arms.stable], [arms.canary], redis_url=redis_server.url, namespace="team-a", name="chat",
                       redis_poll_s=0.1) as r:
        assert r.metric("specfleet_router_state_version") == state.version

        def inject():
            if fault == "kill":
                redis_server.kill()
            elif fault == "pause":
                redis_server.pause(PAUSE_S)
            else:
                redis_server.read_only(True)
            end = time.monotonic() + 5
            while r.metric("specfleet_router_redis_connected") and fault != "read_only":
                assert time.monotonic() < end, "the router did not notice that Redis is gone"
                time.sleep(0.02)

        report = run_load(r.base_url, model="chat", requests=200, clients=16, max_tokens=8, fault=inject,
                          timeout_s=20)
        print(report.summary())
        assert not report.failed(), report.summary()
        assert {o.arm for o in report.outcomes} == {"canary"}, "served on another state than the last one"
        assert max(o.latency_s for o in report.outcomes) < 5.0, "a request waited on Redis"
        assert r.metric("specfleet_router_state_version") == state.version
        # the load above may end before a paused read times out: more, now that the router has noticed
        assert fault == "read_only" or not r.metric("specfleet_router_redis_connected")
        during = run_load(r.base_url, model="chat", requests=32, clients=8, max_tokens=4)
        assert not during.failed() and {o.arm for o in during.outcomes} == {"canary"}, during.summary()

        if fault == "kill":
            redis_server.start()  # the same port, empty: nothing to apply yet
        elif fault == "pause":
            time.sleep(max(0.0, report.fault_at + PAUSE_S - time.monotonic()))
        else:
            with pytest.raises(Exception, match="(?i)replica"):
                redis_server.client().set(KEY, state.next(canary_weight=0.0).to_json())
            redis_server.read_only(False)
        newer = state.next(canary_weight=0.0)
        redis_server.client().set(KEY, newer.to_json())
        end = time.monotonic() + 2.0
        while r.metric("specfleet_router_state_version") != newer.version:
            assert time.monotonic() < end, "the state written after Redis returned was not applied within 2 s"
            time.sleep(0.02)
        after = run_load(r.base_url, model="chat", requests=16, clients=4, max_tokens=4)
        assert not after.failed() and {o.arm for o in after.outcomes} == {"stable"}, after.summary()
