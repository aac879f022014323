"""The one step-cost model: a calibrated shape refined by live steps, a live level."""
from __future__ import annotations

import doctest
import math
import random

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


def live_steps(c: StepCostModel, true: dict[int, float], n: int, seed: int, burst=lambda i: 1.0) -> None:
    """n steps of mixed sizes at their true cost, times a load that drifts (common to all sizes),
    times 5% noise per step."""
    rng = random.Random(seed)
    load = 1.0
    sizes = sorted(true)
    for i in range(n):
        load = min(max(load * math.exp(rng.gauss(0, 0.02)), 0.5), 2.0)
        rows = rng.choice(sizes)
        c.observe(rows, true[rows] * load * burst(i) * math.exp(rng.gauss(0, 0.05)))


def test_live_steps_correct_a_shape_the_calibration_got_wrong():
    """Calibrated with a short dummy context, rows looked cheaper than they are at real contexts:
    live steps of mixed sizes bring the shape to what they cost, whatever the load did."""
    true = {1: 1.0, 4: 1.08, 6: 1.11, 8: 1.16, 16: 1.45}
    c = StepCostModel()
    c.set_curve({1: 1.0, 4: 1.02, 6: 1.04, 8: 1.06, 16: 1.30})
    live_steps(c, true, 6000, seed=1)
    for r, cost in true.items():
        assert c(r) / c(1) == pytest.approx(cost, rel=0.02), (r, c.relative())


def test_contention_leaves_a_right_shape_alone():
    true = {1: 1.0, 4: 1.08, 8: 1.16, 16: 1.45}
    c = StepCostModel()
    c.set_curve(true)
    live_steps(c, true, 6000, seed=2, burst=lambda i: 2.0 if (i // 500) % 2 else 1.0)  # bursts of 500 steps
    for r, cost in true.items():
        assert c(r) / c(1) == pytest.approx(cost, rel=0.03), (r, c.relative())
    # a long stretch of one size only (one sequence at a fixed K), twice as slow: nothing to compare it with
    c.set_curve(true)
    live_steps(c, {4: 2 * true[4]}, 3000, seed=3)
    assert c.relative() == {r: round(v, 3) for r, v in true.items()}


def test_sizes_between_the_timed_ones_teach_the_points_they_are_priced_from():
    """A busy batch's rows spread over many sizes, few of them timed: each residual counts toward
    the calibrated neighbours its price came from."""
    true = {r: 1.0 + 0.03 * (r - 1) for r in range(1, 33)}  # rows cost 3% each; calibrated as 1.5%
    c = StepCostModel()
    c.set_curve({r: 1.0 + 0.015 * (r - 1) for r in (1, 8, 16, 32)})
    live_steps(c, {r: true[r] for r in [1, *range(9, 32, 2)]}, 3000, seed=4)  # never 8, 16 or 32 itself
    for r in (16, 24, 31):
        assert c(r) / c(1) == pytest.approx(true[r], rel=0.04), (r, c.relative())
    assert sorted(c.seconds) == [1, 8, 16, 32]  # the curve keeps its points


def test_only_single_sequence_steps_refine_the_shape():
    """A batch's cost depends on its sequences' contexts, not its rows alone: batches move the
    level only."""
    c = StepCostModel()
    c.set_curve({1: 1.0, 4: 1.02, 8: 1.06, 16: 1.30})
    before = c.relative()
    rng = random.Random(5)
    for _ in range(3000):
        rows = rng.choice([4, 8, 16])
        c.observe(rows, {4: 1.5, 8: 1.6, 16: 1.7}[rows], seqs=4)
    assert c.relative() == before and c.level > 1.2


def test_calibration_keeps_each_sizes_fastest_round_so_a_neighbours_load_cannot_steepen_the_shape(monkeypatch):
    """Load only adds time: a size slowed in most of its rounds is still priced by its quiet one.
    (A per-size median priced 5 rows at 3.4x one row here, and nothing would draft at 4 sequences.)"""
    from specfleet_engine import engine as engine_module
    from specfleet_engine.engine import Engine
    from specfleet_engine.testing import tiny_model

    true = {r: 1.0 + 0.15 * (r - 1) for r in range(1, 9)}  # seconds of a forward of r new rows
    clock = [0.0]
    calls: dict[int, int] = {}

    def forward(seqs, inputs, logits_rows, **kwargs):
        real(seqs, inputs, logits_rows, **kwargs)  # the KV moves as in a real step; the clock is ours
        rows = len(inputs[0])
        calls[rows] = calls.get(rows, 0) + 1
        slowed = rows == 5 and calls[rows] % 5 != 0  # a neighbour hogs the core in 4 of 5 rounds
        clock[0] += true.get(rows, 1.0) * (2.0 if slowed else 1.0)

    engine = Engine(tiny_model(seed=1))
    real = engine._forward
    monkeypatch.setattr(engine, "_forward", forward)
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    shape = engine.calibrate(sizes=list(range(1, 9)), reps=5)
    assert shape == pytest.approx({r: t / true[1] for r, t in true.items()}, abs=1e-3)
