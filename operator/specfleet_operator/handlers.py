"""kopf handlers: thin glue between the Kubernetes events and the pure modules.

create / update / resume -> reconcile (apply every child, delete the ones no longer wanted,
write the status, then the live state in Redis); worker, vLLM pool and router Deployment events ->
refresh the owner's status; a daemon per resource runs the control loop (specfleet_control: the SLO loop and
the canary analysis, docs/control-loop.md); delete -> delete
what this resource owns. Clients and sources come in through kopf's memo, so tests swap them
without patching.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import time
from typing import Any, Sequence

import kopf

from specfleet_api import fleet_spec, vllm
from specfleet_api.windows import Window, sum_windows
from specfleet_control import canary as canaries
from specfleet_control import fleet as control_fleet
from specfleet_control import loop as slo_loop
from specfleet_control.kbounds import KTuning
from specfleet_control.methods import Selection
from specfleet_control.observe import Observation
from specfleet_control.slo import FALLBACK, SloPolicy

from . import API_VERSION, GROUP, KIND, PLURAL, VERSION
from . import manifests, metrics, redis_state
from . import spec as specs
from . import status as statuses
from .kube import ApiError, Kube, OwnedByAnother

SDD = (GROUP, VERSION, PLURAL)
FLEET_LABELS = {"app.kubernetes.io/managed-by": manifests.MANAGED_BY}  # worker and router Deployments
OPTIONAL_KINDS = {"ServiceMonitor": "observability.serviceMonitor", "PrometheusRule": "observability.prometheusRule",
                  "HorizontalPodAutoscaler": "scaling"}
#: The operator install a fleet belongs to (`main.Options.instance`: its Lease's namespace/name, one
#: per chart release): written by the first install to reconcile it; every other install leaves the
#: fleet alone while it names another.
CLAIM_ANNOTATION = f"{GROUP}/operator"
CLAIMED_ELSEWHERE = "ClaimedByAnotherOperator"
WARNING_REASONS = {CLAIMED_ELSEWHERE, "FallbackEntered", "CanaryAborted", "CanaryCheckFailed", "CanaryGateInvalid",
                   "CanaryAnalysisHalted", "InvalidSpec", "Unsupported", "ApplyFailed", "NoDecision",
                   "RedisUnavailable", statuses.OWNED_BY_ANOTHER}


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(text: str | None) -> float | None:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None


def canary_state(status: dict[str, Any]) -> canaries.CanaryState:
    """The canary analysis' memory, kept in status.canary."""
    return canaries.CanaryState.from_status(status.get("canary"))


def memory_of(status: dict[str, Any]) -> slo_loop.Memory:
    """The SLO loop's memory, kept in status.slo."""
    return slo_loop.Memory.from_status(status.get("slo"))


def fleet_state(cstate: canaries.CanaryState, spec: dict[str, Any], memory: slo_loop.Memory | None = None
                ) -> fleet_spec.FleetState:
    """What shapes the children and the live state (specfleet_control.fleet.fleet_state)."""
    return control_fleet.fleet_state(memory, cstate, spec)


Arm = Sequence[tuple[dict[str, Any] | None, int | None]]  # an arm's serving Deployments: (as read, replicas wanted)


def _observed(body: Any, spec: dict[str, Any], cstate: canaries.CanaryState, stable: Arm | None,
              canary: Arm | None, errors: list[str], window: Window | None = None,
              router: dict[str, Any] | None = None, memory: slo_loop.Memory | None = None) -> statuses.Observed:
    """What the status is computed from; `stable`, `canary`: each arm's serving Deployments
    (_serving), None when not read."""
    prev = body.get("status") or {}
    memory = memory or memory_of(prev)
    fleet = fleet_state(cstate, spec, memory)
    whole = memory.keys.get(slo_loop.DEPLOYMENT)
    _, canary_n = fleet_spec.replica_counts(spec, fleet)
    w = window
    first = (stable or [(None, None)])[0][0] or {}  # the worker Deployment's hash (a vLLM pool has none)
    live_hash = (first.get("spec", {}).get("template", {}).get("metadata", {})
                 .get("annotations", {}).get(manifests.ANNOTATION_CONFIG_HASH))
    k = fleet_spec.k_bounds(spec, fleet)
    return statuses.Observed(
        generation=body.get("metadata", {}).get("generation"),
        apply_error="; ".join(errors) or None,
        stable=statuses.Workers.of(stable),
        canary=statuses.Workers.of(canary) if canary_n else None,
        servers="vLLM servers" if vllm.engine(spec) == vllm.VLLM else "workers",
        router=statuses.Workers.from_deployment(router, (spec.get("router") or {}).get("replicas", 2)),
        state=fleet, draft_method=fleet_spec.effective_spec(spec, "stable", fleet)["draft"]["method"],
        k_bounds=(k.k_min, k.k_max),
        config_hash=live_hash or prev.get("configHash"),
        alpha=_round(w.alpha) if w and w.alpha is not None else prev.get("alpha"),
        mean_accepted_length=_round(w.tau) if w and w.tau is not None else prev.get("meanAcceptedLength"),
        speedup=_round(w.speedup) if w and w.speedup is not None else prev.get("speedup"),
        fallback_since=_iso(whole.since) if whole is not None and whole.mode == FALLBACK else None,
        canary_status=cstate.to_status(), not_in_spec=fleet_spec.not_in_spec(spec, fleet))


