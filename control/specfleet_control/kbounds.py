"""Each prompt type's K ceiling, set by the loop from what its drafts did, and lowered under load.

The engine's K policy chooses each step's draft length within the deployment's K bounds, from
the sequence's own recent acceptance and the machine's step costs. Two things it cannot see from
one sequence, the fleet's windows show: how acceptance falls (or holds) by draft position on a
prompt type, over all its requests; and whether the fleet is loaded past its latency SLO. So at
each judgement, for every prompt type, on the draft method it runs (`speculation.kTuning`):

- **acceptance**: position p's gain g_p is the share of the steps whose draft reached p that had
  it accepted (`TypeCounts.pos_drafted`, `pos_accepted`: the expected tokens that position adds);
  a drafted position's cost c is what the type's speculating steps cost beyond plain decoding,
  per drafted position, in plain steps (busy over plain-equivalent seconds, less one, over the
  positions a step drafted: the draft's own compute and the verify rows together, as measured at
  the load of the window). The ceiling is the K that maximises tokens per unit of time,
  (1 + g_1 + ... + g_K) / (1 + K c), among the positions with `minSteps` steps of evidence and
  one more past them (its gain extrapolated: a ceiling in force keeps deeper drafts from being
  measured); that one winning means deeper drafts may pay, and the type keeps no ceiling.
  Evidence carries over windows, halved each judgement, so a quiet type adds up;
- **load**: where `tpotP99Seconds` is set and a type's TPOT P99 is over it, its ceiling halves
  (at least kMin); once it is back under (1 - hysteresis) of it, the ceiling rises by one a
  judgement until the acceptance's ceiling is back.

Changes move by at least one position and only when the new K's rate beats the current one's by
`margin`. The acceptance's ceiling rises at most once a `minDwell` (5 min) after its last move: a
ceiling keeps the positions past it from being measured, so a rise rests on their gain
extrapolated from the ones before, and from one position alone that guess can say "lift" where
the measurement, once lifted, says "cap" again (a real fleet's type flapped none -> 1 -> none -> 1
in 90 s of 20 s windows). So a rise is a probe of deeper drafts, once a dwell; a cap rests on
measured positions and acts at once. The load's ceiling is not held: it answers the TPOT each
judgement. Pure: `tune` takes the stable arm's per-(type, method) windows and the ceilings so far
(the loop's memory) and returns the next ones and an event per change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from specfleet_api.durations import parse_duration
from specfleet_api.windows import POSITIONS, Window

CHANGED = "KCeilingChanged"
CARRY = 0.5  # of a type's position evidence carried into the next judgement
MIN_TPOT = 8  # requests with a TPOT a window needs before its P99 is judged


@dataclasses.dataclass(frozen=True)
class KTuning:
    """speculation.kTuning: whether the loop sets K ceilings per prompt type, and its lines."""

    enabled: bool = False  # opt-in: speculation.kTuning.enabled
    min_steps: int = 64  # drafting steps a position needs before its acceptance counts
    margin: float = 0.02  # a ceiling moves when the new K's rate beats the current one's by this
    tpot_p99_s: float | None = None  # a type over this TPOT P99 halves its ceiling
    hysteresis: float = 0.1  # and raises it again below (1 - hysteresis) of it
    min_dwell_s: float = 300.0  # from a move of a type's acceptance ceiling to its next rise
    k_min: int = 0  # the deployment's K bounds (speculation.kMin, kMax): ceilings stay within
    k_max: int = 8

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> KTuning:
        """From a defaulted spec; disabled where nothing is drafted (draft.method none).

        >>> t = KTuning.from_spec({"draft": {"method": "ngram"}, "speculation": {"kMin": 1, "kMax": 6,
        ...                        "kTuning": {"enabled": True, "tpotP99Seconds": 0.2}}})
        >>> t.enabled, t.tpot_p99_s, (t.k_min, t.k_max), t.min_dwell_s
        (True, 0.2, (1, 6), 300.0)
        """
        speculation = spec.get("speculation") or {}
        raw = speculation.get("kTuning") or {}
        d = cls()
        tpot = raw.get("tpotP99Seconds")
        drafts = (spec.get("draft") or {}).get("method", "ngram") != "none"
        return cls(enabled=drafts and bool(raw.get("enabled", d.enabled)),
                   min_steps=int(raw.get("minSteps", d.min_steps)), margin=float(raw.get("margin", d.margin)),
                   tpot_p99_s=float(tpot) if tpot is not None else None,
                   hysteresis=float(raw.get("hysteresis", d.hysteresis)),
                   min_dwell_s=parse_duration(raw.get("minDwell", "5m")),
                   k_min=int(speculation.get("kMin", d.k_min)), k_max=int(speculation.get("kMax", d.k_max)))


@dataclasses.dataclass(frozen=True)
class Positions:
    """A type's draft evidence on its method: steps that reached / accepted each position, and
    the speculating steps' seconds (plain-equivalent, busy) with the positions they drafted."""

    drafted: tuple[float, ...] = (0.0,) * POSITIONS
    accepted: tuple[float, ...] = (0.0,) * POSITIONS
    steps: float = 0.0
    draft_positions: float = 0.0
    plain_s: float = 0.0
    busy_s: float = 0.0

    @classmethod
    def of(cls, w: Window | None) -> Positions:
        if w is None:
            return cls()
        c = w.counts
        return cls(tuple(map(float, c.pos_drafted)), tuple(map(float, c.pos_accepted)), float(c.steps),
                   float(c.draft_tokens), c.plain_seconds, c.busy_seconds)

    def carried(self, new: Positions, keep: float = CARRY) -> Positions:
        return Positions(tuple(keep * a + b for a, b in zip(self.drafted, new.drafted)),
                         tuple(keep * a + b for a, b in zip(self.accepted, new.accepted)),
                         keep * self.steps + new.steps, keep * self.draft_positions + new.draft_positions,
                         keep * self.plain_s + new.plain_s, keep * self.busy_s + new.busy_s)

    @property
    def cost(self) -> float | None:
        """A drafted position's cost in plain steps (>= 0): a step's seconds over a plain step's
        (plain-equivalent seconds are a plain step's per token emitted, and a step emits its
        accepted tokens and one more), less one, over the positions a step drafted; None without
        drafts or seconds.

        >>> round(Positions(steps=100.0, draft_positions=300.0, accepted=(80.0, 40.0) + (0.0,) * 14, plain_s=11.0,
        ...                 busy_s=8.0).cost, 3)      # 220 tokens: 0.05 s a plain step; a step 0.08 s
        0.2
        """
        if self.draft_positions <= 0 or self.plain_s <= 0 or self.steps <= 0:
            return None
        plain_step = self.plain_s / (self.steps + sum(self.accepted))
        return max(0.0, (self.busy_s / self.steps / plain_step - 1.0) * self.steps / self.draft_positions)

    @property
    def speedup(self) -> float:
        """What the steps made, in tokens per plain step's time (plain-equivalent over busy seconds)."""
        return self.plain_s / self.busy_s if self.busy_s > 0 else 1.0

    def gains(self, min_steps: float) -> list[float]:
        """g_1 .. g_n: the positions with `min_steps` of evidence, from the first on."""
        out = []
        for d, a in zip(self.drafted, self.accepted):
            if d < min_steps:
                break
            out.append(a / d)
        return out

    def to_status(self) -> dict[str, Any]:
        return {"drafted": [round(x, 2) for x in self.drafted], "accepted": [round(x, 2) for x in self.accepted],
                "steps": round(self.steps, 2), "draftPositions": round(self.draft_positions, 2),
                "plainSeconds": round(self.plain_s, 6), "busySeconds": round(self.busy_s, 6)}

    @classmethod
    def from_status(cls, raw: dict[str, Any]) -> Positions:
        def row(name):
            v = [float(x) for x in raw.get(name) or []][:POSITIONS]
            return tuple(v + [0.0] * (POSITIONS - len(v)))
        return cls(row("drafted"), row("accepted"), float(raw.get("steps", 0.0)),
                   float(raw.get("draftPositions", 0.0)), float(raw.get("plainSeconds", 0.0)),
                   float(raw.get("busySeconds", 0.0)))


