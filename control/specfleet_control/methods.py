"""The draft method each prompt type runs, chosen by the loop from what every method did on it.

A deployment serves more than one draft method (n-gram always, and its draft.method: a draft
model, an EAGLE head or Medusa heads); which one pays on a prompt type depends on the model, the
traffic, the temperature and the load, and changes when any of them does. The routers send a small
share of each unpinned type's requests (`exploreShare`, percent) to the methods the type does not
run now, so every method keeps evidence; the workers window requests by (type, method); and at
each judgement this module compares the methods on each type:

- a method's evidence is its latest windows' speculating requests (drafted and accepted tokens,
  plain and busy seconds, each request's own log speedup), sized by requests rather than time: a
  new window counts whole, and older ones are weighed down so that the sum holds about
  `evidenceRequests` of them (at most 0.9 of them a window). The method a type runs fills that in
  one window, so a shift in its traffic shows at the next judgement; one explored by a few
  requests a window adds them up over as many windows as it takes;
- a shift in a type's traffic restarts its evidence: where one method's acceptance rate in the new
  window differs from what its carried evidence holds by more than the 99% interval of the
  difference (Student's t, over the requests' own rates), the older windows describe other traffic, and
  every method's evidence on the type starts again from this window (`TrafficShifted`). Acceptance
  moves first and plainest (n-gram drafts of copied text are accepted 0.8 of the time, of fresh
  text 0.5), and an explored method's few requests a window show it, where their speedups would
  take many windows to;
- a type moves from its method c to another m when the 95% interval of speedup(m) / speedup(c)
  (around the ratio of their plain-over-busy seconds, as wide as their requests' log speedups
  spread, Welch) lies wholly above 1 + `margin` (the hysteresis), both have `minRequests`
  speedups, and `minDwell` has passed since the type's last move (no flapping);
- a type pinned in routing.byPromptType is never moved (and never explored); plain decoding is not
  a candidate: falling back to it stays the SLO loop's job, the safety floor.

Pure: `choose` takes the stable arm's per-method windows and the choices so far (the loop's memory,
kept in the SDD status) and returns the next choices and an event for every move.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from specfleet_api import fleet_spec
from specfleet_api.durations import parse_duration
from specfleet_api.windows import ClusterMethod

from .slo import Evidence, mean_var, speedup_bounds, t99, welch_half_width, window_evidence

MAX_CARRY = 0.9  # the most of a method's evidence a window carries on (a method no request runs is forgotten)
MOVED = "MethodChanged"
SHIFTED = "TrafficShifted"


@dataclasses.dataclass(frozen=True)
class SelectPolicy:
    """routing.select: whether the loop picks methods, and how cautiously (the share of requests
    that explore is the live state's: `fleet_spec.explore_share`)."""

    enabled: bool = True
    margin: float = 0.05  # a move needs speedup(new) / speedup(now) above 1 + margin, interval and all
    min_dwell_s: float = 600.0  # between two moves of one type
    min_requests: int = 4  # speedups a method needs on a type before it is compared
    evidence_requests: int = 16  # about how many of its latest requests a method's evidence holds

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> SelectPolicy:
        raw = (spec.get("routing") or {}).get("select") or {}
        d = cls()
        return cls(enabled=bool(raw.get("enabled", d.enabled)),
                   margin=float(raw.get("margin", d.margin)),
                   min_dwell_s=parse_duration(raw.get("minDwell", "10m")),
                   min_requests=int(raw.get("minRequests", d.min_requests)),
                   evidence_requests=int(raw.get("evidenceRequests", d.evidence_requests)))


@dataclasses.dataclass(frozen=True)
class Selection:
    """What the loop chooses among for a deployment: its policy, the methods its stable arm
    serves, the method of a type it has not chosen for, and the spec's pins."""

    policy: SelectPolicy
    candidates: tuple[str, ...]
    default: str
    pins: Mapping[str, str]

    @classmethod
    def from_spec(cls, spec: dict[str, Any], state: fleet_spec.FleetState = fleet_spec.FleetState()) -> Selection:
        """From a defaulted spec; no candidates where the loop does not choose (one served method,
        or routing.select.enabled false)."""
        stable = fleet_spec.effective_spec(spec, "stable", state)
        routing = stable.get("routing") or {}
        candidates = fleet_spec.served_methods(spec, "stable", state) if fleet_spec.selects_methods(spec, state) else ()
        return cls(SelectPolicy.from_spec(spec), candidates, routing.get("default", stable["draft"]["method"]),
                   dict(routing.get("byPromptType", {})))


@dataclasses.dataclass(frozen=True)
class Choice:
    """One prompt type's method: what it runs, when the loop last moved it (None: never, the
    spec's), and each method's evidence on it (sums, older windows weighed down)."""

    method: str
    since: float | None = None
    evidence: Mapping[str, Evidence] = dataclasses.field(default_factory=dict)

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method}
        if self.since is not None:
            out["since"] = self.since
        if self.evidence:
            out["evidence"] = {m: e.to_status() for m, e in sorted(self.evidence.items())}
        return out

    @classmethod
    def from_status(cls, raw: dict[str, Any]) -> Choice:
        return cls(str(raw["method"]), raw.get("since"),
                   {str(m): Evidence(**{f.name: float(e.get(f.name, 0.0)) for f in dataclasses.fields(Evidence)})
                    for m, e in (raw.get("evidence") or {}).items()})


