"""Canary analysis with Argo Rollouts / Flagger semantics over the router's request-level split:
decide_canary(observation, state, policy, now) -> CanaryDecision. Pure: no clock, no client.

A run (one canary configuration, `epoch`) goes Idle -> Waiting (the canary workers are not all
Ready: weight 0, nothing judged) -> Progressing (every `interval`, one analysis comparing canary
with stable over that interval; the analysed time of passing analyses moves the steps) -> Promoted
or Aborted. Missing data halts an analysis: it never passes, never counts as failed, and aborts
only once nothing has progressed for `progressDeadline`. Manual gates (the annotation
`serving.specfleet.dev/canary`): `pause` holds the run while it is set, `resume` lifts it,
`promote` and `abort` end the run now. docs/canary.md has the diagram and every knob.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import json
import math
from typing import Any

from specfleet_api.durations import parse_duration
from specfleet_api.fleet_spec import base_of, lookup, merge, promotion
from specfleet_api.windows import DriftCounts, Window, sum_windows

from .loop import DRAFT_CORRELATION
from .slo import mean_var, welch_half_width
from .observe import Observation

PHASES = ("Idle", "Waiting", "Progressing", "Paused", "Promoted", "Aborted")
LIVE_PHASES = ("Waiting", "Progressing", "Paused")  # a run in flight: the canary workers exist
GATES = ("pause", "resume", "promote", "abort")
GATE_ANNOTATION = "serving.specfleet.dev/canary"
# |t| above which a sampled drift is significant: two-sided p < 0.001 under the normal
# approximation (the token counts are in the hundreds at least: minPairs requests' tokens)
T_CRITICAL = 3.29


def gate_from_annotations(metadata: dict[str, Any] | None) -> str | None:
    """The manual gate the resource's annotation asks for; None without one. ValueError names a
    value that is not a gate.

    >>> gate_from_annotations({"annotations": {"serving.specfleet.dev/canary": " Promote "}})
    'promote'
    >>> gate_from_annotations({}) is None
    True
    >>> gate_from_annotations({"annotations": {"serving.specfleet.dev/canary": "go"}})
    Traceback (most recent call last):
    ValueError: annotation serving.specfleet.dev/canary: 'go' is not a canary gate; use pause, resume, promote or abort
    """
    value = ((metadata or {}).get("annotations") or {}).get(GATE_ANNOTATION)
    if value is None or not str(value).strip():
        return None
    gate = str(value).strip().lower()
    if gate not in GATES:
        raise ValueError(f"annotation {GATE_ANNOTATION}: {value!r} is not a canary gate; "
                         f"use pause, resume, promote or abort")
    return gate


def settle_promotion(spec: dict[str, Any], state: CanaryState) -> tuple[CanaryState, tuple[tuple[str, str], ...]]:
    """The state with its promotion record judged against the spec now (once per change: the
    events fire when a leaf goes)."""
    kept, events = promotion(spec, state.promoted)
    return (dataclasses.replace(state, promoted=kept) if kept != state.promoted else state), events


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Compare:
    """Tolerances of the canary-vs-stable checks, as fractions of stable's value (error rate: an
    absolute difference). Higher is better for alpha, tau and speedup; lower for the rest."""

    alpha: float = 0.1
    tau: float = 0.1
    speedup: float = 0.1
    ttft_p50: float = 0.25
    ttft_p99: float = 0.5
    tpot_p50: float = 0.25
    tpot_p99: float = 0.5
    error_rate: float = 0.01

    @classmethod
    def from_spec(cls, compare: dict[str, Any]) -> Compare:
        keys = {"alpha": "alpha", "tau": "tau", "speedup": "speedup", "ttftP50": "ttft_p50", "ttftP99": "ttft_p99",
                "tpotP50": "tpot_p50", "tpotP99": "tpot_p99", "errorRate": "error_rate"}
        return cls(**{attr: float(compare[key]) for key, attr in keys.items() if key in compare})


@dataclasses.dataclass(frozen=True)
class DriftPolicy:
    """The output-drift check. `threshold`: the greedy agreement the canary pairs need, relative
    to the control pairs' (None: not judged); `sampled_max_mean_diff`: the effect-size floor in
    nats per token under which a sampled drift never fails (None: not judged)."""

    sample_share: float = 2.0  # percent of greedy requests mirrored to both arms; 0: no drift check
    threshold: float | None = 1.0
    min_pairs: int = 20
    sampled_max_mean_diff: float | None = 0.01


@dataclasses.dataclass(frozen=True)
class CanaryPolicy:
    weight: float = 1.0  # percent of requests at the start
    steps: tuple[tuple[float, float], ...] = ()  # (weight percent, analysed seconds to stay)
    pause_s: float = 300.0  # analysed seconds at the start weight
    interval_s: float = 60.0
    failure_limit: int = 3
    min_requests: int = 20  # per arm and interval, below which the analysis halts
    progress_deadline_s: float = 600.0
    compare: Compare = Compare()
    checks: tuple[tuple[str, float | None, float | None], ...] = ()  # absolute (metric, min, max) on the canary
    drift: DriftPolicy = DriftPolicy()
    config_hash: str = ""  # a new hash starts a new run
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    base: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)  # the spec's values under them

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> CanaryPolicy | None:
        """The policy of a defaulted spec (specfleet_operator.spec.with_defaults); None without a canary.

        >>> p = CanaryPolicy.from_spec({"model": {"name": "m", "uri": "u"}, "quantization": "none",
        ...     "canary": {"weight": 1, "overrides": {"quantization": "int8", "speculation": {"kMax": 12}},
        ...                "steps": [{"weight": 10, "pause": "2m"}], "analysis": {"interval": "30s"}}})
        >>> p.steps, p.interval_s, p.drift.threshold, p.base
        (((10, 120.0),), 30.0, None, {'quantization': 'none'})
        """
        canary = spec.get("canary")
        if not canary:
            return None
        analysis = canary.get("analysis") or {}
        drift = analysis.get("drift") or {}
        overrides = copy.deepcopy(canary.get("overrides") or {})
        base = base_of(spec, overrides)
        precision = ("quantization", "dtype")
        same = all(lookup(overrides, (k,)) in (None, spec.get(k)) for k in precision)
        exact = 1.0 if same else None  # speculation is lossless: the same precision must agree exactly
        threshold = drift.get("threshold", exact)
        floor = drift.get("sampledMaxMeanDiff", DriftPolicy.sampled_max_mean_diff if same else None)
        inherited = {k: spec.get(k) for k in ("model", "draft", "speculation", "quantization", "dtype",
                                               "template", "routing")}
        return cls(
            weight=canary.get("weight", 1),
            steps=tuple((s["weight"], parse_duration(s.get("pause", "5m"))) for s in canary.get("steps") or ()),
            pause_s=parse_duration(canary.get("pause", "5m")),
            interval_s=parse_duration(analysis.get("interval", "1m")),
            failure_limit=analysis.get("failureLimit", 3),
            min_requests=analysis.get("minRequests", 20),
            progress_deadline_s=parse_duration(canary.get("progressDeadline", "10m")),
            compare=Compare.from_spec(analysis.get("compare") or {}),
            checks=tuple((m["name"], m.get("min"), m.get("max")) for m in analysis.get("metrics") or ()),
            drift=DriftPolicy(sample_share=float(drift.get("sampleShare", 2.0)), threshold=threshold,
                              min_pairs=int(drift.get("minPairs", 20)), sampled_max_mean_diff=floor),
            config_hash=_hash([canary, inherited]), overrides=overrides, base=base)


@dataclasses.dataclass(frozen=True)
class ArmView:
    """One arm as observed: its window summed over prompt types over the analysis interval (None:
    not read) and its workers' readiness."""

    window: Window | None = None
    ready: int = 0
    desired: int = 0

    @property
    def all_ready(self) -> bool:
        return self.desired > 0 and self.ready >= self.desired


