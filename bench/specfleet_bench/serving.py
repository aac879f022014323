"""Serving benchmark: throughput and latency of the gRPC worker at several concurrencies, with
speculation on and off in the same run, on Spec-Bench prompts.

Not a test: it measures. By default it starts a worker in this process on SmolLM2-135M-Instruct
(a free loopback port) and drives it over real gRPC; --target HOST:PORT drives a running worker
instead (with --admin-target HOST:PORT, its Admin port: `specfleet serve --admin-port`, 50060
on loopback by default). For each concurrency, speculation is switched off and on through the
Admin service (the same worker, no restart), and every prompt is sent by that many client threads. Greedy outputs
with speculation on must equal those with it off; the table says whether they did.

    python -m specfleet_bench.serving --limit 8 --max-tokens 64 --concurrency 1,4   # a quick look
    python -m specfleet_bench.serving                                              # the full run
    python -m specfleet_bench.serving --limit 32 --concurrency 16 --trees 4 --repeats 3   # trees vs chains
    python -m specfleet_bench.serving --method eagle --concurrency 16 --trees 2     # the shipped EAGLE head, on vs off

--router HOST:PORT drives a running router's gRPC front instead (a fleet of specfleet workers or of
vLLM pools behind it): speculation is off and on per request, by naming the method in each request
(`none`, or --method), which on vLLM picks the arm's plain or speculating pool.

    python -m specfleet_bench.serving --router 127.0.0.1:50050 --limit 16 --concurrency 1,8

--trees B adds a third mode beside off and on: speculation on with draft trees of up to B
children a node (the in-process worker's engine cap, set between runs); "on" is then chains.
--repeats N runs every mode N times, interleaved (the order rotates each round), and reports
the median of each round's ratios.
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

REPO = Path(__file__).resolve().parents[1]

from specfleet_api.engine_config import BUNDLED_EAGLE_HEAD  # noqa: E402
from specfleet_api.enums import SERVED_QUANTIZATIONS, SPECULATIVE_METHODS  # noqa: E402
from specfleet_bench.questions import default_questions, pick_prompts  # noqa: E402
from specfleet_proto import worker_pb2 as pb  # noqa: E402
from specfleet_proto import worker_pb2_grpc as pb_grpc  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HOST:PORT of a running worker (default: start one here)")
    p.add_argument("--router", default=None, metavar="HOST:PORT",
                   help="a running router's gRPC front: speculation off and on per request (no Admin)")
    p.add_argument("--admin-target", default="127.0.0.1:50060",
                   help="HOST:PORT of that worker's Admin service (its --admin-port); ignored without --target")
    p.add_argument("--model", default="smollm2-135m", help="model for the in-process worker")
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench JSON lines (default: the dev set)")
    p.add_argument("--limit", type=int, default=0, help="prompts per run (0: all); taken round-robin over categories")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k-max", type=int, default=8, help="K_max for the speculative runs")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the in-process worker")
    p.add_argument("--out", type=Path, default=Path("results/serving_bench.json"))
    p.add_argument("--trees", type=int, default=0, help="also run speculation with trees of up to this many "
                   "children a node (in-process worker only); 0: chains only")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every mode, interleaved")
    p.add_argument("--max-slowdown", type=float, default=None,
                   help="the adaptive policy's latency guard for the in-process worker, a fraction (0.02: "
                        "speculation.latencyGuard.maxSlowdownPercent 2; default: off)")
    p.add_argument("--method", default="ngram", choices=SPECULATIVE_METHODS,
                   help="the in-process worker's draft.method, every prompt type routed to it (default ngram)")
    p.add_argument("--draft-uri", default=None,
                   help="its draft.uri (eagle: default the bundled smollm2-135m-eagle head)")
    p.add_argument("--quantization", default="none", choices=SERVED_QUANTIZATIONS,
                   help="the in-process worker's weights (default none)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the in-process worker's prompt tokens prefilled a step (0: whole prompts; default: the "
                        "worker's --prefill-chunk default)")
    args = p.parse_args(argv)
    if args.prefill_chunk is not None and (args.target or args.prefill_chunk < 0):
        p.error("--prefill-chunk is >= 0 and sets the in-process worker's: not with --target")
    if args.target and (args.method != "ngram" or args.draft_uri or args.quantization != "none"):
        p.error("--method, --draft-uri and --quantization set the in-process worker's: a running worker takes "
                "them from its engine.json")
    if args.draft_uri is None and args.method == "eagle":
        args.draft_uri = BUNDLED_EAGLE_HEAD
    if args.router and (args.target or args.trees or args.max_slowdown is not None):
        p.error("--router drives a running router: --target, --trees and --max-slowdown do not apply")
    if args.trees and args.target:
        p.error("--trees sets the in-process worker's tree cap: it cannot be used with --target")
    if args.max_slowdown is not None and args.target:
        p.error("--max-slowdown sets the in-process worker's latency guard: a running worker takes it from its "
                "engine.json (speculation.latencyGuard.maxSlowdownPercent)")
    if args.max_slowdown is not None and args.max_slowdown < 0:
        p.error(f"--max-slowdown is a fraction >= 0 (0.02: 2%), got {args.max_slowdown}")
    if args.trees == 1 or args.trees < 0 or args.repeats < 1:
        p.error("--trees must be 0 or >= 2 and --repeats >= 1")
    return args


PROMPT_TYPES = {"coding": "code", "math_reasoning": "math", "summarization": "summarization", "rag": "rag",
                "translation": "translation", "qa": "chat", "writing": "chat", "roleplay": "chat",
                "reasoning": "chat", "stem": "chat", "humanities": "chat", "extraction": "chat"}


def run_once(stub, prompts: list[dict], concurrency: int, max_tokens: int, method: str | None = None) -> dict:
    """Sends every prompt from `concurrency` client threads (naming `method` in each, if given);
    returns throughput and latencies."""
    work: queue.Queue = queue.Queue()
    for i, q in enumerate(prompts):
        work.put((i, q))
    latencies, outputs, stats, errors = [0.0] * len(prompts), [None] * len(prompts), [None] * len(prompts), []

    def client():
        while True:
            try:
                i, q = work.get_nowait()
            except queue.Empty:
                return
            msg = pb.GenerateRequest(prompt=q["turns"][0], apply_chat_template=True, max_tokens=max_tokens,
                                     prompt_type=PROMPT_TYPES.get(q["category"], "chat"),
                                     request_id=f"bench-{q.get('question_id', i)}", speculation_method=method or "")
            t = time.perf_counter()
            try:
                resp = stub.Generate(msg, timeout=600)
            except grpc.RpcError as e:
                errors.append(f"{e.code().name}: {e.details()}")
                continue
            latencies[i] = time.perf_counter() - t
            outputs[i] = list(resp.token_ids)
            stats[i] = resp.speculation

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [i for i, o in enumerate(outputs) if o is not None]
    tokens = sum(len(outputs[i]) for i in done)
    lat = sorted(latencies[i] for i in done)
    steps = sum(stats[i].num_steps for i in done)
    accepted = sum(stats[i].num_accepted_tokens for i in done)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99), "errors": errors,
            "tau": (accepted + steps) / steps if steps else 0.0, "outputs": outputs,
            "latencies": [round(x, 3) for x in latencies], "categories": [q["category"] for q in prompts]}


def summarize_level(concurrency: int, runs: dict[str, list[dict]]) -> dict:
    """One concurrency's row: the median run of each mode (by tokens/s) and the median of each
    round's ratios; outputs compared with plain decoding's, every round."""
    def median_run(rs):
        return sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]

    def median_ratio(a, b, key):
        return statistics.median(x[key] / y[key] for x, y in zip(runs[a], runs[b]) if y[key])

    row = {"concurrency": concurrency, "rounds": len(runs["off"])}
    for mode, rs in runs.items():
        row[mode] = {k: v for k, v in median_run(rs).items() if k != "outputs"}
    row["speedup"] = median_ratio("on", "off", "tokens_per_s")
    row["p99_on_vs_off"] = median_ratio("on", "off", "p99_s")
    row["identical"] = all(r["outputs"] == o["outputs"] for mode in runs if mode != "off"
                           for r, o in zip(runs[mode], runs["off"]))
    if "tree" in runs:
        row["tree_vs_off"] = median_ratio("tree", "off", "tokens_per_s")
        row["tree_vs_chain"] = median_ratio("tree", "on", "tokens_per_s")
        row["p99_tree_vs_off"] = median_ratio("tree", "off", "p99_s")
    return row


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(p) - 1] if p < 100 else sorted_values[-1]


def start_local_worker(args, max_batch: int):
    from specfleet_worker.app import WorkerServer
    from specfleet_worker.config import EngineConfig
    from specfleet_worker.main import build_engine, make_worker

    cfg = EngineConfig(model_name=args.model, k_max=args.k_max, max_slowdown=args.max_slowdown,
                       draft_method=args.method, draft_uri=args.draft_uri, default_method=args.method,
                       quantization=args.quantization)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    chunk = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
    engine = build_engine(cfg, threads=args.threads, max_batch_size=max_batch, **chunk)
    server = WorkerServer("127.0.0.1", 0, 0, admin_port=0, max_workers=max_batch + 16).start()
    server.attach(make_worker(engine, cfg, max_batch_size=max_batch, max_queue=max_batch * 4,
                              max_tokens_limit=max(args.max_tokens, 2048)))
    return server, f"127.0.0.1:{server.grpc_port}"


def speedup_totals(server) -> tuple[float, float] | None:
    """(plain-equivalent seconds, busy seconds) of an in-process worker's speedup meter."""
    if server is None or server.worker is None:
        return None
    meter = server.worker.scheduler.speedup
    return meter.total_plain, meter.total_actual


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = pick_prompts(args.questions or default_questions(), args.limit)
    server = None
    target, admin_target = args.router or args.target, args.admin_target
    if target is None:
        server, target = start_local_worker(args, max(levels))
        admin_target = f"127.0.0.1:{server.admin_port}"
    channel = grpc.insecure_channel(target)
    gen = pb_grpc.GenerationStub(channel)
    admin = None if args.router else pb_grpc.AdminStub(grpc.insecure_channel(admin_target))
    model = f"the fleet behind the router at {target}" if admin is None else admin.GetConfig(pb.GetConfigRequest()).model
    # warm-up: the first forwards pay for allocations that a steady worker has already made
    gen.Generate(pb.GenerateRequest(prompt="Hello", apply_chat_template=True, max_tokens=8))
    print(f"{len(prompts)} prompts x concurrency {levels}, max_tokens {args.max_tokens}, model {model}, "
          f"target {target}", file=sys.stderr, flush=True)

    modes = ["off", "on"] + (["tree"] if args.trees else [])
    engine = server.worker.scheduler.engine if server is not None else None
    rows = []
    try:
        for c in levels:
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for rnd in range(args.repeats):
                order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]  # interleaved: the order rotates
                for mode in order:
                    per_request = None
                    if admin is None:  # the router: the method in each request
                        per_request = "none" if mode == "off" else args.method
                    else:
                        admin.UpdateConfig(pb.UpdateConfigRequest(speculation_enabled=mode != "off", k_min=0,
                                                                  k_max=args.k_max))
                    if engine is not None:
                        engine.tree_branching = args.trees if mode == "tree" else 1
                    before = speedup_totals(server)
                    r = run_once(gen, prompts, c, args.max_tokens, per_request)
                    # the worker's own estimates, to set beside the measured ratio: the gauge
                    # (spec_decode_total_speedup_ratio, its recent window) and, in-process, the ratio of
                    # its plain-equivalent and busy seconds counters over exactly this run
                    r["live_speedup_estimate"] = (admin.GetStats(pb.GetStatsRequest()).speedup_ratio
                                                  if admin is not None else float("nan"))
                    after = speedup_totals(server)
                    if before and after and after[1] > before[1]:
                        r["run_speedup_estimate"] = (after[0] - before[0]) / (after[1] - before[1])
                    runs[mode].append(r)
                    print(f"  concurrency {c:>2} round {rnd + 1} {mode:>4}: {r['tokens_per_s']:7.1f} tok/s, "
                          f"p50 {r['p50_s']:.2f}s, p99 {r['p99_s']:.2f}s, tau {r['tau']:.2f}"
                          + (f", {len(r['errors'])} errors" if r["errors"] else ""), file=sys.stderr, flush=True)
            rows.append(summarize_level(c, runs))
    finally:
        channel.close()
        if server is not None:
            server.stop(0)

    print_table(rows, model, len(prompts), args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": model, "method": args.method, "draft_uri": args.draft_uri,
                                    "quantization": args.quantization,
                                    "prompts": len(prompts), "max_tokens": args.max_tokens,
                                    "k_max": args.k_max, "trees": args.trees, "repeats": args.repeats,
                                    "max_slowdown": engine.k_policy.max_slowdown if engine is not None else None,
                                    "prefill_chunk": engine.prefill_chunk if engine is not None else None,
                                    "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def print_table(rows: list[dict], model: str, n: int, max_tokens: int) -> None:
    print(f"\nserving benchmark: {model}, {n} Spec-Bench prompts, max_tokens {max_tokens}")
    head = f"{'conc':>4} | {'off tok/s':>9} {'p50':>6} {'p99':>6} | {'on tok/s':>9} {'p50':>6} {'p99':>6} {'tau':>5} | " \
           f"{'on/off':>6} {'gauge':>6} {'run est':>7} {'same out':>8} {'bar':>5}"
    print(head)
    print("-" * len(head))
    for r in rows:
        off, on = r["off"], r["on"]
        bar = 1.2 if r["concurrency"] == 1 else 1.0
        print(f"{r['concurrency']:>4} | {off['tokens_per_s']:>9.1f} {off['p50_s']:>6.2f} {off['p99_s']:>6.2f} | "
              f"{on['tokens_per_s']:>9.1f} {on['p50_s']:>6.2f} {on['p99_s']:>6.2f} {on['tau']:>5.2f} | "
              f"{r['speedup']:>5.2f}x {on['live_speedup_estimate']:>5.2f}x {on.get('run_speedup_estimate', float('nan')):>6.2f}x "
              f"{'yes' if r['identical'] else 'NO':>8} "
              f"{'ok' if r['speedup'] >= bar else 'MISS':>5}")
        print(f"     p99 with speculation / without: {r['p99_on_vs_off']:.3f}"
              + (f"; trees: {r['tree']['tokens_per_s']:.1f} tok/s, vs off {r['tree_vs_off']:.3f}x, "
                 f"vs chains {r['tree_vs_chain']:.3f}x, p99 vs off {r['p99_tree_vs_off']:.3f}, "
                 f"tau {r['tree']['tau']:.2f}" if "tree" in r else "")
              + (f" (medians of {r['rounds']} rounds)" if r["rounds"] > 1 else ""))


if __name__ == "__main__":
    sys.exit(main())
