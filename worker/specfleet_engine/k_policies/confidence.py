"""`kPolicy: confidence`: verify the drafted nodes whose cumulative draft probability (EAGLE-2's
confidence: the product of the draft's probabilities along the node's path) reaches
`min_confidence`, always the first k_min, within the adaptive policy's draft (at most k_max).

A node is judged before its own token is known: its parent's cumulative probability (the product
of its ancestors' own token probabilities, `DraftStats.prob`) times `DraftStats.rank_prob`, the
probability of the position's most likely token of the node's sibling rank. Greedy drafts take
those tokens, so there the score is exactly the node's cumulative draft probability; a sampled
node's own draw does not decide whether it is verified, which keeps rejection sampling exact
(`threshold.py`). A branch stops at its first node below the threshold: a node never scores above
its parent.

The draft's length is the adaptive policy's (its ceiling from the acceptance of what was
verified, and the cost-aware choice for the batch); n-gram drafts, which carry no distribution,
get the adaptive policy's choice.
"""

from __future__ import annotations

from .base import Cost
from .threshold import ThresholdPolicy

#: The default threshold: a node is verified when the draft gives its path at least this chance.
#: Measured with the shipped EAGLE head on SmolLM2-135M (greedy chains of 6, 13 Spec-Bench
#: questions, docs/engine.md): its confidence runs high (nodes at 0.1-0.2 were accepted 7% of the
#: time, at 0.3-0.5 28%); 0.2 gave the most tokens per forward priced at 0.1 of a step a verify
#: row (the CPU), within 1% of the best at 0.05 and 3% at 0.2.
DEFAULT_MIN_CONFIDENCE = 0.2


def path_confidence(parents: list[int], prob: list[float], rank_prob: list[float]) -> list[float]:
    """Each node's score: its parent's cumulative draft probability times its rank's probability
    at its position (greedy drafts: its own, so this is the path's cumulative draft probability).

    >>> path_confidence([-1, 0, 0, 1], [0.8, 0.5, 0.1, 0.5], [0.8, 0.5, 0.3, 0.5])  # 2: rank 1, drew 0.1
    [0.8, 0.4, 0.24, 0.2]
    """
    path: list[float] = []  # cumulative probability of each node's own tokens, itself included
    out = []
    for p, own, rank in zip(parents, prob, rank_prob):
        above = 1.0 if p < 0 else path[p]
        out.append(above * rank)
        path.append(above * own)
    return out


class ConfidencePolicy(ThresholdPolicy):
    name = "confidence"

    def __init__(self, costs: Cost, *, min_confidence: float = DEFAULT_MIN_CONFIDENCE, **kw):
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be a probability in [0, 1], got {min_confidence!r}")
        super().__init__(costs, **kw)
        self.min_confidence = min_confidence

    def passes(self, proposal) -> list[bool]:
        st = proposal.stats
        return [c >= self.min_confidence for c in path_confidence(proposal.parent_list(), st.prob, st.rank_prob)]
