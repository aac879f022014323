"""The one step-cost model: a calibrated shape, a live level."""
from __future__ import annotations

import doctest

import pytest

from specfleet_engine import costs
from specfleet_engine.costs import StepCostModel
from specfleet_engine.k_policies import choose_ks


def test_docstring_examples():
    assert doctest.testmod(costs).failed == 0


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
