"""The GPU check: one run of under 7 minutes that needs torch, triton and this repository only (no
network, random weights, no file larger than a few MB), printing a table per part and writing JSON.

    bench/gpu_check.sh                                     # on a CUDA machine: docs/bench/gpu-check.json
    python -m specfleet_bench.gpu_check --cpu-smoke --json /tmp/x.json   # tiny shapes on the CPU

(a) `pytest -m gpu` on the engine's CUDA tests; (b) tree attention at verify shapes (batch 1-64, prefix
512-32k, trees of 8 and 64 nodes, head dim 128, 32 query / 8 KV heads, bf16): the Triton kernel, its
torch reference, and SDPA with a dense bool mask over K/V gathered from the paged cache, each timed,
with the kernel's achieved bandwidth (prefix K/V bytes / time) against the device's measured copy
bandwidth; (c) the rejection-sampling kernel against its reference, when kernels/rejection.py is
there; (d) speculative decoding smoke runs: a random SmolLM2-shaped model in fp32 (n-gram output must
equal plain greedy output, with CUDA graphs the output without) and a 1B-class model in bf16, tokens/s
of each, with the decode step's CUDA graphs off and on. --cpu-smoke runs every part
but (a) at tiny shapes on the CPU, the kernels under TRITON_INTERPRET=1, so the script cannot rot.
A part that fails records its error and the rest still run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from specfleet_api.enums import Method

ROOT = Path(__file__).resolve().parents[2]

# Random-weight stand-ins: SmolLM2-135M's configuration and a Llama-3.2-1B-shaped one.
SMOLLM2 = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536,
               norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
               bos_token_id=1, eos_token_ids=[2])
LLAMA_1B = dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                intermediate_size=8192, norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2])
TINY = dict(vocab_size=111, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
            max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=0, eos_token_ids=[110])

FULL = dict(batches=(1, 8, 64), prefixes=(512, 4096, 32768), trees=(8, 64), n_heads=32, n_kv=8, head_dim=128,
            block_size=16, dtype="bfloat16", ref_max_rows=8 * 32768 * 8, reject_vocab=(49152, 128256),
            reject_batch=64, reject_nodes=8, models=(("smollm2-135m-random", SMOLLM2, "float32", True),
                                                     ("llama-1b-class-random", LLAMA_1B, "bfloat16", False)),
            prompt_period=16, prompt_repeats=8, max_tokens=128, k=4, batch_seqs=8)
SMOKE = dict(batches=(1, 2), prefixes=(40, 300), trees=(3, 8), n_heads=4, n_kv=2, head_dim=32, block_size=16,
             dtype="float32", ref_max_rows=math.inf, reject_vocab=(111,), reject_batch=2, reject_nodes=3,
             models=(("tiny-random", TINY, "float32", True),), prompt_period=5, prompt_repeats=6, max_tokens=16, k=4,
             batch_seqs=2)


def log(*a) -> None:
    print(*a, flush=True)


def timer(device):
    """ms per call of fn: triton.testing.do_bench on CUDA (it clears L2 between calls), else the wall clock."""
    import torch

    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn, budget_ms=100: do_bench(fn, warmup=max(1, budget_ms // 4), rep=budget_ms)

    def wall(fn, budget_ms=100):
        fn()
        n, t = 0, time.perf_counter()
        while n < 2 or (time.perf_counter() - t) * 1e3 < budget_ms and n < 50:
            fn()
            n += 1
        return (time.perf_counter() - t) * 1e3 / n

    del torch
    return wall


def copy_bandwidth(device, bench) -> float:
    """GB/s of a large device-to-device copy (bytes read + bytes written)."""
    import torch

    n = (1 << 28) if device.type == "cuda" else (1 << 22)  # 1 GiB of fp32 on CUDA
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), 200)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


# -- (a) ------------------------------------------------------------------------------------------

def run_pytest(timeout: int) -> dict:
    files = ["tests/engine/test_cuda.py", "tests/engine/test_tree_attention.py"]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("api", "bench", "worker"))}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": timeout}
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
    log("\n".join(tail))
    return {"status": "passed" if proc.returncode == 0 else f"failed (rc {proc.returncode})", "tail": tail}


# -- (b) ------------------------------------------------------------------------------------------

def random_tree(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]


def sdpa_paged(q, k_flat, v_flat, slots, kt, vt, mask, scale):
    """The dense alternative: gather each sequence's K/V from the pages, then one SDPA under a bool mask.
    q [B * n, H, hd]; k_flat, v_flat [Hkv, slots, hd]; slots [B, P]; kt, vt [B * n, Hkv, hd]; mask [n, P + n]."""
    import torch
    import torch.nn.functional as F

    (B, P), (T, H, hd), Hkv = slots.shape, q.shape, k_flat.shape[0]
    n = T // B
    k = torch.cat([k_flat[:, slots.flatten()].view(Hkv, B, P, hd), kt.view(B, n, Hkv, hd).permute(2, 0, 1, 3)], 2)
    v = torch.cat([v_flat[:, slots.flatten()].view(Hkv, B, P, hd), vt.view(B, n, Hkv, hd).permute(2, 0, 1, 3)], 2)
    o = F.scaled_dot_product_attention(q.view(B, n, H, hd).transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(T, H, hd)


def tree_attention_part(cfg: dict, device, bench) -> dict:
    import torch

    from specfleet_engine.kernels import tree_attention as ta

    dtype = getattr(torch, cfg["dtype"])
    H, Hkv, hd, bs = cfg["n_heads"], cfg["n_kv"], cfg["head_dim"], cfg["block_size"]
    copy_gbs = copy_bandwidth(device, bench)
    log(f"\n(b) tree attention, {H} q / {Hkv} kv heads, head dim {hd}, {cfg['dtype']}, block size {bs}; "
        f"device copy bandwidth {copy_gbs:.0f} GB/s")
    log(f"{'batch':>5} {'prefix':>6} {'tree':>4} | {'triton ms':>9} {'ref ms':>8} {'sdpa ms':>8} | "
        f"{'vs ref':>6} {'vs sdpa':>7} | {'GB/s':>6} {'of copy':>7} | {'max err':>8}")
    rows = []
    scale = hd ** -0.5
    for B in cfg["batches"]:
        for P in cfg["prefixes"]:
            blocks = B * -(-P // bs)
            g = torch.Generator(device=device).manual_seed(B * 7 + P)
            # the model's layout: [Hkv, slots, hd] per layer, read as [blocks, block_size, Hkv, hd]
            k_flat = torch.randn(Hkv, blocks * bs, hd, device=device, dtype=dtype, generator=g)
            v_flat = torch.randn(Hkv, blocks * bs, hd, device=device, dtype=dtype, generator=g)
            kc = k_flat.view(Hkv, blocks, bs, hd).permute(1, 2, 0, 3)
            vc = v_flat.view(Hkv, blocks, bs, hd).permute(1, 2, 0, 3)
            perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(P)).to(torch.int32)
            tables = perm.view(B, -1)
            slots = (tables.long()[:, :, None] * bs + torch.arange(bs)).view(B, -1)[:, :P].to(device)  # [B, P]
            for n in cfg["trees"]:
                parents = random_tree(n, n)
                T = B * n
                q = torch.randn(T, H, hd, device=device, dtype=dtype, generator=g)
                kt = torch.randn(T, Hkv, hd, device=device, dtype=dtype, generator=g)
                vt = torch.randn(T, Hkv, hd, device=device, dtype=dtype, generator=g)
                batch = ta.tree_batch(tables, [P] * B, [parents] * B, device)
                tp = torch.tensor(parents * B, dtype=torch.int32, device=device)
                cu = torch.arange(0, T + 1, n, dtype=torch.int32, device=device)
                pl = torch.full((B,), P, dtype=torch.int32, device=device)
                bt = tables.to(device)
                mask = torch.cat([torch.ones(n, P, dtype=torch.bool), ta.tree_mask(parents)], 1).to(device)

                triton_fn = functools.partial(ta.tree_attention_launch, q, kc, vc, batch, kt, vt, scale)
                ref_fn = functools.partial(ta.tree_attention_ref, q, kc, vc, bt, pl, kt, vt, tp, cu, scale)
                sdpa_fn = functools.partial(sdpa_paged, q, k_flat, v_flat, slots, kt, vt, mask, scale)

                got = triton_fn()
                row = {"batch": B, "prefix": P, "tree": n, "triton_ms": bench(triton_fn)}
                if B * P * n <= cfg["ref_max_rows"]:
                    want = ref_fn()
                    row["max_err_vs_ref"] = float((got.float() - want.float()).abs().max())
                    row["ref_ms"] = bench(ref_fn, 50)
                row["sdpa_ms"] = bench(sdpa_fn)
                row["max_err_vs_sdpa"] = float((got.float() - sdpa_fn().float()).abs().max())
                kv_bytes = 2 * B * P * Hkv * hd * q.element_size()
                row["gbs"] = kv_bytes / (row["triton_ms"] * 1e-3) / 1e9
                row["of_copy"] = row["gbs"] / copy_gbs
                rows.append(row)
                ref, ms = row.get("ref_ms"), row["triton_ms"]
                err = row.get("max_err_vs_ref", row.get("max_err_vs_sdpa"))
                ref_s, vs_ref = ("-", "-") if ref is None else (f"{ref:.3f}", f"{ref / ms:.1f}x")
                log(f"{B:>5} {P:>6} {n:>4} | {ms:>9.3f} {ref_s:>8} {row['sdpa_ms']:>8.3f} | {vs_ref:>6} "
                    f"{row['sdpa_ms'] / ms:>6.1f}x | {row['gbs']:>6.0f} {row['of_copy']:>7.0%} | {err:>8.1e}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "rows": rows}


# -- (c) ------------------------------------------------------------------------------------------

def rejection_part(cfg: dict, device, bench) -> dict:
    try:
        from specfleet_engine.kernels import rejection
    except ImportError:
        log("\n(c) rejection sampling: skipped: not present")
        return {"status": "skipped: not present"}
    import torch

    B, n = cfg["reject_batch"], cfg["reject_nodes"]
    log(f"\n(c) rejection sampling, {B} sequences x a chain of {n} drafts, fp32 probabilities")
    log(f"{'vocab':>6} {'mode':>7} | {'triton ms':>9} {'ref ms':>8} {'speedup':>7}")
    rows = []
    for V in cfg["reject_vocab"]:
        g = torch.Generator(device=device).manual_seed(V)
        R = B * (n + 1)
        target = torch.softmax(torch.randn(R, V, device=device, generator=g) * 3, -1)
        draft = torch.softmax(torch.randn(R, V, device=device, generator=g) * 3, -1)
        tokens = torch.multinomial(draft, 1, generator=g).view(-1)
        for mode in ("greedy", "sampled"):
            greedy = mode == "greedy"
            batch = rejection.TreeVerifyBatch(
                torch.arange(0, R + 1, n + 1, device=device), tokens,
                torch.tensor(list(range(-1, n)) * B, device=device), torch.full((B,), greedy, device=device),
                torch.full((R,), not greedy, device=device))
            gens = [None if greedy else torch.Generator(device=device).manual_seed(b) for b in range(B)]
            dp = None if greedy else draft
            args = (target, dp, batch, gens)
            row = {"vocab": V, "mode": mode,
                   "triton_ms": bench(functools.partial(rejection.rejection_sample_triton, *args)),
                   "ref_ms": bench(functools.partial(rejection.rejection_sample_ref, *args), 50)}
            rows.append(row)
            log(f"{V:>6} {mode:>7} | {row['triton_ms']:>9.3f} {row['ref_ms']:>8.3f} "
                f"{row['ref_ms'] / row['triton_ms']:>6.1f}x")
    return {"rows": rows}


# -- (d) ------------------------------------------------------------------------------------------

def random_model(arch: dict, dtype, device, seed: int = 0, scale: float = 2.0):
    """A Transformer of that shape with random weights made on the device (no CPU copy of a 1B model);
    `scale` sharpens the logits so that a repetitive prompt yields repetitive output."""
    import torch

    from specfleet_engine.model import ModelArgs, Transformer, rope_cache

    args = ModelArgs(**arch)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, scale / p.shape[-1] ** 0.5, generator=g)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    cos, sin = rope_cache(args, args.max_position_embeddings)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.to(dtype).eval().requires_grad_(False)


def decode_part(cfg: dict, device) -> dict:
    import torch

    from specfleet_engine.engine import Engine
    from specfleet_engine.proposers import NgramProposer
    from specfleet_engine.sampling import SamplingParams

    log(f"\n(d) speculative decoding smoke runs, greedy, n-gram k={cfg['k']}, "
        f"{cfg['max_tokens']} new tokens, prompt: {cfg['prompt_period']} tokens x {cfg['prompt_repeats']}")
    log(f"{'model':>22} {'dtype':>8} {'seqs':>4} {'graphs':>6} | {'plain tok/s':>11} {'ngram tok/s':>11} "
        f"{'speedup':>7} {'accepted':>11} {'equal':>5}")
    from specfleet_engine.graphs import GRAPHS_ENV
    from specfleet_engine.kernels.tree_attention import KERNELS_ENV

    out = []
    for (name, arch, dtype_name, must_equal), graphed in itertools.product(cfg["models"], (False, True)):
        model = random_model(arch, getattr(torch, dtype_name), device)
        # graphs: captured on CUDA; in the smoke, the same padded step run eagerly, through the
        # interpreted Triton attention it needs (graphs.py)
        os.environ[GRAPHS_ENV] = ("eager" if device.type != "cuda" else "") if graphed else "0"
        if graphed and device.type != "cuda":
            os.environ[KERNELS_ENV] = "triton"
        engine = Engine(model, proposers={"ngram": NgramProposer()}, max_kv_tokens=16384, block_size=16,
                        k_policy="fixed")
        os.environ.pop(GRAPHS_ENV)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, min(arch["vocab_size"], 1000), (cfg["prompt_period"],), generator=g).tolist()
                   * cfg["prompt_repeats"] for _ in range(cfg["batch_seqs"])]
        params = SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=True)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for n_seqs in (1, cfg["batch_seqs"]):
            res = {}
            for method in (Method.NONE.value, Method.NGRAM.value):  # warm up: the kernels compile per shape
                run_to_end(engine, [engine.add(p, params, method, cfg["k"]) for p in prompts[:n_seqs]])
            for method in (Method.NONE.value, Method.NGRAM.value):
                sync(device)
                t = time.perf_counter()
                seqs = run_to_end(engine, [engine.add(p, params, method, cfg["k"]) for p in prompts[:n_seqs]])
                sync(device)
                dt = time.perf_counter() - t
                res[method] = {"outputs": [s.output for s in seqs], "seconds": dt,
                               "tok_s": sum(len(s.output) for s in seqs) / dt,
                               "accepted": sum(s.stats.num_accepted_tokens for s in seqs),
                               "drafted": sum(s.stats.num_draft_tokens for s in seqs)}
            equal = res["ngram"]["outputs"] == res["none"]["outputs"]
            ungraphed = next((r for r in out if (r["model"], r["seqs"], r["graphs"]) == (name, n_seqs, False)), None)
            if ungraphed is not None:  # with graphs, the same tokens as without
                equal = equal and res["none"]["outputs"] == ungraphed.pop("outputs")
            row = {"model": name, "dtype": dtype_name, "seqs": n_seqs, "graphs": graphed, "equal": equal,
                   "must_equal": must_equal, "plain_tok_s": res["none"]["tok_s"], "ngram_tok_s": res["ngram"]["tok_s"],
                   "accepted": res["ngram"]["accepted"], "drafted": res["ngram"]["drafted"],
                   "outputs": None if graphed else res["none"]["outputs"],
                   "graph_stats": dict(engine.graphs.stats) if engine.graphs is not None else None}
            if row["outputs"] is None:
                del row["outputs"]
            row["anatomy"] = step_anatomy(engine, prompts[:n_seqs], cfg, device, weight_bytes)
            out.append(row)
            rate = row["accepted"] / max(1, row["drafted"])
            log(f"{name:>22} {dtype_name:>8} {n_seqs:>4} {'on' if graphed else 'off':>6} | "
                f"{row['plain_tok_s']:>11.1f} {row['ngram_tok_s']:>11.1f} "
                f"{row['ngram_tok_s'] / row['plain_tok_s']:>6.2f}x {rate:>11.0%} {str(equal):>5}")
            an = row["anatomy"]
            log(f"{'':>22} plain step: {an['step_ms']:.2f} ms wall, {an['kernel_ms']:.2f} ms in {an['launches']:.0f} "
                f"kernels (GPU busy {an['busy']:.0%}); weights streamed at {an['weight_gb_s']:.0f} GB/s")
            if must_equal and not equal:
                raise AssertionError(f"{name}: n-gram speculation or graphs changed the greedy output ({dtype_name})")
        if graphed and (engine.graphs is None or not engine.graphs.stats["replays"]):
            raise AssertionError(f"{name}: the engine took no graphed step")
        os.environ.pop(KERNELS_ENV, None)
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": out}


def run_to_end(engine, seqs: list) -> list:
    """Steps the engine until every one of `seqs` has finished; returns them."""
    while not all(s.finished for s in seqs):
        engine.step()
    return seqs


def sync(device) -> None:
    """Waits for the device's queued work (a CUDA timer's edge); nothing on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def step_anatomy(engine, prompts: list, cfg: dict, device, weight_bytes: int, steps: int = 16) -> dict:
    """Plain decoding's step, profiled: wall ms, the ms its kernels ran on the device and how many
    there were (on the CPU, none), and the weights' bytes per wall second (the roofline's numerator:
    a decode step streams every weight once). Busy well under 100% is host time: the Python per
    layer and the launches that CUDA graphs remove."""
    from torch.profiler import ProfilerActivity, profile

    from specfleet_engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    seqs = [engine.add(p, params, Method.NONE.value, 0) for p in prompts]
    engine.step()  # the prefill
    engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = (time.perf_counter() - t) / steps
    run_to_end(engine, seqs)
    kernel_us, launches = 0.0, 0
    for ev in prof.key_averages():
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            kernel_us += getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            launches += ev.count
    return {"step_ms": wall * 1e3, "kernel_ms": kernel_us / 1e3 / steps, "launches": launches / steps,
            "busy": kernel_us / 1e6 / steps / wall, "weight_gb_s": weight_bytes / wall / 1e9}


