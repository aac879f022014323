"""The rows curve of SmolLM2-135M's fused decoder step (model.py's FusedStack) on each CPU kernel
path: what verifying K draft rows costs against decoding one, and how far each path is from its
bound on this machine.

    .venv/bin/python -m specfleet_bench.fused_step [--threads 2] [--rows 1,2,4,8,16] [--isa avx512vnni,avx2]
    .venv/bin/python -m specfleet_bench.fused_step --layer-by-layer     # also the Python path

For each precision (fp32, int8), path (--isa, default every path this CPU runs) and rows a step
(1: decoding; K + 1: verifying a chain of K), the forward at a context of --context tokens, all
of them interleaved rep after rep (a burst of load hits them alike); medians. Each path's bound
for r rows is max(streaming the weights once at the copy bandwidth measured in the same run,
r rows' multiply-adds at the path's peak), the peak being cache-resident GEMMs of 12 rows
(576 x 1536) on that path with the same threads, timed among the forwards. A step can overlap
its streaming and its arithmetic, so while the second term stays below the first, a verify of r
rows near its bound costs about what one row does. --layer-by-layer adds the same forwards run
layer by layer from Python (what the fused step saves).
"""

from __future__ import annotations

import argparse
import json

import torch
from specfleet_api.enums import SERVED_QUANTIZATIONS, Quantization
from torch import nn

from specfleet_engine.factory import prepare_model
from specfleet_engine.kernels import cpu_gemm
from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata
from specfleet_engine.quant import Int8WeightOnlyLinear, PackedLinear, pack_int8_weight, quantize_per_channel, \
    weight_bytes

from .spec_bench import memory_bandwidth_gbs
from .timing import interleaved_medians

PEAK_SHAPE = (12, 576, 1536)  # rows, K, N of the GEMM that measures a path's peak (~0.9 MB int8)


def time_forward(model, context: int, rows: int, fused: bool, isa: str):
    """A closure running one forward of `rows` new tokens after `context` cached ones on `isa`."""
    cache = PagedKVCache.for_model(model.args, context + 64, 16, dtype=model.dtype)
    bt = BlockTable(cache)
    tokens, meta, last = batch_metadata([bt], [list(range(context))])
    with torch.inference_mode():
        model(tokens, meta, cache.layers, last)
    stack = model.fused

    def step():
        cpu_gemm.select_isa(isa)
        tokens, meta, last = batch_metadata([bt], [list(range(1, rows + 1))])
        model.fused = stack if fused else None
        try:
            with torch.inference_mode():
                model(tokens, meta, cache.layers, last)
        finally:
            model.fused = stack
        bt.truncate(context)
    return step


