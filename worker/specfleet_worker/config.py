"""engine.json (docs/worker-contract.md) and the live settings that the admin surface moves.

`EngineConfig.from_dict` reads the operator's file: unknown keys are ignored with a warning so an
older worker runs a newer operator's config. `LiveConfig` holds what may change at run time (K
bounds, speculation on/off, the method per prompt type); every change swaps one frozen snapshot,
so the scheduler reads a consistent view once per step without a lock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("specfleet.worker")

METHODS = ("ngram", "draft-model", "eagle", "medusa", "none")
QUANTIZATIONS = ("none", "int8", "fp8", "fp4")
K_POLICIES = ("adaptive", "fixed")
AUTO = "auto"

_KNOWN = {
    "": {"model", "draft", "speculation", "routing", "quantization", "dtype", "role"},
    "model": {"name", "uri", "tokenizer"},
    "draft": {"method", "uri"},
    "speculation": {"kMin", "kMax", "kInitial", "kPolicy", "tree"},
    "speculation.tree": {"branching", "depth"},
    "routing": {"default", "byPromptType"},
}


def _warn_unknown(raw: dict, where: str = "") -> None:
    for key in raw:
        if key not in _KNOWN[where]:
            log.warning("engine.json: ignoring unknown key %r", f"{where}.{key}" if where else key)
    for key, value in raw.items():
        sub = f"{where}.{key}" if where else key
        if sub in _KNOWN and isinstance(value, dict):
            _warn_unknown(value, sub)


@dataclass(frozen=True)
class EngineConfig:
    model_name: str = "smollm2-135m"
    model_uri: str | None = None
    tokenizer: str | None = None
    draft_method: str = "ngram"
    draft_uri: str | None = None
    k_min: int = 0
    k_max: int = 8
    k_initial: int = 4
    k_policy: str = "adaptive"
    tree_branching: int = 1
    tree_depth: int = 0
    default_method: str = "ngram"
    by_prompt_type: dict[str, str] = field(default_factory=dict)
    quantization: str = "none"
    dtype: str = "auto"
    role: str = "stable"

    @classmethod
    def from_dict(cls, raw: dict) -> EngineConfig:
        _warn_unknown(raw)
        model, draft = raw.get("model") or {}, raw.get("draft") or {}
        spec, routing = raw.get("speculation") or {}, raw.get("routing") or {}
        tree = spec.get("tree") or {}
        draft_method = draft.get("method", "ngram")
        cfg = cls(
            model_name=model.get("name", cls.model_name), model_uri=model.get("uri"),
            tokenizer=model.get("tokenizer"), draft_method=draft_method, draft_uri=draft.get("uri"),
            k_min=int(spec.get("kMin", 0)), k_max=int(spec.get("kMax", 8)), k_initial=int(spec.get("kInitial", 4)),
            k_policy=spec.get("kPolicy", "adaptive"), tree_branching=int(tree.get("branching", 1)),
            tree_depth=int(tree.get("depth", 0)), default_method=routing.get("default", draft_method),
            by_prompt_type=dict(routing.get("byPromptType") or {}), quantization=raw.get("quantization", "none"),
            dtype=raw.get("dtype", "auto"), role=raw.get("role", "stable"),
        )
        cfg.check()
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> EngineConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object at the top level")
        return cls.from_dict(raw)

    def check(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"engine.json: {msg}")

        need(self.draft_method in METHODS, f"draft.method must be one of {METHODS}, got {self.draft_method!r}")
        need(self.quantization in QUANTIZATIONS,
             f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        need(self.k_policy in K_POLICIES, f"speculation.kPolicy must be one of {K_POLICIES}, got {self.k_policy!r}")
        need(0 <= self.k_min <= self.k_max, f"speculation needs 0 <= kMin <= kMax, got {self.k_min}, {self.k_max}")
        need(self.k_max <= 32, f"speculation.kMax must be <= 32, got {self.k_max}")


@dataclass(frozen=True)
class Settings:
    """One consistent snapshot of what the control plane may move at run time."""

    speculation_enabled: bool
    k_min: int
    k_max: int
    k_initial: int
    k_policy: str
    default_method: str
    by_prompt_type: dict[str, str]

    def method_for(self, requested: str, prompt_type: str) -> str:
        """The method a new request runs with ("none" while speculation is off)."""
        if not self.speculation_enabled:
            return "none"
        if requested and requested != AUTO:
            return requested
        return self.by_prompt_type.get(prompt_type, self.default_method)


class LiveConfig:
    """The current `Settings`; `update` validates against the methods the engine has."""

    def __init__(self, cfg: EngineConfig, methods: list[str]):
        self.methods = sorted(set(methods) | {"none"})
        self._lock = threading.Lock()
        default = self._usable(cfg.default_method, "routing.default", fallback="none")
        routes = {t: self._usable(m, f"routing.byPromptType.{t}", fallback=default)
                  for t, m in cfg.by_prompt_type.items()}
        self.settings = Settings(cfg.draft_method != "none", cfg.k_min, cfg.k_max,
                                 min(max(cfg.k_initial, cfg.k_min), cfg.k_max), cfg.k_policy, default, routes)

    def _usable(self, method: str, where: str, fallback: str) -> str:
        if method == AUTO:
            return fallback
        if method not in self.methods:
            log.warning("engine.json: %s names %r, which this worker does not have (%s); using %r",
                        where, method, ", ".join(self.methods), fallback)
            return fallback
        return method

    def update(self, *, speculation_enabled: bool | None = None, k_min: int | None = None,
               k_max: int | None = None, default_method: str | None = None,
               by_prompt_type: dict[str, str] | None = None) -> Settings:
        """Raises ValueError naming the field; nothing changes then."""
        with self._lock:
            s = self.settings
            k_lo = s.k_min if k_min is None else k_min
            k_hi = s.k_max if k_max is None else k_max
            if not 0 <= k_lo <= k_hi <= 32:
                raise ValueError(f"k_min, k_max: need 0 <= k_min <= k_max <= 32, got {k_lo}, {k_hi}")
            for name, m in [("default_method", default_method)] + [
                    (f"method_by_prompt_type[{t!r}]", m) for t, m in (by_prompt_type or {}).items() if m]:
                if m is not None and m not in self.methods:
                    raise ValueError(f"{name}: unknown method {m!r}; this worker has {self.methods}")
            routes = dict(s.by_prompt_type)
            for t, m in (by_prompt_type or {}).items():
                if m:
                    routes[t] = m
                else:
                    routes.pop(t, None)
            self.settings = dataclasses.replace(
                s, speculation_enabled=s.speculation_enabled if speculation_enabled is None else speculation_enabled,
                k_min=k_lo, k_max=k_hi, k_initial=min(max(s.k_initial, k_lo), k_hi),
                default_method=s.default_method if default_method is None else default_method,
                by_prompt_type=routes)
            log.info("settings changed", extra={"settings": dataclasses.asdict(self.settings)})
            return self.settings

    def apply_control_file(self, raw: dict) -> Settings:
        """control.json, written by the operator's control loop: {speculate, kMin, kMax}."""
        k_max = int(raw.get("kMax", self.settings.k_max))
        # with speculation off the operator writes kMax 0 and leaves kMin as the spec has it
        k_min = min(int(raw.get("kMin", self.settings.k_min)), k_max)
        return self.update(speculation_enabled=bool(raw.get("speculate", True)), k_min=k_min, k_max=k_max)
