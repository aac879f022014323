"""The one step-cost model: a calibrated shape refined by live steps, a live level."""
from __future__ import annotations

import doctest
import math
import random

import pytest

from specfleet_engine import costs
from specfleet_engine.costs import StepCostModel, batch_features
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


def test_a_batch_is_priced_by_its_sequences_and_contexts_too():
    c = StepCostModel()
    c.set_curve({1: 1.0, 16: 1.3, 48: 2.0})
    assert c(16, 16, None) == c(16)  # without a context: the rows alone, as before
    c.set_batch(per_seq=0.05, per_context=1e-4, per_row_context=1e-5, base_context=128)
    assert c(1, 1, 128) == c(1) == 1.0  # the calibration's own shape
    assert c(16, 16, 16 * 512) == pytest.approx(1.3 + 0.05 * 15 + 1e-4 * (16 * 512 - 128) + 1e-5 * 16 * (512 - 128))
    # the rows drafts add are priced at the batch's mean context
    assert c(48, 16, 16 * 512) - c(16, 16, 16 * 512) == pytest.approx(0.7 + 1e-5 * 32 * (512 - 128))
    c.observe(16, 2 * c(16, 16, 16 * 512), 16, 16 * 512)  # the level follows the full price
    assert c.level == pytest.approx(2 ** c.smoothing)


def test_calibration_fits_the_batch_terms_a_known_cost_law_would_have(monkeypatch):
    """The engine's forwards replaced by a clock that a known law moves: rows, plus 2 ms a
    sequence beyond one, 1 us a context token, 3 us a row-context token. The fit finds them."""
    from specfleet_engine import engine as engine_module
    from specfleet_worker.testing import tiny_engine

    engine = tiny_engine(max_kv_tokens=16384)
    now = [0.0]
    law = (2e-3, 1e-6, 3e-6)

    def forward(seqs, inputs, logits_rows, trees=None):
        rows, context = sum(map(len, inputs)), sum(s.block_table.num_tokens for s in seqs)
        now[0] += 0.010 + 0.001 * rows + sum(w * x for w, x in zip(law, batch_features(rows, len(seqs), context, 128)))
        for s, new in zip(seqs, inputs):
            s.block_table.append_slots(len(new))

    monkeypatch.setattr(engine, "_forward", forward)
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: now[0])
    engine.calibrate(sizes=[1, 2, 4, 8, 16, 32, 48], context=128, reps=3)
    assert engine.costs.batch_weights() == pytest.approx(law, rel=0.02)
