"""Pure builders: (SpecDecodeDeployment, fleet state, settings) -> the plain dict of each child.

Names are deterministic (`<sdd>-stable`, `<sdd>-engine`, ...), so re-applying finds the same
objects; owner references are added by the handlers (kopf.adopt). No I/O, no kopf, no clock.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from typing import Any

from specfleet_api.engine_config import DEFAULT_MODEL_CACHE, MODEL_CACHE_ENV

from . import API_VERSION, GROUP, KIND

MANAGED_BY = "specfleet-operator"
LABEL_SDD = f"{GROUP}/deployment"
LABEL_ROLE = f"{GROUP}/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
CONFIG_DIR = "/etc/specfleet"
MODEL_CACHE = DEFAULT_MODEL_CACHE  # where the worker also looks for a relative model path
CONTROL_KEY = "control.json"
WORKER_UID = 65532  # "nonroot" in distroless images
PRESTOP_SLEEP_S = 5  # lets endpoints drop the pod before SIGTERM starts the drain


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the operator itself is configured with (flags / Helm values), not per resource."""

    worker_image: str = "ghcr.io/specfleet/worker:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    grpc_port: int = 50051
    http_port: int = 8080
    drain_seconds: int = 30


@dataclasses.dataclass(frozen=True)
class FleetState:
    """The operator's own decisions that shape children: control-loop mode and canary progress."""

    mode: str = "speculative"  # or "fallback"
    canary_weight: int | None = None  # None: spec.canary.weight (the start)
    canary_phase: str = "Idle"  # Idle | Progressing | Promoted | Aborted


def child_name(sdd_name: str, suffix: str) -> str:
    """`<sdd>-<suffix>`, shortened with a stable hash so it stays a valid 63-character DNS label.
    >>> child_name("llama", "stable")
    'llama-stable'
    >>> len(child_name("x" * 80, "canary-metrics"))
    63
    """
    name = f"{sdd_name}-{suffix}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(sdd_name.encode()).hexdigest()[:8]
    keep = 63 - len(suffix) - len(digest) - 2
    return f"{sdd_name[:keep].rstrip('-')}-{digest}-{suffix}"


def labels(sdd_name: str, role: str | None = None, component: str = "worker") -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "specfleet-worker",
        "app.kubernetes.io/instance": sdd_name,
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_SDD: sdd_name,
    }
    if role:
        out[LABEL_ROLE] = role
    return out


def selector(sdd_name: str, role: str | None = None) -> dict[str, str]:
    out = {LABEL_SDD: sdd_name, LABEL_COMPONENT: "worker"}
    if role:
        out[LABEL_ROLE] = role
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def effective_spec(spec: dict[str, Any], role: str, state: FleetState = FleetState()) -> dict[str, Any]:
    """The spec a role runs: the canary applies its overrides; after promotion, so does stable."""
    canary = spec.get("canary") or {}
    if role == "canary" or (role == "stable" and state.canary_phase == "Promoted"):
        over = canary.get("overrides", {})
        spec = _merge(spec, {k: over[k] for k in ("draft", "speculation") if k in over})
        if "image" in over:
            spec = _merge(spec, {"template": {"image": over["image"]}})
    return spec


def engine_config(spec: dict[str, Any], role: str, state: FleetState = FleetState()) -> dict[str, Any]:
    """engine.json as docs/worker-contract.md defines it, for one role."""
    spec = effective_spec(spec, role, state)
    model, draft, k = spec["model"], spec["draft"], spec["speculation"]
    routing = spec.get("routing") or {}
    return {
        "model": {"name": model["name"], "uri": model["uri"], "tokenizer": model.get("tokenizer")},
        "draft": {"method": draft["method"], "uri": draft.get("uri")},
        "speculation": {
            "kMin": k["kMin"], "kMax": k["kMax"], "kInitial": k["kInitial"], "kPolicy": k["kPolicy"],
            "tree": {"branching": k["tree"]["branching"], "depth": k["tree"]["depth"]},
        },
        "routing": {"default": routing.get("default", draft["method"]),
                    "byPromptType": dict(routing.get("byPromptType", {}))},
        "quantization": spec["quantization"],
        "dtype": spec["dtype"],
        "role": role,
    }


def control_config(spec: dict[str, Any], state: FleetState) -> dict[str, Any]:
    """control.json: what the control loop moves at run time, outside the config hash so a
    fallback never restarts a pod (the worker re-reads the mounted file)."""
    k = spec["speculation"]
    speculate = state.mode == "speculative" and spec["draft"]["method"] != "none"
    return {"speculate": speculate, "kMin": k["kMin"], "kMax": k["kMax"] if speculate else 0}


def config_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def canary_weight(spec: dict[str, Any], state: FleetState) -> int:
    canary = spec.get("canary")
    if not canary or state.canary_phase in ("Promoted", "Aborted"):
        return 0
    return canary.get("weight", 1) if state.canary_weight is None else state.canary_weight


