"""The one step-cost model: seconds of a target forward by its number of new-token rows.

Speculation pays only when the tokens a verify step is expected to yield grow faster than its
cost; a forward over T new tokens costs c(T), measured on this machine (on a CPU, c grows quickly
with T; on a GPU, slowly until the batch fills the device). The K policies choose draft lengths
with it, and the worker prices its speedup gauge with it (what plain decoding would have cost).
"""

from __future__ import annotations


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
