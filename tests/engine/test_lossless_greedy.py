"""Greedy speculative decoding must be token-identical to the engine's own plain decoding."""

import pytest
import torch

from specfleet_engine.engine import Engine
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import tiny_model

CONFIGS = {
    "llama": dict(),
    "qwen2-bias": dict(attention_bias=True, architecture="qwen2", tie_word_embeddings=False),
    "mistral-window": dict(sliding_window=24, architecture="mistral"),
    "mha-rope-llama3": dict(n_kv_heads=4, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                          "original_max_position_embeddings": 64}),
}


def prompts(n, seed=0, vocab=100):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(base * (1 + i % 3) + base[: i % 4])  # repeats give the n-gram something to find
    return out


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ngram_and_draft_model_match_plain_decoding(config):
    target = tiny_model(seed=1, scale=4.0, **CONFIGS[config])
    draft = tiny_model(seed=2, scale=4.0, **CONFIGS[config])
    proposers = {"ngram": NgramProposer(), "draft-model": DraftModelProposer(draft)}
    engine = Engine(target, proposers=proposers, max_kv_tokens=4096, block_size=8, k_policy="fixed")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    accepted = 0
    for prompt in prompts(3):
        plain = engine.generate(prompt, params, "none").output
        assert len(plain) == 24
        for k in range(1, 9):
            for method in ("ngram", "draft-model"):
                seq = engine.generate(prompt, params, method, k)
                assert seq.output == plain, (method, k)
                accepted += seq.stats.num_accepted_tokens
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise verification"
    assert engine.cache.allocator.num_used == 0
    assert proposers["draft-model"].cache.allocator.num_used == 0


def test_batched_speculation_matches_single_requests():
    target = tiny_model(seed=3, scale=4.0)
    engine = Engine(target, proposers={"ngram": NgramProposer(),
                                       "draft-model": DraftModelProposer(tiny_model(seed=4, scale=4.0))})
    engine.costs.seconds.update({r: 1.0 + 0.1 * (r - 1) for r in range(1, 64)})  # cheap drafts: adaptive K drafts
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ps = prompts(8, seed=5)
    expected = [engine.generate(p, params, "none").output for p in ps]
    methods = ["none", "ngram", "draft-model"]
    seqs = [engine.add(p, params, methods[i % 3], k=1 + i % 7) for i, p in enumerate(ps)]
    while not all(s.finished for s in seqs):
        engine.step()
        # a request joins mid-flight: continuous batching
        if len(seqs) == len(ps):
            seqs.append(engine.add(ps[0], params, "ngram", 3))
    assert [s.output for s in seqs[: len(ps)]] == expected
    assert seqs[-1].output == expected[0]
    assert sum(s.stats.num_draft_tokens for s in seqs) > 0, "adaptive K never drafted"
    assert engine.cache.allocator.num_used == 0


def test_eos_max_tokens_and_logprobs_inside_verification():
    target = tiny_model(seed=1, scale=4.0)
    engine = Engine(target, k_policy="fixed")
    prompt = prompts(1, seed=9)[0]
    plain = engine.generate(prompt, SamplingParams(max_tokens=25, ignore_eos=True, logprobs=True), "none")
    spec = engine.generate(prompt, SamplingParams(max_tokens=25, ignore_eos=True, logprobs=True), "ngram", 8)
    assert spec.output == plain.output and spec.finish_reason == "length"
    assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4) and len(spec.logprobs) == 25
    # make the 7th plain token an EOS: both paths must stop right before it
    eos = plain.output[6]
    engine.eos = {eos}
    a = engine.generate(prompt, SamplingParams(max_tokens=25), "none")
    b = engine.generate(prompt, SamplingParams(max_tokens=25), "ngram", 8)
    assert a.output == b.output == plain.output[: plain.output.index(eos)]
    assert a.finish_reason == b.finish_reason == "stop"


def test_failing_proposer_degrades_to_plain_decoding():
    class Broken:
        name = "broken"

        def propose(self, seqs, ks):
            raise RuntimeError("draft crashed")

        def rollback(self, seq, n):
            pass

        def release(self, seq):
            pass

    target = tiny_model(seed=1, scale=4.0)
    engine = Engine(target, proposers={"broken": Broken()}, k_policy="fixed")
    prompt = prompts(1)[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = engine.generate(prompt, params, "none")
    seq = engine.generate(prompt, params, "broken", 4)
    assert seq.output == plain.output
    # the last step has one token left to make: nothing is drafted, so nothing fails
    assert seq.stats.draft_errors == seq.stats.num_steps - 1 == 8
