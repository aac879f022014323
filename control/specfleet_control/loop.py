"""One tick of the SLO loop over a whole deployment: every key's window judged by `slo.step`, the
keys' states kept as the loop's memory, and what the fleet must do about them (which prompt types
and clusters run plain, whether the whole deployment does).

Keys are judged once per window (`slo.window`), so that two judgements never count the same
requests twice; a window too thin to decide on is kept as evidence and the next one adds to it,
until a verdict (healthy or missed) starts the evidence afresh (a healthy speedup does not while
alpha is not yet clear of its line, or too thin for a baseline the key lacks). Half way between
two judgements, a speculating key whose current window alone misses the SLO falls back then (a
miss needs no more evidence than its own window, and the collapse is caught within two windows of
its start); at a judgement, too, a window that misses on its own is a miss when the kept evidence
it adds to leaves the verdict open.
An alert is judged at once.

Keys: `type:<prompt type>` where the router routes per type (the deployment has a router), a
`cluster:<router>/<n>` per prompt cluster the routers learned inside a type, and `deployment` for
the whole of it (the only key without a router; with one, only an alert without a prompt type
moves it). The stable arm's windows are judged: the canary is the canary analysis' to judge.
Pure: the operator's daemon and `specfleet up` call `tick` with what they read and keep `Memory`
(the SDD status, or the local store) between ticks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from specfleet_api.windows import ClusterWindow, Window, sum_windows

from .kbounds import Ceiling, KTuning, tune
from .methods import Choice, Selection, choose, cluster_method_evidence
from .observe import Observation
from .slo import (FALLBACK, HEALTHY, MISSED, SPECULATIVE, UNKNOWN, Evidence, KeyState, Sample, SloPolicy, alpha_clear,
                  judge, mean_var, speedup_bounds, step, t95, wilson, window_evidence)

# Accepted draft tokens are not independent (a rejection ends its draft): a cluster's interval
# counts its drafted tokens as this many times fewer trials.
DRAFT_CORRELATION = 2.0
CLUSTER_Z = 1.96  # alpha's interval (a type's, a cluster's): 95%

DEPLOYMENT = "deployment"
# A key's evidence adds up over at most this many windows without a verdict (a speedup that stays
# within its interval of the line), then starts again from the current window; evidence still too
# thin to judge (a quiet probe: 5% of a slow type may finish one request in many windows) keeps
# adding up to MAX_THIN_WINDOWS, so a slower machine waits longer instead of never deciding.
MAX_EVIDENCE_WINDOWS = 12
MAX_THIN_WINDOWS = 60


def type_key(prompt_type: str) -> str:
    return f"type:{prompt_type}"


def cluster_key(cluster: str) -> str:
    return f"cluster:{cluster}"


@dataclasses.dataclass(frozen=True)
class Memory:
    """The SLO loop's memory: one KeyState per key, and when each cluster was last seen."""

    keys: Mapping[str, KeyState] = dataclasses.field(default_factory=dict)
    seen: Mapping[str, float] = dataclasses.field(default_factory=dict)  # cluster key -> last window
    evidence: Mapping[str, Evidence] = dataclasses.field(default_factory=dict)  # key -> windows not yet decisive
    judged_at: float | None = None  # the last judgement of the windows
    early_at: float | None = None  # the last half-way check for misses
    methods: Mapping[str, Choice] = dataclasses.field(default_factory=dict)  # prompt type -> its draft method
    ceilings: Mapping[str, Ceiling] = dataclasses.field(default_factory=dict)  # prompt type -> its K ceiling
    # prompt cluster (`<router>/<n>`) -> its draft method: one the loop moved runs it, not its type's
    cluster_methods: Mapping[str, Choice] = dataclasses.field(default_factory=dict)

    @property
    def whole(self) -> bool:
        return self.keys.get(DEPLOYMENT, KeyState()).mode == FALLBACK

    def fallback_types(self) -> tuple[str, ...]:
        return tuple(sorted(k.split(":", 1)[1] for k, s in self.keys.items()
                            if k.startswith("type:") and s.mode == FALLBACK))

    def fallback_clusters(self) -> tuple[str, ...]:
        return tuple(sorted(k.split(":", 1)[1] for k, s in self.keys.items()
                            if k.startswith("cluster:") and s.mode == FALLBACK))

    def chosen_methods(self) -> dict[str, str]:
        """The draft method the loop chose per (unpinned) prompt type."""
        return {t: c.method for t, c in sorted(self.methods.items())}

    def cluster_routes(self) -> dict[str, str]:
        """The draft method per prompt cluster the loop moved off its type's method."""
        return {c: ch.method for c, ch in sorted(self.cluster_methods.items()) if ch.since is not None}

    def k_ceilings(self) -> dict[str, int]:
        """The K ceiling in force per prompt type, where the loop set one (below the kMax it
        judged against; the live state drops one a lower kMax has overtaken)."""
        return {t: c.in_force for t, c in sorted(self.ceilings.items()) if c.in_force is not None}

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keys": {k: s.to_status() for k, s in sorted(self.keys.items())}}
        if self.methods:
            out["methods"] = {t: c.to_status() for t, c in sorted(self.methods.items())}
        if self.ceilings:
            out["kCeilings"] = {t: c.to_status() for t, c in sorted(self.ceilings.items())}
        if self.cluster_methods:
            out["clusterMethods"] = {c: ch.to_status() for c, ch in sorted(self.cluster_methods.items())}
        if self.seen:
            out["seen"] = dict(sorted(self.seen.items()))
        if self.evidence:
            out["evidence"] = {k: e.to_status() for k, e in sorted(self.evidence.items())}
        if self.judged_at is not None:
            out["judgedAt"] = self.judged_at
        if self.early_at is not None:
            out["earlyAt"] = self.early_at
        return out

    @classmethod
    def from_status(cls, raw: dict[str, Any] | None) -> Memory:
        raw = raw or {}
        return cls({str(k): KeyState.from_status(v) for k, v in (raw.get("keys") or {}).items()},
                   {str(k): float(v) for k, v in (raw.get("seen") or {}).items()},
                   {str(k): Evidence.from_status(v) for k, v in (raw.get("evidence") or {}).items()},
                   raw.get("judgedAt"), raw.get("earlyAt"),
                   {str(t): Choice.from_status(c) for t, c in (raw.get("methods") or {}).items()},
                   {str(t): Ceiling.from_status(c) for t, c in (raw.get("kCeilings") or {}).items()},
                   {str(c): Choice.from_status(ch) for c, ch in (raw.get("clusterMethods") or {}).items()})


