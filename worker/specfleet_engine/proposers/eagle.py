"""EAGLE proposer: a learned head (draft_head.py) drafts from the target's own features.

The engine hands over the features of every token the target prefilled or verified (the forwards
it ran anyway: no second target forward). The head's cache holds one row per position t whose
features are known: (the target's features at t, the token at t + 1), which predicts the token at
t + 2. To draft, it catches up on the rows it has not seen, then goes on from its own output (its
hidden state and the token it drafted). Those draft rows are dropped after verification: the next
step's catch-up writes the accepted positions again, from the target's features.

Chains and trees (EAGLE-2's expansion of the best nodes by cumulative draft probability, or a
static shape) come from `DraftModelProposer`: only what a row reads besides its token differs."""

from __future__ import annotations

import torch

from specfleet_api.enums import Method

from ..draft_head import EagleHead
from ..model import Transformer
from .base import Capabilities, DraftVocab, SequenceView
from .draft_model import DraftModelProposer


class EagleProposer(DraftModelProposer):
    name = Method.EAGLE.value

    def __init__(self, head: EagleHead, target: Transformer, max_kv_tokens: int = 32768, block_size: int = 16):
        super().__init__(head, max_kv_tokens, block_size)  # the head is the draft model: one layer, its cache
        self.head = head
        self.embeddings = target.tok_embeddings  # the target's, shared
        self.vocab = DraftVocab(head.draft_vocab, target.args.vocab_size)  # the head scores its own columns
        # per sequence: (the position of the first row, the fused features [n, dim]) the head has
        # not read yet
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}
        self.capabilities = Capabilities(cheap=False, trees=True, shapes=True, draft_stats=True,
                                         target_layers=tuple(head.config.feature_layers))

    # -- the target's features --------------------------------------------------------------

    def observe_features(self, seq: SequenceView, start: int, feats: torch.Tensor) -> None:
        with torch.inference_mode():
            fused = self.head.fused(feats)
        held = self.pending.get(seq.seq_id)
        if held is not None and held[0] + held[1].shape[0] == start:
            self.pending[seq.seq_id] = (held[0], torch.cat([held[1], fused]))
        else:  # a gap (or the first): what came before cannot be read
            self.pending[seq.seq_id] = (start, fused)

    def ready(self, seq: SequenceView) -> bool:
        """Whether the head can draft for `seq`: it holds the features of every position from its
        cache's end to the one before the last token."""
        held = self.pending.get(seq.seq_id)
        bt = self.tables.get(seq.seq_id)
        have = bt.num_tokens if bt is not None else 0
        need_to = len(seq.tokens) - 1  # positions have .. need_to - 1
        return have < need_to and held is not None and held[0] <= have and held[0] + held[1].shape[0] >= need_to

    # -- what `DraftModelProposer` asks of the model --------------------------------------------

    def _catch_up_inputs(self, seq: SequenceView) -> list[int]:
        # rows t = have .. len - 2 read the token at t + 1
        return seq.tokens[self.tables[seq.seq_id].num_tokens + 1:]

    def _catch_up_context(self, group: list[SequenceView], inputs: list[list[int]]) -> torch.Tensor:
        rows = []
        for s, inp in zip(group, inputs):
            first, fused = self.pending[s.seq_id]
            have = self.tables[s.seq_id].num_tokens
            rows.append(fused[have - first:have - first + len(inp)])
            # keep what the next catch-up reads: positions from len - 1 on (none yet)
            self.pending[s.seq_id] = (have + len(inp), fused[have - first + len(inp):])
        return torch.cat(rows)

    def _run(self, tokens: torch.Tensor, meta, rows: torch.Tensor | None, context: torch.Tensor | None):
        with torch.inference_mode():
            emb = self.embeddings(tokens.to(self.embeddings.weight.device))
            logits, hidden = self.head(emb, context, meta, self.cache.layers, rows)
            return logits, hidden

    # -- drafting ----------------------------------------------------------------------------

    def propose(self, seqs, ks, branching=None, shape=None):
        ks = [k if k > 0 and self.ready(s) else 0 for s, k in zip(seqs, ks)]
        return super().propose(seqs, ks, branching, shape)

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        # the draft rows read the head's own features: drop them all, accepted or not
        self.slots.pop(seq.seq_id, None)
        bt = self.tables.get(seq.seq_id)
        if bt is not None:
            bt.truncate(min(bt.num_tokens, self.base.get(seq.seq_id, bt.num_tokens), max(0, num_valid - 1)))

    def release(self, seq: SequenceView) -> None:
        self.pending.pop(seq.seq_id, None)
        super().release(seq)
