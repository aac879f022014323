"""A `redis-server` process of our own on loopback: for `specfleet up` and for tests.

Persistence off (the fleet's state is derived from the resource, never only in Redis), a free
port picked here, on loopback only; with a `password`, every client must log in (it is in a 0600
config file, never on a command line that `ps` shows), and the process ended when the context exits; `detached` (for `specfleet up`)
puts it in a session of its own, tied to this process's life (`procs.spawn`). Its clients give up
on a call after their timeout, never retried (`client`): whoever calls tries again at its next
period. Chaos tests use `kill`, `pause`, `read_only`, `freeze` and `unreachable` to play the
failures the fleet must survive (the last two also on a server found by its pid and port, as in
`specfleet up`'s run file).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from specfleet_api.redis_auth import read_secret_file, write_secret_file

from .procs import spawn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1", binary: str = "redis-server",
                 workdir: Path | None = None, detached: bool = False, password: str | None = None):
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary} not found: install it (Debian: apt-get install redis-server; "
                                    "./dev setup does)")
        self.binary, self.host, self.port = path, host, port or free_port(host)
        self.workdir, self.detached, self.password = workdir, detached, password
        self.proc: subprocess.Popen | None = None
        self._confdir: str | None = None  # a temporary directory for the config file, without workdir

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        cmd = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
               "--protected-mode", "yes", "--loglevel", "warning"]
        if self.workdir is not None:
            cmd += ["--dir", str(self.workdir)]
        if self.password:
            confdir = self.workdir
            if confdir is None:
                confdir = self._confdir = tempfile.mkdtemp(prefix="specfleet-redis-")
            conf = Path(confdir) / "redis.conf"
            write_secret_file(conf, f"requirepass {self.password}")
            cmd.insert(1, str(conf))  # redis-server <config file> [options]
        popen = spawn if self.detached else subprocess.Popen
        self.proc = popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start: {self.proc.stderr.read().decode()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # it answers: up
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s} s")

    def client(self, **kw):
        """A client whose every call gives up after 2 s (connect, then each read), never retried:
        redis-py's default retries a timed-out call 10 times, 26 s on a paused server."""
        import redis

        kw.setdefault("socket_timeout", 2)
        kw.setdefault("socket_connect_timeout", 2)
        kw.setdefault("retry", no_retry())
        if self.password:
            kw.setdefault("password", self.password)
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

    def freeze(self) -> None:
        """SIGSTOP: the process stops; connections open, nothing answers (`thaw` resumes it)."""
        freeze(self.proc.pid)

    def thaw(self) -> None:
        thaw(self.proc.pid)

    def unreachable(self) -> Unreachable:
        """Frozen, and no new connection answered either (`Unreachable`); closing it thaws."""
        return Unreachable(self.host, self.port, self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            thaw(self.proc.pid)  # a frozen server gets its SIGTERM only once it runs again
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._confdir is not None:
            shutil.rmtree(self._confdir, ignore_errors=True)
            self._confdir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_credentials(run: dict | None) -> dict[str, str]:
    """The admin's login to a running `specfleet up`'s Redis, from its run file (`passwordFile`);
    {} for a run without one."""
    path = ((run or {}).get("redis") or {}).get("passwordFile")
    return {"password": read_secret_file(path)} if path else {}


def no_retry():
    """redis-py's retry policy for a call that is not retried."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


def freeze(pid: int) -> None:
    """SIGSTOP a server: the kernel still completes connections to it, nothing is ever answered."""
    os.kill(pid, signal.SIGSTOP)


def thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


class Unreachable:
    """A server that cannot be reached, as behind a network that drops its packets: frozen
    (SIGSTOP), and its listening socket's accept queue filled with connections of our own, so that
    a new connection's SYN is dropped and its connect times out (connections already open hang as
    on a paused server). `close` gives the queue back and thaws the server.

    The kernel drops a SYN to a full accept queue (net.ipv4.tcp_abort_on_overflow 0, the default);
    the queue holds the server's backlog (redis-server's tcp-backlog, 511) plus one."""

    def __init__(self, host: str, port: int, pid: int, max_connections: int = 8192):
        self.pid, self.sockets = pid, []
        freeze(pid)
        try:
            while len(self.sockets) < max_connections:
                s = socket.socket()
                s.settimeout(0.5)
                try:
                    s.connect((host, port))
                except OSError:  # timed out: the queue is full (or refused: nothing listens)
                    s.close()
                    break
                self.sockets.append(s)
            else:
                raise RuntimeError(f"{host}:{port} still took connections after {max_connections}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for s in self.sockets:
            s.close()
        self.sockets = []
        thaw(self.pid)

    def __enter__(self) -> Unreachable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
