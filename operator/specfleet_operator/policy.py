"""The control loop as a pure policy: decide(metrics, state, policy, now) -> Decision.

Two loops share it: the alpha SLO (enter fallback when acceptance or speedup drops below the
floor, leave it after recoverAfter), and the canary (analyse every interval; a failed check
counts, failureLimit of them aborts; a passed pause moves to the next step; after the last step
the canary is promoted). A kopf timer feeds it observations; no clock or client in here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .spec import parse_duration


@dataclasses.dataclass(frozen=True)
class RoleMetrics:
    """What one role's workers report over the SLO window (None: not reported)."""

    alpha: float | None = None
    mean_accepted_length: float | None = None
    speedup: float | None = None
    error_rate: float | None = None
    p99_latency_seconds: float | None = None

    def get(self, name: str) -> float | None:
        return {"alpha": self.alpha, "speedup": self.speedup, "errorRate": self.error_rate,
                "p99LatencySeconds": self.p99_latency_seconds}[name]


@dataclasses.dataclass(frozen=True)
class Metrics:
    stable: RoleMetrics | None = None
    canary: RoleMetrics | None = None


@dataclasses.dataclass(frozen=True)
class LoopState:
    """The control loop's memory, kept in the SDD status between ticks (times in epoch seconds)."""

    mode: str = "speculative"
    fallback_since: float | None = None
    canary_phase: str = "Idle"
    canary_step: int = 0  # 0: at spec.canary.weight; i: at steps[i-1]
    canary_weight: float | None = None  # percent of requests
    step_since: float | None = None
    failed_checks: int = 0
    last_analysis: float | None = None


@dataclasses.dataclass(frozen=True)
class Policy:
    alpha_floor: float = 0.3
    speedup_floor: float = 1.0
    fallback_enabled: bool = True
    recovery_alpha: float = 0.5
    recover_after_s: float = 600.0
    canary_weight: float | None = None  # percent of requests; None: no canary
    steps: tuple[tuple[float, float], ...] = ()  # (weight percent, pause seconds)
    analysis_interval_s: float = 60.0
    failure_limit: int = 3
    checks: tuple[tuple[str, float | None, float | None], ...] = ()  # (metric, min, max)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Policy:
        slo, fb = spec["slo"], spec["slo"]["fallback"]
        canary = spec.get("canary")
        kw: dict[str, Any] = {}
        if canary:
            analysis = canary.get("analysis", {})
            kw = dict(
                canary_weight=canary.get("weight", 1),
                steps=tuple((s["weight"], parse_duration(s.get("pause", "5m"))) for s in canary.get("steps", [])),
                analysis_interval_s=parse_duration(analysis.get("interval", "1m")),
                failure_limit=analysis.get("failureLimit", 3),
                checks=tuple((m["name"], m.get("min"), m.get("max")) for m in analysis.get("metrics", [])),
            )
        return cls(alpha_floor=slo["alphaFloor"], speedup_floor=slo["speedupFloor"],
                   fallback_enabled=fb["enabled"], recovery_alpha=fb.get("recoveryAlpha", 0.0),
                   recover_after_s=parse_duration(fb["recoverAfter"]), **kw)


@dataclasses.dataclass(frozen=True)
class Decision:
    state: LoopState
    events: tuple[tuple[str, str], ...] = ()  # (reason, message), posted as Kubernetes Events


def _slo_missed(m: RoleMetrics | None, p: Policy) -> str | None:
    if m is None:
        return None
    if m.alpha is not None and m.alpha < p.alpha_floor:
        return f"alpha {m.alpha:.3f} below the floor {p.alpha_floor}"
    if m.speedup is not None and m.speedup < p.speedup_floor:
        return f"speedup {m.speedup:.2f} below the floor {p.speedup_floor}"
    return None


