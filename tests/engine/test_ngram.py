import doctest

import numpy as np

from specfleet_worker.proposers import ngram


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
