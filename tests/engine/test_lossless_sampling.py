"""Sampled speculative decoding must draw from exactly the target's distribution.

On a 4-token vocabulary the exact distribution of the first four generated tokens (256 outcomes)
is computed by enumeration with plain forwards. The first token comes from the prefill, so the
first verify step decides tokens 2 to K+1: with K up to 3, every draft position is scored. 10^4
seeded speculative generations must land within a total-variation bound calibrated by drawing as
many samples from the exact distribution itself, and must have judged drafts at every position
(accepted and rejected). The same check must reject each known-wrong acceptance rule below, so a
pass cannot come from a check too weak to see a real bug.
"""

import dataclasses
from collections import Counter
from typing import NamedTuple

import pytest
import torch

from specfleet_engine import engine as engine_module
from specfleet_engine.engine import Engine
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.sampling import SamplingParams, logits_to_probs, sample_from
from specfleet_engine.testing import tiny_model
from specfleet_engine.verify import VerifyResult

VOCAB, DEPTH, N, BATCH = 4, 4, 10_000, 1000
PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


class Case(NamedTuple):
    name: str
    method: str
    k: int
    params: dict


CASES = [
    Case("ngram (one-hot q)", "ngram", 3, dict(temperature=1.0)),
    Case("draft model", "draft-model", 3, dict(temperature=1.0)),
    Case("draft model, T=0.7, top-p 0.9", "draft-model", 3, dict(temperature=0.7, top_p=0.9)),
    Case("ngram, T=1.5, top-k 3", "ngram", 2, dict(temperature=1.5, top_k=3)),
]


@pytest.fixture(scope="module")
def models():
    target = tiny_model(seed=17, vocab_size=VOCAB, scale=2.0)
    draft = tiny_model(seed=12, vocab_size=VOCAB, scale=2.0)
    return target, draft


def exact_distribution(model, params: SamplingParams) -> torch.Tensor:
    """P(x1..x4) under the target's sampling distribution, by enumeration: [VOCAB ** DEPTH], the
    outcome x1 x2 x3 x4 at index x1 V^3 + x2 V^2 + x3 V + x4."""
    engine = Engine(model, proposers={})
    probs = torch.ones(1, dtype=torch.float64)
    prefixes: list[list[int]] = [[]]
    for _ in range(DEPTH):
        seqs = [engine.add(PROMPT + p, SamplingParams(max_tokens=1), "none") for p in prefixes]
        logits = engine._forward(seqs, [s.tokens for s in seqs], "last")  # [len(prefixes), V]
        for s in seqs:
            engine.abort(s)
        probs = (probs[:, None] * logits_to_probs(logits, params).double()).flatten()
        prefixes = [p + [t] for p in prefixes for t in range(VOCAB)]
    return probs / probs.sum()


def tv_threshold(exact: torch.Tensor, n: int, reps: int = 300, quantile: float = 0.999) -> float:
    """The TV that n samples of the exact distribution itself stay under, but for 1 in 1000."""
    g = torch.Generator().manual_seed(1234)
    tvs = []
    for _ in range(reps):
        counts = torch.bincount(torch.multinomial(exact, n, replacement=True, generator=g), minlength=exact.numel())
        tvs.append(total_variation(counts / n, exact))
    return float(torch.quantile(torch.tensor(tvs), quantile))


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.fixture(scope="module")
def reference(models):
    """The exact distribution and its TV bound for a case's sampling parameters, computed once
    per module and shared by the real rule and by every mutant."""
    cache = {}

    def get(params: dict) -> tuple[torch.Tensor, float]:
        key = tuple(sorted(params.items()))
        if key not in cache:
            exact = exact_distribution(models[0], SamplingParams(**params))
            cache[key] = exact, tv_threshold(exact, N)
        return cache[key]

    return get


class Sampled(NamedTuple):
    dist: torch.Tensor  # [VOCAB ** DEPTH] the empirical distribution of x1..x4
    judged: Counter  # (draft position from 1, "accepted" | "rejected") -> count, scored tokens only
    draft_errors: int