def _round(x: float) -> float:
    return round(x, 4)


def _status(observed: statuses.Observed, body: Any, memory: slo_loop.Memory) -> dict[str, Any]:
    prev = body.get("status") or {}
    now = _iso(time.time())
    out = statuses.compute(observed, prev, now)
    out["slo"] = memory.to_status()
    out["fallback"] = {"promptTypes": list(memory.fallback_types()), "clusters": list(memory.fallback_clusters())}
    chosen = memory.chosen_methods()  # a merge patch: a type no longer chosen for is dropped by None
    out["methods"] = {**{t: None for t in prev.get("methods") or {} if t not in chosen}, **chosen} or None
    ceilings = memory.k_ceilings()
    out["kCeilings"] = {**{t: None for t in prev.get("kCeilings") or {} if t not in ceilings}, **ceilings} or None
    clusters = memory.cluster_routes()
    out["clusterMethods"] = {**{c: None for c in prev.get("clusterMethods") or {} if c not in clusters},
                             **clusters} or None
    for key in ("fallbackSince", "notInSpec"):
        if key not in out and prev.get(key):
            out[key] = None  # merge patch: drop the key
    return out


def _changed(prev: dict[str, Any], new: dict[str, Any]) -> bool:
    return any(prev.get(k) != v for k, v in new.items())


def _event(body: Any, reason: str, message: str) -> None:
    kopf.event(body, type="Warning" if reason in WARNING_REASONS else "Normal", reason=reason, message=message)


async def _apply_children(body: Any, spec: dict[str, Any], fleet: fleet_spec.FleetState, memo: Any,
                          taken: list[str] | None = None
                          ) -> tuple[dict[tuple[str, str], tuple[str, dict[str, Any]]], list[str]]:
    """Apply every child; `taken`: what is already known to be held by another owner (the
    credentials' handle or Secret), reported with what this finds."""
    kube: Kube = memo.kube
    desired = manifests.children(body, spec, memo.settings, fleet, credentials_name(memo, body, spec))
    kopf.adopt(desired, owner=body)
    results: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    errors: list[str] = []
    taken = list(taken or [])
    predecessors = manifests.legacy_predecessors(body["metadata"]["name"])
    for obj in desired:
        key = (obj["kind"], obj["metadata"]["name"])
        try:
            if key in predecessors:  # its old-named twin goes first (manifests.RETIRED_FIRST says why)
                await retire_legacy_children(memo, body, [predecessors[key]])
            results[key] = await kube.apply(obj)
        except OwnedByAnother as exc:
            taken.append(str(exc))
        except ApiError as exc:
            if exc.status == 404 and obj["kind"] in OPTIONAL_KINDS:
                errors.append(f"{obj['apiVersion']} {obj['kind']} is not served by this cluster: install it "
                              f"(e.g. prometheus-operator) or turn off spec.{OPTIONAL_KINDS[obj['kind']]}")
            elif exc.status in (400, 403, 404, 422):
                errors.append(str(exc))  # needs a spec or RBAC change, not a retry
            else:
                raise kopf.TemporaryError(str(exc), delay=10) from exc
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
    uid = body.get("metadata", {}).get("uid")
    for api_version, kind, name in manifests.child_refs(body["metadata"]["name"]):
        if (kind, name) in wanted:
            continue
        live = await kube.get(api_version, kind, body["metadata"]["namespace"], name)
        if live and _owned(live, uid):
            await kube.delete(api_version, kind, body["metadata"]["namespace"], name)
            _event(body, "Removed", f"removed {kind} {name}, no longer in the spec")
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    if tuple(taken) != child_conflicts(memo).get(key, ()):
        if taken:  # one event per new set of children held by another owner, not one per reconcile
            _event(body, statuses.OWNED_BY_ANOTHER, "; ".join(taken))
        child_conflicts(memo)[key] = tuple(taken)
    return results, errors


