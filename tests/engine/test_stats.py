"""Per-request speculation stats: alpha counts the positions a draft covered, so a tree's alpha
reads like a chain's (its siblings are candidates for the same position); nodes are counted apart."""
from __future__ import annotations

import pytest

from specfleet_engine.engine import SequenceStats, StepStats


def test_a_tree_counts_its_depth_as_draft_tokens_and_its_nodes_apart():
    s = SequenceStats()
    s.add(StepStats("ngram", 6, 2, False, 3, draft_depth=3))  # 6 nodes over 3 levels, 2 accepted
    s.add(StepStats("ngram", 4, 4, True, 5, draft_depth=4))  # a chain of 4, all accepted
    s.add(StepStats("none", 0, 0, True, 1))  # a plain step
    assert (s.num_steps, s.num_drafts, s.num_tree_steps) == (3, 2, 1)
    assert (s.num_draft_tokens, s.num_draft_nodes, s.num_accepted_tokens) == (7, 10, 6)
    assert s.acceptance_rate == pytest.approx(6 / 7)
    assert s.accepted_per_position == [2, 2, 1, 1]  # by position, never by node
    assert s.mean_accepted_length == pytest.approx(9 / 3)


def test_a_chain_without_a_depth_reads_as_its_length():
    s = SequenceStats()
    s.add(StepStats("ngram", 5, 1, False, 2))
    assert (s.num_draft_tokens, s.num_draft_nodes, s.acceptance_rate) == (5, 5, pytest.approx(0.2))
