"""A static draft-tree shape (Medusa's and EAGLE's "choices"): each step verifies at most the nodes
it lists, the draft model expands exactly them, and greedy outputs stay those of plain decoding."""

from collections import Counter

import pytest

from specfleet_engine.engine import Engine
from specfleet_engine.proposers import Proposal, TreeShape
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import branching_prompts, repeating_prompts, tiny_model

from .test_lossless_greedy import METHODS, assert_every_proposer_drafted, proposers_for, tally

# a Medusa-like shape: 3 children of the root, 2 under the first, one deep main chain
SHAPE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))


def test_rank_paths_and_the_nodes_a_shape_keeps():
    #          0      1     2   3   4   5
    p = Proposal([10, 11, 12, 13, 14, 15], None, parents=[-1, 0, 0, -1, 1, 3])
    assert p.rank_paths() == [(0,), (0, 0), (0, 1), (1,), (0, 0, 0), (1, 0)]
    kept = p.within(TreeShape.of([[0], [1], [0, 0], [0, 0, 0]], branching=2))
    assert kept.draft_tokens == [10, 11, 13, 14] and kept.parents == [-1, 0, -1, 1]
    chain = Proposal([1, 2, 3, 4], None)
    assert chain.within(TreeShape.of([[0], [0, 0]], branching=1)).draft_tokens == [1, 2]
    assert chain.within(None) is chain


@pytest.mark.parametrize("choices, caps, wrong", [
    ([[0], [0, 1]], (2, 0), r"\[0, 1\]"),  # [0, 0] missing: rank 1 without rank 0
    ([[0], [1, 0]], (2, 0), r"\[1\]"),  # its prefix [1] missing
    ([[0], [1]], (1, 0), "branching"),  # rank 1 under a cap of 1 child
    ([[0], [0, 0], [0, 0, 0]], (1, 2), "depth"),
])
def test_a_bad_shape_is_refused_naming_the_path(choices, caps, wrong):
    with pytest.raises(ValueError, match=wrong):
        Engine(tiny_model(seed=1), tree_branching=caps[0], tree_depth=caps[1], tree_choices=choices)


def shaped_engine(target, proposers):
    engine = Engine(target, proposers=proposers, max_kv_tokens=4096, block_size=8, k_policy="fixed",
                    tree_branching=3, tree_choices=SHAPE)
    verified: dict[str, list[list[tuple[int, ...]]]] = {m: [] for m in METHODS}
    propose = engine._propose

    def recorded(seqs):
        props = propose(seqs)
        for s, p in zip(seqs, props):
            if p.draft_tokens:
                verified[s.method].append(p.rank_paths())
        return props

    engine._propose = recorded
    return engine, verified


def test_a_static_shape_is_what_each_step_verifies_and_outputs_match_plain_decoding():
    target = tiny_model(seed=1, scale=4.0)
    engine, verified = shaped_engine(target, proposers_for(target))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    totals = {m: Counter() for m in METHODS}
    for prompt in repeating_prompts(3) + branching_prompts(3):
        plain = engine.generate(prompt, params, "none").output
        for k in (2, 4, 6):
            for method in METHODS:
                seq = engine.generate(prompt, params, method, k)
                assert seq.output == plain, (method, k)
                tally(totals, seq)
    assert_every_proposer_drafted(totals)
    for method, steps in verified.items():
        assert steps and all(set(paths) <= set(SHAPE) for paths in steps), method
        assert sum(len(p) > max(map(len, p)) for p in steps) >= 10, f"{method}: too few branching trees"
    # the draft model drafts every node the shape lists down to the step's K (it never runs out of
    # candidates; the fixed policy prunes nothing); the n-gram drafter only what the context offers
    full = {k: sorted(p for p in SHAPE if len(p) <= k) for k in range(1, 7)}
    assert all(sorted(p) in full.values() for p in verified["draft-model"]), verified["draft-model"][:3]
    assert engine.cache.allocator.num_used == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_draft_model_drafts_exactly_the_nodes_of_the_shape(temperature):
    """Each node gets the children the shape lists, and only nodes with children in it are
    expanded: no draft forward is spent on nodes the shape would drop."""
    target = tiny_model(seed=1, scale=4.0)
    proposer = proposers_for(target)["draft-model"]
    engine = Engine(target, proposers={"draft-model": proposer}, k_policy="fixed")
    seq = engine.add(repeating_prompts(1)[0], SamplingParams(max_tokens=16, temperature=temperature, seed=3),
                     "draft-model", 4)
    engine.step()  # the prefill
    rows = []
    forward = proposer._forward_tree
    proposer._forward_tree = lambda group, expand, trees: rows.append(sum(map(len, expand))) or forward(group, expand, trees)
    shape = TreeShape.of(SHAPE, branching=3)
    for k in (1, 2, 4):
        rows.clear()
        (prop,) = proposer.propose([seq], [k], [3], shape=shape)
        assert sorted(prop.rank_paths()) == sorted(p for p in SHAPE if len(p) <= k), k
        # expanded: the nodes with children in the shape, above depth k
        assert sum(rows) == sum(1 for p in SHAPE if len(p) < k and shape.children(p)), (k, rows)
        proposer.rollback(seq, len(seq.tokens) - 1)
    engine.abort(seq)
