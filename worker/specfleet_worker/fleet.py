"""Fleet statistics in Redis (SPECFLEET_REDIS_URL): each worker publishes its window's view.

Every `period_s` the worker writes one hash, `specfleet:worker:<pod>`, that expires after three
periods, so a worker that died drops out on its own. Readers (dashboards, the control plane, a
future fleet-wide K prior) take the mean over the keys they find. Redis being away costs a
warning per failure, never a request.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

log = logging.getLogger("specfleet.worker")

KEY_PREFIX = "specfleet:worker:"


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


class FleetPublisher:
    def __init__(self, client, worker, name: str | None = None, period_s: float = 5.0):
        self.client, self.worker, self.period_s = client, worker, period_s
        self.key = KEY_PREFIX + (name or os.environ.get("POD_NAME") or socket.gethostname())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet", daemon=True)
        self._warned = False

    @classmethod
    def from_env(cls, worker) -> FleetPublisher | None:
        url = os.environ.get("SPECFLEET_REDIS_URL")
        if not url:
            return None
        import redis

        return cls(redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2), worker)

    def publish_once(self) -> bool:
        try:
            pipe = self.client.pipeline()
            pipe.hset(self.key, mapping=snapshot(self.worker))
            pipe.expire(self.key, max(int(self.period_s * 3), 1))
            pipe.execute()
            self._warned = False
            return True
        except Exception as e:  # noqa: BLE001 - fleet statistics are best effort
            if not self._warned:
                log.warning("cannot publish fleet statistics", extra={"key": self.key, "error": str(e)})
                self._warned = True
            return False

    def start(self) -> FleetPublisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self.client.delete(self.key)  # leaving the fleet: do not wait for the expiry
        except Exception:  # noqa: BLE001 - best effort, as above
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.publish_once()
