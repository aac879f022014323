"""The one step-cost model: seconds of a target forward by its number of new-token rows.

Speculation pays only when the tokens a verify step is expected to yield grow faster than its
cost; a forward over T new tokens costs c(T), measured on this machine (on a CPU, c grows quickly
with T; on a GPU, slowly until the batch fills the device). The K policies choose draft lengths
with it, and the worker prices its speedup gauge with it (what plain decoding would have cost).
"""

from __future__ import annotations

import math

RESIDUAL_CLIP = 0.25  # a live step's log(observed / predicted), clipped: one slow step moves little
REFINE_RATE = 0.5  # the share of a size's mean residual a refinement round applies
REFINE_STEP = math.log(1.1)  # and at most this much, either way


class StepCostModel:
    """Seconds of one target forward by its number of new-token rows: a shape times a level.

    The shape, cost(rows) / cost(1), is measured by `Engine.calibrate` with every size timed in
    turn, so that a change in the machine's load hits all sizes alike, and is made non-decreasing
    (isotonic). Each live step moves the level (an exponential average). Single-sequence steps
    also refine the shape, but only by how sizes differ from each other: a step's log residual
    (observed over predicted) counts toward the calibrated sizes its price was interpolated from;
    every `refine_every` steps, each size with `min_samples` of weight since its last refinement
    moves by half its mean residual less the mean of all such sizes, at most 10% a round. A burst
    of contention slows the sizes that ran then alike and leaves the shape; a size seen alone
    teaches nothing; a shape the calibration got wrong (its dummy context is shorter than real
    ones) converges to what live steps cost. Batches refine nothing: the calibration times one
    sequence, and a batch's cost grows with its sequences' contexts, not its rows alone (refining
    from batches made the rows drafts add look cheap: 16 clients 0.95x plain throughput and P99
    1.41x, against 1.04x and 1.26x without; docs/trees.md). Unmeasured sizes are interpolated
    linearly and extrapolated with the last slope.

    >>> c = StepCostModel(); c.set_curve({1: 1.0, 2: 0.9, 4: 1.3}); c.relative()   # 2 rows: noise
    {1: 1.0, 2: 1.0, 4: 1.368}
    >>> c.observe(4, 13.0); round(c(4) / c(1), 3)       # a slow step moves the level, not the shape
    1.368
    """

    def __init__(self, smoothing: float = 0.1, clip: float = 3.0, refine_every: int = 256, min_samples: int = 16):
        self.smoothing, self.clip = smoothing, clip
        self.refine_every, self.min_samples = refine_every, min_samples
        self.seconds: dict[int, float] = {}  # the calibrated curve, refined by live steps
        self.level = 1.0  # observed / calibrated seconds, tracked online
        self._residuals: dict[int, list[float]] = {}  # calibrated rows -> [weight, weighted sum of log residuals]
        self._since = 0

    def set_curve(self, seconds: dict[int, float]) -> None:
        rows = sorted(seconds)
        self.seconds = dict(zip(rows, isotonic([seconds[r] for r in rows])))
        self.level = 1.0
        self._residuals, self._since = {}, 0

    def observe(self, rows: int, seconds: float, seqs: int = 1) -> None:
        """A live forward of `rows` new-token rows over `seqs` sequences took `seconds`."""
        ratio = min(max(seconds / self._curve(rows) / self.level, 1 / self.clip), self.clip)
        self.level *= ratio ** self.smoothing  # an exponential average of log(level)
        if not self.seconds or self.refine_every <= 0 or seqs != 1:
            return
        residual = min(max(math.log(ratio), -RESIDUAL_CLIP), RESIDUAL_CLIP)  # one outlier step moves little
        for point, weight in self._points(rows):
            acc = self._residuals.setdefault(point, [0.0, 0.0])
            acc[0] += weight
            acc[1] += weight * residual
        self._since += 1
        if self._since >= self.refine_every:
            self._refine()

    def _refine(self) -> None:
        seen = {r: (n, total / n) for r, (n, total) in self._residuals.items() if n >= self.min_samples}
        self._since = 0
        if len(seen) < 2:
            return
        for r in seen:  # a rarer size keeps gathering: its residuals are relative to the level, not a round
            del self._residuals[r]
        mean = sum(n * m for n, m in seen.values()) / sum(n for n, _ in seen.values())
        moved = {r: self._curve(r) * math.exp(min(max(REFINE_RATE * (m - mean), -REFINE_STEP), REFINE_STEP))
                 for r, (_, m) in seen.items()}
        curve = {**self.seconds, **moved}
        rows = sorted(curve)
        self.seconds = dict(zip(rows, isotonic([curve[r] for r in rows])))

    def _points(self, rows: int) -> list[tuple[int, float]]:
        """The calibrated sizes a step of `rows` is priced from, with their interpolation weights
        (what a residual there teaches each)."""
        if rows in self.seconds:
            return [(rows, 1.0)]
        known = sorted(self.seconds)
        lo = max((r for r in known if r < rows), default=None)
        hi = min((r for r in known if r > rows), default=None)
        if lo is None or hi is None:  # outside the calibration: its nearest end
            return [(hi if lo is None else lo, 1.0)]
        w = (rows - lo) / (hi - lo)
        return [(lo, 1.0 - w), (hi, w)]

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
