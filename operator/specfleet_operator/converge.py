"""Level-triggered convergence: the children are brought back to the desired state whenever they
drift from it, not only when the spec changes.

Two triggers, one check. A watch on every child kind (by the fleet's managed-by label) sees a
child deleted or edited and converges its owner; a daemon per resource converges it every
`memo.converge_interval` seconds, the safety net for a missed event. The check compares what is
live with `manifests.children` (kube.apply_patch: the owned fields only) and, only when something
drifted, runs `handlers.reconcile` under the resource's reconcile lock, so the operator's own
writes, which leave nothing to do, end there: no loop.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from . import API_VERSION, KIND, handlers, manifests
from . import spec as specs
from .kube import PLURALS, ApiError, apply_patch, controller_of

logger = logging.getLogger("specfleet.operator.converge")
CONVERGE_INTERVAL_S = 60.0  # memo.converge_interval unless set

#: (apiVersion, kind) of every child the operator may create, each watched.
CHILD_KINDS = tuple(dict.fromkeys((api_version, kind) for api_version, kind, _ in manifests.child_refs("x")))


def owner_name(body: Any) -> str | None:
    """The resource a child belongs to: its owner reference (the full name), else its label."""
    meta = body.get("metadata", {})
    owners = [ref["name"] for ref in meta.get("ownerReferences", []) if ref.get("kind") == KIND]
    return owners[0] if owners else meta.get("labels", {}).get(manifests.LABEL_SDD)


def desired_children(sdd: dict[str, Any], memo: Any) -> dict[tuple[str, str], dict[str, Any]] | None:
    """Every child the resource should have now, by (kind, name), owner references included;
    None when nothing is to be converged (not reconciled yet, being deleted, an invalid spec)."""
    meta = sdd.get("metadata", {})
    if meta.get("deletionTimestamp") or not sdd.get("status"):
        return None  # the delete handler, or the first reconcile, has it in hand
    spec = specs.with_defaults(dict(sdd.get("spec") or {}))
    if specs.problems(spec):
        return None
    status = sdd["status"]
    fleet = handlers.fleet_state(handlers.canary_state(status), spec, handlers.memory_of(status))
    try:
        desired = manifests.children(sdd, spec, memo.settings, fleet, handlers.credentials_name(memo, sdd, spec))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # reconcile reports it in the status
    kopf.adopt(desired, owner=sdd)
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in desired}


def drifted(kind: str, name: str, live: dict[str, Any] | None, desired: dict[str, dict[str, Any]],
            uid: str | None) -> str | None:
    """What is wrong with one live child (None: nothing): missing, hand-edited, or left over. A
    child that another owner controls is nothing to converge."""
    want = desired.get((kind, name))
    if want is None:
        return f"{kind} {name} left over" if live is not None and handlers._owned(live, uid) else None
    if live is None:
        return f"{kind} {name} missing"
    if (controller := controller_of(live)) is not None and controller.get("uid") != uid:
        return None  # another owner's: reconcile leaves it alone, and the status says so
    patch = apply_patch(live, want)
    fields = sorted(_paths(patch))
    return f"{kind} {name} edited ({', '.join(fields)})" if fields else None


def _paths(patch: Any, prefix: str = "") -> list[str]:
    if not isinstance(patch, dict) or not patch:
        return [prefix] if prefix else []
    return [p for key, value in patch.items() for p in _paths(value, f"{prefix}.{key}" if prefix else key)]


async def converge(memo: Any, namespace: str, name: str, only: tuple[str, str] | None = None) -> list[str]:
    """Check the resource's children (`only`: just this (kind, name)) and reconcile if any drifted;
    returns what drifted. Runs under the reconcile lock, on a fresh read of the resource, so it
    never applies children from a state another reconcile is replacing."""
    kube = memo.kube
    async with handlers.reconcile_lock(memo, namespace, name):
        sdd = await kube.get(API_VERSION, KIND, namespace, name)
        if sdd and handlers.elsewhere(memo, sdd):
            return []  # another operator install's fleet
        if sdd and not sdd["metadata"].get("deletionTimestamp") and handlers.unclaimed(sdd):
            # released by the install that held it (or from before claims): reconcile, which claims it
            await handlers.reconcile(sdd, memo, locked=True)
            return ["unclaimed"]
        desired = desired_children(sdd, memo) if sdd else None
        if desired is None:
            return []
        uid = sdd["metadata"].get("uid")
        found = []
        for api_version, kind, child in manifests.child_refs(name):
            if only is not None and (kind, child) != only:
                continue
            try:
                live = await kube.get(api_version, kind, namespace, child)
            except ApiError as exc:
                if exc.status == 404 and kind in handlers.OPTIONAL_KINDS:
                    continue  # not served here: reconcile reports it when it is wanted
                raise
            if (what := drifted(kind, child, live, desired, uid)) is not None:
                found.append(what)
        if only is None and (why := memo.get("credentials_pending", {}).get((namespace, name))):
            found.append(f"the fleet's Redis credentials are not in place ({why})")  # a Secret is never watched
        if found:
            logger.info("%s/%s drifted: %s", namespace, name, "; ".join(found))
            kopf.event(sdd, type="Normal", reason="Converged", message="; ".join(found))
            await handlers.reconcile(sdd, memo, locked=True)
        return found


def _watch(api_version: str, kind: str) -> None:
    @kopf.on.event(api_version, PLURALS[kind], labels=handlers.FLEET_LABELS, id=f"converge-{kind.lower()}")
    async def child_changed(type: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        """A child was deleted or edited: converge that child of its owner (after a short pause,
        so that a burst of events for one child costs one check)."""
        owner, ns, name = owner_name(body), body["metadata"].get("namespace"), body["metadata"]["name"]
        if not owner or not ns or memo.get("kube") is None:
            return
        if type != "DELETED":
            sdd = await memo.kube.get(API_VERSION, KIND, ns, owner)
            desired = desired_children(sdd, memo) if sdd and not handlers.elsewhere(memo, sdd) else None
            if desired is None or drifted(kind, name, dict(body), desired, sdd["metadata"].get("uid")) is None:
                return  # the common case, the operator's own write or a status update: no write
        await asyncio.sleep(memo.get("converge_debounce", 0.1))
        try:
            await converge(memo, ns, owner, only=(kind, name))
        except (ApiError, kopf.TemporaryError) as exc:  # kopf retries no event handler: the daemon will
            logger.warning("converging %s %s/%s failed, the periodic converge retries: %s", kind, ns, name, exc)


for _api_version, _kind in CHILD_KINDS:
    _watch(_api_version, _kind)


@kopf.on.startup()
async def defaults(memo: Any, **_: Any) -> None:
    memo.setdefault("converge_interval", CONVERGE_INTERVAL_S)


@kopf.daemon(*handlers.SDD, cancellation_timeout=1.0)
async def converge_loop(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Every converge_interval: check every child of the resource (a missed event, a watch that
    was down) and reconcile what drifted."""
    meta = body["metadata"]
    while not stopped:
        await stopped.wait(memo.get("converge_interval", CONVERGE_INTERVAL_S))
        if stopped:
            break
        try:
            with handlers._working(memo, "converge", body):
                await converge(memo, meta["namespace"], meta["name"])
        except (ApiError, OSError, kopf.TemporaryError) as exc:
            kopf.warn(body, reason="ConvergeFailed", message=f"converge failed, will retry: {exc}")
