"""Router overhead: the same gRPC client, the same requests, straight to one worker and through
`specfleet router` in front of it; throughput ratio (router / direct, the bar is >= 0.97x) and the
router's added time to first token (P50, P99) at several concurrencies.

Not a test: it measures. A worker starts in this process on SmolLM2-135M-Instruct (as
specfleet_bench.serving does) and the router as a separate `specfleet router` process with that
worker as its only backend. Every request is a GenerateStream (the first message times the first
token) with the draft method named, so both paths run the same work. At each concurrency the runs
interleave (direct, router, direct, router, ...) so that both see the same machine, and each figure
is the median of the runs.

    python -m specfleet_bench.router_overhead --quick   # a check that it works (4 prompts, 16 tokens)
    python -m specfleet_bench.router_overhead           # the full run: 32 prompts, 128 tokens, 1/4/16 clients

With `--engine vllm` the backend is a vLLM server instead (vLLM's CPU build from `./dev setup
--vllm`, on the bundled model exported as a HF folder, n-gram drafts unless `--method none`), the
router reaches it as a vLLM pool (`--vllm-backend`), and both paths are the official `openai`
client streaming chat completions over HTTP (usage in the last chunk): vLLM's own OpenAI server
against the router's, with the router's adapter, evidence and windows in the way.

    python -m specfleet_bench.router_overhead --engine vllm --concurrency 1,8 --limit 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

from specfleet_bench.questions import default_questions, pick_prompts
from specfleet_bench.serving import PROMPT_TYPES, percentile, start_local_worker
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc

BAR = 0.97  # router throughput / direct throughput
PATHS = ("direct", "router")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model for the in-process worker")
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench JSON lines (default: the dev set)")
    p.add_argument("--limit", type=int, default=32, help="prompts per run; taken round-robin over categories")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="runs per path at each concurrency (the median is reported)")
    p.add_argument("--method", default="ngram", help="draft method named in every request")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch threads for the in-process worker")
    p.add_argument("--engine", choices=("specfleet", "vllm"), default="specfleet",
                   help="the backend: specfleet's worker (gRPC, default) or a vLLM server (OpenAI HTTP)")
    p.add_argument("--quick", action="store_true",
                   help="a check that it works: --limit 4 --max-tokens 16 --concurrency 1,4 (not a measurement)")
    p.add_argument("--out", type=Path, default=Path("results/router_overhead.json"))
    args = p.parse_args(argv)
    # what serving.start_local_worker reads that this benchmark does not vary: the worker's defaults
    args.max_slowdown = args.draft_uri = args.prefill_chunk = None
    args.quantization = "none"
    if args.quick:
        args.limit, args.max_tokens, args.concurrency = 4, 16, "1,4"
    return args


def drive(prompts: list[dict], concurrency: int, one) -> dict:
    """Every prompt through `one(q) -> (ttft_s | None, tokens)` from `concurrency` client threads
    (an exception of `one` is the request's error): throughput and the time to first token."""
    work: queue.Queue = queue.Queue()
    for i, q in enumerate(prompts):
        work.put((i, q))
    ttft, tokens, errors = [None] * len(prompts), [0] * len(prompts), []

    def client():
        while True:
            try:
                i, q = work.get_nowait()
            except queue.Empty:
                return
            try:
                ttft[i], tokens[i] = one(q)
            except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    firsts = sorted(x for x in ttft if x is not None)
    return {"tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall if wall else 0.0,
            "ttft_p50_s": percentile(firsts, 50), "ttft_p99_s": percentile(firsts, 99), "errors": errors}


def run_streams(stub, prompts: list[dict], concurrency: int, max_tokens: int, method: str) -> dict:
    """Every prompt as a GenerateStream from `concurrency` client threads: throughput and the time
    to first token of each request."""
    def one(q):
        msg = pb.GenerateRequest(prompt=q["turns"][0], apply_chat_template=True, max_tokens=max_tokens,
                                 prompt_type=PROMPT_TYPES.get(q["category"], "chat"), speculation_method=method,
                                 request_id=f"overhead-{q.get('question_id', id(q))}")
        t, first, n = time.perf_counter(), None, 0
        try:
            for m in stub.GenerateStream(msg, timeout=600):
                if m.token_ids and first is None:
                    first = time.perf_counter() - t
                n += len(m.token_ids)
        except grpc.RpcError as e:
            raise RuntimeError(f"{e.code().name}: {e.details()}") from None
        return first, n

    return drive(prompts, concurrency, one)


def run_http_streams(base_url: str, model: str, prompts: list[dict], concurrency: int, max_tokens: int) -> dict:
    """Every prompt as a streamed chat completion (greedy, ignore_eos, usage in the last chunk) from
    `concurrency` client threads of the official openai client: throughput (the usage's completion
    tokens) and the time to first content."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    def one(q):
        t, first, n = time.perf_counter(), None, 0
        for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q["turns"][0]}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - t
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        return first, n

    return drive(prompts, concurrency, one)


VLLM_MODEL = "smollm2-135m-instruct"  # the served model name, and the router's deployment name


def start_vllm(args, tmp: Path):
    """A vLLM server on the bundled model (exported to `tmp`), n-gram drafts at --k-max unless
    --method none; returns it once ready (its start-up printed as it goes)."""
    from specfleet_local.hf_model import cached_export
    from specfleet_local.vllm import VllmServer, ngram_config

    folder = cached_export(args.model, progress=lambda _: None)
    speculative = None if args.method == "none" else ngram_config(args.k_max)
    cpus = None if args.threads is None else ",".join(str(c) for c in range(args.threads))
    server = VllmServer(folder, speculative, served_model_name=VLLM_MODEL, cpus=cpus, log=tmp / "vllm.log").start()
    seconds = server.wait_ready(progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    print(f"vLLM ready in {seconds:.0f} s at {server.url}", file=sys.stderr, flush=True)
    return server


def main_vllm(args, levels: list[int], prompts: list[dict]) -> list[dict]:
    """The vLLM comparison: the same prompts straight to vLLM's OpenAI server and through the router."""
    import tempfile

    from specfleet_router.testing import RouterProcess

    with tempfile.TemporaryDirectory(prefix="vllm-overhead-") as tmp:
        server = start_vllm(args, Path(tmp))
        address = server.url.removeprefix("http://").rstrip("/")
        method = "none" if args.method == "none" else "ngram"
        router = RouterProcess("--vllm-backend", f"stable/{method}={address}", "--default-method", method,
                               "--deployment", f"bench/{VLLM_MODEL}", "--log-level", "INFO").start()
        try:
            router.wait_ready(timeout_s=60)
            urls = {"direct": server.url.rstrip("/") + "/v1", "router": router.base_url}
            print(f"{len(prompts)} prompts x concurrency {levels}, max_tokens {args.max_tokens}, {args.runs} runs per "
                  f"path, vLLM {method}, direct {urls['direct']}, router {urls['router']}", file=sys.stderr, flush=True)
            for url in urls.values():  # warm-up
                run_http_streams(url, VLLM_MODEL, prompts[:1], 1, 8)
            rows = []
            for c in levels:
                runs: dict[str, list[dict]] = {path: [] for path in PATHS}
                for n in range(args.runs):
                    for path in PATHS:
                        r = run_http_streams(urls[path], VLLM_MODEL, prompts, c, args.max_tokens)
                        runs[path].append(r)
                        print(f"  concurrency {c:>2} run {n + 1}/{args.runs} {path:<6}: {r['tokens_per_s']:7.1f} tok/s"
                              + (f", {len(r['errors'])} errors" if r["errors"] else ""), file=sys.stderr, flush=True)
                rows.append(summarize(c, runs))
            return rows
        finally:
            router.proc.terminate()
            router.proc.wait(timeout=30)
            server.stop()


def start_router(worker: str):
    """`specfleet router` with the worker as its only backend (health checks off: the worker is up)."""
    from specfleet_router.testing import RouterProcess

    router = RouterProcess("--backend", f"stable={worker}", "--no-health-check", "--deployment", "bench/overhead",
                           "--log-level", "INFO").start()
    router.wait_ready()
    return router


def summarize(c: int, runs: dict[str, list[dict]]) -> dict:
    """The medians of one concurrency's runs and the router's ratio and overheads."""
    med = {path: {k: statistics.median(r[k] for r in runs[path]) for k in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s")}
           for path in PATHS}
    ratio = med["router"]["tokens_per_s"] / med["direct"]["tokens_per_s"] if med["direct"]["tokens_per_s"] else 0.0
    return {"concurrency": c, "direct": med["direct"], "router": med["router"], "ratio": ratio,
            "ttft_overhead_p50_ms": 1e3 * (med["router"]["ttft_p50_s"] - med["direct"]["ttft_p50_s"]),
            "ttft_overhead_p99_ms": 1e3 * (med["router"]["ttft_p99_s"] - med["direct"]["ttft_p99_s"]),
            "errors": sum(len(r["errors"]) for path in PATHS for r in runs[path]), "runs": runs}


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = pick_prompts(args.questions or default_questions(), args.limit)
    if args.engine == "vllm":
        rows = main_vllm(args, levels, prompts)
        return finish(rows, args, prompts)
    server, worker = start_local_worker(args, max(levels))
    router = start_router(worker)
    channels = {"direct": grpc.insecure_channel(worker), "router": grpc.insecure_channel(router.grpc_target)}
    stubs = {path: pb_grpc.GenerationStub(ch) for path, ch in channels.items()}
    print(f"{len(prompts)} prompts x concurrency {levels}, max_tokens {args.max_tokens}, {args.runs} runs per path, "
          f"model {args.model}, worker {worker}, router {router.grpc_target}", file=sys.stderr, flush=True)
    rows = []
    try:
        for stub in stubs.values():  # warm-up: first forwards allocate, first calls connect
            run_streams(stub, prompts[:1], 1, 8, args.method)
        for c in levels:
            runs: dict[str, list[dict]] = {path: [] for path in PATHS}
            for n in range(args.runs):
                for path in PATHS:  # interleaved: a slow moment of the machine hits both paths alike
                    r = run_streams(stubs[path], prompts, c, args.max_tokens, args.method)
                    runs[path].append(r)
                    print(f"  concurrency {c:>2} run {n + 1}/{args.runs} {path:<6}: {r['tokens_per_s']:7.1f} tok/s, "
                          f"ttft p50 {1e3 * r['ttft_p50_s']:6.1f} ms p99 {1e3 * r['ttft_p99_s']:6.1f} ms"
                          + (f", {len(r['errors'])} errors" if r["errors"] else ""), file=sys.stderr, flush=True)
            rows.append(summarize(c, runs))
    finally:
        for ch in channels.values():
            ch.close()
        router.proc.terminate()
        router.proc.wait(timeout=30)
        server.stop(0)
    return finish(rows, args, prompts)


def finish(rows: list[dict], args, prompts: list[dict]) -> int:
    print_table(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "engine": args.engine, "prompts": len(prompts),
                                    "max_tokens": args.max_tokens, "method": args.method, "runs": args.runs,
                                    "quick": args.quick, "bar": BAR, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


def print_table(rows: list[dict], args) -> None:
    call = "openai chat stream, vLLM" if args.engine == "vllm" else "GenerateStream"
    print(f"\nrouter overhead: {args.model}, {rows and len(rows[0]['runs']['direct'])} runs per path (median), "
          f"max_tokens {args.max_tokens}, {call}" + (" [quick: not a measurement]" if args.quick else ""))
    head = (f"{'conc':>4} | {'direct tok/s':>12} {'router tok/s':>12} {'ratio':>6} {'bar':>5} | "
            f"{'direct ttft p50':>15} {'+router':>8} | {'direct ttft p99':>15} {'+router':>8} | {'errors':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        d = r["direct"]
        print(f"{r['concurrency']:>4} | {d['tokens_per_s']:>12.1f} {r['router']['tokens_per_s']:>12.1f} "
              f"{r['ratio']:>5.3f}x {'ok' if r['ratio'] >= BAR else 'MISS':>5} | "
              f"{1e3 * d['ttft_p50_s']:>12.1f} ms {r['ttft_overhead_p50_ms']:>+5.1f}ms | "
              f"{1e3 * d['ttft_p99_s']:>12.1f} ms {r['ttft_overhead_p99_ms']:>+5.1f}ms | {r['errors']:>6}")


if __name__ == "__main__":
    sys.exit(main())
