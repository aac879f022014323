"""The alpha / speedup SLO of one key (a prompt type, a prompt cluster, or the whole deployment):
a pure state machine from what the window showed to speculative or fallback (docs/control-loop.md).

    speculative --(SLO missed, dwell passed)--> fallback --(probe healthy for recoverAfter,
         ^                                                   dwell passed)--+
         +------------------------------------------------------------------+

Missed: alpha under the absolute floor, alpha under (1 - alphaDropAlert) x its own baseline (a
mean of the healthy windows, learned per key), the live speedup (priced by the engine's cost
model) under speedupFloor, or an alert firing for the key. In fallback the window is the probe's
(the share of requests that still speculate): it must clear the floors by the hysteresis margin,
without a miss, for recoverAfter. A window with too little data decides nothing: it neither moves
a key nor breaks a probe's healthy run (fail static, ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from specfleet_api.durations import parse_duration
from specfleet_api.fleet_spec import FALLBACK, SPECULATIVE
from specfleet_api.windows import Window

HEALTHY, MISSED, UNKNOWN = "healthy", "missed", "unknown"


@dataclasses.dataclass(frozen=True)
class SloPolicy:
    window_s: float = 300.0
    alpha_floor: float = 0.05
    alpha_drop: float = 0.5
    speedup_floor: float = 1.0
    min_draft_tokens: int = 200
    min_requests: int = 4  # a window's speedup needs this many finished requests
    enabled: bool = True
    recover_after_s: float = 300.0
    recovery_alpha: float | None = None
    probe_share: float = 5.0
    min_dwell_s: float = 120.0
    hysteresis: float = 0.05
    clusters: bool = True
    max_clusters: int = 16
    cluster_min_requests: int = 8
    baseline_weight: float = 0.2  # how much one healthy window moves the baseline

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> SloPolicy:
        """From a defaulted spec (specfleet_operator.spec.with_defaults)."""
        slo = spec.get("slo") or {}
        fb = slo.get("fallback") or {}
        cl = fb.get("clusters") or {}
        d = cls()
        return cls(window_s=parse_duration(slo.get("window", "5m")),
                   alpha_floor=float(slo.get("alphaFloor", d.alpha_floor)),
                   alpha_drop=float(slo.get("alphaDropAlert", d.alpha_drop)),
                   speedup_floor=float(slo.get("speedupFloor", d.speedup_floor)),
                   min_draft_tokens=int(slo.get("minDraftTokens", d.min_draft_tokens)),
                   enabled=bool(fb.get("enabled", True)),
                   recover_after_s=parse_duration(fb.get("recoverAfter", "5m")),
                   recovery_alpha=fb.get("recoveryAlpha"),
                   probe_share=float(fb.get("probeShare", d.probe_share)),
                   min_dwell_s=parse_duration(fb.get("minDwell", "2m")),
                   hysteresis=float(fb.get("hysteresis", d.hysteresis)),
                   clusters=bool(cl.get("enabled", True)),
                   max_clusters=int(cl.get("maxClusters", d.max_clusters)),
                   cluster_min_requests=int(cl.get("minRequests", d.cluster_min_requests)))


@dataclasses.dataclass(frozen=True)
class Sample:
    """What one key's window showed. `speedup` is the speculating requests' (in fallback: the
    probes'); None where it is not observed (a cluster: routers see no step costs)."""

    alpha: float | None = None
    speedup: float | None = None
    draft_tokens: int = 0
    requests: int = 0
    alert: str | None = None  # an alert firing for this key (Alertmanager), named
    alerts_only: bool = False  # no windows to read (no Redis): the alerts are the observation
    # where alpha is judged by its confidence interval (a cluster: a few requests), its bounds: a
    # miss needs the upper bound under the line, a recovery the lower bound over it
    alpha_bounds: tuple[float, float] | None = None
    # the speedup's interval over the requests' own speedups, where they were counted: a speedup
    # under the line enters fallback only when its upper bound is under it too
    speedup_bounds: tuple[float, float] | None = None


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What a key's windows showed, summed over the windows judged since its last verdict: a
    window too thin to decide on is kept and the next one adds to it (a probe at 5% of a quiet
    type needs several windows to say anything). `requests` are those that speculated; `seen` all
    of them (a cluster's minimum)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    requests: int = 0
    plain_s: float = 0.0
    busy_s: float = 0.0
    seen: int = 0
    windows: int = 0
    speedups: int = 0  # requests with a speedup of their own, and the sums of its log
    log_speedup: float = 0.0
    log_speedup_sq: float = 0.0
    alphas: int = 0  # requests that drafted, and the sums of their acceptance rates
    alpha_sum: float = 0.0
    alpha_sq: float = 0.0

    def plus(self, other: Evidence) -> Evidence:
        return Evidence(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def alpha(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def speedup(self) -> float | None:
        return self.plain_s / self.busy_s if self.busy_s > 0 else None

    def to_status(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items() if v}

    @classmethod
    def from_status(cls, raw: dict[str, Any] | None) -> Evidence:
        raw = raw or {}
        return cls(**{f.name: type(f.default)(raw.get(f.name, f.default)) for f in dataclasses.fields(cls)})


def window_evidence(w: Window | None) -> Evidence | None:
    """A worker window's evidence: the requests that speculated (in fallback, the probes)."""
    if w is None:
        return None
    c = w.counts
    return Evidence(draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens, requests=c.spec_requests,
                    plain_s=c.spec_plain_seconds, busy_s=c.spec_busy_seconds, seen=c.requests, windows=1,
                    speedups=c.spec_speedups, log_speedup=c.spec_log_speedup_sum,
                    log_speedup_sq=c.spec_log_speedup_sq, alphas=c.spec_alphas, alpha_sum=c.spec_alpha_sum,
                    alpha_sq=c.spec_alpha_sq)


def t95(df: int) -> float:
    """Student's t, two-sided 95%, for `df` degrees of freedom (within 1% past the table)."""
    table = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23)
    return table[df - 1] if df <= len(table) else 1.96 + 2.4 / df


def t99(df: int) -> float:
    """Student's t, two-sided 99%, for `df` degrees of freedom (within 1% past the table)."""
    table = (63.66, 9.92, 5.84, 4.60, 4.03, 3.71, 3.50, 3.36, 3.25, 3.17)
    return table[df - 1] if df <= len(table) else 2.576 + 5.4 / df


def mean_var(n: float, total: float, squares: float) -> tuple[float, float]:
    """Mean and sample variance of n values from their sum and the sum of their squares (n >= 2).

    >>> mean_var(3, 6.0, 14.0)                            # 1, 2, 3
    (2.0, 1.0)
    """
    mean = total / n
    return mean, max(0.0, (squares - n * mean * mean) / (n - 1))


def speedup_bounds(e: Evidence) -> tuple[float, float] | None:
    """The speedup's 95% interval: around the evidence's speedup (plain / busy seconds summed),
    as wide as the mean of the requests' log speedups is uncertain (Student's t over them); None
    under two requests with a speedup of their own.

    >>> e = Evidence(requests=4, plain_s=3.8, busy_s=4.0, speedups=4, log_speedup=-0.2, log_speedup_sq=0.05)
    >>> [round(b, 3) for b in speedup_bounds(e)]
    [0.791, 1.141]
    """
    n = e.speedups
    if n < 2 or e.speedup is None:
        return None
    _, var = mean_var(n, e.log_speedup, e.log_speedup_sq)
    half = t95(n - 1) * math.sqrt(var / n)
    return e.speedup * math.exp(-half), e.speedup * math.exp(half)


def welch_half_width(a: tuple[float, float, float], b: tuple[float, float, float]) -> float | None:
    """The 95% half-width of the difference of two means, each sample given as (count, sum, sum
    of squares) (Welch's t, Satterthwaite's degrees of freedom); None under two values on a side.
    The loop and the canary compare speedups by their requests' log speedups with it.

    >>> round(welch_half_width((4, 4.0, 4.5), (4, 0.0, 0.5)), 3)      # means 1 and 0, sd 0.41 each
    0.707
    """
    if a[0] < 2 or b[0] < 2:
        return None
    (_, va), (_, vb) = mean_var(*a), mean_var(*b)
    se2 = va / a[0] + vb / b[0]
    if se2 <= 0:
        return 0.0
    df = se2 * se2 / ((va / a[0]) ** 2 / (a[0] - 1) + (vb / b[0]) ** 2 / (b[0] - 1))
    return t95(max(1, int(df))) * math.sqrt(se2)


def wilson(successes: float, n: float, z: float = 2.58) -> tuple[float, float]:
    """The Wilson score interval of a proportion (z 2.58: 99%).

    >>> lo, hi = wilson(0, 30); round(lo, 3), round(hi, 3)
    (0.0, 0.182)
    >>> [round(x, 3) for x in wilson(50, 100)]
    [0.375, 0.625]
    """
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclasses.dataclass(frozen=True)
class KeyState:
    mode: str = SPECULATIVE
    since: float | None = None  # the last transition (epoch seconds); None: never moved
    baseline: float | None = None  # alpha of the healthy windows, a running mean
    # drafted tokens behind the baseline: until they outweigh one window's share, a window counts by
    # its tokens (the first thin window does not set the line for long); None: not known (0.2 each)
    baseline_tokens: int | None = None
    healthy_since: float | None = None  # in fallback: start of the probe's healthy run
    reason: str = ""  # why it is in fallback, or what the last window showed
    verdict: str = ""  # the last judgement: healthy, missed or unknown (its evidence is kept)

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if self.verdict:
            out["verdict"] = self.verdict
        for key, value in (("since", self.since), ("baseline", self.baseline),
                           ("baselineTokens", self.baseline_tokens), ("healthySince", self.healthy_since)):
            if value is not None:
                out[key] = round(value, 4) if key == "baseline" else value
        if self.reason:
            out["reason"] = self.reason
        return out

    @classmethod
    def from_status(cls, raw: dict[str, Any]) -> KeyState:
        mode = raw.get("mode", SPECULATIVE)
        return cls(mode=mode if mode in (SPECULATIVE, FALLBACK) else SPECULATIVE, since=raw.get("since"),
                   baseline=raw.get("baseline"), baseline_tokens=raw.get("baselineTokens"),
                   healthy_since=raw.get("healthySince"),
                   reason=str(raw.get("reason", "")), verdict=str(raw.get("verdict", "")))


def judge(sample: Sample | None, state: KeyState, policy: SloPolicy, margin: float = 0.0) -> tuple[str, str]:
    """(verdict, why): HEALTHY, MISSED or UNKNOWN (too little data). `margin` raises the floors
    (recovery's hysteresis).

    Alpha is judged by its interval (`alpha_bounds`, which the loop always gives with an alpha):
    a sample without one says nothing about alpha.

    >>> p = SloPolicy(alpha_floor=0.1, min_draft_tokens=10)
    >>> judge(Sample(alpha=0.05, draft_tokens=50, alpha_bounds=(0.01, 0.09)), KeyState(), p)
    ('missed', 'alpha 0.050 (interval [0.010, 0.090] over 50 drafted tokens) under the floor 0.1')
    >>> judge(Sample(alpha=0.3, draft_tokens=50, alpha_bounds=(0.2, 0.38)), KeyState(baseline=0.8), p)[0]
    'missed'
    >>> judge(Sample(alpha=0.3, draft_tokens=5, alpha_bounds=(0.02, 0.86)), KeyState(), p)[0]
    'unknown'
    """
    if sample is None:
        return UNKNOWN, "no window"
    if sample.alert:
        return MISSED, f"alert {sample.alert} firing"
    if sample.alerts_only:
        return HEALTHY, "no alert firing (no fleet windows to read)"
    # the speedup's line sits below the floor to enter fallback, above it to leave: a gauge within
    # a few percent of the truth cannot make a type that gains about nothing flap
    speed_line = policy.speedup_floor * ((1 + margin) if margin else (1 - policy.hysteresis))
    enough_speedup = sample.speedup is not None and sample.requests >= policy.min_requests
    unclear = ""
    if enough_speedup and sample.speedup < speed_line:
        if margin or sample.speedup_bounds is None or sample.speedup_bounds[1] < speed_line:
            shown = "" if sample.speedup_bounds is None else \
                " (interval [{:.2f}, {:.2f}])".format(*sample.speedup_bounds)
            return MISSED, f"speedup {sample.speedup:.2f}{shown} under {speed_line:.2f}"
        # in speculation, a few requests' speedup under the line is not yet a miss: requests'
        # speedups spread with their prompts, and the window adds to the next one until it is clear
        unclear = "speedup {:.2f} (interval [{:.2f}, {:.2f}]) not yet clearly under {:.2f}".format(
            sample.speedup, *sample.speedup_bounds, speed_line)
    if sample.alpha_bounds is not None and sample.alpha is not None and sample.draft_tokens:
        verdict, why = _judge_bounds(sample, state, policy, margin)
    else:
        verdict, why = UNKNOWN, f"{sample.draft_tokens} drafted tokens"
    if verdict == MISSED:
        return MISSED, why
    if unclear:
        return UNKNOWN, unclear
    if verdict == HEALTHY or enough_speedup:
        alpha = f"alpha {sample.alpha:.3f}" if sample.alpha is not None else "alpha -"
        speedup = f"speedup {sample.speedup:.2f}" if sample.speedup is not None else "speedup -"
        return HEALTHY, f"{alpha}, {speedup}"
    return UNKNOWN, f"too little data: {why}; {sample.requests} requests (need {policy.min_requests})"


def alpha_clear(sample: Sample | None, state: KeyState, policy: SloPolicy) -> bool:
    """Whether a speculating key's alpha, by its interval, is clear of its line either way (a
    verdict on it, not on the speedup alone).

    >>> p = SloPolicy()
    >>> alpha_clear(Sample(alpha=0.1, draft_tokens=20, alpha_bounds=(0.02, 0.4)), KeyState(baseline=0.6), p)
    False
    >>> alpha_clear(Sample(alpha=0.0, draft_tokens=60, alpha_bounds=(0.0, 0.12)), KeyState(baseline=0.6), p)
    True
    """
    if sample is None or sample.alpha_bounds is None or sample.alpha is None or not sample.draft_tokens:
        return False
    return _judge_bounds(sample, state, policy, 0.0)[0] != UNKNOWN


def _judge_bounds(sample: Sample, state: KeyState, policy: SloPolicy, margin: float) -> tuple[str, str]:
    """Alpha judged by its interval: MISSED when even its upper bound is under the line (the floor,
    or the drop from the baseline), HEALTHY when its lower bound clears the line (with the margin
    in fallback), else UNKNOWN: not enough evidence either way."""
    lo, hi = sample.alpha_bounds
    line = policy.alpha_floor * (1 + margin)
    what = f"the floor {line:.3g}"
    if state.baseline is not None:
        drop = (1 - policy.alpha_drop) * state.baseline * (1 + margin)
        if drop > line:
            line, what = drop, f"{1 - policy.alpha_drop:.2g} x its baseline {state.baseline:.3f}"
    if policy.recovery_alpha is not None and margin and policy.recovery_alpha > line:
        line, what = policy.recovery_alpha, f"recoveryAlpha {policy.recovery_alpha}"
    shown = f"alpha {sample.alpha:.3f} (interval [{lo:.3f}, {hi:.3f}] over {sample.draft_tokens} drafted tokens)"
    if hi < line:
        return MISSED, f"{shown} under {what}"
    if lo >= line:
        return HEALTHY, shown
    return UNKNOWN, f"{shown}: not yet clear of {what}"


def learn_baseline(state: KeyState, alpha: float, drafted: int, policy: SloPolicy) -> tuple[float, int]:
    """The baseline after one more healthy window (alpha over `drafted` tokens) and the tokens behind it.

    A mean weighted by drafted tokens while the baseline rests on few (a first window of a few dozen
    tokens does not set the line alone), then a running mean that gives each window at least
    `baseline_weight`, so a slow drift is followed.

    >>> p = SloPolicy(baseline_weight=0.2)
    >>> learn_baseline(KeyState(baseline=0.2, baseline_tokens=50), 0.6, 150, p)  # (0.2*50 + 0.6*150) / 200
    (0.5, 200)
    >>> round(learn_baseline(KeyState(baseline=0.5, baseline_tokens=5000), 0.6, 100, p)[0], 3)  # weight 0.2
    0.52
    >>> round(learn_baseline(KeyState(baseline=0.5), 0.6, 100, p)[0], 3)  # tokens unknown: weight 0.2
    0.52
    """
    if state.baseline is None:
        return alpha, drafted
    behind = state.baseline_tokens
    weight = policy.baseline_weight if behind is None else max(policy.baseline_weight, drafted / (behind + drafted))
    return state.baseline + weight * (alpha - state.baseline), (behind or 0) + drafted


def step(sample: Sample | None, state: KeyState, policy: SloPolicy, now: float
         ) -> tuple[KeyState, tuple[str, str] | None]:
    """One window of one key: the next state, and the event of a transition (reason, message).

    >>> p = SloPolicy(min_draft_tokens=10, min_dwell_s=60, recover_after_s=120)
    >>> good = Sample(alpha=0.6, draft_tokens=100, alpha_bounds=(0.5, 0.7))
    >>> bad = Sample(alpha=0.1, draft_tokens=100, alpha_bounds=(0.04, 0.2))
    >>> s, _ = step(good, KeyState(), p, 0.0); s.baseline
    0.6
    >>> s, ev = step(bad, s, p, 10.0); s.mode, ev[0]
    ('fallback', 'FallbackEntered')
    >>> s, ev = step(good, s, p, 20.0); s.mode, s.healthy_since
    ('fallback', 20.0)
    >>> s, ev = step(good, s, p, 140.0); s.mode, ev[0]
    ('speculative', 'FallbackLeft')
    """
    verdict, why = judge(sample, state, policy, margin=policy.hysteresis if state.mode == FALLBACK else 0.0)
    state = dataclasses.replace(state, verdict=verdict)
    dwelled = state.since is None or now - state.since >= policy.min_dwell_s
    if state.mode == SPECULATIVE:
        # the baseline learns from windows whose alpha is itself clear of its line: a window healthy
        # on its speedup alone (a collapsed type whose K fell to 0 loses little time) says nothing
        # of alpha, and learning from it would walk the baseline down to meet the collapse
        if verdict == HEALTHY and sample is not None and sample.alpha is not None \
                and sample.draft_tokens >= policy.min_draft_tokens and sample.alpha_bounds is not None \
                and _judge_bounds(sample, state, policy, 0.0)[0] == HEALTHY:
            base, tokens = learn_baseline(state, sample.alpha, sample.draft_tokens, policy)
            return dataclasses.replace(state, baseline=base, baseline_tokens=tokens, reason=why), None
        if verdict == MISSED and policy.enabled:
            if not dwelled:
                return dataclasses.replace(state, reason=f"{why} (holding: min dwell)"), None
            return (KeyState(FALLBACK, since=now, baseline=state.baseline, baseline_tokens=state.baseline_tokens,
                             reason=why, verdict=verdict),
                    ("FallbackEntered", f"speculation off: {why}"))
        return dataclasses.replace(state, reason=why), None
    # fallback: the probe's window
    if not policy.enabled:
        return (KeyState(SPECULATIVE, since=now, baseline=state.baseline, baseline_tokens=state.baseline_tokens,
                         reason="fallback disabled in the spec", verdict=verdict),
                ("FallbackLeft", "speculation back on: fallback was disabled in the spec"))
    if verdict == MISSED:
        return dataclasses.replace(state, healthy_since=None, reason=f"probe: {why}"), None
    if verdict == UNKNOWN:
        return dataclasses.replace(state, reason=f"probe: {why}"), None
    healthy_since = state.healthy_since if state.healthy_since is not None else now
    if now - healthy_since >= policy.recover_after_s and dwelled:
        # the probe's alpha is the new baseline: a type whose traffic changed for good, but where
        # speculation pays, is not sent back by its old baseline
        probed = sample is not None and sample.alpha is not None
        base, tokens = (sample.alpha, sample.draft_tokens) if probed else (state.baseline, state.baseline_tokens)
        return (KeyState(SPECULATIVE, since=now, baseline=base, baseline_tokens=tokens, reason=why, verdict=verdict),
                ("FallbackLeft", f"speculation back on: the probe was healthy for {now - healthy_since:.0f}s ({why})"))
    return dataclasses.replace(state, healthy_since=healthy_since, reason=f"probe healthy: {why}"), None
