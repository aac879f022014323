"""`specfleet router` as a process: its flags, serving in front of a worker, and SIGTERM."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

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
    proc, port = router_process("--backend", f"stable={h.target(worker)}", "--deployment", "team-a/chat",
                                "--model-alias", "tiny-random")
    end = time.monotonic() + 30
    try:
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


def router_process(*args: str) -> tuple[subprocess.Popen, int]:
    """`specfleet router` as a child process and its HTTP port (from its `listening` log line); a
    thread keeps reading its logs, so a full pipe never blocks it."""
    env = {k: v for k, v in os.environ.items() if k != "SPECFLEET_REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "specfleet_cli.main", "router", "--http-port", "0",
                             "--grpc-port", "0", *args], stderr=subprocess.PIPE, text=True, env=env)
    ports: queue.Queue[int] = queue.Queue()

    def read():
        for line in proc.stderr:
            if '"listening"' in line:
                ports.put(json.loads(line)["http_port"])

    threading.Thread(target=read, daemon=True).start()
    try:
        return proc, ports.get(timeout=30)
    except queue.Empty:
        proc.kill()
        proc.wait(timeout=10)
        raise TimeoutError("the router did not log where it listens within 30 s") from None


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_fleet_of_processes_worker_kill_and_weight_change(tmp_path, redis_server):
    """Two `specfleet serve` tiny-random workers (stable, canary) and the router, all processes,
    with the live state in a real redis-server: chat through the router, the canary weight moved
    in Redis, the canary SIGKILLed (its requests fall back to stable, none fails), SIGTERM drains."""
    from specfleet_api.live_state import LiveState, state_key
    from specfleet_worker.testing import WorkerProcess

    def config(role):
        path = tmp_path / f"{role}.json"
        path.write_text(json.dumps({"model": {"name": "tiny-random", "uri": None}, "draft": {"method": "ngram"},
                                    "speculation": {"kMin": 0, "kMax": 8}, "role": role}))
        return path

    state = LiveState().next(canary_weight=0.0)
    redis_server.client().set(state_key("team-a", "chat"), state.to_json())
    with WorkerProcess(config("stable"), "--threads", "1") as stable, \
            WorkerProcess(config("canary"), "--threads", "1") as canary:
        proc, port = router_process("--backend", f"stable=127.0.0.1:{stable.grpc_port}", "--backend",
                                    f"canary=127.0.0.1:{canary.grpc_port}", "--deployment", "team-a/chat",
                                    "--redis-url", redis_server.url, "--eject-seconds", "30")
        try:
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)

            def chat(session="s"):
                raw = c.chat.completions.with_raw_response.create(
                    model="chat", messages=[{"role": "user", "content": "Hello there"}], max_tokens=4,
                    temperature=0, extra_headers={"x-session-id": session})
                assert raw.parse().usage.completion_tokens == 4
                return raw.headers["x-specfleet-arm"]

            end = time.monotonic() + 30
            while "stable: 1, canary: 1" not in readyz(port)[1]:  # health arrives just after the listeners
                assert time.monotonic() < end, f"workers not ready at the router: {readyz(port)}"
                time.sleep(0.05)
            assert chat() == "stable"
            redis_server.client().set(state_key("team-a", "chat"), state.next(canary_weight=100.0).to_json())
            moved = time.monotonic()
            while chat() != "canary":
                assert time.monotonic() - moved < 2.0, "the weight change was not served within 2 s"
            canary.kill()  # SIGKILL: no drain, no goodbye
            assert all(chat(f"s{i}") == "stable" for i in range(8))  # fallback; nothing failed
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
