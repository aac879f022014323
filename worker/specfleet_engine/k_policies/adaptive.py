"""`kPolicy: adaptive` (the default): a per-sequence K ceiling from its recent acceptance, then,
within it, the draft lengths that maximise the batch's expected tokens per second.

Two parts, composed:
- **The ceiling** (one per sequence) follows a window of about `window` verify steps: alpha is
  the geometric estimate (each accepted token a success, each step that stopped short a failure)
  and the ceiling walks one step at a time toward `best_k` for the current batch, at most every
  `hold` steps and only for a gain above `margin` (hysteresis). At 0 it drafts one token every
  `probe_every` idle steps, so alpha can recover: that token is verified whatever the budget or
  the latency guard say, until a probe's outcome has been observed.
- **The cost-aware choice** (`choose_ks`, over the whole batch): a proposer whose drafts cost
  something (a draft model) is told how many tokens to draft, judged by the sequence's acceptance;
  a cheap one (n-gram) drafts up to the ceiling and its draft is trimmed after, judged by the
  acceptance of that kind of draft (`Proposal.key`: the n-gram match length). Never below `k_min`.
As the batch grows, verify rows cost more and both parts fall to 0: plain decoding, never slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..acceptance import Acceptance
from .base import Cost, best_k, choose_ks, choose_nodes, path_scores, sibling_ranks


@dataclass
class AdaptiveState:
    """One sequence's policy state."""

    window: Acceptance  # for the ceiling
    by_key: dict[int, Acceptance] = field(default_factory=dict)  # for the cost-aware choice
    since_change: int = 0
    idle_steps: int = 0
    probing: bool = False  # a probe is due: its first draft node is verified (a floor), whatever the budget

    def acceptance(self, key: int) -> Acceptance:
        est = self.by_key.get(key)
        if est is None:
            est = self.by_key[key] = Acceptance()
        return est


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, costs: Cost, *, window: int = 16, hold: int = 4, margin: float = 0.03,
                 probe_every: int = 32, prior: float = 0.5, branch_prior: float = 0.15,
                 max_slowdown: float | None = None):
        self.costs = costs  # the engine's StepCostModel: seconds by rows
        self.window, self.hold, self.margin, self.probe_every, self.prior = window, hold, margin, probe_every, prior
        self.branch_prior, self.max_slowdown = branch_prior, max_slowdown
        self.branches: dict[int, Acceptance] = {}  # sibling rank >= 1 -> chance it wins where tried

    def _window(self, prior: float) -> Acceptance:
        return Acceptance(prior=prior, weight=1.0, decay=1.0 - 1.0 / self.window, recover=0.0)

    def start(self, seq, prior: float | None = None, batch: int = 1) -> None:
        """With a prior alpha (what recent requests of the same kind saw), the first ceiling is
        already the best K for it: short requests would otherwise spend much of their life walking
        K to where it belongs."""
        if prior is None:
            seq.k = min(max(seq.k, seq.k_min), seq.k_max)
            seq.kstate = AdaptiveState(self._window(self.prior))
        else:
            seq.k = best_k(prior, batch, seq.k_min, seq.k_max, self.costs)[0]
            seq.kstate = AdaptiveState(self._window(prior))

    def ceiling(self, seq, batch: int) -> int:
        st: AdaptiveState = seq.kstate
        k_min, k_max = seq.k_min, seq.k_max
        if seq.k < k_min or seq.k > k_max:  # the bounds moved: obey at once
            seq.k, st.since_change = min(max(seq.k, k_min), k_max), 0
            return seq.k
        if st.since_change < self.hold:
            return seq.k
        target, rates = best_k(st.window.alpha, batch, k_min, k_max, self.costs)
        now = rates[seq.k - k_min]
        step = (target > seq.k) - (target < seq.k)
        if step and rates[target - k_min] > now * (1 + self.margin):
            seq.k += step
            st.since_change = 0
        elif seq.k == 0 and k_max > 0 and st.idle_steps >= self.probe_every:
            # K = 0 drafts nothing, so alpha cannot move: draft one token now and then to re-measure
            st.window = self._window(self.prior)
            seq.k, st.since_change, st.idle_steps, st.probing = 1, 0, 0, True
        return seq.k

    @staticmethod
    def floor(seq) -> int:
        """Draft tokens a sequence verifies whatever the budget: k_min, and a due probe's one."""
        return max(seq.k_min, int(seq.kstate.probing))

    def draft_lengths(self, seqs: list, room: list[int], cost: Cost, cheap: bool, batch: int) -> list[int]:
        caps = [min(self.ceiling(s, batch), r) for s, r in zip(seqs, room)]
        if cheap and any(caps) and not any(self.floor(s) for s in seqs):
            # `select_nodes` adds the best node first and stops at the first that does not pay: if
            # not even a node as good as any can be, it will verify nothing, so do not draft at all
            # (at 16 sequences the n-gram search costs ~4% of a step that verifies nothing)
            n, gain = len(seqs), self.best_gain(seqs)
            if (n + gain) / cost(n + 1) <= n / cost(n):
                return [0] * n
        if cheap or not any(caps):
            return caps
        chosen = choose_ks([s.kstate.acceptance(0).alpha for s in seqs], caps, cost)
        return [max(c, min(self.floor(s), k)) for s, c, k in zip(seqs, chosen, caps)]

    def select_nodes(self, seqs: list, proposals: list, cost: Cost, cheap: bool, batch: int,
                     bystander_credit: float = 0.0) -> list[list[int]]:
        """The tree budget: a node's score is the chance its path is accepted, rank-0 edges at
        the sequence's acceptance for that kind of draft, a rank-r sibling at the fleet-wide
        chance that rank r wins where it was tried; nodes go best first while tokens per second
        of the forward rise and no request falls behind (1 + max_slowdown) x plain decoding's pace
        over its life (`choose_nodes`: each sequence's `latency_credit`, the others' least as
        `bystander_credit`), past each sequence's `floor`: the guard would otherwise prune a probe's
        one row in a batch of plain requests, and alpha would never recover. A costly draft was
        sized before: its chain is kept whole; its tree is pruned the same way."""
        if not cheap and not any(p.is_tree for p in proposals):
            return [list(range(len(p.draft_tokens))) for p in proposals]
        parents = [p.parent_list() for p in proposals]
        scores = []
        for s, p, par in zip(seqs, proposals, parents):
            a = s.kstate.acceptance(p.key).alpha
            scores.append(path_scores(par, lambda rank, depth, a=a: a if rank == 0 else self.branch(rank).alpha))
        floors = [min(self.floor(s), len(p.draft_tokens)) for s, p in zip(seqs, proposals)]
        credits = [getattr(s, "latency_credit", 0.0) for s in seqs]
        return choose_nodes(scores, parents, floors, cost, self.max_slowdown, batch - len(seqs), credits,
                            bystander_credit)

    def best_gain(self, seqs: list) -> float:
        """The most expected tokens one draft node of these sequences can add: no node scores above
        its sequence's acceptance for its kind of draft (a kind not seen yet: the prior of a new
        estimate) or, for a sibling, its rank's chance of winning (`path_scores`)."""
        gain = max([Acceptance().alpha, *(e.alpha for s in seqs for e in s.kstate.by_key.values())])
        return max([gain, *(b.alpha for b in self.branches.values())])

    def branch(self, rank: int) -> Acceptance:
        est = self.branches.get(rank)
        if est is None:
            est = self.branches[rank] = Acceptance(prior=self.branch_prior, weight=4.0, decay=1.0 - 1.0 / 256,
                                                   recover=0.0)
        return est

    def observe_branches(self, parents: list[int], path: list[int]) -> None:
        """At the root and at each accepted node: which of its children won (one trial each rank
        tried: ranks below the winner's lost, the winner's won; greedy and sampled alike)."""
        ranks = sibling_ranks(parents)
        for at, nxt in zip([-1, *path], [*path, None]):
            kids = [c for c, p in enumerate(parents) if p == at]
            won = ranks[nxt] if nxt is not None else len(kids)
            for c in kids:
                if 0 < ranks[c] <= won:
                    self.branch(ranks[c]).observe(1, int(ranks[c] == won))

    def observe(self, seq, key: int, drafted: int, accepted: int) -> None:
        st: AdaptiveState = seq.kstate
        st.since_change += 1
        st.acceptance(key).observe(drafted, accepted)
        if drafted:
            st.window.observe(drafted, accepted)
            st.idle_steps, st.probing = 0, False
        else:
            st.idle_steps += 1