def _owned(obj: dict[str, Any], uid: str | None) -> bool:
    return any(ref.get("uid") == uid and ref.get("kind") == KIND
               for ref in obj.get("metadata", {}).get("ownerReferences", []))


SHARED_MEMO = ("reconcile_locks", "status_locks", "applied_generations", "redis_secrets", "child_conflicts",
               "legacy_retired", "claims_elsewhere", "applied_credentials", "credentials_pending",
               "credentials_retired")  # created at startup: see there


def instance(memo: Any) -> str:
    """This operator install's name in CLAIM_ANNOTATION."""
    return memo.get("instance") or "specfleet-operator"


def unclaimed(body: Any) -> bool:
    """Whether no operator install has claimed the fleet (CLAIM_ANNOTATION)."""
    return not ((body.get("metadata") or {}).get("annotations") or {}).get(CLAIM_ANNOTATION)


def elsewhere(memo: Any, body: Any) -> str | None:
    """The operator install that claimed this fleet, when it is another than this one."""
    owner = ((body.get("metadata") or {}).get("annotations") or {}).get(CLAIM_ANNOTATION) or None
    return owner if owner is not None and owner != instance(memo) else None


async def claim(memo: Any, body: Any) -> bool:
    """Whether this install may act on the fleet: it holds the claim, or takes it now (a patch
    conditional on the resourceVersion, so two installs cannot both take it). A fleet claimed by
    another install: one Warning Event per install and claimant, and False."""
    meta = body["metadata"]
    owner = (meta.get("annotations") or {}).get(CLAIM_ANNOTATION) or None
    if owner == instance(memo):
        return True
    key = (meta["namespace"], meta["name"])
    if owner is not None:
        if memo.setdefault("claims_elsewhere", {}).get(key) != owner:
            memo.claims_elsewhere[key] = owner
            _event(body, CLAIMED_ELSEWHERE, f"reconciled by the operator install {owner}; this one "
                   f"({instance(memo)}) leaves it alone. To hand it over, remove the annotation "
                   f"{CLAIM_ANNOTATION} (or set it to {instance(memo)})")
        return False
    try:
        await memo.kube.patch(API_VERSION, KIND, meta["namespace"], meta["name"], {"metadata": {
            "resourceVersion": meta.get("resourceVersion"), "annotations": {CLAIM_ANNOTATION: instance(memo)}}})
    except ApiError as exc:
        if exc.status == 409:  # written since this body was read, perhaps claimed: judge again
            raise kopf.TemporaryError("the fleet changed while being claimed: trying again", delay=1) from exc
        raise
    memo.setdefault("claims_elsewhere", {}).pop(key, None)
    _event(body, "Claimed", f"reconciled by the operator install {instance(memo)}")
    return True


def reconcile_lock(memo: Any, namespace: str, name: str) -> asyncio.Lock:
    """Held by each reconcile of one resource, so that children are applied from one state at a time."""
    return memo.setdefault("reconcile_locks", {}).setdefault((namespace, name), asyncio.Lock())


async def reconcile(body: Any, memo: Any, cstate: canaries.CanaryState | None = None,
                    window: Window | None = None, memory: slo_loop.Memory | None = None, *,
                    locked: bool = False) -> None:
    """Make the children match the spec, then write the status from what is live. `locked`: the
    caller holds reconcile_lock."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if not locked:
        lock = reconcile_lock(memo, ns, name)
        metrics.RECONCILES_WAITING.inc()  # the queue: reconciles waiting on a fleet's lock
        try:
            await lock.acquire()
        finally:
            metrics.RECONCILES_WAITING.dec()
        start = time.perf_counter()
        try:
            return await reconcile(body, memo, cstate, window, memory, locked=True)
        except BaseException:
            metrics.RECONCILE_ERRORS.labels("exception").inc()
            raise
        finally:
            lock.release()
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - start)
    if not await claim(memo, body):
        return
    spec = specs.with_defaults(dict(body.get("spec") or {}))
    problems = specs.problems(spec)
    prev = body.get("status") or {}
    cstate = cstate or canary_state(prev)
    memory = memory or memory_of(prev)
    if not problems:
        try:
            manifests.children(body, spec, memo.settings, fleet_state(cstate, spec, memory),
                               credentials_name(memo, body, spec))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            problems = [specs.Problem("spec", f"cannot build the workers from this spec: {exc!r}")]
    if problems:  # no child is created: nothing a worker would refuse reaches a pod
        _event(body, specs.rejection_reason(problems), "; ".join(str(p) for p in problems))
        await write_status(memo, ns, name, problems=problems)
        return
    refresh_default_redis(memo)
    secret = await _fleet_credentials(body, spec, memo)
    pending = memo.setdefault("credentials_pending", {})  # converge tries again while it is not in place
    if secret.taken or secret.error:
        pending[(ns, name)] = secret.taken or secret.error
    else:
        pending.pop((ns, name), None)
    results, errors = await _apply_children(body, spec, fleet_state(cstate, spec, memory), memo,
                                            [secret.taken] if secret.taken else [])
    errors = [secret.error, *errors] if secret.error else errors
    if errors:
        metrics.RECONCILE_ERRORS.labels("apply").inc(len(errors))
    applied_generations(memo)[(ns, name)] = body.get("metadata", {}).get("generation")
    memo.setdefault("applied_credentials", {})[(ns, name)] = credentials_name(memo, body, spec)
    created = [f"{kind} {n}" for (kind, n), (action, _) in results.items() if action == "created"]
    if created:
        _event(body, "Created", "created " + ", ".join(created))
    if errors:
        _event(body, "ApplyFailed", "; ".join(errors))
    await write_status(memo, ns, name, cstate=cstate, window=window, errors=errors, memory=memory)


def applied_generations(memo: Any) -> dict[tuple[str, str], int | None]:
    """(namespace, name) -> the generation whose children this operator last applied, every one
    of them. Unknown (no entry) after a restart, until the resume handler's reconcile."""
    return memo.setdefault("applied_generations", {})


