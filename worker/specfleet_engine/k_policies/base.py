"""What every K policy shares: the protocol the engine calls, and the expected-tokens arithmetic.

A step decides K at two points, and the engine asks the sequence's policy at both:
`draft_lengths` before proposing (how many tokens each sequence may draft) and `verify_lengths`
after (how many of each draft the target verifies; a cheap proposer drafts first and is trimmed
here). `observe` hears each verify step's outcome. Bounds come from the sequence (`k_min`,
`k_max`, set by the caller from the live config); costs come from the one `StepCostModel`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

Cost = Callable[[int], float]  # seconds of a forward by its rows (the rest of the batch included)


class KPolicy(Protocol):
    name: str

    def start(self, seq, prior: float | None = None, batch: int = 1) -> None:
        """Sets up `seq.kstate` and `seq.k` for a new sequence (prior: alpha of its kind of request)."""

    def draft_lengths(self, seqs: list, room: list[int], cost: Cost, cheap: bool, batch: int) -> list[int]:
        """Tokens each sequence may draft this step, each <= room[i] (what the context and
        max_tokens leave). batch: sequences decoding in this step."""

    def verify_lengths(self, seqs: list, drafted: list[int], keys: list[int], cost: Cost, cheap: bool) -> list[int]:
        """Of each draft (drafted[i] tokens, of kind keys[i]), how many tokens to verify."""

    def observe(self, seq, key: int, drafted: int, accepted: int) -> None:
        """The verify step's outcome for one sequence (drafted 0: a plain decoding step)."""


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step yields with k draft tokens each accepted with chance a: the
    accepted drafts plus the bonus or recovered token, 1 + a + ... + a^k.

    >>> expected_tokens(0.0, 4), expected_tokens(1.0, 4), round(expected_tokens(0.5, 3), 4)
    (1.0, 5.0, 1.875)
    """
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_ks(alphas: list[float], caps: list[int], cost: Cost) -> list[int]:
    """Draft lengths for a batch, each k_i <= caps[i], maximising expected tokens / cost(T).

    The i-th sequence's (k+1)-th draft token adds a_i^(k+1) expected tokens and one row to the
    forward; rows are added best gain first while the ratio improves.

    >>> linear = lambda T: 1.0 + 0.25 * (T - 1)          # each extra row costs a quarter step
    >>> choose_ks([0.9, 0.1], [4, 4], linear)
    [4, 0]
    >>> choose_ks([0.9], [4], lambda T: float(T))        # a row costs a full step: never draft
    [0]
    """
    ks = [0] * len(alphas)
    tokens, rows = float(len(alphas)), len(alphas)
    heap = [(-a, i) for i, (a, cap) in enumerate(zip(alphas, caps)) if cap > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if (tokens + gain) / cost(rows + 1) <= tokens / cost(rows):
            break
        ks[i] += 1
        tokens += gain
        rows += 1
        if ks[i] < caps[i]:
            heapq.heappush(heap, (-(alphas[i] ** (ks[i] + 1)), i))
    return ks


def best_k(alpha: float, batch: int, k_min: int, k_max: int, cost: Cost) -> tuple[int, list[float]]:
    """argmax over K of a batch's tokens per second when every sequence drafts K, and the rate
    of every K from k_min.

    >>> best_k(0.8, 1, 0, 8, lambda T: 1.0)[0]            # free verify rows: draft all allowed
    8
    >>> best_k(0.8, 16, 0, 8, lambda T: float(T))[0]       # each row costs a whole step: never
    0
    """
    rates = [batch * expected_tokens(alpha, k) / cost(batch * (1 + k)) for k in range(k_min, k_max + 1)]
    best = max(range(len(rates)), key=rates.__getitem__)
    return k_min + best, rates
