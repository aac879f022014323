"""Every verify step gives the target's token too: a step that is not cut short by EOS, a stop
string or max_tokens emits exactly its accepted draft tokens plus one (the bonus token after a
fully accepted draft, the target's own choice where a draft token was rejected), for chains and
trees, greedy and sampled.

Losslessness cannot see this: an engine that dropped the bonus token of a fully accepted step and
kept its KV cache consistent would produce the same output, only in more steps. So this checks
each step's statistics, and that the runs held both kinds of step (fully accepted, and rejected).
"""

from __future__ import annotations

from collections import Counter

import pytest

from specfleet_engine.engine import Engine
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import branching_prompts, repeating_prompts, tiny_model

MAX_TOKENS = 24


def run_steps(engine: Engine, prompt: list[int], params: SamplingParams, method: str, k: int):
    """(stats, finished after the step) of each decoding step of one request."""
    seq = engine.add(prompt, params, method, k)
    steps = []
    while not seq.finished:
        for out in engine.step():
            if out.seq is seq and out.stats is not None:
                steps.append((out.stats, seq.finished))
    return seq, steps


@pytest.mark.parametrize("branching", [1, 3], ids=["chains", "trees"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_step_not_cut_short_emits_its_accepted_tokens_and_one_more(branching, temperature):
    target = tiny_model(seed=1, scale=4.0)
    # the target as its own draft model: its drafts are accepted whole (q = p), so steps end in a
    # bonus token; the n-gram drafts are rejected often, so steps end in the target's correction
    proposers = {"ngram": NgramProposer(), "draft-model": DraftModelProposer(target)}
    engine = Engine(target, proposers=proposers, max_kv_tokens=4096, block_size=8, k_policy="fixed",
                    tree_branching=branching)
    seen = Counter()
    prompts = repeating_prompts(3) + (branching_prompts(2) if branching > 1 else [])
    for i, prompt in enumerate(prompts):
        for method in ("ngram", "draft-model"):
            for k in (1, 3, 6):
                params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=temperature, seed=i)
                seq, steps = run_steps(engine, prompt, params, method, k)
                assert len(seq.output) == MAX_TOKENS
                for n, (s, finished) in enumerate(steps):
                    if finished:  # the last step: max_tokens may cut it
                        assert n == len(steps) - 1 and s.num_emitted <= s.num_accepted + 1
                        continue
                    assert s.num_emitted == s.num_accepted + 1, (method, k, n, s)
                    if s.num_draft_tokens:
                        seen["bonus" if s.bonus else "rejected"] += 1
                        seen["tree"] += s.num_draft_tokens > s.draft_depth
                        seen["full chain"] += s.bonus and s.num_accepted == s.draft_depth > 1
    # both kinds of step were checked, and fully accepted multi-token drafts among them
    assert seen["bonus"] >= 20 and seen["rejected"] >= 20 and seen["full chain"] >= 10, seen
    assert (seen["tree"] > 0) == (branching > 1), seen
    assert engine.cache.allocator.num_used == 0


def test_a_step_cut_by_eos_emits_fewer():
    """EOS inside an accepted draft ends the request there: the cut is the only exception."""
    target = tiny_model(seed=1, scale=4.0)
    prompt = repeating_prompts(1)[0]
    plain = Engine(target).generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "none", 0).output
    eos = plain[6]  # a token the target emits at position 6: EOS for this engine
    engine = Engine(target, proposers={"draft-model": DraftModelProposer(target)}, eos_token_ids=[eos],
                    k_policy="fixed")
    seq, steps = run_steps(engine, prompt, SamplingParams(max_tokens=MAX_TOKENS), "draft-model", 8)
    assert seq.finish_reason == "stop" and seq.output == plain[:plain.index(eos)]
    last, finished = steps[-1]
    assert finished and last.num_emitted < last.num_accepted + 1
    assert all(s.num_emitted == s.num_accepted + 1 for s, _ in steps[:-1])
