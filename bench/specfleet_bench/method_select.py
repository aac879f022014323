"""The loop choosing each prompt type's draft method, on a real local fleet, against fixed choices,
on the same stream of requests.

Every config serves SmolLM2-135M (int8) with the bundled EAGLE head as draft.method, so that its
workers serve two draft methods (EAGLE and n-gram), under `specfleet up` (Redis, a worker, the
router, the control loop); the official openai client sends the same seeded stream of requests
(Spec-Bench dev questions, every category in turn, a share of them sampled) from --clients threads
for --seconds:

    self     routing.select on: the loop explores (--explore percent) and moves each type to the
             method that pays on it
    eagle    routing.select off: every type drafts with the head (what draft.method says)
    ngram    draft.method ngram: n-gram drafts for every type
    table    routing.byPromptType from --table TYPE=METHOD,... (a per-type table fixed by hand)

With --shift CATEGORY@SECONDS a traffic shift comes into every run: from that second on, the
category's requests are drawn from --shift-questions instead (by default the bundled
code_edits.jsonl: pasted Python classes to edit, which the answer copies, so n-gram drafts them and
the head does not), classified as the same prompt type. The result says which types the loop moved
after the shift, and how many of its judgements (windows) after it each move came.

A config named with `+k` (`ngram+k`, `self+k`, ...) also turns on speculation.kTuning: the loop's
K ceiling per prompt type, from the acceptance by draft position the workers publish. The ceilings
over time and their KCeilingChanged events are in the result, and each `X+k` is compared with `X`
where both ran. With --tpot-p99 SECONDS the ceilings also answer load (kTuning.tpotP99Seconds),
and --burst N@START-END adds N clients from START to END seconds: the result then says, before,
during and after the burst, the tokens/s, each request's seconds per output token (median, P99)
and the ceilings' changes.

It prints and writes (JSON, and a plot with --plot) each config's tokens/s over the whole run and
over its second half (after the loop has had time to choose), the ratios of `self` to the others,
the methods each type ran, the loop's moves with their evidence and times, and the errors (there
must be none). Configs run one after another, in a rotating order over --rounds.

    specfleet bench select --seconds 600 --out docs/bench/method-select.json --plot docs/bench/method-select.png
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specfleet_api.engine_config import BUNDLED_EAGLE_HEAD
from specfleet_api.enums import Method
from specfleet_control import kbounds, methods
from specfleet_local.state import loop_key

from .local_fleet import local_fleet
from .questions import default_questions, load_questions

NAME, NAMESPACE = "select", "default"
CODE_EDITS = Path(__file__).with_name("code_edits.jsonl")  # a shift's default prompts
FIXED = (Method.EAGLE.value, Method.NGRAM.value)  # every type on one method: the head's, n-gram's
CONFIGS = ("self", *FIXED, "table")


K_TUNED = "+k"  # a config's suffix: the same, with speculation.kTuning on
K_MAX = 6  # every config's speculation.kMax


def spec(config: str, args) -> dict:
    config, k_tuned = config.removesuffix(K_TUNED), config.endswith(K_TUNED)
    draft = {"method": config} if config == Method.NGRAM else {"method": Method.EAGLE.value, "uri": BUNDLED_EAGLE_HEAD}
    routing: dict = {"select": {"enabled": config == "self", "exploreShare": args.explore,
                                "minDwell": f"{int(args.dwell * 1000)}ms", "minRequests": args.min_requests}}
    if config == "table":
        routing["byPromptType"] = dict(pair.split("=", 1) for pair in args.table.split(",") if pair)
    k_tuning: dict = {"enabled": k_tuned}
    if k_tuned and args.tpot_p99:
        k_tuning["tpotP99Seconds"] = args.tpot_p99
    return {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "spec": {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"},
                     "draft": draft, "speculation": {"kMin": 0, "kMax": K_MAX, "kInitial": 3,
                                                     "kTuning": k_tuning},
                     "quantization": "int8", "replicas": 1, "routing": routing,
                     "slo": {"window": f"{int(args.window * 1000)}ms"}}}


@dataclass
class Call:
    start: float
    end: float
    category: str
    temperature: float
    prompt_type: str = ""
    method: str = ""
    tokens: int = 0
    error: str = ""


def request_stream(questions: list[dict], seed: int, sampled_share: float, temperature: float,
                   shift: tuple[str, list[str], threading.Event] | None = None):
    """An endless, seeded stream of (category, prompt, temperature, seed): every category in turn,
    a question drawn from it, sampled at `temperature` with probability `sampled_share`. With
    `shift` (category, prompts, event): once the event is set, that category's prompts are drawn
    from `prompts` instead (the same draws, so the rest of the stream does not change).

    >>> on = threading.Event()
    >>> qs = [{"category": "a", "turns": ["a1"]}, {"category": "b", "turns": ["b1"]}]
    >>> s = request_stream(qs, 1, 0.0, 0.7, ("b", ["edit"], on))
    >>> [next(s)[1] for _ in range(2)], on.set(), [next(s)[1] for _ in range(2)]
    (['a1', 'b1'], None, ['a1', 'edit'])
    """
    rng = random.Random(seed)
    by_cat: dict[str, list[str]] = collections.defaultdict(list)
    for q in questions:
        by_cat[q["category"]].append(q["turns"][0])
    cats = sorted(by_cat)
    while True:
        for cat in cats:
            t = temperature if rng.random() < sampled_share else 0.0
            pool = shift[1] if shift is not None and cat == shift[0] and shift[2].is_set() else by_cat[cat]
            yield cat, pool[rng.randrange(len(pool))], t, rng.randrange(2**31)


class Run:
    """One config: its fleet, its clients, what the loop did."""

    def __init__(self, config: str, args, questions: list[dict], shift_prompts: list[str] | None = None):
        self.config, self.args = config, args
        self.shifted = threading.Event()
        self.shift_at: float | None = None  # wall-clock time (the loop's clock) of the shift
        self.shift = parse_shift(args.shift) if args.shift else None
        self.burst = parse_burst(args.burst) if args.burst else None
        self.stream = request_stream(questions, args.seed, args.sampled_share, args.temperature,
                                     (self.shift[0], shift_prompts or [], self.shifted) if self.shift else None)
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.loop_doc: dict = {}
        self.methods_over_time: list[tuple[float, dict]] = []
        self.ceilings_over_time: list[tuple[float, dict]] = []
        self.judged: set[float] = set()  # the loop's judgements seen (memory.judgedAt)
        self.stop = threading.Event()
        self.t0 = 0.0

    def client(self, url: str, start: float = 0.0, end: float = float("inf")) -> None:
        """Requests one after another, from `start` to `end` seconds into the run (a burst's window)."""
        import openai

        client = openai.OpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)
        if self.stop.wait(start):
            return
        while not self.stop.is_set() and time.monotonic() - self.t0 < end:
            with self.lock:
                cat, prompt, temperature, seed = next(self.stream)
            call = Call(time.monotonic() - self.t0, 0.0, cat, temperature)
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=self.args.max_tokens,
                    temperature=temperature, seed=seed)
                r = raw.parse()
                call.tokens = r.usage.completion_tokens
                call.prompt_type = raw.headers.get("x-specfleet-prompt-type", "")
                call.method = raw.headers.get("x-specfleet-method", "")
            except Exception as e:  # noqa: BLE001 - every failure is counted, none may happen
                call.error = f"{type(e).__name__}: {e}"
                self.stop.wait(0.5)
            call.end = time.monotonic() - self.t0
            with self.lock:
                self.calls.append(call)

    def sampler(self, run: dict) -> None:
        import redis

        from specfleet_local.redis_server import run_credentials

        client = redis.Redis.from_url(run["redis"]["url"], socket_timeout=2, **run_credentials(run))
        while not self.stop.is_set():
            try:
                self.loop_doc = json.loads(client.get(loop_key(NAMESPACE, NAME)) or "{}")
                now = round(time.monotonic() - self.t0, 1)
                self.methods_over_time.append((now, dict(self.loop_doc.get("methods") or {})))
                self.ceilings_over_time.append((now, dict(self.loop_doc.get("kCeilings") or {})))
                judged = (self.loop_doc.get("memory") or {}).get("judgedAt")
                if judged is not None:
                    self.judged.add(float(judged))
            except Exception as e:  # noqa: BLE001 - a missed sample is a gap
                print(f"sampler: {type(e).__name__}: {e}", file=sys.stderr)
            self.stop.wait(2.0)

    def go(self) -> dict:
        a = self.args
        with tempfile.TemporaryDirectory(prefix="specfleet-select-") as tmp, local_fleet(
                spec(self.config, a), Path(tmp), worker_threads=a.worker_threads, max_batch=a.max_batch,
                ready_timeout=a.ready_timeout, name=self.config) as run:
            self.t0 = time.monotonic()
            threads = [threading.Thread(target=self.sampler, args=(run,), daemon=True)]
            threads += [threading.Thread(target=self.client, args=(run["router"]["openai"],), daemon=True)
                        for _ in range(a.clients)]
            if self.burst:
                n, start, end = self.burst
                threads += [threading.Thread(target=self.client, args=(run["router"]["openai"], start, end),
                                             daemon=True) for _ in range(n)]
            for th in threads:
                th.start()
            until, said = a.seconds, 0.0
            while time.monotonic() - self.t0 < until:
                self.stop.wait(min(2.0, until - (time.monotonic() - self.t0)))
                if self.shift and not self.shifted.is_set() and time.monotonic() - self.t0 >= self.shift[1]:
                    self.shift_at = time.time()
                    self.shifted.set()
                    print(f"[{self.config} {time.monotonic() - self.t0:6.0f}s] shift: {self.shift[0]}'s prompts "
                          f"change", flush=True)
                if time.monotonic() - self.t0 - said >= 30.0:
                    said = time.monotonic() - self.t0
                    done = [c for c in self.calls if not c.error]
                    print(f"[{self.config} {said:6.0f}s] {len(done)} requests, "
                          f"{sum(c.tokens for c in done)} tokens, methods {self.current_methods()}", flush=True)
                if a.until_moved and self.current_methods().get(a.until_moved, Method.EAGLE) != Method.EAGLE:
                    break
            self.stop.set()
            for th in threads:
                th.join(timeout=a.max_tokens * 3 + 60)
            return self.report(time.monotonic() - self.t0)

    def current_methods(self) -> dict:
        return dict(self.loop_doc.get("methods") or {})

    def report(self, seconds: float) -> dict:
        done = [c for c in self.calls if not c.error and c.end <= seconds]
        half = seconds / 2

        def tps(calls, lo, hi):
            return round(sum(c.tokens for c in calls if lo <= c.end < hi) / (hi - lo), 2) if hi > lo else None

        by_type: dict[str, dict] = {}
        for t in sorted({c.prompt_type for c in done}):
            mine = [c for c in done if c.prompt_type == t]
            by_type[t] = {"requests": len(mine), "tokens": sum(c.tokens for c in mine),
                          "methods": dict(collections.Counter(c.method for c in mine)),
                          "tokens_per_s_each": round(statistics.median(
                              c.tokens / (c.end - c.start) for c in mine if c.end > c.start), 2)}
        events = [e for e in self.loop_doc.get("events", []) if e.get("reason") == methods.MOVED]
        shift = None
        if self.shift_at is not None:
            # events carry their time to the millisecond, the memory its judgement's whole
            after = sorted({round(t, 3) for t in self.judged if t > self.shift_at})
            shift = {"category": self.shift[0], "at_s": self.shift[1],
                     "prompt_types": dict(collections.Counter(
                         c.prompt_type for c in done if c.category == self.shift[0] and c.start >= self.shift[1])),
                     "windows_judged_after": len(after),
                     "moves_after": [{**e, "window": sum(t <= e["time"] for t in after)}
                                     for e in events if e["time"] > self.shift_at],
                     "restarts_after": [e for e in self.loop_doc.get("events", [])
                                        if e.get("reason") == methods.SHIFTED and e["time"] > self.shift_at]}
        ceilings = [e for e in self.loop_doc.get("events", []) if e.get("reason") == kbounds.CHANGED]
        burst = None
        if self.burst:
            _, start, end = self.burst
            zero = time.time() - (time.monotonic() - self.t0)  # the loop's clock at the run's second 0
            burst = {name: phase_report(done, lo, hi, [e for e in ceilings if lo <= e["time"] - zero < hi])
                     for name, lo, hi in (("before", 0.0, start), ("during", start, end), ("after", end, seconds))}
        return {"config": self.config, "seconds": round(seconds, 1), "requests": len(done),
                "tokens": sum(c.tokens for c in done), "tokens_per_s": tps(done, 0.0, seconds),
                "tokens_per_s_second_half": tps(done, half, seconds),
                "errors": [c.error for c in self.calls if c.error],
                "types": by_type, "methods_chosen": self.current_methods(), "moves": events, "shift": shift,
                "k_ceilings": dict(self.loop_doc.get("kCeilings") or {}), "k_ceiling_changes": ceilings,
                "burst": burst,
                "methods_over_time": self.methods_over_time, "ceilings_over_time": self.ceilings_over_time,
                "calls": [asdict(c) for c in self.calls]}