def child_conflicts(memo: Any) -> dict[tuple[str, str], tuple[str, ...]]:
    """(namespace, name) -> the children the last reconcile left alone because another owner
    controls them (kube.OwnedByAnother, in words): the status says so until they are free."""
    return memo.setdefault("child_conflicts", {})


async def retire_legacy_children(memo: Any, sdd: dict[str, Any],
                                  refs: Sequence[tuple[str, str, str]] | None = None) -> None:
    """Delete the children this resource owns under the names of an older operator
    (manifests.legacy_child_refs), once per resource and operator process. Called when the
    fleet is Ready under the current names, so the old workers and router serve until then;
    `refs`: only these, now (a predecessor of manifests.RETIRED_FIRST, before its successor)."""
    meta = sdd["metadata"]
    key = (meta["namespace"], meta["name"], meta.get("uid"))
    done = memo.setdefault("legacy_retired", {})
    if done.get(key):
        return
    removed = []
    for api_version, kind, child in manifests.legacy_child_refs(meta["name"]) if refs is None else refs:
        live = await memo.kube.get(api_version, kind, meta["namespace"], child)
        if live and _owned(live, meta.get("uid")):
            await memo.kube.delete(api_version, kind, meta["namespace"], child)
            removed.append(f"{kind} {child}")
    if removed and refs is not None:
        _event(sdd, "Removed", f"removed {', '.join(removed)} (an older operator's name) before its successor "
               "over the same pods: Kubernetes evicts no pod that two PodDisruptionBudgets cover")
    elif removed:
        _event(sdd, "Removed", "removed the children named as before the upgrade: " + ", ".join(removed))
    if refs is None:
        done[key] = True


async def refresh_status(memo: Any, namespace: str, name: str, **kwargs: Any) -> dict[str, Any] | None:
    """`write_status` from outside a reconcile: after the one in flight, if any, so that a status
    is never computed from a fleet half applied (Ready with the last children still to come)."""
    async with reconcile_lock(memo, namespace, name):
        return await write_status(memo, namespace, name, **kwargs)


def _lock(memo: Any, namespace: str, name: str) -> asyncio.Lock:
    locks = memo.setdefault("status_locks", {})
    return locks.setdefault((namespace, name), asyncio.Lock())