@dataclasses.dataclass(frozen=True)
class CanaryObservation:
    stable: ArmView | None = None
    canary: ArmView | None = None
    drift: dict[str, DriftCounts] = dataclasses.field(default_factory=dict, hash=False)  # this epoch's, by kind
    complete: bool = True  # False: some of it could not be read (Redis away): nothing is judged
    gate: str | None = None  # the manual gate (gate_from_annotations)


def observation(obs: Observation, gate: str | None) -> CanaryObservation:
    """The canary's view of one loop observation: each arm's windows summed over prompt types."""
    def arm(name: str) -> ArmView | None:
        by_type = obs.windows.get(name)
        ready, desired = obs.ready.get(name, (0, 0))
        if by_type is None and name not in obs.ready:
            return None
        return ArmView(sum_windows(list(by_type.values())) if by_type else None, ready, desired)
    return CanaryObservation(arm("stable"), arm("canary"), dict(obs.drift), obs.complete, gate)


@dataclasses.dataclass(frozen=True)
class CanaryState:
    """The canary's memory, kept in the status between ticks (times in epoch seconds)."""

    phase: str = "Idle"
    step: int = 0  # 0: at canary.weight; i: at steps[i-1]
    weight: float = 0.0  # percent of requests of the current step (routed only while the canary is Ready)
    started: float | None = None
    step_since: float | None = None
    ready_since: float | None = None
    progress_since: float | None = None  # the last progress: start, readiness, an analysis, a resume
    analysed_s: float = 0.0  # analysed time of the passing analyses at this step
    failed_checks: int = 0
    last_analysis: float | None = None
    epoch: str = ""  # this run's id: LiveState.drift_epoch
    config_hash: str = ""
    last_gate: str | None = None  # the gate seen at the last tick (promote / abort act when it changes)
    message: str = ""
    promoted: dict[str, Any] | None = dataclasses.field(default=None, hash=False)  # see promotion_record

    @property
    def routed_weight(self) -> float:
        """The share of requests the router sends the canary now: the step's once it is Ready."""
        routed = self.phase in ("Progressing", "Paused") and self.ready_since is not None
        return self.weight if routed else 0.0

    def to_status(self) -> dict[str, Any]:
        """The status `canary` section (the CRD's names; times as RFC 3339): `weight` is what the
        router sends now, `stepWeight` the step's."""
        out: dict[str, Any] = {"phase": self.phase, "step": self.step, "weight": self.routed_weight,
                               "stepWeight": self.weight, "failedChecks": self.failed_checks,
                               "analysedSeconds": round(self.analysed_s, 3)}
        for key, value in (("startedAt", self.started), ("stepSince", self.step_since),
                           ("readySince", self.ready_since), ("progressSince", self.progress_since),
                           ("lastAnalysis", self.last_analysis)):
            if value is not None:
                out[key] = _iso(value)
        for key, value in (("epoch", self.epoch), ("configHash", self.config_hash), ("lastGate", self.last_gate),
                           ("message", self.message)):
            if value:
                out[key] = value
        if self.promoted:
            out["promoted"] = copy.deepcopy(self.promoted)
        return out

    @classmethod
    def from_status(cls, section: dict[str, Any] | None) -> CanaryState:
        """Back from the status section; an unknown phase (a status written by an older operator)
        reads as Idle. Round trip:

        >>> s = CanaryState("Progressing", 1, 10.0, started=0.0, last_analysis=60.0, epoch="e-0")
        >>> CanaryState.from_status(s.to_status()) == s
        True
        """
        c = section or {}
        phase = c.get("phase", "Idle")
        return cls(phase=phase if phase in PHASES else "Idle", step=int(c.get("step", 0)),
                   weight=float(c.get("stepWeight", c.get("weight", 0.0)) or 0.0),
                   started=_epoch(c.get("startedAt")),
                   step_since=_epoch(c.get("stepSince")), ready_since=_epoch(c.get("readySince")),
                   progress_since=_epoch(c.get("progressSince")), analysed_s=float(c.get("analysedSeconds", 0.0)),
                   failed_checks=int(c.get("failedChecks", 0)), last_analysis=_epoch(c.get("lastAnalysis")),
                   epoch=c.get("epoch", ""), config_hash=c.get("configHash", ""), last_gate=c.get("lastGate"),
                   message=c.get("message", ""), promoted=copy.deepcopy(c.get("promoted")) or None)


