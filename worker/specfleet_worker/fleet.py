"""Fleet statistics in Redis (SPECFLEET_REDIS_URL): each worker publishes what it observed.

At start and every `period_s` (5 s) after, the worker writes, in one transaction, each key
expiring after three periods so that a worker that died drops out on its own:

    specfleet:worker:<pod>                                      its summary (a hash of strings), or with
    specfleet:v1:<namespace>/<name>:worker:<pod>                SPECFLEET_DEPLOYMENT set, under its fleet's
                                                                keys (the only ones its Redis user may write)
    specfleet:v1:<namespace>/<name>:window:<arm>:<pod>          its windows, with SPECFLEET_DEPLOYMENT set:
                                                                a hash, field = prompt type, value = JSON

A window is what the requests of one prompt type did on this worker over the last `window_s`
(SPECFLEET_FLEET_WINDOW_S, 60 s by default, set to the SLO window; less while the worker is
younger): requests and errors, output tokens, decoding steps, drafts, draft and accepted tokens,
the plain-equivalent and busy seconds of their share of each step (the speedup meter's two
sides; `spec_` the same for the requests that speculated, the probes in fallback), and TTFT and
TPOT sums, counts and histograms (`specfleet_api.windows.TypeCounts`), with `window_seconds` and
`updated`. Readers sum a field over the pods of an arm (the loop, the router, `specfleet
status`). Redis being away costs a warning per outage, never a request.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time

from specfleet_api.live_state import PREFIX, window_key

from .live import REDIS_URL_ENV, deployment_from_env, redis_client
from specfleet_api.windows import Windows, publish_period, window_json

log = logging.getLogger("specfleet.worker")

KEY_PREFIX = "specfleet:worker:"
WINDOW_ENV = "SPECFLEET_FLEET_WINDOW_S"
DEFAULT_WINDOW_S = 60.0


def window_from_env() -> float:
    """SPECFLEET_FLEET_WINDOW_S in seconds (60 when unset); ValueError naming it when it is not a
    positive number."""
    raw = os.environ.get(WINDOW_ENV, "").strip()
    if not raw:
        return DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{WINDOW_ENV}: {raw!r} is not a positive number of seconds")
    return value


def snapshot(worker) -> dict[str, str]:
    """What one worker reports: flat strings, as a Redis hash holds them."""
    sch, m = worker.scheduler, worker.scheduler.metrics
    return {
        "model": worker.model_name, "role": worker.role, "quantization": worker.quantization,
        "acceptance_rate": f"{m.window.rate:.6f}",
        "mean_accepted_length": f"{m.window.tau:.6f}",
        "speedup_ratio": f"{sch.speedup_ratio():.6f}",
        "acceptance_rate_by_prompt_type": json.dumps({t: round(w.rate, 6)
                                                      for t, w in list(m.window_by_type.items())}),
        "requests_total": str(sch.requests_total), "queue_depth": str(sch.queue_depth()),
        "running": str(sch.running()), "updated": f"{time.time():.3f}",
    }


def pod_window_key(namespace: str, name: str, arm: str, pod: str) -> str:
    """The hash of one pod's windows.

    >>> pod_window_key("default", "chat", "canary", "chat-canary-7d9f-x2x")
    'specfleet:v1:default/chat:window:canary:chat-canary-7d9f-x2x'
    """
    return f"{window_key(namespace, name, arm)}:{pod}"


class FleetPublisher:
    def __init__(self, client, worker, name: str | None = None, period_s: float | None = None,
                 deployment: tuple[str, str] | None = None, window_s: float = DEFAULT_WINDOW_S):
        period_s = publish_period(window_s) if period_s is None else period_s
        self.client, self.worker, self.period_s = client, worker, period_s
        pod = name or os.environ.get("POD_NAME") or socket.gethostname()
        self.key = f"{PREFIX}{deployment[0]}/{deployment[1]}:worker:{pod}" if deployment else KEY_PREFIX + pod
        self.window_key = pod_window_key(*deployment, worker.role, pod) if deployment else None
        self.windows = Windows(worker.scheduler.metrics.counts_by_type, window_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet", daemon=True)
        self._warned = False

    @classmethod
    def from_env(cls, worker, **kw) -> FleetPublisher | None:
        """None without SPECFLEET_REDIS_URL; windows too with SPECFLEET_DEPLOYMENT, of
        SPECFLEET_FLEET_WINDOW_S seconds (ValueError when either is malformed)."""
        url = os.environ.get(REDIS_URL_ENV)
        if not url:
            return None
        kw.setdefault("window_s", window_from_env())
        return cls(redis_client(url, timeout_s=2.0), worker, deployment=deployment_from_env(), **kw)

    def window_fields(self) -> dict[str, str]:
        """This period's windows, one JSON object per prompt type."""
        seconds, windows = self.windows.take()
        updated = round(time.time(), 3)
        return {t: window_json(c, seconds, updated) for t, c in sorted(windows.items())}

    def publish_once(self) -> bool:
        ttl = max(int(self.period_s * 3), 1)
        try:
            windows = self.window_fields() if self.window_key else {}  # taken even when Redis is away
            pipe = self.client.pipeline()
            pipe.hset(self.key, mapping=snapshot(self.worker))
            pipe.expire(self.key, ttl)
            if windows:  # an empty mapping is an error to Redis; until the first request there is none
                pipe.hset(self.window_key, mapping=windows)
                pipe.expire(self.window_key, ttl)
            pipe.execute()
        except Exception as e:  # noqa: BLE001 - fleet statistics are best effort
            if not self._warned:
                log.warning("cannot publish fleet statistics", extra={"key": self.key, "error": str(e)})
                self._warned = True
            return False
        if self._warned:
            log.info("publishing fleet statistics again", extra={"key": self.key})
            self._warned = False
        return True

    def start(self) -> FleetPublisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self.client.delete(self.key, *([self.window_key] if self.window_key else []))  # leaving the fleet
        except Exception:  # noqa: BLE001 - best effort, as above
            pass

    def _run(self) -> None:
        while True:  # at once, so that a new worker shows up in the fleet without waiting a period
            self.publish_once()
            if self._stop.wait(self.period_s):
                return
