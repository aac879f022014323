"""The demo `./dev run` shows: a short mixed Spec-Bench workload through the fleet's OpenAI API.

Prompts are picked round-robin over Spec-Bench's categories, sent greedy by a few concurrent
clients (the official `openai` client, streaming, each prompt its own session so the split is
the same on every run), with a progress bar. Then, per prompt type and arm: the method the router
chose (its response headers), tokens/s and time to first token as the client saw them (the
usage), and alpha, tau and the speed-up from the windows the workers publish (for vLLM servers, the
router, from each answer's metrics).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specfleet_api.windows import read_windows

WINDOW_WAIT_S = 7.0  # workers publish their windows every 5 s


@dataclasses.dataclass
class Result:
    category: str
    prompt_type: str = "-"
    arm: str = "-"
    method: str = "-"
    completion_tokens: int = 0
    seconds: float = 0.0
    ttft_s: float | None = None
    error: str | None = None


def one_request(client, model: str, question: dict, session: str, max_tokens: int) -> Result:
    """One streamed chat completion; what the router's headers and the usage say about it."""
    import openai

    out = Result(question["category"])
    start = time.perf_counter()
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": question["turns"][0]}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_headers={"x-session-id": session})
        out.prompt_type = raw.headers.get("x-specfleet-prompt-type", "-")
        out.arm = raw.headers.get("x-specfleet-arm", "-")
        out.method = raw.headers.get("x-specfleet-method", "-")
        for chunk in raw.parse():
            if out.ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
                out.ttft_s = time.perf_counter() - start
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.perf_counter() - start
    return out


def run_workload(base_url: str, model: str, questions: list[dict], *, max_tokens: int, clients: int,
                 stop: threading.Event, console) -> tuple[list[Result], float]:
    """Every question once, `clients` at a time, with a progress bar; stops starting new ones
    when `stop` is set. The results in question order, and the wall time."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    results: list[Result | None] = [None] * len(questions)
    tokens, lock = [0], threading.Lock()
    with Progress(TextColumn("demo"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tokens]} tokens"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("demo", total=len(questions), tokens=0)

        def send(i: int) -> None:
            if stop.is_set():
                return
            r = results[i] = one_request(client, model, questions[i], f"demo-{i}", max_tokens)
            with lock:
                tokens[0] += r.completion_tokens
                progress.update(task, advance=1, tokens=tokens[0])

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(send, range(len(questions))))
        wall = time.perf_counter() - start
    client.close()
    return [r for r in results if r is not None], wall


def summary(results: list[Result], windows: dict, wall_s: float, clients: int) -> Table:
    """One row per (prompt type, arm): what the clients saw, and what the workers' windows say."""
    groups: dict[tuple[str, str], list[Result]] = collections.defaultdict(list)
    for r in results:
        if r.error is None:
            groups[(r.prompt_type, r.arm)].append(r)
    ok = [r for r in results if r.error is None]
    total_tokens = sum(r.completion_tokens for r in ok)
    table = Table(title=f"{len(ok)} of {len(results)} requests answered, {total_tokens} tokens in {wall_s:.1f} s "
                        f"({total_tokens / wall_s if wall_s else 0:.1f} tokens/s with {clients} clients)",
                  title_justify="left")
    for col in ("prompt type", "arm", "method", "requests", "categories", "tokens", "tok/s", "TTFT p50",
                "alpha", "tau", "speedup"):
        table.add_column(col, justify="left" if col in ("prompt type", "arm", "method", "categories") else "right")
    for (prompt_type, arm), rs in sorted(groups.items()):
        w = windows.get(arm, {}).get(prompt_type)
        seconds = sum(r.seconds for r in rs)
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
        table.add_row(
            prompt_type, arm, ", ".join(sorted({r.method for r in rs})), str(len(rs)),
            ", ".join(sorted({r.category for r in rs})), str(sum(r.completion_tokens for r in rs)),
            f"{sum(r.completion_tokens for r in rs) / seconds:.1f}" if seconds else "-",
            f"{statistics.median(ttfts):.2f} s" if ttfts else "-",
            _f(w.alpha if w else None), _f(w.tau if w else None), _f(w.speedup if w else None, "x"))
    return table


def _f(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def windows_of(fleet) -> str:
    """Whose windows the table reads: the workers publish theirs; for vLLM servers the router
    publishes what each answer's metrics say (specfleet_router.vllm_evidence)."""
    return "the router's windows of the vLLM answers" if fleet.vllm else "the workers' windows"


def run_demo(fleet, stop: threading.Event) -> int:
    """The demo against a ready `up` fleet; 0 when every request was answered."""
    from specfleet_bench.questions import pick_prompts

    args, console, plan = fleet.args, fleet.console, fleet.plan
    questions = pick_prompts(Path(args.questions), args.demo_prompts)
    categories = sorted({q["category"] for q in questions})
    console.print(f"\n[bold]Demo[/bold]: {len(questions)} Spec-Bench prompts ({len(categories)} categories), "
                  f"max_tokens {args.demo_max_tokens}, greedy, {args.demo_clients} clients, through "
                  f"{fleet.router_url()}/v1 with the openai client")
    results, wall = run_workload(f"{fleet.router_url()}/v1", plan.name, questions, max_tokens=args.demo_max_tokens,
                                 clients=args.demo_clients, stop=stop, console=console)
    if stop.is_set():
        return 0
    client = fleet.redis.client()
    answered = sum(r.error is None for r in results)
    end = time.monotonic() + WINDOW_WAIT_S  # until the windows hold every request (or the wait is up)
    while True:
        windows = read_windows(client, plan.namespace, plan.name, tuple(a.name for a in plan.arms))
        seen = sum(w.counts.requests for by_type in windows.values() for w in by_type.values())
        if seen >= answered or time.monotonic() > end or stop.wait(0.5):
            break
    console.print(summary(results, windows, wall, args.demo_clients))
    held = (f"they hold {seen} of the {answered} requests" if seen <= answered else
            f"they hold the {answered} requests and {seen - answered} copies of them that the router's canary "
            f"drift check mirrored")
    console.print("tok/s: completion tokens / request time as the client saw it (prefill and queueing included). "
                  f"alpha, tau, speedup: {windows_of(fleet)} for that arm and prompt type (the last "
                  f"{fleet.window_s:g} s, spec.slo.window; {held}). Routes: the router's x-specfleet-* headers.")
    for r in results:
        if r.error:
            console.print(f"[red]{escape(r.category)}: {escape(r.error)}[/red]")
    if not args.exit_after_demo:
        console.print(f"\nStill serving at {fleet.router_url()}/v1 (model '{plan.name}'); `specfleet status` "
                      "shows the fleet; Ctrl-C stops it all.")
    return 0 if answered == len(results) == len(questions) else 1
