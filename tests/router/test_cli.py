"""`specfleet router` as a process: its flags, serving in front of a worker, and SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai

from specfleet_router.main import build_parser


def test_help_lists_every_flag_without_loading_torch():
    code = ("import sys\n"
            "from specfleet_cli.main import main\n"
            "try:\n"
            "    main(['router', '--help'])\n"
            "except SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) >= 20
    missing = [f for f in flags if f not in out.stdout]
    assert not missing, missing


def test_a_bad_flag_exits_2_with_the_reason():
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "router", "--backend", "blue=h:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "stable or canary" in out.stderr


def test_the_router_process_serves_and_drains_on_sigterm(h, worker):
    env = {k: v for k, v in os.environ.items() if k != "SPECFLEET_REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "specfleet_cli.main", "router", "--http-port", "0",
                             "--grpc-port", "0", "--backend", f"stable={h.target(worker)}", "--deployment",
                             "team-a/chat", "--model-alias", "tiny-random"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        end = time.monotonic() + 30
        while port is None:
            assert time.monotonic() < end and proc.poll() is None, "the router did not say where it listens"
            line = proc.stderr.readline()
            if '"listening"' in line:
                port = json.loads(line)["http_port"]
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        assert [m.id for m in c.models.list()] == ["chat"]
        while True:  # the worker's health arrives a moment after the listeners
            try:
                out = c.completions.create(model="tiny-random", prompt="Hi", max_tokens=3, temperature=0)
                break
            except openai.InternalServerError:
                assert time.monotonic() < end, "no backend became ready"
                time.sleep(0.05)
        assert out.usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
