"""Fleet windows in Redis: per (deployment, arm, prompt type) counts of a worker's requests, with
the numbers its responses report, expiring when the worker stops publishing; a real redis-server."""
from __future__ import annotations

import dataclasses
import doctest
import json
import math
import time

import pytest

import grpc

from specfleet_api.live_state import LiveState
from specfleet_api.windows import (TPOT_BUCKETS, TTFT_BUCKETS, TypeCounts, bucket_of, parse_window, read_all_windows,
                                   read_windows)
from specfleet_worker import fleet
from specfleet_api.windows import Windows
from specfleet_worker.fleet import FleetPublisher
from specfleet_worker.live import redis_client
from specfleet_worker.main import main as serve_main
from specfleet_worker.metrics import Metrics
from specfleet_worker.testing import TINY, pb, running_worker

KEY = "specfleet:v1:default/demo:window:canary:pod-a"
RPC_S = 30


def test_docstring_examples():
    assert doctest.testmod(fleet).failed == 0


@pytest.fixture
def canary():
    with running_worker(cfg=dataclasses.replace(TINY, role="canary")) as r:
        yield r


def run(r, prompt_type: str, method: str, prompt: list[int], max_tokens: int,
        probe: bool = False) -> pb.GenerateResponse:
    return r.gen.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                             prompt_type=prompt_type, speculation_method=method, probe=probe),
                          timeout=RPC_S)


def test_a_workers_window_has_the_numbers_of_its_requests_for_two_prompt_types(canary, redis_server):
    r = canary
    pub = FleetPublisher(redis_client(redis_server.url), r.worker, name="pod-a", deployment=("default", "demo"))
    code = [run(r, "code", "ngram", [5, 6, 7, 8] * 4 + [5, 6], 40),
            run(r, "code", "ngram", [1, 2, 3] * 5, 30),
            run(r, "code", "ngram", [9, 4, 9, 4, 9, 4], 20)]
    chat = [run(r, "chat", "none", [3, 1, 4, 1, 5, 9, 2, 6], 12), run(r, "chat", "none", [2, 7, 1, 8], 9)]
    assert sum(x.speculation.num_accepted_tokens for x in code) > 0  # drafts were accepted: a real test of them
    assert pub.publish_once()

    client = redis_server.client()
    raw = client.hgetall(KEY)
    # each prompt type's window, and one per (type, method) its requests ran
    assert set(raw) == {b"code", b"chat", b"code@ngram", b"chat@none"}
    assert 0 < client.ttl(KEY) <= 15 and 0 < client.ttl("specfleet:v1:default/demo:worker:pod-a") <= 15
    got = {t.decode(): json.loads(v) for t, v in raw.items()}
    for name, responses in (("code", code), ("chat", chat)):
        w = got[name]
        s = [x.speculation for x in responses]
        assert w["requests"] == len(responses)
        assert w["output_tokens"] == sum(len(x.token_ids) for x in responses)
        assert w["steps"] == sum(x.num_steps for x in s)
        assert w["drafts"] == sum(x.num_drafts for x in s)
        assert w["draft_tokens"] == sum(x.num_draft_tokens for x in s)
        assert w["accepted_tokens"] == sum(x.num_accepted_tokens for x in s)
        assert w["ttft_count"] == w["tpot_count"] == len(responses)
        assert w["ttft_seconds_sum"] == pytest.approx(sum(x.time_to_first_token_s for x in responses))
        assert 0 < w["tpot_seconds_sum"] < sum(x.latency_s for x in responses)
        assert w["busy_seconds"] > 0 and w["plain_seconds"] > 0
        assert 0 < w["window_seconds"] < 60 and abs(w["updated"] - time.time()) < 60
        assert w["errors"] == 0
        ttft = [0] * (len(TTFT_BUCKETS) + 1)
        for x in responses:
            ttft[bucket_of(x.time_to_first_token_s, TTFT_BUCKETS)] += 1
        assert w["ttft_hist"] == ttft
        tpot = [0] * (len(TPOT_BUCKETS) + 1)
        for x in responses:  # first token to last, over the tokens after the first
            tpot[bucket_of((x.latency_s - x.time_to_first_token_s) / (len(x.token_ids) - 1), TPOT_BUCKETS)] += 1
        assert w["tpot_hist"] == tpot
    # one method per type here: each (type, method) window is its type's
    for name, method in (("code", "ngram"), ("chat", "none")):
        assert {k: v for k, v in got[f"{name}@{method}"].items() if k != "updated"} == \
            {k: v for k, v in got[name].items() if k != "updated"}
    # every request of code ran ngram, none of chat speculated: the spec_ fields are all or nothing
    assert got["code"]["spec_requests"] == 3 and got["chat"]["spec_requests"] == 0
    assert got["code"]["spec_busy_seconds"] == got["code"]["busy_seconds"]
    assert got["code"]["spec_plain_seconds"] == got["code"]["plain_seconds"]
    assert got["chat"]["spec_busy_seconds"] == got["chat"]["spec_plain_seconds"] == 0
    assert got["chat"]["drafts"] == 0
    # plain decoding priced as plain decoding: its two sides nearly agree (proposing nothing costs little)
    assert 0.8 < got["chat"]["plain_seconds"] / got["chat"]["busy_seconds"] <= 1.0 + 1e-9
    # every step's seconds are shared out whole: the types add up to the speedup meter's totals
    meter = r.worker.scheduler.speedup
    assert got["code"]["busy_seconds"] + got["chat"]["busy_seconds"] == pytest.approx(meter.total_actual)
    assert got["code"]["plain_seconds"] + got["chat"]["plain_seconds"] == pytest.approx(meter.total_plain)

    pub.stop()  # leaving the fleet: both keys go at once
    assert client.exists(KEY, "specfleet:v1:default/demo:worker:pod-a") == 0


