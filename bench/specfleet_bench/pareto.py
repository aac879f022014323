"""The throughput-latency Pareto front of one model's serving configurations, on this machine.

Sweeps precision x draft method x K policy x tree budget x concurrency x temperature on the same
model and the same Spec-Bench prompts, each point a real gRPC worker (in this process, one per
precision: its draft.method is the head, so it serves the head, n-gram and plain decoding)
driven by that many client threads. The draft's own compute is in every number: they are end to
end (a request's first token, its tokens after, the run's wall time). For each point it writes
P50 time to first token, P50 / P99 time per output token, requests/s, tokens/s and the cost of a
million output tokens at --dollars-per-hour; it marks the points no other point beats on both
tokens/s and P50 TPOT (the front), and plots them (docs/pareto.md). Greedy outputs of every
speculative point must equal plain decoding's at the same precision (the table says so).

With --fleet RESULT.json (specfleet_bench.method_select's output) the self-tuned fleet's operating
point is marked on the plot, and its distance to the front is reported.

    specfleet bench pareto --out docs/bench/pareto.json --plot docs/bench/pareto.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

from specfleet_api.engine_config import BUNDLED_EAGLE_HEAD
from specfleet_api.enums import K_POLICIES, SERVED_QUANTIZATIONS, Method, Quantization
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc

from .questions import default_questions, pick_prompts
from .serving import PROMPT_TYPES, percentile


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specfleet bench pareto", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default="eagle", help="the workers' draft.method beside n-gram (default eagle)")
    p.add_argument("--draft-uri", default=None, help="its draft.uri (eagle: the bundled head)")
    p.add_argument("--precisions", default="int8,none", help="quantizations, comma-separated (default int8,none)")
    p.add_argument("--methods", default="none,ngram,eagle", help="draft methods (default none,ngram,eagle)")
    p.add_argument("--k-policies", default="adaptive", help="K policies (default adaptive)")
    p.add_argument("--trees", default="1,2", help="tree budgets: children a node at most, 1 = chains (default 1,2)")
    p.add_argument("--concurrency", default="1,8", help="client threads (default 1,8)")
    p.add_argument("--temperatures", default="0,0.7", help="sampling temperatures (default 0,0.7)")
    p.add_argument("--k-max", type=int, default=6)
    p.add_argument("--limit", type=int, default=13, help="prompts a point, round-robin over categories (default 13)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dollars-per-hour", type=float, default=1.0, help="the machine's price, for $ per 1M tokens")
    p.add_argument("--questions", type=Path, default=None)
    p.add_argument("--fleet", type=Path, default=None, help="a method_select result: mark its fleet's points")
    p.add_argument("--out", type=Path, default=Path("results/pareto.json"))
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    if args.draft_uri is None and args.draft == "eagle":
        args.draft_uri = BUNDLED_EAGLE_HEAD
    served = {Method.NONE.value, Method.NGRAM.value, args.draft}
    for m in args.methods.split(","):
        if m and m not in served:
            p.error(f"--methods: {m!r} is not served by these workers (none, ngram and --draft {args.draft})")
    for q in args.precisions.split(","):
        if q and q not in SERVED_QUANTIZATIONS:
            p.error(f"--precisions: {q!r} is not one of {', '.join(SERVED_QUANTIZATIONS)}")
    for pol in args.k_policies.split(","):
        if pol and pol not in K_POLICIES:
            p.error(f"--k-policies: {pol!r} is not one of {', '.join(K_POLICIES)}")
    return args


def start_worker(args, quantization: str, max_batch: int):
    from specfleet_worker.app import WorkerServer
    from specfleet_worker.config import EngineConfig
    from specfleet_worker.main import build_engine, make_worker

    cfg = EngineConfig(model_name=args.model, k_max=args.k_max, draft_method=args.draft, draft_uri=args.draft_uri,
                       default_method="ngram", quantization=quantization)
    print(f"loading {args.model} ({quantization}) ...", file=sys.stderr, flush=True)
    engine = build_engine(cfg, threads=args.threads, max_batch_size=max_batch)
    server = WorkerServer("127.0.0.1", 0, 0, admin_port=0, max_workers=max_batch + 16).start()
    server.attach(make_worker(engine, cfg, max_batch_size=max_batch, max_queue=max_batch * 4,
                              max_tokens_limit=max(args.max_tokens, 2048)))
    return server, engine


def run_point(stub, prompts: list[dict], method: str, concurrency: int, temperature: float, max_tokens: int) -> dict:
    """Every prompt from `concurrency` client threads; the latencies each response reports."""
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    results: list[dict | None] = [None] * len(prompts)
    errors: list[str] = []

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i, q = todo.pop(0)
            msg = pb.GenerateRequest(prompt=q["turns"][0], apply_chat_template=True, max_tokens=max_tokens,
                                     prompt_type=PROMPT_TYPES.get(q["category"], "chat"), speculation_method=method,
                                     temperature=temperature, seed=1000 + i, request_id=f"pareto-{i}")
            try:
                r = stub.Generate(msg, timeout=900)
            except grpc.RpcError as e:
                errors.append(f"{e.code().name}: {e.details()}")
                continue
            results[i] = {"tokens": list(r.token_ids), "ttft": r.time_to_first_token_s, "latency": r.latency_s}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    tokens = sum(len(r["tokens"]) for r in done)
    ttft = sorted(r["ttft"] for r in done)
    tpot = sorted((r["latency"] - r["ttft"]) / (len(r["tokens"]) - 1) for r in done if len(r["tokens"]) > 1)
    return {"requests": len(done), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(done) / wall, 3),
            "ttft_p50_s": round(percentile(ttft, 50), 4), "tpot_p50_s": round(percentile(tpot, 50), 5),
            "tpot_p99_s": round(percentile(tpot, 99), 5), "errors": errors,
            "outputs": [r["tokens"] if r else None for r in results]}


def front(points: list[dict]) -> list[dict]:
    """The points no other beats on both tokens/s (higher) and P50 TPOT (lower), by tokens/s.

    >>> pts = [{"tokens_per_s": 10, "tpot_p50_s": 0.05}, {"tokens_per_s": 20, "tpot_p50_s": 0.08},
    ...        {"tokens_per_s": 15, "tpot_p50_s": 0.09}]
    >>> [p["tokens_per_s"] for p in front(pts)]
    [10, 20]
    """
    out = [p for p in points if not any(
        q["tokens_per_s"] >= p["tokens_per_s"] and q["tpot_p50_s"] <= p["tpot_p50_s"]
        and (q["tokens_per_s"] > p["tokens_per_s"] or q["tpot_p50_s"] < p["tpot_p50_s"]) for q in points)]
    return sorted(out, key=lambda p: p["tokens_per_s"])


def distance_to_front(point: dict, edge: list[dict]) -> float:
    """How far under the front a point's tokens/s is at its P50 TPOT: 1 - its tokens/s over the
    best front point's that is at least as fast per token (0: on the front; negative: beyond)."""
    best = max((q["tokens_per_s"] for q in edge if q["tpot_p50_s"] <= point["tpot_p50_s"]), default=None)
    if best is None:
        return 0.0
    return round(1 - point["tokens_per_s"] / best, 4)


