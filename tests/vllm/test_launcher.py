"""specfleet_local.vllm without vLLM: the command and environment it gives a server, what it
refuses, and its process handling, played by a stand-in `vllm.entrypoints.openai.api_server`
module (first on PYTHONPATH) that spawns a child as vLLM spawns its engine core."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from specfleet_api import vllm as vllm_api
from specfleet_local.vllm import HOST, TIMING_METRICS, VllmError, VllmServer, ngram_config, vllm_python

FAKE_SERVER = r'''
import argparse, http.server, os, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
args, _ = p.parse_known_args()
mode = os.environ["FAKE_VLLM"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the engine core
open(os.environ["FAKE_VLLM_CHILD"], "w").write(str(child.pid))
print("starting the engine", flush=True)
if mode == "exit":
    print("ValueError: no such model", flush=True)
    child.kill()
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
end = time.process_time() + 1.0
while time.process_time() < end:  # compiling: CPU used, nothing printed
    pass

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", args.port), Health).serve_forever()
'''


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (folder / name).write_text("{}")
    return folder


@pytest.fixture
def fake_venv(tmp_path, monkeypatch) -> Path:
    """A venv whose python is this one, with the stand-in vllm first on its path."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    module = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for folder in (module.parent.parent, module.parent, module):
        (folder / "__init__.py").write_text("")
    (module / "api_server.py").write_text(FAKE_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_VLLM_CHILD", str(tmp_path / "child.pid"))
    return venv


def test_the_command_is_the_operators_on_loopback(model_dir, fake_venv):
    server = VllmServer(model_dir, ngram_config(3), port=8123, venv=fake_venv, served_model_name="m", cpus="0-1")
    argv = server.argv()
    assert argv[:3] == [str(fake_venv / "bin" / "python"), *vllm_api.COMMAND[1:]]
    flags = {a: b for a, b in zip(argv[3:], argv[4:]) if a.startswith("--") and not b.startswith("--")}
    assert flags["--host"] == HOST == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["--model"] == str(model_dir) and flags["--served-model-name"] == "m"
    assert flags["--dtype"] == "float32"
    assert json.loads(flags["--speculative-config"]) == {"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_min": vllm_api.PROMPT_LOOKUP_MIN,
                                                         "prompt_lookup_max": vllm_api.PROMPT_LOOKUP_MAX}
    for flags_in_order in (vllm_api.SPEC_METRICS, TIMING_METRICS):
        i = argv.index(flags_in_order[0])
        assert tuple(argv[i:i + len(flags_in_order)]) == flags_in_order
    env = server.env()
    assert (env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("1", "1", "1")
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == ("0-1", "0")
    assert env["VLLM_USE_AOT_COMPILE"] == os.environ.get("VLLM_USE_AOT_COMPILE", "0")


def test_a_plain_server_asks_for_no_spec_decode_metrics(model_dir, fake_venv, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    server = VllmServer(model_dir, None, venv=fake_venv)
    argv = server.argv()
    assert "--speculative-config" not in argv and vllm_api.SPEC_METRICS[0] not in argv
    assert TIMING_METRICS[0] in argv
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.env()  # vLLM's own choice of cores


def test_bad_input_is_refused_with_what_to_do(tmp_path, model_dir):
    with pytest.raises(VllmError, match=r"no vLLM venv at .*\./dev setup --vllm"):
        vllm_python(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="at least 1 token"):
        ngram_config(0)
    with pytest.raises(ValueError, match="kv_cache_gib=0"):
        VllmServer(model_dir, kv_cache_gib=0)
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(VllmError, match=r"no tokenizer.json, \*\.safetensors.*specfleet export-hf --out"):
        VllmServer(model_dir, venv=tmp_path).start()
    with pytest.raises(VllmError, match="not a folder"):
        VllmServer(tmp_path / "absent", venv=tmp_path).start()


def _gone(pid: int, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_it_waits_through_a_silent_start_and_stops_the_whole_group(model_dir, fake_venv, tmp_path, monkeypatch):
    """Ready once /health answers, after a start that prints nothing while it uses the CPU; stop
    ends the server and the child it spawned."""
    monkeypatch.setenv("FAKE_VLLM", "serve")
    said = []
    server = VllmServer(model_dir, venv=fake_venv, log=tmp_path / "server.log").start()
    try:
        ready_after = server.wait_ready(stall_s=60, progress=said.append, every_s=0.0)
        assert server.healthy() and ready_after > 0
        assert said[-1].startswith(f"vLLM on port {server.port} ready after")
        child = int((tmp_path / "child.pid").read_text())
        os.kill(child, 0)  # alive while the server is
    finally:
        server.stop(timeout_s=20)
    assert not server.alive() and _gone(child), "the engine-core stand-in outlived the server"


def test_a_server_that_exits_fails_the_wait_with_its_last_lines(model_dir, fake_venv, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM", "exit")
    server = VllmServer(model_dir, venv=fake_venv, log=tmp_path / "server.log").start()
    try:
        with pytest.raises(VllmError, match=r"exited with 3 before it was ready:\n(.|\n)*no such model"):
            server.wait_ready(stall_s=60, progress=None)
    finally:
        server.stop(timeout_s=20)


def test_a_server_that_uses_no_cpu_is_hung_not_slow(model_dir, fake_venv, tmp_path, monkeypatch):
    """The stand-in sleeps before it serves: the wait ends after stall_s without CPU, long before
    its timeout, and the server is still there to be stopped."""
    monkeypatch.setenv("FAKE_VLLM", "hang")
    server = VllmServer(model_dir, venv=fake_venv, log=tmp_path / "server.log").start()
    try:
        t = time.monotonic()
        with pytest.raises(VllmError, match="used no CPU for 2 s and is not ready"):
            server.wait_ready(timeout_s=600, stall_s=2, progress=None)
        assert time.monotonic() - t < 60
        assert server.alive()
    finally:
        server.stop(timeout_s=20)
    assert not server.alive()