async def write_status(memo: Any, namespace: str, name: str, *, cstate: canaries.CanaryState | None = None,
                       window: Window | None = None, errors: Sequence[str] = (),
                       problems: Sequence[specs.Problem] = (),
                       memory: slo_loop.Memory | None = None) -> dict[str, Any] | None:
    """Read the resource and its workers, compute the status, write it if it changed, and the
    live state derived from them to Redis (when the fleet has one).

    Every status write of this operator goes through here, one at a time per resource, and reads
    what is live inside the lock: so the last write always reflects the latest observation.
    """
    kube: Kube = memo.kube
    async with _lock(memo, namespace, name):
        sdd = await kube.get(API_VERSION, KIND, namespace, name)
        if sdd is None or sdd["metadata"].get("deletionTimestamp") or elsewhere(memo, sdd):
            return None
        prev = sdd.get("status") or {}
        spec = specs.with_defaults(sdd.get("spec") or {})
        problems = list(problems) or specs.problems(spec)
        fleet = None
        if problems:
            observed = statuses.Observed(generation=sdd["metadata"].get("generation"), problems=tuple(problems))
            new = statuses.compute(observed, prev, _iso(time.time()))
        else:
            cstate = cstate or canary_state(prev)
            memory = memory or memory_of(prev)
            fleet = fleet_state(cstate, spec, memory)
            serving = await _serving(kube, namespace, name, spec, fleet)
            stable, canary = _arm(serving, "stable"), _arm(serving, "canary") if spec.get("canary") else None
            router = await kube.get("apps/v1", "Deployment", namespace, manifests.router_name(name))
            applied = applied_generations(memo).get((namespace, name), sdd["metadata"].get("generation"))
            # before the status, inside the lock: writes reach Redis in the order of the states they
            # carry, and the status says what this write met (a Redis away costs its timeout here)
            health = await publish_live_state(memo, sdd, spec, fleet)
            refused = await pods_refused(memo, sdd, spec)
            observed = _observed(sdd, spec, cstate, stable, canary, list(errors), window, router, memory)
            new = _status(dataclasses.replace(observed, applied_generation=applied, redis=health, pods_auth=refused,
                                              conflicts=child_conflicts(memo).get((namespace, name), ())),
                          sdd, memory)
            _redis_event(sdd, prev, new)
            if prev.get("configHash") and new.get("configHash") and prev["configHash"] != new["configHash"]:
                _event(sdd, "Rolled", f"rolling the stable workers: config {prev['configHash']} -> {new['configHash']}")
        if _changed(prev, new):
            await kube.patch(API_VERSION, KIND, namespace, name, {"status": new}, subresource="status")
        metrics.export_state(namespace, name, new)
        ready = statuses.condition(new, "Ready")
        if fleet is not None and ready is not None and ready["status"] == "True":
            await retire_legacy_children(memo, sdd)
            holders = [d for s, d in serving if s.redis]  # the workers; no vLLM server holds credentials
            await retire_credentials(memo, sdd, spec, [d for d in (*holders, router) if d is not None])
        return new


async def _serving(kube: Kube, namespace: str, name: str, spec: dict[str, Any], fleet: fleet_spec.FleetState
                   ) -> list[tuple[manifests.Serving, dict[str, Any] | None]]:
    """The fleet's serving Deployments (manifests.serving_deployments, either engine's), each as
    read now (None: not there)."""
    return [(s, await kube.get("apps/v1", "Deployment", namespace, s.name))
            for s in manifests.serving_deployments(name, spec, fleet)]


def _arm(serving: Sequence[tuple[manifests.Serving, dict[str, Any] | None]], role: str) -> Arm:
    """One arm's part of _serving as _observed reads it: (Deployment as read, replicas wanted)."""
    return [(d, s.replicas) for s, d in serving if s.role == role]


def _pods_use(deployment: dict[str, Any], secret: str) -> bool:
    """Whether every pod of the Deployment runs a template that takes its Redis user from `secret`."""
    template = (deployment.get("spec") or {}).get("template") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    refs = {(env.get("valueFrom") or {}).get("secretKeyRef", {}).get("name")
            for c in containers for env in c.get("env") or []}
    status = deployment.get("status") or {}
    return secret in refs and status.get("replicas", 0) <= status.get("updatedReplicas", 0)


async def retire_credentials(memo: Any, sdd: dict[str, Any], spec: dict[str, Any],
                             deployments: list[dict[str, Any]]) -> None:
    """Once every pod of the fleet holds its current credentials: drop the user's other passwords
    in Redis and delete the other credentials' handles (garbage collection takes their Secrets)."""
    current = credentials_name(memo, sdd, spec)
    key = (sdd["metadata"]["namespace"], sdd["metadata"]["name"])
    done = memo.setdefault("credentials_retired", {})  # once per process and credentials
    if current is None or done.get(key) == current:
        return
    if not deployments or not all(_pods_use(d, current) for d in deployments):
        return
    target, _ = await redis_target(memo, sdd, spec)
    store = memo.get("live_state")
    if target is not None and store is not None:
        if await store.retire_passwords(target, *key) is None:
            return  # Redis away: the next status write tries again
    try:
        gone = await redis_state.retire_credentials(memo.kube, sdd, current)
    except ApiError as exc:
        kopf.warn(sdd, reason="ApplyFailed", message=f"cannot remove the fleet's old Redis credentials: {exc}")
        return
    done[key] = current
    if gone:
        _event(sdd, "Removed", "removed the fleet's old Redis credentials (every pod holds the current ones): "
               + ", ".join(f"ConfigMap {n} and its Secret" for n in gone))


