"""The live state on this machine: written to the local Redis, and moved by a loop.

The state is the operator's (`manifests.live_state`: derived from the spec and the loop's
memory). `StateWriter` owns the deployment's key in the local Redis, as the operator does in a
cluster: it writes the first state, and every period hands the arms' windows to a `Loop`, whose
answer (a new state, or None to keep this one) it writes as the next version. Today's loop,
`HoldSpec`, keeps the spec's state; the control loop (SLO fallback, canary analysis) plugs in as
another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from specfleet_api.live_state import LiveState, state_key
from specfleet_operator import manifests

from specfleet_api.windows import Window, read_windows

log = logging.getLogger("specfleet.local")


def initial_state(spec: dict[str, Any]) -> LiveState:
    """The state a defaulted spec starts from (version 1, stamped now): the operator's derivation
    with the loop's memory at its start."""
    return manifests.live_state(spec, manifests.FleetState(), version=1, updated=time.time())


class Loop(Protocol):
    def tick(self, state: LiveState, windows: dict[str, dict[str, Window]], now: float) -> LiveState | None:
        """The next state (`state.next(...)`) from what the arms' windows show, or None to keep `state`."""


class HoldSpec:
    """The loop `up` runs until the control loop lands: the spec's state, unchanged."""

    def tick(self, state: LiveState, windows: dict[str, dict[str, Window]], now: float) -> LiveState | None:
        return None


class StateWriter:
    """The deployment's state key in the local Redis, kept by one thread.

    A Redis that lost the key (restarted empty) gets the state in force written back; a loop's
    new state is written as the next version. A failed write is retried at the next period, and
    nothing else waits on it: routers and workers serve on the last state they read."""

    def __init__(self, client, namespace: str, name: str, state: LiveState, loop: Loop | None = None,
                 period_s: float = 1.0, clock: Callable[[], float] = time.time):
        self.client, self.namespace, self.name = client, namespace, name
        self.key = state_key(namespace, name)
        self.state, self.loop = state, loop or HoldSpec()
        self.period_s, self.clock = period_s, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)
        self._failing = False

    def write(self, state: LiveState | None = None) -> None:
        """Writes `state` (default: the one in force) and makes it the one in force."""
        state = state or self.state
        self.client.set(self.key, state.to_json())
        self.state = state

    def tick_once(self) -> None:
        if self.client.get(self.key) is None:
            log.warning("live state: the key is missing (Redis restarted?); writing it again",
                        extra={"key": self.key, "version": self.state.version})
            self.write()
        arms = tuple(self.state.k) or ("stable",)
        decided = self.loop.tick(self.state, read_windows(self.client, self.namespace, self.name, arms), self.clock())
        if decided is not None:
            if decided.version <= self.state.version:
                raise ValueError(f"the loop's state has version {decided.version}, not above "
                                 f"{self.state.version}: return state.next(...)")
            self.write(decided)
            log.info("live state: new version", extra={"key": self.key, "version": self.state.version})

    def start(self) -> StateWriter:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.tick_once()
                self._failing = False
            except Exception as e:  # noqa: BLE001 - Redis away (or a bad loop): the next period tries again
                if not self._failing:
                    log.warning("live state: this period's tick failed; retrying each period",
                                extra={"error": f"{type(e).__name__}: {e}"})
                    self._failing = True
