import doctest

import numpy as np

from specfleet_engine.proposers import ngram


def test_docstring_examples():
    assert doctest.testmod(ngram).failed == 0


def test_longest_match_wins_over_a_later_shorter_one():
    # the last 3 tokens (1 2 3) occur at 0; the last 1 token (3) also occurs later at 5
    tokens = np.array([1, 2, 3, 7, 8, 3, 9, 1, 2, 3])
    assert ngram.ngram_propose(tokens, 1, 3, 2).tolist() == [7, 8]


def test_draft_is_cut_at_the_end_of_the_context():
    tokens = np.array([4, 5, 4])
    assert ngram.ngram_propose(tokens, 1, 2, 5).tolist() == [5, 4]


def test_min_n_bounds_the_match_length():
    tokens = np.array([1, 9, 2, 9])
    assert ngram.ngram_propose(tokens, 2, 3, 2).tolist() == []
    assert ngram.ngram_propose(tokens, 1, 3, 2).tolist() == [2, 9]


def test_match_length_is_reported_as_the_proposal_key():
    tokens = np.array([1, 2, 3, 7, 8, 3, 9, 1, 2, 3])
    draft, n = ngram.ngram_match(tokens, 1, 4, 2)
    assert draft.tolist() == [7, 8] and n == 3
    assert ngram.ngram_match(np.array([1, 2, 3]), 1, 2, 4)[1] == 0


def test_adaptive_k_keeps_separate_acceptance_per_match_length():
    from specfleet_engine.engine import Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model

    engine = Engine(tiny_model(seed=1, scale=4.0))
    engine.costs.seconds.update({r: 1.0 + 0.1 * (r - 1) for r in range(1, 32)})
    seq = engine.generate([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True), "ngram", 6)
    by_key = seq.kstate.by_key  # the adaptive policy's acceptance, per kind of draft
    assert by_key and all(k >= 0 for k in by_key)
    assert any(k > 0 for k in by_key), "drafts from matches were tracked under their match length"
