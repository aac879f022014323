"""What the confidence and entropy K policies share: the adaptive policy sizes each draft, then a
per-node signal from the draft's own distribution (`Proposal.stats`) decides which of the drafted
nodes the target verifies.

The filter is decided node by node, on the node's own path only (its ancestors' tokens, its
sibling rank and the distribution at its position), never on its own sampled token nor on other
branches: a node whose presence depended on its own draw (or on a later sibling's, drawn without
it) would make the token that reaches verification follow another distribution than the q it is
judged with, and sampled outputs would drift from the target's. Greedy drafts are deterministic
given their prefix, so there every choice is lossless.

The cost model acts before drafting: the adaptive ceiling and `choose_ks` say how deep each
sequence may draft for the current batch (a loaded batch drafts less, down to plain decoding), and
the filter keeps what the draft itself believes in. A cross-node budget after the filter
(`choose_nodes`) would let one node's presence depend on its siblings' and cousins' draws, which
the per-node rule avoids. A proposer with no distribution (`Capabilities.draft_stats` False:
n-gram) gets the adaptive policy's choice unchanged.
"""

from __future__ import annotations

from .adaptive import AdaptivePolicy
from .base import Cost


def kept_nodes(parents: list[int], passes: list[bool], floor: int) -> list[int]:
    """The nodes verified: the first `floor` (k_min, or a due probe), and every node that passes
    whose parent is kept (a node whose parent is dropped goes with it).

    >>> kept_nodes([-1, 0, 1, -1], [True, False, True, True], floor=0)   # 2's parent failed
    [0, 3]
    >>> kept_nodes([-1, 0, 1], [False, False, True], floor=2)            # k_min keeps 0 and 1
    [0, 1, 2]
    """
    kept: list[int] = []
    on = [False] * len(parents)
    for i, (p, ok) in enumerate(zip(parents, passes)):
        on[i] = i < floor or (ok and (p < 0 or on[p]))
        if on[i]:
            kept.append(i)
    return kept


class ThresholdPolicy(AdaptivePolicy):
    """The adaptive policy, with `select_nodes` replaced by a per-node threshold on the draft's
    own distribution (`passes`, one per policy)."""

    def passes(self, proposal) -> list[bool]:
        """For each node of a proposal that carries `stats`: whether its signal clears the threshold."""
        raise NotImplementedError

    def select_nodes(self, seqs: list, proposals: list, cost: Cost, cheap: bool, batch: int,
                     bystander_credit: float = 0.0) -> list[list[int]]:
        told = [p.stats is not None and len(p.draft_tokens) > 0 for p in proposals]
        if not any(told):
            return super().select_nodes(seqs, proposals, cost, cheap, batch, bystander_credit)
        fallback = iter(super().select_nodes([s for s, t in zip(seqs, told) if not t],
                                             [p for p, t in zip(proposals, told) if not t], cost, cheap, batch,
                                             bystander_credit) if not all(told) else [])
        out = []
        for s, p, t in zip(seqs, proposals, told):
            if not t:
                out.append(next(fallback))
                continue
            out.append(kept_nodes(p.parent_list(), self.passes(p), min(self.floor(s), len(p.draft_tokens))))
        return out
