"""The live state on this machine: written to the local Redis, and moved by the control loop.

The state is the operator's (`fleet_spec.live_state`: derived from the spec and the loop's
memory). `StateWriter` owns the deployment's key in the local Redis, as the operator does in a
cluster: it writes the first state, and every period hands what the fleet published (an
`Observation`: the arms' windows, the routers' clusters and drift pairs) to a `Loop`, whose answer
(a new state, or None to keep this one) it writes as the next version. `ControlLoop` is the
operator's SLO loop (specfleet_control, the same code) with its memory kept in this process, as
the SDD status keeps it in a cluster; it mirrors the memory and its recent events to
`<prefix>:loop` for `specfleet status`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from specfleet_api import fleet_spec
from specfleet_api.live_state import PREFIX, LiveState, state_key
from specfleet_control import canary as canaries
from specfleet_control import fleet as control_fleet
from specfleet_control import loop as slo_loop
from specfleet_control import observe
from specfleet_control.kbounds import KTuning
from specfleet_control.methods import Selection
from specfleet_control.observe import Observation
from specfleet_control.slo import SloPolicy

log = logging.getLogger("specfleet.local")


def initial_state(spec: dict[str, Any]) -> LiveState:
    """The state a defaulted spec starts from (version 1, stamped now): the operator's derivation
    with the loop's memory at its start."""
    return fleet_spec.live_state(spec, fleet_spec.FleetState(), version=1, updated=time.time())


def gate_key(namespace: str, name: str) -> str:
    """The local fleet's canary gate (`specfleet canary GATE NAME --local` writes it): what the
    annotation serving.specfleet.dev/canary is in a cluster.

    >>> gate_key("default", "local")
    'specfleet:v1:default/local:gate'
    """
    return f"{PREFIX}{namespace}/{name}:gate"


def loop_key(namespace: str, name: str) -> str:
    """Where the local loop mirrors its memory and recent events (a JSON string).

    >>> loop_key("default", "local")
    'specfleet:v1:default/local:loop'
    """
    return f"{PREFIX}{namespace}/{name}:loop"


class Loop(Protocol):
    def tick(self, state: LiveState, obs: Observation, now: float) -> LiveState | None:
        """The next state (`state.next(...)`) from what the fleet shows, or None to keep `state`."""


class HoldSpec:
    """A loop that keeps the spec's state (`specfleet up --no-loop`)."""

    def tick(self, state: LiveState, obs: Observation, now: float) -> LiveState | None:
        return None


class ControlLoop:
    """The operator's loop, run here: the same `specfleet_control` SLO loop and canary analysis on
    the same windows, their memory in this object (the SDD status in a cluster), their events
    logged, kept (the last 100) and counted by reason for `specfleet status`. `readiness` says how many workers of
    each arm are ready (the operator reads the Deployments); `gate` is the manual canary gate (the
    annotation in a cluster), `clear_gate` removes it once promote or abort acted."""

    def __init__(self, spec: dict[str, Any], clock: Callable[[], float] = time.time,
                 readiness: Callable[[], dict[str, tuple[int, int]]] | None = None,
                 gate: Callable[[], str | None] | None = None, clear_gate: Callable[[], None] | None = None):
        self.spec, self.policy = spec, SloPolicy.from_spec(spec)
        self.memory = slo_loop.Memory()
        self.canary = canaries.CanaryState()
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.decisions: collections.Counter[str] = collections.Counter()  # every event by reason (the operator's counter)
        self.decided = 0  # ticks that judged a complete observation
        self.skipped = 0  # ticks on missing data (nothing decided)
        self.clock, self.readiness, self.gate, self.clear_gate = clock, readiness, gate, clear_gate

    def fleet(self) -> fleet_spec.FleetState:
        return control_fleet.fleet_state(self.memory, self.canary, self.spec)

    def _event(self, now: float, reason: str, message: str) -> None:
        log.info("control loop: %s", message, extra={"reason": reason})
        self.events.append({"time": round(now, 3), "reason": reason, "message": message})
        self.decisions[reason] += 1

    def tick(self, state: LiveState, obs: Observation, now: float) -> LiveState | None:
        if self.readiness is not None:
            obs = dataclasses.replace(obs, ready=self.readiness())
        t = slo_loop.tick(obs, self.memory, self.policy, now, per_type=True,
                          selection=Selection.from_spec(self.spec, self.fleet()), tuning=KTuning.from_spec(self.spec))
        if not t.decided:
            self.skipped += 1
        else:
            self.decided += 1
            self.memory = t.memory
        gate = self.gate() if self.gate is not None else None
        meta = {"annotations": {canaries.GATE_ANNOTATION: gate}} if gate else {}
        decision = canaries.tick(self.spec, meta, self.canary.to_status(), canaries.observation(obs, None), now)
        self.canary = decision.state
        if decision.clear_gate and self.clear_gate is not None:
            self.clear_gate()
        for reason, message in t.events + decision.events:
            self._event(now, reason, message)
        wanted = fleet_spec.live_state(self.spec, self.fleet())
        fields = {f.name: getattr(wanted, f.name) for f in dataclasses.fields(LiveState)
                  if f.name not in ("version", "updated")}
        if all(getattr(state, k) == v for k, v in fields.items()):
            return None
        return state.next(**fields)

    def document(self) -> dict[str, Any]:
        """What `specfleet status` shows of the loop."""
        return {"memory": self.memory.to_status(), "fallback": {"promptTypes": list(self.memory.fallback_types()),
                                                                 "clusters": list(self.memory.fallback_clusters()),
                                                                 "deployment": self.memory.whole},
                "methods": self.memory.chosen_methods(),
                "kCeilings": self.memory.k_ceilings(),
                "clusterMethods": self.memory.cluster_routes(),
                "canary": self.canary.to_status() if self.spec.get("canary") else None,
                "events": list(self.events), "decisions": dict(self.decisions),
                "ticks": {"decided": self.decided, "skipped": self.skipped}}


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
        obs = observe.read(self.client, self.namespace, self.name, arms, self.state.drift_epoch)
        decided = self.loop.tick(self.state, obs, self.clock())
        if decided is not None:
            if decided.version <= self.state.version:
                raise ValueError(f"the loop's state has version {decided.version}, not above "
                                 f"{self.state.version}: return state.next(...)")
            self.write(decided)
            log.info("live state: new version", extra={"key": self.key, "version": self.state.version})
        document = getattr(self.loop, "document", None)
        if document is not None:
            self.client.set(loop_key(self.namespace, self.name), json.dumps(document()))

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