def rate(gains: list[float], k: int, cost: float) -> float:
    """Tokens per plain step's time with K drafted positions.

    >>> round(rate([0.8, 0.5, 0.1], 2, 0.2), 3), round(rate([0.8, 0.5, 0.1], 3, 0.2), 3)
    (1.643, 1.5)
    """
    return (1.0 + sum(gains[:k])) / (1.0 + k * cost)


def best_k(gains: list[float], cost: float, k_lo: int, k_hi: int) -> tuple[int | None, float]:
    """(K, its rate): the K in [max(k_lo, 1), min(k_hi, len(gains))] with the most tokens per
    unit of time; K None (no ceiling) when the deepest of those wins (kMax itself, or deeper
    drafts may pay too), or nothing is measured.

    >>> best_k([0.8, 0.5, 0.1, 0.05], 0.2, 0, 8)[0]      # the third draft costs more than it adds
    2
    >>> best_k([0.8, 0.7, 0.6], 0.05, 0, 8)[0] is None     # still paying at the deepest seen
    True
    """
    lo, hi = max(k_lo, 1), min(k_hi, len(gains))
    if hi < lo:
        return None, 0.0
    k = max(range(lo, hi + 1), key=lambda j: (rate(gains, j, cost), -j))
    return None if k == hi else k, rate(gains, k, cost)


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """One prompt type's K ceiling: from its acceptance (None: none), under load (None: not
    loaded), and the evidence carried."""

    method: str
    acceptance: int | None = None
    load: int | None = None
    evidence: Positions = dataclasses.field(default_factory=Positions)
    since: float | None = None  # when the ceiling in force last changed
    acceptance_since: float | None = None  # when the acceptance's ceiling last moved (its dwell)

    @property
    def in_force(self) -> int | None:
        """The lower of the acceptance's and the load's ceilings (None: neither); `tune` keeps
        both below the kMax it judged against."""
        return min((x for x in (self.acceptance, self.load) if x is not None), default=None)

    def k_max(self, k_hi: int) -> int | None:
        """The ceiling in force under a kMax of k_hi (None: k_hi itself)."""
        k = self.in_force
        return k if k is not None and k < k_hi else None

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "evidence": self.evidence.to_status()}
        for name, v in (("acceptance", self.acceptance), ("load", self.load), ("since", self.since),
                        ("acceptanceSince", self.acceptance_since)):
            if v is not None:
                out[name] = v
        return out

    @classmethod
    def from_status(cls, raw: dict[str, Any]) -> Ceiling:
        return cls(str(raw["method"]), raw.get("acceptance"), raw.get("load"),
                   Positions.from_status(raw.get("evidence") or {}), raw.get("since"), raw.get("acceptanceSince"))


