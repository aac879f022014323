"""Independent draft model proposer: a smaller model of the same tokenizer drafts k tokens
autoregressively in its own paged KV cache; its distribution q goes to rejection sampling."""

from __future__ import annotations

import torch

from specfleet_api.enums import Method

from ..kv_cache import BlockTable, PagedKVCache, batch_metadata
from ..model import Transformer
from ..sampling import logits_to_probs, sample_from
from .base import Proposal, SequenceView


class TokenizerMismatch(ValueError):
    pass


class DraftModelProposer:
    name = Method.DRAFT_MODEL.value
    cheap = False

    def __init__(self, model: Transformer, max_kv_tokens: int = 32768, block_size: int = 16):
        self.model = model
        self.cache = PagedKVCache.for_model(model.args, max_kv_tokens, block_size, dtype=model.dtype)
        self.tables: dict[int, BlockTable] = {}

    @staticmethod
    def check_tokenizers(target, draft) -> None:
        """The draft must speak the target's token ids: same vocabulary, same ids."""
        if target.hf.get_vocab() != draft.hf.get_vocab():
            raise TokenizerMismatch(
                "the draft model's tokenizer differs from the target's; a draft model must share the "
                "target's vocabulary (same tokens, same ids)"
            )

    def _forward(self, seqs: list[SequenceView], inputs: list[list[int]]) -> torch.Tensor:
        tokens, meta, last = batch_metadata([self.tables[s.seq_id] for s in seqs], inputs)
        with torch.inference_mode():
            return self.model(tokens, meta, self.cache.layers, last)  # [B, V]

    def _pick(self, seqs: list[SequenceView], logits: torch.Tensor):
        tokens, probs = [], []
        for seq, row in zip(seqs, logits):
            if seq.params.greedy:
                tokens.append(int(row.argmax()))
                probs.append(None)
            else:
                q = logits_to_probs(row[None], seq.params)[0]
                tokens.append(int(sample_from(q[None], seq.generator)))
                probs.append(q)
        return tokens, probs

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Proposal]:
        active = [(s, k) for s, k in zip(seqs, ks) if k > 0]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        qs: dict[int, list] = {s.seq_id: [] for s in seqs}
        if active:
            group = [s for s, _ in active]
            # catch up: feed every token the draft has not seen (at least the newest one)
            inputs = []
            for s in group:
                bt = self.tables.setdefault(s.seq_id, BlockTable(self.cache))
                inputs.append(s.tokens[bt.num_tokens:])
            logits = self._forward(group, inputs)
            want = dict((s.seq_id, k) for s, k in active)
            while True:
                toks, probs = self._pick(group, logits)
                for s, t, q in zip(group, toks, probs):
                    drafts[s.seq_id].append(t)
                    qs[s.seq_id].append(q)
                group = [s for s in group if len(drafts[s.seq_id]) < want[s.seq_id]]
                if not group:
                    break
                logits = self._forward(group, [[drafts[s.seq_id][-1]] for s in group])
        out = []
        for s in seqs:
            q = qs[s.seq_id]
            probs = torch.stack(q) if q and q[0] is not None else None
            out.append(Proposal(drafts[s.seq_id], probs))
        return out

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        bt = self.tables.get(seq.seq_id)
        if bt is not None and bt.num_tokens > num_valid:
            bt.truncate(num_valid)

    def release(self, seq: SequenceView) -> None:
        bt = self.tables.pop(seq.seq_id, None)
        if bt is not None:
            bt.free()
