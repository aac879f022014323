"""The confidence and entropy K policies: which drafted nodes each verifies (the threshold, k_min,
a dropped parent taking its subtree), a sampled node judged before its own draw, the adaptive
choice for drafts without a distribution, clear errors for bad thresholds, the proposers that
tell their draft distribution (and only those), and the CRD stating the defaults the code has."""
from __future__ import annotations

import doctest
import pathlib
from types import SimpleNamespace

import pytest
import torch

from specfleet_engine.k_policies import (
    DEFAULT_MAX_ENTROPY, DEFAULT_MIN_CONFIDENCE, AdaptivePolicy, ConfidencePolicy, EntropyPolicy, make_policy,
)
from specfleet_engine.k_policies import confidence, entropy, threshold
from specfleet_engine.k_policies.confidence import path_confidence
from specfleet_engine.k_policies.threshold import kept_nodes
from specfleet_engine.costs import StepCostModel
from specfleet_engine.proposers import DraftStats, NgramProposer, Proposal
from specfleet_engine.proposers import base as proposers_base
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


def costs() -> StepCostModel:
    c = StepCostModel()
    c.set_curve({n: 1.0 + 0.02 * (n - 1) for n in range(1, 201)})
    return c


def seq(k_min: int = 0, policy=None):
    s = SimpleNamespace(k=8, k_min=k_min, k_max=8, kstate=None, latency_credit=0.0)
    (policy or AdaptivePolicy(costs())).start(s)
    return s


def chain(prob: list[float], entropy_: list[float] | None = None, rank_prob: list[float] | None = None) -> Proposal:
    n = len(prob)
    return Proposal(list(range(10, 10 + n)), None,
                    stats=DraftStats(prob, rank_prob or prob, entropy_ or [0.0] * n))


def select(policy, proposals, k_min: int = 0) -> list[list[int]]:
    seqs = [seq(k_min, policy) for _ in proposals]
    return policy.select_nodes(seqs, proposals, costs(), cheap=False, batch=len(seqs))


def test_docstring_examples():
    for mod in (confidence, entropy, threshold, proposers_base):
        assert doctest.testmod(mod).failed == 0


# -- confidence ---------------------------------------------------------------------------


def test_confidence_keeps_the_nodes_whose_cumulative_draft_probability_clears_the_threshold():
    policy = ConfidencePolicy(costs(), min_confidence=0.3)
    # cumulative 0.9, 0.45, 0.36, 0.072: the chain stops after the third node
    assert select(policy, [chain([0.9, 0.5, 0.8, 0.2])]) == [[0, 1, 2]]
    assert select(ConfidencePolicy(costs(), min_confidence=0.5), [chain([0.9, 0.5, 0.8, 0.2])]) == [[0]]
    assert select(ConfidencePolicy(costs(), min_confidence=0.95), [chain([0.9, 0.5, 0.8, 0.2])]) == [[]]
    # the threshold itself passes (>=)
    assert select(ConfidencePolicy(costs(), min_confidence=0.45), [chain([0.9, 0.5, 0.8, 0.2])]) == [[0, 1]]


def test_a_branch_stops_at_its_first_unconfident_node_even_if_a_later_one_is_confident():
    # node 1 (0.9 x 0.2 = 0.18) fails, so node 2 under it goes whatever its own probability
    p = Proposal([1, 2, 3, 4], None, parents=[-1, 0, 1, -1],
                 stats=DraftStats([0.9, 0.2, 1.0, 0.4], [0.9, 0.2, 1.0, 0.4], [0.0] * 4))
    assert select(ConfidencePolicy(costs(), min_confidence=0.3), [p]) == [[0, 3]]


def test_k_min_nodes_are_verified_whatever_their_confidence():
    policy = ConfidencePolicy(costs(), min_confidence=0.99)
    assert select(policy, [chain([0.1, 0.1, 0.1])], k_min=2) == [[0, 1]]


def test_a_sampled_node_is_judged_by_its_ranks_probability_not_its_own_draw():
    # the second node drew a token of probability 0.05, its position's top token has 0.9
    p = chain([0.9, 0.05, 0.9], rank_prob=[0.9, 0.9, 0.9])
    # scores 0.9, 0.9 x 0.9 = 0.81, then 0.9 x 0.05 x 0.9 (the drawn token counts for the child)
    assert path_confidence(p.parent_list(), p.stats.prob, p.stats.rank_prob) == pytest.approx([0.9, 0.81, 0.0405])
    assert select(ConfidencePolicy(costs(), min_confidence=0.5), [p]) == [[0, 1]]


