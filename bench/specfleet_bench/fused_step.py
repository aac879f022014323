"""What the fused decoder step saves: SmolLM2-135M's few-row forward, its layers in one C++ call
(model.py's FusedStack) against the same forward layer by layer from Python, side by side.

    .venv/bin/python -m specfleet_bench.fused_step [--threads 1] [--rows 1,5] [--reps 30]

For each precision (fp32, int8) and rows a step (1: decoding; K + 1: verifying a chain of K),
the forward at a context of --context tokens, both ways, interleaved rep after rep (a burst of
load hits both alike); medians, and the weight bytes streamed per second against the copy
bandwidth measured in the same run (the roofline).
"""

from __future__ import annotations

import argparse
import json

import torch
from specfleet_api.enums import SERVED_QUANTIZATIONS, Quantization

from specfleet_engine.factory import prepare_model
from specfleet_engine.kernels.cpu_gemm import kernel_summary
from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata
from specfleet_engine.quant import weight_bytes

from .spec_bench import memory_bandwidth_gbs
from .timing import interleaved_medians


def time_forward(model, context: int, rows: int, fused: bool):
    """A closure running one forward of `rows` new tokens after `context` cached ones."""
    cache = PagedKVCache.for_model(model.args, context + 64, 16, dtype=model.dtype)
    bt = BlockTable(cache)
    tokens, meta, last = batch_metadata([bt], [list(range(context))])
    with torch.inference_mode():
        model(tokens, meta, cache.layers, last)
    stack = model.fused

    def step():
        tokens, meta, last = batch_metadata([bt], [list(range(1, rows + 1))])
        model.fused = stack if fused else None
        try:
            with torch.inference_mode():
                model(tokens, meta, cache.layers, last)
        finally:
            model.fused = stack
        bt.truncate(context)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,5", help="new rows a step, comma-separated (default %(default)s)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="a JSON of the medians")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    variants, streamed = {}, {}
    for q in SERVED_QUANTIZATIONS:  # none, int8
        model = prepare_model("smollm2", "fp32", q)
        if model.fused is None:
            raise SystemExit(f"the fused step is not available here ({kernel_summary()}): nothing to compare")
        prec = "fp32" if q == Quantization.NONE else q
        for r in rows:
            for fused in (True, False):
                key = f"{prec} {r} row{'s' if r > 1 else ''} {'fused' if fused else 'layer by layer'}"
                variants[key] = time_forward(model, a.context, r, fused)
                streamed[key] = weight_bytes(model)
    bandwidth = memory_bandwidth_gbs()
    med = interleaved_medians(variants, a.reps)
    print(f"{a.threads} thread(s), context {a.context}, kernel path {kernel_summary()}, "
          f"copy bandwidth {bandwidth:.1f} GB/s")
    print(f"{'forward':<34} {'ms':>7} {'speedup':>8} {'GB/s':>6} {'roofline':>8}")
    out = {"threads": a.threads, "context": a.context, "reps": a.reps, "isa": kernel_summary(),
           "copy_gbs": bandwidth, "median_ms": med, "speedup": {}}
    for k, ms in med.items():
        gbs = streamed[k] / (ms / 1000) / 1e9
        line = f"{k:<34} {ms:7.2f}"
        if k.endswith("fused"):
            ratio = med[k.replace("fused", "layer by layer")] / ms
            out["speedup"][k] = ratio
            line += f" {ratio:7.2f}x"
        else:
            line += " " * 9
        print(f"{line} {gbs:6.1f} {gbs / bandwidth:7.0%}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
