"""Draft proposers, one file each, all with `propose(seqs, ks) -> list[Proposal]`, and the one
registry from the API's draft methods to them."""

from __future__ import annotations

from specfleet_api.enums import SPECULATIVE_METHODS, Method

from .base import Capabilities, DraftStats, Proposal, Proposer, SequenceView, TreeShape
from .mixed import MixedProposer
from .ngram import NgramProposer, ngram_propose


def proposer_class(method: str) -> type:
    """The class that proposes drafts for `method` (a served speculative method)."""
    if method == Method.NGRAM:
        return NgramProposer
    if method == Method.DRAFT_MODEL:
        from .draft_model import DraftModelProposer  # its model comes from the factory

        return DraftModelProposer
    if method == Method.EAGLE:
        from .eagle import EagleProposer  # its head comes from the factory

        return EagleProposer
    if method == Method.MEDUSA:
        from .medusa import MedusaProposer  # its heads come from the factory

        return MedusaProposer
    raise ValueError(f"no proposer for draft method {method!r}; proposers exist for {', '.join(SPECULATIVE_METHODS)}")


def default_proposers(ngram_corpus_tokens: int = 0) -> dict[str, Proposer]:
    """The proposers that need no model of their own (today: n-gram), keyed by method name;
    ngram_corpus_tokens: engine.json's draft.ngram.corpusTokens."""
    return {Method.NGRAM.value: NgramProposer(corpus_tokens=ngram_corpus_tokens)}


__all__ = ["Capabilities", "DraftStats", "MixedProposer", "NgramProposer", "Proposal", "Proposer", "SequenceView",
           "TreeShape", "default_proposers", "ngram_propose", "proposer_class"]