def _iso(epoch: float) -> str:
    t = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S") + (f".{t.microsecond:06d}Z" if t.microsecond else "Z")


def _epoch(text: str | None) -> float | None:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None


@dataclasses.dataclass(frozen=True)
class CanaryDecision:
    state: CanaryState
    events: tuple[tuple[str, str], ...] = ()  # (reason, message), posted as Kubernetes Events
    weight: float = 0.0  # the canary's share of requests now (percent)
    mirror_share: float = 0.0  # percent of greedy requests the routers mirror (LiveState.mirror_share)
    drift_epoch: str = ""  # LiveState.drift_epoch
    clear_gate: bool = False  # a promote / abort gate acted: the caller may remove the annotation


def _decision(state: CanaryState, events: list[tuple[str, str]], policy: CanaryPolicy | None,
              clear_gate: bool = False) -> CanaryDecision:
    routed = state.routed_weight > 0
    mirror = policy.drift.sample_share if policy is not None and routed else 0.0
    return CanaryDecision(state, tuple(events), state.routed_weight, mirror,
                          state.epoch if state.phase in LIVE_PHASES else "", clear_gate)


def routing(state: CanaryState, spec: dict[str, Any]) -> CanaryDecision:
    """What a canary state routes, without a tick (a reconcile between two): its weight now, the
    drift mirror share and epoch.

    >>> routing(CanaryState(), {}).weight
    0.0
    """
    return _decision(state, [], CanaryPolicy.from_spec(spec))


def promotion_record(state: CanaryState, policy: CanaryPolicy, now: float) -> dict[str, Any]:
    """What stable runs after this promotion: the overrides (on top of an earlier promotion's) and
    the spec's values under them at promotion time (specfleet_api.fleet_spec.promotion judges
    later spec edits against those)."""
    before = state.promoted or {}
    base = merge(policy.base, before.get("base") or {})  # an earlier promotion saw the spec first
    return {"overrides": merge(before.get("overrides") or {}, policy.overrides), "base": base,
            "at": _iso(now), "configHash": policy.config_hash}


# -- the analysis ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Analysis:
    halted: str | None = None  # why nothing was judged
    failed: tuple[str, ...] = ()
    drift_judged: bool = False  # whether the drift check had its evidence (promotion waits for it)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _compare(name: str, canary: float | None, stable: float | None, tol: float, higher_is_better: bool) -> str | None:
    if canary is None or stable is None:
        return None  # not comparable (e.g. nothing drafted on an arm): tau and the latencies still are
    if higher_is_better:
        bound = stable * (1 - tol)
        if canary < bound:
            return f"{name} {_fmt(canary)} < stable {_fmt(stable)} x (1 - {tol:g}) = {_fmt(bound)}"
    else:
        bound = stable * (1 + tol)
        if canary > bound:
            return f"{name} {_fmt(canary)} > stable {_fmt(stable)} x (1 + {tol:g}) = {_fmt(bound)}"
    return None


