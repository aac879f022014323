"""The SpecDecodeDeployment spec: the CRD's defaults applied as the API server would, the
semantic checks that the CRD's CEL rules make (for resources that slip past an API server without
CEL, or were stored before a rule existed), and each role's engine.json judged by the worker's own
checker (specfleet_api), so that nothing a worker would refuse reaches a pod. Pure: dicts in,
dicts and Problems out.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.resources
from typing import Any

import yaml

from specfleet_api import redis_auth, vllm
from specfleet_api.engine_config import (
    INVALID, UNSUPPORTED, WEIGHTED_METHODS, EngineConfig, Problem, rejection_reason, uri_path,
)
from specfleet_api.durations import parse_duration
from specfleet_api.enums import METHODS, PROMPT_TYPES
from specfleet_api.fleet_spec import engine_config

from . import manifests

__all__ = ["INVALID", "UNSUPPORTED", "Problem", "crd", "is_percentage", "parse_duration", "problems",
           "rejection_reason", "served_problems", "spec_schema", "url_has_password", "with_defaults"]



@functools.cache
def crd() -> dict[str, Any]:
    """The packaged copy of crds/ (byte-identical, checked by a test)."""
    text = importlib.resources.files(__package__).joinpath("crd.yaml").read_text()
    return yaml.safe_load(text)


def spec_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def with_defaults(value: Any, schema: dict[str, Any] | None = None) -> Any:
    """Return a copy of `value` with the schema's defaults filled in, recursively.

    Mirrors the API server: a missing property with a default gets it, then defaulting
    descends into it, so `draft: {}` defaults to `draft: {method: ngram}`.
    >>> with_defaults({"model": {"name": "m", "uri": "u"}, "replicas": 1})["draft"]
    {'method': 'ngram'}
    """
    schema = spec_schema() if schema is None else schema
    value = copy.deepcopy(value)
    return _default(value, schema)


def _default(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value.keys() - schema.get("properties", {}).keys():
                value[key] = _default(value[key], extra)
    elif isinstance(value, list) and "items" in schema:
        value = [_default(item, schema["items"]) for item in value]
    return value


def problems(spec: dict[str, Any]) -> list[Problem]:
    """Every problem in a (defaulted) spec, in the CRD's words; [] when a worker would serve it.

    First the CRD's x-kubernetes-validations (tests hold these and the CEL rules to the same
    verdicts); when those pass, each role's engine.json as the worker's checker judges it: the
    values the CRD reserves (CEL rejects them too) and the model URIs and tokenizer it does not
    serve yet (only the operator judges those), each a Problem with reason Unsupported. With
    engine vllm the CEL rules also refuse what a vLLM server cannot do (specfleet_api.vllm), and
    engine.json's checks still judge the methods, precisions and URIs the pools are built from.
    """
    out: list[Problem] = []
    model = spec.get("model") or {}
    for key in ("name", "uri"):
        if not model.get(key):
            out.append(Problem(f"spec.model.{key}", "is required"))
    draft, spec_k = spec.get("draft", {}), spec.get("speculation", {})
    method = draft.get("method")
    if method not in METHODS:
        out.append(Problem("spec.draft.method", f"{method!r} is not one of {', '.join(METHODS)}"))
    if ("replicas" in spec) == ("scaling" in spec):
        out.append(Problem("spec", "set exactly one of spec.replicas and spec.scaling"))
    scaling = spec.get("scaling")
    if scaling and scaling.get("minReplicas", 1) > scaling.get("maxReplicas", 0):
        out.append(Problem("spec.scaling", "scaling.minReplicas must not exceed scaling.maxReplicas"))
    k_min, k_init, k_max = spec_k.get("kMin"), spec_k.get("kInitial"), spec_k.get("kMax")
    if not (isinstance(k_min, int) and isinstance(k_init, int) and isinstance(k_max, int)):
        out.append(Problem("spec.speculation", "kMin, kInitial and kMax must be integers"))
    elif not k_min <= k_init <= k_max:
        out.append(Problem("spec.speculation",
                           f"speculation must satisfy kMin <= kInitial <= kMax (got {k_min}, {k_init}, {k_max})"))
    if method in WEIGHTED_METHODS and "uri" not in draft:
        out.append(Problem("spec.draft.uri", "draft.uri is required for draft.method draft-model, eagle and medusa"))
    routes = (spec.get("routing") or {}).get("byPromptType", {})
    if not set(routes) <= set(PROMPT_TYPES):
        out.append(Problem("spec.routing.byPromptType",
                           f"routing.byPromptType keys must be prompt types: {', '.join(PROMPT_TYPES)}"))
    for prompt_type, routed in routes.items():
        if routed not in METHODS:
            out.append(Problem(f"spec.routing.byPromptType.{prompt_type}", f"{routed!r} is not a draft method"))
    out += _source_problems(model)
    strategy = spec.get("strategy") or {}
    rolling = strategy.get("rollingUpdate")
    if rolling and strategy.get("type") != "RollingUpdate":
        out.append(Problem("spec.strategy.rollingUpdate", "strategy.rollingUpdate is for strategy.type RollingUpdate only"))
    if rolling and {str(rolling.get("maxSurge")), str(rolling.get("maxUnavailable"))} <= {"0", "0%"}:
        out.append(Problem("spec.strategy.rollingUpdate", "strategy.rollingUpdate.maxSurge and maxUnavailable cannot "
                                                          "both be 0 (the rollout could never move)"))
    resources = (spec.get("template") or {}).get("resources") or {}
    gpu_request = resources.get("requests", {}).get(manifests.GPU_RESOURCE)
    if gpu_request is not None and str(gpu_request) != str(resources.get("limits", {}).get(manifests.GPU_RESOURCE)):
        out.append(Problem("spec.template.resources", "template.resources.requests nvidia.com/gpu must equal limits "
                                                      "nvidia.com/gpu (GPUs are not overcommitted)"))
    out += _canary_problems(spec.get("canary"))
    redis = spec.get("redis")
    if redis is not None and ("url" in redis) == ("secretRef" in redis):
        out.append(Problem("spec.redis", "set exactly one of redis.url and redis.secretRef"))
    if redis is not None and url_has_password(redis.get("url")):
        out.append(Problem("spec.redis.url", REDIS_URL_PASSWORD_MESSAGE))  # never the URL: it holds the password
    for field, text in _durations(spec):
        try:
            parse_duration(text)
        except ValueError as exc:
            out.append(Problem(field, str(exc)))
    slo = spec.get("slo") or {}
    if str(slo.get("window", "5m")).strip("0msh") == "":  # only zeros and units: 0s, 00m, 0h0m
        out.append(Problem("spec.slo.window", "slo.window must be longer than 0 (the workers publish windows of "
                                              "this length)"))
    fallback = slo.get("fallback") or {}
    if fallback.get("enabled", True) and fallback.get("probeShare", 5) <= 0:
        out.append(Problem("spec.slo.fallback.probeShare",
                           "slo.fallback.probeShare must be above 0 while fallback is enabled (the probes are what "
                           "lets a fallen-back prompt type recover)"))
    out += vllm.problems(spec)  # what vLLM cannot do, with engine vllm (the CEL rules' words)
    return out or served_problems(spec)


def served_problems(spec: dict[str, Any]) -> list[Problem]:
    """What the worker's checker finds in each role's engine.json, named by spec field: a value
    the canary overrides is reported there, the rest once, under spec.

    >>> [str(p) for p in served_problems(with_defaults({"model": {"name": "m", "uri": "hf://org/m"},
    ...                                                 "replicas": 1, "quantization": "fp8"}))]
    ["spec.quantization: quantization 'fp8' is not supported yet; supported: none, int8", \
"spec.model.uri: model.uri scheme 'hf' is not supported yet; supported: file, gguf (or a bare path)"]
    """
    out: list[Problem] = []
    if vllm.engine(spec) not in vllm.SERVED_ENGINES:  # an engine the CRD names before the fleet serves it
        out.append(Problem("spec.engine.name", f"engine {vllm.engine(spec)!r} is not served yet; served: "
                                               f"{', '.join(vllm.SERVED_ENGINES)}", UNSUPPORTED))
    overrides = (spec.get("canary") or {}).get("overrides", {})
    for role in ("stable", "canary") if spec.get("canary") else ("stable",):
        try:
            found = EngineConfig.from_dict(engine_config(spec, role), check=False).problems()
        except (KeyError, TypeError, ValueError) as exc:
            return [Problem("spec", f"cannot render the {role} workers' engine.json: {exc}")]
        for p in found:
            problem = dataclasses.replace(p, field=f"spec.{p.field}")
            if role == "canary" and problem not in out:
                # only the canary has it: its overrides (or what they combine with) caused it
                canary_field = f"spec.canary.overrides.{p.field}"
                problem = dataclasses.replace(p, field=canary_field) if _has_path(overrides, p.field) else \
                    dataclasses.replace(p, field="spec.canary.overrides", message=f"{p.message} (with the overrides)")
            if problem not in out:
                out.append(problem)
    return out


REDIS_URL_WITH_PASSWORD, url_has_password = redis_auth.URL_WITH_PASSWORD, redis_auth.url_has_password
REDIS_URL_PASSWORD_MESSAGE = ("redis.url holds a password, which would be a plain value in every pod template: put "
                              "the URL in a Secret and use spec.redis.secretRef, or drop spec.redis to use the "
                              "install's default Redis")


def _has_path(obj: dict[str, Any], dotted: str) -> bool:
    for key in dotted.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return False
        obj = obj[key]
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_percentage(weight: float) -> bool:
    """Whether a canary weight has at most two decimals, judged as the CRD's CEL rule does (an
    int-rounded hundredfold within 1e-6, so that 0.07's binary 7.000000000000001 passes).

    >>> is_percentage(0.07), is_percentage(12.5), is_percentage(100), is_percentage(1.005)
    (True, True, True, False)
    """
    hundredfold = float(weight) * 100.0
    return abs(float(int(hundredfold + 0.5)) - hundredfold) < 1e-6


#: The kinds of Volume spec.model.source.volume may be: those the restricted Pod Security Standard allows
#: (less emptyDir, which would hold no weights, and downwardAPI).
SOURCE_VOLUME_KINDS = ("persistentVolumeClaim", "csi", "ephemeral", "configMap", "secret", "projected")


def _source_problems(model: dict[str, Any]) -> list[Problem]:
    """spec.model.source as its CEL rules judge it, and a model.uri that looks outside the mount.

    >>> [str(p) for p in _source_problems({"uri": "/models/m.gguf", "source": {"pvc": {"claimName": "w"}}})]
    ['spec.model.uri: with model.source the weights are mounted at /var/cache/specfleet: name a path relative to it (m.gguf) or under it, not /models/m.gguf']
    """
    source = model.get("source")
    if source is None:
        return []
    kinds = [k for k in ("pvc", "initContainer", "volume") if k in source]
    if len(kinds) != 1:
        return [Problem("spec.model.source",
                        "set exactly one of model.source.pvc, model.source.initContainer and model.source.volume")]
    out = []
    sub_path = (source.get("pvc") or {}).get("subPath")
    if sub_path is not None and (sub_path.startswith("/") or ".." in sub_path.split("/")):
        out.append(Problem("spec.model.source.pvc.subPath", "model.source.pvc.subPath must be a relative path without '..'"))
    if "volume" in source and sum(k in source["volume"] for k in SOURCE_VOLUME_KINDS) != 1:
        out.append(Problem("spec.model.source.volume",
                           f"model.source.volume: set exactly one of {', '.join(SOURCE_VOLUME_KINDS[:-1])} "
                           f"and {SOURCE_VOLUME_KINDS[-1]}"))
    path = uri_path(model.get("uri") or "")
    cache = manifests.MODEL_CACHE
    if path and path.startswith("/") and not path.startswith(cache.rstrip("/") + "/"):
        out.append(Problem("spec.model.uri", f"with model.source the weights are mounted at {cache}: name a path "
                                             f"relative to it ({path.rsplit('/', 1)[-1]}) or under it, not {path}"))
    return out


def _canary_problems(canary: dict[str, Any] | None) -> list[Problem]:
    if canary is None:
        return []
    out = []
    weights = [step.get("weight") for step in canary.get("steps", [])]
    start = canary.get("weight", 1)
    if not all(_is_number(w) and 0.01 <= w <= 100 for w in [start, *weights]):
        out.append(Problem("spec.canary", "canary weights must be between 0.01 and 100"))
    elif not is_percentage(start):
        out.append(Problem("spec.canary.weight",
                           "canary.weight must be a percentage with at most two decimals (0.01 to 100)"))
    elif not all(is_percentage(w) for w in weights):
        out.append(Problem("spec.canary.steps",
                           "canary.steps weights must be percentages with at most two decimals (0.01 to 100)"))
    elif weights:
        if not all(w > canary.get("weight", 1) for w in weights):
            out.append(Problem("spec.canary.steps", "canary.steps weights must rise above canary.weight"))
        if weights != sorted(weights):
            out.append(Problem("spec.canary.steps", "canary.steps weights must be rising"))
        if len(set(weights)) != len(weights):
            out.append(Problem("spec.canary.steps", "canary.steps weights must be distinct (strictly rising)"))
    over = canary.get("overrides", {}).get("speculation", {})
    if "kMin" in over and "kMax" in over and over["kMin"] > over["kMax"]:
        out.append(Problem("spec.canary.overrides.speculation",
                           "canary.overrides.speculation.kMin must not exceed kMax"))
    for i, metric in enumerate(canary.get("analysis", {}).get("metrics", [])):
        if "min" not in metric and "max" not in metric:
            out.append(Problem(f"spec.canary.analysis.metrics[{i}]", "a canary metric needs min or max"))
        elif "min" in metric and "max" in metric and metric["min"] > metric["max"]:
            out.append(Problem(f"spec.canary.analysis.metrics[{i}]", "a canary metric's min must not exceed its max"))
    return out


def _durations(spec: dict[str, Any]) -> list[tuple[str, str]]:
    slo, canary = spec.get("slo", {}), spec.get("canary") or {}
    found = [("spec.slo.window", slo.get("window")),
             ("spec.slo.fallback.recoverAfter", slo.get("fallback", {}).get("recoverAfter"))]
    if canary:
        found += [("spec.canary.analysis.interval", canary.get("analysis", {}).get("interval")),
                  ("spec.canary.pause", canary.get("pause")),
                  ("spec.canary.progressDeadline", canary.get("progressDeadline"))]
        found += [(f"spec.canary.steps[{i}].pause", s.get("pause")) for i, s in enumerate(canary.get("steps", []))]
    return [(field, text) for field, text in found if text is not None]
