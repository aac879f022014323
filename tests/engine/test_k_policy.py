import doctest

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
    c.observe(1, 1.0)
    c.observe(3, 2.0)
    assert c(2) == 1.5
    assert c(5) == 3.0
    c.observe(1, 2.0)  # smoothed, not replaced
    assert 1.0 < c(1) < 2.0
