"""The deployment's live state, followed from Redis (specfleet_api.live_state); fail static.

With SPECFLEET_REDIS_URL and SPECFLEET_DEPLOYMENT=<namespace>/<name> set, one thread polls the
deployment's state key every `period_s` and applies what a worker acts on to its LiveConfig:
`speculate` and its own arm's K bounds (the arm is engine.json's `role`). When Redis is down,
paused or read-only the worker keeps the last state it applied (at start: engine.json and
control.json), logs once per outage, and its gauges say how stale it is. Only this thread talks
to Redis, so no request ever waits on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from specfleet_api import redis_auth
from specfleet_api.live_state import LiveState, state_key

from .config import LiveConfig

log = logging.getLogger("specfleet.worker")

REDIS_URL_ENV = "SPECFLEET_REDIS_URL"
DEPLOYMENT_ENV = "SPECFLEET_DEPLOYMENT"


def parse_deployment(value: str) -> tuple[str, str]:
    """SPECFLEET_DEPLOYMENT's `<namespace>/<name>`; ValueError naming what is wrong.

    >>> parse_deployment("default/chat")
    ('default', 'chat')
    """
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"{DEPLOYMENT_ENV}: {value!r} is not <namespace>/<name>")
    return namespace, name


def deployment_from_env() -> tuple[str, str] | None:
    """The deployment this worker belongs to, or None when SPECFLEET_DEPLOYMENT is unset."""
    value = os.environ.get(DEPLOYMENT_ENV)
    return parse_deployment(value) if value else None


def redis_client(url: str, timeout_s: float = 1.0):
    """A client whose every call gives up after `timeout_s` and is never retried: the threads
    that use it (this follower, the fleet publisher) try again at their next period. It logs in
    as the fleet's user when the environment holds one (specfleet_api.redis_auth, docs/redis.md)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0), **redis_auth.credentials_from_env())


class LiveStateFollower:
    """Polls one deployment's state key and applies each new version to a LiveConfig.

    A version is applied when it differs from the one applied last (a Redis that lost its data
    may come back with a writer that counts again from 1), and once more after every outage, since
    control.json may have moved the settings meanwhile. `staleness()` is the time since Redis last
    confirmed that this worker holds its state: a read that failed, or returned a document that
    could not be applied, confirms nothing."""

    def __init__(self, client, live: LiveConfig, namespace: str, name: str, arm: str, *, period_s: float = 0.5,
                 registry: CollectorRegistry | None = None, model: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.live, self.arm, self.period_s, self.clock = client, live, arm, period_s, clock
        self.key = state_key(namespace, name)
        self.version = 0  # the version applied; 0: none yet (engine.json and control.json stand)
        self.in_sync = False  # Redis answered the last poll and its state is the one applied
        self._confirmed = clock()
        self._down_since: float | None = None
        self._reported: str | None = None  # the problem logged last (missing key, bad document)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-state", daemon=True)
        if registry is not None:
            Gauge("spec_decode_live_state_version",
                  "Version of the deployment's live state (Redis) applied; 0: none yet, engine.json and "
                  "control.json stand", ["model"], registry=registry).labels(model).set_function(lambda: self.version)
            Gauge("spec_decode_live_state_staleness_seconds",
                  "Seconds since Redis last confirmed the live state this worker holds", ["model"],
                  registry=registry).labels(model).set_function(self.staleness)

    @classmethod
    def from_env(cls, live: LiveConfig, arm: str, **kw) -> LiveStateFollower | None:
        """None unless both SPECFLEET_REDIS_URL and SPECFLEET_DEPLOYMENT are set; ValueError for a
        malformed SPECFLEET_DEPLOYMENT."""
        deployment, url = deployment_from_env(), os.environ.get(REDIS_URL_ENV)
        if deployment is None or not url:
            return None
        return cls(redis_client(url), live, *deployment, arm, **kw)

    def staleness(self) -> float:
        return 0.0 if self.in_sync else max(self.clock() - self._confirmed, 0.0)

    def poll_once(self) -> bool:
        """One read of the state key; True when this worker now holds Redis's state."""
        try:
            raw = self.client.get(self.key)
        except Exception as e:  # noqa: BLE001 - any failure (refused, timed out, paused) is an outage
            self.in_sync = False
            if self._down_since is None:
                self._down_since = self.clock()
                log.warning("live state: Redis is unavailable; serving on the last state", extra={
                    "key": self.key, "version": self.version, "error": f"{type(e).__name__}: {e}"})
            return False
        resync = self._down_since is not None or not self.in_sync
        if self._down_since is not None:
            log.info("live state: Redis is back", extra={"key": self.key,
                                                         "outage_s": round(self.clock() - self._down_since, 3)})
            self._down_since = None
        if raw is None:  # nothing written yet (or Redis came back empty): the settings in force stand
            self._report("live state: no state at the key yet; keeping the settings in force", raw)
            self._synced()
            return True
        try:
            state = LiveState.from_json(raw)
        except ValueError as e:
            self.in_sync = False
            self._report("live state: ignoring a bad document", raw, logging.ERROR, error=str(e))
            return False
        if state.version != self.version or resync:
            try:
                self.live.apply_live_state(state, self.arm)
            except ValueError as e:  # the state's validation makes this unlikely; never fatal
                self.in_sync = False
                self._report("live state: cannot apply it", raw, logging.ERROR, error=str(e))
                return False
            previous, self.version = self.version, state.version
            self._synced()  # Redis's state is in force from here: staleness 0 as soon as it applies
            if state.version < previous:
                log.warning("live state: the version went back; applying it as Redis has it",
                            extra={"key": self.key, "from": previous, "to": state.version})
            log.info("live state applied", extra={"key": self.key, "version": state.version, "arm": self.arm,
                                                  "speculate": state.speculate,
                                                  "k": str(state.k.get(self.arm, "unchanged"))})
        self._reported = None
        self._synced()
        return True

    def _synced(self) -> None:
        self.in_sync, self._confirmed = True, self.clock()

    def _report(self, msg: str, raw, level: int = logging.INFO, **extra) -> None:
        """Logs a problem once, not every poll while it lasts."""
        what = f"{msg}:{raw!r}"
        if what != self._reported:
            self._reported = what
            log.log(level, msg, extra={"key": self.key, "version": self.version, **extra})

    def start(self) -> LiveStateFollower:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self.poll_once()
            if self._stop.wait(self.period_s):
                return
