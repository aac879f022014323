"""Per-request K: an acceptance-driven controller priced by measured step costs.

Each request keeps a sliding window of its verify steps. From it, alpha (the chance that one
more draft token is accepted) is the geometric estimate accepted / (accepted + rejections). With
t(n) = a + b*n the measured cost of a target forward over n tokens, a batch of B requests
drafting K tokens each emits B * E[K] tokens in t(B * (1 + K)), where E[K] = (1 - alpha^(K+1)) /
(1 - alpha). The best K maximises that rate; as B grows, the verify step's cost grows with B*K
and the best K falls to 0, so speculation never makes a loaded worker slower. K moves one step
at a time, at most every `hold` steps and only for a gain above `margin` (hysteresis).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step emits with k draft tokens, each accepted with chance alpha.

    >>> expected_tokens(0.0, 4), expected_tokens(1.0, 4), round(expected_tokens(0.5, 2), 3)
    (1.0, 5.0, 1.75)
    """
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class StepCostModel:
    """t(n) = a + b*n, fitted online (exponentially forgetting least squares) to measured steps.

    Until it has seen steps of different sizes it assumes an extra token costs `prior_ratio` of
    a one-token step: memory-bound decoding makes a few more tokens nearly free.
    """

    def __init__(self, forget: float = 0.98, prior_ratio: float = 1 / 16):
        self.forget, self.prior_ratio = forget, prior_ratio
        self.w = self.sn = self.st = self.snn = self.snt = 0.0

    def observe(self, n_tokens: int, seconds: float) -> None:
        f = self.forget
        self.w = f * self.w + 1.0
        self.sn = f * self.sn + n_tokens
        self.st = f * self.st + seconds
        self.snn = f * self.snn + n_tokens * n_tokens
        self.snt = f * self.snt + n_tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        """(a, b) in seconds and seconds per token; (1, prior_ratio) before any data."""
        if self.w == 0:
            return 1.0, self.prior_ratio
        mean_n, mean_t = self.sn / self.w, self.st / self.w
        var = self.snn / self.w - mean_n ** 2
        if var < 0.25:  # every step had about the same size: the slope is not identified
            b = self.prior_ratio * mean_t / (1 + self.prior_ratio * mean_n)
        else:
            b = max((self.snt / self.w - mean_n * mean_t) / var, 0.0)
        a = max(mean_t - b * mean_n, 1e-9)
        return a, b

    def cost(self, n_tokens: float) -> float:
        a, b = self.coefficients()
        return a + b * n_tokens


def best_k(alpha: float, batch: int, k_min: int, k_max: int, cost: StepCostModel) -> tuple[int, list[float]]:
    """argmax over K of the batch's tokens per second, and the rate of every K from k_min.

    >>> m = StepCostModel(prior_ratio=0.0)     # free verify tokens: draft as much as allowed
    >>> best_k(0.8, 1, 0, 8, m)[0]
    8
    >>> m = StepCostModel(prior_ratio=1.0)     # each token costs a whole step: never draft
    >>> best_k(0.8, 16, 0, 8, m)[0]
    0
    """
    rates = [batch * expected_tokens(alpha, k) / cost.cost(batch * (1 + k)) for k in range(k_min, k_max + 1)]
    best = max(range(len(rates)), key=rates.__getitem__)
    return k_min + best, rates


@dataclass
class KState:
    """One request's controller state."""

    k: int
    prior: float = 0.5  # alpha before this request has verified anything
    window: deque = field(default_factory=lambda: deque(maxlen=16))  # (accepted, drafted) per verify step
    since_change: int = 0
    idle_steps: int = 0  # steps at K = 0 without a draft: a probe comes after `probe_every`

    def alpha(self) -> float:
        return geometric_alpha(self.window, self.prior)


def geometric_alpha(steps, prior: float) -> float:
    """alpha from verify steps [(accepted, drafted)]: each accepted token a success, each step that
    stopped short one failure; a Beta(prior, 1 - prior) prior, so one step alone does not decide.

    >>> round(geometric_alpha([(3, 4), (4, 4), (0, 4)], prior=0.5), 3)   # 7 accepted, 2 rejections
    0.75
    """
    acc = sum(a for a, _ in steps)
    rejections = sum(1 for a, d in steps if a < d)
    return (acc + prior) / (acc + rejections + 1)


class KController:
    def __init__(self, cost: StepCostModel, hold: int = 4, margin: float = 0.03, probe_every: int = 32,
                 prior_alpha: float = 0.5):
        self.cost, self.hold, self.margin, self.probe_every, self.prior = cost, hold, margin, probe_every, prior_alpha

    def start(self, k_initial: int, prior: float | None = None, batch: int = 1, k_min: int = 0,
              k_max: int = 8) -> KState:
        """A request's state. With a prior alpha (what recent requests of its prompt type saw), its
        first K is already the best K for that alpha rather than k_initial: short requests would
        otherwise spend much of their life walking K to where it belongs."""
        if prior is None:
            return KState(min(max(k_initial, k_min), k_max), self.prior)
        return KState(best_k(prior, batch, k_min, k_max, self.cost)[0], prior)

    def observe(self, st: KState, num_draft_tokens: int, num_accepted: int) -> None:
        st.since_change += 1
        if num_draft_tokens:
            st.window.append((num_accepted, num_draft_tokens))
            st.idle_steps = 0
        else:
            st.idle_steps += 1

    def choose(self, st: KState, batch: int, k_min: int, k_max: int, adaptive: bool = True) -> int:
        """K for this request's next step, within [k_min, k_max]."""
        if not adaptive:
            st.k = min(max(st.k, k_min), k_max)
            return st.k
        if st.k < k_min or st.k > k_max:  # the bounds moved: obey at once
            st.k, st.since_change = min(max(st.k, k_min), k_max), 0
            return st.k
        if st.since_change < self.hold:
            return st.k
        target, rates = best_k(st.alpha(), batch, k_min, k_max, self.cost)
        now = rates[st.k - k_min]
        step = (target > st.k) - (target < st.k)
        if step and rates[target - k_min] > now * (1 + self.margin):
            st.k += step
            st.since_change = 0
        elif st.k == 0 and k_max > 0 and st.idle_steps >= self.probe_every:
            # K = 0 drafts nothing, so alpha cannot move: draft one token now and then to re-measure
            st.window.clear()
            st.k, st.since_change, st.idle_steps = 1, 0, 0
        return st.k