def sample_speculatively(models, case: Case) -> Sampled:
    target, draft = models
    proposers = {"ngram": NgramProposer(), "draft-model": DraftModelProposer(draft)}
    engine = Engine(target, proposers=proposers, max_kv_tokens=64 * 1024, block_size=8, k_policy="fixed")
    # max_tokens leaves room for K drafts in every step that makes a scored token
    params = SamplingParams(max_tokens=DEPTH + case.k, ignore_eos=True, **case.params)
    counts = torch.zeros(VOCAB ** DEPTH, dtype=torch.float64)
    judged: Counter = Counter()
    draft_errors = 0
    for start in range(0, N, BATCH):
        seqs = [engine.add(PROMPT, dataclasses.replace(params, seed=seed), case.method, case.k)
                for seed in range(start, start + BATCH)]
        while not all(s.finished for s in seqs):
            for out in engine.step():
                if out.stats is None:  # the prefill's token
                    continue
                made = len(out.seq.output) - len(out.new_tokens)  # the draft at index i decides token made + i
                for i in range(min(out.stats.num_draft_tokens, DEPTH - made)):
                    if i > out.stats.num_accepted:
                        break
                    judged[i + 1, "accepted" if i < out.stats.num_accepted else "rejected"] += 1
            for s in seqs:
                if not s.finished and len(s.output) >= DEPTH:
                    engine.abort(s)  # the scored tokens are made: the rest would cost time only
        for s in seqs:
            idx = 0
            for t in s.output[:DEPTH]:
                idx = idx * VOCAB + t
            counts[idx] += 1
            draft_errors += s.stats.draft_errors
    return Sampled(counts / N, judged, draft_errors)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_speculative_samples_follow_the_target_distribution(case, models, reference):
    exact, limit = reference(case.params)
    dist, judged, draft_errors = sample_speculatively(models, case)
    assert draft_errors == 0, f"{case.name}: {draft_errors} failed drafts fell back to plain decoding"
    for position in range(1, case.k + 1):  # else a bug at that position would go unseen
        for verdict in ("accepted", "rejected"):
            assert judged[position, verdict] > 0, \
                f"{case.name}: no scored draft {verdict} at position {position} ({dict(judged)})"
    tv = total_variation(dist, exact)
    print(f"{case.name}: TV {tv:.4f}, limit {limit:.4f}, drafts judged {dict(sorted(judged.items()))}")
    assert tv < limit, f"{case.name}: TV {tv:.4f} from the target distribution (limit {limit:.4f})"


# -- the check must see known-wrong rules ----------------------------------------------------

MUTANTS = [
    "recover from p",  # the recovered token drawn from p instead of norm(max(0, p - q))
    "accept with min(1, q/p)",
    "always accept",
    "accepted is not a prefix",  # sum of the accept flags instead of their cumprod
    "residual of the first position",  # q of draft position 1 instead of the rejected one
]


def mutant(wrong: str):
    """verify.verify_sampling with one thing wrong (same signature, same vocabulary)."""

    def verify_sampling(target_probs, draft_tokens, draft_probs, generator):
        k = draft_tokens.shape[0]
        rows = torch.arange(k)
        p = target_probs[rows, draft_tokens]  # [K]
        q = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(p)
        u = torch.rand(k, generator=generator, dtype=p.dtype)
        if wrong == "accept with min(1, q/p)":
            accepted = u * p < q
        elif wrong == "always accept":
            accepted = torch.ones(k, dtype=torch.bool)
        else:
            accepted = u * q < p
        n = int(accepted.sum()) if wrong == "accepted is not a prefix" else int(torch.cumprod(accepted, dim=0).sum())
        tokens = draft_tokens[:n].tolist()
        if n == k:
            tokens.append(int(sample_from(target_probs[k:k + 1], generator)))
            return VerifyResult(n, tokens, True)
        j = 0 if wrong == "residual of the first position" else n
        if wrong == "recover from p":
            residual = target_probs[n].clone()
        elif draft_probs is not None:
            residual = (target_probs[n] - draft_probs[j]).clamp_min(0.0)
        else:
            residual = target_probs[n].clone()
            residual[draft_tokens[j]] = 0.0
        total = residual.sum()
        residual = residual / total if total > 0 else target_probs[n]
        tokens.append(int(sample_from(residual[None], generator)))
        return VerifyResult(n, tokens, False)

    return verify_sampling


@pytest.mark.parametrize("case", CASES[:2], ids=[c.name for c in CASES[:2]])
@pytest.mark.parametrize("wrong", MUTANTS)
def test_the_check_rejects_a_wrong_acceptance_rule(wrong, case, models, reference, monkeypatch):
    monkeypatch.setattr(engine_module, "verify_sampling", mutant(wrong))
    exact, limit = reference(case.params)
    tv = total_variation(sample_speculatively(models, case).dist, exact)
    print(f"{wrong} on {case.name}: TV {tv:.4f}, limit {limit:.4f}")
    assert tv > limit, f"{wrong} went unnoticed on {case.name}: TV {tv:.4f} within the limit {limit:.4f}"


def test_with_nothing_wrong_the_mutant_is_the_real_rule():
    """So each mutant differs from verify_sampling in its one wrong piece and nothing else."""
    from specfleet_engine.verify import verify_sampling

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        k = 1 + trial % 4
        target_probs = torch.softmax(3 * torch.randn(k + 1, VOCAB, generator=g), dim=-1)
        draft_probs = torch.softmax(3 * torch.randn(k, VOCAB, generator=g), dim=-1) if trial % 2 else None
        draft_tokens = torch.randint(0, VOCAB, (k,), generator=g)
        results = [rule(target_probs, draft_tokens, draft_probs, torch.Generator().manual_seed(trial))
                   for rule in (verify_sampling, mutant("nothing"))]
        assert results[0] == results[1], (trial, results)
