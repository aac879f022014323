"""What a real vLLM server answers, captured, and how fast it decodes beside specfleet's engine.

Starts vLLM's CPU build (`./dev setup --vllm`) on the bundled model exported as a HF folder, plain
and with n-gram speculation, and sends Spec-Bench's first turns one request at a time: greedy,
`--max-tokens` tokens each (ignore_eos, so every answer is as long), after one warm-up request.
Then runs specfleet's engine in this process on the same prompts (plain, n-gram at the same fixed
K, and n-gram under its adaptive K). Prints a table of tokens per second (output tokens over the
client's wall time of the request, prefill included) and writes the numbers to --out.

With --fixtures DIR it also keeps the raw bodies as the parser tests read them (tests/vllm/data):
per server, the first --fixture-bodies non-streamed answers, each beside its request, and one
stream's server-sent events byte for byte (a request as the router sends one: no ignore_eos). Run it alone on a quiet machine: it starts servers
that use every core they are given.

    .venv/bin/python tests/vllm/capture.py --prompts 6 --threads 1 --fixtures tests/vllm/data
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

K = 4  # the n-gram servers' K, and the fixed K of specfleet's n-gram runs beside them


def post(url: str, body: dict, timeout: float = 600.0) -> tuple[bytes, float]:
    """The raw response body of a JSON POST and the seconds it took."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return raw, time.perf_counter() - t


def chat_request(model: str, prompt: str, max_tokens: int, stream: bool = False, measure: bool = True) -> dict:
    """A greedy chat request as the router sends one (a stream asks for usage: metrics ride on it);
    `measure` adds ignore_eos, so that every answer has max_tokens tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    if measure:
        body["ignore_eos"] = True
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def run_server(name: str, server, prompts: list[dict], max_tokens: int, fixtures: Path | None, bodies: int) -> dict:
    """Starts `server`, sends the prompts, stops it; its timings and answers."""
    url = f"{server.url}/v1/chat/completions"
    model = server.served_model_name
    rows = []
    with server:
        post(url, chat_request(model, "Say hello.", 8))  # warm-up: the first request pays one-off costs
        for n, q in enumerate(prompts):
            request = chat_request(model, q["turns"][0], max_tokens)
            raw, wall = post(url, request)
            body = json.loads(raw)
            tokens = body["usage"]["completion_tokens"]
            rows.append({"question_id": q["question_id"], "category": q["category"], "tokens": tokens,
                         "wall_s": wall, "text": body["choices"][0]["message"]["content"],
                         "metrics": body.get("metrics")})
            print(f"  {name} q{q['question_id']:<4} {q['category']:<15} {tokens} tokens in {wall:.2f} s "
                  f"({tokens / wall:.1f} tok/s)", flush=True)
            if fixtures is not None and n < bodies:
                (fixtures / name).mkdir(parents=True, exist_ok=True)
                record = {"question_id": q["question_id"], "category": q["category"], "request": request,
                          "response": body}
                (fixtures / name / f"chat-q{q['question_id']}.json").write_text(json.dumps(record, indent=1) + "\n")
        if fixtures is not None:
            q = prompts[0]
            request = chat_request(model, q["turns"][0], 32, stream=True, measure=False)
            raw, _ = post(url, request)
            (fixtures / name / f"stream-q{q['question_id']}.sse").write_bytes(raw)
            (fixtures / name / f"stream-q{q['question_id']}.request.json").write_text(json.dumps(request, indent=1)
                                                                                      + "\n")
    return {"ready_after_s": server.ready_after_s, "argv": server.argv()[1:], "runs": rows}


def run_ours(prompts: list[dict], max_tokens: int, threads: int) -> dict:
    """specfleet's engine in this process: plain, n-gram at fixed K, n-gram at adaptive K."""
    import torch

    from specfleet_engine.engine import Engine
    from specfleet_engine.factory import build_engine_parts
    from specfleet_engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    model, tokenizer, proposers = build_engine_parts("smollm2-135m", "fp32", "none", None, threads)
    out = {}
    for name, method, policy in [("ours-plain", "none", "fixed"), (f"ours-ngram-k{K}", "ngram", "fixed"),
                                 ("ours-ngram-adaptive", "ngram", "adaptive")]:
        engine = Engine(model, tokenizer, proposers=proposers, k_policy=policy)
        if method != "none":
            engine.calibrate(sizes=list(range(1, K + 2)))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.generate(tokenizer.chat("Say hello."), SamplingParams(max_tokens=8, ignore_eos=True), method, K)
        rows = []
        for q in prompts:
            prompt = tokenizer.chat(q["turns"][0])
            t = time.perf_counter()
            seq = engine.generate(prompt, params, method, K)
            wall = time.perf_counter() - t
            rows.append({"question_id": q["question_id"], "category": q["category"], "tokens": len(seq.output),
                         "wall_s": wall, "text": engine.text_of(seq),
                         "accepted_per_step": seq.stats.mean_accepted_length})
            print(f"  {name} q{q['question_id']:<4} {q['category']:<15} {len(seq.output)} tokens in {wall:.2f} s "
                  f"({len(seq.output) / wall:.1f} tok/s)", flush=True)
        out[name] = {"runs": rows}
    return out