def test_a_types_requests_are_windowed_by_the_method_they_ran_and_readers_split_the_two(canary, redis_server):
    """What the loop compares methods on: one type's requests under two methods, each method's
    window its own requests', the two adding up to the type's; `read_windows` sees types only."""
    r = canary
    pub = FleetPublisher(redis_client(redis_server.url), r.worker, name="pod-a", deployment=("default", "demo"))
    ngram = [run(r, "code", "ngram", [5, 6, 7, 8] * 4, 24), run(r, "code", "ngram", [1, 2, 3] * 5, 16)]
    plain = [run(r, "code", "none", [3, 1, 4, 1, 5, 9], 10)]
    assert pub.publish_once()
    client = redis_client(redis_server.url)
    types, methods = read_all_windows(client, "default", "demo", ("canary",))
    assert list(types["canary"]) == ["code"] and sorted(methods["canary"]["code"]) == ["ngram", "none"]
    assert read_windows(client, "default", "demo", ("canary",)) == types
    whole, by = types["canary"]["code"].counts, methods["canary"]["code"]
    assert by["ngram"].counts.requests == 2 and by["none"].counts.requests == 1
    assert by["ngram"].counts.draft_tokens == sum(x.speculation.num_draft_tokens for x in ngram) > 0
    assert by["none"].counts.draft_tokens == 0 and by["none"].counts.spec_requests == 0
    assert by["ngram"].counts.spec_speedups == 2
    # each request's own acceptance rate (what tells a shift in a type's traffic), as sums
    rates = [x.speculation.acceptance_rate for x in ngram]
    assert by["ngram"].counts.spec_alphas == 2 and by["none"].counts.spec_alphas == 0
    assert by["ngram"].counts.spec_alpha_sum == pytest.approx(sum(rates), abs=1e-6)
    assert by["ngram"].counts.spec_alpha_sq == pytest.approx(sum(a * a for a in rates), abs=1e-6)
    # acceptance by draft position: every drafting step reached the first, and each accepted token
    # is one step's accepted position
    c = by["ngram"].counts
    assert c.pos_drafted[0] == c.drafts > 0 and sum(c.pos_accepted) == c.accepted_tokens
    assert sum(c.pos_drafted) == c.draft_tokens and list(c.pos_drafted) == sorted(c.pos_drafted, reverse=True)
    assert by["ngram"].counts.plus(by["none"].counts).output_tokens == whole.output_tokens == 50
    assert by["ngram"].counts.busy_seconds + by["none"].counts.busy_seconds == pytest.approx(whole.busy_seconds)
    assert sum(len(x.token_ids) for x in plain) == 10
    pub.stop()


