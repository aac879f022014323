"""specfleet_bench.step_breakdown on the tiny model: every configuration decodes, and the
breakdown adds up."""

import pytest

from specfleet_bench import step_breakdown
from specfleet_worker.testing import tiny_engine


def test_the_breakdown_adds_up_for_every_configuration():
    # fixed K: the adaptive policy prices drafts by timed step costs, and on a loaded machine a
    # one-rep calibration can price every draft out (tau 1 with the corpus and without)
    engine = tiny_engine(k_policy="fixed")
    prompts = [[11, 3, 27, 8, 40, 2, 19]] * 2  # a repeat: the corpus holds the first one's answer
    res = step_breakdown.breakdown(engine, prompts, max_tokens=16)
    assert set(res) == set(step_breakdown.CONFIGS)
    for name, r in res.items():
        assert r["tau"] >= 1.0 and r["rows"] >= 1.0 and r["tok_s"] > 0, name
        assert r["step_ms"] == pytest.approx(r["forward_ms"] + r["propose_ms"] + r["other_ms"], abs=0.02), name
    assert res["chain+corpus"]["tau"] > res["chain"]["tau"]


def test_bad_arguments_exit_2_naming_them(capsys):
    with pytest.raises(SystemExit) as e:
        step_breakdown.main(["--questions", "0"])
    assert e.value.code == 2 and "--questions" in capsys.readouterr().err


def test_the_refinement_check_runs_both_modes_and_restores_the_curve():
    # fixed K: the adaptive policy prices drafts by timed step costs, and on a loaded machine a
    # one-rep calibration can price every draft out (tau 1 with the corpus and without)
    engine = tiny_engine(k_policy="fixed")
    before = dict(engine.costs.seconds)
    res = step_breakdown.refinement(engine, [[11, 3, 27, 8, 40, 2, 19]] * 3, max_tokens=48, rounds=2)
    assert set(res) == {"off", "on"}
    for mode, r in res.items():
        assert r["tok_s"] > 0 and r["forward_over_predicted_by_rows"].get(1) == 1.0, (mode, r)
    assert engine.costs.seconds == before and engine.costs.refine_every == 256
