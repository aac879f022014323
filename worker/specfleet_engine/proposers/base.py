"""What every proposer shares: the same `propose(seqs, ks)` signature, its `Proposal`, and the
`Capabilities` it declares (the engine reads them; it never probes a proposer for attributes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from specfleet_api.enums import TREE_BRANCHING_MAX
from specfleet_api.tree_shape import shape_problems

from ..k_policies.base import sibling_ranks


@dataclass(frozen=True)
class Capabilities:
    """What a proposer can do and what it needs of the target: declared once, as the proposer
    class's (or instance's) `capabilities`, and read by the engine, which refuses a proposer
    without them or with needs it does not meet.

    >>> Capabilities(cheap=True, trees=True)
    Capabilities(cheap=True, trees=True, shapes=False, target_top_k=0, target_layers=(), draft_stats=False)
    """

    # drafting k tokens costs next to nothing (a search): draft the most, then trim by acceptance;
    # False: size the draft before making it (a draft model's forwards cost)
    cheap: bool = False
    trees: bool = False  # propose() takes `branching` (per sequence): it may return a tree
    shapes: bool = False  # propose() also takes `shape`, a static TreeShape, and drafts its children
    # target features it needs:
    # the target's top-k next tokens after each verified token, handed over by
    # `observe_targets(seq, tokens, top)` (0: none); the verify forward computed them anyway
    target_top_k: int = 0
    # the target's residual stream after these layers (an EAGLE head's features), at every token
    # the target verified or prefilled, handed over by `observe_features(seq, start, feats)`:
    # feats [n, len(target_layers) * dim] for the tokens at positions start .. start + n - 1, in
    # order, from the forwards the target ran anyway
    target_layers: tuple[int, ...] = ()
    # what it tells of its drafts: every Proposal with nodes carries `stats` (DraftStats: what the
    # draft distribution said at each node), which the confidence and entropy K policies read;
    # False: no distribution (n-gram), those policies fall back to the adaptive one's choice
    draft_stats: bool = False

    def problems(self) -> list[str]:
        """What this engine cannot serve of them ([]: all of it)."""
        out = []
        if self.shapes and not self.trees:
            out.append("shapes needs trees (a static shape is a tree)")
        if self.target_top_k < 0:
            out.append(f"target_top_k must be >= 0, got {self.target_top_k}")
        if len(set(self.target_layers)) != len(self.target_layers) or any(i < 0 for i in self.target_layers):
            out.append(f"target_layers must be distinct layer indices >= 0, got {list(self.target_layers)}")
        return out

    def layer_problems(self, n_layers: int) -> list[str]:
        """What a target of n_layers cannot hand over ([]: all of it)."""
        past = [i for i in self.target_layers if i >= n_layers]
        return [f"needs the features of layers {past}; the target has {n_layers} layers"] if past else []


@dataclass
class DraftStats:
    """Per draft node, what the draft distribution at its position said: the distribution its
    token was drawn from, before earlier siblings were taken out of it (greedy: the softmax of the
    draft's logits at temperature 1; sampled: the q of the request's temperature, top-k and top-p).

    `prob[i]`: the probability of node i's own token (EAGLE-2's confidence; a path's product is
    its cumulative draft probability). `rank_prob[i]`: the probability of the position's r-th most
    likely token, r node i's sibling rank: what the node's probability would be had it been
    drafted greedily; greedy drafts take the top tokens in order, so there it equals `prob[i]`.
    A sampled node is judged by `rank_prob` because it is known before the node's own draw.
    `entropy[i]`: the entropy of that distribution, in nats (siblings share it).

    >>> DraftStats([0.5, 0.25], [0.5, 0.25], [1.0, 1.0]).subset([1])
    DraftStats(prob=[0.25], rank_prob=[0.25], entropy=[1.0])
    """

    prob: list[float]
    rank_prob: list[float]
    entropy: list[float]

    def subset(self, keep: list[int]) -> "DraftStats":
        return DraftStats([self.prob[i] for i in keep], [self.rank_prob[i] for i in keep],
                          [self.entropy[i] for i in keep])

    @classmethod
    def of(cls, nodes: list[tuple[float, float, float]]) -> "DraftStats":
        """From (prob, rank_prob, entropy) per node."""
        return cls([n[0] for n in nodes], [n[1] for n in nodes], [n[2] for n in nodes])


def node_stats(probs: Tensor, token: int, rank: int = 0) -> tuple[float, float, float]:
    """(prob, rank_prob, entropy) of a node drawn from `probs` [V] (DraftStats).

    >>> node_stats(torch.tensor([0.5, 0.25, 0.25, 0.0]), token=2, rank=1)
    (0.25, 0.25, 1.0397207736968994)
    """
    top = torch.topk(probs, rank + 1).values[rank]
    logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))  # 0 log 0 = 0
    return float(probs[token]), float(top), float(-(probs * logs).sum())


class DraftVocab:
    """A draft that scores a reduced vocabulary (an EAGLE or Medusa head's): the target's token id
    of each of its logit columns. Its nodes are chosen, and described (`node_stats`), over those
    columns, where the tokens off them have probability 0 (the same numbers as over the target's
    vocabulary; a greedy node's choice and stats took 0.25 ms over SmolLM2's head's 4,096 columns
    against 1.7 ms over 49,152, one thread of a 2-core EPYC); only the tokens and the q rows that
    verification reads are mapped to the target's vocabulary.

    `ids` None: the draft scores the target's whole vocabulary (a draft model), nothing to map.

    >>> v = DraftVocab(torch.tensor([5, 2, 7]), size=8)
    >>> v.token(2), v.expand(torch.tensor([0.5, 0.25, 0.25])).tolist()
    (7, [0.0, 0.0, 0.25, 0.0, 0.0, 0.5, 0.0, 0.25])
    >>> WHOLE_VOCAB.token(2), WHOLE_VOCAB.expand(torch.tensor([0.5, 0.5])).tolist()
    (2, [0.5, 0.5])
    """

    def __init__(self, ids: Tensor | None, size: int = 0):
        self.ids, self.size = (None if ids is None else ids.long()), size
        self._tokens = None if ids is None else self.ids.tolist()

    def token(self, column: int) -> int:
        return column if self._tokens is None else self._tokens[column]

    def expand(self, q: Tensor) -> Tensor:
        """A q row over the draft's columns [Vd] -> over the target's vocabulary [V]."""
        return q if self.ids is None else q.new_zeros(self.size).index_copy_(0, self.ids.to(q.device), q)


WHOLE_VOCAB = DraftVocab(None)  # a draft over the target's own vocabulary


@dataclass
class Proposal:
    """A chain or a tree of draft tokens.

    A tree is its nodes in topological order: `parents[i]` is the index of node i's parent, -1
    for a child of the root (the sequence's last token); siblings appear in the order verification
    tries them (rank 0 first). `parents` None is a chain (-1, 0, 1, ...). `draft_probs[i]` is the q
    node i's token was drawn from, given its parent and its earlier siblings (sampling without
    replacement zeroes them out of q), or None for a deterministic proposer (q one-hot). `stats`:
    what the draft distribution said at each node, from a proposer that declares `draft_stats`. A
    mixed draft (proposers/mixed.py) starts with the n-gram drafter's chain: its first `ngram`
    nodes, the rank-0 path from the root."""

    draft_tokens: list[int]  # [n] with n <= the nodes allowed; empty means "nothing worth verifying"
    draft_probs: Tensor | None  # [n, V] the proposer's q, or None when q is one-hot (deterministic)
    key: int = 0  # what kind of draft this is (n-gram: the match length); acceptance is tracked per key
    parents: list[int] | None = None  # None: a chain
    stats: DraftStats | None = None  # per node (Capabilities.draft_stats), None: not told
    ngram: int = 0  # a mixed draft: nodes 0 .. ngram - 1 are the n-gram's chain (0: none, or not mixed)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def parent_list(self) -> list[int]:
        return list(self.parents) if self.parents is not None else list(range(-1, len(self.draft_tokens) - 1))

    def trimmed(self, k: int) -> "Proposal":
        """The first k nodes (a prefix of a topological order is a tree)."""
        probs = self.draft_probs[:k] if self.draft_probs is not None else None
        parents = self.parents[:k] if self.parents is not None else None
        stats = self.stats.subset(list(range(min(k, len(self.draft_tokens))))) if self.stats is not None else None
        return Proposal(self.draft_tokens[:k], probs, self.key, parents, stats=stats, ngram=min(self.ngram, k))

    def subset(self, keep: list[int]) -> "Proposal":
        """The nodes `keep` (ascending; each one's parent kept too), renumbered."""
        if keep == list(range(len(keep))):
            return self.trimmed(len(keep))
        new = {old: i for i, old in enumerate(keep)}
        parents = self.parent_list()
        probs = self.draft_probs[keep] if self.draft_probs is not None else None
        # the chain's kept nodes are a prefix of it (each one's parent is kept): 0 .. m - 1 again
        return Proposal([self.draft_tokens[i] for i in keep], probs, self.key,
                        [-1 if parents[i] < 0 else new[parents[i]] for i in keep],
                        stats=self.stats.subset(keep) if self.stats is not None else None,
                        ngram=sum(i < self.ngram for i in keep))

    def rank_paths(self) -> list[tuple[int, ...]]:
        """Each node's sibling ranks from the root: (0,) the root's first child, (0, 2) the third
        child of that; a static tree shape lists such paths."""
        out: list[tuple[int, ...]] = []
        for p, r in zip(self.parent_list(), sibling_ranks(self.parent_list())):
            out.append((out[p] if p >= 0 else ()) + (r,))
        return out

    def within(self, shape: "TreeShape | None") -> "Proposal":
        """The nodes a static shape lists (all of them without one). A shape is prefix-closed and
        its sibling ranks contiguous, so what is kept is a tree whose ranks are unchanged."""
        if shape is None:
            return self
        keep = [i for i, path in enumerate(self.rank_paths()) if path in shape.paths]
        return self if len(keep) == len(self.draft_tokens) else self.subset(keep)

    def depths(self) -> list[int]:
        """Each node's depth (a child of the root: 1)."""
        out: list[int] = []
        for p in self.parent_list():
            out.append(1 if p < 0 else out[p] + 1)
        return out


@dataclass(frozen=True)
class TreeShape:
    """A static draft tree (Medusa's and EAGLE's "choices", vLLM's speculative_token_tree): the
    paths of sibling ranks a step may verify, at most. The cost-aware policy still picks a budget
    below it.

    >>> s = TreeShape.of([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    >>> s.branching, s.depth, s.children((0,)), s.children((1,)), s.children(())
    (2, 3, 2, 0, 2)
    """

    paths: frozenset[tuple[int, ...]]

    @classmethod
    def of(cls, choices, branching: int = TREE_BRANCHING_MAX, depth: int = 0) -> "TreeShape | None":
        """The shape of a list of paths (None for none) under the caps (depth 0: none); ValueError
        naming a bad path."""
        if not choices:
            return None
        found = shape_problems(choices, branching, depth)
        if found:
            raise ValueError("tree choices: " + "; ".join(found))
        return cls(frozenset(tuple(c) for c in choices))

    @property
    def branching(self) -> int:
        return 1 + max(r for path in self.paths for r in path)

    @property
    def depth(self) -> int:
        return max(map(len, self.paths))

    def children(self, path: tuple[int, ...]) -> int:
        """How many children the node at `path` has in the shape (ranks are contiguous)."""
        n = 0
        while path + (n,) in self.paths:
            n += 1
        return n


class SequenceView(Protocol):
    """What a proposer may read of a sequence."""

    seq_id: int
    tokens: list[int]  # prompt + generated so far
    params: object  # SamplingParams
    generator: torch.Generator | None

    def token_array(self) -> np.ndarray: ...


class Proposer(Protocol):
    name: str
    capabilities: Capabilities

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Proposal]:
        """Draft up to ks[i] tokens for each sequence (ks[i] == 0: none)."""

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        """After verification: only the first num_valid tokens of seq.tokens are final."""

    def release(self, seq: SequenceView) -> None:
        """The sequence finished: free what the proposer holds for it."""

    # with capabilities.trees: propose(seqs, ks, branching: list[int]); with .shapes also
    # shape=TreeShape; with .target_top_k: observe_targets(seq, tokens, top: np.ndarray [n, k]);
    # with .target_layers: observe_features(seq, start: int, feats: Tensor [n, F])
