"""What `specfleet up` runs for one SpecDecodeDeployment file: pure, no process started here.

The file is judged as a cluster would judge it (the operator's `with_defaults` and `problems`),
each arm's engine.json and control.json are the ones the operator renders (specfleet_api.fleet_spec),
and the fields that only make sense in a cluster are overridden, each named in an `Override` so
that `up` can say what it changed. The live state the routers and workers follow comes from `state.py`.

A spec with `engine: {name: vllm}` runs vLLM servers in place of workers: one per replica of each
pool the operator would run (specfleet_api.vllm.pools: one per arm and draft method, plus the plain
pool `none`), each with the flags the operator gives its pods (`server_args`) but bound to 127.0.0.1,
loading a Hugging Face folder on this machine, and its model threads on cores of its own
(`server_cpus`). What this machine's vLLM (the CPU build) cannot run is refused, field first.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from specfleet_api import fleet_spec
from specfleet_api import vllm as vllm_api
from specfleet_api.engine_config import (DEFAULT_MODEL_CACHE, WEIGHTED_METHODS, EngineConfig, Problem, model_cache,
                                         uri_path)
from specfleet_api.enums import Device
from specfleet_operator import API_VERSION, KIND
from specfleet_operator import manifests
from specfleet_operator import spec as specs
from specfleet_worker.main import TINY_MODEL

from .vllm import VllmError, VllmServer, check_model_folder

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
class VllmModel:
    """The Hugging Face folder every vLLM server of the fleet loads: `folder`, one on this machine,
    or `export`, a model specfleet's loader reads (the bundled name, a .gguf file) that `up` writes
    as such a folder first (specfleet_local.hf_model: once, then from the cache)."""

    folder: str | None = None
    export: str | None = None


@dataclasses.dataclass(frozen=True)
class VllmServerPlan:
    """One vLLM server of an arm's pool for one draft method (none: the plain pool): the flags
    specfleet_api.vllm.server_args gives the operator's pods for it, on 127.0.0.1 and this
    machine's model folder, its model threads bound to `cpus`."""

    name: str  # <name>-<arm>-<method>-<i>
    arm: str
    method: str
    served_model_name: str
    dtype: str
    speculative: dict[str, Any] | None  # --speculative-config; None for the plain pool
    extra_args: tuple[str, ...]  # engine.vllm.args
    cpus: str  # VLLM_CPU_OMP_THREADS_BIND: the cores its model threads run on

    def server(self, model: str | os.PathLike, *, port: int | None = None, log: Path | None = None,
               venv: Path | None = None) -> VllmServer:
        """The server, not started: `model` is the folder (VllmModel), `port` its OpenAI port."""
        return VllmServer(model, self.speculative, port=port, venv=venv, served_model_name=self.served_model_name,
                          dtype=self.dtype, cpus=self.cpus, log=log, extra_args=self.extra_args)


@dataclasses.dataclass(frozen=True)
class Plan:
    namespace: str
    name: str
    spec: dict[str, Any]  # defaulted, with the local overrides applied
    arms: tuple[Arm, ...]  # with engine vllm, an arm's `workers` are its vLLM servers
    overrides: tuple[Override, ...]
    not_run: tuple[str, ...]  # what the file asks for that runs nowhere locally yet
    engine: str = vllm_api.SPECFLEET  # spec.engine.name
    servers: tuple[VllmServerPlan, ...] = ()  # engine vllm: every server of every pool
    vllm_model: VllmModel | None = None  # engine vllm: the folder the servers load

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