def main(argv=None) -> int:
    args = parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    precisions, methods, policies = split(args.precisions), split(args.methods), split(args.k_policies)
    trees, levels = [int(x) for x in split(args.trees)], [int(x) for x in split(args.concurrency)]
    temperatures = [float(x) for x in split(args.temperatures)]
    prompts = pick_prompts(args.questions or default_questions(), args.limit)
    from specfleet_engine.k_policies import make_policy

    points: list[dict] = []
    for quantization in precisions:
        server, engine = start_worker(args, quantization, max(levels))
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        gen = pb_grpc.GenerationStub(channel)
        gen.Generate(pb.GenerateRequest(prompt="Hello", apply_chat_template=True, max_tokens=8))  # warm-up
        plain: dict[float, list] = {}
        try:
            grid = [(m, pol, tr) for m in methods for pol in policies for tr in trees
                    if not (m == "none" and (pol != policies[0] or tr != trees[0]))]  # plain has no K, no tree
            for (method, policy, tree), c, temp in itertools.product(grid, levels, temperatures):
                engine.k_policy = make_policy(policy, engine.costs)
                engine.tree_branching = tree
                r = run_point(gen, prompts, method, c, temp, args.max_tokens)
                r.update(precision=quantization, method=method, k_policy=policy if method != "none" else "-",
                         tree=tree if method != "none" else 0, concurrency=c, temperature=temp,
                         dollars_per_million=round(args.dollars_per_hour / (r["tokens_per_s"] * 3600) * 1e6, 3)
                         if r["tokens_per_s"] else None)
                if temp == 0.0:
                    if method == "none":
                        plain[c] = r["outputs"]
                    r["equals_plain"] = r["outputs"] == plain.get(c) if c in plain else None
                r.pop("outputs")
                points.append(r)
                print(f"  {quantization:>4} {method:>6} {r['k_policy']:>8} tree {r['tree']} c{c:<2} T{temp:<3} "
                      f"{r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_s']:.3f}s  TPOT p50 "
                      f"{r['tpot_p50_s'] * 1000:6.1f} ms p99 {r['tpot_p99_s'] * 1000:6.1f} ms"
                      + (f"  {len(r['errors'])} errors" if r["errors"] else ""), file=sys.stderr, flush=True)
        finally:
            channel.close()
            server.stop(0)

    edge = front(points)
    for p in points:
        p["on_front"] = p in edge
    result = {"model": args.model, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "dollars_per_hour": args.dollars_per_hour, "points": points, "front": edge}
    if args.fleet:
        result["fleet"] = fleet_points(json.loads(args.fleet.read_text()), edge)
    print_table(points)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


