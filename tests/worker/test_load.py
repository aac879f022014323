"""The serving bar under load: exact greedy results at 16 clients, cancellation without leaks,
admission control (RESOURCE_EXHAUSTED beyond the queue) and deadlines."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specfleet_engine.proposers import NgramProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_proto import worker_pb2_grpc as pb_grpc
from specfleet_worker.testing import SlowProposer, pb, running_worker, tiny_engine, wait_idle


def make_prompts(n: int, seed: int = 1) -> list[list[int]]:
    """Prompts with repeats in them, so that n-gram drafts are proposed (and sometimes accepted)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(0, 110) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(0, 110) for _ in range(rng.randint(1, 20))]
        out.append((noise + motif * rng.randint(1, 4) + noise[:3])[:60])
    return out


def expected_outputs(prompts, max_tokens) -> list[list[int]]:
    """Each prompt alone on a fresh engine, without speculation: the reference."""
    engine = tiny_engine()
    return [engine.generate(p, SamplingParams(max_tokens=m), method="none").output
            for p, m in zip(prompts, max_tokens)]


def test_200_requests_from_16_clients_match_single_runs():
    n = 200
    prompts = make_prompts(n)
    rng = random.Random(2)
    max_tokens = [rng.randint(1, 40) for _ in range(n)]
    methods = [rng.choice(["ngram", "none", "auto", ""]) for _ in range(n)]
    expected = expected_outputs(prompts, max_tokens)
    with running_worker(max_batch_size=8, max_queue=16) as r:

        def one(i: int):
            req = pb.GenerateRequest(prompt_token_ids=prompts[i], max_tokens=max_tokens[i],
                                     speculation_method=methods[i], request_id=f"load-{i}")
            if i % 2:
                return i, list(r.gen.Generate(req, timeout=60).token_ids)
            return i, [t for msg in r.gen.GenerateStream(req, timeout=60) for t in msg.token_ids]

        with ThreadPoolExecutor(16) as pool:
            results = dict(pool.map(one, range(n)))
        stats = wait_idle(r)
    mismatches = [i for i in range(n) if results[i] != expected[i]]
    assert not mismatches, f"{len(mismatches)} requests differ from single runs, first {mismatches[:5]}"
    assert (stats.queue_depth, stats.running, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.requests_total == n and stats.rejected_total == 0
    assert stats.num_drafts > 0  # speculation really ran alongside plain decoding


def test_cancelling_a_tenth_of_the_streams_leaves_the_others_exact_and_nothing_leaked():
    n = 40
    prompts = make_prompts(n, seed=3)
    cancel = set(range(0, n, 10))
    with running_worker(max_batch_size=16, max_queue=64) as r:

        def one(i: int):
            req = pb.GenerateRequest(prompt_token_ids=prompts[i], max_tokens=120, ignore_eos=True)
            call = r.gen.GenerateStream(req, timeout=60)
            got = []
            try:
                for msg in call:
                    got += msg.token_ids
                    if i in cancel and len(got) >= 5:
                        call.cancel()
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED
                return i, None
            return i, got

        with ThreadPoolExecutor(16) as pool:
            results = dict(pool.map(one, range(n)))
        stats = wait_idle(r)
        aborts = r.worker.scheduler.metrics.registry.get_sample_value(
            "spec_decode_requests_total", {"model": "tiny-random", "finish_reason": "abort"})
    assert all(results[i] is None for i in cancel)
    engine_ref = tiny_engine()
    for i in set(range(n)) - cancel:
        want = engine_ref.generate(prompts[i], SamplingParams(max_tokens=120, ignore_eos=True), method="none").output
        assert results[i] == want, i
    assert (stats.queue_depth, stats.running, stats.kv_blocks_used) == (0, 0, 0)
    assert aborts == len(cancel)




def test_overload_rejects_exactly_the_requests_beyond_one_running_and_one_queued():
    engine = tiny_engine(proposers={"slow": SlowProposer(0.01)})
    with running_worker(engine, max_batch_size=1, max_queue=1) as r:
        barrier = threading.Barrier(10)

        def one(i: int):
            barrier.wait()
            try:
                resp = r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 1, 2], max_tokens=150,
                                                         ignore_eos=True, speculation_method="slow"), timeout=60)
                return len(resp.token_ids)
            except grpc.RpcError as e:
                return e.code()

        with ThreadPoolExecutor(10) as pool:
            outcomes = list(pool.map(one, range(10)))
        stats = wait_idle(r)
    assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 8, outcomes
    assert outcomes.count(150) == 2, outcomes
    assert stats.rejected_total == 8 and stats.requests_total == 2


def test_a_deadline_ends_the_request_and_frees_its_blocks():
    engine = tiny_engine(proposers={"slow": SlowProposer(0.01)})
    with running_worker(engine) as r:
        with pytest.raises(grpc.RpcError) as e:
            r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True,
                                              speculation_method="slow"), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stats = wait_idle(r)
        assert (stats.running, stats.kv_blocks_used) == (0, 0)
        # and it still serves
        assert len(r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=3,
                                                     ignore_eos=True)).token_ids) == 3


def test_a_failing_proposer_degrades_to_plain_decoding_and_is_counted():
    class Broken(NgramProposer):
        name = "broken"

        def propose(self, seqs, ks):
            raise RuntimeError("draft model fell over")

    engine = tiny_engine(proposers={"broken": Broken()})
    prompt = [4, 5, 6, 4, 5, 6, 4]
    want = tiny_engine().generate(prompt, SamplingParams(max_tokens=20), method="none").output
    with running_worker(engine) as r:
        resp = r.gen.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=20, speculation_method="broken"))
        stats = r.stats()
    assert list(resp.token_ids) == want
    assert resp.speculation.draft_errors > 0 and stats.draft_errors == resp.speculation.draft_errors
    assert stats.failed_total == 0


def test_a_client_that_disconnects_mid_stream_frees_its_blocks():
    engine = tiny_engine(proposers={"slow": SlowProposer(0.005)})
    with running_worker(engine) as r:
        other = grpc.insecure_channel(f"127.0.0.1:{r.server.grpc_port}")
        stream = pb_grpc.GenerationStub(other).GenerateStream(pb.GenerateRequest(
            prompt_token_ids=[9, 8, 7], max_tokens=400, ignore_eos=True, speculation_method="slow"))
        next(stream)
        assert r.stats().kv_blocks_used > 0
        other.close()  # the client goes away without a word
        stats = wait_idle(r)
        assert (stats.running, stats.kv_blocks_used) == (0, 0)
        assert r.worker.scheduler.metrics.registry.get_sample_value(
            "spec_decode_requests_total", {"model": "tiny-random", "finish_reason": "abort"}) == 1