def make_plan(resource: dict[str, Any], source: str = "spec", *, workers_per_arm: int | None = None,
              model: str | None = None, redis_url: str = "a local redis-server",
              cpus: Sequence[int] | None = None, threads: int | None = None) -> Plan:
    """The plan for `resource`, or SpecError with every problem.

    The file is judged as written (a cluster would refuse what is refused here); then the
    local overrides apply and each arm's engine.json is judged again with the worker's own
    checker, including whether its weights are on this machine. workers_per_arm: worker
    processes per arm (default 1; an engine-vllm fleet's pools are sized by the spec). cpus,
    threads: the cores vLLM servers are bound to (default: this process's) and how many each
    (default: an equal share)."""
    if workers_per_arm is not None and workers_per_arm < 1:
        raise ValueError(f"--workers-per-arm must be at least 1, got {workers_per_arm}")
    raw = resource["spec"]
    spec = specs.with_defaults(raw)
    found = specs.problems(spec)
    if found:
        raise SpecError(source, found)
    if vllm_api.engine(spec) == vllm_api.VLLM:
        return _vllm_plan(resource, source, spec, workers_per_arm, model, redis_url, cpus, threads)
    workers_per_arm = workers_per_arm or 1
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


def _cluster_overrides(raw: dict[str, Any], workers: int | None, redis_url: str) -> list[Override]:
    """Each field of the file (as written, defaults aside) that only means something in a cluster.
    workers: the worker processes per arm that replace the replica counts; None keeps them (an
    engine-vllm fleet runs its pools at the spec's sizes)."""
    out = []
    canary = raw.get("canary") or {}
    if workers is not None:
        per_arm = f"{workers} worker process{'es' if workers > 1 else ''} per arm (--workers-per-arm)"
        if "replicas" in raw:
            out.append(Override("spec.replicas", raw["replicas"], per_arm))
        if "scaling" in raw:
            out.append(Override("spec.scaling", raw["scaling"], per_arm + ", no autoscaler"))
        if "replicas" in canary:
            out.append(Override("spec.canary.replicas", canary["replicas"], per_arm))
    if "image" in (canary.get("overrides") or {}):
        out.append(Override("spec.canary.overrides.image", canary["overrides"]["image"],
                            "this environment's `specfleet serve`"))
    if raw.get("redis"):
        out.append(Override("spec.redis", raw["redis"], redis_url))
    source = (raw.get("model") or {}).get("source")
    if source and workers is not None:  # an engine-vllm fleet names its model folder itself (_vllm_model)
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


#: engine.vllm.args a local server cannot take: vLLM's CPU build here is one process a server, its
#: threads bound to one list of cores (VLLM_CPU_OMP_THREADS_BIND), and sizes its KV cache in
#: VLLM_CPU_KVCACHE_SPACE; the flag (`_` for `-` too) and the values it may keep.
LOCAL_VLLM_ARGS = {"tensor-parallel-size": "1", "tp": "1", "pipeline-parallel-size": "1", "pp": "1",
                   "data-parallel-size": "1", "dp": "1", "gpu-memory-utilization": None}


