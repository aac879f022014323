"""Oracle replay: how well a drafting strategy could do on a model's real outputs, in seconds.

`record` runs the target model once (greedy) over Spec-Bench questions and stores prompt and
output token ids. `replay` feeds those outputs back through the real Engine (proposers, adaptive
K, verification) with an oracle in place of the model: its logits are one-hot on the recorded
next token, so greedy verification accepts exactly what the model would have accepted. Each step
is charged a fixed cost by its number of rows, so the modelled speedup over plain decoding follows
from tau and the cost curve alone, with no machine noise. Prefill is not counted.

    python -m specfleet_bench.oracle_replay record results/outputs.jsonl --per-category 0      # ~20 min, all 240
    python -m specfleet_bench.oracle_replay replay results/outputs.jsonl --costs 1,1.03,1.06,1.09,1.12,1.15,1.18,1.21,1.24
    python -m specfleet_bench.oracle_replay budgets docs/bench/smollm2-dev-greedy-outputs.jsonl --branching 4

`budgets` gives the tau the drafter can reach at each tree budget (draft nodes a step may verify
for free, none beyond), chains (branching 1) beside trees: the adaptive policy picks the nodes.
With `--recycle K` a third column, trees that also draft the target's own top-K next tokens
(Token Recycling): the model runs once, teacher-forced over each recording, for its top-K at every
position, and the oracle's logits carry them (ranked, the recorded token first).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from specfleet_bench.questions import default_questions, load_questions
from specfleet_engine.engine import Engine
from specfleet_engine.model import ModelArgs
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.sampling import SamplingParams



class Oracle:
    """Stands in for the Transformer: logits one-hot on the recorded continuation, or, where `top`
    holds the model's top next tokens at each position, falling over those in rank order."""

    def __init__(self, vocab_size: int):
        self.args = ModelArgs(vocab_size=vocab_size, dim=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8,
                              intermediate_size=8, max_position_embeddings=16384)
        self.dtype = torch.float32
        self.full: list[int] = []
        self.top: torch.Tensor | None = None  # [positions, K]: the model's top next tokens (greedy: full[p + 1] first)

    def __call__(self, tokens, meta, kv, logits_indices=None):
        pos = meta.positions if logits_indices is None else meta.positions.index_select(0, logits_indices)
        out = torch.zeros(len(pos), self.args.vocab_size)
        for i, p in enumerate(pos.tolist()):
            if self.top is not None and p < len(self.top):
                out[i, self.top[p]] = torch.linspace(1.0, 0.5, self.top.shape[1])
            out[i, self.full[p + 1] if p + 1 < len(self.full) else self.args.vocab_size - 1] = 2.0
        return out


