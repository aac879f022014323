"""What a SpecDecodeDeployment's spec means, in one place: the spec each arm runs (a promotion's
and the canary's overrides applied), its engine.json and control.json, the worker counts, the
canary's share, the K bounds in force and the live state the routers and workers follow.

Pure (dicts in, dicts and dataclasses out; no kopf, no Kubernetes, no torch), so the operator's
children and status, `specfleet up` and the control loop all read the spec through the same rules.
`spec` is defaulted as the API server defaults it (specfleet_operator.spec.with_defaults); the
fleet's own decisions (the loop's mode, the canary's progress) come in a FleetState.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from specfleet_api.live_state import KBounds, LiveState, Routing

ROLES = ("stable", "canary")
SPECULATIVE, FALLBACK = "speculative", "fallback"  # the whole deployment's mode
PROBE_SHARE = 5.0  # slo.fallback.probeShare's default in the CRD
EXPLORE_SHARE = 5.0  # routing.select.exploreShare's default in the CRD
# Where an override key lives in the spec (the rest live at the same path).
_OVERRIDE_PATHS = {"image": ("template", "image")}


@dataclasses.dataclass(frozen=True)
class FleetState:
    """The operator's own decisions that shape children: control-loop mode and canary progress."""

    mode: str = SPECULATIVE  # or FALLBACK: the whole deployment
    canary_weight: float | None = None  # percent of requests; None: spec.canary.weight (the start)
    canary_phase: str = "Idle"  # specfleet_control.canary.PHASES
    fallback: tuple[str, ...] = ()  # prompt types in fallback (the router routes them to `none`)
    fallback_clusters: tuple[str, ...] = ()  # prompt clusters in fallback
    mirror_share: float = 0.0  # percent of greedy requests mirrored for the canary's drift check
    drift_epoch: str = ""  # the canary run the drift counts belong to
    # what stable runs since a promotion (status.canary.promoted, `promotion`)
    promoted: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    # the draft method the loop chose per unpinned prompt type (specfleet_control.methods)
    methods: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)
    # the K ceiling the loop set per prompt type, below kMax (specfleet_control.kbounds)
    k_ceilings: dict[str, int] = dataclasses.field(default_factory=dict, hash=False)
    # the draft method per prompt cluster the loop moved off its type's method
    cluster_methods: dict[str, str] = dataclasses.field(default_factory=dict, hash=False)


