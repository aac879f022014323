"""Where a decoding step's time goes, chains vs trees, with and without the n-gram corpus.

Each configuration decodes the same recorded Spec-Bench prompts on one engine, question by
question in turn, the order rotating (so a burst of load hits all alike); per step it records the rows verified, the
verify forward's seconds beside what the calibrated cost curve predicted for those rows, the
proposing and the rest (verification, compaction, bookkeeping). A forward slower than its
prediction means the budget overspends; "other" growing with trees means the tree's bookkeeping
costs what the cost curve does not see.

    python -m specfleet_bench.step_breakdown --quantization int8 --questions 24     # 2 min
    python -m specfleet_bench.step_breakdown --refinement --questions 12             # the cost curve's live refinement
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


def refinement(engine: Engine, prompts: list[list[int]], max_tokens: int = 128, k: int = 8, branching: int = 4,
               skew: float = 0.10, rounds: int = 2) -> dict[str, dict]:
    """The cost curve's live refinement on beside off, from a calibration made wrong on purpose
    (a forward of r rows looks up to `skew` cheaper than calibrated, from 8 rows on: what a
    calibration with a shorter context than the traffic's gets wrong). Each round decodes the
    prompts once per mode, the order alternating. Per mode: the median forward / predicted by rows
    over each pass's second half (once refinement had steps to learn from), relative to one row's,
    the largest error, and tok/s."""
    calibrated = dict(engine.costs.seconds)
    wrong = {r: c * (1 - skew * min(r - 1, 7) / 7) for r, c in calibrated.items()}
    every = engine.costs.refine_every or 256
    ratios: dict[str, dict[int, list[float]]] = {m: defaultdict(list) for m in ("off", "on")}
    totals = {m: [0, 0.0] for m in ratios}
    engine.tree_branching = branching
    for rnd in range(rounds):
        for mode in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            engine.costs.set_curve(wrong)
            engine.costs.refine_every = every if mode == "on" else 0
            steps: list[tuple[int, float]] = []
            for prompt in prompts:
                seq = engine.add(prompt, SamplingParams(max_tokens=max_tokens), "ngram", k)
                engine.step()  # the prefill
                while not seq.finished:
                    t = time.perf_counter()
                    (out,) = engine.step()
                    totals[mode][1] += time.perf_counter() - t
                    totals[mode][0] += len(out.new_tokens)
                    tm = engine.last_timing
                    steps.append((tm.decode_rows, tm.forward / engine.costs(tm.decode_rows)))
            for rows, ratio in steps[len(steps) // 2:]:
                ratios[mode][rows].append(ratio)
    engine.costs.set_curve(calibrated)
    engine.costs.refine_every = every
    out = {}
    for mode, by_rows in ratios.items():
        med = {r: sorted(x)[len(x) // 2] for r, x in sorted(by_rows.items()) if len(x) >= 20}
        rel = {r: round(m / med[1], 3) for r, m in med.items()} if 1 in med else {}
        out[mode] = {"forward_over_predicted_by_rows": rel,
                     "largest_error": round(max((abs(v - 1) for v in rel.values()), default=0.0), 3),
                     "tok_s": round(totals[mode][0] / max(totals[mode][1], 1e-9), 1)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="none", help="none | int8")
    p.add_argument("--questions", type=int, default=24, help="recorded prompts, spread over the categories")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--refinement", action="store_true",
                   help="instead: the cost curve's live refinement on beside off, from a calibration made wrong")
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
    if args.refinement:
        res = refinement(engine, prompts, args.max_tokens)
        for mode, r in res.items():
            print(f"refinement {mode:3s}: {r['tok_s']:6.1f} tok/s, forward / predicted by rows (rel. to 1 row) "
                  f"{r['forward_over_predicted_by_rows']}, largest error {r['largest_error']:.3f}")
        if args.out:
            args.out.write_text(json.dumps({"quantization": args.quantization, "questions": len(prompts),
                                            "calibrated_cost_by_rows": curve, "refinement": res}, indent=1) + "\n")
        return 0
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