def event_scope(message: str) -> str:
    """What a loop event's message says it decided for: one prompt type, one prompt cluster, or
    the deployment (its messages name the key first; the canary's name none).

    >>> event_scope("prompt type code (ngram): kMax 4 -> 2: ..."), event_scope("prompt cluster r/1 (code): ...")
    ('prompt_type', 'cluster')
    >>> event_scope("speculation off: alpha 0.12 ...")
    'deployment'
    """
    return ("prompt_type" if message.startswith("prompt type") else
            "cluster" if message.startswith("prompt cluster") else "deployment")


@dataclasses.dataclass(frozen=True)
class Tick:
    memory: Memory
    events: tuple[tuple[str, str], ...] = ()  # (reason, message): Kubernetes Events / local log
    decided: bool = True  # False: the observation was incomplete and nothing was judged


def cluster_evidence(cw: ClusterWindow) -> Evidence:
    return Evidence(draft_tokens=cw.draft_tokens, accepted_tokens=cw.accepted_tokens, requests=cw.spec_requests,
                    seen=cw.requests, windows=1)


def alpha_bounds(e: Evidence) -> tuple[float, float] | None:
    """Alpha's 95% interval over the evidence: its drafted tokens counted as half as many trials,
    and, where the evidence holds the requests' own acceptance rates, an upper end at least as high
    as their spread says (Student's t over the requests). A request's drafts all come from one
    prompt: prompts of one type accept from 0.01 to 0.6 of their drafts, so the tokens of one or
    two requests say little of the type, and a miss (the upper end under the line) must hold
    across requests; a single request's own rate gives no spread at all, and no miss until a second
    one. The lower end stays the tokens': health is held for `recoverAfter` before a key leaves
    fallback, and a baseline moves by one window's weight, so neither needs the same guard.

    >>> def r(b): return [round(x, 3) for x in b]
    >>> r(alpha_bounds(Evidence(draft_tokens=92, accepted_tokens=1, requests=1, windows=1)))  # tokens alone
    [0.001, 0.096]
    >>> r(alpha_bounds(Evidence(draft_tokens=92, accepted_tokens=1, requests=1, windows=1, alphas=1,
    ...                         alpha_sum=0.011, alpha_sq=0.0001)))  # one odd prompt of a healthy type
    [0.001, 1.0]
    >>> r(alpha_bounds(Evidence(draft_tokens=300, accepted_tokens=9, windows=1,      # three requests alike
    ...                         alphas=3, alpha_sum=0.09, alpha_sq=3 * 0.0009 + 2 * 0.0001)))
    [0.012, 0.071]
    >>> r(alpha_bounds(Evidence(draft_tokens=300, accepted_tokens=90, windows=1,     # three far apart
    ...                         alphas=3, alpha_sum=0.9, alpha_sq=0.01 ** 2 + 0.29 ** 2 + 0.6 ** 2)))
    [0.232, 1.0]
    """
    if not e.draft_tokens:
        return None
    lo, hi = wilson(e.accepted_tokens / DRAFT_CORRELATION, e.draft_tokens / DRAFT_CORRELATION, CLUSTER_Z)
    if e.alphas == 1:
        return lo, 1.0
    if e.alphas >= 2:
        half = t95(int(e.alphas) - 1) * (mean_var(e.alphas, e.alpha_sum, e.alpha_sq)[1] / e.alphas) ** 0.5
        hi = min(1.0, max(hi, e.accepted_tokens / e.draft_tokens + half))
    return lo, hi