def leaves(obj: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in obj.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def spec_path(override_path: tuple[str, ...]) -> tuple[str, ...]:
    """Where an override's leaf lives in the spec: `image` is spec.template.image."""
    return _OVERRIDE_PATHS.get(override_path[0], (override_path[0],)) + override_path[1:]


def lookup(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, recursively (a copy)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else copy.deepcopy(value)
    return out


def base_of(spec: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The spec's values under each leaf of `overrides` (a leaf the spec leaves unset is left out).

    >>> base_of({"speculation": {"kMax": 8}}, {"speculation": {"kMax": 12}, "image": "w:2"})
    {'speculation': {'kMax': 8}}
    """
    out: dict[str, Any] = {}
    for path in leaves(overrides):
        value = lookup(spec, spec_path(path))
        if value is not None:  # unset in the spec (e.g. template.image: the operator's default)
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = copy.deepcopy(value)
    return out


def apply_overrides(spec: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`spec` with the overrides' leaves set (a copy).

    >>> apply_overrides({"speculation": {"kMin": 1, "kMax": 8}}, {"speculation": {"kMax": 12}, "image": "w:2"})
    {'speculation': {'kMin': 1, 'kMax': 12}, 'template': {'image': 'w:2'}}
    """
    out = copy.deepcopy(spec)
    for path, value in leaves(overrides).items():
        node = out
        where = spec_path(path)
        for key in where[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[where[-1]] = copy.deepcopy(value)
    return out


def _unflatten(leaves: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in leaves.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def promotion(spec: dict[str, Any], record: dict[str, Any] | None) -> tuple[dict[str, Any] | None,
                                                                           tuple[tuple[str, str], ...]]:
    """What is left of a promotion record under the spec now, and the events that say what went.

    Each promoted leaf stays (the stable workers run it) until the spec holds the same value
    (folded: nothing changes) or sets that field to something else than it held at promotion time
    (superseded: the spec wins, and the workers follow it). Removing spec.canary changes neither.

    >>> rec = {"overrides": {"speculation": {"kMax": 12}, "draft": {"method": "none"}},
    ...        "base": {"speculation": {"kMax": 8}, "draft": {"method": "ngram"}}}
    >>> spec = {"speculation": {"kMax": 8}, "draft": {"method": "ngram"}}
    >>> promotion(spec, rec)[0] == rec
    True
    >>> kept, events = promotion({"speculation": {"kMax": 12}, "draft": {"method": "ngram"}}, rec)
    >>> kept["overrides"], [r for r, _ in events]
    ({'draft': {'method': 'none'}}, ['PromotionFolded'])
    >>> promotion({"speculation": {"kMax": 6}, "draft": {"method": "none"}}, rec)
    (None, (('PromotionFolded', 'the spec now holds the promoted draft.method none'), ('PromotionSuperseded', 'the spec set speculation.kMax to 6 after the promotion of 12: the stable workers follow the spec')))
    """
    if not record or not record.get("overrides"):
        return None, ()
    base = record.get("base") or {}
    kept: dict[tuple[str, ...], Any] = {}
    folded, superseded = [], []
    for path, value in leaves(record["overrides"]).items():
        now = lookup(spec, spec_path(path))
        name = ".".join(spec_path(path))
        if now == value:
            folded.append(f"{name} {value}")
        elif now != lookup(base, path):
            superseded.append(f"{name} to {now} after the promotion of {value}")
        else:
            kept[path] = value
    events = []
    if folded:
        events.append(("PromotionFolded", f"the spec now holds the promoted {', '.join(folded)}"))
    if superseded:
        events.append(("PromotionSuperseded", f"the spec set {', '.join(superseded)}: the stable workers follow "
                                              f"the spec"))
    if not kept:
        return None, tuple(events)
    out = dict(record, overrides=_unflatten(kept),
               base=_unflatten({p: lookup(base, p) for p in kept if lookup(base, p) is not None}))
    return out, tuple(events)


def promoted_overrides(spec: dict[str, Any], state: FleetState) -> dict[str, Any]:
    """The overrides stable runs since a promotion, what is left of them under the spec now
    (`promotion`): removing spec.canary never changes them.

    >>> s = {"speculation": {"kMax": 8}}
    >>> rec = {"overrides": {"speculation": {"kMax": 12}}, "base": {"speculation": {"kMax": 8}}}
    >>> promoted_overrides(s, FleetState(promoted=rec)), promoted_overrides({"speculation": {"kMax": 6}},
    ...                                                                     FleetState(promoted=rec))
    ({'speculation': {'kMax': 12}}, {})
    """
    record = state.promoted
    if record is None and state.canary_phase == "Promoted" and spec.get("canary"):
        # a status written before promotions were recorded: the canary's overrides, as then
        over = spec["canary"].get("overrides") or {}
        record = {"overrides": over, "base": base_of(spec, over)}
    kept, _ = promotion(spec, record)
    return kept["overrides"] if kept else {}


def not_in_spec(spec: dict[str, Any], state: FleetState) -> dict[str, Any]:
    """What the stable workers run that the spec does not say, by the field's place in the spec:
    the promoted overrides not yet folded in (`promoted_overrides`). Empty: the spec says it all.

    >>> rec = {"overrides": {"speculation": {"kMax": 12}, "image": "w:2"}, "base": {"speculation": {"kMax": 8}}}
    >>> not_in_spec({"speculation": {"kMax": 8}}, FleetState(promoted=rec))
    {'speculation.kMax': 12, 'template.image': 'w:2'}
    >>> not_in_spec({"speculation": {"kMax": 12}, "template": {"image": "w:2"}}, FleetState(promoted=rec))
    {}
    """
    return {".".join(spec_path(path)): value for path, value in leaves(promoted_overrides(spec, state)).items()}


def effective_spec(spec: dict[str, Any], role: str, state: FleetState = FleetState()) -> dict[str, Any]:
    """The spec a role runs: stable, the base spec with what a promotion left it; the canary,
    stable's with its own overrides on top."""
    out = apply_overrides(spec, promoted_overrides(spec, state))
    if role == "canary":
        out = apply_overrides(out, (spec.get("canary") or {}).get("overrides") or {})
    return out


def engine_config(spec: dict[str, Any], role: str, state: FleetState = FleetState()) -> dict[str, Any]:
    """engine.json as docs/worker-contract.md defines it, for one role."""
    spec = effective_spec(spec, role, state)
    model, draft, k = spec["model"], spec["draft"], spec["speculation"]
    routing = spec.get("routing") or {}
    speculation = {"kMin": k["kMin"], "kMax": k["kMax"], "kInitial": k["kInitial"], "kPolicy": k["kPolicy"],
                   "tree": {"branching": k["tree"]["branching"], "depth": k["tree"]["depth"]}}
    choices = k["tree"].get("choices")
    if choices:  # absent or []: no static shape, and the file (its hash, the pods) as before the field existed
        speculation["tree"]["choices"] = choices  # as the spec wrote it: engine.json's reader judges it
    guard = (k.get("latencyGuard") or {}).get("maxSlowdownPercent")
    if guard is not None:  # absent: off, and the file (its hash, the pods) as before the field existed
        speculation["latencyGuard"] = {"maxSlowdownPercent": guard}
    draft_json = {"method": draft["method"], "uri": draft.get("uri")}
    ngram = draft.get("ngram") or {}
    # 0 and false, the defaults: the file (its hash, the pods) as before the fields existed
    ngram_json = {k: ngram[k] for k in ("corpusTokens", "mix") if ngram.get(k)}
    if ngram_json:
        draft_json["ngram"] = ngram_json
    return {
        "model": {"name": model["name"], "uri": model["uri"], "tokenizer": model.get("tokenizer")},
        "draft": draft_json,
        "speculation": speculation,
        "routing": {"default": routing.get("default", draft["method"]),
                    "byPromptType": dict(routing.get("byPromptType", {}))},
        "quantization": spec["quantization"],
        "dtype": spec["dtype"],
        "device": spec["device"],
        "role": role,
    }


def speculates(spec: dict[str, Any], state: FleetState, role: str = "stable") -> bool:
    """Whether an arm's requests speculate by default: not in a whole-deployment fallback, and the
    arm drafts (its draft.method is not none). The stable arm's is the live state's `speculate`."""
    return state.mode == SPECULATIVE and effective_spec(spec, role, state)["draft"]["method"] != "none"


def probe_share(spec: dict[str, Any]) -> float:
    """Percent of a fallen-back key's requests that still speculate (slo.fallback.probeShare, the
    CRD's default where unset); 0 with the fallback off.

    >>> probe_share({}), probe_share({"slo": {"fallback": {"probeShare": 2}}}), probe_share({"slo": {"fallback": {"enabled": False}}})
    (5.0, 2.0, 0.0)
    """
    fallback = (spec.get("slo") or {}).get("fallback") or {}
    return float(fallback.get("probeShare", PROBE_SHARE)) if fallback.get("enabled", True) else 0.0


def served_methods(spec: dict[str, Any], role: str = "stable", state: FleetState = FleetState()) -> tuple[str, ...]:
    """The draft methods an arm's workers serve and the loop may choose among per prompt type:
    n-gram (every worker has it) and the arm's draft.method; none where it does not speculate.

    >>> served_methods({"draft": {"method": "eagle"}}), served_methods({"draft": {"method": "ngram"}})
    (('ngram', 'eagle'), ('ngram',))
    >>> served_methods({"draft": {"method": "none"}})
    ()
    """
    method = effective_spec(spec, role, state)["draft"]["method"]
    if method == "none":
        return ()
    return ("ngram",) if method == "ngram" else ("ngram", method)


def selects_methods(spec: dict[str, Any], state: FleetState = FleetState()) -> bool:
    """Whether the loop chooses each unpinned prompt type's method (routing.select.enabled, on by
    default) among more than one served method.

    >>> selects_methods({"draft": {"method": "eagle"}}), selects_methods({"draft": {"method": "ngram"}})
    (True, False)
    >>> selects_methods({"draft": {"method": "eagle"}, "routing": {"select": {"enabled": False}}})
    False
    """
    select = (spec.get("routing") or {}).get("select") or {}
    return bool(select.get("enabled", True)) and len(served_methods(spec, "stable", state)) > 1


def explore_share(spec: dict[str, Any], state: FleetState = FleetState()) -> float:
    """Percent of an unpinned type's requests that run the other served methods
    (routing.select.exploreShare); 0 where the loop does not choose.

    >>> explore_share({"draft": {"method": "eagle"}}), explore_share({"draft": {"method": "ngram"}})
    (5.0, 0.0)
    """
    select = (spec.get("routing") or {}).get("select") or {}
    return float(select.get("exploreShare", EXPLORE_SHARE)) if selects_methods(spec, state) else 0.0


def k_bounds(spec: dict[str, Any], state: FleetState, role: str = "stable") -> KBounds:
    """The K bounds in force for one arm: its spec's, or kMax 0 where nothing speculates, the one
    rule of "speculation off" (the live state, control.json and the status all say this). In a
    whole-deployment fallback the probes still speculate: the bounds stay while probe_share > 0,
    and `speculates` False makes the workers' default plain (a soft off, docs/worker.md).

    >>> s = {"draft": {"method": "ngram"}, "speculation": {"kMin": 2, "kMax": 8}}
    >>> k_bounds(s, FleetState()), k_bounds(s, FleetState(mode=FALLBACK))
    (KBounds(k_min=2, k_max=8), KBounds(k_min=2, k_max=8))
    >>> s["slo"] = {"fallback": {"probeShare": 0}}
    >>> k_bounds(s, FleetState(mode=FALLBACK)), k_bounds({**s, "draft": {"method": "none"}}, FleetState())
    (KBounds(k_min=0, k_max=0), KBounds(k_min=0, k_max=0))
    """
    arm = effective_spec(spec, role, state)
    bounds = arm["speculation"]
    probes = state.mode == FALLBACK and probe_share(spec) > 0 and arm["draft"]["method"] != "none"
    on = speculates(spec, state, role) or probes
    k_max = bounds["kMax"] if on else 0
    return KBounds(min(bounds["kMin"], k_max), k_max)


def control_config(spec: dict[str, Any], state: FleetState, role: str = "stable") -> dict[str, Any]:
    """control.json of one arm: whether the arm speculates and its K bounds in force, what a worker
    starts from and follows while Redis is away (the live state says the same). The canary's has
    its overrides' K bounds: a worker clamps its K to these, so a shared file would undo them.

    >>> s = {"draft": {"method": "ngram"}, "speculation": {"kMin": 2, "kMax": 8}}
    >>> control_config(s, FleetState(mode=FALLBACK))
    {'speculate': False, 'kMin': 2, 'kMax': 8}
    """
    k = k_bounds(spec, state, role)
    return {"speculate": speculates(spec, state, role), "kMin": k.k_min, "kMax": k.k_max}


def canary_weight(spec: dict[str, Any], state: FleetState) -> float:
    """The canary's share of requests in percent (two decimals) now: 0 without a canary or after it."""
    canary = spec.get("canary")
    if not canary or state.canary_phase in ("Promoted", "Aborted"):
        return 0
    return canary.get("weight", 1) if state.canary_weight is None else state.canary_weight


def replica_counts(spec: dict[str, Any], state: FleetState) -> tuple[int | None, int]:
    """(stable, canary) worker counts. Stable is None under an autoscaler. The router splits
    requests, so pods no longer carry the share: the canary runs canary.replicas while it lives.

    A canary waiting for its workers routes nothing (weight 0) but has its pods.

    >>> s = {"replicas": 100, "canary": {"weight": 1, "replicas": 2}}
    >>> replica_counts(s, FleetState()), replica_counts(s, FleetState(canary_phase="Promoted"))
    ((100, 2), (100, 0))
    >>> replica_counts(s, FleetState(canary_phase="Waiting", canary_weight=0))
    (100, 2)
    """
    scaling = spec.get("scaling")
    stable = None if scaling else spec.get("replicas", 1)
    live = spec.get("canary") and state.canary_phase not in ("Promoted", "Aborted")
    canary = spec["canary"].get("replicas", 1) if live else 0
    return stable, canary


def writes_live_state(spec: dict[str, Any], read_secrets: bool, default_redis: bool = False) -> bool:
    """Whether the fleet's live state is kept in Redis: spec.redis, and for a secretRef the right
    to read that Secret (`read_secrets`); without spec.redis, whether there is a default Redis
    (`default_redis`: the one the install provides); else the router serves the spec's state from
    flags.

    >>> writes_live_state({}, False), writes_live_state({}, False, default_redis=True)
    (False, True)
    >>> writes_live_state({"redis": {"secretRef": {"name": "r"}}}, False, default_redis=True)
    False
    """
    redis = spec.get("redis") or {}
    if not redis:
        return default_redis
    return "url" in redis or ("secretRef" in redis and read_secrets)


def live_state(spec: dict[str, Any], state: FleetState, version: int = 0, updated: float = 0.0) -> LiveState:
    """The live state (specfleet_api.live_state) derived from the spec and the loop's state: the
    canary's request share, the routing table, speculation on or off (the loop's fallback), the
    probes' share and each arm's K bounds (`k_bounds`, as control.json).

    >>> s = {"draft": {"method": "ngram"}, "speculation": {"kMin": 1, "kMax": 8},
    ...      "routing": {"byPromptType": {"chat": "none"}}, "canary": {"weight": 0.5,
    ...      "overrides": {"speculation": {"kMax": 12}}}}
    >>> ls = live_state(s, FleetState())
    >>> ls.canary_weight, ls.default_method, ls.routes, ls.speculate, ls.k["canary"]
    (0.5, 'ngram', {'chat': 'none'}, True, KBounds(k_min=1, k_max=12))
    >>> fb = live_state(s, FleetState(mode="fallback"))   # probes (5% by default) keep K in a fallback
    >>> fb.speculate, fb.k["stable"], fb.method_for("code"), fb.route("code", draw=1.0)
    (False, KBounds(k_min=1, k_max=8), 'none', ('ngram', True))
    >>> s["slo"] = {"fallback": {"probeShare": 0}}                      # no probes: speculation off
    >>> fb = live_state(s, FleetState(mode="fallback")); fb.k["stable"], fb.route("code", draw=1.0)
    (KBounds(k_min=0, k_max=0), ('none', False))
    >>> s["canary"]["overrides"]["draft"] = {"method": "none"}          # the canary tries plain decoding
    >>> ls = live_state(s, FleetState()); ls.method_for("code"), ls.method_for("code", "canary")
    ('ngram', 'none')
    """
    stable = effective_spec(spec, "stable", state)
    routing = stable.get("routing") or {}
    k = {role: k_bounds(spec, state, role) for role in (ROLES if spec.get("canary") else ("stable",))}
    pins = dict(routing.get("byPromptType", {}))
    selects = selects_methods(spec, state)
    chosen = state.methods if selects else {}
    table = Routing(routing.get("default", stable["draft"]["method"]),
                    {**{t: m for t, m in chosen.items() if t not in pins}, **pins})
    arms = {}
    if spec.get("canary"):  # a canary that tries another method gets a table of its own
        canary = effective_spec(spec, "canary", state)
        own = canary.get("routing") or {}
        own_pins, serves = dict(own.get("byPromptType", {})), served_methods(spec, "canary", state)
        canary_table = Routing(own.get("default", canary["draft"]["method"]),  # the loop's choices it can serve
                               {**{t: m for t, m in chosen.items() if t not in own_pins and m in serves}, **own_pins})
        if canary_table != table:
            arms["canary"] = canary_table
    return LiveState(version=version, canary_weight=round(float(canary_weight(spec, state)), 2),
                     default_method=table.default_method, routes=table.routes, fallback=tuple(state.fallback),
                     speculate=speculates(spec, state), k=k, updated=updated, arms=arms,
                     probe_share=probe_share(spec),
                     fallback_clusters=tuple(state.fallback_clusters), mirror_share=state.mirror_share,
                     drift_epoch=state.drift_epoch, explore_share=explore_share(spec, state),
                     candidates=served_methods(spec, "stable", state) if selects else (),
                     pinned=tuple(sorted(pins)) if selects else (),
                     k_ceilings={t: kc for t, kc in sorted(state.k_ceilings.items()) if kc < k["stable"].k_max},
                     cluster_routes=dict(sorted(state.cluster_methods.items())) if selects else {})
