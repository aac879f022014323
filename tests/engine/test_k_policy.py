import doctest

import pytest

from specfleet_worker import k_policy
from specfleet_worker.k_policy import AcceptanceEstimator, StepCostModel, choose_ks, expected_tokens


def test_docstring_examples():
    assert doctest.testmod(k_policy).failed == 0


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1


def test_a_bigger_batch_drafts_less():
    # on a CPU each row costs ~15% of a step; per-row cost stays flat as the batch grows
    cost = lambda rows: 1.0 + 0.15 * (rows - 1)  # noqa: E731
    alone = sum(choose_ks([0.6], [8], cost))
    batch = choose_ks([0.6] * 16, [8] * 16, cost)
    assert alone >= 2 and sum(batch) / 16 < alone


def test_low_acceptance_turns_speculation_off_and_high_turns_it_on():
    cost = lambda rows: 1.0 + 0.3 * (rows - 1)  # noqa: E731
    assert choose_ks([0.2], [8], cost) == [0]
    assert choose_ks([0.9], [8], cost)[0] >= 3


def test_acceptance_estimator_tracks_and_recovers():
    est = AcceptanceEstimator(prior=0.5)
    for _ in range(10):
        est.update(4, 0)
    low = est.alpha
    assert low < 0.1
    for _ in range(200):
        est.update(0, 0)
    assert low < est.alpha <= 0.5
    for _ in range(10):
        est.update(4, 4)
    assert est.alpha > 0.9


def test_cost_model_interpolates_and_extrapolates():
    c = StepCostModel()
    c.set_curve({1: 1.0, 3: 2.0})
    assert c(2) == 1.5
    assert c(5) == 3.0


def test_contention_moves_the_cost_level_but_not_the_shape_that_k_is_chosen_by():
    c = StepCostModel()
    c.set_curve({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})
    shape = [c(r) / c(1) for r in range(1, 6)]
    alpha_choice = choose_ks([0.6], [4], c)
    for _ in range(20):  # multi-row steps that hit bursts of load, twice as slow as calibrated
        c.observe(4, 2.3)
    assert c.level > 1.5
    assert [c(r) / c(1) for r in range(1, 6)] == pytest.approx(shape)
    assert choose_ks([0.6], [4], c) == alpha_choice
    c.observe(1, 1e6)  # one absurd sample is clipped: the level moves by at most clip ** smoothing
    assert c.level < 2.3 * c.clip ** c.smoothing


def test_calibration_keeps_the_shape_non_decreasing():
    c = StepCostModel()
    c.set_curve({1: 1.0, 2: 1.2, 3: 1.1, 4: 1.3})
    values = [c(r) for r in range(1, 5)]
    assert values == sorted(values)
    assert values[1] == values[2] == pytest.approx(1.15)