def sample_of(e: Evidence | None, alert: str | None = None) -> Sample | None:
    """A prompt type's (or the deployment's) evidence: alpha judged by its interval, the speedup of
    the requests that speculated."""
    if e is None or not e.windows:
        return Sample(alert=alert) if alert else None
    return Sample(alpha=e.alpha, speedup=e.speedup, draft_tokens=e.draft_tokens, requests=e.requests, alert=alert,
                  alpha_bounds=alpha_bounds(e), speedup_bounds=speedup_bounds(e))


def cluster_sample(e: Evidence | None, policy: SloPolicy, alert: str | None = None) -> Sample | None:
    """A cluster's evidence, judged by alpha's 95% interval (its requests are few)."""
    if e is None or e.seen < policy.cluster_min_requests or not e.draft_tokens:
        return None
    return Sample(alpha=e.alpha, draft_tokens=e.draft_tokens, requests=e.requests, alpha_bounds=alpha_bounds(e))


def enough(e: Evidence, policy: SloPolicy) -> bool:
    """Whether evidence without a verdict lacked clarity rather than data: the drafted tokens alpha
    needs. Requests alone never are (a speedup judged healthy keeps evidence whose alpha is unclear,
    and a cluster's speedup is not observed): a collapsed type or an out-of-distribution cluster
    may finish many requests that draft almost nothing.

    >>> p = SloPolicy(min_requests=4, min_draft_tokens=100)
    >>> enough(Evidence(requests=4, draft_tokens=100), p), enough(Evidence(requests=40, draft_tokens=10), p)
    (True, False)
    """
    return e.draft_tokens >= policy.min_draft_tokens