def _log_speedups(w: Window) -> tuple[int, float, float]:
    """A window's per-request log speedups as (count, sum, sum of squares) (workers that predate
    the per-request counts send none)."""
    cn = w.counts
    return cn.spec_speedups, cn.spec_log_speedup_sum, cn.spec_log_speedup_sq


def compare_speedup(canary: Window, stable: Window, tol: float) -> str | None:
    """The speedup check. The canary's speedup over stable's (each plain / busy seconds summed
    over its requests) must not be under 1 - tol; with each speculating request's own speedup
    counted on both arms, it fails only when the ratio's 95% interval is wholly under that line
    (Welch's t over the two arms' log speedups, around the ratio): requests' speedups spread with
    their prompts, and at a 1% weight the canary serves few of them, so a ratio under the line by
    chance is not a failure (as the SLO loop judges a speedup). A canary that is slower shows it
    again in the next intervals, each failed one counted toward failureLimit. Without those counts:
    by value.

    >>> from specfleet_api.windows import TypeCounts
    >>> def w(speedup, n, spread):
    ...     return Window(TypeCounts(requests=n, plain_seconds=speedup * n, busy_seconds=n, spec_speedups=n,
    ...                              spec_log_speedup_sum=n * math.log(speedup),
    ...                              spec_log_speedup_sq=n * (math.log(speedup) ** 2 + spread ** 2)))
    >>> compare_speedup(w(1.2, 20, 0.5), w(1.5, 400, 0.5), 0.1) is None     # 0.8x, 20 spread requests
    True
    >>> compare_speedup(w(1.2, 20, 0.05), w(1.5, 400, 0.05), 0.1)
    'speedup 1.2 < stable 1.5 x (1 - 0.1) = 1.35; the ratio 0.8, 95% interval [0.7807, 0.8198] (Welch t over 20 and 400 requests)'
    """
    c, s = canary.speedup, stable.speedup
    by_value = _compare("speedup", c, s, tol, True)
    if by_value is None or not s:
        return by_value
    mc, ms = _log_speedups(canary), _log_speedups(stable)
    half = welch_half_width(mc, ms)
    if half is None:
        return by_value
    n1, n2 = mc[0], ms[0]
    ratio = c / s
    lo, hi = ratio * math.exp(-half), ratio * math.exp(half)
    if hi >= 1 - tol:
        return None
    return f"{by_value}; the ratio {_fmt(ratio)}, 95% interval [{_fmt(lo)}, {_fmt(hi)}] (Welch t over {n1} and {n2} requests)"


def _depth(w: Window) -> int:
    """The deepest draft position a window's steps reached (0: no per-position counts)."""
    return max((p + 1 for p, n in enumerate(w.counts.pos_drafted) if n), default=0)


def _acceptance(canary: Window, stable: Window) -> tuple[tuple[int, int], tuple[int, int], int | None]:
    """Each arm's (accepted, drafted) tokens, over the draft positions both arms reach when they
    draft to different depths (a canary that changes K: a deeper draft's last positions are
    accepted less by nature, so its alpha over all of them would read as a regression at the same
    acceptance per position), with that depth; else over all of them, depth None.

    >>> from specfleet_api.windows import TypeCounts
    >>> def w(k, per_position):  # 100 steps, each position accepted at `per_position` given the last
    ...     acc = [round(100 * per_position ** (p + 1)) for p in range(k)]
    ...     return Window(TypeCounts(draft_tokens=100 * k, accepted_tokens=sum(acc), pos_drafted=(100,) * k + (0,) * (16 - k),
    ...                              pos_accepted=tuple(acc) + (0,) * (16 - k)))
    >>> _acceptance(w(6, 0.6), w(4, 0.6))
    ((131, 400), (131, 400), 4)
    """
    dc, ds = _depth(canary), _depth(stable)
    if dc and ds and dc != ds:
        d = min(dc, ds)
        c, s = [(sum(w.counts.pos_accepted[:d]), sum(w.counts.pos_drafted[:d])) for w in (canary, stable)]
        return c, s, d
    return ((canary.counts.accepted_tokens, canary.counts.draft_tokens),
            (stable.counts.accepted_tokens, stable.counts.draft_tokens), None)


