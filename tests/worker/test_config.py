"""engine.json as docs/worker-contract.md defines it, and the live settings the admin moves."""
from __future__ import annotations

import doctest
import json
import logging
import re
import threading
from pathlib import Path

import pytest

from specfleet_api import enums
from specfleet_api.engine_config import MIX_PROBLEM, UNSUPPORTED
from specfleet_api.live_state import KBounds, LiveState
from specfleet_worker import config
from specfleet_worker.config import EngineConfig, LiveConfig
from specfleet_worker.main import main as serve_main
from specfleet_worker.main import parse_args, watch_control_file
from specfleet_worker.testing import wait_for

REPO = Path(__file__).resolve().parents[2]


def contract_example() -> dict:
    text = (REPO / "docs" / "worker-contract.md").read_text()
    return json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))


def test_the_contracts_example_parses():
    cfg = EngineConfig.from_dict(contract_example())
    assert (cfg.model_name, cfg.draft_method, cfg.k_min, cfg.k_max, cfg.k_initial) == ("smollm2-135m", "ngram", 0, 8, 4)
    assert cfg.by_prompt_type == {"code": "ngram", "chat": "draft-model"} and cfg.role == "stable"
    assert (cfg.tree_branching, cfg.tree_choices) == (3, ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))


def test_the_operators_engine_json_parses():
    from specfleet_operator.manifests import engine_config

    spec = {"model": {"name": "m", "uri": "gguf://m.gguf"}, "draft": {"method": "ngram"},
            "speculation": {"kMin": 1, "kMax": 6, "kInitial": 3, "kPolicy": "fixed", "tree": {"branching": 1, "depth": 3}},
            "quantization": "int8", "dtype": "bfloat16", "device": "cuda"}
    try:
        raw = engine_config(spec, "canary")
    except (KeyError, TypeError) as e:  # the operator defaults specs first; say so rather than guess
        pytest.fail(f"engine_config needs a defaulted spec: {e}")
    cfg = EngineConfig.from_dict(raw)
    assert (cfg.k_min, cfg.k_max, cfg.k_policy, cfg.tree_depth, cfg.role) == (1, 6, "fixed", 3, "canary")
    assert cfg.device == "cuda"


def test_unknown_keys_are_ignored_with_a_warning(caplog):
    raw = contract_example() | {"future": 1}
    raw["speculation"] = raw["speculation"] | {"kSchedule": "x"}
    with caplog.at_level(logging.WARNING, logger="specfleet.worker"):
        EngineConfig.from_dict(raw)
    assert "future" in caplog.text and "speculation.kSchedule" in caplog.text