def still_pending(e: Evidence | None, policy: SloPolicy) -> Evidence:
    """A key's kept evidence as its next judgement takes it: afresh once it has added up over
    too many windows (what is older says little of now).

    >>> still_pending(Evidence(draft_tokens=500, windows=MAX_EVIDENCE_WINDOWS), SloPolicy()).windows
    0
    >>> still_pending(Evidence(draft_tokens=5, windows=MAX_EVIDENCE_WINDOWS), SloPolicy()).windows  # thin
    12
    """
    if e is None or e.windows >= (MAX_EVIDENCE_WINDOWS if enough(e, policy) else MAX_THIN_WINDOWS):
        return Evidence()
    return e


def judges_cluster(keys: Mapping[str, KeyState], key: str, cw: ClusterWindow) -> bool:
    """Whether the loop judges this cluster now: not a new one inside a type that runs plain
    (nothing to learn about its clusters then; its probes' drafts are the type's evidence)."""
    return key in keys or keys.get(type_key(cw.prompt_type), KeyState()).mode != FALLBACK


def tick(obs: Observation, memory: Memory, policy: SloPolicy, now: float, per_type: bool = True,
         selection: Selection | None = None, tuning: KTuning | None = None) -> Tick:
    """One tick: every key judged when a window has passed since the last judgement (a key with an
    alert, at once); nothing changes on an incomplete observation. `per_type` False (no router
    following a live state): the deployment is the only key; with no windows at all
    (`obs.windows` empty: no Redis), its alerts alone move it, both ways. `selection`: what the
    loop chooses each prompt type's draft method among (methods.py), at each judgement; a type
    that moves learns its alpha baseline afresh (another method accepts at another rate).
    `tuning`: how the loop sets each prompt type's K ceiling (kbounds.py), at each judgement."""
    if not obs.complete:
        return Tick(memory, (), decided=False)
    due = memory.judged_at is None or now - memory.judged_at >= policy.window_s * 0.98
    early = not due and now - memory.judged_at >= policy.window_s * 0.49 and (
        memory.early_at is None or memory.early_at < memory.judged_at)
    stable = obs.windows.get("stable", {})
    whole_alert = next((a.name for a in obs.alerts if a.prompt_type is None), None)
    type_alerts = {a.prompt_type: a.name for a in obs.alerts if a.prompt_type is not None}
    keys: dict[str, KeyState] = dict(memory.keys)
    seen: dict[str, float] = dict(memory.seen)
    evidence: dict[str, Evidence] = dict(memory.evidence)
    events: list[tuple[str, str]] = []

    def missed_alone(window: Evidence | None, before: KeyState, sample) -> Sample | None:
        """The current window alone, not added to the evidence, where a speculating key misses on it."""
        if window is None or before.mode != SPECULATIVE:
            return None
        current = sample(window, None)
        return current if judge(current, before, policy)[0] == MISSED else None

    def move(key: str, what: str, window: Evidence | None, alert: str | None = None,
             sample=sample_of, only_alert: bool = False) -> None:
        if early and not alert and window is not None and keys.get(key, KeyState()).mode == SPECULATIVE:
            current = missed_alone(window, keys.get(key, KeyState()), sample)
            if current is not None:
                state, event = step(current, keys.get(key, KeyState()), policy, now)
                keys[key] = state
                evidence.pop(key, None)
                if event:
                    events.append((event[0], f"{what}: {event[1]}"))
            return
        if not (due or alert):
            return
        pending = still_pending(evidence.get(key), policy)
        combined = pending.plus(window) if window is not None and not only_alert else pending
        judged = sample(combined, alert) if not only_alert else Sample(alert=alert)
        before = keys.get(key, KeyState())
        if pending.windows and not only_alert and judge(judged, before, policy)[0] == UNKNOWN:
            # kept evidence from before a collapse blurs it (healthy requests beside collapsed ones
            # spread the requests' acceptance wide): a window that misses on its own is a miss
            judged = missed_alone(window, before, sample) or judged
        state, event = step(judged, before, policy, now)
        keys[key] = state
        # a speculating key judged healthy on its speedup alone keeps its evidence while its alpha
        # is not yet clear of its line, or too thin for a baseline when it has none: where no one
        # window holds that many drafted tokens (a slow machine, a quiet type, a collapsed type
        # whose K fell to 0), throwing each window away would leave its alpha never judged
        thin = state.mode == SPECULATIVE and state.verdict == HEALTHY and before.mode == SPECULATIVE and (
            not alpha_clear(judged, before, policy)
            or (before.baseline is None and combined.draft_tokens < policy.min_draft_tokens))
        if (state.verdict == UNKNOWN or thin) and combined.windows:
            evidence[key] = combined
        else:
            evidence.pop(key, None)
        if event:
            events.append((event[0], f"{what}: {event[1]}"))

    everything = window_evidence(sum_windows(list(stable.values()))) if stable else None
    if not per_type:
        alert = whole_alert or next(iter(type_alerts.values()), None)
        if obs.windows:
            move(DEPLOYMENT, "the deployment", everything, alert)
        elif due or alert:
            state, event = step(Sample(alert=alert, alerts_only=True), keys.get(DEPLOYMENT, KeyState()), policy, now)
            keys[DEPLOYMENT] = state
            if event:
                events.append((event[0], f"the deployment: {event[1]}"))
        return Tick(Memory(keys, seen, evidence, now if due else memory.judged_at,
                           now if early else memory.early_at), tuple(events))

    # with a router: the whole deployment falls back only on an alert for all of it; it recovers
    # on the probes' evidence summed over the types
    if keys.get(DEPLOYMENT, KeyState()).mode == FALLBACK:
        move(DEPLOYMENT, "the deployment", everything, whole_alert)
    elif whole_alert:
        move(DEPLOYMENT, "the deployment", None, whole_alert, only_alert=True)
    for prompt_type in sorted(set(stable) | set(type_alerts)
                              | {k.split(":", 1)[1] for k in keys if k.startswith("type:")}):
        move(type_key(prompt_type), f"prompt type {prompt_type}", window_evidence(stable.get(prompt_type)),
             type_alerts.get(prompt_type))
    chosen = dict(memory.methods)
    if due and selection is not None and selection.candidates:
        plain = frozenset(k.split(":", 1)[1] for k, st in keys.items() if k.startswith("type:") and st.mode == FALLBACK)
        chosen, moves = choose(obs.methods.get("stable", {}), memory.methods, selection.policy, now,
                               candidates=selection.candidates, default=selection.default, pins=selection.pins,
                               plain=plain)
        for prompt_type, choice in chosen.items():
            before = memory.methods.get(prompt_type)
            if choice.since == now and (before is None or before.since != now):  # it moved now
                key = type_key(prompt_type)
                keys[key] = dataclasses.replace(keys.get(key, KeyState()), baseline=None, baseline_tokens=None)
                evidence.pop(key, None)
        events += moves
    elif selection is not None and not selection.candidates:
        chosen = {}  # nothing to choose among any more (the spec serves one method, or turned it off)
    ceilings = dict(memory.ceilings)
    if due and tuning is not None:
        ceilings, changes = tune(obs.methods.get("stable", {}), stable, memory.ceilings, tuning, now)
        events += changes
    if policy.clusters:
        for cluster, cw in sorted(obs.clusters.items()):
            key = cluster_key(cluster)
            seen[key] = now
            if not judges_cluster(keys, key, cw):
                continue
            if key not in keys:  # a new cluster is judged against its type's baseline
                of_type = keys.get(type_key(cw.prompt_type), KeyState())
                keys[key] = KeyState(baseline=of_type.baseline, baseline_tokens=of_type.baseline_tokens)
            move(key, f"prompt cluster {cluster} ({cw.prompt_type})", cluster_evidence(cw),
                 sample=lambda e, alert: cluster_sample(e, policy, alert))
        for key in [k for k in keys if k.startswith("cluster:")]:
            # a cluster no router reports any more (its router restarted, or its traffic stopped)
            # is forgotten after ten windows; one in fallback says so
            if now - seen.get(key, now) > 10 * policy.window_s:
                if keys[key].mode == FALLBACK:
                    events.append(("FallbackLeft", f"prompt cluster {key.split(':', 1)[1]}: forgotten, "
                                                   f"no router has reported it for {now - seen[key]:.0f}s"))
                del keys[key]
                seen.pop(key, None)
                evidence.pop(key, None)
            else:
                seen.setdefault(key, now)
    else:
        for key in [k for k in keys if k.startswith("cluster:")]:
            del keys[key]
            seen.pop(key, None)
            evidence.pop(key, None)
    # each cluster's method, judged after its SLO (a cluster that moves learns its baseline from the next
    # window, its new method's); a choice lives as long as its cluster is remembered
    cluster_chosen = {c: ch for c, ch in memory.cluster_methods.items() if cluster_key(c) in seen} \
        if selection is not None and selection.candidates and policy.clusters else {}
    if due and selection is not None and selection.candidates and policy.clusters:
        cluster_chosen, moves = choose_for_clusters(obs.clusters, cluster_chosen, chosen, keys, selection, now)
        for cluster, choice in cluster_chosen.items():
            old = memory.cluster_methods.get(cluster)
            if choice.since == now and (old is None or old.since != now):  # it moved now: a new baseline
                key = cluster_key(cluster)
                if key in keys:
                    keys[key] = dataclasses.replace(keys[key], baseline=None, baseline_tokens=None)
                evidence.pop(key, None)
        events += moves
    return Tick(Memory(keys, seen, evidence, now if due else memory.judged_at, now if early else memory.early_at,
                       chosen, ceilings, cluster_chosen), tuple(events))


