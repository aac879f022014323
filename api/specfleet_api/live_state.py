"""The fleet's live routing state: what routers and workers act on between two reconciles.

The SpecDecodeDeployment's spec and status stay the source of truth; the operator (or, locally,
`specfleet up`'s loop) derives this from them and writes it to Redis under one key per
deployment, as one JSON document with a version that only grows. Routers and workers poll it
(and so pick up a change within their poll period) and keep the last state they read when Redis
is away (fail static). Torch-free: the operator, the router and the worker all import it.

Keys (docs/router.md, docs/worker.md):
    specfleet:v1:<namespace>/<name>:state               this document (a Redis string, JSON)
    specfleet:v1:<namespace>/<name>:window:<arm>:<pod>  one worker's windows: a hash, field = prompt
        type, value = JSON counts over its last 60 s (requests, output_tokens, steps, drafts,
        draft_tokens, accepted_tokens, plain_seconds, busy_seconds, ttft_seconds_sum, ttft_count,
        tpot_seconds_sum, tpot_count, window_seconds, updated); written every 5 s, expiring after
        15 s, so a reader sums over the pods it finds (`SCAN MATCH window_key(...) + ":*"`)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from .enums import METHODS, PROMPT_TYPES
from .limits import K_LIMIT

PREFIX = "specfleet:v1:"
ARMS = ("stable", "canary")


def state_key(namespace: str, name: str) -> str:
    """The Redis key of a deployment's live state.

    >>> state_key("default", "chat")
    'specfleet:v1:default/chat:state'
    """
    return f"{PREFIX}{namespace}/{name}:state"


def window_key(namespace: str, name: str, arm: str) -> str:
    """The prefix of an arm's window keys: each worker appends `:<pod>` (specfleet_worker.fleet).

    >>> window_key("default", "chat", "canary")
    'specfleet:v1:default/chat:window:canary'
    """
    return f"{PREFIX}{namespace}/{name}:window:{arm}"


@dataclass(frozen=True)
class KBounds:
    k_min: int = 0
    k_max: int = 8


@dataclass(frozen=True)
class Routing:
    """An arm's own routing table, where it differs from the deployment's (a canary that tries
    another draft method)."""

    default_method: str
    routes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LiveState:
    """One deployment's live state. `canary_weight` is the canary arm's share of requests in
    percent (two decimals); `routes` maps a prompt type to a draft method (`default_method` for
    the rest), for every arm that `arms` does not give a table of its own; a prompt type in
    `fallback` runs `none`; `speculate` False turns speculation off for the whole deployment (its
    fallback); `k` holds each arm's K bounds, and `k_ceilings` a lower kMax for some prompt types
    on the stable arm."""

    version: int = 0
    canary_weight: float = 0.0
    default_method: str = "ngram"
    routes: dict[str, str] = field(default_factory=dict)
    fallback: tuple[str, ...] = ()
    speculate: bool = True
    k: dict[str, KBounds] = field(default_factory=dict)
    updated: float = 0.0  # when the writer wrote it (seconds since the epoch)
    arms: dict[str, Routing] = field(default_factory=dict)  # arm -> its own table, where it differs
    probe_share: float = 0.0  # percent of a fallen-back type's / cluster's requests that still speculate
    fallback_clusters: tuple[str, ...] = ()  # prompt clusters (`<router>/<n>`) in fallback
    mirror_share: float = 0.0  # percent of greedy requests mirrored to a second backend (drift check)
    drift_epoch: str = ""  # the canary run the routers' drift counts belong to ("" : none)
    # percent of an unpinned type's requests that run the other `candidates` (the draft methods the
    # deployment serves), so that the loop keeps evidence of each (specfleet_control.methods)
    explore_share: float = 0.0
    candidates: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()  # prompt types routing.byPromptType pins: never explored
    # the stable arm's K ceiling per prompt type, below its kMax (specfleet_control.kbounds)
    k_ceilings: dict[str, int] = field(default_factory=dict)
    # the stable arm's draft method per prompt cluster the loop moved off its type's method
    cluster_routes: dict[str, str] = field(default_factory=dict)

    def method_for(self, prompt_type: str, arm: str = "stable") -> str:
        """The draft method a request of this prompt type runs with on this arm.

        >>> s = LiveState(routes={"code": "none"}, arms={"canary": Routing("draft-model")})
        >>> s.method_for("code"), s.method_for("chat"), s.method_for("code", "canary")
        ('none', 'ngram', 'draft-model')
        """
        return self.route(prompt_type, arm)[0]

    def in_fallback(self, prompt_type: str, cluster: str | None = None) -> bool:
        """Whether requests of this type (and cluster) run plain decoding, probes aside."""
        return (not self.speculate or prompt_type in self.fallback
                or (cluster is not None and cluster in self.fallback_clusters))

    def route(self, prompt_type: str, arm: str = "stable", cluster: str | None = None,
              draw: float = 100.0) -> tuple[str, bool]:
        """(method, probe) for one request: the arm's table, or `none` in fallback except for the
        probes: a request whose `draw` (uniform in [0, 100), from its id) falls under `probe_share`
        still speculates, so that the loop keeps observing what speculation would do. A draw in the
        top `explore_share` of an unpinned type runs one of the other candidates instead (in
        fallback too, as a probe of that method).

        >>> s = LiveState(fallback=("code",), probe_share=5.0)
        >>> s.route("code", draw=3.0), s.route("code", draw=50.0), s.route("chat", draw=3.0)
        (('ngram', True), ('none', False), ('ngram', False))
        >>> s = LiveState(explore_share=4.0, candidates=("ngram", "eagle", "medusa"), pinned=("math",))
        >>> s.route("chat", draw=50.0), s.route("chat", draw=96.5), s.route("chat", draw=98.5)
        (('ngram', False), ('eagle', False), ('medusa', False))
        >>> s.route("math", draw=98.5)
        ('ngram', False)
        >>> s = LiveState(routes={"qa": "eagle"}, cluster_routes={"r/3": "ngram"})   # a cluster moved off its type's
        >>> s.route("qa", cluster="r/3"), s.route("qa", cluster="r/4"), s.route("qa", "canary", "r/3")
        (('ngram', False), ('eagle', False), ('ngram', False))
        """
        own = self.arms.get(arm)
        if own is not None:
            method = own.routes.get(prompt_type, own.default_method)
        elif cluster is not None and cluster in self.cluster_routes and prompt_type not in self.pinned:
            method = self.cluster_routes[cluster]
        else:
            method = self.routes.get(prompt_type, self.default_method)
        explored = None if own is not None else self.explored(prompt_type, method, draw)
        if not self.in_fallback(prompt_type, cluster):
            return explored or method, False
        if explored is not None:
            return explored, True
        if method != "none" and draw < self.probe_share:
            return method, True
        return "none", False

    def explored(self, prompt_type: str, method: str, draw: float) -> str | None:
        """The other candidate a request of this type explores, or None (most requests, a pinned
        type, a method that is not a candidate)."""
        start = 100.0 - self.explore_share
        if not start <= draw < 100.0 or prompt_type in self.pinned or method not in self.candidates:  # 100: no draw
            return None
        others = [m for m in self.candidates if m != method]
        if not others:
            return None
        return others[min(len(others) - 1, int((draw - start) / self.explore_share * len(others)))]

    def problems(self) -> list[str]:
        out = []
        for what in ("probe_share", "mirror_share", "explore_share"):
            share = getattr(self, what)
            if not 0.0 <= share <= 100.0:
                out.append(f"{what}: {share} is not a percentage")
        if not 0.0 <= self.canary_weight <= 100.0 or round(self.canary_weight, 2) != self.canary_weight:
            out.append(f"canary_weight: {self.canary_weight} is not a percentage with at most two decimals")
        tables = [("", self.default_method, self.routes)] + [
            (f"arms[{arm!r}].", r.default_method, r.routes) for arm, r in self.arms.items()]
        for prefix, default, routes in tables:
            for where, method in [("default_method", default)] + [(f"routes[{t!r}]", m) for t, m in routes.items()]:
                if method not in METHODS:
                    out.append(f"{prefix}{where}: {method!r} is not a draft method ({', '.join(METHODS)})")
        for arm in self.arms:
            if arm not in ARMS:
                out.append(f"arms[{arm!r}]: not an arm of {ARMS}")
        for m in self.candidates:
            if m not in METHODS or m == "none":
                out.append(f"candidates: {m!r} is not a draft method that speculates")
        for t in (list(self.routes) + list(self.fallback) + [t for r in self.arms.values() for t in r.routes]
                  + list(self.pinned)):
            if t not in PROMPT_TYPES:
                out.append(f"prompt type {t!r} is not one of {', '.join(PROMPT_TYPES)}")
        for c, m in self.cluster_routes.items():
            if m not in METHODS or m == "none":
                out.append(f"cluster_routes[{c!r}]: {m!r} is not a draft method that speculates")
        for t, k in self.k_ceilings.items():
            if t not in PROMPT_TYPES or not 1 <= k <= K_LIMIT:
                out.append(f"k_ceilings[{t!r}]: need a prompt type and 1 <= kMax <= {K_LIMIT}, got {k}")
        for arm, b in self.k.items():
            if arm not in ARMS or not 0 <= b.k_min <= b.k_max <= K_LIMIT:
                out.append(f"k[{arm!r}]: need an arm of {ARMS} and 0 <= kMin <= kMax <= {K_LIMIT}, got {b}")
        return out

    def to_json(self) -> str:
        raw = asdict(self)
        raw["fallback"] = list(self.fallback)
        raw["fallback_clusters"] = list(self.fallback_clusters)
        raw["candidates"], raw["pinned"] = list(self.candidates), list(self.pinned)
        for key, default in (("probe_share", 0.0), ("fallback_clusters", []), ("mirror_share", 0.0),
                             ("drift_epoch", ""), ("explore_share", 0.0), ("candidates", []), ("pinned", []),
                             ("k_ceilings", {}), ("cluster_routes", {})):
            if raw[key] == default:
                del raw[key]  # readers that predate the loop's fields see the same document
        raw["k"] = {arm: {"kMin": b.k_min, "kMax": b.k_max} for arm, b in self.k.items()}
        if not self.arms:
            del raw["arms"]  # readers that predate per-arm tables see the same document
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> LiveState:
        """Raises ValueError naming what is wrong."""
        try:
            raw = json.loads(text)
            state = cls(version=int(raw["version"]), canary_weight=float(raw.get("canary_weight", 0.0)),
                        default_method=str(raw.get("default_method", "ngram")),
                        routes={str(k): str(v) for k, v in (raw.get("routes") or {}).items()},
                        fallback=tuple(str(t) for t in raw.get("fallback") or ()),
                        speculate=bool(raw.get("speculate", True)),
                        k={arm: KBounds(int(b["kMin"]), int(b["kMax"])) for arm, b in (raw.get("k") or {}).items()},
                        updated=float(raw.get("updated", 0.0)),
                        arms={str(arm): Routing(str(r["default_method"]),
                                                {str(k): str(v) for k, v in (r.get("routes") or {}).items()})
                              for arm, r in (raw.get("arms") or {}).items()},
                        probe_share=float(raw.get("probe_share", 0.0)),
                        fallback_clusters=tuple(str(c) for c in raw.get("fallback_clusters") or ()),
                        mirror_share=float(raw.get("mirror_share", 0.0)),
                        drift_epoch=str(raw.get("drift_epoch", "")),
                        explore_share=float(raw.get("explore_share", 0.0)),
                        candidates=tuple(str(m) for m in raw.get("candidates") or ()),
                        pinned=tuple(str(t) for t in raw.get("pinned") or ()),
                        k_ceilings={str(t): int(k) for t, k in (raw.get("k_ceilings") or {}).items()},
                        cluster_routes={str(c): str(m) for c, m in (raw.get("cluster_routes") or {}).items()})
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"live state: not a state document ({type(e).__name__}: {e})") from None
        problems = state.problems()
        if problems:
            raise ValueError("live state: " + "; ".join(problems))
        return state

    def next(self, **changes) -> LiveState:
        """The next version with `changes` applied, stamped now."""
        raw = {**asdict(self), **changes}
        raw["k"] = {arm: b if isinstance(b, KBounds) else KBounds(**b) for arm, b in raw["k"].items()}
        raw["arms"] = {arm: r if isinstance(r, Routing) else Routing(**r) for arm, r in raw["arms"].items()}
        raw["fallback"] = tuple(raw["fallback"])
        raw["fallback_clusters"] = tuple(raw["fallback_clusters"])
        raw["candidates"], raw["pinned"] = tuple(raw["candidates"]), tuple(raw["pinned"])
        raw["version"] = self.version + 1
        raw["updated"] = time.time()
        return LiveState(**raw)
