"""A SpecDecodeDeployment served by `specfleet up` in a child process, for the episode benchmarks:
the spec written to a file, the fleet started, waited on until it serves, and stopped with it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

from specfleet_local import procs, runfile


@contextlib.contextmanager
def local_fleet(doc: dict, workdir: Path, *, loop_period: float = 1.0, worker_threads: int = 2, max_batch: int = 8,
                model: str = "smollm2", ready_timeout: float = 300.0, name: str = "fleet",
                engine: str = "specfleet") -> Iterator[dict]:
    """Serves `doc` (a SpecDecodeDeployment) and yields `specfleet up`'s run file (its router's
    URLs, its Redis); the fleet's output goes to `<workdir>/<name>.out`. Tied to this process: a
    harness killed mid-episode (a test's timeout) leaves no fleet behind. With engine vllm the
    pools are vLLM servers: `up` shares the cores out and sizes their batches itself."""
    spec_file, run_file, out = workdir / f"{name}.yaml", workdir / f"{name}-up.json", workdir / f"{name}.out"
    spec_file.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if k not in ("SPECFLEET_REDIS_URL", runfile.ENV)}
    cmd = [sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(spec_file), "--http-port", "0",
           "--grpc-port", "0", "--run-file", str(run_file), "--loop-period", str(loop_period), "--drain-seconds", "5"]
    if engine != "vllm":
        cmd += ["--worker-threads", str(worker_threads), f"--worker-arg=--max-batch-size={max_batch}"]
    if model != "smollm2" and engine != "vllm":
        cmd += ["--model", model]
    up = procs.spawn(cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        end = time.monotonic() + ready_timeout
        while True:
            run = runfile.read(run_file)
            if run is not None and run.get("phase") == "serving":
                break
            if up.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"specfleet up did not serve within {ready_timeout:g} s:\n{out.read_text()[-3000:]}")
            time.sleep(0.2)
        yield run
    finally:
        if up.poll() is None:
            up.terminate()
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
