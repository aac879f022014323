"""What `specfleet up` runs for a file with `engine: {name: vllm}`, without vLLM: a server per replica
of each pool the operator would run, with the operator's flags on 127.0.0.1 and this machine's model
folder, its threads on cores of its own; what this machine's vLLM cannot run refused by field; the
router given each server as --vllm-backend; the model's export cached; and no vLLM venv refused
before anything starts."""
from __future__ import annotations

import copy
import doctest
import os
import pathlib
import subprocess
import sys
import types

import pytest
import yaml

from specfleet_api import fleet_spec as fs
from specfleet_api import vllm as vllm_api
from specfleet_local import hf_model, plan, pools
from specfleet_local.plan import SpecError, VllmModel, load_resource, make_plan
from specfleet_local.state import initial_state
from specfleet_operator import spec as specs

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "vllm-local.yaml"
HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


@pytest.fixture(autouse=True)
def no_model_folder_here(monkeypatch, tmp_path):
    """The model cache is an empty folder: the example's model.uri names nothing on this machine."""
    monkeypatch.setenv("SPECFLEET_MODEL_CACHE", str(tmp_path / "model-cache"))


def resource(tmp_path, **spec) -> dict:
    """The example, its spec updated with `spec` (a None value removes the field), through a file."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    for key, value in spec.items():
        if value is None:
            doc["spec"].pop(key, None)
        else:
            doc["spec"][key] = value
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(doc))
    return load_resource(f)


def hf_folder(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(parents=True)
    for name in HF_FILES:
        (path / name).write_text("{}")
    return path


def problems(tmp_path, **kw) -> list[str]:
    spec = kw.pop("spec", {})
    with pytest.raises(SpecError) as e:
        make_plan(resource(tmp_path, **spec), "fleet.yaml", cpus=[0, 1], **kw)
    return e.value.problems


@pytest.mark.parametrize("module", [plan, pools, hf_model], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0


def test_the_example_runs_an_ngram_and_a_plain_server_a_core_each():
    p = make_plan(load_resource(EXAMPLE), cpus=[0, 1])
    assert p.engine == "vllm"
    assert [(s.name, s.arm, s.method, s.cpus) for s in p.servers] == [
        ("vllm-local-stable-ngram-0", "stable", "ngram", "0"), ("vllm-local-stable-none-0", "stable", "none", "1")]
    assert [(a.name, a.workers) for a in p.arms] == [("stable", 2)]
    assert p.servers[0].speculative == vllm_api.speculative_config(p.spec, "ngram") and p.servers[1].speculative is None
    # the bundled model, exported: model.uri names a folder this machine lacks
    assert p.vllm_model == VllmModel(export="smollm2-135m")
    assert make_plan(load_resource(EXAMPLE), model="smollm2-135m", cpus=[0, 1]) == p  # the file's own model
    said = {o.field: o for o in p.overrides}
    assert set(said) == {"spec.model.uri", "spec.model.source"}, said  # the pools keep the spec's sizes
    assert "specfleet export-hf" in said["spec.model.uri"].now
    state = initial_state(p.spec)
    assert state.default_method == "ngram" and state.method_for("translation") == "none"
    assert state.speculate and specs.problems(p.spec) == []


def test_each_pool_server_gets_the_operators_flags_on_loopback_and_the_local_folder(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    res = resource(tmp_path, canary={"weight": 10, "replicas": 1,
                                     "overrides": {"speculation": {"kInitial": 3, "kMax": 3, "kPolicy": "fixed"}}},
                   engine={"name": "vllm", "vllm": {"args": ["--max-model-len", "2048"],
                                                    "pools": {"ngram": {"replicas": 2}},
                                                    "ngram": {"promptLookupMax": 3}}})
    p = make_plan(res, cpus=[0, 1])
    assert [(s.arm, s.method, s.cpus) for s in p.servers] == [
        ("stable", "ngram", "0"), ("stable", "ngram", "1"), ("stable", "none", "0"),
        ("canary", "ngram", "1"), ("canary", "none", "0")]
    assert [s.name for s in p.servers][:2] == ["vllm-local-stable-ngram-0", "vllm-local-stable-ngram-1"]
    assert [(a.name, a.workers) for a in p.arms] == [("stable", 3), ("canary", 2)]
    spec = specs.with_defaults(res["spec"])
    model = hf_folder(tmp_path / "m")
    for s in p.servers:
        server = s.server(model, port=8123, venv=venv)
        want = vllm_api.server_args(spec, fs.effective_spec(spec, s.arm), s.method, gpus=False)
        want[want.index("--model") + 1] = str(model.resolve())
        want[want.index("--host") + 1] = "127.0.0.1"
        want[want.index("--port") + 1] = "8123"
        assert server.argv() == [str(venv / "bin" / "python"), *vllm_api.COMMAND[1:], *want]
        assert server.env()["VLLM_CPU_OMP_THREADS_BIND"] == s.cpus
    assert p.servers[3].speculative["num_speculative_tokens"] == 3  # the canary's own K
    assert p.servers[0].speculative["prompt_lookup_max"] == 3


@pytest.mark.parametrize("spec, field", [
    ({"device": "cuda"}, "spec.device: asks for a GPU"),
    ({"device": "auto", "template": {"resources": {"limits": {"nvidia.com/gpu": 1},
                                                   "requests": {"nvidia.com/gpu": 1}}}},
     "spec.template.resources: asks for a GPU"),
    ({"engine": {"name": "vllm", "vllm": {"args": ["-tp", "2"]}}}, "spec.engine.vllm.args[0]: -tp"),
    ({"engine": {"name": "vllm", "vllm": {"args": ["--max-model-len", "512", "--tensor_parallel_size=2"]}}},
     "spec.engine.vllm.args[2]: --tensor_parallel_size=2"),
    ({"engine": {"name": "vllm", "vllm": {"args": ["--gpu-memory-utilization", "0.9"]}}},
     "spec.engine.vllm.args[0]: --gpu-memory-utilization"),
    ({"replicas": 0}, "spec.replicas: 0 servers in every pool of the stable arm"),
    ({"model": {"name": "qwen", "uri": "/models/qwen"}},
     "spec.model.uri: no Hugging Face folder at /models/qwen on this machine"),
    ({"draft": {"method": "eagle", "uri": "/heads/none-here"}, "routing": {"default": "eagle"}},
     "spec.draft.uri: no folder at /heads/none-here on this machine"),
    ({"speculation": {"kPolicy": "adaptive", "kInitial": 2, "kMax": 4}}, "spec.speculation.kPolicy"),  # the CRD's
], ids=["cuda", "gpu-resources", "tp", "tp-underscore", "gpu-memory", "no-server", "no-model", "no-draft", "crd"])
def test_what_this_machine_cannot_run_is_refused_by_field(tmp_path, spec, field):
    found = problems(tmp_path, spec=spec)
    assert any(p.startswith(field) for p in found), found
    if field.startswith("spec.model.uri"):
        assert any("--model" in p for p in found), found


def test_settings_a_local_server_takes_are_run(tmp_path):
    args = ["--tensor-parallel-size", "1", "--max-model-len", "4096", "--enforce-eager"]
    p = make_plan(resource(tmp_path, device="auto", engine={"name": "vllm", "vllm": {"args": args, "image": "mine:1"}}),
                  cpus=[0, 1])
    assert all(s.extra_args == tuple(args) for s in p.servers)
    assert "spec.engine.vllm.image" in {o.field for o in p.overrides}


def test_flags_for_workers_or_models_vllm_cannot_load_are_refused(tmp_path):
    assert any(p.startswith("--workers-per-arm") for p in problems(tmp_path, workers_per_arm=2))
    assert any(p.startswith("--worker-threads") for p in problems(tmp_path, threads=0))
    assert any(p.startswith("--model tiny-random") for p in problems(tmp_path, model="tiny-random"))
    assert any(p.startswith("--model /no/such") for p in problems(tmp_path, model="/no/such"))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    found = problems(tmp_path, model=str(partial))
    assert any(p.startswith("--model: model") and "tokenizer.json" in p for p in found), found


def test_a_folder_on_this_machine_is_served_as_it_is(tmp_path, monkeypatch):
    folder = hf_folder(tmp_path / "SmolLM2-HF")
    p = make_plan(resource(tmp_path), model=str(folder), cpus=[0, 1])
    assert p.vllm_model == VllmModel(folder=str(folder.resolve()))
    assert p.spec["model"]["name"] == "smollm2-hf" and p.servers[0].served_model_name == "smollm2-hf"
    # model.uri's folder under the mount, found in the model cache here (as the worker finds weights)
    cache = tmp_path / "model-cache"
    hf_folder(cache / "smollm2-135m-instruct")
    p = make_plan(resource(tmp_path), cpus=[0, 1, 2, 3])
    assert p.vllm_model == VllmModel(folder=str((cache / "smollm2-135m-instruct").resolve()))
    assert [o.field for o in p.overrides] == ["spec.model.source"] and [s.cpus for s in p.servers] == ["0,1", "2,3"]


def test_the_router_is_given_each_server_as_a_vllm_backend(tmp_path):
    from specfleet_local.up import Fleet, build_parser, ports_in_use

    p = make_plan(load_resource(EXAMPLE), cpus=[0, 1])
    args = build_parser().parse_args(["-f", str(EXAMPLE), "--worker-ports", "0"])
    fleet = Fleet(p, args, tmp_path / "run" / "up.json", console=None)
    fleet.redis = types.SimpleNamespace(url="redis://127.0.0.1:1/0")
    fleet.writer = types.SimpleNamespace(state=initial_state(p.spec))
    fleet.workers = [fleet._vllm_server(s, n, tmp_path / "m") for n, s in enumerate(p.servers)]
    cmd = fleet._router().cmd
    backends = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--vllm-backend"]
    assert backends == [f"stable/ngram=127.0.0.1:{fleet.workers[0].ports['http']}",
                        f"stable/none=127.0.0.1:{fleet.workers[1].ports['http']}"]
    assert "--backend" not in cmd and cmd[cmd.index("--route") + 1] == "translation=none"
    assert cmd[cmd.index("--default-method") + 1] == "ngram" and "--model-alias" in cmd
    # --worker-ports: server i on BASE + i, checked before anything starts
    args = build_parser().parse_args(["-f", str(EXAMPLE), "--worker-ports", "41000"])
    fleet = Fleet(p, args, tmp_path / "run" / "up.json", console=None)
    assert [fleet._vllm_server(s, n, tmp_path / "m").ports["http"] for n, s in enumerate(p.servers)] == [41000, 41001]
    args.http_port = args.grpc_port = 0
    assert ports_in_use(args, len(p.servers)) == []


def test_up_without_the_vllm_venv_starts_nothing_and_names_the_set_up(tmp_path):
    env = {**os.environ, "SPECFLEET_VLLM_VENV": str(tmp_path / "no-venv")}
    run_file = tmp_path / "up.json"
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(EXAMPLE), "--run-file",
                          str(run_file)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    said = " ".join(out.stderr.split())
    assert "./dev setup --vllm" in said and "nothing was started" in said, said
    assert not run_file.exists()
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(EXAMPLE), "--worker-arg=--x",
                          "--run-file", str(run_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "spec.engine.vllm.args" in " ".join(out.stderr.split()), out.stderr


def test_the_export_is_cached_per_source_file_and_made_again_when_incomplete(tmp_path, monkeypatch):
    from specfleet_engine import hf_export

    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path / "cache"))
    made = []

    def fake_export(source, out, overwrite=False, progress=print):
        made.append(source)
        out.mkdir(parents=True, exist_ok=True)
        for name in hf_export.FILES:
            (out / name).write_text(name)
        return out

    monkeypatch.setattr(hf_export, "export_hf", fake_export)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = hf_model.cached_export(str(gguf), progress=lambda _: None)
    assert first.parent == tmp_path / "cache" / "hf" and first.name.startswith("m-")
    assert hf_model.cached_export(str(gguf), progress=lambda _: None) == first and len(made) == 1
    (first / "model.safetensors").unlink()  # an entry a stopped export left incomplete
    assert hf_model.cached_export(str(gguf), progress=lambda _: None) == first and len(made) == 2
    gguf.write_bytes(b"other")  # another model in the same file: another entry
    assert hf_model.cached_export(str(gguf), progress=lambda _: None) != first and len(made) == 3


def test_the_new_modules_stay_torch_free():
    code = ("import importlib, sys\n"
            "class Block:\n"
            "    def find_spec(self, name, *_):\n"
            "        if name.split('.')[0] in ('torch', 'triton'):\n"
            "            raise ImportError(f'{name} is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "for m in ('plan', 'pools', 'hf_model', 'vllm', 'up'):\n"
            "    importlib.import_module('specfleet_local.' + m)\n"
            "assert 'torch' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_example_is_the_smallest_vllm_fleet():
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = specs.with_defaults(copy.deepcopy(doc["spec"]))
    assert specs.problems(spec) == []
    assert [(p.role, p.method, p.replicas) for p in vllm_api.pools(spec)] == [("stable", "ngram", 1),
                                                                              ("stable", "none", 1)]
    assert spec["slo"]["alphaFloor"] > 0 and spec["slo"]["fallback"]["enabled"]
