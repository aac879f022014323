"""Prometheus metrics under the names that speculative-decoding runbooks and dashboards use.

The spec_decode_num_* counters are vLLM's (`vllm:spec_decode_num_drafts`, ...) under the
spec_decode_ prefix this fleet's dashboards, alerts and operator read. The gauges are computed
over a sliding window of recent verify steps, so one scrape is one window's view (the operator
relies on that). Each server owns its registry: two servers in one process do not collide.
`TypeCounts` are the same events summed per prompt type, for the fleet windows (fleet.py), with
latency histograms on the windows' own buckets (specfleet_api.windows).
"""

from __future__ import annotations

import dataclasses
import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from specfleet_api import windows
from specfleet_api.windows import TypeCounts, bucket_of
from specfleet_engine.acceptance import Acceptance, window

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
K_BUCKETS = tuple(range(0, 17))


def new_window() -> Acceptance:
    """The gauges' window: about the last 512 decoding steps, no prior (an empty window reads 0)."""
    return window(512, weight=0.0, recover=0.0)


class Metrics:
    def __init__(self, model: str, quantization: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model, self.quantization = model, quantization
        r, m = self.registry, ["model"]

        self.acceptance_rate = Gauge("spec_decode_acceptance_rate",
                                     "Accepted / drafted tokens over the recent window", ["model", "prompt_type"],
                                     registry=r)
        self.avg_accepted_tokens = Gauge("spec_decode_avg_accepted_tokens",
                                         "Mean tokens per verify step (tau) over the recent window", m, registry=r)
        self.draft_k = Histogram("spec_decode_draft_k_distribution", "K chosen per request per decoding step",
                                 m, buckets=K_BUCKETS, registry=r)
        self.tree_branch_factor = Gauge("spec_decode_tree_branch_factor",
                                        "Draft tree branching verified over the recent window: draft nodes per "
                                        "draft level (1: chains)", m, registry=r)
        self.speedup = Gauge("spec_decode_total_speedup_ratio",
                             "Estimated speed-up over plain decoding over recent steps, priced by the engine's "
                             "calibrated step costs", ["model", "quantization"], registry=r)
        self.busy_seconds = Counter("spec_decode_busy_seconds", "Seconds the engine spent stepping", m, registry=r)
        self.plain_equivalent_seconds = Counter(
            "spec_decode_plain_equivalent_seconds",
            "Seconds plain decoding would have spent on the same steps (rate over busy rate: the speed-up)",
            m, registry=r)

        # vLLM-compatible counters
        self.num_drafts = Counter("spec_decode_num_drafts", "Verify steps with at least one draft token",
                                  m, registry=r)
        self.num_draft_tokens = Counter("spec_decode_num_draft_tokens",
                                        "Output positions drafted (a draft tree's depth: alpha's denominator)",
                                        m, registry=r)
        self.num_draft_nodes = Counter("spec_decode_num_draft_nodes",
                                       "Draft tokens verified, every tree node (chains: = num_draft_tokens)",
                                       m, registry=r)
        self.num_accepted_tokens = Counter("spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           m, registry=r)
        self.accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft", ["model", "position"],
                                        registry=r)
        # draft.ngram.mix: whether mixing pays, by prompt type (the head's accepted tokens are the
        # accepted ones less the n-gram's)
        self.ngram_drafts = Counter("spec_decode_num_ngram_drafts",
                                    "Verify steps whose mixed draft held the n-gram's chain", ["model", "prompt_type"],
                                    registry=r)
        self.ngram_accepted = Counter("spec_decode_num_ngram_accepted_tokens",
                                      "Draft tokens accepted on a mixed draft's n-gram chain", ["model", "prompt_type"],
                                      registry=r)
        self.draft_failures = Counter("spec_decode_draft_failures", "Proposer failures degraded to plain decoding",
                                      m, registry=r)

        self.ttft = Histogram("spec_decode_time_to_first_token_seconds", "Arrival to first token", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("spec_decode_time_per_output_token_seconds", "Decode time per output token after the first",
                              m, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("spec_decode_e2e_request_latency_seconds", "Arrival to the last token", m,
                             buckets=LATENCY_BUCKETS, registry=r)

        self.requests = Counter("spec_decode_requests", "Requests finished, by finish reason",
                                ["model", "finish_reason"], registry=r)
        self.rejected = Counter("spec_decode_rejected_requests", "Requests refused before running, by reason",
                                ["model", "reason"], registry=r)
        self.failed = Counter("spec_decode_failed_requests", "Requests that failed inside the worker", m, registry=r)
        self.prompt_tokens = Counter("spec_decode_prompt_tokens", "Prompt tokens prefilled", m, registry=r)
        self.generation_tokens = Counter("spec_decode_generation_tokens", "Tokens generated", m, registry=r)

        self.queue_depth = Gauge("spec_decode_queue_depth", "Requests admitted and waiting for a batch slot",
                                 m, registry=r)
        self.running = Gauge("spec_decode_running_requests", "Requests in the running batch", m, registry=r)
        self.kv_blocks_used = Gauge("spec_decode_kv_blocks_used", "KV cache blocks in use", m, registry=r)
        self.kv_blocks_total = Gauge("spec_decode_kv_blocks_capacity", "KV cache blocks in all (a gauge: not named _total, "
                                     "which Prometheus reserves for counters)", m, registry=r)

        self.totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_draft_nodes": 0, "num_accepted_tokens": 0,
                       "draft_errors": 0}
        self.window = new_window()
        # (draft tokens, draft levels) of recent verify steps with a draft, forgotten as the window is
        self._tree = (0.0, 0.0)
        self.window_by_type: dict[str, Acceptance] = {}
        self._by_type: dict[str, TypeCounts] = {}  # written by the scheduler thread, read by the publisher's
        self._by_type_lock = threading.Lock()
        self.speedup.labels(model, quantization).set(1.0)
        self.avg_accepted_tokens.labels(model).set(0.0)
        self.tree_branch_factor.labels(model).set(1.0)  # nothing verified yet reads as chains
        for c in (self.num_drafts, self.num_draft_tokens, self.num_draft_nodes, self.num_accepted_tokens,
                  self.draft_failures, self.failed, self.prompt_tokens, self.generation_tokens, self.busy_seconds,
                  self.plain_equivalent_seconds):
            c.labels(model)  # exported at 0 from the start, so rate() works from the first scrape

    def step(self, prompt_type: str, k: int, nodes: int, accepted: int, emitted: int, depth: int = 0,
             ngram_nodes: int = 0, ngram_accepted: int = 0, method: str | None = None) -> None:
        """One decoding step of one request: `nodes` draft tokens verified over `depth` levels
        (StepStats.num_draft_tokens, .draft_depth; depth 0 reads as a chain of `nodes`). alpha
        counts positions (the depth), so a tree's reads like a chain's; the nodes price the step.
        ngram_nodes, ngram_accepted: a mixed draft's n-gram chain (StepStats')."""
        m = self.model
        drafted = depth or nodes
        self.draft_k.labels(m).observe(k)
        self.generation_tokens.labels(m).inc(emitted)
        self.window.observe(drafted, accepted)
        with self._by_type_lock:
            for c in self._counts(prompt_type, method):
                c.steps += 1
                if drafted:
                    c.drafts += 1
                    c.draft_tokens += drafted
                    c.accepted_tokens += accepted
                    c.pos_drafted = _counted_upto(c.pos_drafted, drafted)
                    if accepted:
                        c.pos_accepted = _counted_upto(c.pos_accepted, accepted)
        if drafted:
            self.totals["num_drafts"] += 1
            self.totals["num_draft_tokens"] += drafted
            self.totals["num_draft_nodes"] += nodes
            self.totals["num_accepted_tokens"] += accepted
            self.num_drafts.labels(m).inc()
            self.num_draft_tokens.labels(m).inc(drafted)
            self.num_draft_nodes.labels(m).inc(nodes)
            self.num_accepted_tokens.labels(m).inc(accepted)
            for pos in range(accepted):
                self.accepted_per_pos.labels(m, str(pos)).inc()
            w = self.window_by_type.get(prompt_type)
            if w is None:
                w = self.window_by_type[prompt_type] = new_window()
            w.observe(drafted, accepted)
            self.acceptance_rate.labels(m, prompt_type).set(w.rate)
            if ngram_nodes:
                self.ngram_drafts.labels(m, prompt_type).inc()
                self.ngram_accepted.labels(m, prompt_type).inc(ngram_accepted)
            tree_nodes, levels = self._tree
            d = self.window.decay
            self._tree = (d * tree_nodes + nodes, d * levels + drafted)
            self.tree_branch_factor.labels(m).set(self._tree[0] / self._tree[1])
        self.avg_accepted_tokens.labels(m).set(self.window.tau)

    def busy(self, plain_s: float, actual_s: float) -> None:
        """One engine step: its seconds, and what plain decoding would have taken."""
        self.busy_seconds.labels(self.model).inc(actual_s)
        self.plain_equivalent_seconds.labels(self.model).inc(plain_s)

    def cost(self, prompt_type: str, plain_s: float, actual_s: float, spec: bool = False,
             method: str | None = None) -> None:
        """One request's share of an engine step (`busy` counts the whole step); `spec`: the
        request speculated in that step (counted in the `spec_` fields too); `method`: the draft
        method it ran (its counts go to the (type, method) window too)."""
        with self._by_type_lock:
            for c in self._counts(prompt_type, method):
                c.plain_seconds += plain_s
                c.busy_seconds += actual_s
                if spec:
                    c.spec_plain_seconds += plain_s
                    c.spec_busy_seconds += actual_s

    def finished(self, prompt_type: str, finish_reason: str, output_tokens: int, e2e_s: float,
                 ttft_s: float | None, tpot_s: float | None, spec: bool = False,
                 spec_seconds: tuple[float, float] = (0.0, 0.0), method: str | None = None,
                 spec_alpha: float | None = None) -> None:
        """A request that ran to its end (stop, length or abort); TTFT is None when no token came,
        TPOT when fewer than two did; `spec`: speculation was in effect for it (in some step);
        `spec_seconds`: (plain-equivalent, actual) seconds of its speculating steps, whose ratio is
        this request's own speedup (the spread of those is how sure a window's speedup is);
        `spec_alpha`: its acceptance rate, where it drafted."""
        m = self.model
        self.requests.labels(m, finish_reason).inc()
        self.e2e.labels(m).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(m).observe(tpot_s)
        with self._by_type_lock:
            for c in self._counts(prompt_type, method):
                self._finished_into(c, output_tokens, ttft_s, tpot_s, spec, spec_seconds, spec_alpha)

    @staticmethod
    def _finished_into(c: TypeCounts, output_tokens: int, ttft_s: float | None, tpot_s: float | None, spec: bool,
                       spec_seconds: tuple[float, float], spec_alpha: float | None) -> None:
        c.requests += 1
        c.spec_requests += spec
        plain_s, busy_s = spec_seconds
        if spec and plain_s > 0 and busy_s > 0:
            log_speedup = math.log(plain_s / busy_s)
            c.spec_speedups += 1
            c.spec_log_speedup_sum += log_speedup
            c.spec_log_speedup_sq += log_speedup * log_speedup
        if spec and spec_alpha is not None:
            c.spec_alphas += 1
            c.spec_alpha_sum += spec_alpha
            c.spec_alpha_sq += spec_alpha * spec_alpha
        c.output_tokens += output_tokens
        if ttft_s is not None:
            c.ttft_seconds_sum += ttft_s
            c.ttft_count += 1
            c.ttft_hist = _counted(c.ttft_hist, bucket_of(ttft_s, windows.TTFT_BUCKETS))
        if tpot_s is not None:
            c.tpot_seconds_sum += tpot_s
            c.tpot_count += 1
            c.tpot_hist = _counted(c.tpot_hist, bucket_of(tpot_s, windows.TPOT_BUCKETS))

    def error(self, prompt_type: str, method: str | None = None) -> None:
        """A request that failed inside the worker (the engine failed, or the worker stopped under it)."""
        with self._by_type_lock:
            for c in self._counts(prompt_type, method):
                c.errors += 1

    def counts_by_type(self) -> dict[str, TypeCounts]:
        """A consistent copy of every prompt type's counts, and every (type, method)'s under
        `windows.method_field` (any thread)."""
        with self._by_type_lock:
            return {t: dataclasses.replace(c) for t, c in self._by_type.items()}

    def _counts(self, prompt_type: str, method: str | None = None) -> list[TypeCounts]:
        """The counts one event adds to: its prompt type's, and its (type, method)'s."""
        fields = [prompt_type] + ([windows.method_field(prompt_type, method)] if method else [])
        return [self._by_type.setdefault(f, TypeCounts()) for f in fields]

    def draft_error(self, n: int) -> None:
        self.totals["draft_errors"] += n
        self.draft_failures.labels(self.model).inc(n)


def _counted(hist: tuple[int, ...], bucket: int) -> tuple[int, ...]:
    return hist[:bucket] + (hist[bucket] + 1,) + hist[bucket + 1:]


def _counted_upto(counts: tuple[int, ...], n: int) -> tuple[int, ...]:
    """One more at each of the first n positions (at most all of them).

    >>> _counted_upto((0, 0, 0), 2), _counted_upto((1, 1, 1), 5)
    ((1, 1, 0), (2, 2, 2))
    """
    n = min(n, len(counts))
    return tuple(c + 1 for c in counts[:n]) + counts[n:]