def test_a_draft_without_a_distribution_gets_the_adaptive_choice():
    """n-gram: no stats. The adaptive policy trims a cheap draft by its kind's acceptance."""
    ngram = Proposal([5, 6, 7, 8], None, key=3)
    mixed = [ngram, chain([0.9, 0.1], [0.1, 3.0])]
    for policy in (ConfidencePolicy(costs(), min_confidence=0.5), EntropyPolicy(costs(), max_entropy=0.5)):
        seqs = [seq(0, policy) for _ in mixed]
        for _ in range(20):  # n-gram drafts of key 3 all accepted: the adaptive choice keeps them all
            policy.observe(seqs[0], 3, 4, 4)
        adaptive = AdaptivePolicy(costs())
        aseq = seq(0, adaptive)
        for _ in range(20):
            adaptive.observe(aseq, 3, 4, 4)
        want = adaptive.select_nodes([aseq], [ngram], costs(), cheap=True, batch=2)
        got = policy.select_nodes(seqs, mixed, costs(), cheap=True, batch=2)
        assert got[0] == want[0] == [0, 1, 2, 3]
        assert got[1] == [0], policy.name  # the other sequence's draft still goes by its threshold


def test_bad_thresholds_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="min_confidence must be a probability"):
        ConfidencePolicy(costs(), min_confidence=1.5)
    with pytest.raises(ValueError, match="max_entropy must be a number of nats >= 0"):
        EntropyPolicy(costs(), max_entropy=-0.1)
    with pytest.raises(ValueError, match="kPolicy must be one of adaptive, fixed, confidence, entropy"):
        make_policy("eagle2", costs())


def test_the_policies_are_served_by_name_with_the_documented_defaults():
    c = costs()
    assert make_policy("confidence", c).min_confidence == DEFAULT_MIN_CONFIDENCE
    assert make_policy("entropy", c).max_entropy == DEFAULT_MAX_ENTROPY
    crd = (ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml").read_text()
    # the CRD's description of kPolicy states the thresholds the code has
    assert f"at least {DEFAULT_MIN_CONFIDENCE}" in crd and f"more than {DEFAULT_MAX_ENTROPY} nats" in crd


# -- entropy ------------------------------------------------------------------------------


def test_entropy_stops_drafting_past_the_first_position_whose_draft_is_a_guess():
    policy = EntropyPolicy(costs(), max_entropy=2.0)
    assert select(policy, [chain([0.5] * 4, [0.4, 1.9, 2.6, 0.1])]) == [[0, 1]]
    assert select(policy, [chain([0.5] * 3, [2.0, 2.0, 2.0])]) == [[0, 1, 2]]  # at the threshold: kept
    assert select(policy, [chain([0.5] * 3, [3.0, 0.1, 0.1])]) == [[]]
    assert select(policy, [chain([0.5] * 3, [3.0, 0.1, 0.1])], k_min=1) == [[0, 1, 2]]


def test_entropy_drops_a_subtree_under_a_flat_position_and_keeps_its_sibling_branch():
    # root children 0 and 3 (entropy of the root's position 0.5); under 0 a flat position (3.0)
    p = Proposal([1, 2, 3, 4, 5], None, parents=[-1, 0, 1, -1, 3],
                 stats=DraftStats([0.5] * 5, [0.5] * 5, [0.5, 3.0, 0.1, 0.5, 1.0]))
    assert select(EntropyPolicy(costs(), max_entropy=2.0), [p]) == [[0, 3, 4]]


def test_kept_nodes_never_keeps_a_node_whose_parent_is_dropped():
    assert kept_nodes([-1, 0, 1, 2], [True, False, True, True], floor=0) == [0]
    assert kept_nodes([-1, -1, 1], [False, True, True], floor=0) == [1, 2]


# -- what proposers tell ------------------------------------------------------------------


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("branching", [1, 3], ids=["chain", "tree"])
def test_a_draft_model_tells_each_nodes_probability_rank_probability_and_entropy(greedy, branching):
    target = tiny_model(seed=1, scale=4.0)
    proposer = DraftModelProposer(tiny_model(seed=2, scale=4.0))
    assert proposer.capabilities.draft_stats and not NgramProposer.capabilities.draft_stats
    params = SamplingParams(max_tokens=8) if greedy else SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    s = SimpleNamespace(seq_id=1, tokens=[1, 2, 3, 4, 5], params=params,
                        generator=None if greedy else torch.Generator().manual_seed(3))
    p = proposer.propose([s], [3], [branching])[0]
    n = len(p.draft_tokens)
    assert n >= 3 and len(p.stats.prob) == len(p.stats.rank_prob) == len(p.stats.entropy) == n
    assert all(0.0 < x <= 1.0 for x in p.stats.prob + p.stats.rank_prob)
    assert all(0.0 <= h <= torch.log(torch.tensor(float(target.args.vocab_size))) + 1e-4 for h in p.stats.entropy)
    if greedy:  # the top tokens in order: a node's probability is its rank's
        assert p.stats.prob == pytest.approx(p.stats.rank_prob)
    if branching > 1:  # siblings share their position's entropy; a later rank has no more probability
        parents = p.parent_list()
        for i in range(1, n):
            if parents[i] == parents[i - 1]:
                assert p.stats.entropy[i] == pytest.approx(p.stats.entropy[i - 1])
                assert p.stats.rank_prob[i] <= p.stats.rank_prob[i - 1] + 1e-7
    # a subset keeps each node's stats with it
    sub = p.subset([0, n - 1]) if p.parent_list()[n - 1] in (-1, 0) else p.trimmed(1)
    assert sub.stats.prob[0] == p.stats.prob[0]
    proposer.release(s)