def parse_shift(text: str) -> tuple[str, float]:
    """--shift's CATEGORY@SECONDS; ValueError naming what is wrong.

    >>> parse_shift("coding@240")
    ('coding', 240.0)
    """
    category, at, seconds = text.partition("@")
    try:
        if not category or not at or float(seconds) < 0:
            raise ValueError
        return category, float(seconds)
    except ValueError:
        raise ValueError(f"--shift {text!r}: want CATEGORY@SECONDS, e.g. coding@240") from None


def parse_burst(text: str) -> tuple[int, float, float]:
    """--burst's N@START-END (N more clients from START to END seconds); ValueError naming what is wrong.

    >>> parse_burst("6@120-300")
    (6, 120.0, 300.0)
    """
    n, at, span = text.partition("@")
    start, dash, end = span.partition("-")
    try:
        if not at or not dash or int(n) < 1 or not 0 <= float(start) < float(end):
            raise ValueError
        return int(n), float(start), float(end)
    except ValueError:
        raise ValueError(f"--burst {text!r}: want CLIENTS@START-END (seconds), e.g. 6@120-300") from None


def phase_report(calls: list[Call], lo: float, hi: float, ceiling_changes: list[dict]) -> dict:
    """A stretch of a run (the calls that ended in [lo, hi)): tokens/s, each request's seconds per
    output token (median, P99: what its client saw, the queue included) and the K ceilings' changes.

    >>> calls = [Call(0.0, 1.0 + i, "qa", 0.0, tokens=10) for i in range(4)]
    >>> phase_report(calls, 0.0, 10.0, [])
    {'seconds': 10.0, 'requests': 4, 'tokens_per_s': 4.0, 'seconds_per_token_p50': 0.3, 'seconds_per_token_p99': 0.4, 'k_ceiling_changes': []}
    """
    mine = [c for c in calls if lo <= c.end < hi and c.tokens]
    per_token = sorted((c.end - c.start) / c.tokens for c in mine)

    def q(x: float) -> float | None:
        return round(per_token[min(len(per_token) - 1, int(x * len(per_token)))], 4) if per_token else None

    return {"seconds": round(hi - lo, 1), "requests": len(mine),
            "tokens_per_s": round(sum(c.tokens for c in mine) / (hi - lo), 2) if hi > lo else None,
            "seconds_per_token_p50": q(0.5), "seconds_per_token_p99": q(0.99),
            "k_ceiling_changes": ceiling_changes}