# -- the run --------------------------------------------------------------------------------------

def part(results: dict, name: str, fn, *a) -> None:
    t = time.perf_counter()
    try:
        results[name] = fn(*a)
    except Exception as e:  # noqa: BLE001 - one failing part must not hide the others' figures
        traceback.print_exc()
        results[name] = {"status": f"error: {type(e).__name__}: {e}"}
    results[name]["seconds"] = round(time.perf_counter() - t, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, kernels interpreted")
    ap.add_argument("--json", type=Path, help="where to write the results (default: $OUT/gpu-check.json if $OUT "
                    "is set, else docs/bench/gpu-check.json)")
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--pytest-timeout", type=int, default=150)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is first built, i.e. after this
    import torch

    smoke = args.cpu_smoke or not torch.cuda.is_available()
    if smoke and not args.cpu_smoke:
        log("no CUDA device: running the CPU smoke (pass --cpu-smoke to say so)")
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cpu" if smoke else "cuda")
    cfg = SMOKE if smoke else FULL
    bench = timer(device)
    results: dict = {"mode": "cpu-smoke" if smoke else "gpu", "torch": torch.__version__,
                     "device": torch.cuda.get_device_name() if not smoke else "cpu",
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    log(f"specfleet GPU check ({results['mode']}): torch {results['torch']}, triton {results['triton']}, "
        f"{results['device']}")
    t0 = time.perf_counter()
    if smoke or args.skip_pytest:
        results["pytest"] = {"status": "skipped"}
    else:
        log("\n(a) pytest -m gpu")
        part(results, "pytest", run_pytest, args.pytest_timeout)
    part(results, "tree_attention", tree_attention_part, cfg, device, bench)
    part(results, "rejection", rejection_part, cfg, device, bench)
    part(results, "decode", decode_part, cfg, device)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    default_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "docs" / "bench"
    path = args.json or default_dir / "gpu-check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    failed = [k for k, v in results.items() if isinstance(v, dict) and str(v.get("status", "")).startswith(
        ("error", "failed", "timeout"))]
    log(f"\ndone in {results['seconds']} s; results in {path}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
