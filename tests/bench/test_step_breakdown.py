"""specfleet_bench.step_breakdown on the tiny model: every configuration decodes, and the
breakdown adds up."""

import pytest

from specfleet_bench import step_breakdown
from specfleet_worker.testing import tiny_engine


def test_the_breakdown_adds_up_for_every_configuration():
    engine = tiny_engine(k_policy="adaptive")
    engine.calibrate(sizes=[1, 2, 4, 8, 16, 32], reps=1)
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
