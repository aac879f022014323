"""Acceptance by temperature and by position, per draft method, on this model: what the control
loop's keys should hold.

Alpha moves with the sampling temperature and decays over long outputs; whether either changes
which draft method pays is what decides if it belongs in the loop's key (a temperature band) or
in the K bounds (by position). For each temperature and method, every prompt (Spec-Bench, one per
category by default) is decoded alone by the engine with the default adaptive K policy, and every
step is recorded: it reports tokens/s against plain decoding at the same temperature (the draft's
own compute included), alpha, alpha by output position (buckets of --bucket tokens) and the
acceptance of each draft position given the ones before it.

    python -m specfleet_bench.alpha_by --out docs/bench/alpha-by.json --plot docs/bench/alpha-by.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specfleet_api.engine_config import BUNDLED_EAGLE_HEAD
from specfleet_api.enums import SERVED_QUANTIZATIONS

from .questions import default_questions, pick_prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specfleet_bench.alpha_by", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="int8", choices=SERVED_QUANTIZATIONS)
    p.add_argument("--methods", default="ngram,eagle", help="draft methods (default ngram,eagle)")
    p.add_argument("--temperatures", default="0,0.7,1.2", help="(default 0,0.7,1.2)")
    p.add_argument("--limit", type=int, default=13, help="prompts, round-robin over categories (default 13)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--bucket", type=int, default=32, help="output positions a bucket (default 32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    return p.parse_args(argv)


def run(engine, tokenizer, prompts, method: str, temperature: float, max_tokens: int, bucket: int) -> dict:
    from specfleet_engine.sampling import SamplingParams

    tokens, seconds = 0, 0.0
    by_pos: dict[int, list[int]] = {}  # output bucket -> [drafted positions, accepted]
    at: list[list[int]] = []  # draft position -> [drafted, accepted]
    for i, q in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=100 + i, ignore_eos=True)
        t = time.perf_counter()
        seq = engine.add(tokenizer.chat(q["turns"][0]), params, method, 4)
        while not seq.finished:
            for out in engine.step():
                st = out.stats
                if out.seq is not seq or st is None or not st.num_draft_tokens:
                    continue
                b = by_pos.setdefault((len(seq.output) - len(out.new_tokens)) // bucket, [0, 0])
                b[0] += st.draft_positions
                b[1] += st.num_accepted
                while len(at) < st.draft_positions:
                    at.append([0, 0])
                for p in range(st.draft_positions):
                    at[p][0] += 1
                    at[p][1] += p < st.num_accepted
        seconds += time.perf_counter() - t
        tokens += len(seq.output)
    drafted = sum(b[0] for b in by_pos.values())
    return {"method": method, "temperature": temperature, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "alpha": round(sum(b[1] for b in by_pos.values()) / drafted, 4) if drafted else None,
            "alpha_by_output_position": {f"{k * bucket}-{(k + 1) * bucket - 1}": round(a / d, 4)
                                         for k, (d, a) in sorted(by_pos.items()) if d},
            "drafted_by_output_position": {f"{k * bucket}-{(k + 1) * bucket - 1}": d for k, (d, _) in sorted(by_pos.items())},
            "acceptance_by_draft_position": [round(a / d, 4) if d else None for d, a in at],
            "drafted_by_draft_position": [d for d, _ in at]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from specfleet_engine.engine import Engine
    from specfleet_engine.factory import build_engine_parts

    methods = [m for m in args.methods.split(",") if m]
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    prompts = pick_prompts(args.questions or default_questions(), args.limit)
    model, tokenizer, proposers = build_engine_parts(
        args.model, "fp32", args.quantization, None, args.threads,
        draft_head=BUNDLED_EAGLE_HEAD if "eagle" in methods else None)
    engine = Engine(model, tokenizer, proposers=proposers)
    engine.calibrate()
    rows = []
    for temperature in temperatures:
        plain = run(engine, tokenizer, prompts, "none", temperature, args.max_tokens, args.bucket)
        rows.append({**plain, "speedup": 1.0})
        for method in methods:
            r = run(engine, tokenizer, prompts, method, temperature, args.max_tokens, args.bucket)
            r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
            rows.append(r)
        for r in rows[-len(methods) - 1:]:
            print(f"T {temperature:<4} {r['method']:>6}: {r['tokens_per_s']:6.1f} tok/s ({r['speedup']:.2f}x plain), "
                  f"alpha {r['alpha']}, by output position {r['alpha_by_output_position']}, "
                  f"by draft position {r['acceptance_by_draft_position'][:6]}", file=sys.stderr, flush=True)
    best = {}
    for temperature in temperatures:
        spec = [r for r in rows if r["temperature"] == temperature and r["method"] != "none"]
        best[str(temperature)] = max(spec, key=lambda r: r["speedup"])["method"] if spec else None
    result = {"model": args.model, "quantization": args.quantization, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "threads": args.threads, "rows": rows, "best_method_by_temperature": best}
    print(json.dumps({"best_method_by_temperature": best,
                      "table": [{k: r[k] for k in ("method", "temperature", "tokens_per_s", "speedup", "alpha")}
                                for r in rows]}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["method"] != "none"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4.2))
    methods = sorted({r["method"] for r in rows})
    temps = sorted({r["temperature"] for r in rows})
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        a1.plot([r["temperature"] for r in mine], [r["speedup"] for r in mine], "o-", label=m)
        for r in mine:
            keys = list(r["alpha_by_output_position"])
            a2.plot(range(len(keys)), list(r["alpha_by_output_position"].values()), "o-",
                    label=f"{m} T={r['temperature']}", alpha=0.4 + 0.6 * (r["temperature"] == temps[0]))
            a3.plot(range(1, len(r["acceptance_by_draft_position"]) + 1), r["acceptance_by_draft_position"], "o-",
                    label=f"{m} T={r['temperature']}", alpha=0.4 + 0.6 * (r["temperature"] == temps[0]))
        if mine:
            a2.set_xticks(range(len(keys)), keys, fontsize=7)
    a1.axhline(1.0, color="gray", lw=0.8)
    a1.set_xlabel("temperature")
    a1.set_ylabel("tokens/s over plain decoding")
    a1.legend()
    a2.set_xlabel("output position")
    a2.set_ylabel("alpha")
    a3.set_xlabel("draft position (given the ones before)")
    a3.set_ylabel("acceptance")
    a3.legend(fontsize=6)
    fig.suptitle(f"{result['model']} {result['quantization']}: {result['prompts']} Spec-Bench prompts, "
                 f"{result['max_tokens']} tokens, adaptive K")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