def compare_alpha(canary: Window, stable: Window, tol: float) -> str | None:
    """The acceptance check. The canary's alpha over stable's must not be under 1 - tol; it fails
    only when the ratio's 95% interval is wholly under that line (the log of a ratio of two
    proportions, Katz; each arm's drafted tokens counted as DRAFT_CORRELATION times fewer trials,
    since a rejection ends its draft, as the SLO loop counts them): at a 1% weight the canary
    drafts a few hundred tokens an interval, and a point under the line by chance is not a
    regression. A retrained head that accepts less shows it interval after interval, each failed
    one counted toward failureLimit. Arms that draft to different depths (a canary of another K)
    are compared over the positions both reach (`_acceptance`).

    >>> from specfleet_api.windows import TypeCounts
    >>> def w(alpha, drafted):
    ...     return Window(TypeCounts(requests=20, draft_tokens=drafted, accepted_tokens=round(alpha * drafted)))
    >>> compare_alpha(w(0.5, 60), w(0.6, 6000), 0.1) is None      # 0.83x, over 60 drafted tokens
    True
    >>> compare_alpha(w(0.4, 2000), w(0.6, 6000), 0.1)
    'alpha 0.4 < stable 0.6 x (1 - 0.1) = 0.54; the ratio 0.6667, 95% interval [0.6146, 0.7232] (over 2000 and 6000 drafted tokens)'
    """
    (ac, nc), (as_, ns), depth = _acceptance(canary, stable)
    alpha_c, alpha_s = (ac / nc if nc else None), (as_ / ns if ns else None)
    by_value = _compare("alpha", alpha_c, alpha_s, tol, True)
    if by_value is None:
        return None
    where = f"the first {depth} draft positions' " if depth else ""
    (a1, n1), (a2, n2) = [(a / DRAFT_CORRELATION, n / DRAFT_CORRELATION) for a, n in ((ac, nc), (as_, ns))]
    if a1 <= 0 or a2 <= 0:  # a log interval needs an accepted token on each arm; none on the canary's is by value
        return by_value + (f" (over {where}drafted tokens)" if depth else "")
    half = 1.96 * math.sqrt(1 / a1 - 1 / n1 + 1 / a2 - 1 / n2)
    ratio = alpha_c / alpha_s
    lo, hi = ratio * math.exp(-half), ratio * math.exp(half)
    if hi >= 1 - tol:
        return None
    return (f"{by_value}; the ratio {_fmt(ratio)}, 95% interval [{_fmt(lo)}, {_fmt(hi)}] (over {where}"
            f"{nc} and {ns} drafted tokens)")


#: The canary's own figures that analysis.metrics may bound (the CRD's enum; p99LatencySeconds is
#: the older name of ttftP99Seconds).
METRICS = {
    "alpha": lambda w: w.alpha, "tau": lambda w: w.tau, "speedup": lambda w: w.speedup,
    "errorRate": lambda w: w.error_rate, "ttftP50Seconds": lambda w: w.ttft_quantile(0.5),
    "ttftP99Seconds": lambda w: w.ttft_quantile(0.99), "tpotP50Seconds": lambda w: w.tpot_quantile(0.5),
    "tpotP99Seconds": lambda w: w.tpot_quantile(0.99), "p99LatencySeconds": lambda w: w.ttft_quantile(0.99),
}


def _moments(d: DriftCounts) -> tuple[float, float, int]:
    """Mean, sample variance and count of the per-token log-prob differences."""
    n = d.logprob_tokens
    return (*mean_var(n, d.logprob_diff_sum, d.logprob_diff_sq_sum), n)


def sampled_drift(canary: DriftCounts, control: DriftCounts | None, floor: float, min_pairs: int) -> str | None:
    """The sampled drift check: Welch's t-test between the per-token log-probability differences
    of the canary pairs (the canary's tokens scored teacher-forced under both arms) and those of
    the control pairs (stable against stable: the fleet's numerical noise); without control scores,
    the paired t-test of the canary differences against 0. It fails only when the difference of
    means is both significant (|t| > T_CRITICAL) and larger than `floor` nats per token, so float
    noise, however well measured, never fails it.

    >>> noise = DriftCounts("e", scored=30, logprob_diff_sum=0.3, logprob_diff_sq_sum=0.001, logprob_tokens=3000)
    >>> sampled_drift(noise, None, 0.01, 20) is None              # 1e-4 nats/token: below the floor
    True
    >>> far = DriftCounts("e", scored=30, logprob_diff_sum=150.0, logprob_diff_sq_sum=30.0, logprob_tokens=3000)
    >>> sampled_drift(far, noise, 0.01, 20)
    'sampled drift: canary log-probs differ by 0.04990 nats/token from the control pairs (Welch t = 32, 3000 vs 3000 tokens)'
    """
    if canary.scored < min_pairs or canary.logprob_tokens < 2:
        return None
    m1, v1, n1 = _moments(canary)
    if control is not None and control.scored >= min_pairs and control.logprob_tokens >= 2:
        m2, v2, n2 = _moments(control)
        se, what = math.sqrt(v1 / n1 + v2 / n2), f"the control pairs (Welch t = %s, {n1} vs {n2} tokens)"
    else:
        m2, se, what = 0.0, math.sqrt(v1 / n1), f"0 (paired t = %s, {n1} tokens; no control scores)"
    diff = m1 - m2
    t = diff / se if se > 0 else (math.inf if diff else 0.0)
    if abs(diff) > floor and abs(t) > T_CRITICAL:
        return f"sampled drift: canary log-probs differ by {diff:.5f} nats/token from " + what % f"{t:.2g}"
    return None


