"""Sampled decoding with the CPU's sampling as it is beside as it was: the inverse-CDF draw and
the partial top-k for top-p, against the exponential race and the full sort they replaced.

Every sampled token draws from a distribution over the whole vocabulary (49152 for SmolLM2): the
exponential race (argmax of p / Exp(1)) draws V exponentials a row, the inverse CDF one uniform
against a cumulative sum (`sampling.sample_from`); top-p sorted all V probabilities of every row
(every verified row of a speculative step), it now looks among the 1024 most likely first
(`sampling.top_p_filter`). Both ways draw from the same distribution exactly. This measures what
the difference is worth: plain decoding and n-gram speculation (whose rejection sampling draws the
next token the same way), one request at a time (4 of them) and a batch of 16, without and with top-p, the old
and the new alternating round by round on one engine (the order rotating), so that the machine's
load hits both alike. It prints tokens/s per configuration and the ratio new / old.

    python -m specfleet_bench.sampler --out docs/bench/sampler.json      # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from specfleet_api.enums import Method
from specfleet_engine import sampling
from specfleet_engine.engine import Engine
from specfleet_engine.kernels import rejection
from specfleet_engine.proposers import draft_model
from specfleet_engine.sampling import SamplingParams

from .step_breakdown import RECORDED


def race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The sampler before: the exponential race, V draws a row."""
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / q).argmax(dim=-1)


def full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p before: every row's V probabilities sorted."""
    sorted_probs, idx = torch.sort(probs, dim=-1, descending=True)
    sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_probs)
    return out / out.sum(-1, keepdim=True)


#: name -> (sample_from, top_p_filter)
SAMPLERS = {"old": (race, full_sort_top_p), "new": (sampling.sample_from, sampling.top_p_filter)}
_USERS = (sampling, rejection, draft_model)  # the modules that call sample_from by name


@contextlib.contextmanager
def using(name: str):
    draw, top_p = SAMPLERS[name]
    saved = [m.sample_from for m in _USERS], sampling.top_p_filter
    for m in _USERS:
        m.sample_from = draw
    sampling.top_p_filter = top_p
    try:
        yield
    finally:
        for m, f in zip(_USERS, saved[0]):
            m.sample_from = f
        sampling.top_p_filter = saved[1]


def decode(engine: Engine, prompts: list[list[int]], method: str, temperature: float, max_tokens: int,
           seed: int, top_p: float = 1.0) -> tuple[int, float]:
    """(tokens, seconds) of decoding the prompts together as one batch."""
    seqs = [engine.add(p, SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                         seed=seed + i, ignore_eos=True), method, 4) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    while not all(s.finished for s in seqs):
        engine.step()
    return sum(len(s.output) for s in seqs), time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="none", help="none | int8")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,16", help="requests decoded together")
    p.add_argument("--top-p", default="1.0,0.95", help="top-p values (1.0: off)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration (samplers alternate)")
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    try:
        top_ps = [float(x) for x in args.top_p.split(",")]
    except ValueError:
        p.error(f"--top-p must be comma-separated numbers, got {args.top_p!r}")
    if args.rounds < 1 or args.temperature <= 0 or any(b < 1 for b in batches) or not all(0 < x <= 1 for x in top_ps):
        p.error("--rounds and every batch must be >= 1, --temperature > 0 (greedy draws nothing), "
                "every --top-p in (0, 1]")
    from specfleet_engine.factory import prepare_model
    from specfleet_engine.loader import load_tokenizer

    records = [json.loads(line) for line in RECORDED.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in records[::max(1, len(records) // max(batches))]]
    engine = Engine(prepare_model(args.model, "fp32", args.quantization), load_tokenizer(args.model), max_kv_tokens=16384)
    engine.calibrate()
    decode(engine, prompts[:1], "ngram", args.temperature, 8, 0)  # warm
    rates: dict[str, list[float]] = {}
    configs = [(m, b, tp) for tp in top_ps for m in (Method.NONE.value, Method.NGRAM.value) for b in batches]
    label = lambda m, b, tp: f"{'plain' if m == Method.NONE else m} x{b}" + (f" top-p {tp:g}" if tp < 1 else "")
    names = list(SAMPLERS)
    for r in range(args.rounds):
        for method, batch, top_p in configs:
            for name in names[r % 2:] + names[:r % 2]:  # the order alternates by round
                tokens, seconds = 0, 0.0
                with using(name):  # at least 4 prompts a run: one sampled text's acceptance varies much
                    for g in range(0, max(batch, 4), batch):
                        t, sec = decode(engine, prompts[g:g + batch], method, args.temperature, args.max_tokens,
                                        100 * r + g, top_p)
                        tokens, seconds = tokens + t, seconds + sec
                rates.setdefault(f"{label(method, batch, top_p)} {name}", []).append(tokens / seconds)
                print(f"round {r + 1}/{args.rounds}  {label(method, batch, top_p):26s} {name}  "
                      f"{tokens / seconds:7.1f} tok/s", file=sys.stderr, flush=True)
    out = {"model": args.model, "quantization": args.quantization, "temperature": args.temperature,
           "max_tokens": args.max_tokens, "rounds": args.rounds, "tok_s": {}, "new_over_old": {}}
    print(f"\nsampled decoding (temperature {args.temperature}, {args.max_tokens} tokens, medians of "
          f"{args.rounds} rounds), tok/s:")
    for method, batch, top_p in configs:
        key = label(method, batch, top_p)
        old, new = rates[f"{key} old"], rates[f"{key} new"]
        ratios = [n / o for n, o in zip(new, old)]
        out["tok_s"][key] = {"old": round(statistics.median(old), 1), "new": round(statistics.median(new), 1)}
        out["new_over_old"][key] = round(statistics.median(ratios), 3)
        print(f"  {key:26s} old {statistics.median(old):7.1f}  new {statistics.median(new):7.1f}  "
              f"new/old {statistics.median(ratios):.3f}x (rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
