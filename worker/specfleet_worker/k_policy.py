"""Choosing how many draft tokens to verify: acceptance estimates against measured step costs.

Speculation pays only when the tokens a verify step is expected to yield grow faster than its
cost. With a per-token acceptance rate a, drafting k tokens yields E(k) = 1 + a + ... + a^k
tokens; a forward over T new tokens costs c(T), measured on this machine (on a CPU, c grows
quickly with T; on a GPU, slowly until the batch fills the device). `choose_ks` picks the draft
lengths that maximise the batch's expected tokens per second, so a batch that is already large,
or a sequence whose drafts keep failing, gets k = 0: plain decoding, never slower than it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step yields: accepted drafts plus the bonus or recovered token.

    >>> round(expected_tokens(0.5, 3), 4)
    1.875
    >>> expected_tokens(0.9, 0)
    1.0
    """
    return sum(a ** i for i in range(k + 1))


def choose_ks(alphas: list[float], caps: list[int], cost: Callable[[int], float]) -> list[int]:
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


class AcceptanceEstimator:
    """Per-token acceptance rate of one sequence's drafts, exponentially weighted.

    Each verify step contributes its accepted tokens and, if it stopped early, one rejection;
    a = accepted / (accepted + rejections) is the geometric model's estimate. Steps without
    a draft pull the estimate back toward the prior, so a sequence that stopped drafting is
    tried again later.
    """

    def __init__(self, prior: float = 0.5, weight: float = 4.0, decay: float = 0.8, recover: float = 0.02):
        self.prior, self.decay, self.recover = prior, decay, recover
        self.accepted = prior * weight
        self.rejected = (1 - prior) * weight

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            # drift back toward the prior: nothing was learned this step
            a = self.alpha + self.recover * (self.prior - self.alpha)
            total = self.accepted + self.rejected
            self.accepted, self.rejected = a * total, (1 - a) * total
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (num_accepted < num_draft)


class StepCostModel:
    """Seconds of one target forward by its number of new-token rows, calibrated then tracked.

    Unmeasured sizes are interpolated linearly between measured ones and extrapolated with
    the last measured slope.
    """

    def __init__(self, smoothing: float = 0.1):
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + self.smoothing * (seconds - old)

    def __call__(self, rows: int) -> float:
        if rows in self.seconds:
            return self.seconds[rows]
        if not self.seconds:
            return 1.0 + 0.5 * (rows - 1)  # uncalibrated: assume drafts are expensive
        known = sorted(self.seconds)
        lo = max((r for r in known if r < rows), default=None)
        hi = min((r for r in known if r > rows), default=None)
        if lo is not None and hi is not None:
            w = (rows - lo) / (hi - lo)
            return self.seconds[lo] * (1 - w) + self.seconds[hi] * w
        if hi is not None:  # below every measurement
            return self.seconds[hi] * rows / hi
        if len(known) >= 2:
            a, b = known[-2], known[-1]
            slope = max((self.seconds[b] - self.seconds[a]) / (b - a), 0.0)
        else:
            slope = 0.5 * self.seconds[lo]
        return self.seconds[lo] + slope * (rows - lo)

    def relative(self) -> dict[int, float]:
        base = self.seconds.get(1)
        return {r: round(s / base, 3) for r, s in sorted(self.seconds.items())} if base else {}