def _k(v: int | None) -> str:
    return "none" if v is None else str(v)


def next_gain(gains: list[float]) -> float:
    """The next position's gain, extrapolated: the last one times its own ratio to the one before
    (the chance a draft that got this far is accepted one further, held), at most the last.

    >>> round(next_gain([0.6, 0.3]), 3), round(next_gain([0.5]), 3)
    (0.15, 0.25)
    """
    last = gains[-1]
    ratio = last / gains[-2] if len(gains) > 1 and gains[-2] > 0 else last
    return last * min(1.0, ratio)


def running_method(by_method: Mapping[str, Window]) -> str | None:
    """The draft method most of a type's decoding steps ran in a window (explorers and probes
    aside), not counting plain decoding; None without any."""
    drafted = {m: w.counts.steps for m, w in by_method.items() if m != "none" and w.counts.steps}
    return max(sorted(drafted), key=drafted.get) if drafted else None


def tune(windows: Mapping[str, Mapping[str, Window]], type_windows: Mapping[str, Window],
         ceilings: Mapping[str, Ceiling], tuning: KTuning,
         now: float) -> tuple[dict[str, Ceiling], list[tuple[str, str]]]:
    """One judgement. `windows`: the stable arm's {type: {method: Window}} (a type's ceiling is
    its running method's; a type that changed method starts afresh); `type_windows`: its {type:
    Window} (the TPOT a type's requests saw). Returns the next ceilings and the events (reason,
    message)."""
    k_lo, k_hi = tuning.k_min, tuning.k_max
    out: dict[str, Ceiling] = {}
    events: list[tuple[str, str]] = []
    if not tuning.enabled or k_hi <= max(k_lo, 1):
        return out, events
    for prompt_type in sorted(set(windows) | set(ceilings)):
        prev = ceilings.get(prompt_type)
        method = running_method(windows.get(prompt_type, {})) or (prev.method if prev else None)
        if method is None:
            continue
        before, why = prev, []
        if before is None or before.method != method:
            before = Ceiling(method)
            if prev is not None and prev.k_max(k_hi) is not None:  # its ceiling was the old method's
                why.append(f"it runs {method} now, not {prev.method}")
        evidence = before.evidence.carried(Positions.of(windows.get(prompt_type, {}).get(method)))
        measured, cost = evidence.gains(tuning.min_steps), evidence.cost
        acceptance, acceptance_since = before.acceptance, before.acceptance_since
        dwelt = acceptance_since is None or now - acceptance_since >= tuning.min_dwell_s
        if measured and cost is not None:
            # one position past the measured ones, extrapolated: a ceiling in force keeps deeper
            # drafts from being measured, so whether one more would pay is estimated
            gains = measured + ([next_gain(measured)] if len(measured) < k_hi else [])
            k, r = best_k(gains, cost, k_lo, k_hi)
            # what runs now: under a ceiling, its K's rate; without one, what the steps did
            current = rate(gains, min(before.acceptance, len(gains)), cost) if before.acceptance is not None \
                else evidence.speedup
            rise = before.acceptance is not None and (k is None or k > before.acceptance)  # extrapolated
            if k != before.acceptance and r > current * (1 + tuning.margin) and (dwelt or not rise):
                acceptance, acceptance_since = k, now
                shown = ", ".join(f"{g:.2f}" for g in measured[:len(measured) if k is None else k + 1])
                why.append(f"acceptance by position {shown}, a drafted position costs {cost:.2f} of a plain step"
                           + (f": position {k + 1} adds less than it costs" if k is not None else ""))
        load = before.load
        w = type_windows.get(prompt_type)
        p99 = w.tpot_quantile(0.99) if w is not None and w.counts.tpot_count >= MIN_TPOT else None
        if tuning.tpot_p99_s is not None and p99 is not None:
            in_force = min(x for x in (acceptance, load, k_hi) if x is not None)
            if p99 > tuning.tpot_p99_s and in_force > max(k_lo, 1):
                load = max(k_lo, 1, in_force // 2)
                why.append(f"TPOT P99 {p99:.3f}s over its SLO {tuning.tpot_p99_s:g}s")
            elif load is not None and p99 < tuning.tpot_p99_s * (1 - tuning.hysteresis):
                load = load + 1 if load + 1 < (acceptance if acceptance is not None else k_hi) else None
                why.append(f"TPOT P99 {p99:.3f}s back under its SLO {tuning.tpot_p99_s:g}s")
        elif tuning.tpot_p99_s is None:
            load = None
        ceiling = Ceiling(method, acceptance, load, evidence, before.since, acceptance_since)
        old, new = (prev.k_max(k_hi) if prev else None), ceiling.k_max(k_hi)
        if old != new:
            ceiling = dataclasses.replace(ceiling, since=now)
            events.append((CHANGED, f"prompt type {prompt_type} ({method}): kMax {_k(old)} -> {_k(new)}: "
                                    f"{'; '.join(why)}"))
        out[prompt_type] = ceiling
    return out, events