def shift_prompts(args) -> list[str]:
    """The prompts a shifted category's requests draw from (--shift-questions' first turns)."""
    return [q["turns"][0] for q in load_questions(Path(args.shift_questions))]


def ratios(results: dict[str, list[dict]]) -> dict:
    """Tokens/s of `self` over each other config's, and of each `X+k` over `X`, whole run and second
    half (medians over rounds).

    >>> ratios({"ngram": [{"tokens_per_s": 100.0, "tokens_per_s_second_half": 90.0}],
    ...         "ngram+k": [{"tokens_per_s": 110.0, "tokens_per_s_second_half": 81.0}]})
    {'ngram+k/ngram tokens_per_s': 1.1, 'ngram+k/ngram tokens_per_s_second_half': 0.9}
    """
    pairs = [("self", other) for other in results if "self" in results and other not in ("self", "self" + K_TUNED)]
    pairs += [(c, c.removesuffix(K_TUNED)) for c in results if c.endswith(K_TUNED) and c.removesuffix(K_TUNED) in results]
    out = {}
    for mine, other in pairs:
        for key in ("tokens_per_s", "tokens_per_s_second_half"):
            rs = [s[key] / o[key] for s, o in zip(results[mine], results[other]) if s[key] and o[key]]
            if rs:
                out[f"{mine}/{other} {key}"] = round(statistics.median(rs), 3)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"].get("self")
    tuned = [c for c in result["runs"] if c.endswith(K_TUNED)]
    # the +k run whose ceilings moved most: its kMax per type over time
    moved = max(((c, i, r) for c in tuned for i, r in enumerate(result["runs"][c])),
                key=lambda x: len(x[2]["k_ceiling_changes"]), default=None)
    moved = moved if moved and moved[2]["k_ceiling_changes"] else None
    panels = 1 + bool(runs) + bool(moved)
    fig, axes = plt.subplots(panels, 1, figsize=(10, 4 + 3 * (panels - 1)), squeeze=False, sharex=True)
    ax1 = axes[0][0]
    for config, config_runs in result["runs"].items():
        calls = sorted((c for c in config_runs[0]["calls"] if not c["error"]), key=lambda c: c["end"])
        if not calls:
            continue
        span = 30.0
        ts = [i * 5.0 for i in range(int(calls[-1]["end"] // 5) + 1)]
        rate = [sum(c["tokens"] for c in calls if t - span <= c["end"] < t) / span if t >= span else None for t in ts]
        ax1.plot(ts, rate, label=config)
    ax1.set_ylabel(f"tokens/s (last 30 s)")
    ax1.set_xlabel("seconds")
    ax1.legend()
    clients = result["clients"]
    ax1.set_title(f"the same requests, {clients} client{'s' if clients != 1 else ''}, max {result['max_tokens']} tokens")
    if runs:
        ax2 = axes[1][0]
        types = sorted({t for _, m in runs[0]["methods_over_time"] for t in m})
        for i, t in enumerate(types):
            xs = [x for x, m in runs[0]["methods_over_time"]]
            ys = [{Method.NGRAM.value: 0, Method.EAGLE.value: 1}.get(m.get(t, ""), None)
                  for _, m in runs[0]["methods_over_time"]]
            ax2.step(xs, [None if y is None else y + 0.04 * i for y in ys], where="post", label=t)
        ax2.set_yticks([0, 1], [Method.NGRAM.value, Method.EAGLE.value])
        ax2.set_xlabel("seconds")
        ax2.set_title("the method the loop chose per prompt type (self)")
        ax2.legend(fontsize=7, ncol=4)
    if moved:
        config, i, run = moved
        ax3 = axes[-1][0]
        for j, t in enumerate(sorted({t for _, c in run["ceilings_over_time"] for t in c})):
            xs = [x for x, _ in run["ceilings_over_time"]]
            ax3.step(xs, [c.get(t, K_MAX) + 0.05 * j for _, c in run["ceilings_over_time"]], where="post", label=t)
        ax3.set_ylim(0, K_MAX + 0.5)
        ax3.set_ylabel(f"kMax ({K_MAX}: no ceiling)")
        ax3.set_xlabel("seconds")
        ax3.set_title(f"the K ceiling the loop set per prompt type ({config}, round {i + 1})")
        ax3.legend(fontsize=7)
    if result.get("burst"):
        n, start, end = parse_burst(result["burst"])
        for row in axes:
            row[0].axvspan(start, end, color="orange", alpha=0.12)
        ax1.text(start, ax1.get_ylim()[1] * 0.95, f" +{n} clients", fontsize=8, va="top")
    if result.get("shift"):
        category, at = parse_shift(result["shift"])
        for row in axes:
            row[0].axvline(at, color="grey", linestyle=":")
        ax1.text(at, ax1.get_ylim()[1] * 0.95, f" {category}'s prompts change", fontsize=8, va="top")
    if tuned and not any(r["k_ceiling_changes"] for c in tuned for r in result["runs"][c]):
        ax1.text(0.01, 0.02, f"{', '.join(tuned)}: no K ceiling moved", transform=ax1.transAxes, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench select", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="self,eagle,ngram", help=f"comma-separated, of {', '.join(CONFIGS)}; each may end in {K_TUNED} (kTuning on)")
    p.add_argument("--table", default="", help="TYPE=METHOD,... for the table config")
    p.add_argument("--seconds", type=float, default=600.0, help="each config's run (default 600)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every config, the order rotating (default 1)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--sampled-share", type=float, default=0.25, help="share of requests sampled (default 0.25)")
    p.add_argument("--temperature", type=float, default=0.7, help="their temperature (default 0.7)")
    p.add_argument("--window", type=float, default=30.0, help="slo.window, seconds (default 30)")
    p.add_argument("--dwell", type=float, default=60.0, help="routing.select.minDwell, seconds (default 60)")
    p.add_argument("--explore", type=float, default=5.0, help="routing.select.exploreShare, percent (default 5)")
    p.add_argument("--min-requests", type=int, default=4, help="routing.select.minRequests (default 4)")
    p.add_argument("--until-moved", default=None,
                   help="end a run once the loop has moved this prompt type off eagle (a test's short episode)")
    p.add_argument("--categories", default=None, help="comma-separated Spec-Bench categories (default: all)")
    p.add_argument("--shift", default=None, help="CATEGORY@SECONDS: from then on that category's prompts come "
                                                 "from --shift-questions (a traffic shift)")
    p.add_argument("--burst", default=None, help="N@START-END: N more clients from START to END seconds")
    p.add_argument("--tpot-p99", type=float, default=None,
                   help="kTuning.tpotP99Seconds of the +k configs: a type over it halves its K ceiling")
    p.add_argument("--shift-questions", default=str(CODE_EDITS), help="the shifted prompts (default: bundled code edits)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--worker-threads", type=int, default=2)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--questions", default=None)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, help="write the plot (PNG) here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c.removesuffix(K_TUNED) not in CONFIGS]
    if unknown:
        print(f"method_select: error: unknown config(s) {unknown}; have {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if any(c.removesuffix(K_TUNED) == "table" for c in configs) and not args.table:
        print("method_select: error: the table config needs --table TYPE=METHOD,...", file=sys.stderr)
        return 2
    questions = load_questions(Path(args.questions) if args.questions else default_questions())
    if args.categories:
        keep = set(args.categories.split(","))
        questions = [q for q in questions if q["category"] in keep]
    prompts = None
    if args.shift:
        try:
            category, _ = parse_shift(args.shift)
            prompts = shift_prompts(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"method_select: error: {e}", file=sys.stderr)
            return 2
        if category not in {q["category"] for q in questions}:
            print(f"method_select: error: --shift {args.shift!r}: no {category} questions in this run", file=sys.stderr)
            return 2
    if args.burst:
        try:
            _, _, end = parse_burst(args.burst)
        except ValueError as e:
            print(f"method_select: error: {e}", file=sys.stderr)
            return 2
        if end > args.seconds:
            print(f"method_select: error: --burst {args.burst!r} ends after the run's {args.seconds:g} s", file=sys.stderr)
            return 2
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            print(f"== round {r + 1}/{args.rounds}: {c}", flush=True)
            runs[c].append(Run(c, args, questions, prompts).go())
    result = {"clients": args.clients, "max_tokens": args.max_tokens, "seconds": args.seconds,
              "sampled_share": args.sampled_share, "temperature": args.temperature, "window_s": args.window,
              "explore_pct": args.explore, "shift": args.shift, "burst": args.burst,
              "tpot_p99_s": args.tpot_p99, "ratios": ratios(runs), "runs": runs}
    summary = {"ratios": result["ratios"], **{c: [{k: v for k, v in x.items()
                                                   if k not in ("calls", "methods_over_time", "ceilings_over_time")}
                                               for x in rs]
                                              for c, rs in runs.items()}}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