def greedy_drift(canary: DriftCounts | None, control: DriftCounts | None, threshold: float,
                 min_pairs: int) -> tuple[bool, str | None]:
    """(judged, failure) of the greedy drift check: the canary pairs' agreement must reach
    `threshold` x the control pairs' (1 without enough control pairs). Judged from `min_pairs`
    pairs on, or at the first disagreement when exact agreement is required.

    >>> diff = {"request_id": "r-7", "position": 12, "a": 310, "b": 2045}
    >>> greedy_drift(DriftCounts("e", pairs=3, agree=2, first_diff=diff), None, 1.0, 20)
    (True, 'output drift: 2/3 greedy pairs agree (0.667), need 1 (threshold 1 x control 1); first differing request r-7 at token 12: stable 310, canary 2045')
    >>> greedy_drift(DriftCounts("e", pairs=3, agree=3), None, 1.0, 20)
    (False, None)
    """
    if canary is None or not canary.pairs:
        return False, None
    ceiling = control.agreement if control is not None and control.pairs >= min_pairs else 1.0
    need = threshold * ceiling
    agreement = canary.agreement
    judged = canary.pairs >= min_pairs or (need >= 1.0 and canary.agree < canary.pairs)
    if not judged or agreement >= need - 1e-12:
        return judged, None
    msg = (f"output drift: {canary.agree}/{canary.pairs} greedy pairs agree ({agreement:.3f}), need {need:.4g} "
           f"(threshold {threshold:g} x control {ceiling:.4g})")
    fd = canary.first_diff
    if fd:
        msg += (f"; first differing request {fd.get('request_id')} at token {fd.get('position')}: "
                f"stable {fd.get('a')}, canary {fd.get('b')}")
    return True, msg


def analyse(obs: CanaryObservation, policy: CanaryPolicy) -> Analysis:
    """One analysis of the canary against stable over the interval."""
    if not obs.complete:
        return Analysis(halted="the observations could not be read")
    for arm, view in (("stable", obs.stable), ("canary", obs.canary)):
        if view is None or view.window is None:
            return Analysis(halted=f"no window from the {arm} workers")
        done = view.window.counts.requests + view.window.counts.errors
        if done < policy.min_requests:
            return Analysis(halted=f"{done} {arm} requests in the interval, fewer than minRequests "
                                   f"{policy.min_requests}")
    s, c, tol = obs.stable.window, obs.canary.window, policy.compare
    found = [
        compare_alpha(c, s, tol.alpha),
        _compare("tau", c.tau, s.tau, tol.tau, True),
        compare_speedup(c, s, tol.speedup),
        _compare("TTFT P50", c.ttft_quantile(0.5), s.ttft_quantile(0.5), tol.ttft_p50, False),
        _compare("TTFT P99", c.ttft_quantile(0.99), s.ttft_quantile(0.99), tol.ttft_p99, False),
        _compare("TPOT P50", c.tpot_quantile(0.5), s.tpot_quantile(0.5), tol.tpot_p50, False),
        _compare("TPOT P99", c.tpot_quantile(0.99), s.tpot_quantile(0.99), tol.tpot_p99, False),
    ]
    if c.error_rate is not None and s.error_rate is not None and c.error_rate > s.error_rate + tol.error_rate:
        found.append(f"error rate {c.error_rate:.4g} > stable {s.error_rate:.4g} + {tol.error_rate:g}")
    for name, lo, hi in policy.checks:
        value = METRICS[name](c)
        if value is None:
            found.append(f"{name} not reported by the canary")
        elif (lo is not None and value < lo) or (hi is not None and value > hi):
            found.append(f"{name} {_fmt(value)} outside [{lo if lo is not None else '-inf'}, "
                         f"{hi if hi is not None else 'inf'}]")
    judged = True
    d = policy.drift
    if d.sample_share > 0 and (d.threshold is not None or d.sampled_max_mean_diff is not None):
        canary, control = obs.drift.get("canary"), obs.drift.get("control")
        judged = False
        if d.threshold is not None:
            judged, fail = greedy_drift(canary, control, d.threshold, d.min_pairs)
            found.append(fail)
        if d.sampled_max_mean_diff is not None and canary is not None:
            fail = sampled_drift(canary, control, d.sampled_max_mean_diff, d.min_pairs)
            judged = judged or canary.scored >= d.min_pairs
            found.append(fail)
    return Analysis(failed=tuple(f for f in found if f), drift_judged=judged)


# -- the decision ---------------------------------------------------------------------------------


def _abort(state: CanaryState, now: float, why: str, events: list, policy: CanaryPolicy | None,
           clear_gate: bool = False) -> CanaryDecision:
    state = dataclasses.replace(state, phase="Aborted", weight=0.0, message=why, progress_since=now)
    events.append(("CanaryAborted", f"canary aborted, its weight is 0: {why}"))
    return _decision(state, events, policy, clear_gate)


def _promote(state: CanaryState, policy: CanaryPolicy, now: float, why: str, events: list,
             clear_gate: bool = False) -> CanaryDecision:
    record = promotion_record(state, policy, now)
    state = dataclasses.replace(state, phase="Promoted", weight=0.0, message=why, promoted=record,
                                progress_since=now)
    over = json.dumps(record["overrides"], sort_keys=True)
    events.append(("CanaryPromoted", f"canary promoted ({why}): the stable workers now run its overrides {over}; "
                                     f"fold them into the spec to make this explicit"))
    return _decision(state, events, policy, clear_gate)


