"""At start: is the installed CRD as new as the one this operator ships (crd.yaml)? The API server
prunes every field its CRD's schema lacks from each write, so against an older CRD the status
fields added since (the control loop's memory: kCeilings, methods, clusterMethods) vanish silently.

The installed schema is read from the API server's OpenAPI v3 document of the group/version
(`/openapi/v3/apis/<group>/<version>`), which the system:discovery role lets every authenticated
client read: no RBAC on CustomResourceDefinitions, so it works watching one namespace as well as
all. Every spec and status property of the shipped schema, recursively, must be published there;
one that is not means an older CRD, and `check` raises OutdatedCRD (the operator does not start).
A document not served (404: an API server without OpenAPI v3, or no such version installed) or not
readable (401, 403) cannot be compared: a warning, and the operator starts as it did before the check.
"""
from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

from . import GROUP, KIND, VERSION
from .kube import ApiError, Kube
from .spec import crd

log = logging.getLogger("specfleet.operator.crd_check")
CRD_FILE = "crds/serving.specfleet.dev_specdecodedeployments.yaml"
EXIT_CODE = 3  # `specfleet operator`'s exit status on an older CRD (1: the Lease was lost)


class OutdatedCRD(Exception):
    """The installed CRD lacks properties this operator writes: what, and the command that upgrades it."""

    def __init__(self, missing: list[str]):
        self.missing = missing
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        super().__init__(
            f"the installed CustomResourceDefinition {crd()['metadata']['name']} is older than this operator "
            f"(specfleet {_version()}): its {VERSION} schema lacks {shown}, which the API server would drop from "
            f"every write. Upgrade it, and the operator starts on its next restart: kubectl apply --server-side "
            f"-f {CRD_FILE} (from specfleet {_version()}; the chart's charts/specfleet/crds/ holds the same file, "
            "which helm upgrade does not apply)")


def _version() -> str:
    try:
        return importlib.metadata.version("specfleet")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "of this source tree"


def missing(shipped: dict[str, Any], published: dict[str, Any], path: str = "") -> list[str]:
    """The properties of the `shipped` schema that the `published` one lacks (where it would prune
    them), as paths; `[]` where it holds all of them (a newer one may hold more).

    >>> ours = {"properties": {"a": {"type": "integer"}, "m": {"additionalProperties": {
    ...     "properties": {"k": {"type": "integer"}}}}, "l": {"items": {"properties": {"x": {}}}}}}
    >>> missing(ours, {"properties": {"a": {}, "m": {"additionalProperties": {}}, "l": {"items": {}}}})
    ['m.*.k', 'l[].x']
    >>> missing(ours, {"properties": {"a": {}, "m": {"x-kubernetes-preserve-unknown-fields": True}}})
    ['l']
    """
    if published.get("x-kubernetes-preserve-unknown-fields"):
        return []  # nothing under it is pruned
    out = []
    for name, schema in (shipped.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        theirs = (published.get("properties") or {}).get(name)
        out += [where] if theirs is None else missing(schema, theirs, where)
    if isinstance(shipped.get("items"), dict):
        out += missing(shipped["items"], published.get("items") or {}, f"{path}[]")
    if isinstance(shipped.get("additionalProperties"), dict):
        theirs = published.get("additionalProperties")
        out += [f"{path}.*"] if not isinstance(theirs, dict) else missing(shipped["additionalProperties"], theirs,
                                                                         f"{path}.*")
    return out


def lacking(document: dict[str, Any]) -> list[str] | None:
    """The spec and status properties of the shipped schema that an OpenAPI v3 document's schema of
    this kind lacks (`missing`); None when the document holds no schema of this kind (found by its
    x-kubernetes-group-version-kind, as the API server tags it)."""
    gvk = {"group": GROUP, "version": VERSION, "kind": KIND}
    schemas = ((document.get("components") or {}).get("schemas") or {}).values()
    theirs = next((s for s in schemas if gvk in s.get("x-kubernetes-group-version-kind", [])), None)
    if theirs is None:
        return None
    (ours,) = [v["schema"]["openAPIV3Schema"]["properties"] for v in crd()["spec"]["versions"] if v["name"] == VERSION]
    return missing({"properties": {part: ours[part] for part in ("spec", "status")}}, theirs)


async def check(kube: Kube) -> None:
    """Raise OutdatedCRD when the published schema lacks a spec or status property of ours; warn
    and return when it cannot be read. Other errors (the API server away) propagate."""
    path = f"/openapi/v3/apis/{GROUP}/{VERSION}"
    try:
        document = await kube.request("GET", path, what=f"the OpenAPI v3 document of {GROUP}/{VERSION}")
    except ApiError as exc:
        if exc.status not in (401, 403, 404):
            raise
        log.warning("cannot check the installed CRD against this operator's (%s): %s. Make sure it is the one "
                    "of this version (kubectl apply --server-side -f %s): an older one drops the status "
                    "fields it lacks", "not served" if exc.status == 404 else "not allowed", exc, CRD_FILE)
        return
    found = lacking(document)
    if found is None:
        log.warning("the OpenAPI v3 document of %s/%s holds no %s: the CRD is not installed (kubectl apply "
                    "--server-side -f %s)", GROUP, VERSION, KIND, CRD_FILE)
        return
    if found:
        raise OutdatedCRD(found)
    log.info("the installed CRD holds every property this operator writes")
