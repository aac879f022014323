"""Where a decoding step's time goes, chains vs trees, with and without the n-gram corpus.

Each configuration decodes the same recorded Spec-Bench prompts on one engine, question by
question in turn, the order rotating (so a burst of load hits all alike); per step it records the rows verified, the
verify forward's seconds beside what the calibrated cost curve predicted for those rows, the
proposing and the rest (verification, compaction, bookkeeping). A forward slower than its
prediction means the budget overspends; "other" growing with trees means the tree's bookkeeping
costs what the cost curve does not see.

    python -m specfleet_bench.step_breakdown --quantization int8 --questions 24     # 2 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from specfleet_engine.engine import Engine
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.sampling import SamplingParams

from .spec_bench import CORPUS_TOKENS

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "bench" / "smollm2-dev-greedy-outputs.jsonl"
#: name -> (tree branching cap, n-gram corpus tokens)
CONFIGS = {"chain": (1, 0), "tree": (4, 0), "chain+corpus": (1, CORPUS_TOKENS), "tree+corpus": (4, CORPUS_TOKENS)}


def breakdown(engine: Engine, prompts: list[list[int]], max_tokens: int = 128, k: int = 8,
              configs: dict[str, tuple[int, int]] = CONFIGS) -> dict[str, dict[str, float]]:
    """{config: per-step means (ms) and rates}; each config keeps its own n-gram proposer."""
    proposers = {name: NgramProposer(corpus_tokens=corpus) for name, (_, corpus) in configs.items()}
    sums: dict[str, dict[str, float]] = {name: defaultdict(float) for name in configs}
    names = list(configs)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:  # the order rotates: no config always first
            branching = configs[name][0]
            engine.proposers["ngram"], engine.tree_branching = proposers[name], branching
            seq = engine.add(prompt, SamplingParams(max_tokens=max_tokens), "ngram", k)
            engine.step()  # the prefill
            s = sums[name]
            while not seq.finished:
                t = time.perf_counter()
                (out,) = engine.step()
                s["total"] += time.perf_counter() - t
                tm = engine.last_timing
                s["steps"] += 1
                s["tokens"] += len(out.new_tokens)
                s["rows"] += tm.decode_rows
                s["forward"] += tm.forward
                s["predicted"] += engine.costs(tm.decode_rows)
                s["propose"] += tm.propose
    out = {}
    for name, s in sums.items():
        n = max(s["steps"], 1)
        out[name] = {"tok_s": round(s["tokens"] / max(s["total"], 1e-9), 1), "tau": round(s["tokens"] / n, 3),
                     "rows": round(s["rows"] / n, 2), "step_ms": round(s["total"] / n * 1e3, 2),
                     "forward_ms": round(s["forward"] / n * 1e3, 2),
                     "predicted_ms": round(s["predicted"] / n * 1e3, 2),
                     "propose_ms": round(s["propose"] / n * 1e3, 2),
                     "other_ms": round((s["total"] - s["forward"] - s["propose"]) / n * 1e3, 2)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="none", help="none | int8")
    p.add_argument("--questions", type=int, default=24, help="recorded prompts, spread over the categories")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    args = p.parse_args(argv)
    if args.questions < 1:
        p.error(f"--questions must be >= 1, got {args.questions}")
    from specfleet_engine.factory import prepare_model
    from specfleet_engine.loader import load_tokenizer

    records = [json.loads(line) for line in RECORDED.read_text().splitlines() if line.strip()]
    step = max(1, len(records) // args.questions)
    prompts = [r["prompt"] for r in records[::step]][:args.questions]
    engine = Engine(prepare_model(args.model, "fp32", args.quantization), load_tokenizer(args.model), max_kv_tokens=8192)
    engine.calibrate()
    curve = {r: round(engine.costs(r) / engine.costs(1), 3) for r in (1, 2, 4, 8, 16, 32)}
    print(f"cost of a forward by rows, relative to one: {curve}", file=sys.stderr)
    res = breakdown(engine, prompts, args.max_tokens)
    for name, r in res.items():
        print(f"{name:13s} {r['tok_s']:6.1f} tok/s  tau {r['tau']:.3f}  rows {r['rows']:.2f}  step {r['step_ms']:.2f} ms"
              f" = forward {r['forward_ms']:.2f} (predicted {r['predicted_ms']:.2f}) + propose {r['propose_ms']:.2f}"
              f" + other {r['other_ms']:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"quantization": args.quantization, "questions": len(prompts),
                                        "relative_cost_by_rows": curve, "configs": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