def choose_for_clusters(clusters: Mapping[str, ClusterWindow], before: Mapping[str, Choice],
                        type_choices: Mapping[str, Choice], keys: Mapping[str, KeyState], selection: Selection,
                        now: float) -> tuple[dict[str, Choice], list[tuple[str, str]]]:
    """The draft method of each prompt cluster a router reported now, by the rules a type's is
    chosen by (`methods.choose`), on the routers' per-method counts of the cluster's stable
    requests: a cluster runs its type's method until its own evidence clearly favours another
    (a type's drafts can pay on most of its prompts and not on one kind of them). A cluster of a
    pinned type is never moved; one the SLO loop has fallen back moves only to a method whose
    own speedup is clearly above plain decoding's. The others keep their choice."""
    of_type = {c: cw.prompt_type for c, cw in clusters.items()}
    defaults = {c: type_choices[t].method if t in type_choices else selection.default for c, t in of_type.items()}
    pins = {c: selection.pins[t] for c, t in of_type.items() if t in selection.pins}
    plain = frozenset(c for c in clusters if keys.get(cluster_key(c), KeyState()).mode == FALLBACK)
    chosen, moves = choose({c: cw.methods for c, cw in clusters.items()},
                           {c: ch for c, ch in before.items() if c in clusters}, selection.policy, now,
                           candidates=selection.candidates, default=selection.default, pins=pins, plain=plain,
                           defaults=defaults, evidence_of=cluster_method_evidence,
                           label=lambda c: f"prompt cluster {c} ({of_type[c]})")
    out = {c: ch for c, ch in before.items() if c not in clusters and c not in pins}
    out.update(chosen)
    return out, moves
