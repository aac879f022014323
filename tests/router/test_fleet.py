"""Prompt clusters and probes at a running router in front of a real worker, with the live state
and the published windows in a real Redis: a cluster in fallback runs plain decoding while the rest
of its prompt type keeps speculating, its probes still speculate, and each cluster's window shows
up in Redis with the counts the responses carried. Redis away never holds a request up."""
from __future__ import annotations

import logging
import random
import time

import grpc
import pytest

from specfleet_api.live_state import LiveState, state_key
from specfleet_api.windows import cluster_key, read_cluster_windows
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc
from specfleet_router.dispatch import draw
from specfleet_router.testing import finnish_prose, python_code
from specfleet_worker.testing import wait_for

ROUTER = "r-test"
KEY = state_key("default", "specfleet")
PERIOD_S = 0.2


@pytest.fixture(scope="module")
def worker(h):
    with h.text_worker() as w:
        yield w


def chat(stub, text: str, rid: str) -> tuple[pb.GenerateResponse, dict]:
    """One greedy chat request of prompt type chat through the router's gRPC front."""
    req = pb.GenerateRequest(request_id=rid, messages=[pb.ChatMessage(role="user", content=text)],
                             prompt_type="chat", max_tokens=16, ignore_eos=True, temperature=0.0)
    resp, call = stub.Generate.with_call(req, timeout=30)
    return resp, dict(call.initial_metadata())


def test_a_cluster_in_fallback_runs_plain_except_its_probes_and_windows_reach_redis(h, worker, redis_server):
    db = redis_server.client()
    state = LiveState().next(fallback_clusters=(f"{ROUTER}/1",))
    db.set(KEY, state.to_json())
    rng = random.Random(5)
    # at 0.3 each kind is one cluster for this seed (the default, 0.35, may split the prose in two)
    with h.router_over([worker], redis_url=redis_server.url, router_name=ROUTER, fleet_publish_s=PERIOD_S,
                       cluster_similarity=0.3) as r, grpc.insecure_channel(r.grpc_target) as ch:
        stub = pb_grpc.GenerationStub(ch)
        # the first prompt of each kind opens the cluster: Python code r-test/0, Finnish prose r-test/1
        seen: dict[str, list[tuple[pb.GenerateResponse, dict]]] = {"python": [], "finnish": []}
        for i in range(6):
            seen["python"].append(chat(stub, python_code(rng), f"py-{i}"))
            seen["finnish"].append(chat(stub, finnish_prose(rng), f"fi-{i}"))
        assert {md["x-specfleet-cluster"] for _, md in seen["python"]} == {f"{ROUTER}/0"}
        assert {md["x-specfleet-cluster"] for _, md in seen["finnish"]} == {f"{ROUTER}/1"}
        # the same prompt type, two methods: the cluster in fallback alone runs plain
        assert {md["x-specfleet-prompt-type"] for k in seen for _, md in seen[k]} == {"chat"}
        assert {(md["x-specfleet-method"], resp.speculation.method) for resp, md in seen["python"]} == {("ngram", "ngram")}
        assert {(md["x-specfleet-method"], resp.speculation.method) for resp, md in seen["finnish"]} == {("none", "none")}
        assert not any("x-specfleet-probe" in md for k in seen for _, md in seen[k])
        drafted = sum(resp.speculation.num_draft_tokens for resp, _ in seen["python"])
        accepted = sum(resp.speculation.num_accepted_tokens for resp, _ in seen["python"])
        assert drafted > 0  # the speculating cluster did draft: its counts below are not zeros by accident

        def windows():
            return read_cluster_windows(db, "default", "specfleet")

        wait_for(lambda: {c: w.requests for c, w in windows().items()} == {f"{ROUTER}/0": 6, f"{ROUTER}/1": 6}, 5.0,
                 "the cluster windows in Redis")
        windows = windows()
        py, fi = windows[f"{ROUTER}/0"], windows[f"{ROUTER}/1"]
        assert (py.prompt_type, py.requests, py.spec_requests, py.draft_tokens, py.accepted_tokens) == \
            ("chat", 6, 6, drafted, accepted)
        assert (fi.prompt_type, fi.requests, fi.spec_requests, fi.draft_tokens, fi.accepted_tokens) == ("chat", 6, 0, 0, 0)
        assert 0 < db.pttl(cluster_key("default", "specfleet", ROUTER)) <= 3 * PERIOD_S * 1000

        # probes: half of the cluster's requests, chosen by their ids, speculate with the method named
        db.set(KEY, state.next(probe_share=50.0).to_json())
        wait_for(lambda: r.server.state.current.probe_share == 50.0, 5.0, "the probe share")
        rids = [f"probe-{i}" for i in range(30)]
        expected = {rid for rid in rids if draw(rid, "probe") < 50.0}
        assert 5 < len(expected) < 25
        got = {rid: chat(stub, finnish_prose(rng), rid) for rid in rids}
        assert {rid for rid, (_, md) in got.items() if md.get("x-specfleet-probe") == "1"} == expected
        assert {(md["x-specfleet-method"], resp.speculation.method) for rid, (resp, md) in got.items()
                if rid in expected} == {("ngram", "ngram")}
        assert {md["x-specfleet-method"] for rid, (_, md) in got.items() if rid not in expected} == {"none"}
        assert {md["x-specfleet-cluster"] for _, md in got.values()} == {f"{ROUTER}/1"}
        assert r.metric("specfleet_router_probes_total", {"prompt_type": "chat"}) == len(expected)
        wait_for(lambda: read_cluster_windows(db, "default", "specfleet")[f"{ROUTER}/1"].spec_requests
                 == len(expected), 5.0, "the probes in the cluster's window")

        # the HTTP front routes by cluster too
        raw = h.client(r).chat.completions.with_raw_response.create(
            model="specfleet", max_tokens=2, messages=[{"role": "user", "content": python_code(rng)}])
        assert raw.headers["x-specfleet-cluster"] == f"{ROUTER}/0"