def cluster_method_evidence(c: ClusterMethod | None) -> Evidence | None:
    """A prompt cluster's evidence on one method (a router's window, `ClusterWindow.methods`),
    as `window_evidence` reads a worker's: its speculating requests."""
    if c is None:
        return None
    return Evidence(draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens, requests=c.requests,
                    plain_s=c.plain_seconds, busy_s=c.busy_seconds, seen=c.requests, windows=1, speedups=c.speedups,
                    log_speedup=c.log_speedup_sum, log_speedup_sq=c.log_speedup_sq, alphas=c.alphas,
                    alpha_sum=c.alpha_sum, alpha_sq=c.alpha_sq)


def scaled(e: Evidence, by: float) -> Evidence:
    return Evidence(*(by * v for v in dataclasses.astuple(e)))


def carried(old: Evidence | None, new: Evidence | None, requests: int) -> Evidence:
    """A method's evidence after a window: the new one whole, the old weighed down so the two
    hold about `requests` requests (at most MAX_CARRY of the old; none when the new one alone
    holds that many).

    >>> e = carried(Evidence(speedups=30, windows=3), Evidence(speedups=10, windows=1), 16)
    >>> round(e.speedups, 3), round(e.windows, 3)
    (16.0, 1.6)
    >>> carried(Evidence(speedups=2, windows=1), None, 16).speedups      # no request: 0.9 of it
    1.8
    """
    new = new or Evidence()
    if old is None or not old.windows:
        return new
    room = max(0.0, requests - new.speedups)
    keep = MAX_CARRY if not old.speedups else min(MAX_CARRY, room / old.speedups)
    return scaled(old, keep).plus(new)


def shift(old: Evidence | None, new: Evidence | None) -> tuple[float, float, float] | None:
    """(carried, new, 99% half-width) of a method's mean acceptance rate over its requests where
    this window's differs from the carried evidence's by more than the half-width of their
    difference (Student's t, 99%, the two sides' variances pooled: a window's few explored
    requests say little about the spread, the carried ones more); None where it does not, or
    either side has under two rates.

    >>> before = Evidence(alphas=16, alpha_sum=16 * 0.5, alpha_sq=16 * (0.25 + 0.04))   # 0.5, sd 0.2
    >>> [round(x, 3) for x in shift(before, Evidence(alphas=4, alpha_sum=3.4, alpha_sq=4 * (0.7225 + 0.01)))]
    [0.5, 0.85, 0.312]
    >>> shift(before, Evidence(alphas=4, alpha_sum=2.4, alpha_sq=4 * (0.36 + 0.01))) is None      # 0.6: noise
    True
    """
    if old is None or new is None or old.alphas < 2 or new.alphas < 2:
        return None
    (m_old, v_old), (m_new, v_new) = mean_var(old.alphas, old.alpha_sum, old.alpha_sq), \
        mean_var(new.alphas, new.alpha_sum, new.alpha_sq)
    df = old.alphas + new.alphas - 2
    pooled = ((old.alphas - 1) * v_old + (new.alphas - 1) * v_new) / df
    half = t99(max(1, int(df))) * math.sqrt(pooled * (1 / old.alphas + 1 / new.alphas))
    return (m_old, m_new, half) if abs(m_new - m_old) > half else None


def log_ratio_bounds(a: Evidence, b: Evidence) -> tuple[float, float, float] | None:
    """(point, low, high) of log(speedup(a) / speedup(b)), 95%: around the ratio of the two
    speedups (plain over busy seconds), as wide as the means of their requests' log speedups are
    uncertain (`slo.welch_half_width`); None when either has fewer than two speedups or no seconds.

    >>> a = Evidence(plain_s=15.0, busy_s=10.0, speedups=8, log_speedup=8 * 0.4, log_speedup_sq=8 * 0.17)
    >>> b = Evidence(plain_s=11.0, busy_s=10.0, speedups=8, log_speedup=8 * 0.1, log_speedup_sq=8 * 0.02)
    >>> [round(x, 3) for x in log_ratio_bounds(a, b)]
    [0.31, 0.196, 0.425]
    """
    half = welch_half_width((a.speedups, a.log_speedup, a.log_speedup_sq),
                            (b.speedups, b.log_speedup, b.log_speedup_sq))
    if half is None or not a.speedup or not b.speedup:
        return None
    point = math.log(a.speedup / b.speedup)
    return point, point - half, point + half


