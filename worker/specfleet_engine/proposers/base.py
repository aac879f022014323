"""What every proposer shares: the same `propose(seqs, ks)` signature and its `Proposal`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor


@dataclass
class Proposal:
    """A chain or a tree of draft tokens.

    A tree is its nodes in topological order: `parents[i]` is the index of node i's parent, -1
    for a child of the root (the sequence's last token); siblings appear in the order verification
    tries them (rank 0 first). `parents` None is a chain (-1, 0, 1, ...). `draft_probs[i]` is the q
    node i's token was drawn from, given its parent and its earlier siblings (sampling without
    replacement zeroes them out of q), or None for a deterministic proposer (q one-hot)."""

    draft_tokens: list[int]  # [n] with n <= the nodes allowed; empty means "nothing worth verifying"
    draft_probs: Tensor | None  # [n, V] the proposer's q, or None when q is one-hot (deterministic)
    key: int = 0  # what kind of draft this is (n-gram: the match length); acceptance is tracked per key
    parents: list[int] | None = None  # None: a chain

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def parent_list(self) -> list[int]:
        return list(self.parents) if self.parents is not None else list(range(-1, len(self.draft_tokens) - 1))

    def trimmed(self, k: int) -> "Proposal":
        """The first k nodes (a prefix of a topological order is a tree)."""
        probs = self.draft_probs[:k] if self.draft_probs is not None else None
        parents = self.parents[:k] if self.parents is not None else None
        return Proposal(self.draft_tokens[:k], probs, self.key, parents)

    def subset(self, keep: list[int]) -> "Proposal":
        """The nodes `keep` (ascending; each one's parent kept too), renumbered."""
        if keep == list(range(len(keep))):
            return self.trimmed(len(keep))
        new = {old: i for i, old in enumerate(keep)}
        parents = self.parent_list()
        probs = self.draft_probs[keep] if self.draft_probs is not None else None
        return Proposal([self.draft_tokens[i] for i in keep], probs, self.key,
                        [-1 if parents[i] < 0 else new[parents[i]] for i in keep])

    def depths(self) -> list[int]:
        """Each node's depth (a child of the root: 1)."""
        out: list[int] = []
        for p in self.parent_list():
            out.append(1 if p < 0 else out[p] + 1)
        return out


class SequenceView(Protocol):
    """What a proposer may read of a sequence."""

    seq_id: int
    tokens: list[int]  # prompt + generated so far
    params: object  # SamplingParams
    generator: torch.Generator | None

    def token_array(self) -> np.ndarray: ...


class Proposer(Protocol):
    name: str
    cheap: bool  # True: drafting k tokens costs next to nothing, so draft first and trim after

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Proposal]:
        """Draft up to ks[i] tokens for each sequence (ks[i] == 0: none)."""

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        """After verification: only the first num_valid tokens of seq.tokens are final."""

    def release(self, seq: SequenceView) -> None:
        """The sequence finished: free what the proposer holds for it."""
