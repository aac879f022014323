"""Greedy speculative decoding must be token-identical to plain decoding: on every architecture,
alone and in a continuous batch, with every proposer drafting for real (drafts made, some
accepted, none failed), and the check must fail when a proposer never drafts.

Plain decoding is itself checked against HF transformers' `generate` in test_hf_generate.py, so a
bug shared by both paths cannot hide here.
"""

import dataclasses
from collections import Counter

import pytest

from specfleet_engine.draft_head import target_fingerprint
from specfleet_engine.engine import Engine
from specfleet_engine.k_policies import ConfidencePolicy, EntropyPolicy
from specfleet_engine.proposers import Capabilities, NgramProposer, Proposal
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.proposers.eagle import EagleProposer
from specfleet_engine.proposers.medusa import MedusaProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import (
    TINY_ARCHITECTURES, branching_prompts, repeating_prompts, tiny_draft, tiny_head, tiny_medusa_head, tiny_model,
)

METHODS = ("ngram", "draft-model", "eagle", "medusa")
_HEADS: dict = {}  # one trained head per target and kind (a few seconds each)


def head_for(target, prompts=None, train=tiny_head):
    """A head (`train`: tiny_head, an EAGLE one, or tiny_medusa_head) trained on the target's
    answers to `prompts` (the default: the prompts these tests decode), so that its drafts are
    accepted often enough to exercise verification."""
    key = (target_fingerprint(target), target.args.architecture, target.args.attention_bias,
           target.args.sliding_window, target.args.n_kv_heads, str(prompts), train.__name__)
    if key not in _HEADS:
        _HEADS[key] = train(target, prompts)
    return _HEADS[key]


def proposers_for(target, prompts=None, device: str | None = None) -> dict:
    """Every method's proposer for `target`; with `device`, the draft model and heads are made on
    the CPU (their noise and training run there) and moved, the target with them (test_cuda.py)."""
    draft, eagle, medusa = tiny_draft(target), head_for(target, prompts), head_for(target, prompts, tiny_medusa_head)
    if device is not None:
        target.to(device)
        draft, eagle, medusa = draft.to(device), eagle.to(device), medusa.to(device)
    return {"ngram": NgramProposer(), "draft-model": DraftModelProposer(draft), "eagle": EagleProposer(eagle, target),
            "medusa": MedusaProposer(medusa, target)}


def tally(totals: dict[str, Counter], seq) -> None:
    t = totals[seq.method]
    t["steps"] += seq.stats.num_steps
    t["draft tokens"] += seq.stats.num_draft_tokens
    t["draft nodes"] += seq.stats.num_draft_nodes
    t["accepted"] += seq.stats.num_accepted_tokens
    t["draft errors"] += seq.stats.draft_errors


def assert_every_proposer_drafted(totals: dict[str, Counter]) -> None:
    """Each proposer, on its own, drafted, had drafts accepted and never failed: otherwise the
    equality was plain decoding compared with itself."""
    for method in METHODS:
        t = totals[method]
        assert t["draft errors"] == 0, f"{method}: {t['draft errors']} failed drafts fell back to plain decoding"
        assert t["draft tokens"] > 0, f"{method} never drafted: its equality proves nothing"
        assert t["accepted"] > 0, f"{method}: no draft token was ever accepted: verification was not exercised"


def count_trees(engine: Engine, totals: dict[str, Counter]):
    """Wraps engine.step to count, per method, the verify steps whose draft was a branching tree."""
    step = engine.step

    def counted():
        outs = step()
        for out in outs:
            if out.stats is not None and out.stats.num_draft_tokens > out.stats.draft_depth:
                totals[out.seq.method]["tree steps"] += 1
        return outs

    engine.step = counted


