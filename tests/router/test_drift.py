"""The drift check with real workers as the two arms: a canary that runs the stable model agrees on
every mirrored greedy pair and scores the client's sampled tokens the same; a canary that runs
another model is caught, with the first request that differed; the client never sees a mirror nor
waits for one, and a mirror beyond the bound is dropped and counted."""
from __future__ import annotations

import time

import pytest

from specfleet_api.live_state import LiveState, Routing, state_key
from specfleet_api.windows import DriftCounts, read_drift
from specfleet_engine.engine import Engine
from specfleet_engine.proposers.ngram import NgramProposer
from specfleet_engine.testing import tiny_model
from specfleet_worker.testing import CharTokenizer, running_worker, wait_for

KEY = state_key("default", "specfleet")
PERIOD_S = 0.2
PROMPTS = ["Tell me about owls", "Hyvää huomenta, kuinka voit?", "def add(a, b): return a + b",
           "What is the capital of France?", "Write a haiku about rain", "List three prime numbers"]


@pytest.fixture(scope="module")
def stable(h):
    with h.text_worker() as w:
        yield w


@pytest.fixture(scope="module")
def twin(h):
    """The same model as stable: a canary that changes nothing."""
    with h.text_worker() as w:
        yield w


@pytest.fixture(scope="module")
def other_model():
    """A canary with another model (another seed of the tiny model): its outputs differ."""
    engine = Engine(tiny_model(seed=1, scale=4.0), CharTokenizer(), proposers={"ngram": NgramProposer()},
                    k_policy="fixed")
    with running_worker(engine) as w:
        yield w


def ask(h, r, prompt: str, rid: str, temperature: float = 0.0, stream: bool = False, session: str = "s"):
    """One chat request: (its answer's text, its headers, seconds it took)."""
    c = h.client(r)
    start = time.monotonic()
    headers = {"x-request-id": rid, "x-session-id": session}
    kw = dict(model="specfleet", messages=[{"role": "user", "content": prompt}], max_tokens=12,
              temperature=temperature, extra_body={"ignore_eos": True}, extra_headers=headers)
    if stream:
        with c.chat.completions.with_streaming_response.create(stream=True, **kw) as raw:
            text = "".join(line for line in raw.iter_lines())
            return text, raw.headers, time.monotonic() - start
    raw = c.chat.completions.with_raw_response.create(**kw)
    return raw.parse().choices[0].message.content, raw.headers, time.monotonic() - start


def drift_now(r) -> dict[str, DriftCounts]:
    return r.call(_current(r.server.drift))


async def _current(drift):
    return drift.current()


def test_a_canary_running_the_stable_model_agrees_on_every_mirrored_pair(h, stable, twin, redis_server):
    db = redis_server.client()
    db.set(KEY, LiveState().next(canary_weight=50.0, drift_epoch="run-1", mirror_share=100.0).to_json())
    # room for every pair: on a loaded machine mirrors fall behind the sequential clients, and a
    # dropped pair would never be counted
    with h.router_over([stable], [twin], redis_url=redis_server.url, router_name="r-drift",
                       fleet_publish_s=PERIOD_S, mirror_concurrency=64) as r:
        arms = set()
        for i, prompt in enumerate(PROMPTS * 2):
            _, headers, _ = ask(h, r, prompt, f"g-{i}", stream=i % 3 == 0, session=f"user-{i}")
            arms.add(headers["x-specfleet-arm"])
        assert arms == {"stable", "canary"}  # pairs mirrored both ways: stable to canary and canary to stable
        n = len(PROMPTS) * 2
        wait_for(lambda: {k: d.pairs for k, d in read_drift(db, "default", "specfleet", "run-1").items()}
                 == {"canary": n, "control": n}, 30.0, "every greedy pair in Redis")
        counts = read_drift(db, "default", "specfleet", "run-1")
        assert counts["canary"].agree == n and counts["control"].agree == n, counts
        assert counts["canary"].first_diff is None and counts["control"].first_diff is None
        assert r.metric("specfleet_router_drift_pairs_total", {"kind": "canary", "result": "agree"}) == n
        assert r.metric("specfleet_router_drift_pairs_total", {"kind": "canary", "result": "differ"}) == 0

        # sampled requests: the client's tokens, scored teacher-forced on both arms, score the same
        for i, prompt in enumerate(PROMPTS):
            ask(h, r, prompt, f"s-{i}", temperature=1.0, session=f"user-{i}")
        wait_for(lambda: drift_now(r)["canary"].scored == len(PROMPTS) and drift_now(r)["control"].scored
                 == len(PROMPTS), 30.0, "every sampled pair scored")
        for kind, d in drift_now(r).items():
            assert d.logprob_tokens == 12 * len(PROMPTS), kind
            assert abs(d.logprob_diff_sum) < 1e-3 and d.logprob_diff_sq_sum < 1e-5, (kind, d)


