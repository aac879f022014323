"""An engine-vllm fleet's servers as `specfleet up` runs them: each vLLM server (`VllmServer`) with
the face `up` knows of its workers (`procs.Child`: a name, an arm, ports, a phase, `ready`, its last
lines, `signal` and `wait`), so that up's start order, progress lines, liveness checks and stop
order are the same code for both engines.

A server prints nothing useful while it compiles (minutes), so its phase is its CPU time and last
log line, and its readiness is `VllmServer.wait_ready` (its /health), on a thread of its own: that
wait fails a server that hung (no CPU used for `STALL_S`), which is then stopped, so `up` sees it
exit and reports why.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from .plan import VllmServerPlan
from .vllm import VllmError, group_cpu_seconds

#: How long a starting server may use no CPU before it is taken for hung (tests/vllm/conftest.py's).
STALL_S = 300.0
#: How often a server's CPU time is read for its progress line (a walk over /proc).
CPU_EVERY_S = 2.0


class PoolServer:
    """One vLLM server of a pool, started by `up`."""

    def __init__(self, planned: VllmServerPlan, model: str | Path, log_path: Path, port: int | None = None,
                 venv: Path | None = None, ready_timeout_s: float = 3600.0):
        self.planned, self.name, self.arm, self.method = planned, planned.name, planned.arm, planned.method
        self.log_path, self.ready_timeout_s = log_path, ready_timeout_s
        self.server = planned.server(model, port=port, log=log_path, venv=venv)
        self.ports = {"http": self.server.port}  # chosen before it starts: the router can name it at once
        self.listening, self.ready = threading.Event(), threading.Event()
        self.started_at = self.ready_after = 0.0
        self.failure: str | None = None
        self._cpu, self._cpu_read = 0.0, 0.0

    @property
    def proc(self):
        return self.server.proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> PoolServer:
        """Starts the server (call it from the thread that lives as long as `up`: procs.spawn) and
        its readiness wait."""
        self.server.start()
        self.started_at = time.monotonic()
        self.listening.set()
        threading.Thread(target=self._wait_ready, name=f"ready-{self.name}", daemon=True).start()
        return self

    def _wait_ready(self) -> None:
        try:
            self.server.wait_ready(timeout_s=self.ready_timeout_s, stall_s=STALL_S, progress=None)
        except VllmError as e:
            if self.alive():  # hung or too slow: stopped, so that `up` sees it exit, with why
                self.failure = str(e).splitlines()[0]
                self.server.stop(10)
            return
        self.ready_after = time.monotonic() - self.started_at
        self.ready.set()

    @property
    def phase(self) -> str:
        """Its CPU time and last log line: a compile prints nothing for minutes, but uses the CPU."""
        if self.proc is None:
            return "starting the process"
        now = time.monotonic()
        if now - self._cpu_read >= CPU_EVERY_S:
            self._cpu, self._cpu_read = group_cpu_seconds(self.proc.pid), now
        return f"{self._cpu:.0f} CPU s; {self.server.phase()[:60]}"

    def alive(self) -> bool:
        return self.server.alive()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            self.server.send_signal(sig)

    def wait(self, timeout_s: float, force: threading.Event | None = None) -> int | None:
        """Its exit code once its whole process group is gone; SIGKILL after timeout_s or at `force`."""
        return self.server.stop(timeout_s, force=force)

    def last_lines(self, n: int = 8) -> str:
        why = f"  {self.failure}\n" if self.failure else ""
        return why + self.server.last_lines(n)
