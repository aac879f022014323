"""The processes `specfleet up` starts: detached from the terminal, tied to `up`'s life, logs kept.

Each child runs in a session of its own, so a Ctrl-C at the terminal reaches `up` alone and `up`
stops them in its order (router, workers, Redis); each is asked to die with `up` (Linux's
PR_SET_PDEATHSIG, SIGTERM: they drain), so even a `kill -9` of `up` leaves none behind. A child
writes its JSON log lines (stderr) to its log file itself, so what it says after `up` is gone (its
exit path, step by step) is kept, and no pipe `up` stopped reading can block it; a thread follows
the file and keeps what `up` needs: the ports of its `listening` line, its phase, and its last
lines for an error message.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

#: A worker's log messages in the order they come, and what each means for someone waiting.
PHASES = {
    "listening": "loading the model, then calibrating step costs",
    "calibrated step costs": "starting to serve",
    "ready": "ready",
    "shutting down": "stopping",
    "draining": "draining",
    "exiting": "exiting",
}


def _tie_to(parent: int):
    def preexec() -> None:  # in the child, between fork and exec: no Python objects shared, no locks
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl: nothing would ever signal us
            os._exit(1)

    return preexec if _libc is not None else None


def spawn(cmd: list[str], **kw) -> subprocess.Popen:
    """Popen in a session of its own, sent SIGTERM when this process dies. Call it from a
    thread that lives as long as the child: the death signal follows the thread that forked."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_tie_to(os.getpid()), **kw)


class Child:
    """One `specfleet serve` or `specfleet router` process and what its log lines said."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
                 arm: str | None = None):
        self.name, self.cmd, self.log_path, self.arm = name, cmd, log_path, arm
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.phase = "starting the process"
        self.ports: dict[str, int] = {}
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.listening, self.ready = threading.Event(), threading.Event()
        self.started_at = self.ready_after = 0.0
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        with open(self.log_path, "wb") as log:  # the child's own descriptor outlives `up`
            self.proc = spawn(self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        self._reader = threading.Thread(target=self._follow, name=f"log-{self.name}", daemon=True)
        self._reader.start()
        return self

    def _follow(self, poll_s: float = 0.05) -> None:
        """Reads the log file as the child writes it, line by line, until the child has exited and
        every line it wrote is read."""
        with open(self.log_path, encoding="utf-8", errors="replace", newline="") as log:
            partial = ""
            while True:
                exited = self.proc.poll() is not None  # before the read: nothing written after it is missed
                chunk = log.read()
                if chunk:
                    *lines, partial = (partial + chunk).split("\n")
                    for line in lines:
                        self._line(line)
                elif exited:
                    if partial:
                        self._line(partial)
                    return
                else:
                    time.sleep(poll_s)

    def _line(self, line: str) -> None:
        self.tail.append(line.rstrip("\r"))
        try:
            rec = json.loads(line)
        except ValueError:
            return
        msg = rec.get("msg") if isinstance(rec, dict) else None
        if msg == "listening":
            self.ports = {k.removesuffix("_port"): int(v) for k, v in rec.items() if k.endswith("_port")}
            self.listening.set()
        if msg == "ready":
            self.ready_after = time.monotonic() - self.started_at
            self.ready.set()
        self.phase = PHASES.get(msg, self.phase)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float, force: threading.Event | None = None) -> int | None:
        """Its exit code once it exits; SIGKILL after timeout_s, or as soon as `force` is set."""
        if self.proc is None:
            return None
        end = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            if time.monotonic() > end or (force is not None and force.is_set()):
                self.proc.kill()
                self.proc.wait(10)
                break
            time.sleep(0.05)
        if self._reader is not None:
            self._reader.join(2)
        return self.proc.returncode

    def last_lines(self, n: int = 8) -> str:
        """Its last log lines, messages first, for an error a person reads."""
        out = []
        for line in list(self.tail)[-n:]:
            try:
                rec = json.loads(line)
                extra = {k: v for k, v in rec.items() if k not in ("ts", "level", "logger", "msg")}
                out.append(f"  {rec.get('level', '')}: {rec.get('msg', '')} {json.dumps(extra) if extra else ''}")
            except (ValueError, AttributeError):
                out.append(f"  {line}")
        return "\n".join(out) + f"\n  (whole log: {self.log_path})"