async def pods_refused(memo: Any, sdd: Any, spec: dict[str, Any]) -> str | None:
    """What Redis says of the fleet's pods' logins, when it refused some lately (Degraded says it,
    the metric counts them); None when none, or unknown (a fleet without its own user)."""
    store = memo.get("live_state")
    ns, name = sdd["metadata"]["namespace"], sdd["metadata"]["name"]
    user = fleet_user(memo, sdd, spec)
    if store is None or user is None:
        metrics.export_auth_failures(ns, name, None)
        return None
    target, _ = await redis_target(memo, sdd, spec)
    seen = await store.auth_failures(target) if target is not None else None
    metrics.export_auth_failures(ns, name, seen.count if seen is not None else None)
    if seen is None or not seen.count:
        return None
    return (f"Redis refused {seen.count} logins as the fleet's user {user[0]} in the last "
            f"{store.auth_window_s:g}s (from {', '.join(seen.addresses)}): those pods hold "
            f"credentials that are not the fleet's current ones (Secret {credentials_name(memo, sdd, spec)}); "
            "they serve on their last state and publish no windows until they restart with it")


async def redis_target(memo: Any, sdd: Any, spec: dict[str, Any]
                       ) -> tuple[redis_state.Target | None, redis_state.Health | None]:
    """Where the fleet's live state and windows are, as the operator reaches them; (None, why) when
    it cannot (a secretRef it may not read), (None, None) for a fleet without Redis."""
    return await redis_state.resolve(memo.kube, memo.settings, memo.get("default_redis"), sdd, spec)


def default_redis(memo: Any) -> redis_state.DefaultRedis | None:
    """The install's default Redis, its admin password as last read (`refresh_default_redis`)."""
    return memo.get("default_redis") if hasattr(memo, "get") else None


def refresh_default_redis(memo: Any) -> bool:
    """Read the default Redis' password file again (a rotated Secret); whether it changed."""
    default = default_redis(memo)
    return default is not None and default.refresh()


def fleet_user(memo: Any, sdd: Any, spec: dict[str, Any]) -> tuple[str, str] | None:
    """(username, password) of the fleet's own user in the default Redis; None for a fleet with
    spec.redis, or without a default Redis with a password."""
    default = default_redis(memo)
    if spec.get("redis") or default is None or not memo.settings.default_redis_url:
        return None
    meta = sdd["metadata"]
    return redis_state.default_target(default, meta["namespace"], meta["name"], meta.get("uid", "")).fleet_user


def credentials_name(memo: Any, sdd: Any, spec: dict[str, Any]) -> str | None:
    """The Secret the fleet's pods take their Redis user from (None: they need none)."""
    user = fleet_user(memo, sdd, spec)
    return redis_state.credentials_name(sdd["metadata"]["name"], *user) if user else None


async def _fleet_credentials(body: Any, spec: dict[str, Any], memo: Any) -> redis_state.CredentialsResult:
    """Create the Secret with the fleet's own Redis user (default Redis only), as redis_state says."""
    user = fleet_user(memo, body, spec)
    if user is None:
        return redis_state.CredentialsResult()
    return await redis_state.ensure_credentials(memo.kube, body, *user, memo.setdefault("redis_secrets", {}))


def _redis_event(sdd: Any, prev: dict[str, Any], new: dict[str, Any]) -> None:
    """One event when RedisReady changes: a Warning as Redis goes away (or its reason changes), a
    Normal one when it is back; none while it stays as it was."""
    before, after = statuses.condition(prev, "RedisReady"), statuses.condition(new, "RedisReady")
    if after is None or (before or {}).get("status") == after["status"] == "True":
        return
    if before is not None and (before["status"], before["reason"]) == (after["status"], after["reason"]):
        return
    if after["status"] == "False":
        _event(sdd, "RedisUnavailable", f"{after['reason']}: {after['message']}")
    elif before is not None:
        _event(sdd, "RedisAvailable", after["message"])


async def publish_live_state(memo: Any, sdd: dict[str, Any], spec: dict[str, Any],
                             fleet: fleet_spec.FleetState) -> redis_state.Health | None:
    """Write the fleet's live state to its Redis (routers and workers follow it); what that met
    (None: the fleet has no Redis). Never raises."""
    store = memo.get("live_state")
    if store is None:
        return None
    ns, name = sdd["metadata"]["namespace"], sdd["metadata"]["name"]
    target, problem = await redis_target(memo, sdd, spec)
    if target is None:
        return problem
    await store.write(target, ns, name, fleet_spec.live_state(spec, fleet))
    return store.health(ns, name)


