"""`specfleet bench select`'s configs and ratios (the fleet runs are episodes: tests/local)."""
from __future__ import annotations

import doctest

from specfleet_bench import method_select
from specfleet_bench.method_select import build_parser, main, spec


def test_the_module_doctests_pass():
    assert doctest.testmod(method_select).failed == 0


def test_a_k_suffix_turns_on_k_tuning_and_keeps_the_config():
    args = build_parser().parse_args([])
    for config in ("self", "ngram", "eagle"):
        plain, tuned = spec(config, args)["spec"], spec(config + "+k", args)["spec"]
        assert plain["speculation"]["kTuning"] == {"enabled": False}
        assert tuned["speculation"]["kTuning"] == {"enabled": True}
        assert {k: v for k, v in tuned.items() if k != "speculation"} == {k: v for k, v in plain.items()
                                                                            if k != "speculation"}
    assert spec("self+k", args)["spec"]["routing"]["select"]["enabled"] is True
    assert spec("ngram+k", args)["spec"]["draft"] == {"method": "ngram"}


def test_an_unknown_config_exits_2_naming_it(capsys):
    assert main(["--configs", "ngram,fast+k"]) == 2
    assert "fast+k" in capsys.readouterr().err
    assert main(["--configs", "table+k"]) == 2  # the table needs --table


def test_a_bad_shift_exits_2_naming_it(capsys, tmp_path):
    assert main(["--shift", "coding", "--seconds", "1"]) == 2
    assert "want CATEGORY@SECONDS" in capsys.readouterr().err
    assert main(["--shift", "poetry@10", "--seconds", "1"]) == 2
    assert "no poetry questions" in capsys.readouterr().err
    assert main(["--shift", "coding@10", "--shift-questions", str(tmp_path / "none.jsonl"), "--seconds", "1"]) == 2
    assert "none.jsonl not found" in capsys.readouterr().err


def test_the_bundled_shift_prompts_are_code_edits_the_router_calls_code():
    """The shift keeps its type: every bundled edit is classified as code, as Spec-Bench's coding
    questions are, and each pastes code for the answer to copy."""
    from specfleet_bench.questions import load_questions
    from specfleet_router.classify import classify

    edits = load_questions(method_select.CODE_EDITS)
    assert len(edits) >= 8
    assert {classify(q["turns"][0]).value for q in edits} == {"code"}
    assert all(q["turns"][0].count("\n") >= 10 and "```python" in q["turns"][0] for q in edits)


def test_a_shift_report_counts_the_loop_s_judgements_after_it():
    args = build_parser().parse_args(["--shift", "coding@100"])
    run = method_select.Run("self", args, [{"category": "coding", "turns": ["a"]}], ["edit"])
    run.shift_at = 1000.0
    run.judged = {940.0, 1000.0, 1060.0, 1120.0004, 1180.0}  # the move's judgement, to the microsecond
    run.loop_doc = {"events": [
        {"time": 970.0, "reason": "MethodChanged", "message": "prompt type chat: eagle -> ngram"},
        {"time": 1060.0, "reason": "TrafficShifted", "message": "prompt type code: ngram's acceptance"},
        {"time": 1120.0, "reason": "MethodChanged", "message": "prompt type code: eagle -> ngram"}]}
    run.calls = [method_select.Call(120.0, 130.0, "coding", 0.0, "code", "ngram", 10)]
    shift = run.report(200.0)["shift"]
    assert shift["windows_judged_after"] == 3 and shift["prompt_types"] == {"code": 1}
    [move] = shift["moves_after"]  # the move before the shift is not counted
    assert move["window"] == 2 and move["message"].startswith("prompt type code")
    assert [e["reason"] for e in shift["restarts_after"]] == ["TrafficShifted"]


def test_a_burst_adds_clients_in_its_window_and_the_tpot_slo_reaches_the_k_configs_only(capsys):
    args = build_parser().parse_args(["--burst", "5@60-180", "--tpot-p99", "0.05"])
    assert spec("ngram+k", args)["spec"]["speculation"]["kTuning"] == {"enabled": True, "tpotP99Seconds": 0.05}
    assert spec("ngram", args)["spec"]["speculation"]["kTuning"] == {"enabled": False}
    assert main(["--burst", "5@200-100", "--seconds", "300"]) == 2
    assert "want CLIENTS@START-END" in capsys.readouterr().err
    assert main(["--burst", "5@100-400", "--seconds", "300"]) == 2
    assert "ends after the run's 300 s" in capsys.readouterr().err


def test_a_burst_report_splits_the_run_and_its_ceiling_changes_by_phase():
    import time

    args = build_parser().parse_args(["--burst", "2@10-20"])
    run = method_select.Run("ngram+k", args, [{"category": "qa", "turns": ["a"]}])
    run.t0 = time.monotonic() - 30.0  # the run started 30 s ago
    zero = time.time() - 30.0
    run.calls = [method_select.Call(s, s + 2.0, "qa", 0.0, "chat", "ngram", 20) for s in (1.0, 12.0, 14.0, 25.0)]
    run.loop_doc = {"events": [{"time": zero + 15.0, "reason": "KCeilingChanged", "message": "kMax 6 -> 3"},
                               {"time": zero + 24.0, "reason": "KCeilingChanged", "message": "kMax 3 -> 4"}]}
    burst = run.report(30.0)["burst"]
    assert [burst[p]["requests"] for p in ("before", "during", "after")] == [1, 2, 1]
    assert [e["message"] for e in burst["during"]["k_ceiling_changes"]] == ["kMax 6 -> 3"]
    assert [e["message"] for e in burst["after"]["k_ceiling_changes"]] == ["kMax 3 -> 4"]
    assert burst["during"]["tokens_per_s"] == 4.0 and burst["during"]["seconds_per_token_p50"] == 0.1
