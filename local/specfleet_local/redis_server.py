"""A `redis-server` process of our own on loopback: for `specfleet up` and for tests.

Persistence off (the fleet's state is derived from the resource, never only in Redis), a free
port picked here, and the process ended when the context exits; `detached` (for `specfleet up`)
puts it in a session of its own, tied to this process's life (`procs.spawn`). Chaos tests use `kill`,
`pause` and `read_only` to play the failures the fleet must survive.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from .procs import spawn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1", binary: str = "redis-server",
                 workdir: Path | None = None, detached: bool = False):
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary} not found: install it (Debian: apt-get install redis-server; "
                                    "./dev setup does)")
        self.binary, self.host, self.port = path, host, port or free_port(host)
        self.workdir, self.detached = workdir, detached
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        cmd = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
               "--protected-mode", "yes", "--loglevel", "warning"]
        if self.workdir is not None:
            cmd += ["--dir", str(self.workdir)]
        popen = spawn if self.detached else subprocess.Popen
        self.proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start: {self.proc.stderr.read().decode()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s} s")

    def client(self, **kw):
        import redis

        kw.setdefault("socket_timeout", 2)
        kw.setdefault("socket_connect_timeout", 2)
        return redis.Redis(host=self.host, port=self.port, **kw)

    def kill(self) -> None:
        """SIGKILL: the server vanishes with everything in it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self, seconds: float) -> None:
        """CLIENT PAUSE: every client's commands hang for `seconds`."""
        self.client().execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")

    def read_only(self, on: bool = True) -> None:
        """Writes fail (as on a replica), reads work."""
        self.client().config_set("min-replicas-to-write", 1 if on else 0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