def server_cpus(servers: int, cpus: Sequence[int], per_server: int | None = None) -> list[str]:
    """The cores each of `servers` vLLM servers binds its model threads to (VLLM_CPU_OMP_THREADS_BIND),
    the machine's dealt out in turn, `per_server` each (default: an equal share, at least one).

    Left to itself, vLLM binds one core a physical core and keeps one for its scheduler: on two
    cores, every server on core 0, the second core idle. Dealt out, two servers get a core each and
    a third shares the first's.

    >>> server_cpus(2, [0, 1]), server_cpus(3, [0, 1]), server_cpus(1, [0, 1]), server_cpus(2, [0, 1, 2, 3])
    (['0', '1'], ['0', '1', '0'], ['0,1'], ['0,1', '2,3'])
    >>> server_cpus(2, [4, 5, 6], per_server=2), server_cpus(1, [0, 1], per_server=5)
    (['4,5', '6,4'], ['0,1'])
    """
    cpus = sorted(cpus)
    per = min(len(cpus), per_server or max(1, len(cpus) // max(1, servers)))
    return [",".join(str(cpus[(i * per + j) % len(cpus)]) for j in range(per)) for i in range(servers)]


def _vllm_plan(resource: dict[str, Any], source: str, spec: dict[str, Any], workers_per_arm: int | None,
               model: str | None, redis_url: str, cpus: Sequence[int] | None, threads: int | None) -> Plan:
    """make_plan for engine vllm: a server per replica of each pool, or SpecError with every reason
    this machine cannot run one."""
    raw, meta = resource["spec"], resource.get("metadata") or {}
    problems: list[Problem | str] = []
    if workers_per_arm is not None:
        problems.append("--workers-per-arm: an engine vllm fleet runs the spec's servers in each pool (spec.replicas; "
                        "engine.vllm.pools sizes a pool apart, canary.replicas the canary's), as a cluster does: "
                        "drop the flag")
    if threads is not None and threads < 1:
        problems.append(f"--worker-threads: {threads}; a vLLM server binds at least 1 core")
    overrides = _cluster_overrides(raw, None, redis_url)
    written = (raw.get("engine") or {}).get("vllm") or {}
    for key, now in (("image", "this machine's vLLM CPU build (.venv-vllm, ./dev setup --vllm)"),
                     ("shmSize", "ignored (no container: the servers share this machine's /dev/shm)")):
        if key in written:
            overrides.append(Override(f"spec.engine.vllm.{key}", written[key], now))
    replaced = model is not None and model not in (spec["model"]["name"], spec["model"]["uri"])
    if replaced:
        new = model_override(model)
        overrides.append(Override("spec.model", spec["model"], f"{new['name']} ({new['uri']}, --model)"))
        spec = {**spec, "model": new}
    local_model, said = _vllm_model(spec, raw, from_flag=replaced, problems=problems)
    overrides += said
    names = ("stable", "canary") if spec.get("canary") else ("stable",)
    pools = [p for p in vllm_api.pools(spec) if p.replicas > 0]
    problems += _vllm_local_problems(spec, names, pools)
    if not any(p.role == "stable" for p in pools):
        problems.append(Problem("spec.replicas", "0 servers in every pool of the stable arm: nothing would serve "
                                                 "(set spec.replicas, or engine.vllm.pools.<method>.replicas)"))
    if problems:
        raise SpecError(source, list(dict.fromkeys(str(p) for p in problems)))
    conf = vllm_api.settings(spec)
    planned = [(pool, i) for pool in pools for i in range(pool.replicas)]
    bound = server_cpus(len(planned), cpus if cpus is not None else sorted(os.sched_getaffinity(0)), threads)
    servers = []
    for (pool, i), cores in zip(planned, bound):
        arm = fleet_spec.effective_spec(spec, pool.role)
        servers.append(VllmServerPlan(
            name=f"{meta['name']}-{pool.role}-{pool.method}-{i}", arm=pool.role, method=pool.method,
            served_model_name=arm["model"]["name"], dtype=vllm_api.dtype(arm, gpus=False),
            speculative=vllm_api.speculative_config(arm, pool.method, conf["eagleMethod"],
                                                    (conf["promptLookupMin"], conf["promptLookupMax"])),
            extra_args=tuple(conf["args"]), cpus=cores))
    arms = tuple(Arm(name, sum(s.arm == name for s in servers), fleet_spec.engine_config(spec, name),
                     fleet_spec.control_config(spec, fleet_spec.FleetState(), name)) for name in names)
    return Plan(namespace=meta.get("namespace") or "default", name=meta["name"], spec=spec, arms=arms,
                overrides=tuple(overrides), not_run=tuple(_not_run(raw, spec)), engine=vllm_api.VLLM,
                servers=tuple(servers), vllm_model=local_model)


def _vllm_model(spec: dict[str, Any], raw: dict[str, Any], from_flag: bool,
                problems: list[Problem | str]) -> tuple[VllmModel | None, list[Override]]:
    """The Hugging Face folder the servers load, and the override that says where it comes from:
    `--model` (a folder as is; the bundled name or a .gguf file exported), else model.uri's folder
    on this machine (a relative one under SPECFLEET_MODEL_CACHE, where model.source would mount
    it), else the bundled model when spec.model.name names it, exported. Problems are appended."""
    model = spec["model"]
    uri, name = model["uri"], model["name"]
    exportable = tuple(m for m in BUNDLED_OR_TEST if m != TINY_MODEL)
    if from_flag:
        path = Path(uri).expanduser()
        if uri == TINY_MODEL:
            problems.append(f"--model {uri}: the random test model has no tokenizer vLLM loads; run "
                            f"{exportable[0]}, a .gguf file or a Hugging Face folder")
        elif uri in exportable or (path.suffix == ".gguf" and path.is_file()):
            return VllmModel(export=uri), []
        elif path.is_dir():
            return _folder(path, "--model", problems), []
        else:
            problems.append(f"--model {uri}: no such file or folder")
        return None, []
    written = vllm_api.model_path(spec)
    here = written
    if written.startswith(DEFAULT_MODEL_CACHE.rstrip("/") + "/"):  # model.source's mount: SPECFLEET_MODEL_CACHE here
        here = str(model_cache() / written.removeprefix(DEFAULT_MODEL_CACHE.rstrip("/") + "/"))
    source = (raw.get("model") or {}).get("source")
    if Path(here).is_dir():
        said = [Override("spec.model.source", source, f"the folder on this machine ({here})")] if source else []
        return _folder(Path(here), "spec.model.uri", problems), said
    if name in exportable:
        now = (f"the bundled {name} as a Hugging Face folder (`specfleet export-hf`, once, into specfleet's "
               f"cache): no folder at {here}")
        return VllmModel(export=name), [Override("spec.model.uri", uri, now)] + \
            ([Override("spec.model.source", source, "the bundled model (spec.model.uri)")] if source else [])
    problems.append(Problem("spec.model.uri", f"no Hugging Face folder at {here} on this machine for the vLLM servers; "
                                              f"run one with --model FOLDER (or a .gguf file, or {exportable[0]})"))
    return None, []


def _folder(path: Path, field: str, problems: list[Problem | str]) -> VllmModel | None:
    try:
        check_model_folder(path)
    except VllmError as e:
        problems.append(f"{field}: {e}")
        return None
    return VllmModel(folder=str(path.resolve()))


def _vllm_local_problems(spec: dict[str, Any], arms: Sequence[str], pools: Sequence[vllm_api.Pool]) -> list[Problem]:
    """What this machine's vLLM (the CPU build, one process a server) cannot run, by field: a GPU
    asked for (the operator would run vLLM's CUDA image), an engine.vllm.args flag of several
    processes or of a GPU, a draft folder that is not here."""
    out: list[Problem] = []
    for name in arms:
        arm = fleet_spec.effective_spec(spec, name)
        resources = manifests.worker_resources((arm.get("template") or {}).get("resources")
                                               or manifests.VLLM_RESOURCES, arm["device"])
        if arm["device"] != Device.CPU and manifests.asks_for_gpus(resources):  # the operator's choice of build
            field = "spec.device" if arm["device"] == Device.CUDA else "spec.template.resources"
            out.append(Problem(field, "asks for a GPU (vLLM's CUDA build); `specfleet up` runs vLLM's CPU build "
                                      "on this machine: set device cpu (or auto without nvidia.com/gpu in "
                                      "template.resources) to run it here"))
            break
    args = vllm_api.settings(spec)["args"]
    for i, arg in enumerate(args):
        flag, eq, value = arg.lstrip("-").replace("_", "-").partition("=")
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if arg.startswith("-") and flag in LOCAL_VLLM_ARGS and value != LOCAL_VLLM_ARGS[flag]:
            out.append(Problem(f"spec.engine.vllm.args[{i}]",
                               f"{arg}: a local vLLM server is one CPU process, its threads bound to cores "
                               "of its own, its KV cache set by VLLM_CPU_KVCACHE_SPACE; drop it to run here"))
    over = (spec.get("canary") or {}).get("overrides") or {}
    for pool in pools:
        if pool.method in WEIGHTED_METHODS:
            arm = fleet_spec.effective_spec(spec, pool.role)
            folder = uri_path(arm["draft"]["uri"]) or arm["draft"]["uri"]
            field = ("spec.canary.overrides.draft.uri" if pool.role == "canary" and "uri" in (over.get("draft") or {})
                     else "spec.draft.uri")
            if not Path(folder).is_dir():
                out.append(Problem(field, f"no folder at {folder} on this machine: the {pool.role} arm's "
                                          f"{pool.method} pool loads its draft from there"))
    return list(dict.fromkeys(out))


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
