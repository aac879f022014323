"""What `specfleet up` runs for one SpecDecodeDeployment file: pure, no process started here.

The file is judged as a cluster would judge it (the operator's `with_defaults` and `problems`),
each arm's engine.json and control.json are the ones the operator renders (specfleet_api.fleet_spec),
and the fields that only make sense in a cluster are overridden, each named in an `Override` so
that `up` can say what it changed. The live state the routers and workers follow comes from `state.py`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from specfleet_api import fleet_spec
from specfleet_api.engine_config import EngineConfig, Problem, model_cache
from specfleet_operator import API_VERSION, KIND
from specfleet_operator import spec as specs
from specfleet_worker.main import TINY_MODEL

BUNDLED_OR_TEST = ("smollm2-135m", TINY_MODEL)  # model names `--model` takes as they are


class SpecError(ValueError):
    """The file cannot be run: each problem in the CRD's words, the field first."""

    def __init__(self, source: str, problems: list[Problem | str]):
        self.source, self.problems = source, [str(p) for p in problems]
        super().__init__(f"{source}: " + "; ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class Override:
    """A field of the file that `up` runs differently on this machine, and why."""

    field: str
    was: Any
    now: str

    def __str__(self) -> str:
        return f"{self.field}: {_short(self.was)} -> {self.now}"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str  # stable | canary
    workers: int
    engine: dict[str, Any]  # engine.json, as fleet_spec.engine_config renders it
    control: dict[str, Any]  # control.json: what a worker starts from while Redis is away


@dataclasses.dataclass(frozen=True)
class Plan:
    namespace: str
    name: str
    spec: dict[str, Any]  # defaulted, with the local overrides applied
    arms: tuple[Arm, ...]
    overrides: tuple[Override, ...]
    not_run: tuple[str, ...]  # what the file asks for that runs nowhere locally yet

    @property
    def deployment(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def model_name(self) -> str:
        return self.spec["model"]["name"]

    def arm(self, name: str) -> Arm | None:
        return next((a for a in self.arms if a.name == name), None)


def load_resource(path: str | Path) -> dict[str, Any]:
    """The one SpecDecodeDeployment in a YAML file (other kinds in it are skipped); ValueError
    names what is wrong and where."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    found = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(found) != 1:
        kinds = [d.get("kind") if isinstance(d, dict) else type(d).__name__ for d in docs]
        raise ValueError(f"{path}: expected exactly one {KIND} ({API_VERSION}), found {len(found)} "
                         f"(kinds in the file: {kinds})")
    resource = found[0]
    if resource.get("apiVersion") != API_VERSION:
        raise ValueError(f"{path}: apiVersion {resource.get('apiVersion')!r}, expected {API_VERSION!r}")
    name = (resource.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name or ""):
        raise ValueError(f"{path}: metadata.name {name!r} must be a DNS label (lowercase letters, digits, '-')")
    if not isinstance(resource.get("spec"), dict):
        raise ValueError(f"{path}: spec is required (an object)")
    return resource


def model_override(model: str) -> dict[str, Any]:
    """spec.model for `--model`: a bundled or test model by name, or a local file or folder.

    >>> model_override("tiny-random")
    {'name': 'tiny-random', 'uri': 'tiny-random'}
    >>> model_override("/models/SmolLM2-360M-Instruct.Q8_0.gguf")
    {'name': 'smollm2-360m-instruct-q8-0', 'uri': '/models/SmolLM2-360M-Instruct.Q8_0.gguf'}
    """
    if model in BUNDLED_OR_TEST:
        return {"name": model, "uri": model}
    stem = Path(model.rstrip("/")).name.removesuffix(".gguf")
    return {"name": re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-") or "model", "uri": model}


def make_plan(resource: dict[str, Any], source: str = "spec", *, workers_per_arm: int = 1,
              model: str | None = None, redis_url: str = "a local redis-server") -> Plan:
    """The plan for `resource`, or SpecError with every problem.

    The file is judged as written (a cluster would refuse what is refused here); then the
    local overrides apply and each arm's engine.json is judged again with the worker's own
    checker, including whether its weights are on this machine."""
    if workers_per_arm < 1:
        raise ValueError(f"--workers-per-arm must be at least 1, got {workers_per_arm}")
    raw = resource["spec"]
    spec = specs.with_defaults(raw)
    found = specs.problems(spec)
    if found:
        raise SpecError(source, found)
    overrides = _cluster_overrides(raw, workers_per_arm, redis_url)
    if model is not None and model not in (spec["model"]["name"], spec["model"]["uri"]):
        new = model_override(model)
        overrides.append(Override("spec.model", spec["model"], f"{new['name']} ({new['uri']}, --model)"))
        spec = {**spec, "model": new}
    names = ("stable", "canary") if spec.get("canary") else ("stable",)
    arms, problems = [], []
    for arm in names:
        engine = fleet_spec.engine_config(spec, arm)
        cfg = EngineConfig.from_dict(engine, check=False)
        problems += [f"{arm} workers' engine.json: {p}" for p in cfg.problems()]
        if TINY_MODEL not in (cfg.model_name, cfg.model_uri):
            problems += [f"{arm} workers' engine.json: {p}" for p in cfg.file_problems(model_cache())]
        control = fleet_spec.control_config(spec, fleet_spec.FleetState(), arm)
        arms.append(Arm(arm, workers_per_arm, engine, control))
    if problems:
        hint = " (run a model this machine has with --model, e.g. --model smollm2-135m)" \
            if any("no weights here" in p for p in problems) else ""
        raise SpecError(source, [p + hint for p in dict.fromkeys(problems)])
    meta = resource.get("metadata") or {}
    return Plan(namespace=meta.get("namespace") or "default", name=meta["name"], spec=spec, arms=tuple(arms),
                overrides=tuple(overrides), not_run=tuple(_not_run(raw, spec)))


def _cluster_overrides(raw: dict[str, Any], workers: int, redis_url: str) -> list[Override]:
    """Each field of the file (as written, defaults aside) that only means something in a cluster."""
    out = []
    per_arm = f"{workers} worker process{'es' if workers > 1 else ''} per arm (--workers-per-arm)"
    if "replicas" in raw:
        out.append(Override("spec.replicas", raw["replicas"], per_arm))
    if "scaling" in raw:
        out.append(Override("spec.scaling", raw["scaling"], per_arm + ", no autoscaler"))
    canary = raw.get("canary") or {}
    if "replicas" in canary:
        out.append(Override("spec.canary.replicas", canary["replicas"], per_arm))
    if "image" in (canary.get("overrides") or {}):
        out.append(Override("spec.canary.overrides.image", canary["overrides"]["image"],
                            "this environment's `specfleet serve`"))
    if raw.get("redis"):
        out.append(Override("spec.redis", raw["redis"], redis_url))
    source = (raw.get("model") or {}).get("source")
    if source:
        out.append(Override("spec.model.source", source, "the weights on this machine (SPECFLEET_MODEL_CACHE)"))
    if raw.get("strategy"):
        out.append(Override("spec.strategy", raw["strategy"], "ignored (no pods)"))
    for key in ("imagePullSecrets", "nodeSelector", "tolerations"):
        if key in (raw.get("router") or {}):
            out.append(Override(f"spec.router.{key}", raw["router"][key], "ignored (no pods)"))
    template = raw.get("template") or {}
    for key, value in template.items():
        now = {"image": "this environment's `specfleet serve`",
               "resources": "not enforced: the processes share this machine"}.get(key, "ignored (no pods)")
        out.append(Override(f"spec.template.{key}", value, now))
    observability = raw.get("observability") or {}
    if observability.get("otlpEndpoint"):
        out.append(Override("spec.observability.otlpEndpoint", observability["otlpEndpoint"], "traces off"))
    for key in ("serviceMonitor", "prometheusRule"):
        if (observability.get(key) or {}).get("enabled"):
            out.append(Override(f"spec.observability.{key}", observability[key],
                                "none: scrape each process's /metrics on loopback"))
    return out


def _not_run(raw: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """What the file asks of the control loop, which `up` does not run yet: the live state
    stays what the spec starts from."""
    out = []
    canary = spec.get("canary")
    if canary and (canary.get("steps") or (raw.get("canary") or {}).get("analysis")):
        out.append(f"canary steps and analysis: the canary stays at {canary.get('weight', 1)}%")
    if spec.get("slo", {}).get("fallback", {}).get("enabled"):
        out.append(f"the alpha SLO fallback (alphaFloor {spec['slo']['alphaFloor']}): speculation stays on")
    return out


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, (dict, list)):
        text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()
    else:
        text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
