"""The live settings that the admin surface moves, from engine.json (specfleet_api.engine_config).

`LiveConfig` holds what may change at run time (K bounds, speculation on/off, the method per
prompt type); every change swaps one frozen snapshot, so the scheduler reads a consistent view
once per step without a lock. Changes come from the Admin service, control.json and the live
state in Redis (live.py). EngineConfig lives in the torch-free specfleet_api.

Speculation has two switches. `speculation_enabled` is the hard one (Admin.UpdateConfig, the
operator's emergency switch): off, every request runs plain. `default_speculate` is the soft one
(the live state's and control.json's `speculate`, the fleet's fallback): off, only the router's
probes (`GenerateRequest.probe`) speculate, with the method they name.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from specfleet_api.engine_config import AUTO, EngineConfig
from specfleet_api.enums import Method
from specfleet_api.limits import K_LIMIT
from specfleet_api.live_state import LiveState

__all__ = ["AUTO", "EngineConfig", "LiveConfig", "Settings"]

log = logging.getLogger("specfleet.worker")


@dataclass(frozen=True)
class Settings:
    """One consistent snapshot of what the control plane may move at run time."""

    speculation_enabled: bool  # hard: off, every request runs plain
    k_min: int
    k_max: int
    k_initial: int
    k_policy: str
    default_method: str
    by_prompt_type: dict[str, str]
    default_speculate: bool = True  # soft: off, only the router's probes speculate
    # a lower kMax for some prompt types (the live state's, the stable arm's: the control loop's)
    k_ceilings: dict[str, int] = dataclasses.field(default_factory=dict)

    def k_bounds(self, prompt_type: str) -> tuple[int, int]:
        """(kMin, kMax) for a request of this prompt type: the deployment's, under its ceiling.

        >>> s = Settings(True, 2, 8, 4, "adaptive", "ngram", {}, k_ceilings={"code": 3, "qa": 1})
        >>> s.k_bounds("code"), s.k_bounds("qa"), s.k_bounds("chat")
        ((2, 3), (1, 1), (2, 8))
        """
        k_max = min(self.k_max, self.k_ceilings.get(prompt_type, self.k_max))
        return min(self.k_min, k_max), k_max

    def method_for(self, requested: str, prompt_type: str, probe: bool = False) -> str:
        """The method a new request runs with: "none" under the hard off, and under the soft off
        unless it is a probe; else the one it names, or the route of its prompt type.

        >>> s = Settings(True, 0, 8, 4, "adaptive", "ngram", {"chat": "none"}, default_speculate=False)
        >>> s.method_for("ngram", "code"), s.method_for("ngram", "code", probe=True)
        ('none', 'ngram')
        >>> dataclasses.replace(s, speculation_enabled=False).method_for("ngram", "code", probe=True)
        'none'
        """
        if not self.speculates(probe):
            return Method.NONE.value
        if requested and requested != AUTO:
            return requested
        return self.by_prompt_type.get(prompt_type, self.default_method)

    def speculates(self, probe: bool) -> bool:
        """Whether speculation is on for a request, a probe or not."""
        return self.speculation_enabled and (self.default_speculate or probe)

    def drafts(self, method: str, probe: bool) -> bool:
        """Whether a running request with this method may draft now."""
        return method != Method.NONE.value and self.speculates(probe)


class LiveConfig:
    """The current `Settings`; `update` validates against the methods the engine has."""

    def __init__(self, cfg: EngineConfig, methods: list[str]):
        self.methods = sorted(set(methods) | {Method.NONE.value})
        self._lock = threading.Lock()
        default = self._usable(cfg.default_method, "routing.default", fallback=Method.NONE.value)
        routes = {t: self._usable(m, f"routing.byPromptType.{t}", fallback=default)
                  for t, m in cfg.by_prompt_type.items()}
        self.settings = Settings(cfg.draft_method != Method.NONE, cfg.k_min, cfg.k_max,
                                 min(max(cfg.k_initial, cfg.k_min), cfg.k_max), cfg.k_policy, default, routes)

    def _usable(self, method: str, where: str, fallback: str) -> str:
        if method == AUTO:
            return fallback
        if method not in self.methods:
            log.warning("engine.json: %s names %r, which this worker does not have (%s); using %r",
                        where, method, ", ".join(self.methods), fallback)
            return fallback
        return method

    def update(self, *, speculation_enabled: bool | None = None, default_speculate: bool | None = None,
               k_min: int | None = None, k_max: int | None = None, default_method: str | None = None,
               by_prompt_type: dict[str, str] | None = None, k_ceilings: dict[str, int] | None = None) -> Settings:
        """Raises ValueError naming the field; nothing changes then."""
        with self._lock:
            s = self.settings
            k_lo = s.k_min if k_min is None else k_min
            k_hi = s.k_max if k_max is None else k_max
            if not 0 <= k_lo <= k_hi <= K_LIMIT:
                raise ValueError(f"k_min, k_max: need 0 <= k_min <= k_max <= {K_LIMIT}, got {k_lo}, {k_hi}")
            for name, m in [("default_method", default_method)] + [
                    (f"method_by_prompt_type[{t!r}]", m) for t, m in (by_prompt_type or {}).items() if m]:
                if m is not None and m not in self.methods:
                    raise ValueError(f"{name}: unknown method {m!r}; this worker has {self.methods}")
            routes = dict(s.by_prompt_type)
            for t, m in (by_prompt_type or {}).items():
                if m:
                    routes[t] = m
                else:
                    routes.pop(t, None)
            self.settings = dataclasses.replace(
                s, speculation_enabled=s.speculation_enabled if speculation_enabled is None else speculation_enabled,
                default_speculate=s.default_speculate if default_speculate is None else default_speculate,
                k_min=k_lo, k_max=k_hi, k_initial=min(max(s.k_initial, k_lo), k_hi),
                default_method=s.default_method if default_method is None else default_method,
                by_prompt_type=routes, k_ceilings=s.k_ceilings if k_ceilings is None else dict(k_ceilings))
            log.info("settings changed", extra={"settings": dataclasses.asdict(self.settings)})
            return self.settings

    def apply_live_state(self, state: LiveState, arm: str) -> Settings:
        """The deployment's live state from Redis (live.py): `speculate` (the soft switch), and
        the K bounds of this worker's arm when the state has them, and on the stable arm the loop's
        K ceilings per prompt type. The method per prompt type is the router's choice, sent with
        each request, so the state's routes are not applied here.

        Writers mark speculation off with kMax 0 too (the operator does); under the soft off a
        probe still speculates with the bounds in force, so kMax 0 beside `speculate: false` is
        read as "off", not as bounds (control.json alike)."""
        bounds = state.k.get(arm)
        if bounds is not None and not state.speculate and bounds.k_max == 0:
            bounds = None
        return self.update(default_speculate=state.speculate, k_min=bounds.k_min if bounds else None,
                           k_max=bounds.k_max if bounds else None,
                           k_ceilings=state.k_ceilings if arm == "stable" else {})

    def apply_control_file(self, raw: dict) -> Settings:
        """control.json, written by the operator's control loop: {speculate, kMin, kMax}."""
        speculate = bool(raw.get("speculate", True))
        if not speculate and int(raw.get("kMax", 1)) == 0:  # "off", not bounds (apply_live_state)
            return self.update(default_speculate=False)
        k_max = int(raw.get("kMax", self.settings.k_max))
        k_min = min(int(raw.get("kMin", self.settings.k_min)), k_max)
        return self.update(default_speculate=speculate, k_min=k_min, k_max=k_max)
