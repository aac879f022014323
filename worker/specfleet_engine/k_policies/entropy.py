"""`kPolicy: entropy`: stop drafting past a node whose next draft is a guess: a node is verified
while the entropy of the draft distribution it was drawn from (`DraftStats.entropy`, nats) stays
at or below `max_entropy` at its position and at every position above it; always the first k_min,
within the adaptive policy's draft (at most k_max).

The entropy belongs to the position, not to the token drawn there (siblings share it), so a
sampled node's own draw never decides whether it is verified and rejection sampling stays exact
(`threshold.py`). Greedy drafts read the softmax of the draft's logits at temperature 1; sampled
ones the q they were drawn from (the request's temperature, top-k and top-p). The draft's length
is the adaptive policy's; n-gram drafts, which carry no distribution, get the adaptive choice.
"""

from __future__ import annotations

from .base import Cost
from .threshold import ThresholdPolicy

#: The default threshold in nats (e^2.5: as uncertain as a uniform choice among ~12 tokens).
#: Measured with the shipped EAGLE head on SmolLM2-135M (greedy chains of 6, 13 Spec-Bench
#: questions, docs/engine.md): a node whose parent was accepted was accepted 61-85% of the time
#: below 1.5 nats, 32-39% at 1.5-2.5, 20-25% at 2.5-4, 5% above; 2.5 gave the most tokens per
#: forward priced at 0.05 to 0.2 of a step a verify row, within 5% of the best threshold at each.
DEFAULT_MAX_ENTROPY = 2.5


class EntropyPolicy(ThresholdPolicy):
    name = "entropy"

    def __init__(self, costs: Cost, *, max_entropy: float = DEFAULT_MAX_ENTROPY, **kw):
        if not max_entropy >= 0.0:
            raise ValueError(f"max_entropy must be a number of nats >= 0, got {max_entropy!r}")
        super().__init__(costs, **kw)
        self.max_entropy = max_entropy

    def passes(self, proposal) -> list[bool]:
        return [h <= self.max_entropy for h in proposal.stats.entropy]