@pytest.mark.parametrize("patch, word", [
    ({"draft": {"method": "magic"}}, "draft.method"),
    ({"quantization": "int3"}, "quantization"),
    ({"speculation": {"kMin": 5, "kMax": 2}}, "kMin"),
    ({"speculation": {"kPolicy": "random"}}, "kPolicy"),
    ({"speculation": {"tree": {"branching": 9}}}, "speculation.tree.branching must be between 1 and 8, got 9"),
    ({"speculation": {"tree": {"branching": 0}}}, "speculation.tree.branching must be between 1 and 8, got 0"),
    ({"speculation": {"tree": {"depth": 17}}}, "speculation.tree.depth must be between 0 and 16, got 17"),
    ({"device": "bogus"}, "device must be one of auto, cpu, cuda, got 'bogus'"),
])
def test_bad_values_are_refused_naming_the_key(patch, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        EngineConfig.from_dict(contract_example() | patch)


@pytest.mark.parametrize("method", enums.SPECULATIVE_METHODS)
def test_tree_caps_are_served_for_every_method_that_drafts(method):
    raw = contract_example() | {"draft": {"method": method, "uri": "gguf://d.gguf"},
                                "speculation": {"tree": {"branching": 3, "depth": 4}}, "device": "cpu"}
    cfg = EngineConfig.from_dict(raw)
    assert (cfg.tree_branching, cfg.tree_depth, cfg.device) == (3, 4, "cpu") and cfg.problems() == []
    defaults = EngineConfig.from_dict(contract_example() | {"speculation": {}})
    assert (defaults.tree_branching, defaults.tree_depth, defaults.device) == (enums.DEFAULT_TREE_BRANCHING, 0, "auto")


@pytest.mark.parametrize("guard, slowdown", [({"maxSlowdownPercent": 2}, 0.02), ({"maxSlowdownPercent": 1}, 0.01),
                                             ({"maxSlowdownPercent": 100}, 1.0), ({}, None), (None, None)])
def test_the_latency_guard_is_a_percentage_and_absent_means_off(guard, slowdown):
    raw = contract_example()
    raw["speculation"] = {k: v for k, v in raw["speculation"].items() if k != "latencyGuard"}
    if guard is not None:
        raw["speculation"]["latencyGuard"] = guard
    cfg = EngineConfig.from_dict(raw)
    assert cfg.max_slowdown == slowdown and cfg.problems() == []


@pytest.mark.parametrize("guard, words", [
    ({"maxSlowdownPercent": 0}, "speculation.latencyGuard.maxSlowdownPercent must be between 1 and 100 (absent: "
                                "no guard), got 0"),
    ({"maxSlowdownPercent": 101}, "speculation.latencyGuard.maxSlowdownPercent must be between 1 and 100 (absent: "
                                  "no guard), got 101"),
    ({"maxSlowdownPercent": "5"}, "speculation.latencyGuard.maxSlowdownPercent must be an integer, got '5'"),
    ({"maxSlowdownPercent": True}, "speculation.latencyGuard.maxSlowdownPercent must be an integer, got True"),
    ({"maxSlowdownPercent": 2.5}, "speculation.latencyGuard.maxSlowdownPercent must be an integer, got 2.5"),
    (5, "speculation.latencyGuard must be an object, got 5"),
])
def test_a_bad_latency_guard_is_refused_naming_the_key(guard, words):
    raw = contract_example()
    raw["speculation"] = raw["speculation"] | {"latencyGuard": guard}
    with pytest.raises(ValueError, match=re.escape(words)):
        EngineConfig.from_dict(raw)


@pytest.mark.parametrize("ngram, tokens", [({"corpusTokens": 16384}, 16384), ({"corpusTokens": 0}, 0), ({}, 0),
                                           (None, 0), ({"corpusTokens": enums.NGRAM_CORPUS_TOKENS_MAX},
                                                       enums.NGRAM_CORPUS_TOKENS_MAX)])
def test_the_ngram_corpus_is_a_token_count_and_absent_means_none(ngram, tokens):
    raw = contract_example()
    raw["draft"] = {"method": "ngram"} | ({"ngram": ngram} if ngram is not None else {})
    cfg = EngineConfig.from_dict(raw)
    assert cfg.ngram_corpus_tokens == tokens and cfg.problems() == []
    assert enums.DEFAULT_NGRAM_CORPUS_TOKENS == EngineConfig.ngram_corpus_tokens


@pytest.mark.parametrize("ngram, words", [
    ({"corpusTokens": -1}, f"draft.ngram.corpusTokens must be between 0 and {enums.NGRAM_CORPUS_TOKENS_MAX}, got -1"),
    ({"corpusTokens": enums.NGRAM_CORPUS_TOKENS_MAX + 1}, "draft.ngram.corpusTokens must be between 0 and"),
    ({"corpusTokens": "16k"}, "draft.ngram.corpusTokens must be an integer, got '16k'"),
    ({"corpusTokens": True}, "draft.ngram.corpusTokens must be an integer, got True"),
    ([1], "draft.ngram must be an object, got [1]"),
])
def test_a_bad_ngram_corpus_is_refused_naming_the_key(ngram, words):
    raw = contract_example()
    raw["draft"] = {"method": "ngram", "ngram": ngram}
    with pytest.raises(ValueError, match=re.escape(words)):
        EngineConfig.from_dict(raw)


def test_the_latency_guards_unknown_keys_are_warned_about_and_its_own_are_not(caplog):
    raw = contract_example()
    raw["speculation"] = raw["speculation"] | {"latencyGuard": {"maxSlowdownPercent": 2, "p99": 1}}
    with caplog.at_level(logging.WARNING, logger="specfleet.api"):
        assert EngineConfig.from_dict(raw).max_slowdown == 0.02
    assert "speculation.latencyGuard.p99" in caplog.text and "'speculation.latencyGuard'" not in caplog.text
    assert "maxSlowdownPercent" not in caplog.text


MEDUSA = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def with_tree(tree: object) -> dict:
    raw = contract_example()
    raw["speculation"] = raw["speculation"] | {"tree": tree}
    return raw


@pytest.mark.parametrize("tree, shape", [
    ({"branching": 3, "choices": MEDUSA}, tuple(map(tuple, MEDUSA))),
    ({"branching": 1, "depth": 2, "choices": [[0], [0, 0]]}, ((0,), (0, 0))),
    ({"branching": 3, "choices": []}, ()), ({"branching": 3, "choices": None}, ()), ({"branching": 3}, ()),
])
def test_tree_choices_are_a_tuple_of_paths_and_absent_means_no_shape(tree, shape):
    cfg = EngineConfig.from_dict(with_tree(tree))
    assert cfg.tree_choices == shape and cfg.problems() == []
    assert EngineConfig.tree_choices == ()


@pytest.mark.parametrize("choices, words", [
    ([[0], [1, 0]], "speculation.tree.choices[1] [1, 0]: its prefix [1] is not listed"),
    ([[0], [2]], "speculation.tree.choices[1] [2]: its sibling [1] is not listed"),
    ([[0], [1], [2], [3]], "speculation.tree.choices[3] [3]: rank 3 is not below speculation.tree.branching (3)"),
    ([[0], [0, 0], [0, 0, 0]], "speculation.tree.choices[2] [0, 0, 0]: 3 ranks, longer than speculation.tree.depth (2)"),
    ([[0], [0]], "speculation.tree.choices[1] [0]: listed twice (first as speculation.tree.choices[0])"),
    ([[0], [8]], "speculation.tree.choices[1] [8]: rank 8 is not between 0 and 7"),
    ([[0], []], "speculation.tree.choices[1] []: a path holds 1 to 16 ranks, got 0"),
    ([[0]] * 65, "speculation.tree.choices holds at most 64 paths, got 65"),
])
def test_a_bad_tree_shape_is_refused_naming_the_path(choices, words):
    with pytest.raises(ValueError, match=re.escape(f"speculation.tree.choices: {words}")):
        EngineConfig.from_dict(with_tree({"branching": 3, "depth": 2, "choices": choices}))
    problems = EngineConfig.from_dict(with_tree({"branching": 3, "depth": 2, "choices": choices}), check=False).problems()
    assert {p.field for p in problems} == {"speculation.tree.choices"} and {p.reason for p in problems} == {"InvalidSpec"}


@pytest.mark.parametrize("choices, words", [
    (5, "speculation.tree.choices must be a list of paths (lists of sibling ranks), got 5"),
    ({"0": [0]}, "speculation.tree.choices must be a list of paths (lists of sibling ranks), got {'0': [0]}"),
    ([[0], 1], "speculation.tree.choices[1] must be a list of integers (sibling ranks), got 1"),
    ([[0], [0, "1"]], "speculation.tree.choices[1] must be a list of integers (sibling ranks), got [0, '1']"),
    ([[True]], "speculation.tree.choices[0] must be a list of integers (sibling ranks), got [True]"),
    ([[0.0]], "speculation.tree.choices[0] must be a list of integers (sibling ranks), got [0.0]"),
])
def test_tree_choices_of_the_wrong_type_are_refused_naming_the_field(choices, words):
    with pytest.raises(ValueError, match=re.escape(f"engine.json: {words}")):
        EngineConfig.from_dict(with_tree({"branching": 3, "choices": choices}), check=False)


def test_tree_choices_are_known_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="specfleet.api"):
        EngineConfig.from_dict(with_tree({"branching": 3, "choices": MEDUSA}))
    assert "choices" not in caplog.text