def assert_trees_verified(totals: dict[str, Counter]) -> None:
    for method in METHODS:
        t = totals[method]
        # n-gram trees branch only where the context continued differently: a fraction of steps
        assert t["tree steps"] >= max(10, t["steps"] // 40), \
            f"{method}: only {t['tree steps']} of {t['steps']} steps held a tree"
        # alpha counts the positions drafted (a tree's depth), the nodes are counted apart
        assert t["draft nodes"] > t["draft tokens"] > 0, (method, t)


def check_speculation_matches_plain(target, proposers: dict, branching: int = 1) -> None:
    engine = Engine(target, proposers=proposers, max_kv_tokens=4096, block_size=8, k_policy="fixed",
                    tree_branching=branching)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    totals = {m: Counter() for m in METHODS}
    count_trees(engine, totals)
    for prompt in repeating_prompts(3) + (branching_prompts(3) if branching > 1 else []):
        plain = engine.generate(prompt, params, "none").output
        assert len(plain) == 24
        for k in range(1, 9):
            for method in METHODS:
                seq = engine.generate(prompt, params, method, k)
                assert seq.output == plain, (method, k)
                tally(totals, seq)
    assert_every_proposer_drafted(totals)
    if branching > 1:
        assert_trees_verified(totals)
    assert engine.cache.allocator.num_used == 0
    for method, proposer in proposers.items():
        assert getattr(proposer, "cache", None) is None or proposer.cache.allocator.num_used == 0, method


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_ngram_and_draft_model_match_plain_decoding(arch):
    target = tiny_model(seed=1, scale=4.0, **TINY_ARCHITECTURES[arch])
    check_speculation_matches_plain(target, proposers_for(target))


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_draft_trees_match_plain_decoding(arch):
    """Up to 3 children a node: the longest agreeing root path, its K/V compacted into place."""
    target = tiny_model(seed=1, scale=4.0, **TINY_ARCHITECTURES[arch])
    check_speculation_matches_plain(target, proposers_for(target), branching=3)


def test_trees_with_the_targets_recycled_choices_match_plain_decoding():
    """The n-gram proposer also drafting the target's own top next tokens (Token Recycling)."""
    target = tiny_model(seed=1, scale=4.0)
    proposers = {**proposers_for(target), "ngram": NgramProposer(recycle=4)}
    check_speculation_matches_plain(target, proposers, branching=3)
    assert proposers["ngram"].successors == {}


def test_the_tree_check_fails_when_proposers_draft_chains_only(monkeypatch):
    """Chains verify fine, so outputs still match: only the tree guard sees it."""
    for proposer in (NgramProposer, DraftModelProposer):
        chains = dataclasses.replace(proposer.capabilities, trees=False, shapes=False)
        monkeypatch.setattr(proposer, "capabilities", chains)
    target = tiny_model(seed=1, scale=4.0)
    with pytest.raises(AssertionError, match="steps held a tree"):
        check_speculation_matches_plain(target, proposers_for(target), branching=3)


class NeverDrafts:
    name, capabilities = "draft-model", Capabilities()

    def propose(self, seqs, ks):
        return [Proposal([], None) for _ in seqs]

    def rollback(self, seq, n):
        pass

    def release(self, seq):
        pass


class AlwaysRaises(NeverDrafts):
    def propose(self, seqs, ks):
        raise RuntimeError("draft crashed")


@pytest.mark.parametrize("broken", [NeverDrafts, AlwaysRaises], ids=["empty drafts", "raises"])
def test_the_check_fails_when_a_proposer_never_drafts(broken):
    """Both fall back to plain decoding, so every output still matches: only the guard sees it."""
    target = tiny_model(seed=1, scale=4.0)
    proposers = {**proposers_for(target), "draft-model": broken()}
    with pytest.raises(AssertionError, match="draft-model"):
        check_speculation_matches_plain(target, proposers)


def test_a_failing_proposer_is_logged_once_with_its_error(caplog):
    """A proposer that raises costs its sequences their drafts, not the step: the error is logged
    (once per method, with its traceback: a device mix-up on a GPU was otherwise silent) and
    counted on each sequence."""
    engine = Engine(tiny_model(seed=1, scale=4.0), proposers={"draft-model": AlwaysRaises()}, max_kv_tokens=1024,
                    block_size=8, k_policy="fixed")
    with caplog.at_level("WARNING", logger="specfleet.engine"):
        seqs = [engine.generate(p, SamplingParams(max_tokens=6, ignore_eos=True), "draft-model", 3)
                for p in repeating_prompts(2)]
    assert [(len(s.output), s.stats.draft_errors > 0) for s in seqs] == [(6, True)] * 2
    failures = [r for r in caplog.records if "proposer failed" in r.getMessage()]
    assert len(failures) == 1 and "draft-model" in failures[0].getMessage(), caplog.text
    assert "draft crashed" in caplog.text  # the traceback names the cause


@pytest.mark.parametrize("branching", [1, 3], ids=["chains", "trees"])
@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_batched_speculation_matches_single_requests(arch, branching):
    target = tiny_model(seed=3, scale=4.0, **TINY_ARCHITECTURES[arch])
    # fixed K: every speculative request verifies its own k (1 to 7) each step, next to plain ones;
    # with trees, a ragged batch of trees, chains (a single continuation) and plain rows
    ps = repeating_prompts(8, seed=5) if branching == 1 else repeating_prompts(4, seed=5) + branching_prompts(4)
    engine = Engine(target, proposers=proposers_for(target, ps), k_policy="fixed", tree_branching=branching)
    totals = {m: Counter() for m in METHODS}
    count_trees(engine, totals)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    expected = [engine.generate(p, params, "none").output for p in ps]
    methods = ["none", "ngram", "draft-model", "eagle", "medusa"]
    seqs = [engine.add(p, params, methods[i % len(methods)], k=1 + i % 7) for i, p in enumerate(ps)]
    while not all(s.finished for s in seqs):
        engine.step()
        # a request joins mid-flight: continuous batching
        if len(seqs) == len(ps):
            seqs.append(engine.add(ps[0], params, "ngram", 3))
    assert [s.output for s in seqs[: len(ps)]] == expected
    assert seqs[-1].output == expected[0]
    for s in seqs:
        if s.method != "none":
            tally(totals, s)
    assert_every_proposer_drafted(totals)
    if branching > 1:
        assert_trees_verified(totals)
    assert engine.cache.allocator.num_used == 0


def test_chunked_prefill_matches_whole_prompts_and_never_stalls_decoding():
    """prefill_chunk 5: every step's prefill forward holds at most 5 prompt tokens, a long prompt
    is prefilled over several steps while the running sequences decode a token (or more) in each
    of them, an abort mid-prompt frees its blocks, and the outputs are those of whole prompts."""
    target = tiny_model(seed=3, scale=4.0)
    engine = Engine(target, proposers=proposers_for(target), k_policy="fixed", prefill_chunk=5)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ps = repeating_prompts(6, seed=11)
    whole = Engine(target, proposers=proposers_for(target), k_policy="fixed")
    expected = [whole.generate(p, params, "none").output for p in ps]
    chunks = []
    forward = engine._forward

    def recording(seqs, inputs, rows, trees=None):
        if rows == "last":  # the prefill's
            chunks.append(sum(map(len, inputs)))
        return forward(seqs, inputs, rows, trees)

    engine._forward = recording
    methods = ["none", "ngram", "draft-model"]
    seqs = [engine.add(p, params, methods[i % 3], k=3) for i, p in enumerate(ps[:3])]
    while not all(s.prefilled for s in seqs):
        engine.step()
    doomed = engine.add(ps[3] * 3, params, "ngram", 3)
    late = [engine.add(p, params, methods[i % 3], k=3) for i, p in enumerate(ps[3:])]
    stalled = 0
    while not all(s.finished for s in seqs + late):
        before = [len(s.output) for s in seqs]
        engine.step()
        stalled += any(len(s.output) == b and not s.finished for s, b in zip(seqs, before))
        if doomed.block_table.num_tokens and not doomed.prefilled and not doomed.finished:
            engine.abort(doomed)  # mid-prompt
    assert max(chunks) <= 5 and len(chunks) > len(ps), chunks
    assert sum(chunks) >= sum(map(len, ps)) and stalled == 0
    assert [s.output for s in seqs + late] == expected
    assert doomed.finish_reason == "abort" and not doomed.prefilled
    assert engine.cache.allocator.num_used == 0
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(target, prefill_chunk=0)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_batched_adaptive_k_matches_single_requests(arch):
    """The default policy: each step verifies what pays for the whole batch (cheap verify rows
    here), so draft lengths and tree budgets differ by sequence and by step; outputs must not."""
    target = tiny_model(seed=3, scale=4.0, **TINY_ARCHITECTURES[arch])
    engine = Engine(target, proposers=proposers_for(target), k_policy="adaptive", tree_branching=3)
    engine.costs.set_curve({r: 1.0 + 0.02 * (r - 1) for r in range(1, 80)})
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ps = repeating_prompts(6, seed=8)
    expected = [engine.generate(p, params, "none").output for p in ps]
    seqs = [engine.add(p, params, "draft-model" if i % 2 else "ngram", k=8) for i, p in enumerate(ps)]
    drafted_per_step = set()
    while not all(s.finished for s in seqs):
        for out in engine.step():
            if out.stats is not None and out.stats.num_draft_tokens:
                drafted_per_step.add(out.stats.num_draft_tokens)
    assert [s.output for s in seqs] == expected
    draft_model = [s for s in seqs if s.method == "draft-model"]
    assert sum(s.stats.num_accepted_tokens for s in draft_model) > 0 and not any(s.stats.draft_errors for s in seqs)
    assert len(drafted_per_step) >= 3, f"adaptive K chose too few distinct draft lengths: {drafted_per_step}"
    assert engine.cache.allocator.num_used == 0


@pytest.mark.parametrize("branching", [1, 3], ids=["chains", "trees"])
def test_eos_max_tokens_and_logprobs_inside_verification(branching):
    target = tiny_model(seed=1, scale=4.0)
    engine = Engine(target, k_policy="fixed", tree_branching=branching)
    prompt = repeating_prompts(1, seed=0)[0]
    plain = engine.generate(prompt, SamplingParams(max_tokens=25, ignore_eos=True, logprobs=True), "none")
    spec = engine.add(prompt, SamplingParams(max_tokens=25, ignore_eos=True, logprobs=True), "ngram", 8)
    mid_step = []  # output positions that a verify step emitted after an accepted draft token
    while not spec.finished:
        for out in engine.step():
            if out.seq is spec and out.stats is not None and out.stats.num_accepted:
                first = len(spec.output) - len(out.new_tokens)
                mid_step += range(first + 1, len(spec.output))
    assert spec.output == plain.output and spec.finish_reason == "length"
    assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-4) and len(spec.logprobs) == 25
    # an EOS at a position a verify step reaches through an accepted draft: both paths stop right before it
    cut = next((i for i in mid_step if plain.output[i] not in plain.output[:i]), None)
    assert cut is not None, f"no verify step accepted a draft ahead of a new token (steps after a draft: {mid_step})"
    engine.eos = {plain.output[cut]}
    a = engine.generate(prompt, SamplingParams(max_tokens=25), "none")
    b = engine.generate(prompt, SamplingParams(max_tokens=25), "ngram", 8)
    assert a.output == b.output == plain.output[:cut]
    assert a.finish_reason == b.finish_reason == "stop"