def replica_counts(spec: dict[str, Any], state: FleetState) -> tuple[int | None, int]:
    """(stable, canary) worker counts. Stable is None under an autoscaler. Without a traffic
    router the split is by pods, so a weight above 0 is at least one canary pod."""
    scaling = spec.get("scaling")
    base = scaling["minReplicas"] if scaling else spec.get("replicas", 1)
    weight = canary_weight(spec, state)
    canary = math.ceil(base * weight / 100) if weight else 0
    return (None if scaling else base), canary


def _env(spec: dict[str, Any], sdd_name: str, role: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": MODEL_CACHE_ENV, "value": MODEL_CACHE},
        {"name": "HOME", "value": "/tmp"},
        {"name": "OTEL_SERVICE_NAME", "value": f"specfleet-{sdd_name}-{role}"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    redis = spec.get("redis")
    if redis and "url" in redis:
        env.append({"name": "SPECFLEET_REDIS_URL", "value": redis["url"]})
    elif redis:
        ref = redis["secretRef"]
        env.append({"name": "SPECFLEET_REDIS_URL",
                    "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref.get("key", "url")}}})
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
               state: FleetState = FleetState()) -> dict[str, Any]:
    """The worker Deployment for `role` (stable or canary); `spec` is already defaulted.

    The pod template carries the hash of everything that needs a restart (engine.json, env,
    image), so a spec change rolls the pods and an unchanged spec changes nothing.
    """
    name = sdd["metadata"]["name"]
    eff = effective_spec(spec, role, state)
    template = eff.get("template", {})
    image = template.get("image") or settings.worker_image
    env = _env(eff, name, role)
    engine = engine_config(spec, role, state)
    resources = template.get("resources", {})
    pod_hash = config_hash({"engine": engine, "env": env, "image": image, "resources": resources,
                            "settings": dataclasses.asdict(settings)})
    stable_n, canary_n = replica_counts(spec, state)
    http = {"port": "http", "scheme": "HTTP"}
    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": template.get("imagePullPolicy", settings.image_pull_policy),
        "command": ["specfleet"],
        "args": ["serve", "--config", f"{CONFIG_DIR}/engine.json", "--host", "0.0.0.0",
                 "--grpc-port", str(settings.grpc_port), "--http-port", str(settings.http_port),
                 "--drain-seconds", str(settings.drain_seconds)],
        "ports": [{"name": "grpc", "containerPort": settings.grpc_port, "protocol": "TCP"},
                  {"name": "http", "containerPort": settings.http_port, "protocol": "TCP"}],
        "env": env,
        "resources": copy.deepcopy(resources),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "model-cache", "mountPath": MODEL_CACHE},
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
                {"key": engine_key, "path": "engine.json"}, {"key": CONTROL_KEY, "path": CONTROL_KEY}]}},
            {"name": "model-cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    for key in ("nodeSelector", "tolerations", "priorityClassName", "serviceAccountName"):
        if template.get(key):
            pod_spec[key] = copy.deepcopy(template[key])
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": child_name(name, role), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, role)},
        "spec": {
            "selector": {"matchLabels": selector(name, role)},
            "revisionHistoryLimit": 5,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
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


def engine_configmap(sdd: dict[str, Any], spec: dict[str, Any], state: FleetState = FleetState()) -> dict[str, Any]:
    name = sdd["metadata"]["name"]
    data = {"engine.json": _dumps(engine_config(spec, "stable", state)),
            CONTROL_KEY: _dumps(control_config(spec, state))}
    if spec.get("canary"):
        data["engine-canary.json"] = _dumps(engine_config(spec, "canary", state))
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": child_name(name, "engine"), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, component="engine-config")},
        "data": data,
    }


def grpc_service(sdd: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The Service clients call: every worker, stable and canary (the split is by pod count)."""
    name = sdd["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name if len(name) <= 63 else child_name(name, "grpc"),
                     "namespace": sdd["metadata"]["namespace"], "labels": labels(name, component="grpc")},
        "spec": {"type": "ClusterIP", "selector": selector(name),
                 "ports": [{"name": "grpc", "port": settings.grpc_port, "targetPort": "grpc",
                            "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]},
    }


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


def pod_disruption_budget(sdd: dict[str, Any]) -> dict[str, Any]:
    name = sdd["metadata"]["name"]
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": child_name(name, "stable"), "namespace": sdd["metadata"]["namespace"],
                     "labels": labels(name, "stable", "disruption-budget")},
        # maxUnavailable (not minAvailable) so that a single-replica fleet can still be drained.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name, "stable")}},
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
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": child_name(name, "workers"), "namespace": sdd["metadata"]["namespace"],
                     "labels": {**labels(name, component="monitoring"), **monitor.get("labels", {})}},
        "spec": {
            "selector": {"matchLabels": {LABEL_SDD: name, LABEL_COMPONENT: "metrics"}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": monitor.get("interval", "30s")}],
            "podTargetLabels": [LABEL_SDD, LABEL_ROLE],
        },
    }


PROM_LABEL_SDD = "serving_specfleet_dev_deployment"  # LABEL_SDD as Prometheus relabels it


def alert_rules(selector: str = "", window: str = "5m", alpha_drop: float = 0.1,
                speedup_floor: float = 1.0) -> list[dict[str, Any]]:
    """The standard alerts; `selector` (PromQL matchers) narrows them, e.g. to one fleet."""
    sel = "{" + selector + "}" if selector else ""
    by = f"namespace, {PROM_LABEL_SDD}"
    now = f"avg by ({by}) (avg_over_time(spec_decode_acceptance_rate{sel}[{window}]))"
    before = f"avg by ({by}) (avg_over_time(spec_decode_acceptance_rate{sel}[{window}] offset {window}))"
    return [
        {"alert": "SpecDecodeAlphaDrop",
         "expr": f"({before} - {now}) / {before} > {alpha_drop}",
         "for": "1m", "labels": {"severity": "warning"},
         "annotations": {"summary": f"Acceptance rate (alpha) fell by more than {alpha_drop:.0%} over {window}",
                         "description": "Drafts are rejected more often: check the prompt mix and the draft."}},
        {"alert": "SpecDecodeSpeedupBelowOne",
         "expr": f"avg by ({by}) (spec_decode_total_speedup_ratio{sel}) < {speedup_floor}",
         "for": window, "labels": {"severity": "warning"},
         "annotations": {"summary": f"Speculative decoding is slower than plain decoding (speedup < {speedup_floor})",
                         "description": "Speculation costs more than it saves; fallback should engage."}},
        {"alert": "SpecDecodeDraftErrors",
         "expr": f"sum by ({by}) (rate(spec_decode_draft_failures_total{sel}[{window}])) > 0",
         "for": "5m", "labels": {"severity": "warning"},
         "annotations": {"summary": "Draft proposers are failing (their requests degrade to plain decoding)"}},
        {"alert": "SpecDecodeFallbackEntered",
         "expr": "max by (namespace, name) (specfleet_fallback_active) == 1",
         "for": "0m", "labels": {"severity": "info"},
         "annotations": {"summary": "The operator switched a fleet to plain decoding (fallback)"}},
    ]


def prometheus_rule(sdd: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    name, ns, slo = sdd["metadata"]["name"], sdd["metadata"]["namespace"], spec["slo"]
    rule = spec["observability"]["prometheusRule"]
    rules = alert_rules(f'namespace="{ns}", {PROM_LABEL_SDD}="{name}"',
                        slo["window"], slo["alphaDropAlert"], slo["speedupFloor"])
    rules[-1]["expr"] = f'max(specfleet_fallback_active{{namespace="{ns}", name="{name}"}}) == 1'
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": child_name(name, "alerts"), "namespace": ns,
                     "labels": {**labels(name, component="monitoring"), **rule.get("labels", {})}},
        "spec": {"groups": [{"name": f"specfleet.{ns}.{name}", "rules": rules}]},
    }


def children(sdd: dict[str, Any], spec: dict[str, Any], settings: Settings,
             state: FleetState = FleetState()) -> list[dict[str, Any]]:
    """Every child the SDD should have now, in apply order (config before the pods that mount it)."""
    out = [engine_configmap(sdd, spec, state), grpc_service(sdd, settings),
           metrics_service(sdd, "stable", settings), deployment(sdd, spec, "stable", settings, state),
           pod_disruption_budget(sdd)]
    if spec.get("canary"):
        out += [metrics_service(sdd, "canary", settings), deployment(sdd, spec, "canary", settings, state)]
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
    return [
        ("v1", "ConfigMap", child_name(sdd_name, "engine")),
        ("v1", "Service", sdd_name if len(sdd_name) <= 63 else child_name(sdd_name, "grpc")),
        ("v1", "Service", child_name(sdd_name, "metrics")),
        ("v1", "Service", child_name(sdd_name, "canary-metrics")),
        ("apps/v1", "Deployment", child_name(sdd_name, "stable")),
        ("apps/v1", "Deployment", child_name(sdd_name, "canary")),
        ("policy/v1", "PodDisruptionBudget", child_name(sdd_name, "stable")),
        ("autoscaling/v2", "HorizontalPodAutoscaler", child_name(sdd_name, "stable")),
        ("monitoring.coreos.com/v1", "ServiceMonitor", child_name(sdd_name, "workers")),
        ("monitoring.coreos.com/v1", "PrometheusRule", child_name(sdd_name, "alerts")),
    ]


def owner_reference(sdd: dict[str, Any]) -> dict[str, Any]:
    """The reference kopf.adopt writes; used by tests and the cleanup to recognise children."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": sdd["metadata"]["name"],
            "uid": sdd["metadata"].get("uid"), "controller": True, "blockOwnerDeletion": True}