def table(results: dict) -> str:
    names = list(results)
    qids = [r["question_id"] for r in results[names[0]]["runs"]]
    cats = {r["question_id"]: r["category"] for r in results[names[0]]["runs"]}
    lines = [f"{'question':<22}" + "".join(f"{n:>22}" for n in names)]
    for qid in qids:
        cells = []
        for n in names:
            r = next(r for r in results[n]["runs"] if r["question_id"] == qid)
            cells.append(f"{r['tokens'] / r['wall_s']:>22.1f}")
        lines.append(f"{f'q{qid} {cats[qid]}':<22}" + "".join(cells))
    totals = []
    for n in names:
        runs = results[n]["runs"]
        totals.append(f"{sum(r['tokens'] for r in runs) / sum(r['wall_s'] for r in runs):>22.1f}")
    lines.append(f"{'all (tokens / time)':<22}" + "".join(totals))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specfleet_bench.questions import default_questions, pick_prompts
    from specfleet_engine.hf_export import export_hf
    from specfleet_local.vllm import VllmServer, ngram_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6, help="Spec-Bench questions, one per category in turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1,
                   help="1: vLLM binds its own choice (one core; the other kept for its scheduler) and ours runs "
                        "one thread; N > 1: vLLM binds cores 0..N-1 and ours runs N threads")
    p.add_argument("--model-dir", type=Path, default=None, help="an export to use (default: export to a temp folder)")
    p.add_argument("--fixtures", type=Path, default=None, help="write captured answers here (tests/vllm/data)")
    p.add_argument("--fixture-bodies", type=int, default=3)
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--out", type=Path, default=Path("results/vllm-local.json"))
    args = p.parse_args(argv)

    prompts = pick_prompts(default_questions(), args.prompts)
    tmp = tempfile.TemporaryDirectory(prefix="specfleet-vllm-capture-")
    model_dir = args.model_dir or export_hf("smollm2-135m", Path(tmp.name) / "smollm2-135m-instruct")
    cpus = None if args.threads == 1 else f"0-{args.threads - 1}"
    results = {}
    if args.fixtures is not None:
        args.fixtures.mkdir(parents=True, exist_ok=True)
    for name, spec in [("plain", None), ("ngram", ngram_config(K))]:
        server = VllmServer(model_dir, spec, cpus=cpus, log=Path(tmp.name) / f"{name}.log",
                            served_model_name="smollm2-135m-instruct")
        results[f"vllm-{name}"] = run_server(name, server, prompts, args.max_tokens, args.fixtures,
                                             args.fixture_bodies)
    if not args.skip_ours:
        results.update(run_ours(prompts, args.max_tokens, args.threads))
    print(f"\ntokens/s, greedy, {args.max_tokens} tokens, one request at a time, threads {args.threads} "
          f"({os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end)")
    print(table(results))
    for name in ("vllm-ngram", f"ours-ngram-k{K}"):
        if name in results:
            same = [a["text"] == b["text"] for a, b in zip(results[name]["runs"], results["vllm-plain"]["runs"])]
            print(f"{name}: text equal to vllm-plain's on {sum(same)} of {len(same)} prompts")
    if "ours-plain" in results:
        same = [a["text"] == b["text"] for a, b in zip(results["ours-plain"]["runs"], results["vllm-plain"]["runs"])]
        print(f"ours-plain: text equal to vllm-plain's on {sum(same)} of {len(same)} prompts")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "max_tokens": args.max_tokens, "k": K, "machine": platform.machine(),
            "cores": os.cpu_count(), "python": sys.version.split()[0],
            "mean_ready_after_s": statistics.mean(r["ready_after_s"] for n, r in results.items() if "ready_after_s" in r)}
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.fixtures is not None:
        import subprocess

        from specfleet_local.vllm import vllm_python

        version = subprocess.run([vllm_python(), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True, check=True).stdout.strip()
        argv = {n.removeprefix("vllm-"): [a.replace(str(model_dir), "MODEL_DIR") for a in r["argv"]]
                for n, r in results.items() if n.startswith("vllm-")}
        server_info = {"vllm": version, "argv": argv}
        (args.fixtures / "servers.json").write_text(json.dumps(server_info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