def test_the_loops_k_ceiling_holds_its_prompt_types_drafts_and_no_other_types():
    with running_worker() as r:
        r.worker.live.apply_live_state(LiveState(version=1, k_ceilings={"code": 1}), "stable")
        counts = r.worker.scheduler.metrics.counts_by_type
        for t in ("code", "chat"):
            run(r, t, "ngram", [5, 6, 7, 8] * 5, 40)
        code, chat = counts()["code"], counts()["chat"]
        assert code.drafts > 0 and code.pos_drafted[1] == 0  # one position a step at most
        assert chat.pos_drafted[1] > 0  # the deployment's kMax
        assert sum(chat.pos_accepted) == chat.accepted_tokens > 0 and chat.pos_accepted[1] > 0
        r.worker.live.apply_live_state(LiveState(version=2, k_ceilings={"code": 1}), "canary")  # stable's only
        assert r.worker.live.settings.k_ceilings == {}


def test_a_worker_that_stops_publishing_drops_out_and_redis_read_only_costs_no_request(canary, redis_server):
    r = canary
    pub = FleetPublisher(redis_client(redis_server.url), r.worker, name="pod-a", period_s=0.4,
                         deployment=("default", "demo"))
    assert pub.publish_once() and redis_server.client().exists(KEY) == 0  # no request yet, no window
    run(r, "math", "ngram", [1, 2, 3] * 4, 8)
    pub.start()
    client = redis_server.client()
    deadline = time.monotonic() + 5
    while not client.exists(KEY):
        assert time.monotonic() < deadline, "no window published within 5 s"
        time.sleep(0.05)
    assert json.loads(client.hget(KEY, "math"))["requests"] == 1
    redis_server.read_only(True)
    assert not pub.publish_once()  # refused, logged, never raised
    assert len(run(r, "math", "ngram", [4, 5] * 4, 8).token_ids) == 8
    redis_server.read_only(False)
    assert pub.publish_once() and json.loads(client.hget(KEY, "math"))["requests"] == 2
    pub._stop.set()  # the worker dies: it neither publishes nor cleans up
    pub._thread.join(5)
    deadline = time.monotonic() + 5
    while client.exists(KEY):  # the TTL is three periods (1.2 s here, whole seconds in Redis)
        assert time.monotonic() < deadline, "the window of a dead worker did not expire within 5 s"
        time.sleep(0.05)


def test_a_window_slides_over_the_last_window_s_of_running_totals():
    now, totals = [0.0], {"code": TypeCounts(requests=1, busy_seconds=1.0)}
    w = Windows(lambda: {t: dataclasses.replace(c) for t, c in totals.items()}, window_s=60, clock=lambda: now[0])

    def at(t: float, **counts) -> tuple[float, dict]:
        now[0] = t
        for name, c in counts.items():
            totals[name] = c
        return w.take()

    seconds, win = at(30, code=TypeCounts(requests=3, busy_seconds=4.0))
    assert seconds == 30 and win["code"] == TypeCounts(requests=2, busy_seconds=3.0)
    seconds, win = at(70, code=TypeCounts(requests=5, busy_seconds=5.0), chat=TypeCounts(requests=1))
    assert seconds == 70 and win["code"].requests == 4 and win["chat"].requests == 1  # a new type: all of it
    seconds, win = at(100, code=TypeCounts(requests=6, busy_seconds=5.0))
    assert seconds == 70 and win["code"].requests == 3  # since t=30: the last record at least 60 s old
    seconds, win = at(200)
    assert seconds == 100 and win["code"].requests == 0 and win["chat"].requests == 0


def test_in_fallback_the_spec_fields_hold_the_probes_alone(redis_server):
    with running_worker(cfg=dataclasses.replace(TINY, by_prompt_type={"code": "ngram"})) as r:
        r.worker.live.apply_live_state(LiveState(version=1, speculate=False), "stable")  # the soft off
        pub = FleetPublisher(redis_client(redis_server.url), r.worker, name="pod-a", deployment=("default", "demo"))
        counts = r.worker.scheduler.metrics.counts_by_type
        probe = run(r, "code", "ngram", [7] * 10, 40, probe=True)
        assert probe.speculation.num_draft_tokens > 0
        after_probe = counts()["code"]
        plain = run(r, "code", "ngram", [7] * 10, 40)
        assert plain.speculation.method == "none"
        c = counts()["code"]
        assert (c.requests, c.spec_requests) == (2, 1)
        assert c.busy_seconds > after_probe.busy_seconds  # the plain request's steps count in the whole
        assert c.spec_busy_seconds == after_probe.busy_seconds == after_probe.spec_busy_seconds
        assert c.spec_plain_seconds == after_probe.plain_seconds
        # one speedup per speculating request: the probe's own, the plain request's none
        assert c.spec_speedups == 1 and c.spec_log_speedup_sum == pytest.approx(
            math.log(after_probe.plain_seconds / after_probe.busy_seconds))
        assert c.spec_log_speedup_sq == pytest.approx(c.spec_log_speedup_sum ** 2)
        assert pub.publish_once()
        w = parse_window(redis_server.client().hget("specfleet:v1:default/demo:window:stable:pod-a", "code"))
        assert w.counts.spec_requests == 1
        assert w.spec_speedup == pytest.approx(after_probe.plain_seconds / after_probe.busy_seconds)
        pub.stop()
        r.admin.UpdateConfig(pb.UpdateConfigRequest(k_min=0, k_max=0))  # a draft method, but no room to draft
        assert run(r, "code", "ngram", [7] * 10, 20, probe=True).speculation.method == "ngram"
        c2 = counts()["code"]
        assert (c2.requests, c2.spec_requests, c2.spec_busy_seconds) == (3, 1, c.spec_busy_seconds)
        assert c2.spec_speedups == 1


