"""What one vLLM answer says about speculation, counted as the fleet's windows count it
(specfleet_api.windows.TypeCounts), so that the loop, the method choice and the canary analysis read
a vLLM pool's windows exactly as they read specfleet's workers'.

vLLM started with `--per-request-spec-decode-metrics summary` (or `detailed`) puts a `metrics`
object in every single-choice answer (the last chunk of a stream too):

    time_to_first_token_ms   scheduled -> first output token
    generation_time_ms       first -> last output token (the decode; no queue, no prefill)
    mean_itl_ms              generation_time_ms / (output tokens - 1)
    speculative_decoding     None on a server without a draft; else
        acceptance_histogram       [j] = verify steps that accepted exactly j draft tokens (the bonus
                                   token excluded), j = 0 .. num_spec_tokens
        num_spec_steps             verify steps with a draft (the histogram's sum)
        num_draft_tokens           draft tokens proposed (n-gram may propose fewer than K)
        num_accepted_draft_tokens  sum of j * histogram[j]
        num_spec_tokens            the server's K (num_speculative_tokens)
        per_step_accepted, per_step_drafted   one entry a verify step (`detailed` only)

A decoding step is one target forward after the prefill: it emits its accepted draft tokens and
one more, so the steps are (output tokens - 1) - accepted draft tokens, the verify steps among them.

The speedup's plain side cannot come from the answer: a vLLM server runs one draft configuration,
so what plain decoding would have spent is what the arm's plain pool (no speculative config) spends
per output token now (`PlainBaseline`, fed by that pool's answers). Until the plain pool has answered,
a speculating answer counts its acceptance but no seconds, so no speedup is read from it: the loop
decides nothing on a speedup it does not have.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from specfleet_api.windows import POSITIONS, TPOT_BUCKETS, TTFT_BUCKETS, TypeCounts, bucket_of


@dataclasses.dataclass(frozen=True)
class SpecMetrics:
    """`metrics.speculative_decoding` of one answer."""

    histogram: tuple[int, ...]
    draft_tokens: int
    accepted_tokens: int
    per_step_drafted: tuple[int, ...] | None = None  # `detailed` only

    @property
    def verify_steps(self) -> int:
        return sum(self.histogram)


@dataclasses.dataclass(frozen=True)
class Answer:
    """What the counts are made of, from one answer's `usage` and `metrics`."""

    output_tokens: int
    ttft_s: float | None = None
    decode_s: float | None = None  # first -> last output token
    spec: SpecMetrics | None = None


