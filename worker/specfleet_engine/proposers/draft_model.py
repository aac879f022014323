"""Independent draft model proposer: a smaller model of the same tokenizer drafts k tokens
autoregressively in its own paged KV cache; its distribution q goes to rejection sampling."""

from __future__ import annotations

import torch

from specfleet_api.enums import Method

from ..kv_cache import BlockTable, PagedKVCache, batch_metadata
from ..model import Transformer
from ..sampling import logits_to_probs, sample_from
from .base import WHOLE_VOCAB, Capabilities, DraftStats, DraftVocab, Proposal, SequenceView, TreeShape, node_stats


class TokenizerMismatch(ValueError):
    pass


def draft_children(seq: SequenceView, row: torch.Tensor, width: int, vocab: DraftVocab = WHOLE_VOCAB
                   ) -> list[tuple[int, torch.Tensor | None, float, tuple[float, float, float]]]:
    """A node's `width` children from its draft logits `row` [V] (over `vocab`'s columns where
    the draft scores a reduced vocabulary): (token, the q it was drawn from over the target's
    vocabulary, its draft log-prob, its `node_stats`).

    Greedy: the top tokens. Sampled: draws without replacement (Gumbel top-k: the order is
    that of drawing one by one), each with q renormalised over what earlier siblings left."""
    if seq.params.greedy:
        logp = torch.log_softmax(row, dim=-1)
        top = torch.topk(logp, width)
        probs = logp.exp()
        return [(vocab.token(int(t)), None, float(v), node_stats(probs, int(t), r))
                for r, (v, t) in enumerate(zip(top.values, top.indices))]
    q = logits_to_probs(row[None], seq.params)[0]
    keys = q.log() - torch.empty_like(q).exponential_(generator=seq.generator).log()
    order = torch.topk(keys, min(width, int((q > 0).sum()))).indices.tolist()
    out, left = [], q.clone()
    for r, t in enumerate(order):
        cond = left / left.sum()
        out.append((vocab.token(t), vocab.expand(cond), float(q[t].log()), node_stats(q, t, r)))
        left[t] = 0.0
    return out


