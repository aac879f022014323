"""`kPolicy: fixed`: every step drafts and verifies the sequence's K, clamped to its bounds."""

from __future__ import annotations

from .base import Cost


class FixedPolicy:
    name = "fixed"

    def start(self, seq, prior: float | None = None, batch: int = 1) -> None:
        seq.kstate = None
        seq.k = min(max(seq.k, seq.k_min), seq.k_max)

    def draft_lengths(self, seqs: list, room: list[int], cost: Cost, cheap: bool, batch: int) -> list[int]:
        return [min(min(max(s.k, s.k_min), s.k_max), r) for s, r in zip(seqs, room)]

    def select_nodes(self, seqs: list, proposals: list, cost: Cost, cheap: bool, batch: int,
                     bystander_credit: float = 0.0) -> list[list[int]]:
        return [list(range(len(p.draft_tokens))) for p in proposals]

    def observe(self, seq, key: int, drafted: int, accepted: int) -> None:
        pass

    def observe_branches(self, parents: list[int], path: list[int]) -> None:
        pass
