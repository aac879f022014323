"""What an EAGLE head's draft step costs beside the target's step, by draft vocabulary size.

    .venv/bin/python -m specfleet_bench.draft_head_cost [--sizes 2048,4096,8192,16384,49152] [--reps 30]

For SmolLM2-135M (fp32 and int8 targets, as served): the target's one-token decoding step (the
verify forward of a chain of K costs about as much on a CPU) against one draft step of a head with
each draft vocabulary size (one decoder layer, its paged KV cache, the reduced LM head, the
scatter back to the target's ids), as served (`EagleHead.serving_layout`: its layer through the
fused step), and the shipped size also as trained ("unfused": layer by layer, nn.Linear weights).
The head's weights are random: cost does not depend on them.
All variants run interleaved, rep after rep, so a noisy machine slows them alike; medians.
A chain of K drafts costs K head steps: what is left of the target's gain is
tau / (1 + K * head / target).
"""

from __future__ import annotations

import argparse
import json

import torch
from specfleet_api.enums import SERVED_QUANTIZATIONS, Quantization

from specfleet_engine.draft_head import EagleHead, HeadConfig
from specfleet_engine.factory import prepare_model
from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata

from .timing import interleaved_medians


SHIPPED_VOCAB = 4096  # the draft vocabulary of the shipped SmolLM2 head


def time_target(model, context: int):
    cache = PagedKVCache.for_model(model.args, context + 64, 16, dtype=model.dtype)
    bt = BlockTable(cache)
    tokens, meta, last = batch_metadata([bt], [list(range(context))])
    with torch.inference_mode():
        model(tokens, meta, cache.layers, last)

    def step():
        tokens, meta, last = batch_metadata([bt], [[1]])
        with torch.inference_mode():
            model(tokens, meta, cache.layers, last)
        bt.truncate(context)
    return step


def time_head(model, head: EagleHead, context: int):
    cache = PagedKVCache.for_model(head.args, context + 64, 16)
    bt = BlockTable(cache)
    d = model.args.dim
    tokens, meta, last = batch_metadata([bt], [list(range(context))])
    with torch.inference_mode():
        head(model.tok_embeddings(tokens), torch.randn(context, d), meta, cache.layers, last)
    feature = torch.randn(1, d)

    def step():
        tokens, meta, last = batch_metadata([bt], [[1]])
        with torch.inference_mode():
            logits, _ = head(model.tok_embeddings(tokens), feature, meta, cache.layers, last)
            head.to_target_logits(logits, model.args.vocab_size).argmax(-1)
        bt.truncate(context)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2048,4096,8192,16384,49152")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",")]
    variants = {}
    for q in SERVED_QUANTIZATIONS:  # none, int8
        model = prepare_model("smollm2", "fp32", q)
        variants[f"target {'fp32' if q == Quantization.NONE else q}"] = time_target(model, a.context)
    for v in sizes:  # as served (serving_layout), and the size shipped also in its trained layout
        head = EagleHead(HeadConfig.for_target(model, v), model.args).eval()
        if v == SHIPPED_VOCAB:
            variants[f"head {v} unfused"] = time_head(model, head, a.context)
            head = EagleHead(HeadConfig.for_target(model, v), model.args).eval()
        variants[f"head {v}"] = time_head(model, head.serving_layout(), a.context)
    med = interleaved_medians(variants, a.reps)
    print(f"{'variant':<20} {'ms':>7}  {'/ target fp32':>13}  {'/ target int8':>13}")
    for k, ms in med.items():
        print(f"{k:<20} {ms:7.2f}  {ms / med['target fp32']:13.3f}  {ms / med['target int8']:13.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"context": a.context, "threads": a.threads, "reps": a.reps, "median_ms": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
