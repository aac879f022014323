"""The speedup gauge's arithmetic: plain steps price at 1.0 whatever the machine's load, and a
speculative step is re-priced with the engine's calibrated step costs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specfleet_engine.costs import StepCostModel
from specfleet_engine.engine import StepTiming
from specfleet_worker.scheduler import SpeedupMeter


def engine(timing: StepTiming, curve: dict[int, float]):
    costs = StepCostModel()
    costs.set_curve(curve)
    return SimpleNamespace(last_timing=timing, costs=costs)


def test_plain_decoding_reads_one_at_any_speed():
    m = SpeedupMeter()
    curve = {r: 1.0 + 0.05 * (r - 1) for r in range(1, 40)}
    for forward in (0.02, 0.5, 0.03):  # a burst of contention makes one step 20x slower
        t = StepTiming(decode=forward + 0.004, forward=forward, propose=0.0, decode_rows=4, decode_seqs=4, emitted=4)
        m.observe(engine(t, curve), t.decode + 0.001)
    assert m.ratio() == pytest.approx(1.0)


def test_a_speculative_step_is_priced_against_plain_steps_of_the_same_batch():
    # 2 sequences verified 3 drafts each (8 rows) in a forward of 0.012 s; 8 rows cost 1.2x 2 rows.
    # They emitted 6 tokens: plain decoding needs 3 steps of (0.010 forward + 0.002 outside).
    curve = {2: 1.0, 8: 1.2}
    t = StepTiming(prefill=0.0, decode=0.012 + 0.001 + 0.002, forward=0.012, propose=0.001,
                   decode_rows=8, decode_seqs=2, emitted=6)
    m = SpeedupMeter()
    plain, actual = m.observe(engine(t, curve), t.decode)
    assert plain == pytest.approx(3 * (0.010 + 0.002))
    assert m.ratio() == pytest.approx(0.036 / 0.015)
    assert (m.total_plain, m.total_actual) == (pytest.approx(0.036), pytest.approx(0.015))


def test_prefill_counts_the_same_on_both_sides_and_the_window_forgets():
    m = SpeedupMeter(size=2)
    t = StepTiming(prefill=0.5)
    m.observe(engine(t, {1: 1.0}), 0.5)
    assert m.ratio() == 1.0
    m.add(3.0, 1.0)
    m.add(3.0, 1.0)  # the prefill step left the window
    assert m.ratio() == pytest.approx(3.0) and m.total_actual == pytest.approx(2.5)


def test_a_steps_seconds_are_shared_among_its_sequences_and_add_up_to_the_step():
    # one prefill (0.1 s) and two decoding sequences (0.015 s, as above), 0.005 s around them;
    # the first decoding sequence emitted 4 tokens, the second 2
    curve = {2: 1.0, 8: 1.2}
    t = StepTiming(prefill=0.1, decode=0.015, forward=0.012, propose=0.001, decode_rows=8, decode_seqs=2, emitted=6)
    outputs = [SimpleNamespace(stats=None), SimpleNamespace(stats=SimpleNamespace(num_emitted=4)),
               SimpleNamespace(stats=SimpleNamespace(num_emitted=2))]
    e, elapsed = engine(t, curve), 0.12
    (p0, a0), (p1, a1), (p2, a2) = SpeedupMeter.shares(e, elapsed, outputs)
    around = 0.005 / 3
    assert p0 == a0 == pytest.approx(0.1 + around)  # a prefill counts the same on both sides
    assert (a1, a2) == (pytest.approx(0.0075 + around), pytest.approx(0.0075 + around))
    assert (p1, p2) == (pytest.approx(4 * 0.006 + around), pytest.approx(2 * 0.006 + around))  # 0.012 / 2 a token
    plain, actual = SpeedupMeter().observe(e, elapsed)
    assert (p0 + p1 + p2, a0 + a1 + a2) == (pytest.approx(plain), pytest.approx(actual))
