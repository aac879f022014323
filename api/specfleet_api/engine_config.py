"""engine.json (docs/worker-contract.md): what a worker is asked to serve, read and checked.

`EngineConfig.from_dict` reads the operator's file: unknown keys are ignored with a warning so an
older worker runs a newer operator's config. Torch-free: the operator, the CLI and the worker import it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("specfleet.api")

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
