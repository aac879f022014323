"""What this router tells the loop through Redis, every `period_s`: its prompt clusters' windows
(`cluster_key`), the drift counts of the current canary run (`drift_key`) and, where vLLM pools
serve, the windows of their answers per arm (`vllm_backend.Evidence.key`, a pod of the arm as the
loop reads it), each a hash that expires after three periods, so that a router that went away
stops counting.

Each write replaces the whole hash in one transaction (a reader never sees half of it). Fail
static, as the live state's reader: the publisher runs on its own task, a request never waits on
it, and when Redis is away it says so once per outage and tries again at the next period.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from specfleet_api.windows import cluster_key, drift_key

from .clusters import ClusterWindows
from .drift import Drift
from .metrics import RouterMetrics
from .state import RedisTask, redis_client
from .vllm_backend import Evidence

log = logging.getLogger("specfleet.router.fleet")

PERIOD_S = 5.0
TIMEOUT_S = 1.0


class FleetPublisher(RedisTask):
    task_name = "fleet-publisher"

    def __init__(self, url: str, namespace: str, name: str, router: str, metrics: RouterMetrics, *,
                 windows: ClusterWindows | None = None, drift: Drift | None = None, evidence: Evidence | None = None,
                 period_s: float = PERIOD_S):
        self.windows, self.drift, self.metrics, self.period_s = windows, drift, metrics, period_s
        self.evidence = evidence
        self.cluster_key = cluster_key(namespace, name, router)
        self.drift_key = drift_key(namespace, name, router)
        self.timeout_s = TIMEOUT_S
        self.client = redis_client(url, TIMEOUT_S)
        self.connected = True  # until a write fails: the first failure is an outage to report

    def _hashes(self) -> list[tuple[str, dict[str, str]]]:
        out = []
        if self.windows is not None:
            out.append((self.cluster_key, {c: w.to_json() for c, w in self.windows.snapshot().items()}))
        if self.drift is not None:
            out.append((self.drift_key, {kind: d.to_json() for kind, d in self.drift.current().items()}))
        if self.evidence is not None:
            out += self.evidence.hashes()
        return out

    async def publish_once(self) -> bool:
        """One write of everything; True when it went through. Never raises."""
        ttl_ms = int(self.period_s * 3 * 1000)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                for key, fields in self._hashes():
                    pipe.delete(key)
                    if fields:
                        pipe.hset(key, mapping=fields)
                        pipe.pexpire(key, ttl_ms)
                await pipe.execute()
        except Exception as e:  # any failure is the same here: the next period tries again
            self.metrics.fleet_publish_errors.inc()
            if self.connected:
                log.warning("redis unreachable; the cluster windows and drift counts are not published",
                            extra={"error": f"{type(e).__name__}: {e}"})
            self.connected = False
            return False
        if not self.connected:
            log.info("redis reachable again; publishing the cluster windows and drift counts")
        self.connected = True
        return True

    async def run(self) -> None:
        while not self.stopping:
            await asyncio.sleep(self.period_s)
            if not self.stopping:
                await self.publish_once()



def router_name(flag: str | None, env: dict, hostname: Callable[[], str]) -> str:
    """This router's name in cluster ids and keys: the flag, else $POD_NAME (the downward API),
    else the host name.

    >>> router_name(None, {"POD_NAME": "chat-router-7f-x"}, lambda: "h"), router_name("r1", {}, lambda: "h")
    ('chat-router-7f-x', 'r1')
    """
    return flag or env.get("POD_NAME") or hostname()