def decide_canary(obs: CanaryObservation, state: CanaryState, policy: CanaryPolicy | None,
                  now: float) -> CanaryDecision:
    """One tick of the canary. Worked through (a 60 s interval, one step):

    >>> from specfleet_api.windows import TypeCounts
    >>> p = CanaryPolicy(weight=1, steps=((10, 60.0),), pause_s=60, interval_s=60, min_requests=5,
    ...                  drift=DriftPolicy(sample_share=0), config_hash="h")
    >>> good = Window(TypeCounts(requests=50, steps=100, draft_tokens=200, accepted_tokens=80))
    >>> ready = CanaryObservation(ArmView(good, 4, 4), ArmView(good, 1, 1))
    >>> d = decide_canary(CanaryObservation(canary=ArmView(None, 0, 1)), CanaryState(), p, now=0.0)
    >>> d.state.phase, d.weight, [r for r, _ in d.events]
    ('Waiting', 0.0, ['CanaryStarted'])
    >>> d = decide_canary(ready, d.state, p, now=30.0); d.state.phase, d.weight
    ('Progressing', 1)
    >>> d = decide_canary(ready, d.state, p, now=90.0); d.state.step, d.weight
    (1, 10)
    >>> decide_canary(ready, d.state, p, now=150.0).state.phase
    'Promoted'
    """
    events: list[tuple[str, str]] = []
    if policy is None:
        if state.phase in LIVE_PHASES:
            events.append(("CanaryRemoved", f"spec.canary was removed while the canary was {state.phase}: "
                                            f"its workers go, stable is unchanged"))
        elif state.phase == "Aborted":
            events.append(("CanaryRemoved", "spec.canary was removed after its abort: stable is unchanged"))
        if state.phase != "Idle" and state.promoted:
            events.append(("PromotionKept", f"spec.canary is gone; the stable workers keep the promoted overrides "
                                            f"{json.dumps(state.promoted['overrides'], sort_keys=True)} "
                                            f"(status.canary.promoted) until the spec holds them or sets them "
                                            f"otherwise"))
        if state.phase == "Idle" and not state.message:
            return _decision(state, events, None)
        return _decision(CanaryState(last_gate=state.last_gate, promoted=state.promoted), events, None)
    if state.phase != "Idle" and state.config_hash != policy.config_hash:
        if state.phase in LIVE_PHASES:
            events.append(("CanaryRestarted", f"spec.canary changed during the run {state.epoch}: a new run starts"))
        state = CanaryState(last_gate=state.last_gate, promoted=state.promoted)
    if state.phase in ("Promoted", "Aborted"):
        return _decision(dataclasses.replace(state, last_gate=obs.gate), events, policy)
    # promote and abort act once, when the annotation changes to them (a stale one never ends a new run)
    edge = obs.gate if obs.gate in ("promote", "abort") and obs.gate != state.last_gate else None
    state = dataclasses.replace(state, last_gate=obs.gate)
    if state.phase == "Idle":
        state = dataclasses.replace(
            state, phase="Waiting", step=0, weight=policy.weight, started=now, step_since=None, ready_since=None,
            progress_since=now, analysed_s=0.0, failed_checks=0, last_analysis=None,
            epoch=f"{policy.config_hash[:12]}-{int(now)}", config_hash=policy.config_hash,
            message="waiting for the canary workers to be ready")
        events.append(("CanaryStarted", f"canary run {state.epoch} started: {policy.weight}% of requests once "
                                        f"its workers are ready"))
    if edge == "abort":
        return _abort(state, now, f"the {GATE_ANNOTATION} annotation asked for it", events, policy, True)
    if edge == "promote":
        return _promote(state, policy, now, f"the {GATE_ANNOTATION} annotation asked for it", events, True)
    canary = obs.canary
    ready = canary is not None and canary.all_ready
    counts = f"{canary.ready}/{canary.desired}" if canary is not None else "unknown"
    if obs.gate == "pause":
        if state.phase != "Paused":
            state = dataclasses.replace(state, phase="Paused", message=f"paused by the {GATE_ANNOTATION} annotation")
            events.append(("CanaryPaused", f"canary paused at {state.weight}% (step {state.step}): no step, "
                                           f"no abort until resumed"))
        return _decision(state, events, policy)
    if state.phase == "Paused":
        # the analysis restarts: what happened while paused is neither progress nor failure
        state = dataclasses.replace(state, phase="Progressing" if state.ready_since is not None else "Waiting",
                                    progress_since=now, last_analysis=now if state.ready_since is not None else None,
                                    message="resumed")
        events.append(("CanaryResumed", f"canary resumed at {state.weight}% (step {state.step})"))
    deadline = policy.progress_deadline_s
    stalled = state.progress_since is not None and now - state.progress_since > deadline
    if state.phase == "Waiting":
        if ready:
            state = dataclasses.replace(state, phase="Progressing", ready_since=now, step_since=now,
                                        progress_since=now, last_analysis=now,
                                        message=f"analysing at {state.weight}%")
            events.append(("CanaryReady", f"the canary's {counts} workers are ready: {state.weight}% of requests, "
                                          f"analysis every {policy.interval_s:g}s"))
            return _decision(state, events, policy)
        if stalled:
            return _abort(state, now, f"the canary workers were not ready within progressDeadline {deadline:g}s "
                                      f"({counts} ready)", events, policy)
        return _decision(dataclasses.replace(state, message=f"waiting for the canary workers: {counts} ready"),
                         events, policy)
    # Progressing
    if state.last_analysis is not None and now - state.last_analysis < policy.interval_s:
        return _decision(state, events, policy)
    result = Analysis(halted=f"{counts} canary workers ready") if not ready else analyse(obs, policy)
    if result.halted:
        if stalled:
            return _abort(state, now, f"no analysis for progressDeadline {deadline:g}s: {result.halted}",
                          events, policy)
        message = f"analysis halted: {result.halted}"
        if message != state.message:
            events.append(("CanaryAnalysisHalted", f"{message} (nothing is judged on missing data)"))
        return _decision(dataclasses.replace(state, message=message), events, policy)
    credit = min(now - state.last_analysis, policy.interval_s) if state.last_analysis is not None \
        else policy.interval_s
    if result.failed:
        count = state.failed_checks + 1
        state = dataclasses.replace(state, failed_checks=count, last_analysis=now, progress_since=now,
                                    message="; ".join(result.failed))
        if count >= policy.failure_limit:
            return _abort(state, now, f"{count} failed analyses (failureLimit {policy.failure_limit}): "
                                      f"{'; '.join(result.failed)}", events, policy)
        events.append(("CanaryCheckFailed", f"analysis {count}/{policy.failure_limit} failed: "
                                            f"{'; '.join(result.failed)}"))
        return _decision(state, events, policy)
    state = dataclasses.replace(state, last_analysis=now, analysed_s=state.analysed_s + credit,
                                message=f"analysis passed at {state.weight}%")
    stay = policy.steps[state.step - 1][1] if state.step else policy.pause_s
    if state.analysed_s < stay:
        return _decision(dataclasses.replace(state, progress_since=now), events, policy)
    if state.step < len(policy.steps):
        weight = policy.steps[state.step][0]
        state = dataclasses.replace(state, step=state.step + 1, weight=weight, step_since=now, analysed_s=0.0,
                                    progress_since=now, message=f"analysing at {weight}%")
        events.append(("CanaryStepped", f"canary moved to {weight}% of requests (step {state.step} of "
                                        f"{len(policy.steps)})"))
        return _decision(state, events, policy)
    if not result.drift_judged:
        # the last step passed but the drift check has not had its pairs: no progress, so the
        # deadline aborts a run whose routers never mirror
        message = (f"analysis halted: waiting for {policy.drift.min_pairs} output-drift pairs before promotion "
                   f"(have {(obs.drift.get('canary') or DriftCounts('')).pairs})")
        if stalled:
            return _abort(state, now, f"no drift evidence for progressDeadline {deadline:g}s: {message}",
                          events, policy)
        if message.split(" (have")[0] != state.message.split(" (have")[0]:
            events.append(("CanaryAnalysisHalted", message))
        return _decision(dataclasses.replace(state, message=message), events, policy)
    return _promote(state, policy, now, f"passed every step, {state.failed_checks} failed analyses", events)


