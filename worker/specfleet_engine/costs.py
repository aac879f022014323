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
    """Seconds of one target forward by its number of new-token rows: a shape times a level.

    The shape, cost(rows) / cost(1), is measured by `Engine.calibrate` with every size timed in
    turn, so that a change in the machine's load hits all sizes alike, and is made non-decreasing
    (isotonic). Online observations move only the level: on a shared machine, steps that ran during
    a burst of contention would otherwise bend the shape, and with it every choice of K (only the
    shape matters to `choose_ks`; the level is for reporting seconds). Unmeasured sizes are
    interpolated linearly and extrapolated with the last slope.

    >>> c = StepCostModel(); c.set_curve({1: 1.0, 2: 0.9, 4: 1.3}); c.relative()   # 2 rows: noise
    {1: 1.0, 2: 1.0, 4: 1.368}
    >>> c.observe(4, 13.0); round(c(4) / c(1), 3)       # a slow step moves the level, not the shape
    1.368
    """

    def __init__(self, smoothing: float = 0.1, clip: float = 3.0):
        self.smoothing, self.clip = smoothing, clip
        self.seconds: dict[int, float] = {}  # the calibrated curve
        self.level = 1.0  # observed / calibrated seconds, tracked online

    def set_curve(self, seconds: dict[int, float]) -> None:
        rows = sorted(seconds)
        self.seconds = dict(zip(rows, isotonic([seconds[r] for r in rows])))
        self.level = 1.0

    def observe(self, rows: int, seconds: float) -> None:
        ratio = min(max(seconds / self._curve(rows) / self.level, 1 / self.clip), self.clip)
        self.level *= ratio ** self.smoothing  # an exponential average of log(level)

    def __call__(self, rows: int) -> float:
        return self.level * self._curve(rows)

    def _curve(self, rows: int) -> float:
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


def isotonic(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ys in least squares (pool adjacent violators).

    >>> isotonic([1.0, 1.2, 1.1, 1.5, 1.4, 1.3])
    [1.0, 1.15, 1.15, 1.4, 1.4, 1.4]
    """
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [round(s / n, 12) for s, n in blocks for _ in range(int(n))]
