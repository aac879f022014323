import doctest

import pytest

from specfleet_engine import costs as k_policy
from specfleet_engine.costs import AcceptanceEstimator, StepCostModel, choose_ks, expected_tokens


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


def test_k_floor_makes_an_adaptive_engine_verify_at_least_k_min_draft_tokens():
    from specfleet_engine.engine import Engine
    from specfleet_engine.proposers import Proposal
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model

    class Counting:  # a cheap proposer that always has a draft: 1, 2, 3, ...
        name, cheap = "count", True

        def propose(self, seqs, ks):
            return [Proposal(list(range(1, k + 1)), None) for k in ks]

        def rollback(self, seq, num_valid):
            pass

        def release(self, seq):
            pass

    engine = Engine(tiny_model(seed=1, scale=4.0), proposers={"count": Counting()})
    engine.costs.set_curve({r: float(r) for r in range(1, 16)})  # a draft row costs a whole step
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate([5, 6, 7, 8], params, "count", 6)
    assert alone.stats.num_draft_tokens == 0, "drafts never pay at this cost: plain decoding"
    seq = engine.add([5, 6, 7, 8], params, "count", 6)
    seq.k_floor = 2
    engine.step()  # the prefill
    steps = 0
    while not seq.finished:
        room = params.max_tokens - len(seq.output) - 1  # drafts never run past max_tokens
        (out,) = engine.step()
        assert out.stats.num_draft_tokens == min(2, room)
        steps += 1
    assert steps > 3
    assert seq.output == alone.output