def test_a_canary_running_another_model_is_caught_with_the_first_request_that_differed(
        h, stable, other_model, redis_server):
    db = redis_server.client()
    first = LiveState().next(drift_epoch="run-2", mirror_share=100.0)
    db.set(KEY, first.to_json())
    with h.router_over([stable], [other_model], redis_url=redis_server.url, router_name="r-drift",
                       fleet_publish_s=PERIOD_S, mirror_concurrency=64) as r:
        answers, first_differed = [], None
        for i, prompt in enumerate(PROMPTS):
            answers.append(ask(h, r, prompt, f"req-{i}")[0])
            wait_for(lambda: [d.pairs for d in drift_now(r).values()] == [i + 1, i + 1], 30.0, f"pairs of request {i}")
            if first_differed is None and drift_now(r)["canary"].agree < i + 1:
                first_differed = f"req-{i}"
        counts = drift_now(r)
        canary, control = counts["canary"], counts["control"]
        assert (canary.pairs, control.pairs, control.agree) == (len(PROMPTS), len(PROMPTS), len(PROMPTS))
        assert canary.agree < len(PROMPTS)
        diff = canary.first_diff
        assert diff["request_id"] == first_differed
        assert diff["a"] != diff["b"] and diff["position"] >= 0
        # the client's answers are stable's own, whatever the mirror said
        with h.router_over([stable]) as plain:
            assert [ask(h, plain, p, f"p-{i}")[0] for i, p in enumerate(PROMPTS)] == answers

        for i, prompt in enumerate(PROMPTS):
            ask(h, r, prompt, f"sampled-{i}", temperature=1.0)
        wait_for(lambda: [d.scored for d in drift_now(r).values()] == [len(PROMPTS)] * 2, 30.0,
                 "the sampled pairs scored")
        canary, control = drift_now(r)["canary"], drift_now(r)["control"]
        assert canary.logprob_diff_sq_sum > 1.0 and abs(control.logprob_diff_sum) < 1e-3

        # a new canary run starts from zero
        db.set(KEY, first.next(drift_epoch="run-3").to_json())
        wait_for(lambda: read_drift(db, "default", "specfleet", "run-3")
                 == {k: DriftCounts("run-3") for k in ("canary", "control")}, 5.0, "the new epoch's counts")
        assert read_drift(db, "default", "specfleet", "run-2") == {}


def test_a_slow_mirror_never_delays_the_client_and_one_beyond_the_bound_is_dropped(h, stable):
    with h.text_worker(proposers={"slow": h.SlowProposer(0.5)}) as slow_canary, \
            h.router_over([stable], [slow_canary], mirror_concurrency=1) as r:
        before = [ask(h, r, p, f"before-{i}") for i, p in enumerate(PROMPTS[:3])]
        # the canary's own table sends its requests (the mirrors) to the slow proposer
        r.server.state.current = LiveState(drift_epoch="run-4", mirror_share=100.0, arms={"canary": Routing("slow")})
        after = [ask(h, r, p, f"after-{i}") for i, p in enumerate(PROMPTS[:3])]
        assert r.server.drift.running == 1  # the first mirror is still in its first slow step
        assert [a[0] for a in after] == [b[0] for b in before]
        assert max(a[2] for a in after) < 0.5, [a[2] for a in after]
        assert {a[1]["x-specfleet-arm"] for a in after} == {"stable"}
        dropped = r.metric("specfleet_router_drift_dropped_total", {"kind": "canary", "reason": "busy"})
        assert dropped == 2  # the second and third came while the first's mirror ran
        wait_for(lambda: drift_now(r)["canary"].pairs == 1, 30.0, "the slow mirror's pair")