def multiply_adds(model: nn.Module) -> int:
    """Multiply-adds of one row through every linear layer (the GEMMs; attention is apart)."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, (nn.Linear, PackedLinear, Int8WeightOnlyLinear)))


def peak_call(prec: str, isa: str, calls: int = 20):
    """A closure running `calls` cache-resident GEMMs of PEAK_SHAPE on `isa`: the path's compute
    rate on this machine with the threads set, the weights never waiting on memory. Timed among
    the forwards (interleaved), so that a burst of load hits the peak as it hits them."""
    ops = cpu_gemm.int8_kernel()
    m, k, n = PEAK_SHAPE
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k)
    if prec == "int8":
        q, scales = quantize_per_channel(w)
        packed = pack_int8_weight(q)
        call = lambda: ops.linear_isa(x, packed, scales, None, isa)  # noqa: E731
    else:
        packed = pack_int8_weight(w)
        call = lambda: ops.linear_f32_isa(x, packed, n, None, isa)  # noqa: E731

    def burst():
        for _ in range(calls):
            call()
    return burst


def peak_gmacs(burst_ms: float, calls: int = 20) -> float:
    m, k, n = PEAK_SHAPE
    return calls * m * k * n / (burst_ms / 1000) / 1e9


def print_curve(prec: str, isas: list[str], rows: list[int], med: dict, bound: dict, peaks: dict, gb: float,
                bandwidth: float, kind: str) -> None:
    print(f"\n{prec} weights, {kind}: {gb * 1000:.1f} MB a step; ms (x one row), the bound's ms below")
    head = f"{'path':<11} {'peak GMAC/s':>11} {'GB/s':>6} {'of copy':>7} |" + "".join(
        f"{f'{r} row' + ('s' if r > 1 else ''):>16}" for r in rows)
    print(head)
    for isa in isas:
        one = med[isa][rows[0]]
        gbs = gb / (one / 1000)
        line = f"{isa:<11} {peaks[isa]:11.1f} {gbs:6.1f} {gbs / bandwidth:7.0%} |"
        for r in rows:
            ms = med[isa][r]
            line += f"{ms:9.2f} ({ms / one:4.2f}x)"[-16:].rjust(16)
        print(line)
        print(f"{'  bound':<11} {'':>11} {'':>6} {'':>7} |" + "".join(f"{bound[isa][r]:16.2f}" for r in rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16", help="new rows a step, comma-separated (default %(default)s)")
    p.add_argument("--isa", default=None,
                   help=f"kernel paths, comma-separated ({', '.join(cpu_gemm.ISAS)}; default: every one this CPU runs)")
    p.add_argument("--precisions", default="fp32,int8", help="fp32, int8 or both (default %(default)s)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layer-by-layer", action="store_true", help="also time the forwards layer by layer")
    p.add_argument("--out", default=None, help="a JSON of the medians, bounds and peaks")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = sorted({int(r) for r in a.rows.split(",")})
    if cpu_gemm.int8_kernel() is None:
        raise SystemExit(f"the CPU kernel is not available here ({cpu_gemm.kernel_summary()}): nothing to time")
    runs = cpu_gemm.available_isas()
    isas = [i.strip() for i in a.isa.split(",")] if a.isa else runs
    for isa in isas:
        if isa not in runs:
            raise SystemExit(f"--isa {isa}: this CPU runs {', '.join(runs)}")
    precs = [q.strip() for q in a.precisions.split(",")]
    ways = [True, False] if a.layer_by_layer else [True]
    variants, gb, macs = {}, {}, {}
    for q in SERVED_QUANTIZATIONS:  # none, int8
        prec = "fp32" if q == Quantization.NONE else str(q)
        if prec not in precs:
            continue
        cpu_gemm.select_isa(runs[0])  # the model packs its fp32 weights where the active path is SIMD
        model = prepare_model("smollm2", "fp32", q)
        if model.fused is None:
            raise SystemExit(f"the fused step is not available here ({cpu_gemm.kernel_summary()}): nothing to time")
        gb[prec], macs[prec] = weight_bytes(model) / 1e9, multiply_adds(model)
        for isa in isas:
            for r in rows:
                for fused in ways:
                    variants[(prec, isa, r, fused)] = time_forward(model, a.context, r, fused, isa)
        for isa in isas:
            variants[(prec, isa, "peak")] = peak_call(prec, isa)
    bandwidth = memory_bandwidth_gbs()
    med = interleaved_medians(variants, a.reps)
    peaks = {prec: {isa: peak_gmacs(med[(prec, isa, "peak")]) for isa in isas} for prec in gb}
    cpu_gemm.select_isa(runs[0])
    print(f"{a.threads} thread(s), context {a.context}, medians of {a.reps} interleaved reps, "
          f"copy bandwidth {bandwidth:.1f} GB/s; this CPU runs {', '.join(runs)}")
    out = {"threads": a.threads, "context": a.context, "reps": a.reps, "cpu_runs": runs, "copy_gbs": bandwidth,
           "weight_gb": gb, "multiply_adds_a_row": macs, "peak_gmacs": peaks, "median_ms": {}, "bound_ms": {}}
    for prec in gb:
        bound = {isa: {r: max(gb[prec] / bandwidth, r * macs[prec] / (peaks[prec][isa] * 1e9)) * 1000 for r in rows}
                 for isa in isas}
        out["bound_ms"][prec] = bound
        for fused in ways:
            kind = "fused step" if fused else "layer by layer"
            curve = {isa: {r: med[(prec, isa, r, fused)] for r in rows} for isa in isas}
            out["median_ms"][f"{prec} {kind}"] = curve
            print_curve(prec, isas, rows, curve, bound, peaks[prec], gb[prec], bandwidth, kind)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
