"""An in-process test cluster for the operator (like kopf.testing): kmock's KubernetesEmulator on
loopback, made a little more like an API server (uids, generations, resourceVersions with
optimistic concurrency, the OpenAPI v3 document of the CRD it declares, a record of the creates
and deletes done), a stand-in for the Deployment controller that reports workers ready, and the
real operator run in its own thread. Needs the dev extra (kmock); tests and
operator/scripts/scale_test.py use it, the operator itself never imports it.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import json
import math
import itertools
import threading
import time
import uuid
from typing import Any, Callable

import aiohttp.web
import attrs
import jsonpatch
import kmock
import kopf
from kmock._internal import enums

from . import API_VERSION, KIND
from .main import Options, operate
from .spec import crd as shipped_crd


#: What becomes of each file in deploy/examples/ (by stem): "served" (workers run it; every role's
#: engine.json passes `specfleet serve --check-config`) or "rejected" before any pod is created
#: (reserved values: CEL at the API server, else the operator's Ready=False, Unsupported; no
#: example is, today: the tests build their reserved specs). `local` is the one-machine example
#: `specfleet up` starts by default; `vllm-local` is served by vLLM pools (engine vllm), its arms'
#: engine.json, which the pools are built from, checked the same.
EXAMPLE_VERDICTS = {"ngram": "served", "canary-1pct": "served", "draft-model": "served", "eagle-tree": "served",
                    "medusa-tree": "served", "local": "served", "vllm-local": "served"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merged(before: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(before, dict):
        return patch
    out = dict(before)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merged(before.get(key), value)
    return out


@attrs.define(kw_only=True)
class Cluster(kmock.KubernetesEmulator):
    """What the plain emulator leaves to a real API server, done the way one does it."""

    ready_delay: float = 0.05  # how long the "Deployment controller" takes to report pods ready
    # plural -> seconds a create of that kind waits before it is served (a slow admission webhook)
    create_delays: dict = attrs.field(factory=dict)
    # the CRD installed: its names are declared (declare_resources), its schema published at
    # /openapi/v3/apis/<group>/<version> as an API server publishes it; a test may install an older one
    crd: dict = attrs.field(factory=lambda: copy.deepcopy(shipped_crd()))
    openapi_v3: bool = True  # False: /openapi/v3 answers 404, as an API server without it does
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _controllers: set = attrs.field(factory=set, init=False)
    _in_flight: set = attrs.field(factory=set, init=False)  # ids of the requests being served
    log: list = attrs.field(factory=list, init=False)  # (METHOD, path) of every request served
    # ("create" | "delete", plural, namespace, name, created object) of each create or delete answered
    # 2xx, in order (a delete of an object with finalizers only marks it, as an API server does)
    changes: list = attrs.field(factory=list, init=False)

    async def _handle(self, request: Any) -> Any:
        self._in_flight.add(id(request))
        try:
            return await self._serve(request)
        finally:
            self._in_flight.discard(id(request))

    async def _serve(self, request: Any) -> Any:
        # kmock matches each request against its whole request history (quadratic in a long run):
        # keep only the requests still being served (kmock finds each in the history to match it;
        # one dropped while it waited was answered 500) and a light log for assertions instead.
        self._requests[:] = [r for r in self._requests if id(r) in self._in_flight]
        self.log.append((str(request.method).upper().rsplit(".", 1)[-1], request.url.path))
        if request.url.path.startswith("/openapi/"):
            return self._serve_openapi(request.url.path)
        if request.action == enums.action.CREATE and request.resource is not None:
            await asyncio.sleep(self.create_delays.get(request.resource.plural, 0.0))
        deployment_written = False
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {}) if request.action in (
                enums.action.CREATE, enums.action.UPDATE) else None
            if request.action == enums.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.update(resourceVersion=str(next(self._rv)), generation=1, creationTimestamp=_now())
                deployment_written = request.resource.plural == "deployments"
            elif request.action == enums.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                if key in self._objects and not self._objects[key].deleted:
                    live = self._objects[key].raw
                    wanted_rv = meta.get("resourceVersion")
                    if wanted_rv is not None and wanted_rv != live["metadata"].get("resourceVersion"):
                        raise kmock.KubernetesError(status=409, reason="Conflict",
                                                    message="the object has been modified")
                    if request.subresource != "status" and "spec" in request.data:
                        if _merged(live.get("spec"), request.data["spec"]) != live.get("spec"):
                            meta["generation"] = live["metadata"].get("generation", 1) + 1
                            deployment_written = request.resource.plural == "deployments"
                    meta["resourceVersion"] = str(next(self._rv))
        try:
            response = await super()._handle(request)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            # an API server answers a JSON patch that does not apply 422 Unprocessable Entity (kopf
            # then patches again on its next cycle); the plain emulator's 500 made kopf retry the
            # stale patch with backoffs for up to a minute
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        if deployment_written and response.status < 300:
            name = request.name or request.data["metadata"]["name"]
            key = (request.resource, request.namespace or request.data["metadata"].get("namespace"), name)
            task = asyncio.create_task(self._report_ready(key))
            self._controllers.add(task)
            task.add_done_callback(self._controllers.discard)
        if request.resource is not None and response.status < 300 and request.name is None \
                and request.action == enums.action.CREATE:
            meta = request.data["metadata"]
            self.changes.append(("create", request.resource.plural, request.namespace or meta.get("namespace"),
                                 meta["name"], copy.deepcopy(request.data)))
        elif request.resource is not None and response.status < 300 and request.action == enums.action.DELETE:
            self.changes.append(("delete", request.resource.plural, request.namespace, request.name, None))
        return response

    def _serve_openapi(self, path: str) -> Any:
        group, names = self.crd["spec"]["group"], self.crd["spec"]["names"]
        versions = {f"/openapi/v3/apis/{group}/{v['name']}": v for v in self.crd["spec"]["versions"] if v["served"]}
        if not self.openapi_v3 or path not in versions:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{path} is not served")
        return aiohttp.web.json_response(openapi_document(group, names["kind"], versions[path]))

    async def _report_ready(self, key: tuple) -> None:
        await asyncio.sleep(self.ready_delay)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return
            obj = self._objects[key]
            raw = obj.raw
            n = raw.get("spec", {}).get("replicas", 1)
            obj.patch({"metadata": {"resourceVersion": str(next(self._rv))},
                       "status": {"observedGeneration": raw["metadata"].get("generation", 1), "replicas": n,
                                  "readyReplicas": n, "updatedReplicas": n, "availableReplicas": n}})
            await self._buses[key[0]].put({"type": "MODIFIED", "object": obj.raw})

    @property
    def endpoint(self) -> str:
        return str(self.url).rstrip("/")

    def live(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(f"{api_version}/{plural}" if "/" in api_version else f"v1/{plural}"), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key].raw

    def all_live(self, api_version: str, plural: str) -> list[dict[str, Any]]:
        res = kmock.resource(f"{api_version}/{plural}" if "/" in api_version else f"v1/{plural}")
        return [obj.raw for (r, _, _), obj in self._objects.items() if r == res and not obj.deleted]

    def writes(self, method: str, path_part: str) -> int:
        return sum(1 for m, path in self.log if m == method and path_part in path)


def declare_resources(cluster: Cluster) -> None:
    cluster.resources.load_bundled()  # the built-in kinds of a recent k3s
    names = cluster.crd["spec"]["names"]
    cluster.resources[f"{cluster.crd['spec']['group']}/v1alpha1/{names['plural']}"] = kmock.ResourceInfo(
        kind=names["kind"], singular=names["singular"], shortnames=set(names["shortNames"]), namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"}, subresources={"status"})
    for plural, kind in (("servicemonitors", "ServiceMonitor"), ("prometheusrules", "PrometheusRule")):
        cluster.resources[f"monitoring.coreos.com/v1/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs={"get", "list", "watch", "create", "patch", "delete"})


def openapi_document(group: str, kind: str, version: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI v3 document an API server publishes for one served version of a CRD (the parts a
    client reads): its schema under components.schemas, named by the reversed group, tagged with
    x-kubernetes-group-version-kind, metadata a reference to ObjectMeta."""
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    meta_ref = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    schema.setdefault("properties", {})["metadata"] = {"allOf": [{"$ref": f"#/components/schemas/{meta_ref}"}]}
    schema["x-kubernetes-group-version-kind"] = [{"group": group, "version": version["name"], "kind": kind}]
    prefix = ".".join(reversed(group.split("."))) + "." + version["name"]
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"}, "paths": {},
            "components": {"schemas": {f"{prefix}.{kind}": schema, meta_ref: {"type": "object"}}}}


