"""Draft proposers, one file each, all with `propose(seqs, ks) -> list[Proposal]`."""

from .base import Proposal, Proposer, SequenceView
from .ngram import NgramProposer, ngram_propose

__all__ = ["Proposal", "Proposer", "SequenceView", "NgramProposer", "ngram_propose"]
