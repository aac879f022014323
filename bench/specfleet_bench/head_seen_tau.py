"""How far the data bounds a trained EAGLE head: its tau on prompts it was trained on beside the
held-back ones, in the real engine (greedy chains, the eval stage of `specfleet train-draft`).

The split is train-draft's own (the same seed, counts and prompts file as the training run), so
"seen" prompts are ones whose distilled answers the head learnt from. A head far better on those
is bound by its data, not its size.

    python -m specfleet_bench.head_seen_tau --seen 40        # the shipped SmolLM2 head, 6 min
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specfleet_api.engine_config import BUNDLED_EAGLE_HEAD, bundled_model
from specfleet_engine import draft_training as dt
from specfleet_engine.draft_head import load_head

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", default=BUNDLED_EAGLE_HEAD,
                   help="the head's folder, or a head the package carries (default: %(default)s)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", default="../shared/data/draft_train/prompts.jsonl",
                   help="the training run's prompts file")
    p.add_argument("--train-prompts", type=int, default=1200, help="the training run's --train-prompts")
    p.add_argument("--eval-prompts", type=int, default=32, help="the training run's --eval-prompts")
    p.add_argument("--seed", type=int, default=0, help="the training run's --seed")
    p.add_argument("--seen", type=int, default=40, help="training prompts to evaluate on (longer ones are left out)")
    p.add_argument("--eval-k", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    a = dt.TrainArgs(target=args.target, prompts=args.prompts, out="", train_prompts=args.train_prompts,
                     eval_prompts=args.eval_prompts, seed=args.seed, eval_k=args.eval_k)
    prompts = dt.read_prompts(a.prompts)
    train_ids, eval_ids = dt.split_prompts(prompts, a.train_prompts, a.eval_prompts, a.seed)
    model, tokenizer = dt.load_target(args.target, "fp32", "none", "cpu")
    head = load_head(bundled_model(args.head) or args.head, model)
    results = {}
    for name, ids in (("held back", eval_ids), ("seen", train_ids[:args.seen])):
        r = dt.evaluate(a, model, tokenizer, head, prompts, ids)
        results[name] = r
        by_pos = " / ".join(f"{x:.2f}" for x in r["acceptance_by_position"] if x is not None)
        print(f"{name:>9}: {r['prompts']} prompts, tau {r['tau']:.2f}, acceptance by position {by_pos}, "
              f"greedy == plain {r['greedy_equal_plain']}/{r['prompts']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
