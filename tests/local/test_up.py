"""`specfleet up` as a process: the fleet of a small example on the tiny random model (Redis, a
stable and a canary worker, the router), the official openai client against it, `specfleet
status`, Ctrl-C with requests in flight, a `kill -9` of `up`, and the demo."""
from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import psutil
import yaml

from specfleet_local import runfile

SMALL = {
    "apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
    "metadata": {"name": "tiny", "namespace": "team-a"},
    "spec": {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"},
             "draft": {"method": "ngram"}, "speculation": {"kMin": 0, "kMax": 4, "kInitial": 2},
             "replicas": 3, "redis": {"url": "redis://redis.specfleet-system.svc:6379/0"},
             "canary": {"weight": 30, "overrides": {"speculation": {"kMin": 1, "kMax": 6, "kInitial": 3}}}},
}


def up(tmp_path, *args: str, spec: dict = SMALL) -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    """`specfleet up` on the tiny random model, every port picked free; its output goes to a file."""
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(spec))
    run_file, out = tmp_path / "run" / "up.json", tmp_path / "up.out"
    env = {k: v for k, v in os.environ.items() if k not in ("SPECFLEET_REDIS_URL", runfile.ENV)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(f), "--model", "tiny-random",
         "--http-port", "0", "--grpc-port", "0", "--worker-threads", "1", "--run-file", str(run_file),
         "--drain-seconds", "20", *args],
        stdout=open(out, "w"), stderr=subprocess.STDOUT, env=env)
    return proc, run_file, out


