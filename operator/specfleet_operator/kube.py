"""A small async Kubernetes client for the objects the operator owns: get, create, patch, delete,
and `apply` (GET; create when absent, a 409 meaning "already there"; otherwise a three-way
JSON merge patch against the last applied state, so an unchanged object costs one GET, no write).
Built from kopf's ConnectionInfo.

What `apply` owns: every field of the desired object (a hand edit of one is reverted), and the
whole of the maps in OWNED_MAPS (a key added there by hand is removed). Everything else on the
live object (annotations and labels someone added, server defaults, status) is left alone. An
object controlled by another owner than the desired one's is not written at all (OwnedByAnother).
"""
from __future__ import annotations

import base64
import json
import re
import ssl
import tempfile
from decimal import Decimal
from typing import Any

import aiohttp

from . import GROUP

LAST_APPLIED = f"{GROUP}/last-applied"
MERGE_PATCH = "application/merge-patch+json"
#: Maps owned whole, not key by key: a key added to a Service's selector (or a Deployment's, a
#: PDB's) changes which pods it picks, one added to a ConfigMap's data what the workers read.
OWNED_MAPS = frozenset({("data",), ("spec", "selector"), ("spec", "selector", "matchLabels")})
QUANTITY_MAPS = frozenset({"requests", "limits"})  # a container's resources: quantities
_SUFFIXES = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10) ** 3,
             "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "P": Decimal(10) ** 15,
             "E": Decimal(10) ** 18, **{s: Decimal(2) ** (10 * i) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)}}
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?")

PLURALS = {
    "ConfigMap": "configmaps", "Service": "services", "Secret": "secrets", "Event": "events",
    "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers", "Lease": "leases",
    "ServiceMonitor": "servicemonitors", "PrometheusRule": "prometheusrules",
    "SpecDecodeDeployment": "specdecodedeployments", "ServiceAccount": "serviceaccounts",
    "Role": "roles", "RoleBinding": "rolebindings", "EndpointSlice": "endpointslices",
    "NetworkPolicy": "networkpolicies",
}


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference that names the object's controller, if any."""
    return next((ref for ref in obj.get("metadata", {}).get("ownerReferences") or [] if ref.get("controller")), None)


class OwnedByAnother(Exception):
    """`apply` found the object controlled by another owner than the desired one's: left as it is."""

    def __init__(self, kind: str, namespace: str | None, name: str, owner: dict[str, Any]):
        self.kind, self.namespace, self.name, self.owner = kind, namespace, name, owner
        super().__init__(f"{kind} {name} is controlled by {owner.get('kind')} {owner.get('name')} "
                         f"(uid {owner.get('uid')}), not by this resource: left as it is")