def choose(windows: Mapping[str, Mapping[str, Any]], choices: Mapping[str, Choice], policy: SelectPolicy,
           now: float, *, candidates: tuple[str, ...], default: str, pins: Mapping[str, str],
           plain: frozenset[str] = frozenset(), defaults: Mapping[str, str] | None = None,
           evidence_of: Callable[[Any], Evidence | None] = window_evidence,
           label: Callable[[str], str] = lambda key: f"prompt type {key}",
           ) -> tuple[dict[str, Choice], list[tuple[str, str]]]:
    """One judgement: every unpinned key (a prompt type, or a prompt cluster) seen now or before
    with its evidence carried and this window's added, moved where another candidate's speedup is
    clearly better. `windows`: the stable arm's {key: {method: Window}} (anything `evidence_of`
    reads); `candidates`: the draft methods the deployment serves (`fleet_spec.served_methods`);
    `default`: what an unchosen key runs, or `defaults[key]` where given (a cluster: its type's
    method; a key the loop never moved follows it); `plain`: the keys the SLO loop has fallen back
    to plain decoding (their method did not pay): each moves to another method whose own
    speedup's interval is clearly above 1 (plain decoding's), so that it can come back on that
    one. Returns the next choices and the events (reason, message)."""
    out: dict[str, Choice] = {}
    events: list[tuple[str, str]] = []
    if not policy.enabled or len(candidates) < 2:
        return out, events
    for prompt_type in sorted(set(windows) | set(choices)):
        if prompt_type in pins:
            continue
        own = (defaults or {}).get(prompt_type, default)
        own = own if own in candidates else candidates[0]
        before = choices.get(prompt_type)
        if before is None or before.method not in candidates:  # new, or the spec no longer serves it
            before = Choice(own)
        elif before.since is None and before.method != own:  # never moved: it follows its default
            before = Choice(own, None, before.evidence)
        observed = windows.get(prompt_type, {})
        new = {m: evidence_of(observed.get(m)) for m in candidates}
        old = before.evidence
        for m in candidates:
            moved = shift(old.get(m), new[m])
            if moved is not None:
                was, now_alpha, half = moved
                events.append((SHIFTED, (
                    f"{label(prompt_type)}: {m}'s acceptance {now_alpha:.2f} over {new[m].alphas} requests against "
                    f"{was:.2f} over {old[m].alphas:.3g} before (99% of the difference: {half:.2f}); every "
                    f"method's evidence on it restarts from this window")))
                old = {}
                break
        evidence = {}
        for m in candidates:
            e = carried(old.get(m), new[m], policy.evidence_requests)
            if e.windows > 0.01:  # forgotten after ~40 windows without a request
                evidence[m] = e
        choice = Choice(before.method, before.since, evidence)
        current = evidence.get(choice.method)
        dwelt = choice.since is None or now - choice.since >= policy.min_dwell_s
        if prompt_type in plain and dwelt:  # its method fell back: is another one clearly paying?
            best = None
            for m, e in evidence.items():
                bounds = speedup_bounds(e) if m != choice.method and e.speedups >= policy.min_requests else None
                if bounds is not None and bounds[0] > 1 + policy.margin and (best is None or bounds > best[1]):
                    best = (m, bounds)
            if best is not None:
                m, (low, high) = best
                events.append((MOVED, (
                    f"{label(prompt_type)}: {choice.method} -> {m}: {choice.method} fell back to plain "
                    f"decoding, {m}'s speedup {evidence[m].speedup:.2f}x [{low:.2f}, {high:.2f}] over "
                    f"{evidence[m].speedups:.3g} requests (weighted)")))
                choice = Choice(m, now, evidence)
        elif current is not None and current.speedups >= policy.min_requests and dwelt:
            best = None
            for m, e in evidence.items():
                if m == choice.method or e.speedups < policy.min_requests:
                    continue
                bounds = log_ratio_bounds(e, current)
                if bounds is not None and bounds[1] > math.log1p(policy.margin) and (best is None or bounds > best[1]):
                    best = (m, bounds)
            if best is not None:
                m, (point, low, high) = best
                new, old = evidence[m], current
                events.append((MOVED, (
                    f"{label(prompt_type)}: {choice.method} -> {m}: speedup {new.speedup:.2f}x against "
                    f"{old.speedup:.2f}x, ratio {math.exp(point):.2f} [{math.exp(low):.2f}, {math.exp(high):.2f}] "
                    f"over {new.speedups:.3g} and {old.speedups:.3g} requests (weighted)")))
                choice = Choice(m, now, evidence)
        out[prompt_type] = choice
    return out, events
