"""The K controller as pure functions: alpha drives K, a larger batch shrinks it, hysteresis keeps
it from flapping, bounds bind at once, and K = 0 probes now and then."""
from __future__ import annotations

import random

import pytest

from specfleet_worker.kcontrol import KController, StepCostModel, best_k, expected_tokens


def fitted(a: float, b: float) -> StepCostModel:
    m = StepCostModel()
    for n in range(1, 200):
        m.observe(n % 40 + 1, a + b * (n % 40 + 1))
    return m


def test_expected_tokens_is_the_geometric_series():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 8) == 1.0 and expected_tokens(1.0, 3) == 4.0


def test_the_cost_model_recovers_a_linear_step_cost():
    a, b = fitted(0.02, 0.001).coefficients()
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(0.001, rel=1e-6)
    same = StepCostModel(prior_ratio=0.1)
    for _ in range(20):
        same.observe(4, 0.05)  # one size only: the slope falls back on the prior
    a, b = same.coefficients()
    assert a + 4 * b == pytest.approx(0.05) and b / a == pytest.approx(0.1)


def test_best_k_grows_with_alpha_and_shrinks_to_zero_as_the_batch_grows():
    cost = fitted(0.02, 0.001)  # a 20-token step costs twice a 1-token one
    ks_by_alpha = [best_k(alpha, 1, 0, 8, cost)[0] for alpha in (0.1, 0.5, 0.8, 0.95)]
    assert ks_by_alpha == sorted(ks_by_alpha) and ks_by_alpha[0] <= 1 and ks_by_alpha[-1] >= 5
    ks_by_batch = [best_k(0.7, batch, 0, 8, cost)[0] for batch in (1, 4, 16, 64)]
    assert ks_by_batch == sorted(ks_by_batch, reverse=True) and ks_by_batch[0] >= 3 and ks_by_batch[-1] == 0


def run(controller, alpha: float, steps: int, batch: int = 1, k_min: int = 0, k_max: int = 8, seed: int = 0):
    """Simulates a request whose draft tokens are each accepted with chance alpha; returns K per step."""
    rng = random.Random(seed)
    st, ks = controller.start(4), []
    for _ in range(steps):
        k = controller.choose(st, batch, k_min, k_max)
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        controller.observe(st, k, accepted)
    return ks


def test_the_controller_climbs_on_high_acceptance_and_falls_on_low():
    cost = fitted(0.02, 0.001)
    assert run(KController(cost), 0.9, 200)[-1] >= 6
    low = run(KController(cost), 0.02, 200)
    assert max(low[-20:]) <= 1


def test_k_changes_one_step_at_a_time_and_rarely():
    ks = run(KController(fitted(0.02, 0.001)), 0.6, 400)
    changes = sum(1 for a, b in zip(ks, ks[1:]) if a != b)
    assert all(abs(a - b) <= 1 for a, b in zip(ks, ks[1:]))
    assert changes <= 400 / 4 / 2  # hold = 4 steps between changes, and most holds end without one


def test_bounds_bind_at_once_and_a_fixed_policy_stays_put():
    c = KController(fitted(0.02, 0.001))
    st = c.start(6)
    assert c.choose(st, 1, 0, 2) == 2  # K_max lowered under the current K
    assert c.choose(st, 1, 3, 5) == 3
    st = c.start(4)
    for _ in range(50):
        assert c.choose(st, 64, 0, 8, adaptive=False) == 4
        c.observe(st, 4, 0)


def test_at_k_zero_the_controller_probes_to_re_measure_alpha():
    c = KController(fitted(0.02, 0.005), probe_every=10)  # a draft token costs a quarter step
    ks = run(c, 0.0, 300)
    assert 0 in ks and ks.count(1) >= 5  # it dropped to 0 and came back up to look, several times


def test_a_prior_from_the_prompt_types_history_sets_the_first_k():
    c = KController(fitted(0.02, 0.002))
    assert c.start(4).k == 4  # no history: kInitial
    assert c.start(4, prior=0.02).k == 0  # this prompt type's drafts are rejected: do not draft
    assert c.start(4, prior=0.95).k >= 6
    assert c.start(4, prior=0.95, k_max=3).k == 3 and c.start(4, k_min=5).k == 5


def test_the_docstring_examples_hold():
    import doctest

    from specfleet_worker import kcontrol

    assert doctest.testmod(kcontrol).failed == 0
