"""Where the router's live state (canary weight, routing table, fallback flags) comes from: flags
alone, or a deployment's LiveState document in Redis, polled.

Fail static: the poll runs on its own task and requests only ever read `current`, so nothing in a
request's path waits on Redis. When Redis is down, paused or read-only the router keeps the last
state it read and says so (`connected` False, staleness growing); it resyncs at the next poll
that answers. A missing key, an invalid document or an older version changes nothing either.
Stopping never waits on Redis longer than `stop_bound_s()`, whatever state Redis is in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from specfleet_api import redis_auth
from specfleet_api.live_state import LiveState, state_key

from .metrics import RouterMetrics

log = logging.getLogger("specfleet.router.state")

POLL_S = 0.5  # a change is served within POLL_S + one read, well inside the 2 s the fleet promises
READ_TIMEOUT_S = 1.0
# A Redis call is at most this many socket steps (connect, write, read), each bounded by the
# client's timeout; a failed one adds a disconnect, bounded by the connect timeout.
CALL_STEPS = 4
RECANCEL_S = 0.05  # how often `close` cancels again a task that a lost cancel left running


class StateSource(Protocol):
    """What a request reads: the state in force now. Never blocks."""

    @property
    def current(self) -> LiveState: ...


class StaticState:
    """The state from flags (no Redis): fixed for the router's life."""

    def __init__(self, state: LiveState, metrics: RouterMetrics | None = None):
        self.current = state
        if metrics is not None:
            metrics.state_version.set(state.version)
            metrics.canary_weight.set(state.canary_weight)


def newer(candidate: LiveState, current: LiveState) -> bool:
    """Whether a document read from Redis replaces the one in force: a higher version, or a
    different version written later (a writer that started counting again after Redis lost
    everything must not be ignored forever).

    >>> old = LiveState(version=3, updated=100.0)
    >>> newer(LiveState(version=4, updated=90.0), old), newer(LiveState(version=3, updated=200.0), old)
    (True, False)
    >>> newer(LiveState(version=1, updated=200.0), old), newer(LiveState(version=2, updated=50.0), old)
    (True, False)
    """
    if candidate.version > current.version:
        return True
    return candidate.version < current.version and candidate.updated > current.updated


def redis_client(url: str, timeout_s: float):
    """An asyncio Redis client whose every socket step (connect, write, read) gives up after
    `timeout_s`, with one try per call: the caller's next period is the retry, and a paused or
    unreachable Redis must not hold a loop (or its stop) for longer. It logs in as the fleet's user
    when the environment holds one (specfleet_api.redis_auth, docs/redis.md)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                             retry=Retry(NoBackoff(), 0), health_check_interval=0,
                             **redis_auth.credentials_from_env())


class RedisTask:
    """A coroutine `run()` that talks to Redis through `self.client` on a task of its own: `start`
    it; `close` stops it and closes the client within `stop_bound_s()` (the state follower and the
    fleet publisher). `run()` loops while `stopping` is False.

    A cancel alone does not stop such a task for sure: one that reaches a Redis call as its write
    completes is lost (redis-py writes through `asyncio.wait_for`, which before Python 3.12 returns
    a result that finished with the cancel instead of raising it), and the loop then polled on
    forever while `close` waited for it. So `close` sets `stopping`, which the loop checks, and
    cancels again until the task has ended, for as long as the call in flight can last; then gives up
    on it (logged) rather than hold the router's stop."""

    task_name = "redis"
    client = None
    timeout_s: float = READ_TIMEOUT_S  # the client's socket timeouts
    stopping = False
    _task: asyncio.Task | None = None

    async def run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=self.task_name)

    def stop_bound_s(self) -> float:
        """The longest `close` takes: the Redis call in flight (cancelled, or ending by its own
        timeouts), then closing the client's connections (each disconnect bounded by the connect
        timeout)."""
        return CALL_STEPS * self.timeout_s + self.timeout_s

    async def close(self) -> None:
        self.stopping = True
        loop = asyncio.get_running_loop()
        task, end = self._task, loop.time() + CALL_STEPS * self.timeout_s
        while task is not None and not task.done() and loop.time() < end:
            task.cancel()
            await asyncio.wait({task}, timeout=min(RECANCEL_S, max(0.0, end - loop.time())))
        if task is not None and not task.done():
            log.error("a redis task did not stop; leaving it", extra={"task": self.task_name,
                                                                       "within_s": CALL_STEPS * self.timeout_s})
        elif task is not None and not task.cancelled() and task.exception() is not None:
            log.error("a redis task failed", extra={"task": self.task_name, "error": repr(task.exception())})
        closing = loop.create_task(self.client.aclose(), name=f"{self.task_name}-close")
        await asyncio.wait({closing}, timeout=self.timeout_s)
        if not closing.done():
            closing.cancel()
            log.error("closing a redis client timed out", extra={"task": self.task_name, "within_s": self.timeout_s})
        elif not closing.cancelled() and closing.exception() is not None:
            log.warning("closing a redis client failed", extra={"task": self.task_name,
                                                                 "error": repr(closing.exception())})


class RedisState(RedisTask):
    """Follows `specfleet:v1:<namespace>/<name>:state` in Redis, starting from `initial` (the
    flags' state) until the first good read."""

    task_name = "redis-state"

    def __init__(self, url: str, namespace: str, name: str, initial: LiveState, metrics: RouterMetrics,
                 *, poll_s: float = POLL_S, read_timeout_s: float = READ_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.url, self.key = url, state_key(namespace, name)
        self.current = initial
        self.metrics, self.poll_s, self.clock = metrics, poll_s, clock
        self.timeout_s = read_timeout_s
        self.client = redis_client(url, read_timeout_s)
        self.connected = False
        self.started = self.last_read = clock()  # stale since start until the first read
        metrics.state_version.set(initial.version)
        metrics.canary_weight.set(initial.canary_weight)
        metrics.redis_connected.set(0)
        metrics.redis_staleness.set_function(self.staleness)

    def staleness(self) -> float:
        """Seconds since the state was last read from Redis (since start, before the first read)."""
        return max(0.0, self.clock() - self.last_read)

    async def poll_once(self) -> bool:
        """One read; True when the state in force changed. Never raises."""
        try:
            raw = await self.client.get(self.key)
        except Exception as e:  # any failure is the same to a fail-static reader: keep what we have
            if self.connected:
                log.warning("redis unreachable; serving on the last state", extra={
                    "error": f"{type(e).__name__}: {e}", "version": self.current.version})
            self.connected = False
            self.metrics.redis_connected.set(0)
            self.metrics.state_errors.labels("unreachable").inc()
            return False
        if not self.connected:
            log.info("redis connected", extra={"key": self.key})
        self.connected, self.last_read = True, self.clock()
        self.metrics.redis_connected.set(1)
        if raw is None:  # nothing written yet (or Redis lost it): no decision on missing data
            return False
        try:
            doc = LiveState.from_json(raw)
        except ValueError as e:
            self.metrics.state_errors.labels("invalid").inc()
            log.warning("ignoring an invalid live state", extra={"key": self.key, "error": str(e)})
            return False
        if not newer(doc, self.current):
            return False
        log.info("live state changed", extra={"from_version": self.current.version, "version": doc.version,
                                              "canary_weight": doc.canary_weight})
        self.current = doc
        self.metrics.state_version.set(doc.version)
        self.metrics.canary_weight.set(doc.canary_weight)
        return True

    async def run(self) -> None:
        while not self.stopping:
            await self.poll_once()
            await asyncio.sleep(self.poll_s)