def crd_without(*paths: str) -> dict[str, Any]:
    """The shipped CRD less the properties at `paths` (e.g. "status.kCeilings") in every version:
    what an older CRD lacks."""
    out = copy.deepcopy(shipped_crd())
    for version in out["spec"]["versions"]:
        for path in paths:
            *parents, leaf = path.split(".")
            node = version["schema"]["openAPIV3Schema"]
            for part in parents:
                node = node["properties"][part]
            del node["properties"][leaf]
    return out


def stored_live_state(client, namespace: str = "default", name: str = "chat"):
    """The live state Redis holds for a fleet, or None."""
    from specfleet_api.live_state import LiveState, state_key

    raw = client.get(state_key(namespace, name))
    return LiveState.from_json(raw) if raw is not None else None


def publish_window(client, namespace: str, name: str, prompt_type: str, *, alpha: float, speedup: float = 1.4,
                   arm: str = "stable", pod: str = "pod-0", drafted: int = 1000, requests: int = 20,
                   ttl_s: int = 30, method: str | None = None, spread: float | None = None,
                   gains: tuple[float, ...] | None = None) -> None:
    """Write one worker pod's window of one prompt type (of one draft method's requests on it,
    with `method`) into Redis, as specfleet_worker.fleet does; `spread`: the requests' own log
    speedups, half of them that much above log(speedup), half below; `gains`: every step drafts
    len(gains) positions and position p is accepted in gains[p] of them (then `drafted` is
    ignored)."""
    from specfleet_api.live_state import window_key
    from specfleet_api.windows import POSITIONS, TypeCounts, method_field

    busy = 10.0
    log_speedups = {}
    if spread is not None:
        log_s = math.log(speedup)
        log_speedups = {"spec_speedups": requests, "spec_log_speedup_sum": requests * log_s,
                        "spec_log_speedup_sq": requests * (log_s * log_s + spread * spread)}
    steps = requests * 20
    positions = {}
    if gains is not None:
        drafted = steps * len(gains)
        pad = (0,) * (POSITIONS - len(gains))
        positions = {"pos_drafted": (steps,) * len(gains) + pad,
                     "pos_accepted": tuple(round(g * steps) for g in gains) + pad}
    counts = TypeCounts(requests=requests, steps=steps, draft_tokens=drafted,
                        accepted_tokens=int(alpha * drafted), plain_seconds=speedup * busy, busy_seconds=busy,
                        spec_requests=requests, spec_plain_seconds=speedup * busy, spec_busy_seconds=busy,
                        **log_speedups, **positions)
    key = f"{window_key(namespace, name, arm)}:{pod}"
    field = method_field(prompt_type, method) if method else prompt_type
    client.hset(key, field, json.dumps({**dataclasses.asdict(counts), "window_seconds": 10.0}))
    client.expire(key, ttl_s)


