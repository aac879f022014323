"""A SpecDecodeDeployment served by vLLM (spec.engine.name vllm): which pools each arm runs, each
pool's OpenAI server command (its --speculative-config from the spec), and what vLLM cannot do
that the spec can ask, refused as Problems in the words of the CRD's CEL rules (docs/vllm.md).

A vLLM server fixes its draft method and K when it starts, for every request it serves: so each arm
runs one pool of servers per draft method its routing can name (`pool_methods`), plus a plain one
(no speculative config), fallback's target; the router picks the pool per request. K is
speculation.kMax, which a spec for vLLM holds equal to kInitial under kPolicy fixed: the one K that
means the same on specfleet's workers and on vLLM. What only specfleet's engine does per request
(K policies, trees, the latency guard, K ceilings per prompt type) is refused, not ignored.

Pure and torch-free (dicts in, dicts and dataclasses out), so the operator's children and checks,
and `specfleet up` once it runs vLLM, read one set of rules. `spec` is defaulted as the API server
defaults it.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from .engine_config import DEFAULT_MODEL_CACHE, WEIGHTED_METHODS, Problem, uri_path
from .enums import METHODS, Method
from .fleet_spec import FleetState, effective_spec, replica_counts, selects_methods, served_methods

SPECFLEET, VLLM = "specfleet", "vllm"
#: spec.engine.name: which engine serves the fleet's requests (the CRD's enum, checked by a test).
ENGINES = (SPECFLEET, VLLM)
#: The engines a fleet is served on (specfleet_operator.spec.served_problems refuses another, reason
#: Unsupported): both. A vLLM fleet's router sends each request to the pool of the method its routing
#: table names (`--discover-vllm`, rendered by the operator).
SERVED_ENGINES = ENGINES

#: The upstream OpenAI server images, pinned: CUDA for pods that ask for a GPU, the CPU build
#: (vllm-cpu) for the others. The operator's defaults (its --vllm-image and --vllm-cpu-image, the
#: chart's vllm.image and vllm.cpuImage) replace them; a fleet's engine.vllm.image replaces those.
GPU_IMAGE = "vllm/vllm-openai:v0.32.0"
CPU_IMAGE = "vllm/vllm-openai-cpu:v0.32.0-x86_64"
#: The server as a module: the `vllm` console script fails under the vllm-cpu package.
COMMAND = ("python3", "-m", "vllm.entrypoints.openai.api_server")
PORT = 8000  # vLLM's default: the OpenAI API, /health and /metrics on one port
#: The /dev/shm a server gets (engine.vllm.shmSize's default, the CRD's, checked by a test): PyTorch
#: moves tensors between a server's processes through it, and a container's default is 64 MiB.
SHM_SIZE = "2Gi"
#: engine.vllm.ngram's defaults: the n-gram lengths specfleet's own proposer matches (1 to 4), so
#: draft.method ngram looks up the same n-grams on both engines.
PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX = 1, 4
#: vLLM's method for draft.method eagle (engine.vllm.eagleMethod): the head's format decides.
EAGLE_METHODS = ("eagle", "eagle3")
#: Per-request acceptance in each answer's metrics.speculative_decoding, which the router reads.
SPEC_METRICS = ("--per-request-spec-decode-metrics", "summary")
#: Per-request timings in each answer's metrics (time to first token, the decode's time): every pool
#: sends them, the plain pool's being what a speculative pool's speedup is measured against
#: (specfleet_router.vllm_evidence).
TIMING_METRICS = ("--enable-per-request-metrics",)
#: The server flags the operator sets, each from the spec (engine.vllm.args may set none of them, nor
#: an abbreviation argparse would expand to one); and their short forms.
OWNED_FLAGS = ("model", "served-model-name", "speculative-config", "per-request-spec-decode-metrics", "dtype",
               "quantization", "host", "port", "config", "enable-per-request-metrics", "disable-log-stats")
OWNED_SHORT = ("q", "sc")
_DRAFT_METHOD = {Method.NGRAM.value: "ngram", Method.DRAFT_MODEL.value: "draft_model",
                 Method.MEDUSA.value: "medusa"}  # vLLM's "method" per draft method (eagle: EAGLE_METHODS)


def _prefixes(flag: str) -> str:
    """A regex of every non-empty prefix of `flag`, `_` for `-` as vLLM's parser allows.

    >>> _prefixes("a-b")
    'a(?:[-_](?:b)?)?'
    """
    out = ""
    for ch in reversed(flag):
        out = ("[-_]" if ch == "-" else re.escape(ch)) + (f"(?:{out})?" if out else "")
    return out


#: An argument that sets an owned flag: `--flag`, `--flag=v`, `--flag.key v` (vLLM's JSON keys), any
#: argparse abbreviation of it, with `_` for `-`; or an owned short form. The CRD's CEL rule holds
#: this regex (checked by a test).
OWNED_ARG = (f"^(--(?:{'|'.join(_prefixes(f) for f in OWNED_FLAGS)})([=.].*)?"
             f"|-(?:{'|'.join(OWNED_SHORT)}).*)$")
ARGS = (f"engine.vllm.args: an argument sets what the operator sets from the spec "
        f"({', '.join('--' + f for f in OWNED_FLAGS)}): drop it")


def owned_arg(arg: str) -> bool:
    """Whether an engine.vllm.args entry sets a flag the operator owns.

    >>> [owned_arg(a) for a in ("--max-model-len", "--speculative_config.method", "--specul", "-q", "--model-impl")]
    [False, True, True, True, False]
    """
    return re.match(OWNED_ARG, arg) is not None


def engine(spec: dict[str, Any]) -> str:
    """The engine that serves the fleet: spec.engine.name, specfleet when unset.

    >>> engine({}), engine({"engine": {"name": "vllm"}})
    ('specfleet', 'vllm')
    """
    return (spec.get("engine") or {}).get("name", SPECFLEET)


def settings(spec: dict[str, Any]) -> dict[str, Any]:
    """spec.engine.vllm with its defaults (the CRD defaults it only where it is written)."""
    vllm = (spec.get("engine") or {}).get("vllm") or {}
    ngram = vllm.get("ngram") or {}
    return {"image": vllm.get("image"), "args": list(vllm.get("args") or []),
            "eagleMethod": vllm.get("eagleMethod", EAGLE_METHODS[0]), "shmSize": vllm.get("shmSize", SHM_SIZE),
            "promptLookupMin": ngram.get("promptLookupMin", PROMPT_LOOKUP_MIN),
            "promptLookupMax": ngram.get("promptLookupMax", PROMPT_LOOKUP_MAX),
            "pools": {m: p["replicas"] for m, p in (vllm.get("pools") or {}).items() if "replicas" in p}}


def _arm_methods(arm: dict[str, Any]) -> tuple[str, ...]:
    """What an arm (its effective spec) can serve: ngram and plain decoding always, and the one
    weighted method whose draft.uri it holds."""
    method = arm["draft"]["method"]
    return (Method.NGRAM.value, Method.NONE.value) + ((method,) if method in WEIGHTED_METHODS else ())


def pool_methods(spec: dict[str, Any], role: str = "stable", state: FleetState = FleetState()) -> tuple[str, ...]:
    """The draft methods an arm runs a pool of vLLM servers for, in METHODS order: its draft.method,
    what its routing names (routing.default, byPromptType), what the loop may choose among when it
    chooses (fleet_spec.served_methods), and none, always: the plain pool, fallback's target.

    >>> s = {"draft": {"method": "eagle"}, "routing": {"byPromptType": {"code": "ngram"}}}
    >>> pool_methods(s), pool_methods({**s, "routing": {"select": {"enabled": False}}})
    (('ngram', 'eagle', 'none'), ('eagle', 'none'))
    >>> pool_methods({"draft": {"method": "none"}})
    ('none',)
    """
    arm = effective_spec(spec, role, state)
    routing = arm.get("routing") or {}
    named = {arm["draft"]["method"], routing.get("default", arm["draft"]["method"]),
             *(routing.get("byPromptType") or {}).values(), Method.NONE.value}
    if selects_methods(spec, state):
        named.update(served_methods(spec, role, state))
    return tuple(m for m in METHODS if m in named and m in _arm_methods(arm))


def speculative_config(arm: dict[str, Any], method: str, eagle_method: str = EAGLE_METHODS[0],
                       lookup: tuple[int, int] = (PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX)) -> dict[str, Any] | None:
    """vLLM's --speculative-config for a pool of `method` in an arm (its effective spec); None for
    the plain pool. K is speculation.kMax; a draft's folder is draft.uri's path.

    >>> arm = {"draft": {"method": "eagle", "uri": "file:///heads/e"}, "speculation": {"kMax": 3}}
    >>> speculative_config(arm, "ngram")
    {'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_max': 4, 'prompt_lookup_min': 1}
    >>> speculative_config(arm, "eagle", "eagle3"), speculative_config(arm, "none")
    ({'method': 'eagle3', 'model': '/heads/e', 'num_speculative_tokens': 3}, None)
    """
    if method == Method.NONE.value:
        return None
    out: dict[str, Any] = {"method": eagle_method if method == Method.EAGLE.value else _DRAFT_METHOD[method],
                           "num_speculative_tokens": arm["speculation"]["kMax"]}
    if method == Method.NGRAM.value:
        out.update(prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1])
    else:
        out["model"] = uri_path(arm["draft"]["uri"])
    return dict(sorted(out.items()))


def model_path(arm: dict[str, Any]) -> str:
    """The folder vLLM loads the target from: model.uri's path, a relative one under the model
    cache (where model.source mounts the weights).

    >>> model_path({"model": {"uri": "qwen"}}), model_path({"model": {"uri": "file:///models/qwen"}})
    ('/var/cache/specfleet/qwen', '/models/qwen')
    """
    path = uri_path(arm["model"]["uri"]) or arm["model"]["uri"]
    return path if path.startswith("/") else f"{DEFAULT_MODEL_CACHE}/{path}"


def image(spec: dict[str, Any], gpus: bool, gpu_image: str = GPU_IMAGE, cpu_image: str = CPU_IMAGE) -> str:
    """engine.vllm.image, else the default image for pods with or without GPUs (`gpu_image`,
    `cpu_image`: the operator's, the pinned upstream ones unless it was given others).

    >>> image({}, True), image({}, False, cpu_image="registry.local/vllm-cpu:0.32")
    ('vllm/vllm-openai:v0.32.0', 'registry.local/vllm-cpu:0.32')
    >>> image({"engine": {"vllm": {"image": "mine:1"}}}, True, "theirs:1")
    'mine:1'
    """
    return settings(spec)["image"] or (gpu_image if gpus else cpu_image)


def dtype(arm: dict[str, Any], gpus: bool) -> str:
    """vLLM's --dtype: the spec's, auto as specfleet means it (bfloat16 on a GPU, float32 on the CPU;
    vLLM's own auto follows the checkpoint instead)."""
    value = arm["dtype"]
    return ("bfloat16" if gpus else "float32") if value == "auto" else value


def server_args(spec: dict[str, Any], arm: dict[str, Any], method: str, gpus: bool) -> list[str]:
    """The server's arguments for a pool of `method` in an arm (`arm`: its effective spec): the
    flags the operator owns, then engine.vllm.args."""
    conf = settings(spec)
    args = ["--model", model_path(arm), "--served-model-name", arm["model"]["name"], "--host", "0.0.0.0",
            "--port", str(PORT), "--dtype", dtype(arm, gpus), *TIMING_METRICS]
    speculative = speculative_config(arm, method, conf["eagleMethod"],
                                     (conf["promptLookupMin"], conf["promptLookupMax"]))
    if speculative is not None:
        args += ["--speculative-config", json.dumps(speculative, separators=(",", ":")), *SPEC_METRICS]
    return args + conf["args"]


@dataclasses.dataclass(frozen=True)
class Pool:
    """One pool: an arm's vLLM servers for one draft method (none: the plain pool)."""

    role: str
    method: str
    replicas: int


def pools(spec: dict[str, Any], state: FleetState = FleetState()) -> list[Pool]:
    """Every pool the fleet runs now: the stable arm's, sized spec.replicas (engine.vllm.pools sets
    a method's own), then the canary's while spec.canary is set, each canary.replicas (0 once the
    run ended, as the canary's workers).

    >>> s = {"draft": {"method": "ngram"}, "replicas": 3, "canary": {"replicas": 1},
    ...      "engine": {"name": "vllm", "vllm": {"pools": {"none": {"replicas": 1}}}}}
    >>> [(p.role, p.method, p.replicas) for p in pools(s)]
    [('stable', 'ngram', 3), ('stable', 'none', 1), ('canary', 'ngram', 1), ('canary', 'none', 1)]
    """
    stable_n, canary_n = replica_counts(spec, state)
    sizes = settings(spec)["pools"]
    out = [Pool("stable", m, sizes.get(m, stable_n or 0)) for m in pool_methods(spec, "stable", state)]
    if spec.get("canary"):
        out += [Pool("canary", m, canary_n) for m in pool_methods(spec, "canary", state)]
    return out


# What vLLM cannot do that a spec may ask: each the message of one CEL rule in the CRD, which
# holds a vLLM spec to the same verdicts (tests evaluate both).
K_POLICY = ("with engine vllm, speculation.kPolicy must be fixed (in canary.overrides too): a vLLM server drafts "
            "the same K for every request, so no policy can move K per request; specfleet sets K per pool")
K_STATIC = ("with engine vllm, speculation.kInitial must equal speculation.kMax, at least 1 (in canary.overrides "
            "too): the K every vLLM server of the arm drafts at each step (num_speculative_tokens)")
TREE = ("with engine vllm, speculation.tree must be left unset (in canary.overrides too): a vLLM server verifies "
        "one chain of num_speculative_tokens draft tokens per step")
LATENCY_GUARD = ("with engine vllm, speculation.latencyGuard must be left unset (in canary.overrides too): its "
                 "account per request needs specfleet's scheduler")
K_TUNING = ("with engine vllm, speculation.kTuning cannot be enabled: its K ceiling per prompt type needs K set "
            "per request, and vLLM fixes K per server")
NGRAM = ("with engine vllm, draft.ngram must keep corpusTokens 0 and mix false, and canary.overrides.draft.ngram "
         "be unset: vLLM's n-gram proposer searches the request's own context, one method at a time")
QUANTIZATION = ("with engine vllm, quantization must be none (in canary.overrides too): vLLM reads a quantized "
                "checkpoint's method from its config; quantizing at load is specfleet's worker's")
SCALING = ("with engine vllm, spec.scaling is not served yet: set spec.replicas (engine.vllm.pools sizes a pool "
           "apart)")
IMAGE = ("with engine vllm, template.image and canary.overrides.image must be left unset (they name specfleet's "
         "worker image): set the vLLM image in engine.vllm.image")
ROUTES = ("with engine vllm, routing may name only ngram, none and the arm's draft.method (the canary's too): each "
          "routed method is a pool of vLLM servers, and a pool of draft-model, eagle or medusa loads that arm's "
          "draft.uri")
GGUF = "with engine vllm, model.uri must name a Hugging Face folder (config.json and safetensors), not a .gguf file"
MODEL_PATH = ("with engine vllm and no model.source, model.uri must be an absolute path in the vLLM image: a "
              "relative path names the model cache, which only model.source fills")
DRAFT_URI = ("with engine vllm, draft.uri (and canary.overrides.draft.uri) must be the absolute path of a Hugging "
             "Face folder, not a .gguf file (with model.source, a folder under /var/cache/specfleet)")
ENGINE_VLLM = "engine.vllm is read only with engine.name vllm"
LOOKUP = "engine.vllm.ngram.promptLookupMin must not exceed promptLookupMax"
POOL_KEYS = f"engine.vllm.pools keys must be draft methods: {', '.join(METHODS)}"
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://")
_ABSOLUTE = re.compile(r"(file://)?/")


def _remote(uri: str) -> bool:
    """A scheme other than file and gguf: not a path; the operator's Unsupported judges it."""
    return _SCHEME.match(uri) is not None and not uri.startswith(("file://", "gguf://"))


def _draft_uri_ok(uri: str) -> bool:
    return _remote(uri) or (_ABSOLUTE.match(uri) is not None and not uri.endswith(".gguf"))


def problems(spec: dict[str, Any]) -> list[Problem]:
    """What vLLM cannot serve in a (defaulted) spec with engine vllm, named by field: a value the
    canary's overrides brought is named there. [] for another engine.

    >>> base = {"engine": {"name": "vllm"}, "model": {"name": "m", "uri": "/models/m"}, "replicas": 1,
    ...         "draft": {"method": "ngram"}, "speculation": {"kInitial": 4, "kMax": 4, "kPolicy": "fixed"},
    ...         "quantization": "none"}
    >>> problems(base)
    []
    >>> [p.field for p in problems({**base, "speculation": {"kInitial": 2, "kMax": 4, "kPolicy": "adaptive"}})]
    ['spec.speculation.kPolicy', 'spec.speculation.kMax']
    """
    out: list[Problem] = []
    written = (spec.get("engine") or {}).get("vllm")
    if written is not None and engine(spec) != VLLM:
        return [Problem("spec.engine.vllm", ENGINE_VLLM)]
    if engine(spec) != VLLM:
        return []
    conf = settings(spec)
    if conf["promptLookupMin"] > conf["promptLookupMax"]:
        out.append(Problem("spec.engine.vllm.ngram", LOOKUP))
    if not set((written or {}).get("pools") or {}) <= set(METHODS):
        out.append(Problem("spec.engine.vllm.pools", POOL_KEYS))
    out += [Problem(f"spec.engine.vllm.args[{i}]", ARGS) for i, arg in enumerate(conf["args"]) if owned_arg(arg)]
    over = (spec.get("canary") or {}).get("overrides") or {}
    k, over_k = spec.get("speculation") or {}, over.get("speculation") or {}

    def refuse(ok: bool, stable_field: str, message: str, canary_ok: bool = True, canary_field: str = "") -> None:
        if not ok:
            out.append(Problem(stable_field, message))
        elif not canary_ok:
            out.append(Problem(canary_field, message))

    refuse(k.get("kPolicy") == "fixed", "spec.speculation.kPolicy", K_POLICY,
           over_k.get("kPolicy", "fixed") == "fixed", "spec.canary.overrides.speculation.kPolicy")
    canary_k = (over_k.get("kInitial", k.get("kInitial")), over_k.get("kMax", k.get("kMax")))
    refuse(k.get("kInitial") == k.get("kMax") and (k.get("kMax") or 0) >= 1, "spec.speculation.kMax", K_STATIC,
           not over_k or (canary_k[0] == canary_k[1] and (canary_k[1] or 0) >= 1),
           "spec.canary.overrides.speculation.kMax")
    tree = k.get("tree") or {}
    refuse(tree.get("branching", 1) == 1 and tree.get("depth", 0) == 0 and not tree.get("choices"),
           "spec.speculation.tree", TREE, "tree" not in over_k, "spec.canary.overrides.speculation.tree")
    refuse("latencyGuard" not in k, "spec.speculation.latencyGuard", LATENCY_GUARD,
           "latencyGuard" not in over_k, "spec.canary.overrides.speculation.latencyGuard")
    refuse(not (k.get("kTuning") or {}).get("enabled", False), "spec.speculation.kTuning.enabled", K_TUNING)
    ngram = (spec.get("draft") or {}).get("ngram") or {}
    refuse(not ngram.get("corpusTokens") and not ngram.get("mix"), "spec.draft.ngram", NGRAM,
           "ngram" not in (over.get("draft") or {}), "spec.canary.overrides.draft.ngram")
    refuse(spec.get("quantization", "none") == "none", "spec.quantization", QUANTIZATION,
           over.get("quantization", "none") == "none", "spec.canary.overrides.quantization")
    refuse("scaling" not in spec, "spec.scaling", SCALING)
    refuse("image" not in (spec.get("template") or {}), "spec.template.image", IMAGE,
           "image" not in over, "spec.canary.overrides.image")
    model, draft = spec.get("model") or {}, spec.get("draft") or {}
    method = draft.get("method")
    canary_method = (over.get("draft") or {}).get("method", method)
    refuse(_routes_ok(spec, method), "spec.routing", ROUTES,
           "method" not in (over.get("draft") or {}) or _routes_ok(spec, canary_method),
           "spec.canary.overrides.draft.method")
    uri = model.get("uri") or ""
    refuse(not (uri.startswith("gguf://") or uri.endswith(".gguf")), "spec.model.uri", GGUF)
    refuse("source" in model or _ABSOLUTE.match(uri) is not None or _remote(uri), "spec.model.uri",
           MODEL_PATH)
    draft_uri, over_uri = draft.get("uri"), (over.get("draft") or {}).get("uri")
    refuse(draft_uri is None or _draft_uri_ok(draft_uri), "spec.draft.uri", DRAFT_URI,
           over_uri is None or _draft_uri_ok(over_uri), "spec.canary.overrides.draft.uri")
    return out


def _routes_ok(spec: dict[str, Any], method: str) -> bool:
    """Whether every method the spec's routing names is one an arm of draft.method `method` has a
    pool for (ngram, none, or the method itself)."""
    routing = spec.get("routing") or {}
    named = [*(routing.get("byPromptType") or {}).values(), *([routing["default"]] if "default" in routing else [])]
    return all(m in (Method.NGRAM.value, Method.NONE.value, method) for m in named)