def fleet_points(fleet: dict, edge: list[dict]) -> list[dict]:
    """Each method_select config's operating point (tokens/s, median TPOT of its requests) and its
    distance to the front."""
    out = []
    for config, runs in fleet.get("runs", {}).items():
        calls = [c for c in runs[0]["calls"] if not c["error"] and c["tokens"] > 1]
        if not calls:
            continue
        tpot = statistics.median((c["end"] - c["start"]) / c["tokens"] for c in calls)  # no TTFT split: an upper bound
        pt = {"config": config, "tokens_per_s": runs[0]["tokens_per_s"], "tpot_p50_s": round(tpot, 5),
              "concurrency": fleet.get("clients")}
        pt["below_front"] = distance_to_front(pt, edge)
        out.append(pt)
    return out


def print_table(points: list[dict]) -> None:
    cols = ("precision", "method", "k_policy", "tree", "concurrency", "temperature", "tokens_per_s",
            "requests_per_s", "ttft_p50_s", "tpot_p50_s", "tpot_p99_s", "dollars_per_million", "on_front")
    print(" | ".join(cols))
    for p in sorted(points, key=lambda p: -p["tokens_per_s"]):
        print(" | ".join(str(p.get(c)) for c in cols))


MARKERS = {Quantization.INT8.value: "o", Quantization.NONE.value: "s"}


def label_of(precision: str) -> str:
    """A quantization as the plot names it: `none` is fp32 weights."""
    return "fp32" if precision == Quantization.NONE else precision


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    colors = {"none": "tab:gray", "ngram": "tab:blue", "eagle": "tab:orange", "draft-model": "tab:green",
              "medusa": "tab:red"}
    for p in result["points"]:
        marker = MARKERS.get(p["precision"], "^")
        ax.scatter(p["tpot_p50_s"] * 1000, p["tokens_per_s"], c=colors.get(p["method"], "k"), marker=marker,
                   alpha=0.9 if p["on_front"] else 0.35, edgecolors="k" if p["on_front"] else "none")
    edge = result["front"]
    ax.plot([p["tpot_p50_s"] * 1000 for p in edge], [p["tokens_per_s"] for p in edge], "k--", lw=1, label="front")
    for f in result.get("fleet", []):
        ax.scatter(f["tpot_p50_s"] * 1000, f["tokens_per_s"], marker="*", s=220, c="gold", edgecolors="k")
        ax.annotate(f"fleet: {f['config']}", (f["tpot_p50_s"] * 1000, f["tokens_per_s"]), fontsize=8,
                    xytext=(5, 5), textcoords="offset points")
    for m, c in colors.items():
        if any(p["method"] == m for p in result["points"]):
            ax.scatter([], [], c=c, label=m)
    for precision in sorted({p["precision"] for p in result["points"]}):
        ax.scatter([], [], c="w", edgecolors="k", marker=MARKERS.get(precision, "^"), label=label_of(precision))
    ax.set_xlabel("P50 time per output token (ms)")
    ax.set_ylabel("tokens/s (all clients)")
    ax.set_title(f"{result['model']}: {result['prompts']} Spec-Bench prompts, {result['max_tokens']} tokens a point")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
