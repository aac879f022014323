"""Backends: readiness from gRPC health, least-outstanding-requests choice, the retry before the
first token, and the arm fallback."""
from __future__ import annotations

import time

import openai
import pytest

from specfleet_local.redis_server import free_port
from specfleet_router.backends import Backend, Pool


def fake(target: str, outstanding: int = 0, healthy: bool = True) -> Backend:
    return Backend("stable", target, channel=None, generation=None, healthy=healthy, outstanding=outstanding)


def test_the_least_busy_ready_backend_is_picked_and_equals_take_turns():
    pool = Pool("stable", clock=lambda: 100.0)
    a, b, c, down = fake("a", 2), fake("b", 1), fake("c", 1), fake("d", 0, healthy=False)
    pool.backends = [a, b, c, down]
    picks = [pool.pick().target for _ in range(4)]
    assert sorted(picks) == ["b", "b", "c", "c"]  # never the busier a, never the unready d
    b.outstanding = 5
    assert {pool.pick().target for _ in range(3)} == {"c"}
    assert pool.pick(exclude=[c]).target == "a"
    c.ejected_until = 101.0  # ejected after an UNAVAILABLE
    assert pool.pick().target == "a" and pool.any_available()
    a.healthy = b.healthy = False
    assert pool.pick() is None and not pool.any_available()


def test_a_stopped_backend_is_retried_once_elsewhere_before_the_first_token(h):
    """Health checks off, so the router believes the stopped backend is there until a request
    to it fails: each such request goes once more to the live one, and the client never knows."""
    dead = f"127.0.0.1:{free_port()}"
    with h.text_worker() as w:
        for stream in (False, True):
            with h.router_over([w, dead], health_check=False, eject_s=60) as r:
                c = h.client(r)
                for _ in range(4):
                    out = c.completions.create(model="specfleet", prompt="Hi", max_tokens=3, temperature=0,
                                               stream=stream)
                    text = "".join(ch.choices[0].text for ch in out) if stream else out.choices[0].text
                    assert len(text) > 0
                # two backends take turns: the dead one got exactly one request, then was ejected
                assert r.metric("specfleet_router_retries_total", {"arm": "stable", "reason": "unavailable"}) == 1
                assert r.metric("specfleet_router_requests_total", {
                    "arm": "stable", "prompt_type": "chat", "method": "ngram", "outcome": "ok"}) == 4


def test_without_a_retry_left_the_unavailable_backend_is_503(h):
    dead = f"127.0.0.1:{free_port()}"
    with h.router_over([dead], health_check=False) as r:
        with pytest.raises(openai.InternalServerError) as e:
            h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=3)
        assert e.value.status_code == 503 and dead in e.value.body["message"]


def test_a_worker_that_stops_is_seen_by_its_health_and_traffic_moves(h):
    with h.text_worker() as w1, h.text_worker() as w2, h.router_over([w1, w2]) as r:
        w2.server.stop(0)
        end = time.monotonic() + 10
        while r.ready_counts()["stable"] != 1:
            assert time.monotonic() < end, "the stopped worker still counts ready"
            time.sleep(0.02)
        assert r.metric("specfleet_router_backend_ready", {"arm": "stable", "backend": h.target(w2)}) == 0
        for _ in range(6):
            assert h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=2).usage
        assert r.metric("specfleet_router_requests_total", {"arm": "stable", "prompt_type": "chat",
                                                             "method": "ngram", "outcome": "ok"}) == 6


def test_an_arm_without_a_ready_backend_falls_back_to_the_other(h):
    dead = f"127.0.0.1:{free_port()}"
    with h.text_worker() as w, h.router_over([w], [dead], state=_weight(100.0)) as r:
        raw = h.client(r).completions.with_raw_response.create(model="specfleet", prompt="Hi", max_tokens=2)
        assert raw.headers["x-specfleet-arm"] == "stable"
        assert raw.headers["x-specfleet-fallback-from"] == "canary"
        assert r.metric("specfleet_router_arm_fallbacks_total", {"from_arm": "canary", "to_arm": "stable"}) == 1
    with h.text_worker() as w, h.router_over([w], [w], state=_weight(100.0)) as r:  # both up: no fallback
        raw = h.client(r).completions.with_raw_response.create(model="specfleet", prompt="Hi", max_tokens=2)
        assert raw.headers["x-specfleet-arm"] == "canary" and "x-specfleet-fallback-from" not in raw.headers


def _weight(pct: float):
    from specfleet_api.live_state import LiveState

    return LiveState(canary_weight=pct)


def test_readiness_follows_the_workers_health_both_ways(h):
    from grpc_health.v1 import health_pb2

    from specfleet_router.backends import HEALTH_SERVICE

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with h.text_worker() as w, h.router_over([w]) as r:
        w.server.health.set(HEALTH_SERVICE, not_serving)
        end = time.monotonic() + 5
        while r.ready_counts()["stable"]:
            assert time.monotonic() < end, "NOT_SERVING was not seen"
            time.sleep(0.02)
        with pytest.raises(openai.InternalServerError) as e:
            h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503
        w.server.health.set(HEALTH_SERVICE, serving)
        r.wait_ready(stable=1, timeout_s=5)
        assert h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=2).usage


def test_backends_follow_discovery_updates(h):
    """What the Kubernetes discovery will do (EndpointSlices change): a worker joins, another leaves."""
    import asyncio

    class Changing:
        def __init__(self):
            self.updates = None  # made on the router's loop

        async def watch(self):
            self.updates = asyncio.Queue()
            while True:
                yield await self.updates.get()

    with h.text_worker() as w1, h.text_worker() as w2:
        discovery = Changing()
        with h.router_over(discovery=discovery) as r:
            def publish(targets):
                r.loop.call_soon_threadsafe(discovery.updates.put_nowait, targets)

            def wait_for_ready(targets):
                end = time.monotonic() + 5
                while True:
                    ready = {b.target for b in r.server.backends.pools["stable"].backends if b.healthy}
                    if ready == set(targets):
                        return
                    assert time.monotonic() < end, (ready, targets)
                    time.sleep(0.02)

            while discovery.updates is None:
                time.sleep(0.01)
            publish({"stable": [h.target(w1)]})
            wait_for_ready([h.target(w1)])
            publish({"stable": [h.target(w1), h.target(w2)]})
            wait_for_ready([h.target(w1), h.target(w2)])
            publish({"stable": [h.target(w2)]})
            wait_for_ready([h.target(w2)])
            before = w2.stats().requests_total
            for _ in range(3):
                h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=1)
            assert w2.stats().requests_total == before + 3
            assert r.metric("specfleet_router_backend_ready", {"arm": "stable", "backend": h.target(w1)}) == 0
            assert 'backend="' + h.target(w1) not in r.get("/metrics")[1]  # its series are gone