class ApiError(Exception):
    """A non-2xx answer: the HTTP status, the API server's reason and message, and the object."""

    def __init__(self, status: int, reason: str, message: str, what: str):
        super().__init__(f"{what}: HTTP {status} {reason}: {message}")
        self.status, self.reason, self.message, self.what = status, reason, message, what


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{PLURALS[kind]}"
    return path + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def merge_diff(before: Any, after: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `before` into `after`; {} when equal.
    >>> merge_diff({"a": 1, "b": {"c": 2, "d": 3}}, {"a": 1, "b": {"c": 5}})
    {'b': {'d': None, 'c': 5}}
    """
    if not (isinstance(before, dict) and isinstance(after, dict)):
        return after
    patch: dict[str, Any] = {key: None for key in before if key not in after}
    for key, value in after.items():
        if key not in before:
            patch[key] = value
        elif isinstance(value, dict) and isinstance(before[key], dict):
            sub = merge_diff(before[key], value)
            if sub:
                patch[key] = sub
        elif before[key] != value:
            patch[key] = value
    return patch


def holds(live: Any, desired: Any, quantities: bool = False) -> bool:
    """Whether `live` holds `desired`: dicts may have more keys (server defaults), lists match
    item by item, a number may come back as a string (1 == "1"), and inside `requests` and
    `limits` a quantity in the API server's canonical form (0.5 == "500m", "1024Mi" == "1Gi")."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and holds(live[k], v, quantities or k in QUANTITY_MAPS) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(
            holds(a, b, quantities) for a, b in zip(live, desired))
    if live == desired or (not isinstance(desired, bool) and str(live) == str(desired)):
        return True
    return quantities and quantity(live) is not None and quantity(live) == quantity(desired)


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity as a number; None when `value` is not one.
    >>> quantity("500m") == quantity(0.5), quantity("1Gi") == quantity("1024Mi"), quantity("4x")
    (True, True, None)
    """
    match = _QUANTITY.fullmatch(str(value)) if isinstance(value, (str, int, float)) \
        and not isinstance(value, bool) else None
    if match is None:
        return None
    return Decimal(match[1]) * _SUFFIXES[match[2] or ""]


def drift(live: Any, desired: Any, path: tuple[str, ...] = ()) -> Any:
    """The part of `desired` that `live` does not hold, as a merge patch; in the maps of OWNED_MAPS
    a key that only `live` has is removed (None).
    >>> drift({"a": 1, "b": {"c": 2, "x": 9}}, {"a": 1, "b": {"c": 3}})
    {'b': {'c': 3}}
    >>> drift({"data": {"k": "v", "x": "9"}}, {"data": {"k": "v"}})
    {'data': {'x': None}}
    """
    out: dict[str, Any] = {key: None for key in live if key not in desired} if path in OWNED_MAPS else {}
    for key, value in desired.items():
        if isinstance(value, dict) and isinstance(live.get(key), dict):
            sub = drift(live[key], value, (*path, key))
            if sub:
                out[key] = sub
        elif key not in live or not holds(live[key], value):
            out[key] = value
    return out


def apply_patch(live: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that makes `live` hold `desired`; {} when it already does: the fields
    dropped since the last apply (LAST_APPLIED) are removed, and hand edits of owned fields
    reverted. Pure, so a watch can tell drift from its event's body without a request.
    >>> desired = {"metadata": {"name": "c"}, "data": {"a": "1"}}
    >>> apply_patch({"metadata": {"name": "c", "annotations": {"note": "mine"}}, "data": {"a": "2"}}, desired)
    {'data': {'a': '1'}}
    """
    last = json.loads(live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED, "{}"))
    return _deep_update(_dropped(live, merge_diff(last, desired)), drift(live, desired))


def _dropped(live: Any, patch: Any) -> dict[str, Any]:
    """The removals (None) of `patch` whose key `live` still has."""
    out: dict[str, Any] = {}
    for key, value in patch.items() if isinstance(patch, dict) and isinstance(live, dict) else ():
        if value is None and key in live:
            out[key] = None
        elif isinstance(value, dict) and (sub := _dropped(live.get(key), value)):
            out[key] = sub
    return out


