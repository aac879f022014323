"""Our CPU kernel's paths against torch's ops, side by side, for fp32 and int8 weights.

    .venv/bin/python -m specfleet_bench.int8_kernel [--threads 2] [--reps 7] [--ms 1,5,16]
    .venv/bin/python -m specfleet_bench.int8_kernel --threads 1 --cpu-time    # on a busy machine

What computes y[M, N] = x[M, K] @ W[N, K]^T for fp32 activations:
  fp32 weights  mkl    torch.mm(x, W^T), the weight pre-transposed (TransposedLinear: the fp32
                       model's path without our kernel)
                <isa>  our kernel's linear_f32 through each path this CPU runs (avx512, avx2,
                       portable; `linear_f32_isa`)
  int8 weights  torch  _weight_int8pack_mm(x.bf16, Wq, scales.bf16) (the int8 layer's fallback)
                <isa>  our kernel's linear through each path (`linear_isa`)

Part 1 times each SmolLM2-135M shape alone (its weights stay in cache when they fit). Part 2
runs a whole model's worth of distinct layers (30 x (qkv, wo, w13, w2) + the LM head: ~135 MB
int8, ~540 MB fp32) per M, so weights stream from DRAM as in decoding. The variants run
interleaved, rep after rep, so a noisy machine slows them alike; times are medians over reps.
--cpu-time (with --threads 1) counts the calling thread's CPU time instead of the wall clock:
what other processes on a shared machine take no longer counts (their pressure on the memory
bus still does). Ratios are against the active path (what the layers run): above 1, it is faster.
GB/s counts the weight bytes each variant reads (4 per weight for fp32, 1 for int8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from specfleet_engine.kernels import cpu_gemm
from specfleet_engine.quant import pack_int8_weight, quantize_per_channel

SHAPES = {"qkv": (576, 960), "wo": (576, 576), "w13": (576, 3072), "w2": (1536, 576), "lm_head": (576, 49152)}
TORCH = {"fp32": "mkl", "int8": "torch"}  # torch's variant for each weight dtype


class Layer:
    """One [N, K] weight in every form the variants read, and a call per variant."""

    def __init__(self, k: int, n: int, ops):
        w = nn.init.normal_(torch.empty(n, k), std=0.05)
        self.k, self.n, self.ops = k, n, ops
        self.w_t = w.t().contiguous()  # fp32 [K, N] for torch.mm
        self.packed_f32 = pack_int8_weight(w)
        q, self.scales = quantize_per_channel(w)
        self.q = q.contiguous()  # int8 [N, K] for _weight_int8pack_mm
        self.scales_bf16 = self.scales.to(torch.bfloat16)
        self.packed_i8 = pack_int8_weight(q)

    def call(self, dtype: str, variant: str, x: torch.Tensor):
        if dtype == "fp32":
            if variant == "mkl":
                return lambda: torch.mm(x, self.w_t)
            return lambda: self.ops.linear_f32_isa(x, self.packed_f32, self.n, None, variant)
        if variant == "torch":
            return lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), self.q, self.scales_bf16).to(x.dtype)
        return lambda: self.ops.linear_isa(x, self.packed_i8, self.scales, None, variant)

    def bytes(self, dtype: str) -> int:
        return self.k * self.n * (4 if dtype == "fp32" else 1)


def interleaved(fns: dict, reps: int, calls: int, clock) -> dict[str, float]:
    """Median seconds per call of each fn, the fns taking turns within every rep."""
    for fn in fns.values():
        fn()  # warm-up
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = clock()
            for _ in range(calls):
                fn()
            samples[name].append((clock() - t) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def header(variants: list[str], active: str, unit: str) -> str:
    others = [v for v in variants if v != active]
    return (" | ".join(f"{v:>9}" for v in variants) + f"  ({unit}) || "
            + " ".join(f"{f'{v}/{active}':>14}" for v in others) + f" || {active + ' GB/s':>11}")


def row(t: dict[str, float], variants: list[str], active: str, scale: float, gb: float) -> str:
    others = [v for v in variants if v != active]
    return (" | ".join(f"{t[v] * scale:9.2f}" for v in variants) + "       || "
            + " ".join(f"{t[v] / t[active]:14.2f}" for v in others) + f" || {gb / t[active]:11.1f}")


def per_shape(ops, dtypes: list[str], isas: list[str], active: str, ms: list[int], reps: int, clock) -> None:
    for dtype in dtypes:
        variants = isas + [TORCH[dtype]]
        print(f"\n== {dtype} weights, per shape (cache-resident when they fit) ==")
        print(f"{'shape':>8} {'K->N':>11} {'M':>3} | " + header(variants, active, "us per call"))
        for name, (k, n) in SHAPES.items():
            layer = Layer(k, n, ops)
            for m in ms:
                x = torch.randn(m, k)
                calls = max(3, int(2e6 // (k * n)) + 3)
                t = interleaved({v: layer.call(dtype, v, x) for v in variants}, reps, calls, clock)
                print(f"{name:>8} {f'{k}->{n}':>11} {m:>3} | " + row(t, variants, active, 1e6, layer.bytes(dtype) / 1e9))


def model_sweep(ops, dtypes: list[str], isas: list[str], active: str, ms: list[int], reps: int, n_layers: int,
                clock) -> None:
    t0 = time.perf_counter()
    layers = [Layer(*SHAPES[s], ops) for _ in range(n_layers) for s in ("qkv", "wo", "w13", "w2")]
    layers.append(Layer(*SHAPES["lm_head"], ops))
    print(f"\n(built {len(layers)} distinct layers in {time.perf_counter() - t0:.0f} s: "
          f"{sum(layer.bytes('int8') for layer in layers) / 1e6:.0f} MB int8, "
          f"{sum(layer.bytes('fp32') for layer in layers) / 1e6:.0f} MB fp32)")
    for dtype in dtypes:
        variants = isas + [TORCH[dtype]]
        print(f"\n== {dtype} weights, a model's worth: {n_layers} x (qkv, wo, w13, w2) + lm_head (DRAM) ==")
        print(f"{'M':>3} | " + header(variants, active, "ms per sweep") + f" {'x M=1':>6}")
        base = None
        for m in ms:
            xs = {k: torch.randn(m, k) for k in {layer.k for layer in layers}}
            calls = {v: [layer.call(dtype, v, xs[layer.k]) for layer in layers] for v in variants}
            t = interleaved({v: (lambda fs=fs: [f() for f in fs]) for v, fs in calls.items()}, reps, 1, clock)
            base = base or t[active]
            gb = sum(layer.bytes(dtype) for layer in layers) / 1e9
            print(f"{m:>3} | " + row(t, variants, active, 1e3, gb) + f" {t[active] / base:6.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--ms", default="1,5,16", help="rows per call for the per-shape table")
    p.add_argument("--sweep-ms", default="1,2,3,5,8,16", help="rows per call for the model sweep")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtypes", default="fp32,int8", help="weight dtypes to compare: fp32, int8 or both")
    p.add_argument("--isas", default=None, help="our kernel's paths to run (default: every one this CPU has)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the calling thread's CPU time, not the wall clock (needs --threads 1)")
    p.add_argument("--skip-shapes", action="store_true")
    p.add_argument("--skip-sweep", action="store_true")
    args = p.parse_args()
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time counts one thread's time: give --threads 1")
    torch.set_num_threads(args.threads)
    ops = cpu_gemm.int8_kernel()
    if ops is None:
        sys.exit("the CPU kernel could not be built (see the warning above)")
    available, active = cpu_gemm.available_isas(), cpu_gemm.active_isa()
    isas = args.isas.split(",") if args.isas else available
    if unknown := [i for i in isas if i not in available]:
        p.error(f"--isas: this CPU runs {', '.join(available)}, not {', '.join(unknown)}")
    if active not in isas:
        isas.insert(0, active)
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in TORCH]:
        p.error(f"--dtypes: {', '.join(bad)} not in fp32, int8")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'thread CPU time' if args.cpu_time else 'wall clock'}; "
          f"cpu kernel: {active} (this CPU runs: {', '.join(available)})")
    with torch.inference_mode():
        if not args.skip_shapes:
            per_shape(ops, dtypes, isas, active, [int(m) for m in args.ms.split(",")], args.reps, clock)
        if not args.skip_sweep:
            model_sweep(ops, dtypes, isas, active, [int(m) for m in args.sweep_ms.split(",")], args.reps, args.layers,
                        clock)


if __name__ == "__main__":
    main()