def test_redis_away_never_holds_a_request_and_is_reported_once(h, worker, redis_server, caplog):
    caplog.set_level(logging.INFO, logger="specfleet.router.fleet")
    with h.router_over([worker], redis_url=redis_server.url, router_name=ROUTER, fleet_publish_s=PERIOD_S) as r, \
            grpc.insecure_channel(r.grpc_target) as ch:
        stub = pb_grpc.GenerationStub(ch)
        chat(stub, python_code(random.Random(1)), "warm")
        redis_server.kill()
        took = []
        for i in range(10):
            start = time.monotonic()
            chat(stub, python_code(random.Random(i)), f"away-{i}")
            took.append(time.monotonic() - start)
        wait_for(lambda: r.metric("specfleet_router_fleet_publish_errors_total") >= 3, 10.0, "three failed publishes")
    warnings = [rec for rec in caplog.records if rec.name == "specfleet.router.fleet" and rec.levelno == logging.WARNING]
    assert len(warnings) == 1, [rec.getMessage() for rec in warnings]
    assert max(took) < 1.0, took  # a publish that waits on Redis would hold requests for its 1 s timeout


def test_streamed_answers_count_in_their_clusters_window_from_the_last_message(h, worker):
    with h.router_over([worker], router_name=ROUTER) as r, grpc.insecure_channel(r.grpc_target) as ch:
        stub = pb_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=python_code(random.Random(0)))],
                                 prompt_type="code", max_tokens=16, ignore_eos=True, temperature=0.0)
        lasts = [list(stub.GenerateStream(req, timeout=30))[-1] for _ in range(3)]
        http = h.client(r).chat.completions.create(model="specfleet", max_tokens=16, stream=True,
                                                   messages=[{"role": "user", "content": python_code(random.Random(0))}])
        assert [c for c in http]

        async def snapshot():
            return r.server.windows.snapshot()

        windows = r.call(snapshot())
    code = windows[f"{ROUTER}/0"]
    assert code.prompt_type == "code" and code.requests == 4 and code.spec_requests == 4
    assert code.draft_tokens >= sum(m.speculation.num_draft_tokens for m in lasts) > 0
    # the stable arm's speculating requests, by method, with their own speedups (what the loop
    # chooses a cluster's method on)
    [(method, counts)] = code.methods.items()
    assert method == lasts[0].speculation.method and counts.requests == 4 and counts.draft_tokens == code.draft_tokens
    assert counts.speedups == 4 and counts.busy_seconds > 0 and counts.plain_seconds > 0
