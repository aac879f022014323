"""The worker's exit path (specfleet_worker.shutdown): a step that hangs is given up on after its
bound and named in the log, the watchdog ends a shutdown that outlives its deadline (naming the
step and dumping the stacks), and a SIGTERM while the model loads ends the process cleanly."""
from __future__ import annotations

import io
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from specfleet_worker import logs
from specfleet_worker.shutdown import Shutdown


def records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]


def test_a_step_that_hangs_is_given_up_on_after_its_bound_and_named():
    out = io.StringIO()
    logs.configure("INFO", out)
    hang = threading.Event()
    try:
        down = Shutdown(60, exit=lambda code: None).arm(why="test")
        t0 = time.monotonic()
        assert down.step("stuck", lambda: hang.wait(30), timeout_s=0.3, default="gave up") == "gave up"
        assert time.monotonic() - t0 < 5
        assert down.step("quick", lambda: 7, timeout_s=5) == 7
        assert down.step("broken", lambda: 1 / 0, timeout_s=5, default=False) is False
        codes: list[int] = []
        down._exit = codes.append
        down.finish(0, all_requests_finished=True)
        assert codes == [0]
    finally:
        hang.set()
        logging.getLogger("specfleet").handlers[:] = []
    recs = records(out)
    timed_out = next(r for r in recs if r["msg"] == "shutdown step timed out; going on without it")
    assert timed_out["step"] == "stuck" and timed_out["timeout_s"] == 0.3
    assert [(r["step"]) for r in recs if r["msg"] == "shutdown step"] == ["quick"]
    assert next(r for r in recs if r["msg"] == "shutdown step failed")["step"] == "broken"
    assert recs[-1]["msg"] == "exiting" and recs[-1]["exit_code"] == 0


def test_the_watchdog_ends_a_shutdown_past_its_deadline_naming_the_step(tmp_path):
    out = io.StringIO()
    logs.configure("INFO", out)
    exited, hang = threading.Event(), threading.Event()
    codes: list[int] = []
    stacks = open(tmp_path / "stacks.txt", "w+")
    try:
        down = Shutdown(0.5, exit=lambda code: (codes.append(code), exited.set()), stream=stacks).arm(why="test")
        threading.Thread(target=down.step, args=("stuck", lambda: hang.wait(30), 30), daemon=True).start()
        assert exited.wait(10), "the watchdog did not fire"
    finally:
        hang.set()
        logging.getLogger("specfleet").handlers[:] = []
    assert codes == [1]
    late = next(r for r in records(out) if r["msg"] == "shutdown took too long; exiting now")
    assert late["step"] == "stuck" and late["deadline_s"] == 0.5
    stacks.seek(0)
    assert "Thread 0x" in stacks.read()  # every thread's stack, for what the stuck step waits on


def test_sigterm_while_the_model_loads_ends_the_worker_cleanly(tmp_path):
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"model": {"name": "tiny-random", "uri": None}, "draft": {"method": "ngram"}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specfleet_worker.main", "--config", str(config), "--grpc-port", "0",
         "--http-port", "0", "--admin-port", "0", "--threads", "1", "--drain-seconds", "20"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] + [lines.put(None)], daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while True:  # the model loads right after this line
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "the worker exited before it loaded its model"
            if json.loads(line)["msg"] == "loading model":
                break
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        rest = []
        while (line := lines.get(timeout=10)) is not None:
            if line.startswith("{"):
                rest.append(json.loads(line))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, rest  # not -6: torch torn down under the loading thread aborted the process
    assert rest[-1]["msg"] == "exiting", rest
    assert rest[-1]["shutdown_s"] < 10
