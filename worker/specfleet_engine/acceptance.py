"""The one acceptance estimator: how often draft tokens are accepted, over a forgetting window.

Every reader of acceptance uses it: the K policy (per sequence and kind of draft), the worker's
per-prompt-type history and its metrics' windows. Each verify step adds its draft tokens and
accepted tokens; older steps weigh `decay` less per new step, so `decay = 1 - 1/n` is a window
of about n steps (`decay = 1`: everything since the start).

Two readings of the same counts:
- `alpha`: the per-token acceptance chance of the geometric model, accepted / (accepted +
  rejections), where a step that stopped short of its draft is one rejection. It starts at a
  prior worth `weight` steps, which fades as data comes, and steps without a draft pull it back
  toward the prior by `recover`, so a sequence that stopped drafting is tried again later.
- `rate` (accepted / drafted tokens) and `tau` (tokens per step, the bonus or recovered token
  included): what metrics and dashboards report.
"""

from __future__ import annotations


class Acceptance:
    """Acceptance of drafts, exponentially forgetting.

    >>> a = Acceptance(decay=1.0)             # prior 0.5 worth 4 steps, nothing forgotten
    >>> a.observe(4, 4); a.observe(4, 1)      # 5 of 8 accepted, 1 rejection
    >>> a.alpha, a.rate, a.tau                # (2 + 5) / (4 + 5 + 1), 5 / 8, 5 / 2 + 1
    (0.7, 0.625, 3.5)
    >>> w = Acceptance(weight=0.0)            # no prior: a plain windowed rate
    >>> w.observe(0, 0); w.tau                # a step without a draft yields one token
    1.0
    """

    __slots__ = ("prior", "decay", "recover", "_geo", "_counts", "steps")

    def __init__(self, prior: float = 0.5, weight: float = 4.0, decay: float = 0.8, recover: float = 0.02):
        self.prior, self.decay, self.recover = prior, decay, recover
        # (accepted, rejections) of the geometric model, prior pseudo-counts included
        self._geo = (prior * weight, (1 - prior) * weight)
        # (drafted tokens, accepted tokens, steps), decayed; one tuple so other threads read it whole
        self._counts = (0.0, 0.0, 0.0)
        self.steps = 0  # verify steps seen with a draft, not decayed

    @property
    def alpha(self) -> float:
        acc, rej = self._geo
        total = acc + rej
        return acc / total if total > 0 else self.prior

    @property
    def rate(self) -> float:
        drafted, accepted, _ = self._counts
        return accepted / drafted if drafted > 0 else 0.0

    @property
    def tau(self) -> float:
        _, accepted, steps = self._counts
        return accepted / steps + 1.0 if steps > 0 else 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        d = self.decay
        cd, ca, cs = self._counts
        if drafted == 0:
            self._counts = (d * cd, d * ca, d * cs + 1)
            if self.recover:
                # nothing was learned: drift back toward the prior
                acc, rej = self._geo
                total = acc + rej
                a = self.alpha + self.recover * (self.prior - self.alpha)
                self._geo = (a * total, (1 - a) * total)
            return
        self.steps += 1
        self._counts = (d * cd + drafted, d * ca + accepted, d * cs + 1)
        acc, rej = self._geo
        self._geo = (d * acc + accepted, d * rej + (accepted < drafted))


def window(steps: int, **kw) -> Acceptance:
    """An estimator that remembers about the last `steps` verify steps."""
    return Acceptance(decay=1.0 - 1.0 / steps, **kw)