def test_failing_proposer_degrades_to_plain_decoding():
    target = tiny_model(seed=1, scale=4.0)
    engine = Engine(target, proposers={"draft-model": AlwaysRaises()}, k_policy="fixed")
    prompt = repeating_prompts(1)[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = engine.generate(prompt, params, "none")
    seq = engine.generate(prompt, params, "draft-model", 4)
    assert seq.output == plain.output
    # the last step has one token left to make: nothing is drafted, so nothing fails
    assert seq.stats.draft_errors == seq.stats.num_steps - 1 == 8


def test_a_tree_never_verifies_more_nodes_than_a_kv_reservation_leaves_room_for():
    """Up to 8 children a node, 16 deep, every node verified (fixed K): still at most MAX_DRAFT_NODES a step."""
    from specfleet_engine.engine import MAX_DRAFT_NODES

    target = tiny_model(seed=1, scale=4.0)
    engine = Engine(target, proposers=proposers_for(target), k_policy="fixed", tree_branching=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    biggest = 0
    for prompt in branching_prompts(3, seed=2):
        plain = engine.generate(prompt, params, "none").output
        seq = engine.add(prompt, params, "draft-model", 16)
        while not seq.finished:
            for out in engine.step():
                if out.stats is not None:
                    biggest = max(biggest, out.stats.num_draft_tokens)
        assert seq.output == plain
    assert biggest == MAX_DRAFT_NODES  # the draft model's 8 x 16 tree was cut to the cap


def counting_nodes(policy) -> dict[str, Counter]:
    """Wraps a policy's select_nodes: per method, nodes drafted and kept (proposals with stats apart)."""
    counts: dict[str, Counter] = {}
    select = policy.select_nodes

    def counted(seqs, proposals, *a, **kw):
        out = select(seqs, proposals, *a, **kw)
        for s, p, keep in zip(seqs, proposals, out):
            c = counts.setdefault(s.method, Counter())
            c["drafted"] += len(p.draft_tokens)
            c["kept"] += len(keep)
            c["told"] += p.stats is not None
        return out

    policy.select_nodes = counted
    return counts


@pytest.mark.parametrize("branching", [1, 3], ids=["chains", "trees"])
@pytest.mark.parametrize("policy", ["confidence", "entropy"])
def test_the_threshold_k_policies_match_plain_decoding(policy, branching):
    """The confidence and entropy policies verify part of each draft, alone and in a continuous
    batch of every method (n-gram drafts, without a distribution, get the adaptive choice): outputs
    equal plain decoding, and the threshold must have pruned nodes and kept others."""
    target = tiny_model(seed=1, scale=4.0)
    ps = repeating_prompts(4, seed=5) + (branching_prompts(2) if branching > 1 else [])
    engine = Engine(target, proposers=proposers_for(target, ps), tree_branching=branching)
    engine.costs.set_curve({r: 1.0 + 0.01 * (r - 1) for r in range(1, 200)})  # rows cheap: draft deep, then prune
    # the heads trained on these prompts are sure of most drafts: thresholds that prune some
    engine.k_policy = ConfidencePolicy(engine.costs, min_confidence=0.9) if policy == "confidence" else \
        EntropyPolicy(engine.costs, max_entropy=0.3)
    counts = counting_nodes(engine.k_policy)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [engine.generate(p, params, "none").output for p in ps]
    totals = {m: Counter() for m in METHODS}
    for method in METHODS:
        for p, want in zip(ps, expected):
            seq = engine.generate(p, params, method, 8)
            assert seq.output == want, (policy, method)
            tally(totals, seq)
    seqs = [engine.add(p, params, METHODS[i % len(METHODS)], k=8) for i, p in enumerate(ps)]
    while not all(s.finished for s in seqs):
        engine.step()
    assert [s.output for s in seqs] == expected
    assert_every_proposer_drafted(totals)
    for method in ("draft-model", "eagle", "medusa"):
        c = counts[method]
        assert 0 < c["kept"] < c["drafted"] and c["told"] > 0, f"{policy} {method}: kept {c['kept']} of {c['drafted']}"
    assert counts["ngram"]["told"] == 0 and counts["ngram"]["kept"] > 0


MIXED_HEADS = ("draft-model", "eagle", "medusa")


@pytest.mark.parametrize("branching", [1, 3], ids=["chains", "trees"])
def test_mixed_drafts_match_plain_decoding_in_a_batch_with_every_method(branching):
    """n-gram chains mixed into each head's drafts (`draft.ngram.mix`), in one continuous batch
    beside plain, n-gram and head-only requests. Trees: steps whose tree held both the n-gram's
    chain and the head's nodes, with tokens accepted on each; chains: steps drafted by each."""
    from specfleet_engine.proposers import MixedProposer

    target = tiny_model(seed=1, scale=4.0, vocab_size=20)  # a small vocabulary: n-gram drafts are accepted too
    ps = repeating_prompts(4, seed=5, vocab=9) + branching_prompts(4, vocab=9)
    proposers = proposers_for(target, ps)
    mixed = {f"{m}+ngram": MixedProposer(proposers["ngram"], proposers_for(target, ps)[m]) for m in MIXED_HEADS}
    engine = Engine(target, proposers={**proposers, **mixed}, k_policy="fixed", tree_branching=branching)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    expected = [engine.generate(p, params, "none").output for p in ps]
    methods = ["none", "ngram", "eagle", *mixed]
    seqs = [engine.add(p, params, m, k=2 + (i + j) % 5) for i, p in enumerate(ps) for j, m in enumerate(methods)]
    seen = {m: Counter() for m in mixed}
    while not all(s.finished for s in seqs):
        for out in engine.step():
            st = out.stats
            if st is None or out.seq.method not in mixed or not st.num_draft_tokens:
                continue
            c = seen[out.seq.method]
            c["both"] += 0 < st.ngram_nodes < st.num_draft_tokens
            c["ngram led"] += st.ngram_nodes > 0
            c["head led"] += st.ngram_nodes == 0
            c["ngram accepted"] += st.ngram_accepted
            c["head accepted"] += st.num_accepted - st.ngram_accepted
    assert [s.output for s in seqs] == [expected[i] for i in range(len(ps)) for _ in methods]
    assert not any(s.stats.draft_errors for s in seqs)
    for method, c in seen.items():
        assert c["ngram accepted"] >= 10 and c["head accepted"] >= 10, (method, c)
        assert c["ngram led"] > 0 and c["head led"] > 0, (method, c)
        if branching > 1:
            assert c["both"] >= 10, (method, c)
        else:
            assert c["both"] == 0, (method, c)  # a chain cap: one branch, the n-gram's or the head's
    ngram_steps = sum(s.stats.num_ngram_drafts for s in seqs if s.method in mixed)
    assert ngram_steps == sum(c["ngram led"] for c in seen.values())
    assert sum(s.stats.num_ngram_accepted for s in seqs) == sum(c["ngram accepted"] for c in seen.values())
    assert engine.cache.allocator.num_used == 0