class OperatorThread:
    """One operator replica: the real `operate()` in its own thread and event loop."""

    def __init__(self, url: str, identity: str, *, leader_election: bool = False,
                 loop_interval: float = 3600.0, lease_duration: float = 2.0, memo: dict[str, Any] | None = None):
        self.options = Options(identity=identity, leader_election=leader_election, lease_namespace="default",
                               lease_duration_s=lease_duration, renew_s=lease_duration / 4,
                               retry_s=lease_duration / 8, loop_interval_s=loop_interval)
        self.url, self.memo = url, memo or {}
        self.stop, self.ready, self.leading = threading.Event(), threading.Event(), threading.Event()
        self.result: int | BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=identity, daemon=True)
        self.abandon = False

    def _run(self) -> None:
        try:
            self.result = asyncio.run(operate(self.options, connection=kopf.ConnectionInfo(server=self.url),
                                              stop=self.stop, ready=self.ready, leading=self.leading,
                                              memo=dict(self.memo)))
        except BaseException as exc:  # surfaced by the test through .result
            self.result = exc

    def start(self) -> "OperatorThread":
        self.thread.start()
        return self

    async def stop_and_join(self, timeout: float = 20.0) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout
        while self.thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not self.thread.is_alive(), f"{self.options.identity} did not stop in {timeout}s"


async def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def write_kubeconfig(path, endpoint: str, namespace: str = "default"):
    """A kubeconfig for the emulator at `endpoint` (kubectl, the kubernetes client, a subprocess
    operator or router), its context's namespace `namespace`; returns `path`."""
    import yaml

    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": endpoint}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u", "namespace": namespace}}]}))
    return path


def sdd_body(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    base = {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"}, "replicas": 1}
    base.update(spec)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": base}


def ready(cluster: Cluster, name: str, namespace: str = "default") -> bool:
    sdd = cluster.live(API_VERSION, "specdecodedeployments", namespace, name)
    conds = (sdd or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