def model_top(records: list[dict], k: int, model: str = "smollm2-135m") -> list[torch.Tensor]:
    """The model's top-k next tokens at every position of each recording (prompt + output),
    teacher-forced in one forward each; position p's first is output's token p + 1 (greedy)."""
    from specfleet_engine.factory import prepare_model

    engine = Engine(prepare_model(model, "fp32"), None, max_kv_tokens=16384)
    out = []
    for i, r in enumerate(records, 1):
        full = r["prompt"] + r["output"]
        seq = engine.add(full, SamplingParams(max_tokens=1), "none")
        top = engine._forward([seq], [full], "all").topk(k, dim=-1).indices
        engine.abort(seq)
        if top[len(r["prompt"]) - 1:len(full) - 1, 0].tolist() != r["output"]:
            raise AssertionError(f"question {r['question_id']}: the model's greedy choices differ from the recording")
        out.append(top)
        print(f"\r[{i}/{len(records)}] the model's top-{k} next tokens", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out


def record(args) -> int:
    from specfleet_engine.factory import prepare_model
    from specfleet_engine.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    engine = Engine(prepare_model(args.model, "fp32"), tok, max_kv_tokens=8192)
    done = set()
    if args.path.exists():
        done = {json.loads(line)["question_id"] for line in args.path.read_text().splitlines() if line.strip()}
    questions = load_questions(args.questions or default_questions(), args.per_category)
    with args.path.open("a") as f:
        for i, q in enumerate(questions, 1):
            if q["question_id"] in done:
                continue
            prompt = tok.chat(q["turns"][0])
            seq = engine.generate(prompt, SamplingParams(max_tokens=args.max_tokens), "ngram", 8)  # lossless: = plain
            f.write(json.dumps(dict(question_id=q["question_id"], category=q["category"],
                                    prompt=prompt, output=seq.output)) + "\n")
            f.flush()
            print(f"[{i}/{len(questions)}] {q['category']}: {len(prompt)} prompt, {len(seq.output)} output tokens",
                  file=sys.stderr, flush=True)
    return 0


def replay(records: list[dict], costs: dict[int, float], k: int = 8, vocab_size: int = 49152,
           max_tokens: int = 128, branching: int = 1, corpus_tokens: int = 0,
           tops: list[torch.Tensor] | None = None) -> dict:
    """{category: (tokens, modelled spec cost, modelled plain cost, steps)}; cost in units of one plain step.

    max_tokens: the recording's. An output shorter than that ended at EOS, which took a step too.
    branching: the engine's tree cap (1: chains). corpus_tokens: the n-gram proposer's corpus of
    earlier requests (the records replay in order, each once). tops: `model_top`'s, per record: the
    proposer recycles the target's top choices (as many as each holds)."""
    oracle = Oracle(vocab_size)
    recycle = tops[0].shape[1] if tops else 0
    engine = Engine(oracle, None, max_kv_tokens=16384, eos_token_ids=[vocab_size - 1], tree_branching=branching,
                    proposers={"ngram": NgramProposer(corpus_tokens=corpus_tokens, recycle=recycle)})
    engine.costs.set_curve(costs)
    engine.costs.observe = lambda *step: None  # the oracle's steps take no real time
    by_cat: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for i, r in enumerate(records):
        oracle.full = r["prompt"] + r["output"] + [vocab_size - 1]
        oracle.top = tops[i] if tops else None
        seq = engine.add(r["prompt"], SamplingParams(max_tokens=max_tokens), "ngram", k)
        engine.step()  # prefill: its first token is not a decoding step
        spent = 0.0
        while not seq.finished:
            (out,) = engine.step()
            spent += engine.costs(out.stats.num_draft_tokens + 1)
        if seq.output != r["output"]:
            raise AssertionError(f"question {r['question_id']}: the replay diverged from the recording")
        n = len(r["output"]) - 1 + (seq.finish_reason == "stop")  # tokens after the prefill's, EOS included
        c = by_cat[r["category"]]
        c[0] += n
        c[1] += spent
        c[2] += n * costs[1]
        c[3] += seq.stats.num_steps
    return dict(by_cat)


def budget_costs(budget: int) -> dict[int, float]:
    """A forward's cost when `budget` draft nodes (plus the root row) are free and one more is not."""
    return {**{r: 1.0 for r in range(1, budget + 2)}, budget + 2: 1e6}


def budgets(records: list[dict], budget_list: list[int], branching: int, k: int, max_tokens: int,
            corpus_tokens: int = 0, tops: list[torch.Tensor] | None = None) -> dict:
    """{budget: {"chain" | "tree" [| "recycled tree"]: {category: tau}}}: tokens per target forward
    at each budget; tops (`model_top`'s): also trees that recycle the target's top choices."""
    out = {}
    kinds = [("chain", 1, None), ("tree", branching, None)] + ([("recycled tree", branching, tops)] if tops else [])
    for budget in budget_list:
        row = {}
        for name, width, top in kinds:
            res = replay(records, budget_costs(budget), max(k, 1), max_tokens=max_tokens, branching=width,
                         corpus_tokens=corpus_tokens, tops=top)
            taus = {cat: round(n / steps, 3) for cat, (n, _, _, steps) in sorted(res.items())}
            total_n, total_steps = sum(v[0] for v in res.values()), sum(v[3] for v in res.values())
            taus["overall"] = round(total_n / total_steps, 3)
            row[name] = taus
        out[budget] = row
        print(f"budget {budget:3d} nodes: tau " + ", ".join(f"{name} {row[name]['overall']:.3f}" for name in row),
              file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the model once and store its greedy outputs")
    r.add_argument("path", type=Path)
    r.add_argument("--questions", type=Path, default=None)
    r.add_argument("--per-category", type=int, default=0)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--model", default="smollm2-135m")
    s = sub.add_parser("replay", help="replay stored outputs through the engine with an oracle model")
    s.add_argument("path", type=Path)
    s.add_argument("--costs", default="1,1.03,1.06,1.09,1.12,1.15,1.18,1.21,1.24",
                   help="cost of a forward over 1, 2, ... rows, relative to one row")
    s.add_argument("-k", type=int, default=8)
    s.add_argument("--max-tokens", type=int, default=128, help="the recording's max_tokens")
    s.add_argument("--branching", type=int, default=1, help="tree cap: children per node (1: chains)")
    b = sub.add_parser("budgets", help="tau at each tree budget, chains beside trees, with free verify rows")
    b.add_argument("path", type=Path)
    b.add_argument("--budgets", default="1,2,4,8,16,32,64", help="draft nodes a step may verify")
    b.add_argument("--branching", type=int, default=4, help="tree cap: children per node")
    b.add_argument("-k", type=int, default=8, help="depth cap")
    b.add_argument("--max-tokens", type=int, default=128, help="the recording's max_tokens")
    b.add_argument("--recycle", type=int, default=0,
                   help="also trees that draft the model's own top-K next tokens (runs the model once; 0: not)")
    b.add_argument("--model", default="smollm2-135m", help="the recording's model (for --recycle)")
    b.add_argument("--out", type=Path, default=None, help="JSON results")
    b.add_argument("--per-category", type=int, default=0,
                   help="only the questions a Spec-Bench run with this many per category takes (0: all recorded)")
    for sp in (s, b):
        sp.add_argument("--corpus-tokens", type=int, default=0,
                        help="the n-gram proposer also searches this many tokens of the earlier questions (0: none)")
    args = p.parse_args(argv)
    if args.cmd == "record":
        return record(args)
    if args.cmd == "budgets":
        if not args.path.exists():
            p.error(f"{args.path}: no such file (run `record` first)")
        try:
            budget_list = [int(x) for x in args.budgets.split(",")]
        except ValueError:
            p.error(f"--budgets must be comma-separated integers, got {args.budgets!r}")
        records = [json.loads(line) for line in args.path.read_text().splitlines() if line.strip()]
        if args.per_category:
            ids = {q["question_id"] for q in load_questions(default_questions(), args.per_category)}
            records = [r for r in records if r["question_id"] in ids]
        tops = model_top(records, args.recycle, args.model) if args.recycle else None
        res = budgets(records, budget_list, args.branching, args.k, args.max_tokens, args.corpus_tokens, tops)
        first = next(iter(res.values()))
        cats, kinds = list(first["chain"]), list(first)
        print("| budget (nodes) | " + " | ".join(f"{c} {' / '.join(kinds)}" for c in cats) + " |")
        print("|---" * (len(cats) + 1) + "|")
        for budget, row in res.items():
            print(f"| {budget} | " + " | ".join(" / ".join(f"{row[kind][c]:.2f}" for kind in kinds) for c in cats) + " |")
        if args.out:
            args.out.write_text(json.dumps({"branching": args.branching, "depth": args.k, "questions": len(records),
                                            "recycle": args.recycle, "budgets": res}, indent=1))
        return 0
    try:
        costs = {i + 1: float(c) for i, c in enumerate(args.costs.split(","))}
    except ValueError:
        p.error(f"--costs must be comma-separated numbers, got {args.costs!r}")
    if not args.path.exists():
        p.error(f"{args.path}: no such file (run `record` first)")
    records = [json.loads(line) for line in args.path.read_text().splitlines() if line.strip()]
    res = replay(records, costs, args.k, max_tokens=args.max_tokens, branching=args.branching,
                 corpus_tokens=args.corpus_tokens)
    total = [0, 0.0, 0.0, 0]
    for cat, (n, spec, plain, steps) in sorted(res.items()):
        print(f"{cat:15s} {n:6d} tokens  tau {n / steps:.2f}  modelled decode speedup {plain / spec:.2f}x")
        total = [a + b for a, b in zip(total, (n, spec, plain, steps))]
    print(f"{'overall':15s} {total[0]:6d} tokens  tau {total[0] / total[3]:.2f}  "
          f"modelled decode speedup {total[2] / total[1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