def wait_serving(proc: subprocess.Popen, run_file, out, timeout_s: float = 120.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        doc = runfile.read(run_file)
        if doc is not None and doc.get("phase") == "serving":
            return doc
        assert proc.poll() is None, f"specfleet up exited {proc.returncode}:\n{out.read_text()}"
        assert time.monotonic() < end, f"not serving after {timeout_s} s:\n{out.read_text()}"
        time.sleep(0.2)


def pids(doc: dict) -> dict[str, int]:
    return {"up": doc["pid"], "redis": doc["redis"]["pid"], "router": doc["router"]["pid"],
            **{w["name"]: w["pid"] for w in doc["workers"]}}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(named: dict[str, int], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not all(gone(p) for p in named.values()):
        assert time.monotonic() < end, {n: p for n, p in named.items() if not gone(p)}
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    """As a user stops it (SIGTERM: `up` stops its workers, router and Redis); SIGKILL only when it
    hangs, which would leave those children running."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_help_lists_the_flags_and_up_never_imports_torch():
    code = ("import importlib, sys\n"
            "class Block:\n"
            "    def find_spec(self, name, *_):\n"
            "        if name.split('.')[0] in ('torch', 'triton'):\n"
            "            raise ImportError(f'{name} is blocked: specfleet up stays torch-free')\n"
            "sys.meta_path.insert(0, Block())\n"
            "for m in ('up', 'status', 'demo', 'plan', 'state', 'procs', 'runfile', 'redis_server'):\n"
            "    importlib.import_module('specfleet_local.' + m)\n"
            "import specfleet_bench.questions, openai\n"
            "from specfleet_cli.main import main\n"
            "for cmd in ('up', 'status'):\n"
            "    try:\n"
            "        main([cmd, '--help'])\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--workers-per-arm", "--model", "--http-port", "--grpc-port", "--redis-port", "--worker-ports",
                 "--exit-after-demo", "--run-file", "--output", "--router-url"):
        assert flag in out.stdout, flag


def test_a_spec_with_problems_starts_nothing_and_says_why(tmp_path):
    spec = yaml.safe_load(json.dumps(SMALL))
    spec["spec"]["speculation"]["kInitial"] = 9  # above kMax
    spec["spec"]["quantization"] = "fp8"
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(spec))
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(f), "--run-file",
                          str(tmp_path / "up.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "nothing was started" in out.stderr and "kMin <= kInitial <= kMax" in out.stderr, out.stderr
    assert not (tmp_path / "up.json").exists()


def test_a_port_in_use_starts_nothing_and_names_the_flag(tmp_path):
    f = tmp_path / "fleet.yaml"
    f.write_text(yaml.safe_dump(SMALL))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(f), "--model", "tiny-random",
                              "--http-port", str(port), "--run-file", str(tmp_path / "up.json")],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"port {port} on 127.0.0.1 is in use: pick another with --http-port" in out.stderr
    assert "nothing was started" in out.stderr and not (tmp_path / "up.json").exists()


def test_status_without_a_fleet_says_how_to_start_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "status", "--run-file",
                          str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "specfleet up -f" in out.stderr


def test_up_serves_reports_and_stops_everything_on_ctrl_c(tmp_path):
    proc, run_file, out = up(tmp_path)
    try:
        doc = wait_serving(proc, run_file, out)
        said = out.read_text()
        assert "spec.replicas: 3 -> 1 worker process per arm" in said and "spec.redis:" in said, said
        assert "spec.model:" in said and "tiny-random" in said
        assert doc["deployment"] == "team-a/tiny" and [w["arm"] for w in doc["workers"]] == ["stable", "canary"]
        assert doc["router"]["openai"].startswith("http://127.0.0.1:")
        started = pids(doc)
        assert all(psutil.pid_exists(p) for p in started.values())
        for p in started.values():  # loopback only
            for c in psutil.Process(p).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    ip = ipaddress.ip_address(c.laddr.ip)
                    assert (getattr(ip, "ipv4_mapped", None) or ip) == ipaddress.ip_address("127.0.0.1"), (p, c)

        client = openai.OpenAI(base_url=doc["router"]["openai"], api_key="unused", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == ["tiny"]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-random", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0)
        reply = raw.parse()
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
        assert raw.headers["x-specfleet-arm"] in ("stable", "canary")
        # version 1 is the spec's; the loop writes the next ones (the canary's run started, its share)
        assert int(raw.headers["x-specfleet-state-version"]) >= 1

        def status_json() -> dict:
            st = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "status", "-o", "json", "--run-file",
                                 str(run_file)], capture_output=True, text=True, timeout=60)
            assert st.returncode == 0, st.stderr
            return json.loads(st.stdout)
        # the canary gets its 30% once the loop has seen its worker Ready (a tick, 1 s, after it is)
        end = time.monotonic() + 15
        while (status := status_json())["arms"][-1]["weight"] != 30.0:
            assert time.monotonic() < end, status["arms"]
            time.sleep(0.5)
        assert [(a["name"], a["weight"], a["replicas"], a["ready"]) for a in status["arms"]] == [
            ("stable", 70.0, 1, 1), ("canary", 30.0, 1, 1)]
        assert status["mode"] == "speculative" and status["ready"] == "2/2"
        assert status["kBounds"] == {"stable": {"kMin": 0, "kMax": 4}, "canary": {"kMin": 1, "kMax": 6}}
        assert {t["name"]: (t["method"], t["mode"]) for t in status["promptTypes"]}["chat"] == ("ngram", "speculative")
        assert status["redis"]["connected"] and status["redis"]["stateVersion"] >= 1
        assert status["loop"]["ticks"]["decided"] >= 1 and status["fallback"]["probeShare"] == 5.0
        assert "CanaryStarted" in [e["reason"] for e in status["loop"]["events"]]
        assert status["loop"]["decisions"]["CanaryStarted"] == 1, status["loop"]
        assert status["redis"]["routerConnected"] and status["router"]["ready"]
        wide = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "status", "--run-file", str(run_file)],
                              capture_output=True, text=True, timeout=60)
        assert wide.returncode == 0 and "team-a/tiny" in wide.stdout and "PROMPT TYPE" in wide.stdout, wide.stderr
        assert "decisions: " in wide.stdout and "CanaryStarted 1" in wide.stdout, wide.stdout

        # Ctrl-C with long streams in flight: each finishes whole, then everything exits
        results: list = []

        def stream(i: int, first: threading.Event) -> None:
            chunks = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Go {i}"}], max_tokens=400, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                extra_headers={"x-session-id": f"s{i}"})
            finish, usage = None, None
            for chunk in chunks:
                first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                usage = chunk.usage or usage
            results.append((finish, usage.completion_tokens if usage else None))

        firsts = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=stream, args=(i, e)) for i, e in enumerate(firsts)]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in firsts), "no stream started"
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        assert results == [("length", 400)] * 3, results
        assert proc.wait(timeout=90) == 0, out.read_text()
        wait_gone(started, 10)
        router_log = [json.loads(line) for line in open(doc["router"]["log"]) if line.startswith("{")]
        drain = next(r for r in router_log if r.get("msg") == "draining")
        assert drain["in_flight"] >= 1, drain  # they were in flight when the router began to drain
        said = out.read_text()
        assert "Stopped: router (exit 0), tiny-stable-0 (exit 0), tiny-canary-0 (exit 0), redis-server" in said, said
        assert not run_file.exists()
    finally:
        stop(proc)


def test_a_killed_up_leaves_no_process_behind(tmp_path):
    spec = yaml.safe_load(json.dumps(SMALL))
    del spec["spec"]["canary"]
    proc, run_file, out = up(tmp_path, spec=spec)
    try:
        doc = wait_serving(proc, run_file, out)
        started = pids(doc)
        assert len(started) == 4  # up, redis, router, one worker
        proc.kill()
        proc.wait(timeout=10)
        wait_gone(started, 30)
        # the worker's exit path, written after `up` was gone: each step bounded and timed, so a
        # slow one names itself; with nothing in flight no drain is waited for
        log = [json.loads(line) for line in open(doc["workers"][0]["log"]) if line.startswith("{")]
        msgs = [r["msg"] for r in log]
        assert "shutting down" in msgs and msgs[-1] == "exiting", msgs[-12:]
        steps = {r["step"]: r["seconds"] for r in log if r["msg"] == "shutdown step"}
        assert list(steps) == ["stop serving", "drain", "live-state follower", "fleet publisher", "scheduler",
                               "grpc server", "admin server", "http server", "trace exporter"], log[-12:]
        assert next(r for r in log if r["msg"] == "draining")["grace_s"] == 0, log[-12:]
        assert log[-1]["exit_code"] == 0 and log[-1]["shutdown_s"] < 20, log[-1]
    finally:
        stop(proc)


def test_the_demo_runs_the_workload_and_exits(tmp_path):
    # Spec-Bench's own questions run to 1000+ tokens: more than the tiny model's 512 positions
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                                 enumerate([("writing", "Write a short poem."), ("coding", "Write a Python function."),
                                            ("math", "What is 3 * 4?"), ("translation", "Translate 'cat' into French."),
                                            ("summarization", "Summarize: the cat sat."), ("qa", "Why is the sky blue?"),
                                            ("writing", "Write a haiku.")])))
    proc, run_file, out = up(tmp_path, "--exit-after-demo", "--demo-prompts", "6", "--demo-max-tokens", "8",
                             "--demo-clients", "3", "--questions", str(questions))
    try:
        assert proc.wait(timeout=180) == 0, out.read_text()
        said = out.read_text()
        assert "Demo: 6 Spec-Bench prompts (6 categories)" in said and "6 of 6 requests answered" in said, said
        assert "prompt type" in said and "alpha" in said and "tok/s" in said
        assert re.search(r"│ translation +│ (stable|canary) +│ ngram +│ +1 │", said), said
        assert "Still serving" not in said and "Stopped: router (exit 0)" in said
    finally:
        stop(proc)