def tick(spec: dict[str, Any], metadata: dict[str, Any] | None, section: dict[str, Any] | None,
         obs: CanaryObservation, now: float) -> CanaryDecision:
    """One canary tick from what the operator (or the local loop) holds: the defaulted spec, the
    resource's metadata (its gate annotation), its status.canary section and the observation
    (whose `gate` this sets). The promotion record is judged against the spec first; a gate value
    that is not one is an Event (once per value) and no gate.

    >>> meta = {"annotations": {GATE_ANNOTATION: "hold"}}
    >>> d = tick({"canary": {"weight": 1}}, meta, None, CanaryObservation(), now=0.0)
    >>> d.state.phase, [r for r, _ in d.events], d.state.last_gate
    ('Waiting', ['CanaryGateInvalid', 'CanaryStarted'], 'hold')
    >>> [r for r, _ in tick({"canary": {"weight": 1}}, meta, d.state.to_status(), CanaryObservation(), 1.0).events]
    []
    """
    state = CanaryState.from_status(section)
    state, events = settle_promotion(spec, state)
    raw = ((metadata or {}).get("annotations") or {}).get(GATE_ANNOTATION)
    try:
        gate, invalid = gate_from_annotations(metadata), None
    except ValueError as e:
        gate, invalid = None, str(e)
        if raw != state.last_gate:
            events += (("CanaryGateInvalid", f"{e}: ignored"),)
    decision = decide_canary(dataclasses.replace(obs, gate=gate), state, CanaryPolicy.from_spec(spec), now)
    if invalid is not None:
        decision = dataclasses.replace(decision, state=dataclasses.replace(decision.state, last_gate=raw))
    return dataclasses.replace(decision, events=tuple(events) + decision.events)