def test_check_config_refuses_a_bad_tree_shape_and_names_a_good_one(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(with_tree({"branching": 3, "choices": [[0], [1, 0]]})))
    assert serve_main(["--check-config", str(bad), "--skip-files"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"{bad}: speculation.tree.choices: speculation.tree.choices[1] [1, 0]: its prefix [1] is not listed"]
    good = tmp_path / "good.json"
    good.write_text(json.dumps(with_tree({"branching": 3, "choices": MEDUSA})))
    assert serve_main(["--check-config", str(good), "--skip-files"]) == 0
    assert capsys.readouterr().out.endswith("kPolicy adaptive, tree choices 7 nodes\n")


@pytest.mark.parametrize("patch, field, value, served", [
    ({"quantization": "fp8"}, "quantization", "fp8", enums.SERVED_QUANTIZATIONS),
    ({"quantization": "fp4"}, "quantization", "fp4", enums.SERVED_QUANTIZATIONS),
    ({"dtype": "float16"}, "dtype", "float16", enums.SERVED_DTYPES),
    ({"model": {"name": "m", "uri": "hf://org/m"}}, "model.uri scheme", "hf", enums.SERVED_URI_SCHEMES),
    ({"model": {"name": "m", "uri": "s3://bucket/m"}}, "model.uri scheme", "s3", enums.SERVED_URI_SCHEMES),
])
def test_what_the_worker_does_not_serve_is_refused_as_not_supported_yet(patch, field, value, served):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_dict(contract_example() | patch)
    assert enums.not_served(field, value, served) in str(e.value)
    (problem,) = EngineConfig.from_dict(contract_example() | patch, check=False).problems()
    assert problem.reason == UNSUPPORTED


def test_a_method_no_worker_serves_is_refused_as_not_supported_yet(monkeypatch):
    """Every draft method the API names is served today; were one reserved again (eagle here,
    pretended), engine.json naming it as the method or a route would be refused, Unsupported."""
    from specfleet_api import engine_config

    served = tuple(m for m in enums.SERVED_METHODS if m != "eagle")
    monkeypatch.setattr(engine_config, "SERVED_METHODS", served)
    for patch, field in [({"draft": {"method": "eagle", "uri": "/m/eagle"}}, "draft.method"),
                         ({"routing": {"default": "ngram", "byPromptType": {"chat": "eagle"}}},
                          "routing.byPromptType.chat")]:
        with pytest.raises(ValueError, match=re.escape(enums.not_served(field, "eagle", served))):
            EngineConfig.from_dict(contract_example() | patch)
        (problem,) = EngineConfig.from_dict(contract_example() | patch, check=False).problems()
        assert problem.reason == UNSUPPORTED


def test_the_default_and_the_served_values_pass():
    for method in enums.SERVED_METHODS:
        for quantization in enums.SERVED_QUANTIZATIONS:
            for dtype in enums.SERVED_DTYPES:
                raw = contract_example() | {"quantization": quantization, "dtype": dtype,
                                            "draft": {"method": method, "uri": "gguf://d.gguf"}}
                assert EngineConfig.from_dict(raw).problems() == []
    assert EngineConfig().problems() == []


@pytest.mark.parametrize("method", ["draft-model", "eagle", "medusa"])
def test_ngram_mix_goes_with_a_weighted_method_and_absent_means_off(method):
    raw = contract_example()
    raw["draft"] = {"method": method, "uri": "/heads/h", "ngram": {"mix": True, "corpusTokens": 4096}}
    cfg = EngineConfig.from_dict(raw)
    assert cfg.ngram_mix is True and cfg.ngram_corpus_tokens == 4096 and cfg.problems() == []
    raw["draft"]["ngram"] = {}
    assert EngineConfig.from_dict(raw).ngram_mix is False is EngineConfig.ngram_mix


@pytest.mark.parametrize("method", ["ngram", "none"])
def test_ngram_mix_without_drafts_to_mix_into_is_refused_naming_the_field(method):
    raw = contract_example() | {"draft": {"method": method, "ngram": {"mix": True}}}
    (problem,) = EngineConfig.from_dict(raw, check=False).problems()
    assert problem.field == "draft.ngram.mix" and problem.message == f"{MIX_PROBLEM}, got {method}"
    with pytest.raises(ValueError, match=re.escape("draft.ngram.mix: draft.ngram.mix needs draft.method")):
        EngineConfig.from_dict(raw)
    raw["draft"]["ngram"]["mix"] = "yes"
    with pytest.raises(ValueError, match=re.escape("draft.ngram.mix must be true or false, got 'yes'")):
        EngineConfig.from_dict(raw)


def test_check_config_refuses_ngram_mix_with_method_ngram_and_names_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(contract_example() | {"draft": {"method": "ngram", "ngram": {"mix": True}}}))
    assert serve_main(["--check-config", str(bad), "--skip-files"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"{bad}: draft.ngram.mix: {MIX_PROBLEM}, got ngram\n"
    good = tmp_path / "good.json"
    good.write_text(json.dumps(contract_example() | {"draft": {"method": "eagle", "uri": "smollm2-135m-eagle",
                                                               "ngram": {"mix": True}}}))
    assert serve_main(["--check-config", str(good), "--skip-files"]) == 0
    assert "draft eagle + ngram mixed" in capsys.readouterr().out


def test_check_config_says_ok_in_one_line_or_each_reason_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECFLEET_MODEL_CACHE", str(tmp_path))
    (tmp_path / "target.gguf").write_bytes(b"GGUF")
    good = tmp_path / "good.json"
    good.write_text(json.dumps(contract_example() | {"model": {"name": "t", "uri": "gguf://target.gguf"}}))
    assert serve_main(["--check-config", str(good)]) == 0
    out, err = capsys.readouterr()
    assert out == f"OK {good}: model t ({tmp_path / 'target.gguf'}), draft ngram, quantization none, dtype auto, " \
                  "kPolicy adaptive, tree choices 7 nodes\n" and err == ""
    guarded = tmp_path / "guarded.json"
    raw = json.loads(good.read_text())
    raw["speculation"] = raw["speculation"] | {"latencyGuard": {"maxSlowdownPercent": 2}}
    guarded.write_text(json.dumps(raw))
    assert serve_main(["--check-config", str(guarded), "--skip-files"]) == 0
    assert capsys.readouterr().out.endswith("kPolicy adaptive, latency guard 2%, tree choices 7 nodes\n")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(contract_example() | {"quantization": "fp8", "dtype": "float16"}))
    assert serve_main(["--check-config", str(bad), "--skip-files"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"{bad}: quantization: " + enums.not_served("quantization", "fp8", enums.SERVED_QUANTIZATIONS),
        f"{bad}: dtype: " + enums.not_served("dtype", "float16", enums.SERVED_DTYPES)]
    absent = tmp_path / "absent.json"
    absent.write_text(json.dumps(contract_example() | {"model": {"name": "t", "uri": "gguf://nowhere.gguf"}}))
    assert serve_main(["--check-config", str(absent)]) == 2
    assert f"no file at nowhere.gguf or {tmp_path / 'nowhere.gguf'}" in capsys.readouterr().err
    assert serve_main(["--check-config", str(absent), "--skip-files"]) == 0
    assert serve_main(["--check-config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--skip-files"])


def test_the_worker_refuses_what_it_does_not_serve_before_opening_a_port(tmp_path, capsys):
    bad = tmp_path / "engine.json"
    bad.write_text(json.dumps(contract_example() | {"quantization": "fp8"}))
    assert serve_main(["--config", str(bad), "--grpc-port", "0", "--http-port", "0"]) == 2
    rec = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert rec["msg"] == "bad configuration" and "quantization 'fp8' is not supported yet" in rec["error"]


def test_the_model_is_found_as_is_or_in_the_model_cache_else_by_name(tmp_path, monkeypatch):
    from specfleet_worker.main import _model_source

    monkeypatch.setenv("SPECFLEET_MODEL_CACHE", str(tmp_path))
    cfg = EngineConfig(model_name="smollm2-135m", model_uri="gguf://cached.gguf")
    assert _model_source(cfg) == "smollm2-135m"
    (tmp_path / "cached.gguf").write_bytes(b"GGUF")
    assert _model_source(cfg) == str(tmp_path / "cached.gguf")
    assert _model_source(EngineConfig(model_uri=f"file://{tmp_path / 'cached.gguf'}")) == str(tmp_path / "cached.gguf")


def test_the_engine_computes_in_every_served_dtype_and_nothing_else():
    from specfleet_engine.factory import TORCH_DTYPES

    assert set(TORCH_DTYPES) == {enums.resolve_dtype(d, device) for d in enums.DTYPE_CHOICES for device in enums.DEVICES}
    with pytest.raises(ValueError, match="not supported yet"):
        enums.resolve_dtype("float16")


def test_routes_to_methods_the_worker_lacks_fall_back_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="specfleet.worker"):
        live = LiveConfig(EngineConfig.from_dict(contract_example()), ["ngram"])
    s = live.settings
    assert s.by_prompt_type == {"code": "ngram", "chat": "ngram"} and "draft-model" in caplog.text
    assert s.method_for("", "chat") == "ngram" and s.method_for("none", "code") == "none"
    assert s.method_for("auto", "unknown") == "ngram"


def test_live_updates_validate_and_speculation_off_routes_everything_to_none():
    live = LiveConfig(EngineConfig(), ["ngram"])
    with pytest.raises(ValueError, match="k_min"):
        live.update(k_min=3, k_max=1)
    with pytest.raises(ValueError, match="default_method"):
        live.update(default_method="eagle")
    live.update(speculation_enabled=False)
    assert live.settings.method_for("ngram", "code") == "none"
    live.update(speculation_enabled=True, by_prompt_type={"math": "none"})
    live.update(by_prompt_type={"math": ""})
    assert "math" not in live.settings.by_prompt_type


def test_the_control_file_is_applied_when_it_changes_and_its_off_is_the_soft_one(tmp_path):
    live = LiveConfig(EngineConfig(k_min=1, k_max=8), ["ngram"])
    path = tmp_path / "control.json"
    path.write_text(json.dumps({"speculate": False, "kMin": 1, "kMax": 0}))  # the operator's fallback
    stop = threading.Event()
    t = threading.Thread(target=watch_control_file, args=(path, live, stop, 0.01))
    t.start()
    try:
        wait_for(lambda: not live.settings.default_speculate, 5, "speculate: false")
        s = live.settings
        # soft: the hard switch stays on, and a probe keeps the bounds in force (kMax 0 means "off" there)
        assert s.speculation_enabled and (s.k_min, s.k_max) == (1, 8)
        assert s.method_for("ngram", "code") == "none" and s.method_for("ngram", "code", probe=True) == "ngram"
        path.write_text(json.dumps({"speculate": True, "kMin": 2, "kMax": 5}))
        wait_for(lambda: live.settings.default_speculate, 5, "speculate: true")
        assert (live.settings.k_min, live.settings.k_max) == (2, 5)
        path.write_text(json.dumps({"speculate": False, "kMin": 1, "kMax": 3}))  # bounds beside the off apply
        wait_for(lambda: not live.settings.default_speculate, 5, "speculate: false with bounds")
        assert (live.settings.k_min, live.settings.k_max) == (1, 3)
    finally:
        stop.set()
        t.join()


def test_the_config_docstring_examples_hold():
    assert doctest.testmod(config).failed == 0


def test_the_soft_off_runs_only_probes_and_the_hard_off_runs_nothing():
    live = LiveConfig(EngineConfig(), ["ngram"])
    live.update(by_prompt_type={"code": "ngram"})
    on = live.settings
    assert on.method_for("", "code") == on.method_for("auto", "code") == on.method_for("ngram", "chat") == "ngram"
    assert on.drafts("ngram", probe=False) and not on.drafts("none", probe=True)
    soft = live.update(default_speculate=False)
    assert soft.speculation_enabled
    # a method named without the probe flag (a caller of its own, a router on an older state) runs plain
    assert soft.method_for("", "code") == soft.method_for("ngram", "code") == "none"
    assert soft.method_for("ngram", "chat", probe=True) == soft.method_for("", "code", probe=True) == "ngram"
    assert soft.method_for("none", "code", probe=True) == "none"
    # running requests: those not probes stop drafting, probes go on
    assert not soft.drafts("ngram", probe=False) and soft.drafts("ngram", probe=True)
    hard = live.update(speculation_enabled=False, default_speculate=True)
    assert hard.method_for("ngram", "code", probe=True) == hard.method_for("", "code") == "none"
    assert not hard.drafts("ngram", probe=True) and not hard.drafts("ngram", probe=False)
    both = live.update(default_speculate=False)
    assert not both.drafts("ngram", probe=True)
    back = live.update(speculation_enabled=True, default_speculate=True)
    assert back.method_for("", "code") == "ngram" and back.drafts("ngram", probe=False)


def test_the_live_states_speculate_is_the_soft_switch_and_its_kmax_0_keeps_the_bounds():
    live = LiveConfig(EngineConfig(k_min=1, k_max=8), ["ngram"])
    live.apply_live_state(LiveState(speculate=False, k={"stable": KBounds(0, 0), "canary": KBounds(2, 3)}), "stable")
    s = live.settings
    assert s.speculation_enabled and not s.default_speculate and (s.k_min, s.k_max) == (1, 8)
    live.apply_live_state(LiveState(speculate=False, k={"stable": KBounds(2, 4)}), "stable")
    assert (live.settings.k_min, live.settings.k_max) == (2, 4) and not live.settings.default_speculate
    live.apply_live_state(LiveState(speculate=True, k={"stable": KBounds(0, 0)}), "stable")  # K 0 asked for
    s = live.settings
    assert s.default_speculate and (s.k_min, s.k_max) == (0, 0)


def test_process_flags_and_defaults_follow_the_contract():
    a = parse_args([])
    assert (a.host, a.grpc_port, a.http_port, a.drain_seconds, a.config) == ("127.0.0.1", 50051, 8080, 30.0, None)
    assert (a.admin_host, a.admin_port) == ("127.0.0.1", 50060)  # Admin is unauthenticated: loopback unless told
    a = parse_args(["--config", "/etc/specfleet/engine.json", "--host", "0.0.0.0", "--grpc-port", "1",
                    "--http-port", "2", "--drain-seconds", "5"])
    assert (a.host, a.grpc_port, a.http_port, a.drain_seconds) == ("0.0.0.0", 1, 2, 5.0)
    with pytest.raises(SystemExit):
        parse_args(["--max-batch-size", "0"])
    assert parse_args([]).prefill_chunk == 0 and parse_args(["--prefill-chunk", "256"]).prefill_chunk == 256
    with pytest.raises(SystemExit):
        parse_args(["--prefill-chunk", "-1"])


def test_the_calibration_sizes_docstring_holds():
    import doctest

    from specfleet_worker import main

    assert doctest.testmod(main).failed == 0


def test_the_served_engine_is_adaptive_and_calibrated_up_to_a_full_batch_of_drafts():
    from specfleet_worker.main import build_engine

    raw = {"model": {"name": "tiny-random"}, "speculation": {"tree": {"branching": 3, "depth": 5},
                                                             "latencyGuard": {"maxSlowdownPercent": 3}},
           "draft": {"method": "ngram", "ngram": {"corpusTokens": 4096}}}
    engine = build_engine(EngineConfig.from_dict(raw), max_kv_tokens=2048, max_batch_size=2, prefill_chunk=64)
    assert engine.k_policy.name == "adaptive" and engine.prefill_chunk == 64  # --prefill-chunk reaches the engine
    assert engine.proposers["ngram"].corpus.capacity == 4096  # the n-gram corpus reaches the proposer
    assert engine.k_policy.max_slowdown == 0.03  # engine.json's latency guard reaches the policy
    assert (engine.tree_branching, engine.tree_depth) == (3, 5)  # the caps reach the engine
    assert max(engine.costs.seconds) == 2 * (8 + 1)  # max batch x (K_max + 1) rows
    values = [engine.costs.seconds[r] for r in sorted(engine.costs.seconds)]
    assert values == sorted(values)


def test_the_engine_builder_thread_returns_results_and_raises_errors():
    import threading

    from specfleet_worker.main import on_short_lived_thread

    assert on_short_lived_thread(lambda: threading.current_thread().name) == "build-engine"
    with pytest.raises(ZeroDivisionError):
        on_short_lived_thread(lambda: 1 / 0)


def test_the_device_follows_torch(monkeypatch):
    from specfleet_engine import factory

    monkeypatch.setattr(factory.torch.cuda, "is_available", lambda: True)
    assert (factory.device_of("auto"), factory.device_of("cpu")) == ("cuda", "cpu")
    monkeypatch.setattr(factory.torch.cuda, "is_available", lambda: False)
    assert factory.device_of("auto") == "cpu"
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        factory.device_of("tpu")


@pytest.mark.gpu
def test_on_cuda_the_model_loads_on_the_gpu_in_bfloat16_by_default():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specfleet_engine.factory import build_engine_parts

    model, _, _ = build_engine_parts("smollm2-135m", "auto", device="auto")
    weight = next(model.parameters())
    assert (weight.device.type, weight.dtype) == ("cuda", torch.bfloat16)
