"""Proposers declare what they can do and what they need of the target (proposers/base.py
`Capabilities`); the engine serves exactly that: a tree only to a proposer that takes one, a static
shape only to one that drafts it, the target's top tokens to one that asks for them, and it refuses
a proposer that declares nothing or needs what it does not hand over (hidden states)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from specfleet_engine.draft_head import EagleHead, HeadConfig
from specfleet_engine.engine import Engine
from specfleet_engine.proposers import Capabilities, NgramProposer, Proposal
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.proposers.eagle import EagleProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import repeating_prompts, tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Recording:
    """Drafts 1, 2, 3, ... and records how it was called."""

    name = "rec"

    def __init__(self, caps: Capabilities):
        self.capabilities = caps
        self.calls: list[dict] = []
        self.observed: list[int] = []  # columns of each observe_targets' top

    def propose(self, seqs, ks, branching=None, **extra):
        self.calls.append({"branching": branching, **extra})
        return [Proposal(list(range(1, k + 1)), None) for k in ks]

    def observe_targets(self, seq, tokens, top):
        assert isinstance(top, np.ndarray) and len(top) == len(tokens)
        self.observed.append(top.shape[1])

    def rollback(self, seq, num_valid):
        pass

    def release(self, seq):
        pass


def run(caps: Capabilities, **engine_kw) -> Recording:
    rec = Recording(caps)
    engine = Engine(tiny_model(seed=1, scale=4.0), proposers={"rec": rec}, k_policy="fixed", **engine_kw)
    engine.generate(repeating_prompts(1)[0], SamplingParams(max_tokens=8, ignore_eos=True), "rec", 4)
    assert rec.calls
    return rec


def test_a_chain_proposer_is_never_handed_a_tree():
    rec = run(Capabilities(cheap=True), tree_branching=3)
    assert all(c == {"branching": None} for c in rec.calls) and rec.observed == []


def test_a_tree_proposer_gets_branching_and_a_shape_only_when_it_drafts_shapes():
    shape = [[0], [1], [0, 0]]
    assert all(c == {"branching": [3]} for c in run(Capabilities(trees=True), tree_branching=3).calls)
    assert all(c == {"branching": [2]} for c in run(Capabilities(trees=True), tree_branching=2, tree_choices=shape).calls)
    with_shape = run(Capabilities(trees=True, shapes=True), tree_branching=2, tree_choices=shape).calls
    assert all(c["branching"] == [2] and c["shape"].paths == {(0,), (1,), (0, 0)} for c in with_shape)


def test_the_targets_top_tokens_reach_a_proposer_that_asks_for_them():
    rec = run(Capabilities(target_top_k=3))
    assert rec.observed and set(rec.observed) == {3}


def test_the_shipped_proposers_declare_theirs():
    assert NgramProposer.capabilities == Capabilities(cheap=True, trees=True)
    assert NgramProposer(recycle=4).capabilities.target_top_k == 4 and NgramProposer.capabilities.target_top_k == 0
    assert DraftModelProposer.capabilities == Capabilities(trees=True, shapes=True, draft_stats=True)
    target = tiny_model(seed=1)
    head = EagleHead(HeadConfig.for_target(target, 16, feature_layers=(0, 1)), target.args)
    assert EagleProposer(head, target).capabilities == Capabilities(trees=True, shapes=True, target_layers=(0, 1),
                                                                    draft_stats=True)


class Undeclared(Recording):
    capabilities = None

    def __init__(self):
        super().__init__(None)


@pytest.mark.parametrize("proposer, error, match", [
    (Undeclared(), TypeError, "declares no Capabilities"),
    (Recording(Capabilities(target_layers=(1, 1))), ValueError, "distinct layer indices"),
    (Recording(Capabilities(target_layers=(0, 7))), ValueError, r"layers \[7\]; the target has 2 layers"),
    (Recording(Capabilities(shapes=True)), ValueError, "shapes needs trees"),
])
def test_the_engine_refuses_a_proposer_it_cannot_serve(proposer, error, match):
    with pytest.raises(error, match=match):
        Engine(tiny_model(seed=1), proposers={"p": proposer})


def test_the_engine_reads_capabilities_and_never_probes_a_proposer():
    for rel in ("worker/specfleet_engine/engine.py", "worker/specfleet_engine/factory.py"):
        text = (ROOT / rel).read_text()
        for probe in ('getattr(proposer', 'getattr(self.proposers', '"cheap"', '"trees"', '"shapes"', '"recycle"'):
            assert probe not in text, (rel, probe)
