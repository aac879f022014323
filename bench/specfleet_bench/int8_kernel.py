"""The int8 weight-only CPU kernel against fp32 GEMM and torch._weight_int8pack_mm, side by side.

    .venv/bin/python -m specfleet_bench.int8_kernel [--threads 2] [--reps 7]

Three ways to compute y[M, N] = x[M, K] @ W[N, K]^T for fp32 activations:
  fp32   torch.mm(x, W^T) with the weight pre-transposed (TransposedLinear, the fp32 model's path)
  torch  the former int8 path: _weight_int8pack_mm(x.bf16, Wq, scales.bf16).float()
  kernel Int8WeightOnlyLinear's CPU kernel (specfleet_int8::linear), called through the module

Part 1 times each SmolLM2-135M shape alone (its weights stay in cache when they fit). Part 2
runs a whole model's worth of distinct layers (30 x (qkv, wo, w13, w2) + the LM head: ~135 MB
int8, ~540 MB fp32) per M, so weights stream from DRAM as in decoding. The variants run
interleaved, rep after rep, so a noisy machine slows them alike; times are medians over reps.
GB/s counts the weight bytes each variant reads (4 per weight for fp32, 1 for int8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from specfleet_engine.quant import Int8WeightOnlyLinear, int8_kernel  # noqa: E402

SHAPES = {"qkv": (576, 960), "wo": (576, 576), "w13": (576, 3072), "w2": (1536, 576), "lm_head": (576, 49152)}
VARIANTS = ("fp32", "torch", "kernel")


class Layer:
    """One weight in the three forms, and a call per variant."""

    def __init__(self, k: int, n: int):
        lin = nn.Linear(k, n, bias=False)
        nn.init.normal_(lin.weight, std=0.05)
        self.k, self.n = k, n
        self.w_t = lin.weight.data.t().contiguous()  # fp32 [K, N]
        self.q = Int8WeightOnlyLinear(lin, backend="kernel")
        self.w8 = self.q.int8_weight().contiguous()  # [N, K] for _weight_int8pack_mm
        self.scales = self.q.scales

    def run(self, variant: str, x: torch.Tensor) -> torch.Tensor:
        if variant == "fp32":
            return torch.mm(x, self.w_t)
        if variant == "torch":  # the former forward, scale conversion included
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.w8, self.scales.to(torch.bfloat16)).to(x.dtype)
        return self.q(x)

    def bytes(self, variant: str) -> int:
        return self.k * self.n * (4 if variant == "fp32" else 1)


def timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def interleaved(fns: dict, reps: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each fn, the fns taking turns within every rep."""
    for fn in fns.values():
        fn()  # warm-up
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(timed(fn, calls))
    return {name: statistics.median(s) for name, s in samples.items()}


def per_shape(reps: int, ms: list[int]) -> None:
    print("\n== per shape (weights cache-resident when they fit), us per call ==")
    print(f"{'shape':>8} {'K->N':>11} {'M':>3} | {'fp32':>8} {'torch':>8} {'kernel':>8} | "
          f"{'fp32/kern':>9} {'torch/kern':>10} | {'kern GB/s':>9} {'fp32 GB/s':>9}")
    for name, (k, n) in SHAPES.items():
        layer = Layer(k, n)
        for m in ms:
            x = torch.randn(m, k)
            calls = max(3, int(2e6 // (k * n)) + 3)
            t = interleaved({v: (lambda v=v: layer.run(v, x)) for v in VARIANTS}, reps, calls)
            print(f"{name:>8} {f'{k}->{n}':>11} {m:>3} | {t['fp32'] * 1e6:8.1f} {t['torch'] * 1e6:8.1f} "
                  f"{t['kernel'] * 1e6:8.1f} | {t['fp32'] / t['kernel']:9.2f} {t['torch'] / t['kernel']:10.2f} | "
                  f"{layer.bytes('kernel') / t['kernel'] / 1e9:9.1f} {layer.bytes('fp32') / t['fp32'] / 1e9:9.1f}")


def model_sweep(reps: int, ms: list[int], n_layers: int) -> None:
    print(f"\n== model's worth: {n_layers} x (qkv, wo, w13, w2) + lm_head, distinct weights (DRAM), ms per sweep ==")
    t0 = time.perf_counter()
    layers = [Layer(*SHAPES[s]) for _ in range(n_layers) for s in ("qkv", "wo", "w13", "w2")]
    layers.append(Layer(*SHAPES["lm_head"]))
    int8_mb = sum(layer.bytes("kernel") for layer in layers) / 1e6
    print(f"(built {len(layers)} layers in {time.perf_counter() - t0:.0f} s: {int8_mb:.0f} MB int8, "
          f"{4 * int8_mb:.0f} MB fp32)")
    print(f"{'M':>3} | {'fp32':>8} {'torch':>8} {'kernel':>8} | {'fp32/kern':>9} {'torch/kern':>10} | "
          f"{'kern/kern(M=1)':>14} {'fp32/fp32(M=1)':>14} | {'kern GB/s':>9} {'fp32 GB/s':>9} {'torch GB/s':>10}")
    base = {}
    for m in ms:
        xs = {k: torch.randn(m, k) for k in {layer.k for layer in layers}}

        def sweep(v):
            return lambda: [layer.run(v, xs[layer.k]) for layer in layers]

        t = interleaved({v: sweep(v) for v in VARIANTS}, reps, 1)
        base = base or t
        gbs = {v: sum(layer.bytes(v) for layer in layers) / t[v] / 1e9 for v in VARIANTS}
        print(f"{m:>3} | {t['fp32'] * 1e3:8.2f} {t['torch'] * 1e3:8.2f} {t['kernel'] * 1e3:8.2f} | "
              f"{t['fp32'] / t['kernel']:9.2f} {t['torch'] / t['kernel']:10.2f} | "
              f"{t['kernel'] / base['kernel']:14.2f} {t['fp32'] / base['fp32']:14.2f} | "
              f"{gbs['kernel']:9.1f} {gbs['fp32']:9.1f} {gbs['torch']:10.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--ms", default="1,2,4,8", help="rows per call for the per-shape table")
    p.add_argument("--sweep-ms", default="1,2,4,5,8,16", help="rows per call for the model sweep")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--skip-shapes", action="store_true")
    p.add_argument("--skip-sweep", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if int8_kernel() is None:
        sys.exit("the int8 kernel could not be built (see the warning above)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        if not args.skip_shapes:
            per_shape(args.reps, [int(m) for m in args.ms.split(",")])
        if not args.skip_sweep:
            model_sweep(args.reps, [int(m) for m in args.sweep_ms.split(",")], args.layers)


if __name__ == "__main__":
    main()
