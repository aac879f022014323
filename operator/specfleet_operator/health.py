"""Liveness that reflects the reconciler, not a thread that stays up without it.

The operator's event loop beats a `Heartbeat`, and each reconcile and control-loop tick is
registered while it runs; `/healthz` (beside `/metrics`, on the metrics port, served by the leader
and the standby alike) answers 503 once the loop has not beaten for `stale_after_s` (blocked) or a
piece of work has run longer than that (hung), and 200 otherwise.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from typing import Any, Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class Heartbeat:
    """What /healthz reads; the clock is passed in so tests need no sleeping.

    >>> now = [0.0]
    >>> hb = Heartbeat(stale_after_s=60, clock=lambda: now[0])
    >>> with hb.working("reconcile ml/chat"):
    ...     now[0] = 61.0; hb.beat()
    ...     hb.problem()
    'reconcile ml/chat has run for 61 s (stale after 60 s)'
    >>> hb.problem() is None  # the work finished
    True
    >>> now[0] = 122.0; hb.problem()
    "the operator's event loop has not run for 61 s (stale after 60 s)"
    """

    def __init__(self, stale_after_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.stale_after_s, self.clock = stale_after_s, clock
        self.last_beat = clock()
        self._work: dict[int, tuple[str, float]] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()  # /healthz reads from the server's thread

    def beat(self) -> None:
        self.last_beat = self.clock()

    @contextlib.contextmanager
    def working(self, what: str) -> Iterator[None]:
        key = next(self._keys)
        with self._lock:
            self._work[key] = (what, self.clock())
        try:
            yield
        finally:
            with self._lock:
                self._work.pop(key, None)

    def problem(self) -> str | None:
        """Why the operator is not live, or None when it is."""
        now, stale = self.clock(), self.stale_after_s
        if now - self.last_beat > stale:
            return f"the operator's event loop has not run for {now - self.last_beat:.0f} s (stale after {stale:.0f} s)"
        with self._lock:
            oldest = min(self._work.values(), key=lambda w: w[1], default=None)
        if oldest is not None and now - oldest[1] > stale:
            return f"{oldest[0]} has run for {now - oldest[1]:.0f} s (stale after {stale:.0f} s)"
        return None

    async def run(self) -> None:
        """Beat while the event loop runs: a handler that blocks the loop stops the beats."""
        while True:
            self.beat()
            await asyncio.sleep(self.stale_after_s / 6)


def app(heartbeat: Heartbeat) -> Callable[..., Any]:
    """WSGI: /healthz from the heartbeat, everything else prometheus_client's /metrics."""
    metrics = make_wsgi_app()

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("PATH_INFO") != "/healthz":
            return metrics(environ, start_response)
        problem = heartbeat.problem()
        body = (problem or "ok").encode() + b"\n"
        start_response("503 Service Unavailable" if problem else "200 OK",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]
    return serve


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
        pass


def serve(port: int, heartbeat: Heartbeat, addr: str = "0.0.0.0") -> ThreadingWSGIServer:
    """Start /metrics and /healthz on `port` (0: any free one, see server.server_port) in a daemon thread."""
    server = make_server(addr, port, app(heartbeat), ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="specfleet-metrics", daemon=True).start()
    return server
