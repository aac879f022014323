"""Spec-Bench questions: where they are and how they are read; the one loader every benchmark
(Spec-Bench runs, the serving benchmark, the oracle replay) and the main job use."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path


def default_questions() -> Path:
    env = os.environ.get("SPECFLEET_SPEC_BENCH")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    return repo.parent / "shared" / "data" / "spec_bench" / "question.dev.jsonl"


def load_questions(path: Path, per_category: int = 0) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"question file {path} not found (pass --questions)")
    out, seen = [], defaultdict(int)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            q["turns"][0], q["category"]  # noqa: B018 - the fields every question must have
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a Spec-Bench question (need category and turns): {e}") from None
        if per_category and seen[q["category"]] >= per_category:
            continue
        seen[q["category"]] += 1
        out.append(q)
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def pick_prompts(path: Path, limit: int) -> list[dict]:
    """Round-robin over categories, so that a small --limit still sees every kind of prompt."""
    by_cat: dict[str, list[dict]] = {}
    for q in load_questions(path):
        by_cat.setdefault(q["category"], []).append(q)
    out, i = [], 0
    while any(i < len(v) for v in by_cat.values()) and (not limit or len(out) < limit):
        for qs in by_cat.values():
            if i < len(qs) and (not limit or len(out) < limit):
                out.append(qs[i])
        i += 1
    return out