class DraftModelProposer:
    name = Method.DRAFT_MODEL.value
    # forwards cost: not cheap; a tree of the top tokens (or draws) at each level, or the children
    # a static TreeShape lists at each node; every node with what its draft distribution said
    capabilities = Capabilities(cheap=False, trees=True, shapes=True, draft_stats=True)

    def __init__(self, model: Transformer, max_kv_tokens: int = 32768, block_size: int = 16):
        self.model = model
        self.cache = PagedKVCache.for_model(model.args, max_kv_tokens, block_size, dtype=model.dtype,
                                            device=getattr(model, "device", "cpu"))
        self.tables: dict[int, BlockTable] = {}
        self.base: dict[int, int] = {}  # tokens in the draft's cache before this step's draft
        self.slots: dict[int, dict[int, int]] = {}  # a tree being drafted: node -> its position in the table
        self.vocab = WHOLE_VOCAB  # what the columns of `_run`'s logits are (a head: its reduced vocabulary)

    @staticmethod
    def check_tokenizers(target, draft) -> None:
        """The draft must speak the target's token ids: same vocabulary, same ids."""
        if target.hf.get_vocab() != draft.hf.get_vocab():
            raise TokenizerMismatch(
                "the draft model's tokenizer differs from the target's; a draft model must share the "
                "target's vocabulary (same tokens, same ids)"
            )

    # -- what a subclass drafting with more than tokens (an EAGLE head: features) replaces ------

    def _run(self, tokens: torch.Tensor, meta, rows: torch.Tensor | None, context: torch.Tensor | None):
        """One draft forward: the logits of `rows` (all without) [R, V] over the target's vocabulary
        (over `self.vocab`'s columns),
        and what each input row hands its children besides its token ([T, ...], or None: nothing).
        `context`: what each input row reads besides its token (its parent's), or None."""
        with torch.inference_mode():
            return self.model(tokens, meta, self.cache.layers, rows), None

    def _catch_up_context(self, group: list[SequenceView], inputs: list[list[int]]) -> torch.Tensor | None:
        """What the catch-up rows read besides their tokens (None: nothing)."""
        return None

    # ---------------------------------------------------------------------------------------

    def _forward(self, seqs: list[SequenceView], inputs: list[list[int]], context: torch.Tensor | None = None):
        """Each sequence's last row: logits [B, V] and what it hands on (None or [B, ...])."""
        tokens, meta, last = batch_metadata([self.tables[s.seq_id] for s in seqs], inputs)
        logits, out = self._run(tokens, meta, last, context)
        return logits, (None if out is None else out.index_select(0, last.to(out.device)))

    def _pick(self, seqs: list[SequenceView], logits: torch.Tensor):
        """Each sequence's next chain token: (tokens, their q rows or None (greedy), their node_stats)."""
        tokens, probs, stats = [], [], []
        v = self.vocab
        for seq, row in zip(seqs, logits):
            if seq.params.greedy:
                t = int(row.argmax())
                probs.append(None)
                stats.append(node_stats(torch.softmax(row.float(), dim=-1), t))
            else:
                q = logits_to_probs(row[None], seq.params)[0]
                t = int(sample_from(q[None], seq.generator))
                probs.append(v.expand(q))
                stats.append(node_stats(q, t))
            tokens.append(v.token(t))
        return tokens, probs, stats

    def propose(self, seqs: list[SequenceView], ks: list[int], branching: list[int] | None = None,
                shape: TreeShape | None = None) -> list[Proposal]:
        if branching is not None and any(b > 1 for b, k in zip(branching, ks) if k > 0):
            return self._propose_trees(seqs, ks, branching, shape)
        active = [(s, k) for s, k in zip(seqs, ks) if k > 0]
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        qs: dict[int, list] = {s.seq_id: [] for s in seqs}
        told: dict[int, list] = {s.seq_id: [] for s in seqs}
        if active:
            group = [s for s, _ in active]
            logits, handed = self._catch_up(group)
            want = dict((s.seq_id, k) for s, k in active)
            while True:
                toks, probs, stats = self._pick(group, logits)
                for s, t, q, st in zip(group, toks, probs, stats):
                    drafts[s.seq_id].append(t)
                    qs[s.seq_id].append(q)
                    told[s.seq_id].append(st)
                going = [i for i, s in enumerate(group) if len(drafts[s.seq_id]) < want[s.seq_id]]
                if not going:
                    break
                context = None if handed is None else handed[going]
                group = [group[i] for i in going]
                logits, handed = self._forward(group, [[drafts[s.seq_id][-1]] for s in group], context)
        out = []
        for s in seqs:
            q = qs[s.seq_id]
            probs = torch.stack(q) if q and q[0] is not None else None
            out.append(Proposal(drafts[s.seq_id], probs, stats=DraftStats.of(told[s.seq_id])))
        return out

    def _catch_up_inputs(self, seq: SequenceView) -> list[int]:
        """The tokens the draft has not seen (at least the newest one)."""
        return seq.tokens[self.tables[seq.seq_id].num_tokens:]

    def _catch_up(self, group: list[SequenceView]):
        """Feeds what the draft has not seen: each sequence's last row's logits [B, V] and what
        it hands on (see `_forward`)."""
        for s in group:
            self.tables.setdefault(s.seq_id, BlockTable(self.cache))
        inputs = [self._catch_up_inputs(s) for s in group]
        out = self._forward(group, inputs, self._catch_up_context(group, inputs))
        for s in group:
            self.base[s.seq_id] = self.tables[s.seq_id].num_tokens
        return out

    def _children(self, seq: SequenceView, row: torch.Tensor,
                  width: int) -> list[tuple[int, torch.Tensor | None, float, tuple[float, float, float]]]:
        return draft_children(seq, row, width, self.vocab)

    def _propose_trees(self, seqs: list[SequenceView], ks: list[int], branching: list[int],
                       shape: TreeShape | None = None) -> list[Proposal]:
        """Trees level by level: every node kept at a level gets `branching` children; the
        `branching` best of them by their path's draft log-prob are expanded at the next level
        (one draft forward per level, their K/V under a tree mask). With a static shape, a node
        gets the children the shape lists and those with children in it are expanded. Which
        children exist never depends on their own sampled values, so rejection sampling stays exact."""
        trees = {s.seq_id: ([], [], [], []) for s in seqs}  # tokens, parents, q rows, node_stats
        active = [(s, k, b) for s, k, b in zip(seqs, ks, branching) if k > 0]
        if active:
            group = [s for s, _, _ in active]
            rows, handed = self._catch_up(group)
            # (node, score, logits, rank path, what the node's row hands its children)
            frontier = {s.seq_id: [(-1, 0.0, rows[i], (), None if handed is None else handed[i])]
                        for i, s in enumerate(group)}
            depth = 0
            want = {s.seq_id: (k, b) for s, k, b in active}
            while group:
                depth += 1
                expand: dict[int, list[tuple[int, float, tuple[int, ...], object]]] = {}
                for s in group:
                    tokens, parents, qrows, told = trees[s.seq_id]
                    k, width = want[s.seq_id]
                    born = []
                    for node, score, row, path, hand in frontier[s.seq_id]:
                        n = width if shape is None else shape.children(path)
                        for r, (tok, q, logq, st) in enumerate(self._children(s, row, n) if n else []):
                            tokens.append(tok)
                            parents.append(node)
                            qrows.append(q)
                            told.append(st)
                            born.append((len(tokens) - 1, score + logq, path + (r,), hand))
                    if depth >= k:
                        expand[s.seq_id] = []
                    elif shape is None:
                        expand[s.seq_id] = sorted(born, key=lambda x: -x[1])[:width]
                    else:
                        expand[s.seq_id] = [b for b in born if shape.children(b[2])]
                group = [s for s in group if expand[s.seq_id]]
                if not group:
                    break
                logits, handed = self._forward_tree(group, [expand[s.seq_id] for s in group], trees)
                at = 0
                for s in group:
                    nodes = expand[s.seq_id]
                    frontier[s.seq_id] = [(n, sc, logits[at + i], path, None if handed is None else handed[at + i])
                                          for i, (n, sc, path, _) in enumerate(nodes)]
                    at += len(nodes)
        out = []
        for s in seqs:
            tokens, parents, qrows, told = trees[s.seq_id]
            probs = torch.stack(qrows) if qrows and qrows[0] is not None else None
            out.append(Proposal(tokens, probs, parents=parents, stats=DraftStats.of(told)) if tokens
                       else Proposal([], None))
        return out

    def _forward_tree(self, group: list[SequenceView], expand: list[list[tuple[int, float, tuple[int, ...], object]]],
                      trees):
        """One draft forward over the nodes to expand; each sees the prefix, its ancestors
        (written at earlier levels) and itself, and reads what its parent's row handed on.
        Returns their logits in order and what their rows hand on (None: nothing)."""
        tables = [self.tables[s.seq_id] for s in group]
        inputs = [[trees[s.seq_id][0][n] for n, *_ in nodes] for s, nodes in zip(group, expand)]
        for s, nodes in zip(group, expand):  # where each node's K/V lands: the next free slot
            slot_of = self.slots.setdefault(s.seq_id, {})
            for i, (n, *_) in enumerate(nodes):
                slot_of[n] = self.tables[s.seq_id].num_tokens + i
        tokens, meta, _ = batch_metadata(tables, inputs)
        for b, (s, nodes) in enumerate(zip(group, expand)):
            base, parents, slot_of = self.base[s.seq_id], trees[s.seq_id][1], self.slots[s.seq_id]
            S = meta.context_slots[b].shape[0]
            mask = torch.zeros(len(nodes), S, dtype=torch.bool)
            mask[:, :base] = True
            pos = []
            for i, (n, *_) in enumerate(nodes):
                depth, a = 0, n
                while a >= 0:
                    mask[i, slot_of[a]] = True
                    a, depth = parents[a], depth + 1
                pos.append(base - 1 + depth)
            meta.masks[b] = mask
            meta.positions[meta.cu_seqlens[b]:meta.cu_seqlens[b + 1]] = torch.tensor(pos)
        hands = [h for nodes in expand for (*_, h) in nodes]
        context = None if hands[0] is None else torch.stack(hands)
        return self._run(tokens, meta, None, context)  # [rows, V]

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        bt = self.tables.get(seq.seq_id)
        if self.slots.pop(seq.seq_id, None) is not None:  # a tree's nodes sit off the path: drop them all
            num_valid = min(num_valid, self.base[seq.seq_id])
        if bt is not None and bt.num_tokens > num_valid:
            bt.truncate(num_valid)

    def release(self, seq: SequenceView) -> None:
        self.slots.pop(seq.seq_id, None)
        self.base.pop(seq.seq_id, None)
        bt = self.tables.pop(seq.seq_id, None)
        if bt is not None:
            bt.free()
