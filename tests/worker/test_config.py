"""engine.json as docs/worker-contract.md defines it, and the live settings the admin moves."""
from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

import pytest

from specfleet_worker.config import EngineConfig, LiveConfig
from specfleet_worker.main import parse_args, watch_control_file

REPO = Path(__file__).resolve().parents[2]


def contract_example() -> dict:
    text = (REPO / "docs" / "worker-contract.md").read_text()
    return json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))


def test_the_contracts_example_parses():
    cfg = EngineConfig.from_dict(contract_example())
    assert (cfg.model_name, cfg.draft_method, cfg.k_min, cfg.k_max, cfg.k_initial) == ("smollm2-135m", "ngram", 0, 8, 4)
    assert cfg.by_prompt_type == {"code": "ngram", "chat": "draft-model"} and cfg.role == "stable"


def test_the_operators_engine_json_parses():
    from specfleet_operator.manifests import engine_config

    spec = {"model": {"name": "m", "uri": "gguf://m.gguf"}, "draft": {"method": "ngram"},
            "speculation": {"kMin": 1, "kMax": 6, "kInitial": 3, "kPolicy": "fixed", "tree": {"branching": 2, "depth": 3}},
            "quantization": "int8", "dtype": "bf16"}
    try:
        raw = engine_config(spec, "canary")
    except (KeyError, TypeError) as e:  # the operator defaults specs first; say so rather than guess
        pytest.fail(f"engine_config needs a defaulted spec: {e}")
    cfg = EngineConfig.from_dict(raw)
    assert (cfg.k_min, cfg.k_max, cfg.k_policy, cfg.tree_branching, cfg.role) == (1, 6, "fixed", 2, "canary")


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
])
def test_bad_values_are_refused_naming_the_key(patch, word):
    with pytest.raises(ValueError, match=word):
        EngineConfig.from_dict(contract_example() | patch)


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


def test_the_control_file_is_applied_when_it_changes(tmp_path):
    live = LiveConfig(EngineConfig(k_min=1, k_max=8), ["ngram"])
    path = tmp_path / "control.json"
    path.write_text(json.dumps({"speculate": False, "kMin": 1, "kMax": 0}))
    stop = threading.Event()
    t = threading.Thread(target=watch_control_file, args=(path, live, stop, 0.01))
    t.start()
    try:
        for _ in range(500):
            if not live.settings.speculation_enabled:
                break
            stop.wait(0.01)
        assert not live.settings.speculation_enabled and (live.settings.k_min, live.settings.k_max) == (0, 0)
        path.write_text(json.dumps({"speculate": True, "kMin": 2, "kMax": 5}))
        for _ in range(500):
            if live.settings.speculation_enabled:
                break
            stop.wait(0.01)
        assert live.settings.speculation_enabled and (live.settings.k_min, live.settings.k_max) == (2, 5)
    finally:
        stop.set()
        t.join()


def test_process_flags_and_defaults_follow_the_contract():
    a = parse_args([])
    assert (a.host, a.grpc_port, a.http_port, a.drain_seconds, a.config) == ("127.0.0.1", 50051, 8080, 30.0, None)
    a = parse_args(["--config", "/etc/specfleet/engine.json", "--host", "0.0.0.0", "--grpc-port", "1",
                    "--http-port", "2", "--drain-seconds", "5"])
    assert (a.host, a.grpc_port, a.http_port, a.drain_seconds) == ("0.0.0.0", 1, 2, 5.0)
    with pytest.raises(SystemExit):
        parse_args(["--max-batch-size", "0"])


def test_the_calibration_sizes_docstring_holds():
    import doctest

    from specfleet_worker import main

    assert doctest.testmod(main).failed == 0


def test_the_served_engine_is_adaptive_and_calibrated_up_to_a_full_batch_of_drafts():
    from specfleet_worker.main import build_engine

    engine = build_engine(EngineConfig(model_name="tiny-random"), max_kv_tokens=2048, max_batch_size=2)
    assert engine.adaptive_k
    assert max(engine.costs.seconds) == 2 * (8 + 1)  # max batch x (K_max + 1) rows
    values = [engine.costs.seconds[r] for r in sorted(engine.costs.seconds)]
    assert values == sorted(values)


def test_the_engine_builder_thread_returns_results_and_raises_errors():
    import threading

    from specfleet_worker.main import on_short_lived_thread

    assert on_short_lived_thread(lambda: threading.current_thread().name) == "build-engine"
    with pytest.raises(ZeroDivisionError):
        on_short_lived_thread(lambda: 1 / 0)
