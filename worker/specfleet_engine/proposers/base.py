"""What every proposer shares: the same `propose(seqs, ks)` signature and its `Proposal`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor


@dataclass
class Proposal:
    draft_tokens: list[int]  # [k'] with k' <= k; empty means "nothing worth verifying"
    draft_probs: Tensor | None  # [k', V] the proposer's q, or None when q is one-hot (deterministic)
    key: int = 0  # what kind of draft this is (n-gram: the match length); acceptance is tracked per key

    def trimmed(self, k: int) -> "Proposal":
        probs = self.draft_probs[:k] if self.draft_probs is not None else None
        return Proposal(self.draft_tokens[:k], probs, self.key)


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