def test_latencies_count_in_the_windows_buckets():
    m = Metrics("m", "none")
    m.finished("code", "stop", 5, 1.0, ttft_s=0.03, tpot_s=0.007)
    m.finished("code", "stop", 1, 1.0, ttft_s=99.0, tpot_s=None)
    c = m.counts_by_type()["code"]
    assert c.ttft_hist == (0, 0, 1) + (0,) * 8 + (1,)  # (0.025, 0.05] and above the last bound
    assert c.tpot_hist == (0, 0, 1) + (0,) * 9  # (0.005, 0.01]


def test_a_request_that_fails_inside_the_worker_counts_as_an_error_of_its_type():
    with running_worker() as r:
        engine_step = r.engine.step
        calls = []

        def failing_step():
            calls.append(1)
            if len(calls) == 2:  # the first decoding step of the request
                raise RuntimeError("the accelerator fell off the bus")
            return engine_step()

        r.engine.step = failing_step
        with pytest.raises(grpc.RpcError) as e:
            run(r, "math", "ngram", [1, 2, 3] * 4, 8)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        ok = run(r, "math", "ngram", [1, 2, 3] * 4, 8)
        assert len(ok.token_ids) == 8
        c = r.worker.scheduler.metrics.counts_by_type()["math"]
        assert (c.errors, c.requests) == (1, 1)
        with pytest.raises(grpc.RpcError) as e:  # refused at the door: the caller's doing, not an error
            r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1], max_tokens=0, prompt_type="math"), timeout=RPC_S)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert r.worker.scheduler.metrics.counts_by_type()["math"].errors == 1


def test_the_window_length_is_SPECFLEET_FLEET_WINDOW_S(monkeypatch, redis_server):
    monkeypatch.delenv("SPECFLEET_FLEET_WINDOW_S", raising=False)
    assert fleet.window_from_env() == 60.0
    for bad in ("abc", "0", "-5", "nan", "inf", "1e999"):
        monkeypatch.setenv("SPECFLEET_FLEET_WINDOW_S", bad)
        with pytest.raises(ValueError, match=f"SPECFLEET_FLEET_WINDOW_S: '{bad}' is not a positive number"):
            fleet.window_from_env()
    monkeypatch.setenv("SPECFLEET_FLEET_WINDOW_S", "0.3")
    monkeypatch.setenv("SPECFLEET_REDIS_URL", redis_server.url)
    monkeypatch.setenv("SPECFLEET_DEPLOYMENT", "default/demo")
    with running_worker() as r:
        pub = FleetPublisher.from_env(r.worker, name="pod-a")
        run(r, "math", "ngram", [1, 2, 3] * 4, 8)

        def window() -> dict:
            assert pub.publish_once()
            return json.loads(redis_server.client().hget("specfleet:v1:default/demo:window:stable:pod-a", "math"))

        assert window()["requests"] == 1
        time.sleep(0.4)
        window()
        time.sleep(0.4)
        w = window()  # 0.3 s on: the request has left the window (it would stay for 60 s by default)
        assert w["requests"] == 0 and 0.3 <= w["window_seconds"] < 0.8
        pub.stop()


def test_a_bad_window_length_is_a_bad_configuration(monkeypatch, capsys):
    monkeypatch.setenv("SPECFLEET_FLEET_WINDOW_S", "sixty")
    assert serve_main(["--grpc-port", "0", "--http-port", "0"]) == 2
    rec = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert rec["msg"] == "bad configuration" and "SPECFLEET_FLEET_WINDOW_S" in rec["error"]
