"""The operator's contract with the worker: every engine.json the operator renders from an example
in deploy/examples/ passes `specfleet serve --check-config`, or the example is rejected before
any pod is created (CEL at the API server, and the operator's own Ready=False, Unsupported).
Which one is asserted per file (testing.EXAMPLE_VERDICTS; test_crd holds the CEL half of
"rejected"), so no example can crash-loop unnoticed.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from specfleet_api import fleet_spec as fs
from specfleet_operator import spec as specs
from specfleet_operator.testing import EXAMPLE_VERDICTS as VERDICTS
from specfleet_worker.main import check_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
BLOCK_TORCH = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, *_):\n"
               "        if name.split('.')[0] in ('torch', 'triton'):\n"
               "            raise ImportError(f'{name} is blocked in this test')\n"
               "sys.meta_path.insert(0, Block())\n")


def rendered(path: pathlib.Path, tmp_path: pathlib.Path) -> list[pathlib.Path]:
    """engine.json of each role the example runs, as the operator writes it into the ConfigMap."""
    return rendered_spec(yaml.safe_load(path.read_text())["spec"], path.stem, tmp_path)


def rendered_spec(spec: dict, stem: str, tmp_path: pathlib.Path) -> list[pathlib.Path]:
    spec = specs.with_defaults(spec)
    out = []
    for role in ("stable", "canary") if spec.get("canary") else ("stable",):
        f = tmp_path / f"{stem}-{role}.json"
        f.write_text(json.dumps(fs.engine_config(spec, role)))
        out.append(f)
    return out


def reserved_spec() -> dict:
    """The n-gram example with values the API reserves and no worker serves (no example asks for
    one: every example is served): fp8 weights, and a float16 canary."""
    spec = yaml.safe_load((ROOT / "deploy" / "examples" / "ngram.yaml").read_text())["spec"]
    return {**spec, "quantization": "fp8", "canary": {"weight": 5, "overrides": {"dtype": "float16"}}}


def test_every_example_has_a_verdict():
    assert {p.stem for p in EXAMPLES} == set(VERDICTS)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_is_served_or_rejected_before_any_pod(path, tmp_path, capsys):
    spec = specs.with_defaults(yaml.safe_load(path.read_text())["spec"])
    problems = specs.problems(spec)
    for f in rendered(path, tmp_path):
        # the weights are looked for only where the worker runs (see test_weights_are_looked_for_...)
        rc = check_config(str(f), files=False)
        out, err = capsys.readouterr()
        if VERDICTS[path.stem] == "served":
            assert rc == 0 and err == "", err
            assert out.startswith(f"OK {f}: ") and out.count("\n") == 1
        else:
            assert rc == 2 and out == ""
            assert "is not supported yet" in err
            # the worker would refuse what the operator refuses, in the same words
            assert all(p.message in err for p in problems if p.field.startswith("spec.") and "overrides" not in p.field)
    if VERDICTS[path.stem] == "served":
        assert problems == []
    else:
        assert problems and specs.rejection_reason(problems) == specs.UNSUPPORTED


def test_a_reserved_value_is_refused_by_the_worker_in_the_operators_words(tmp_path, capsys):
    """What the operator holds at Unsupported, each role's worker refuses before opening a port."""
    spec = specs.with_defaults(reserved_spec())
    problems = specs.problems(spec)
    assert problems and specs.rejection_reason(problems) == specs.UNSUPPORTED
    stable, canary = rendered_spec(reserved_spec(), "reserved", tmp_path)
    for f, words in ((stable, ["quantization 'fp8' is not supported yet"]),
                     (canary, ["quantization 'fp8' is not supported yet", "dtype 'float16' is not supported yet"])):
        assert check_config(str(f), files=False) == 2
        out, err = capsys.readouterr()
        assert out == "" and all(w in err for w in words), err
        # the worker would refuse what the operator refuses, in the same words
        assert all(p.message in err for p in problems if p.field.startswith("spec.") and "overrides" not in p.field)


def test_weights_are_looked_for_where_the_check_runs(tmp_path, monkeypatch, capsys):
    """Without --skip-files the check looks for the weights as the worker would: a relative
    path as is or under SPECFLEET_MODEL_CACHE, an absolute one as is."""
    ngram = rendered(ROOT / "deploy" / "examples" / "ngram.yaml", tmp_path)[0]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("SPECFLEET_MODEL_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert check_config(str(ngram)) == 0
    assert f"({cache / 'SmolLM2-135M-Instruct.Q4_1.gguf'})" in capsys.readouterr().out
    # the draft-model example's weights live in its worker image (/models), not on this machine
    draft = rendered(ROOT / "deploy" / "examples" / "draft-model.yaml", tmp_path)[0]
    assert check_config(str(draft)) == 2
    err = capsys.readouterr().err
    assert "model.uri: no weights here: no file at /models/SmolLM2-360M-Instruct.Q8_0.gguf" in err
    assert "draft.uri: no weights here: no file at /models/SmolLM2-135M-Instruct.Q8_0.gguf" in err
    assert check_config(str(draft), files=False) == 0
    assert "weights not checked" in capsys.readouterr().out


def test_check_config_runs_without_torch(tmp_path):
    """`specfleet serve --check-config` through the CLI, in a process where torch cannot load."""
    served, = rendered(ROOT / "deploy" / "examples" / "draft-model.yaml", tmp_path)
    rejected, _ = rendered_spec(reserved_spec(), "reserved", tmp_path)
    code = BLOCK_TORCH + (
        "from specfleet_cli.main import main\n"
        f"rcs = [main(['serve', '--check-config', {str(served)!r}, '--skip-files']),\n"
        f"       main(['serve', '--check-config', {str(rejected)!r}, '--skip-files'])]\n"
        "assert 'torch' not in sys.modules\n"
        "print('rcs', rcs)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "rcs [0, 2]"
    assert "quantization 'fp8' is not supported yet" in result.stderr