@kopf.on.login()
def login(memo: Any, **kwargs: Any) -> Any:
    if memo.get("connection") is not None:
        return memo.connection
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def startup(memo: Any, settings: kopf.OperatorSettings, logger: Any, **_: Any) -> None:
    connection = memo.get("connection") or kopf.login_with_service_account(settings=settings) \
        or kopf.login_with_kubeconfig(settings=settings)
    memo.kube = Kube(connection)  # created here: its session belongs to the operator's event loop
    memo.setdefault("settings", manifests.Settings())
    # the fleets' default Redis (main.py: --redis-url, --redis-password-file; their env by default)
    memo.setdefault("default_redis", None)
    if memo.default_redis is not None and not memo.settings.default_redis_url:
        memo.settings = dataclasses.replace(memo.settings, default_redis_url=memo.default_redis.url)
    memo.setdefault("loop_interval", 15.0)
    memo.setdefault("live_state", redis_state.LiveStateStore())
    memo.setdefault("windows", redis_state.WindowSource())
    # kopf hands each object's handlers a shallow copy of this memo, made when the object is first
    # seen: state shared between a resource's handlers and its children's events (the locks, what
    # was applied) must be one object created here, or a child's event gets a lock of its own
    for shared in SHARED_MEMO:
        memo.setdefault(shared, {})


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    if memo.get("kube") is not None:
        await memo.kube.close()
    if memo.get("live_state") is not None:
        await memo.live_state.close()


def _working(memo: Any, what: str, body: Any) -> Any:
    """Register the work with the liveness heartbeat (health.py), when the operator runs one."""
    heartbeat = memo.get("heartbeat") if hasattr(memo, "get") else None
    if heartbeat is None:
        return contextlib.nullcontext()
    meta = body.get("metadata", {})
    return heartbeat.working(f"{what} {meta.get('namespace')}/{meta.get('name')}")


