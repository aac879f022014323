"""Medusa proposer: heads on the target's last hidden state (medusa_head.py) guess the next few tokens at once.

The engine hands over the final-norm input of every token the target prefilled or verified; the
proposer keeps each sequence's newest. After a verify step that is the one before the sequence's
last token (whose own features come with the next forward): from it the target gave the last
token, and head i guesses the token i + 1 after it. One head call per step drafts for the whole
batch; the proposer has no KV cache, so there is nothing to roll back.

A chain is each head's top token (sampled: a draw from each head's q). A tree expands nodes best
first by their path's draft probability (the product over its heads), each expanded node getting
the top `branching` tokens of the next head (or the children a static TreeShape lists; sampled:
draws without replacement, as `draft_children` makes them), until the budget of nodes is spent.
Which children a node has never depends on their own draws, and every node carries the q it was
drawn from, so rejection sampling stays exact."""

from __future__ import annotations

import heapq

import torch

from specfleet_api.enums import Method
from specfleet_api.limits import MAX_DRAFT_NODES

from ..medusa_head import MedusaHead
from ..model import Transformer
from .base import Capabilities, DraftStats, DraftVocab, Proposal, SequenceView, TreeShape
from .draft_model import draft_children


class MedusaProposer:
    name = Method.MEDUSA.value

    def __init__(self, head: MedusaHead, target: Transformer):
        self.head = head
        self.vocab = DraftVocab(head.draft_vocab, target.args.vocab_size)  # the heads score their own columns
        self.features: dict[int, tuple[int, torch.Tensor]] = {}  # per sequence: (position, its final-norm input)
        # one head call whatever the draft's length: draft the most, then trim by acceptance
        self.capabilities = Capabilities(cheap=True, trees=True, shapes=True,
                                         target_layers=(target.args.n_layers - 1,), draft_stats=True)

    def observe_features(self, seq: SequenceView, start: int, feats: torch.Tensor) -> None:
        self.features[seq.seq_id] = (start + feats.shape[0] - 1, feats[-1].clone())  # not the whole forward's

    def ready(self, seq: SequenceView) -> bool:
        """Whether the heads can draft for `seq`: the features of the position before its last token are in."""
        held = self.features.get(seq.seq_id)
        return held is not None and held[0] == len(seq.tokens) - 2

    def propose(self, seqs: list[SequenceView], ks: list[int], branching: list[int] | None = None,
                shape: TreeShape | None = None) -> list[Proposal]:
        ks = [min(k, self.head.config.heads) if k > 0 and self.ready(s) else 0 for s, k in zip(seqs, ks)]
        active = [i for i, k in enumerate(ks) if k > 0]
        out = [Proposal([], None) for _ in seqs]
        if not active:
            return out
        hidden = torch.stack([self.features[seqs[i].seq_id][1] for i in active])
        with torch.inference_mode():  # [B, heads, V]: one call for every sequence and head
            logits = self.head(hidden.to(self.head.device), max(ks))  # over the draft vocabulary
        for row, i in zip(logits, active):
            width = branching[i] if branching is not None else 1
            tree = width > 1 or shape is not None
            budget = (len(shape.paths) if shape is not None else width + (ks[i] - 1) * width * width) if tree else ks[i]
            out[i] = self._expand(seqs[i], row, ks[i], width, shape if tree else None, min(budget, MAX_DRAFT_NODES),
                                  tree, self.vocab)
        return out

    @staticmethod
    def _expand(seq: SequenceView, rows: torch.Tensor, depth: int, width: int, shape: TreeShape | None, budget: int,
                tree: bool, vocab: DraftVocab) -> Proposal:
        """Nodes best first by path log-prob: each expanded node at depth d gets its children
        from head d (`rows[d]`), all at once, while the budget lasts. Siblings keep their drawing
        order; a node's children come after it."""
        tokens: list[int] = []
        parents: list[int] = []
        qs: list = []
        told: list = []
        frontier = [(0.0, 0, -1, 0, ())]  # (-path log-prob, tie, node, depth, rank path)
        tie = 0
        while frontier and len(tokens) < budget:
            neg, _, node, d, path = heapq.heappop(frontier)
            n = width if shape is None else shape.children(path)
            n = min(n, budget - len(tokens)) if d < depth else 0
            for r, (tok, q, logq, st) in enumerate(draft_children(seq, rows[d], n, vocab) if n else []):
                tokens.append(tok)
                parents.append(node)
                qs.append(q)
                told.append(st)
                tie += 1
                heapq.heappush(frontier, (neg - logq, tie, len(tokens) - 1, d + 1, path + (r,)))
        probs = torch.stack(qs) if qs and qs[0] is not None else None
        return Proposal(tokens, probs, parents=parents if tree else None, stats=DraftStats.of(told))

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        pass  # no cache: the next features replace the held ones

    def release(self, seq: SequenceView) -> None:
        self.features.pop(seq.seq_id, None)
