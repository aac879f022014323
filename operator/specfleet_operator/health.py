"""Liveness that reflects the reconciler, not a thread that stays up without it.

The operator's event loop beats a `Heartbeat`, and each reconcile and control-loop tick is
registered while it runs; `/healthz` (beside `/metrics`, on the metrics port, served by the leader
and the standby alike) answers 503 once the loop has not beaten for `stale_after_s` (blocked) or a
piece of work has run longer than that (hung), and 200 otherwise. `POST /alertmanager` on the same
port takes Alertmanager's webhook posts into an `AlertInbox` (alerts.py), behind a bearer token.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import threading
import time
from typing import Any, Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from . import metrics as operator_metrics
from .alerts import AlertInbox, BearerToken, PayloadError, parse

logger = logging.getLogger("specfleet.operator.alerts")
MAX_BODY = 4 << 20  # bytes; a full Alertmanager group is far smaller


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


@dataclasses.dataclass
class AlertReceiver:
    """What `POST /alertmanager` needs: the inbox the loop reads, the token, whether this replica
    leads (a standby answers 503, so that Alertmanager retries and reaches the leader), and the
    namespaces the operator watches (an alert for a fleet elsewhere is refused)."""
    inbox: AlertInbox
    token: BearerToken
    leading: threading.Event | None = None  # None: a replica that always leads (tests, one replica)
    namespaces: tuple[str, ...] = ()  # empty: every namespace (main.Options.namespaces)

    def unwatched(self, alerts: list[Any]) -> str | None:
        """Why a post is refused for naming fleets outside the watched namespaces, or None."""
        if not self.namespaces:
            return None
        outside = [f"alerts[{i}] is for {a.fleet[0]}/{a.fleet[1]}" for i, a in enumerate(alerts)
                   if a.fleet is not None and a.fleet[0] not in self.namespaces]
        if not outside:
            return None
        return (f"{'; '.join(outside[:5])}{' ...' if len(outside) > 5 else ''}: this operator watches only the "
                f"namespaces {', '.join(self.namespaces)}, so nothing of this post was taken")


def _reply(start_response: Callable[..., Any], status: str, doc: dict[str, Any],
           headers: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
    body = json.dumps(doc).encode() + b"\n"
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers])
    return [body]


def receive_alerts(receiver: AlertReceiver | None, environ: dict[str, Any],
                   start_response: Callable[..., Any]) -> list[bytes]:
    """`POST /alertmanager`: off (404) without a token, never open; 401, 503 on a standby, 400 naming
    what is wrong with the payload, 403 naming the alerts for namespaces not watched, else 200 with
    what was taken in (a replayed alert is counted, and changes nothing)."""
    def refuse(status: str, reason: str, error: str, headers: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
        operator_metrics.ALERT_POSTS_REFUSED.labels(reason).inc()
        return _reply(start_response, status, {"error": error}, headers)

    token = receiver.token.get() if receiver is not None else None
    if receiver is None or token is None:
        return refuse("404 Not Found", "disabled", "the Alertmanager receiver is off: no bearer token is "
                      "configured (--alertmanager-token-file, the chart's alertmanager.tokenSecret)")
    if environ.get("REQUEST_METHOD") != "POST":
        return refuse("405 Method Not Allowed", "method", f"use POST, not {environ.get('REQUEST_METHOD')}",
                      (("Allow", "POST"),))
    why = receiver.token.refusal(environ.get("HTTP_AUTHORIZATION"), token)
    if why is not None:
        return refuse("401 Unauthorized", "unauthorized", why, (("WWW-Authenticate", 'Bearer realm="specfleet"'),))
    if receiver.leading is not None and not receiver.leading.is_set():
        return refuse("503 Service Unavailable", "standby", "this replica is a standby: retry, the leader takes alerts")
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = -1
    if not 0 < length <= MAX_BODY:
        return refuse("400 Bad Request", "malformed", f"body: expected a JSON payload of 1 to {MAX_BODY} bytes "
                      f"with its Content-Length, got {environ.get('CONTENT_LENGTH')!r}")
    try:
        alerts = parse(environ["wsgi.input"].read(length))
    except PayloadError as exc:
        return refuse("400 Bad Request", "malformed", str(exc))
    why = receiver.unwatched(alerts)
    if why is not None:
        return refuse("403 Forbidden", "namespace", why)
    matched, replayed = receiver.inbox.record(alerts)
    for a in alerts:
        operator_metrics.ALERTS_RECEIVED.labels(a.status if a.fleet else "unmatched").inc()
    if replayed:
        operator_metrics.ALERTS_RECEIVED.labels("replayed").inc(replayed)
        logger.warning("%d alerts were replays of episodes already resolved (same fingerprint and startsAt): "
                       "ignored", replayed)
    if matched < len(alerts):
        logger.info("%d of %d alerts name no fleet (labels sdd_namespace, sdd_name): ignored",
                    len(alerts) - matched, len(alerts))
    return _reply(start_response, "200 OK", {"alerts": len(alerts), "matched": matched, "replayed": replayed})


def app(heartbeat: Heartbeat, alerts: AlertReceiver | None = None) -> Callable[..., Any]:
    """WSGI: /healthz from the heartbeat, /alertmanager into the inbox, everything else
    prometheus_client's /metrics."""
    metrics = make_wsgi_app()

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO")
        if path == "/alertmanager":
            return receive_alerts(alerts, environ, start_response)
        if path != "/healthz":
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


def serve(port: int, heartbeat: Heartbeat, addr: str = "127.0.0.1",
          alerts: AlertReceiver | None = None) -> ThreadingWSGIServer:
    """Start /metrics, /healthz and /alertmanager on `port` (0: any free one, see server.server_port)
    in a daemon thread."""
    server = make_server(addr, port, app(heartbeat, alerts), ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="specfleet-metrics", daemon=True).start()
    return server
