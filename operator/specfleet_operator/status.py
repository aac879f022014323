"""One pure function from what the operator observed to the SpecDecodeDeployment status.

Conditions follow the Kubernetes convention (type, status, reason, message, observedGeneration,
lastTransitionTime); a condition keeps its lastTransitionTime while its status does not change.
Reconciling and Stalled follow kstatus (abnormal-true: True says the fleet is not yet, or cannot
become, what its spec asks), so `kstatus`-aware tools (Flux, Argo CD, cli-utils) read them as they do
a built-in kind's; Ready's reason is the `Reason` column of `kubectl get sdd`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Sequence

from specfleet_api.fleet_spec import FleetState

from .spec import Problem, rejection_reason

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Speculating", "CanaryProgressing", "Reconciling", "Stalled",
                   "PromotedNotInSpec")
#: The reason of Ready (and Degraded) while a child's name is taken by an object another owner controls.
OWNED_BY_ANOTHER = "ChildOwnedByAnother"


@dataclasses.dataclass(frozen=True)
class Workers:
    """An arm's serving Deployments as observed (its worker Deployment, or its vLLM pools' as one):
    desired replicas and how many are ready / updated."""

    desired: int
    ready: int = 0
    updated: int = 0
    current: bool = True  # the Deployment controller has seen its latest generation

    @classmethod
    def from_deployment(cls, body: dict[str, Any] | None, desired: int | None = None) -> Workers | None:
        if body is None:
            return None
        spec, status = body.get("spec", {}), body.get("status", {})
        want = spec.get("replicas", 1) if desired is None else desired
        generation = body.get("metadata", {}).get("generation")
        return cls(desired=want, ready=status.get("readyReplicas", 0), updated=status.get("updatedReplicas", 0),
                   current=generation is None or status.get("observedGeneration") == generation)

    @classmethod
    def of(cls, parts: Sequence[tuple[dict[str, Any] | None, int | None]] | None) -> Workers | None:
        """An arm's serving Deployments (manifests.serving_deployments: each as read, None when not
        there, with the replicas the spec asks of it) as one: None while one of them is missing (being
        created). Of several, each counts its ready and updated pods up to what it wants, so that a
        pool's surge pod never stands in for another pool's missing one: the arm has rolled out when
        every one of them has.

        >>> pool = lambda want, ready: {"spec": {"replicas": want}, "status": {"readyReplicas": ready,
        ...                                                                   "updatedReplicas": ready}}
        >>> Workers.of([(pool(2, 3), 2), (pool(2, 1), 2)])
        Workers(desired=4, ready=3, updated=3, current=True)
        >>> Workers.of([(pool(2, 2), 2), (None, 1)]) is None, Workers.of([(pool(2, 3), None)]).ready
        (True, 3)
        """
        if not parts or any(body is None for body, _ in parts):
            return None
        each = [cls.from_deployment(body, want) for body, want in parts]
        if len(each) == 1:
            return each[0]
        return cls(desired=sum(w.desired for w in each), ready=sum(min(w.ready, w.desired) for w in each),
                   updated=sum(min(w.updated, w.desired) for w in each), current=all(w.current for w in each))

    @property
    def rolled_out(self) -> bool:
        return self.current and self.updated >= self.desired and self.ready >= self.desired


@dataclasses.dataclass(frozen=True)
class Observed:
    generation: int | None
    problems: tuple[Problem, ...] = ()
    # the generation whose children were all applied (None: unknown, e.g. after a restart): under
    # `generation`, the workers observed are an older spec's, not yet this one's
    applied_generation: int | None = None
    apply_error: str | None = None
    # children left alone because another owner controls them (kube.OwnedByAnother, in words)
    conflicts: tuple[str, ...] = ()
    stable: Workers | None = None
    canary: Workers | None = None
    router: Workers | None = None  # the router Deployment; None: not created yet
    state: FleetState = FleetState()
    draft_method: str = "ngram"
    k_bounds: tuple[int, int] | None = None  # the stable arm's in force (fleet_spec.k_bounds)
    config_hash: str | None = None
    alpha: float | None = None
    mean_accepted_length: float | None = None
    speedup: float | None = None
    canary_step: int = 0
    failed_checks: int = 0
    fallback_since: str | None = None
    last_analysis: str | None = None
    # the canary run's section as specfleet_control.canary.CanaryState.to_status() writes it; None:
    # built from the fields above
    canary_status: dict[str, Any] | None = None
    # what the last try to reach the fleet's Redis met (redis_state.Health: ok, reason, message);
    # None: the fleet keeps no live state in Redis, and the status has no RedisReady
    redis: Any = None
    # pods of the fleet that Redis refuses (redis_state.AuthFailures, in words); None: none seen
    pods_auth: str | None = None
    # what the stable workers run that the spec does not say (fleet_spec.not_in_spec): field -> value
    not_in_spec: dict[str, Any] = dataclasses.field(default_factory=dict)
    # what serves the requests, as the conditions' messages name it: the workers, or vLLM servers
    servers: str = "workers"


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int | None,
               previous: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = previous.get(ctype)
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    cond = {"type": ctype, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def compute(observed: Observed, previous: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """The whole status for `observed`; `previous` is the current status (for transition times)."""
    prev = {c["type"]: c for c in (previous or {}).get("conditions", []) if "type" in c}
    gen, o = observed.generation, observed
    stable, canary = o.stable, o.canary
    invalid = "; ".join(str(p) for p in o.problems)
    rejected = rejection_reason(o.problems)  # InvalidSpec, or Unsupported: reserved, not served yet

    pending = o.applied_generation is not None and gen is not None and o.applied_generation < gen
    taken = "; ".join(o.conflicts)
    if invalid:
        ready = (False, rejected, invalid)
    elif taken:
        ready = (False, OWNED_BY_ANOTHER, taken)
    elif o.apply_error:
        ready = (False, "ApplyFailed", o.apply_error)
    elif stable is None:
        ready = (False, "Creating", f"the stable {o.servers} are being created")
    elif pending:
        ready = (False, "Reconciling", f"generation {gen}'s children are being applied "
                 f"(the last applied in full: {o.applied_generation})")
    elif stable.desired == 0:
        ready = (False, "ScaledToZero", f"spec asks for 0 {o.servers}")
    elif not (stable.rolled_out and (canary is None or canary.rolled_out)):
        ready = (False, "WorkersNotReady", f"{stable.ready}/{stable.desired} stable {o.servers} ready")
    elif o.router is None:
        ready = (False, "RouterNotReady", "the router is being created")
    elif not o.router.rolled_out:
        ready = (False, "RouterNotReady", f"{o.router.ready}/{o.router.desired} router pods ready")
    else:
        ready = (True, "WorkersReady", f"{stable.ready}/{stable.desired} stable {o.servers} ready, "
                 f"{o.router.ready} router pods ready")

    rolling = not invalid and stable is not None and (pending or not (
        stable.rolled_out and (canary is None or canary.rolled_out) and (o.router is None or o.router.rolled_out)))
    progressing = (True, "RollingOut", f"{o.servers} are being rolled out") if rolling else \
        (False, "RolloutComplete" if not invalid else rejected, "no rollout in progress")

    redis_down = not invalid and o.redis is not None and not o.redis.ok
    if invalid or o.apply_error:
        degraded = (True, rejected if invalid else "ApplyFailed", invalid or o.apply_error or "")
    elif taken:
        degraded = (True, OWNED_BY_ANOTHER, taken)
    elif redis_down:  # the routers and workers serve on the last state they read (fail static)
        degraded = (True, f"Redis{o.redis.reason}", "the live state cannot be written to Redis: routers and "
                    "workers serve on the last state they read, and the loop decides nothing on missing windows "
                    "(see RedisReady)")
    elif o.pods_auth and not invalid:  # they serve on their last state, and write no windows
        degraded = (True, "PodsRedisAuthFailed", o.pods_auth)
    elif o.state.mode == "fallback":
        degraded = (True, "Fallback", "the alpha SLO was missed: workers decode without speculation")
    else:
        degraded = (False, "AsExpected", "")

    if invalid:
        speculating = (False, rejected, "no workers run this spec (see Ready)")
    elif o.draft_method == "none":
        speculating = (False, "DraftMethodNone", "draft.method is none")
    elif o.state.mode == "fallback":
        speculating = (False, "Fallback", "speculation is off until the SLO recovers")
    else:
        speculating = (True, "SpeculationOn", f"draft method {o.draft_method}")

    # kstatus: Stalled when no retry alone gets the fleet further (a person must act); else
    # Reconciling while what runs is not yet what the spec (this generation) asks
    if invalid:
        stalled = (True, rejected, invalid)
    elif taken:
        stalled = (True, OWNED_BY_ANOTHER, taken)
    elif o.apply_error:
        stalled = (True, "ApplyFailed", o.apply_error)
    elif redis_down:
        stalled = (True, f"Redis{o.redis.reason}", f"the live state cannot be written to Redis: {o.redis.message}")
    else:
        stalled = (False, "AsExpected", "")
    if not stalled[0] and (stable is None or rolling or (not ready[0] and ready[1] == "RouterNotReady")):
        reconciling = (True, ready[1], ready[2])
    else:
        reconciling = (False, "Reconciled" if not stalled[0] else "Stalled",
                       "the children are what the spec asks" if not stalled[0] else "see Stalled")

    if o.not_in_spec:
        said = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(o.not_in_spec.items()))
        drift = (True, "PromotedOverridesNotInSpec", f"the stable workers run {said}, promoted from the canary "
                 "(status.canary.promoted), which the spec does not hold: fold them into the spec, or set "
                 "those fields otherwise (docs/canary.md)")
    else:
        said = ""
        drift = (False, "SpecHoldsWhatRuns", "the stable workers run what the spec says")

    section = _canary_section(o, previous)
    phase = section["phase"]
    canary_msg = section.get("message") or _CANARY_MESSAGES.get(phase, phase)
    canary_cond = (phase in _LIVE_PHASES, f"Canary{phase}", canary_msg)

    conds = [_condition(t, *c, gen, prev, now) for t, c in zip(
        CONDITION_TYPES, (ready, progressing, degraded, speculating, canary_cond, reconciling, stalled, drift))]
    if invalid and prev.get("PromotedNotInSpec") is not None:  # as RedisReady: what was last known stays
        conds = [prev["PromotedNotInSpec"] if c["type"] == "PromotedNotInSpec" else c for c in conds]
        said = (previous or {}).get("notInSpec", "")
    if o.redis is not None and not invalid:
        conds.append(_condition("RedisReady", o.redis.ok, o.redis.reason, o.redis.message, gen, prev, now))
    elif prev.get("RedisReady") is not None:
        conds.append(prev["RedisReady"])  # an invalid spec writes nothing: what was last known stays
    # an invalid spec stops the loop, not its memory: the mode (and the canary run) stay as they were
    mode = (previous or {}).get("mode", o.state.mode) if invalid else o.state.mode
    status: dict[str, Any] = {"conditions": conds, "mode": mode}
    if said:
        status["notInSpec"] = said  # the Not-In-Spec column of `kubectl get sdd`
    if gen is not None:
        status["observedGeneration"] = gen
    for key, value in (("alpha", o.alpha), ("meanAcceptedLength", o.mean_accepted_length),
                       ("speedup", o.speedup), ("configHash", o.config_hash), ("fallbackSince", o.fallback_since)):
        if value is not None:
            status[key] = value
    if o.k_bounds is not None:
        status["kBounds"] = {"min": o.k_bounds[0], "max": o.k_bounds[1]}
        status["kRange"] = f"{o.k_bounds[0]}-{o.k_bounds[1]}"
    if stable is not None:
        status["replicas"] = {"desired": stable.desired + (canary.desired if canary else 0),
                              "ready": stable.ready + (canary.ready if canary else 0)}
    if o.router is not None:
        status["router"] = {"desired": o.router.desired, "ready": o.router.ready}
    status["canary"] = section
    return status


_LIVE_PHASES = ("Waiting", "Progressing", "Paused")
_CANARY_MESSAGES = {"Idle": "no canary", "Waiting": "waiting for the canary workers to be ready",
                    "Progressing": "the canary is being analysed", "Paused": "the canary is paused",
                    "Promoted": "the canary was promoted", "Aborted": "the canary failed its analysis"}


def _canary_section(o: Observed, previous: dict[str, Any] | None) -> dict[str, Any]:
    if o.problems and (previous or {}).get("canary") is not None:
        return copy.deepcopy(previous["canary"])  # as the mode: the run waits for a valid spec
    if o.canary_status is not None:
        return copy.deepcopy(o.canary_status)
    out = {"weight": o.state.canary_weight or 0, "step": o.canary_step, "phase": o.state.canary_phase,
           "failedChecks": o.failed_checks}
    if o.last_analysis:
        out["lastAnalysis"] = o.last_analysis
    return out


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c.get("type") == ctype), None)
