"""The operator's side of the live state: each fleet's document (manifests.live_state, derived from
its spec and status) written to Redis under specfleet_api.live_state.state_key, for the routers
and workers that follow it.

A document is written only when its content differs from what Redis holds, with a version one
above both the stored one and the last one this process wrote, so a follower (which takes a
higher version) sees every change and an unchanged fleet costs one GET. Nothing here raises:
a Redis that is down, paused or read-only is logged once per outage, and writes to it are skipped
for `retry_after_s` after a failure (each try can cost the whole timeout, inside a fleet's status
write); the next write after that (the control loop's next tick at the latest) tries again, while
followers keep their last state.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from specfleet_api.live_state import LiveState, state_key

log = logging.getLogger("specfleet.operator.redis_state")


def same_content(a: LiveState, b: LiveState) -> bool:
    """Equal but for the version and the time written.

    >>> same_content(LiveState(version=3, canary_weight=1.0), LiveState(version=9, canary_weight=1.0, updated=5.0))
    True
    """
    return dataclasses.replace(a, version=0, updated=0.0) == dataclasses.replace(b, version=0, updated=0.0)


class LiveStateStore:
    """Writes live-state documents, one Redis client per URL (one try per call, `timeout_s` each)."""

    def __init__(self, timeout_s: float = 2.0, retry_after_s: float = 5.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self.timeout_s, self.retry_after_s, self.clock, self.monotonic = timeout_s, retry_after_s, clock, monotonic
        self._clients: dict[str, Any] = {}
        self._failed_at: dict[str, float] = {}  # url -> when a call to it last failed
        self._versions: dict[str, int] = {}  # key -> the last version this process wrote
        self._failing: set[str] = set()  # keys whose last write failed (log once per outage)

    def _client(self, url: str) -> Any:
        if url not in self._clients:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            self._clients[url] = aioredis.from_url(url, socket_timeout=self.timeout_s,
                                                   socket_connect_timeout=self.timeout_s,
                                                   retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return self._clients[url]

    async def write(self, url: str, namespace: str, name: str, wanted: LiveState) -> LiveState | None:
        """Make Redis hold `wanted` (its version and time are set here); returns the document Redis
        holds afterwards, or None when Redis could not be reached."""
        key = state_key(namespace, name)
        if self.monotonic() - self._failed_at.get(url, -1e18) < self.retry_after_s:
            return None  # it failed moments ago: do not make this fleet's status write wait again
        client = self._client(url)
        try:
            raw = await client.get(key)
            try:
                stored = LiveState.from_json(raw) if raw is not None else None
            except ValueError as exc:  # someone wrote garbage: replace it
                log.warning("replacing an invalid live state", extra={"key": key, "error": str(exc)})
                stored = None
            if stored is not None and same_content(stored, wanted):
                self._versions[key] = max(self._versions.get(key, 0), stored.version)
                doc = stored
            else:
                version = max(stored.version if stored else 0, self._versions.get(key, 0)) + 1
                doc = dataclasses.replace(wanted, version=version, updated=self.clock())
                await client.set(key, doc.to_json())
                self._versions[key] = version
                log.info("live state written", extra={"key": key, "version": version,
                                                      "canary_weight": doc.canary_weight, "speculate": doc.speculate})
        except Exception as exc:  # redis.RedisError, OSError, timeouts: all mean "not now"
            if key not in self._failing:
                log.warning("could not write the live state to Redis; routers and workers keep their last "
                            "state until it can be written", extra={"key": key, "error": f"{type(exc).__name__}: {exc}"})
            self._failing.add(key)
            self._failed_at[url] = self.monotonic()
            return None
        self._failed_at.pop(url, None)
        if key in self._failing:
            log.info("live state written again after an outage", extra={"key": key, "version": doc.version})
            self._failing.discard(key)
        return doc

    async def delete(self, url: str, namespace: str, name: str) -> bool:
        """Remove a deleted fleet's document; False when Redis could not be reached."""
        key = state_key(namespace, name)
        try:
            await self._client(url).delete(key)
        except Exception as exc:
            log.warning("could not delete the live state", extra={"key": key, "error": f"{type(exc).__name__}: {exc}"})
            return False
        self._versions.pop(key, None)
        return True

    async def close(self) -> None:
        for client in self._clients.values():
            try:
                await client.aclose()
            except Exception:  # closing a connection to a Redis that is gone
                pass
        self._clients.clear()


class WindowSource:
    """The control loop's reads: a fleet's windows (workers per arm and prompt type, routers per
    cluster, drift pairs) in its Redis, one client per URL, one try per tick (`timeout_s` each).
    A failure is an incomplete observation (nothing is decided on it), never an exception."""

    def __init__(self, timeout_s: float = 2.0):
        self.timeout_s = timeout_s
        self._clients: dict[str, Any] = {}

    def _client(self, url: str) -> Any:
        if url not in self._clients:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._clients[url] = redis.Redis.from_url(url, socket_timeout=self.timeout_s,
                                                      socket_connect_timeout=self.timeout_s,
                                                      retry=Retry(NoBackoff(), 0))
        return self._clients[url]

    async def observe(self, url: str, namespace: str, name: str, arms: tuple[str, ...], drift_epoch: str = ""):
        import asyncio

        from specfleet_control import observe

        return await asyncio.to_thread(observe.read, self._client(url), namespace, name, arms, drift_epoch)

    def close(self) -> None:
        for client in self._clients.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a connection to a Redis that is gone
                pass
        self._clients.clear()