def _deep_update(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


class Kube:
    """The API client. `connection` is a kopf.ConnectionInfo (server, CA, token or client cert)."""

    def __init__(self, connection: Any, timeout_s: float = 30.0):
        self._conn = connection
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._files: list[Any] = []

    def _ssl(self) -> ssl.SSLContext | bool:
        conn = self._conn
        if not str(conn.server).startswith("https"):
            return False
        if conn.insecure:
            return False
        ctx = ssl.create_default_context(cafile=conn.ca_path or None, cadata=self._text(conn.ca_data))
        cert, key = conn.certificate_path, conn.private_key_path
        if conn.certificate_data:
            cert = self._tempfile(conn.certificate_data)
        if conn.private_key_data:
            key = self._tempfile(conn.private_key_data)
        if cert:
            ctx.load_cert_chain(cert, key)
        return ctx

    @staticmethod
    def _text(data: str | bytes | None) -> str | None:
        if data is None:
            return None
        raw = data if isinstance(data, bytes) else data.encode()
        if b"-----BEGIN" not in raw:
            raw = base64.b64decode(raw)
        return raw.decode()

    def _tempfile(self, data: str | bytes) -> str:
        f = tempfile.NamedTemporaryFile("w", suffix=".pem")  # kept open: ssl needs a path
        f.write(self._text(data) or "")
        f.flush()
        self._files.append(f)
        return f.name

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json", "User-Agent": "specfleet-operator"}
            if self._conn.token:
                headers["Authorization"] = f"{self._conn.scheme or 'Bearer'} {self._conn.token}"
            self._session = aiohttp.ClientSession(
                base_url=str(self._conn.server).rstrip("/") + "/", headers=headers, timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=64))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        for f in self._files:
            f.close()

    async def request(self, method: str, path: str, body: Any = None, what: str = "",
                      content_type: str = "application/json", params: dict[str, str] | None = None) -> Any:
        session = await self.session()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with session.request(method, path.lstrip("/"), data=data, headers=headers, params=params) as resp:
            text = await resp.text()
            payload = json.loads(text) if text and text.lstrip().startswith(("{", "[")) else {}
            if resp.status >= 400:
                raise ApiError(resp.status, payload.get("reason", resp.reason or ""),
                               payload.get("message", text[:200]), what or f"{method} {path}")
            return payload

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", resource_path(api_version, kind, namespace, name),
                                      what=f"{kind} {namespace}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        out = await self.request("GET", resource_path(api_version, kind, namespace), params=params,
                                 what=f"{kind} list in {namespace}")
        return out.get("items", [])

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        return await self.request("POST", resource_path(body["apiVersion"], body["kind"], meta.get("namespace")),
                                  body, what=f"{body['kind']} {meta.get('namespace')}/{meta['name']}")

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        return await self.request("PATCH", resource_path(api_version, kind, namespace, name, subresource), patch,
                                  what=f"{kind} {namespace}/{name}", content_type=MERGE_PATCH)

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """True if it was there; a missing object or a kind the cluster lacks is already gone."""
        try:
            await self.request("DELETE", resource_path(api_version, kind, namespace, name),
                               {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
                               what=f"{kind} {namespace}/{name}")
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def apply(self, desired: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Make the object match `desired`: ("created" | "updated" | "unchanged", live object).

        The annotation LAST_APPLIED keeps what was applied last, so that a field dropped from
        `desired` is removed (as `kubectl apply` does) while fields the server defaults stay.
        When `desired` names its controller and the live object has another (a different uid),
        nothing is written: OwnedByAnother.
        """
        meta = desired["metadata"]
        record = json.dumps(desired, sort_keys=True, separators=(",", ":"))
        live = await self.get(desired["apiVersion"], desired["kind"], meta.get("namespace"), meta["name"])
        if live is None:
            body = json.loads(record)
            body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = record
            try:
                return "created", await self.create(body)
            except ApiError as exc:
                if exc.status != 409:  # 409: created meanwhile (another reconcile): patch it below
                    raise
            live = await self.get(desired["apiVersion"], desired["kind"], meta.get("namespace"), meta["name"])
            if live is None:
                raise ApiError(409, "Conflict", "the object vanished while being applied",
                               f"{desired['kind']} {meta.get('namespace')}/{meta['name']}")
        mine, theirs = controller_of(desired), controller_of(live)
        if mine is not None and theirs is not None and theirs.get("uid") != mine.get("uid"):
            raise OwnedByAnother(desired["kind"], meta.get("namespace"), meta["name"], theirs)
        patch = apply_patch(live, desired)
        if not patch:
            return "unchanged", live
        patch.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED] = record
        return "updated", await self.patch(desired["apiVersion"], desired["kind"], meta.get("namespace"),
                                           meta["name"], patch)