def _number(obj: dict[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}.{key}: {value!r} is not a non-negative number")
    return value


def parse(body: dict[str, Any]) -> Answer:
    """An answer (a whole body, or a stream's last chunk: `usage` and `metrics` are read) as counts
    are made of it; ValueError naming the field that is malformed.

    >>> a = parse({"usage": {"completion_tokens": 9}, "metrics": {"time_to_first_token_ms": 20.0,
    ...     "generation_time_ms": 40.0, "speculative_decoding": {"acceptance_histogram": [1, 0, 2],
    ...     "num_draft_tokens": 6, "num_accepted_draft_tokens": 4, "num_spec_steps": 3}}})
    >>> a.output_tokens, a.ttft_s, a.decode_s, a.spec.verify_steps, a.spec.accepted_tokens
    (9, 0.02, 0.04, 3, 4)
    >>> parse({"usage": {"completion_tokens": 3}, "metrics": {"speculative_decoding": {
    ...     "acceptance_histogram": [1, 1], "num_draft_tokens": 2, "num_accepted_draft_tokens": 5}}})
    Traceback (most recent call last):
    ...
    ValueError: metrics.speculative_decoding: 5 accepted of 2 drafted, or against the histogram's 1
    """
    usage = body.get("usage") or {}
    tokens = _number(usage, "completion_tokens", "usage")
    if tokens is None:
        raise ValueError("usage.completion_tokens: missing (vLLM sends usage with every answer; in a stream, "
                         "ask for it with stream_options.include_usage)")
    metrics = body.get("metrics") or {}
    ttft_ms = _number(metrics, "time_to_first_token_ms", "metrics")
    decode_ms = _number(metrics, "generation_time_ms", "metrics")
    raw = metrics.get("speculative_decoding")
    spec = None
    if raw is not None:
        where = "metrics.speculative_decoding"
        hist = raw.get("acceptance_histogram")
        if not isinstance(hist, list) or not hist or not all(isinstance(n, int) and n >= 0 for n in hist):
            raise ValueError(f"{where}.acceptance_histogram: {hist!r} is not a list of counts")
        drafted = int(_number(raw, "num_draft_tokens", where) or 0)
        accepted = int(_number(raw, "num_accepted_draft_tokens", where) or 0)
        if accepted > drafted or accepted != sum(j * n for j, n in enumerate(hist)):
            raise ValueError(f"{where}: {accepted} accepted of {drafted} drafted, or against the histogram's "
                             f"{sum(j * n for j, n in enumerate(hist))}")
        per_step = raw.get("per_step_drafted")
        spec = SpecMetrics(tuple(hist), drafted, accepted,
                           tuple(int(n) for n in per_step) if isinstance(per_step, list) else None)
    return Answer(int(tokens), None if ttft_ms is None else ttft_ms / 1000,
                  None if decode_ms is None else decode_ms / 1000, spec)


class PlainBaseline:
    """Seconds per output token (after the first) on an arm's plain pool, as its answers show it:
    a mean over the last `n` answers' decodes, what a speculating answer's tokens would have cost
    without a draft. None until the plain pool has answered.

    >>> b = PlainBaseline(n=2)
    >>> b.itl_s is None
    True
    >>> b.observe(Answer(11, decode_s=0.2)); b.observe(Answer(3, decode_s=0.1)); round(b.itl_s, 4)
    0.025
    >>> b.observe(Answer(1, decode_s=0.0)); round(b.itl_s, 4)  # one token has no decode: nothing learnt
    0.025
    """

    def __init__(self, n: int = 64):
        self.n = n
        self._seen: list[tuple[float, int]] = []
        self.updated: float | None = None  # when (a monotonic clock's seconds) it last learnt something

    def observe(self, answer: Answer, now: float | None = None) -> None:
        if answer.decode_s is None or answer.output_tokens < 2 or answer.decode_s <= 0:
            return
        self._seen = (self._seen + [(answer.decode_s, answer.output_tokens - 1)])[-self.n:]
        self.updated = now

    def stale(self, now: float, max_age_s: float) -> bool:
        """Whether it has learnt nothing for `max_age_s` (or ever): the load, and with it what a
        plain token costs, moves.

        >>> b = PlainBaseline(); b.stale(10.0, 60.0)
        True
        >>> b.observe(Answer(3, decode_s=0.1), now=10.0); b.stale(60.0, 60.0), b.stale(80.0, 60.0)
        (False, True)
        """
        return self.updated is None or now - self.updated > max_age_s

    @property
    def itl_s(self) -> float | None:
        tokens = sum(t for _, t in self._seen)
        return sum(s for s, _ in self._seen) / tokens if tokens else None


def _counted(hist: tuple[int, ...], bucket: int) -> tuple[int, ...]:
    return hist[:bucket] + (hist[bucket] + 1,) + hist[bucket + 1:]


def counts(answer: Answer, *, speculating: bool, plain_itl_s: float | None) -> TypeCounts:
    """One finished answer as a window counts it (what a worker's metrics add for one request).

    `speculating`: the answer came from a pool with a draft (its method is not none);
    `plain_itl_s`: the arm's PlainBaseline now (its seconds fill the speedup's plain side).

    >>> a = parse({"usage": {"completion_tokens": 17}, "metrics": {"time_to_first_token_ms": 30.0,
    ...     "generation_time_ms": 80.0, "speculative_decoding": {"acceptance_histogram": [2, 1, 3],
    ...     "num_draft_tokens": 12, "num_accepted_draft_tokens": 7}}})
    >>> c = counts(a, speculating=True, plain_itl_s=0.01)  # 16 tokens after the first: 9 steps, 6 verified
    >>> c.steps, c.drafts, c.draft_tokens, c.accepted_tokens, c.pos_accepted[:3]
    (9, 6, 12, 7, (4, 3, 0))
    >>> round(c.plain_seconds, 3), c.busy_seconds, c.spec_speedups, round(c.spec_alpha_sum, 4)
    (0.16, 0.08, 1, 0.5833)
    >>> counts(a, speculating=True, plain_itl_s=None).busy_seconds  # no baseline yet: no seconds
    0.0
    """
    c = TypeCounts(requests=1, output_tokens=answer.output_tokens)
    spec = answer.spec
    accepted = spec.accepted_tokens if spec else 0
    # a last step's tokens past max_tokens or a stop string are cut from the output, not from the counts
    c.steps = max(answer.output_tokens - 1 - accepted, spec.verify_steps if spec else 0, 0)
    if spec is not None and spec.verify_steps:
        c.drafts = spec.verify_steps
        c.draft_tokens, c.accepted_tokens = spec.draft_tokens, accepted
        depth = len(spec.histogram) - 1  # the server's K
        if spec.per_step_drafted is not None:
            drafted = [sum(1 for d in spec.per_step_drafted if d > p) for p in range(POSITIONS)]
        else:  # `summary`: each verify step counted as reaching the server's K (n-gram may draft fewer)
            drafted = [spec.verify_steps if p < depth else 0 for p in range(POSITIONS)]
        c.pos_drafted = tuple(drafted)
        c.pos_accepted = tuple(sum(spec.histogram[p + 1:]) for p in range(POSITIONS))
    if answer.ttft_s is not None:
        c.ttft_seconds_sum, c.ttft_count = answer.ttft_s, 1
        c.ttft_hist = _counted(c.ttft_hist, bucket_of(answer.ttft_s, TTFT_BUCKETS))
    if answer.decode_s is not None and answer.output_tokens > 1:
        tpot = answer.decode_s / (answer.output_tokens - 1)
        c.tpot_seconds_sum, c.tpot_count = tpot, 1
        c.tpot_hist = _counted(c.tpot_hist, bucket_of(tpot, TPOT_BUCKETS))
    plain = busy = 0.0
    if answer.decode_s and answer.output_tokens > 1 and (plain_itl_s is not None or not speculating):
        busy = answer.decode_s
        plain = (answer.output_tokens - 1) * plain_itl_s if speculating else busy
    c.plain_seconds, c.busy_seconds = plain, busy
    if speculating:
        c.spec_requests = 1
        c.spec_plain_seconds, c.spec_busy_seconds = plain, busy
        if plain > 0 and busy > 0:
            c.spec_speedups, c.spec_log_speedup_sum = 1, math.log(plain / busy)
            c.spec_log_speedup_sq = c.spec_log_speedup_sum ** 2
        if spec is not None and spec.draft_tokens:
            alpha = spec.accepted_tokens / spec.draft_tokens
            c.spec_alphas, c.spec_alpha_sum, c.spec_alpha_sq = 1, alpha, alpha * alpha
    return c