def decide_mode(metrics: Metrics, state: LoopState, policy: Policy, now: float) -> Decision:
    """Enter or leave fallback.
    >>> p = Policy(alpha_floor=0.3, recover_after_s=600)
    >>> d = decide_mode(Metrics(stable=RoleMetrics(alpha=0.1)), LoopState(), p, now=1000.0)
    >>> d.state.mode, d.events[0][0]
    ('fallback', 'FallbackEntered')
    >>> decide_mode(Metrics(), d.state, p, now=1600.0).state.mode
    'speculative'
    """
    if state.mode == "speculative":
        why = _slo_missed(metrics.stable, policy) if policy.fallback_enabled else None
        if why:
            return Decision(dataclasses.replace(state, mode="fallback", fallback_since=now),
                            (("FallbackEntered", f"speculation off: {why}"),))
        return Decision(state)
    if not policy.fallback_enabled:
        return Decision(dataclasses.replace(state, mode="speculative", fallback_since=None),
                        (("FallbackLeft", "fallback was disabled in the spec"),))
    since = state.fallback_since if state.fallback_since is not None else now
    # A probe (e.g. a shadow or canary measurement) may report alpha while the fleet is in fallback.
    alpha = metrics.stable.alpha if metrics.stable else None
    if now - since >= policy.recover_after_s and (alpha is None or alpha >= policy.recovery_alpha):
        return Decision(dataclasses.replace(state, mode="speculative", fallback_since=None),
                        (("FallbackLeft", f"speculation back on after {now - since:.0f}s in fallback"),))
    return Decision(dataclasses.replace(state, fallback_since=since))


def _failed_checks(m: RoleMetrics | None, policy: Policy) -> list[str]:
    if m is None:
        return ["the canary reported no metrics"] if policy.checks else []
    failed = []
    for name, lo, hi in policy.checks:
        value = m.get(name)
        if value is None:
            failed.append(f"{name} not reported")
        elif (lo is not None and value < lo) or (hi is not None and value > hi):
            failed.append(f"{name} {value:g} outside [{lo if lo is not None else '-inf'}, "
                          f"{hi if hi is not None else 'inf'}]")
    return failed


def decide_canary(metrics: Metrics, state: LoopState, policy: Policy, now: float) -> Decision:
    """Advance, promote or abort the canary, one analysis per interval.
    >>> p = Policy(canary_weight=1, steps=((10, 60.0),), analysis_interval_s=60, checks=(("alpha", 0.5, None),))
    >>> s = decide_canary(Metrics(), LoopState(), p, now=0.0).state
    >>> s.canary_phase, s.canary_weight
    ('Progressing', 1)
    >>> good = Metrics(canary=RoleMetrics(alpha=0.7))
    >>> s = decide_canary(good, s, p, now=60.0).state; s.canary_weight
    10
    >>> decide_canary(good, s, p, now=120.0).state.canary_phase
    'Promoted'
    """
    if policy.canary_weight is None:
        return Decision(state if state.canary_phase == "Idle" else LoopState(mode=state.mode,
                                                                           fallback_since=state.fallback_since))
    if state.canary_phase in ("Promoted", "Aborted"):
        return Decision(state)
    if state.canary_phase == "Idle":
        return Decision(dataclasses.replace(state, canary_phase="Progressing", canary_step=0,
                                            canary_weight=policy.canary_weight, step_since=now,
                                            failed_checks=0, last_analysis=now),
                        (("CanaryStarted", f"canary at {policy.canary_weight}% of requests"),))
    if state.last_analysis is not None and now - state.last_analysis < policy.analysis_interval_s:
        return Decision(state)
    failed = _failed_checks(metrics.canary, policy)
    if failed:
        count = state.failed_checks + 1
        if count >= policy.failure_limit:
            return Decision(dataclasses.replace(state, canary_phase="Aborted", canary_weight=0,
                                                failed_checks=count, last_analysis=now),
                            (("CanaryAborted", f"{count} failed checks: {'; '.join(failed)}"),))
        return Decision(dataclasses.replace(state, failed_checks=count, last_analysis=now),
                        (("CanaryCheckFailed", f"check {count}/{policy.failure_limit} failed: {'; '.join(failed)}"),))
    state = dataclasses.replace(state, last_analysis=now)
    pause = policy.steps[state.canary_step - 1][1] if state.canary_step else policy.analysis_interval_s
    if now - (state.step_since if state.step_since is not None else now) < pause:
        return Decision(state)
    if state.canary_step < len(policy.steps):
        weight = policy.steps[state.canary_step][0]
        return Decision(dataclasses.replace(state, canary_step=state.canary_step + 1, canary_weight=weight,
                                            step_since=now),
                        (("CanaryStepped", f"canary moved to {weight}% of requests"),))
    return Decision(dataclasses.replace(state, canary_phase="Promoted", canary_weight=0),
                    (("CanaryPromoted", "the canary passed every step and replaces the stable workers"),))


def decide(metrics: Metrics, state: LoopState, policy: Policy, now: float) -> Decision:
    """One tick of both loops; the events of both, in order."""
    mode = decide_mode(metrics, state, policy, now)
    canary = decide_canary(metrics, mode.state, policy, now)
    return Decision(canary.state, mode.events + canary.events)