@kopf.on.resume(*SDD)
@kopf.on.create(*SDD)
@kopf.on.update(*SDD, field="spec")
async def reconcile_handler(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    with _working(memo, "reconcile", body):
        await reconcile(body, memo)


@kopf.on.event("apps", "v1", "deployments", labels=FLEET_LABELS)
async def workers_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A worker, vLLM pool or router Deployment moved (pods became ready, a rollout finished):
    refresh its owner's status."""
    # the owner reference holds the full name; the label is shortened past 63 characters
    owners = [ref["name"] for ref in body.get("metadata", {}).get("ownerReferences", [])
              if ref.get("kind") == KIND]
    name = owners[0] if owners else body.get("metadata", {}).get("labels", {}).get(manifests.LABEL_SDD)
    if name:
        await refresh_status(memo, body["metadata"]["namespace"], name)


# A tick is idempotent, so a stopping daemon may be cancelled mid-tick after a second.
@kopf.daemon(*SDD, cancellation_timeout=1.0)
async def control_loop(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Every loop_interval: observe the workers' metrics, decide, and act on the decision."""
    while not stopped:
        await stopped.wait(memo.loop_interval)
        if stopped:
            break
        try:
            with _working(memo, "control-loop tick", body):
                await tick(body, memo)
        except (ApiError, OSError) as exc:
            kopf.warn(body, reason="ControlLoop", message=f"control loop tick failed, will retry: {exc}")


async def observe(memo: Any, body: Any, spec: dict[str, Any], drift_epoch: str = "") -> tuple[Observation, bool]:
    """(what the fleet showed, whether it routes per prompt type): its windows in Redis when it
    has one (routers follow a live state there), else no windows (the alerts alone act); the
    alerts firing for it, from the Alertmanager receiver."""
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    target, _ = await redis_target(memo, body, spec)
    arms = ("stable", "canary") if spec.get("canary") else ("stable",)
    if target is None:  # no Redis, or one it cannot reach (RedisReady says why): the alerts alone act
        obs, per_type = Observation(), False
    else:
        obs, per_type = await memo.windows.observe(target, ns, name, arms, drift_epoch), True
        if memo.get("live_state") is not None:
            memo.live_state.note_read(target, ns, name, None if obs.complete else obs.error)
    inbox = memo.get("alerts")
    if inbox is not None:
        obs = obs.with_alerts(tuple(inbox.slo_misses(ns, name, time.time())))
    return obs, per_type


def _readiness(deployments: Arm) -> tuple[int, int]:
    """(ready, desired) pods of an arm's serving Deployments (_serving), summed; (0, 0) for none."""
    ready = desired = 0
    for deployment, _ in deployments:
        if deployment is not None:
            ready += (deployment.get("status") or {}).get("readyReplicas", 0)
            desired += (deployment.get("spec") or {}).get("replicas", 0)
    return ready, desired


def _redis_failing(memo: Any, ns: str, name: str) -> bool:
    store = memo.get("live_state")
    health = store.health(ns, name) if store is not None else None
    return health is not None and not health.ok


async def tick(body: Any, memo: Any) -> None:
    """One tick of the loop: observe, judge every SLO key and the canary, act on what moved."""
    spec = specs.with_defaults(dict(body.get("spec") or {}))
    if specs.problems(spec) or body.get("metadata", {}).get("deletionTimestamp") or elsewhere(memo, body):
        return
    prev = body.get("status") or {}
    if not prev:
        return  # not reconciled yet
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    before, memory = canary_state(prev), memory_of(prev)
    now = time.time()
    obs, per_type = await observe(memo, body, spec, canaries.routing(before, spec).drift_epoch)
    kube: Kube = memo.kube
    serving = await _serving(kube, ns, name, spec, fleet_state(before, spec, memory))
    ready = {"stable": _readiness(_arm(serving, "stable"))}
    if spec.get("canary") or before.phase in canaries.LIVE_PHASES:
        ready["canary"] = _readiness(_arm(serving, "canary"))
    obs = dataclasses.replace(obs, ready=ready)
    selection = Selection.from_spec(spec, fleet_state(before, spec, memory))
    slo = slo_loop.tick(obs, memory, SloPolicy.from_spec(spec), now, per_type=per_type, selection=selection,
                        tuning=KTuning.from_spec(spec))
    # a Redis away is said once, by RedisReady and its event, not by one event a tick
    if not slo.decided and not (per_type and _redis_failing(memo, ns, name)):
        _event(body, "NoDecision", f"the fleet's windows could not be read ({obs.error}): nothing decided this tick")
    decision = canaries.tick(spec, body.get("metadata"), prev.get("canary"), canaries.observation(obs, None), now)
    for reason, message in slo.events + decision.events:
        _event(body, reason, message)
        metrics.record_decision(ns, name, reason, message)
    if decision.clear_gate:
        await kube.patch(API_VERSION, KIND, ns, name, {"metadata": {"annotations": {canaries.GATE_ANNOTATION: None}}})
    stable = obs.windows.get("stable")
    window = sum_windows(list(stable.values())) if stable else None
    refresh_default_redis(memo)  # a rotated admin password: new credentials, so the pods roll
    rotated = memo.setdefault("applied_credentials", {}).get((ns, name), "?") != credentials_name(memo, body, spec)
    if rotated or fleet_state(decision.state, spec, slo.memory) != fleet_state(before, spec, memory):
        await reconcile(body, memo, decision.state, window, slo.memory)
    else:
        await refresh_status(memo, ns, name, cstate=decision.state, window=window, memory=slo.memory)


CLAIMANT_CLEANUP_S = 60.0  # how long an install waits for another's cleanup of the fleet it claimed


async def await_claimant(memo: Any, namespace: str, name: str, owner: str) -> None:
    """Wait until the fleet is gone (its claimant cleaned up and released the finalizer the
    installs share) or CLAIMANT_CLEANUP_S passed (the claimant is not running: garbage collection
    takes the children). Polled here, not retried by kopf: kopf keeps a retry's state in an
    annotation both installs read, which would hold the claimant's own handler back too."""
    deadline = time.monotonic() + memo.get("claimant_cleanup_s", CLAIMANT_CLEANUP_S)
    while time.monotonic() < deadline:
        sdd = await memo.kube.get(API_VERSION, KIND, namespace, name)
        if sdd is None or elsewhere(memo, sdd) != owner:
            return
        await asyncio.sleep(1.0)


@kopf.on.delete(*SDD)
async def delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Delete what this resource owns (garbage collection would too; this does not wait for it)."""
    owner = elsewhere(memo, body)
    if owner is not None:  # the finalizer is shared: releasing it now would skip the claimant's cleanup
        await await_claimant(memo, body["metadata"]["namespace"], body["metadata"]["name"], owner)
        return
    ns, name, uid = body["metadata"]["namespace"], body["metadata"]["name"], body["metadata"].get("uid")
    for api_version, kind, child in manifests.child_refs(name) + manifests.legacy_child_refs(name):
        try:
            live = await memo.kube.get(api_version, kind, ns, child)
            if live and _owned(live, uid):
                await memo.kube.delete(api_version, kind, ns, child)
        except ApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=5) from exc
    spec = specs.with_defaults(dict(body.get("spec") or {}))
    if memo.get("live_state") is not None:
        # an invalid spec too: it may have been valid, its live state written, before an edit broke it
        try:
            target, _ = await redis_target(memo, body, spec)  # None: the Secret went first; the document stays
        except (KeyError, TypeError, AttributeError):  # a spec.redis too broken to name a Redis
            target = None
        if target is not None:
            await memo.live_state.delete(target, ns, name)
    metrics.forget(ns, name)
