"""Sampled speculative decoding must draw from exactly the target's distribution.

On a 4-token vocabulary the exact distribution of the first three generated tokens (64
outcomes) is computed by enumeration with plain forwards; 10^4 seeded speculative generations
must land within a total-variation bound calibrated by drawing the same number of samples from
the exact distribution itself. A deliberately broken acceptance rule must fail the same check.
"""

import itertools

import pytest
import torch

from specfleet_engine import engine as engine_module
from specfleet_engine import sampling, verify
from specfleet_engine.engine import Engine
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.sampling import SamplingParams, logits_to_probs
from specfleet_engine.testing import tiny_model

VOCAB, DEPTH, N = 4, 3, 10_000
PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


def exact_distribution(model, params):
    """P(x1, x2, x3) under the target's sampling distribution, by enumeration."""
    engine = Engine(model, proposers={})
    probs = torch.zeros(VOCAB ** DEPTH)
    for i, seq in enumerate(itertools.product(range(VOCAB), repeat=DEPTH)):
        p = 1.0
        for d in range(DEPTH):
            s = engine.add(PROMPT + list(seq[:d]), SamplingParams(max_tokens=1, ignore_eos=True), "none")
            logits = engine._forward([s], [s.tokens], "last")
            engine.abort(s)
            p *= float(logits_to_probs(logits, params)[0, seq[d]])
        probs[i] = p
    return probs / probs.sum()


def tv_threshold(exact, n, reps=300, quantile=0.999):
    g = torch.Generator().manual_seed(1234)
    tvs = []
    for _ in range(reps):
        counts = torch.bincount(torch.multinomial(exact, n, replacement=True, generator=g), minlength=exact.numel())
        tvs.append(0.5 * (counts / n - exact).abs().sum())
    return float(torch.quantile(torch.stack(tvs), quantile))


def speculative_samples(model, proposers, method, k, params_kw):
    engine = Engine(model, proposers=proposers, max_kv_tokens=64 * 1024, block_size=8, k_policy="fixed")
    counts = torch.zeros(VOCAB ** DEPTH)
    drafted = accepted = 0
    for start in range(0, N, 1000):
        seqs = [engine.add(PROMPT, SamplingParams(max_tokens=DEPTH, ignore_eos=True, seed=seed, **params_kw), method, k)
                for seed in range(start, start + 1000)]
        while not all(s.finished for s in seqs):
            engine.step()
        for s in seqs:
            idx = 0
            for t in s.output:
                idx = idx * VOCAB + t
            counts[idx] += 1
            drafted += s.stats.num_draft_tokens
            accepted += s.stats.num_accepted_tokens
    return counts / N, accepted / max(drafted, 1)


def models():
    target = tiny_model(seed=11, vocab_size=VOCAB, scale=2.0)
    draft = tiny_model(seed=12, vocab_size=VOCAB, scale=2.0)
    return target, draft


CASES = [
    ("ngram (one-hot q)", "ngram", 3, dict(temperature=1.0)),
    ("draft model", "draft-model", 2, dict(temperature=1.0)),
    ("draft model, T=0.7, top-p 0.8", "draft-model", 2, dict(temperature=0.7, top_p=0.8)),
    ("ngram, T=1.5, top-k 3", "ngram", 2, dict(temperature=1.5, top_k=3)),
]


@pytest.mark.parametrize("name,method,k,params_kw", CASES, ids=[c[0] for c in CASES])
def test_speculative_samples_follow_the_target_distribution(name, method, k, params_kw):
    target, draft = models()
    exact = exact_distribution(target, SamplingParams(**params_kw))
    proposers = {"ngram": NgramProposer(), "draft-model": DraftModelProposer(draft)}
    empirical, alpha = speculative_samples(target, proposers, method, k, params_kw)
    assert 0.05 < alpha < 0.95, f"alpha {alpha:.2f}: drafts must be both accepted and rejected to test anything"
    tv = 0.5 * float((empirical - exact).abs().sum())
    assert tv < tv_threshold(exact, N), f"{name}: TV {tv:.4f} from the target distribution"


def test_a_broken_acceptance_rule_is_caught(monkeypatch):
    """Recovering from p instead of norm(max(0, p - q)) biases the output: the check must see it."""

    def broken(target_probs, draft_tokens, draft_probs, generator):
        k = draft_tokens.shape[0]
        rows = torch.arange(k)
        p = target_probs[rows, draft_tokens]
        q = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(p)
        u = torch.rand(k, generator=generator)
        n = int(torch.cumprod(u * q < p, dim=0).sum())
        tokens = draft_tokens[:n].tolist()
        tokens.append(int(sampling.sample_from(target_probs[n:n + 1], generator)))  # wrong when n < k
        return verify.VerifyResult(n, tokens, n == k)

    monkeypatch.setattr(engine_module, "verify_sampling", broken)
    target, draft = models()
    params_kw = dict(temperature=1.0)
    exact = exact_distribution(target, SamplingParams(**params_kw))
    empirical, _ = speculative_samples(target, {"draft-model": DraftModelProposer(draft)}, "draft-model", 2, params_kw)
    tv = 0.5 * float((empirical - exact).abs().sum())
    assert tv > tv_threshold(exact, N), f"the broken rule went unnoticed (TV {tv:.4f})"
