"""Mixed drafts: the n-gram drafter's continuation and a learned head's (or a draft model's) tree
in one draft, verified in one target forward (`draft.ngram.mix`).

Each step both are asked. Where the context repeats, the n-gram chain is the rank-0 branch from
the root (laid out first: the draft's first `Proposal.ngram` nodes) and the head's tree the rest;
where both propose the same token under the same parent the two nodes are one, their subtrees
merged; each node keeps at most `branching` children, the n-gram's first. Where nothing repeats,
the head's draft as it is. Under a chain cap (branching 1) one branch fits: the n-gram chain where
it matches (the head is not run for that sequence), else the head's chain.

Exact under sampling. The n-gram token g is a function of the context, so its node's q is one-hot
(a dense one-hot row behaves as `has_q` False in rejection sampling: accept with p(g), residual p
without g). The head drew its siblings one by one without replacement (`draft_children`,
Plackett-Luce); with g's node removed from among them (and the last ones cut to the cap), the ones
left are in law draws without replacement from q restricted to tokens other than g (Luce's choice
axiom: a Plackett-Luce ranking with an item deleted is the Plackett-Luce ranking of the rest), so
each one's q row is its head row with g zeroed and renormalised, the q it was drawn from given its
parent and its earlier siblings, as `Proposal.draft_probs` requires. Greedy: any tree is exact.
"""

from __future__ import annotations

import torch

from .base import Capabilities, Proposal, SequenceView, TreeShape


def mix_tree(chain: list[int], tokens: list[int], parents: list[int],
             width: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The n-gram `chain` and a head's tree (`tokens`, `parents`, siblings in try order) as one
    tree, at most `width` children a node: at each node of the chain's path the chain's next token
    first (one node with the head's, if the head has it there), then the head's other children.
    Laid out depth first, rank 0 first, so the chain's nodes come first.

    Returns (tokens, parents, source, excluded): source[i] the head's node that node i is (-1: the
    n-gram's alone); excluded[i] the n-gram token a head node's q must leave out (-1: none).

    >>> # the head drafted 7 and 5 after the root, 6 and 9 after its 5, 8 after its 7
    >>> mix_tree([5, 6], [7, 5, 6, 9, 8], [-1, -1, 1, 1, 0], width=2)
    ([5, 6, 9, 7, 8], [-1, 0, 0, -1, 3], [1, 2, 3, 0, 4], [-1, -1, 6, 5, -1])
    >>> mix_tree([5, 6, 4], [7, 8], [-1, -1], width=2)   # 8, the head's third, is cut by the cap
    ([5, 6, 4, 7], [-1, 0, 1, -1], [-1, -1, -1, 0], [-1, -1, -1, 5])
    """
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    out_tokens: list[int] = []
    out_parents: list[int] = []
    source: list[int] = []
    excluded: list[int] = []

    def visit(head: int | None, at: int | None, parent: int) -> None:
        """The children of a node: `head` the head's node it is (None: not the head's), `at` how
        much of the chain leads to it (None: it is off the chain)."""
        children = kids.get(head, []) if head is not None else []
        g = chain[at] if at is not None and at < len(chain) else None
        order: list[tuple[int | None, int | None, int]] = []  # (head node, chain position, excluded)
        if g is not None:
            order.append((next((c for c in children if tokens[c] == g), None), at + 1, -1))
        order += [(c, None, -1 if g is None else g) for c in children if tokens[c] != g]
        for node, nxt, ex in order[:width]:
            out_tokens.append(g if nxt is not None else tokens[node])
            out_parents.append(parent)
            source.append(-1 if node is None else node)
            excluded.append(ex)
            visit(node, nxt, len(out_tokens) - 1)

    visit(-1, 0, -1)
    return out_tokens, out_parents, source, excluded


def mix(chain: Proposal, head: Proposal, width: int) -> Proposal:
    """A head's draft with the n-gram `chain` as its rank-0 branch (`mix_tree`), each node's q
    row as the module docstring derives: the n-gram's one-hot, a head node's row with its n-gram
    sibling's token zeroed, renormalised. Greedy heads (q None) give q None."""
    if not chain.draft_tokens:
        return head
    if not head.draft_tokens:
        return Proposal(list(chain.draft_tokens), None, chain.key, None, ngram=len(chain.draft_tokens))
    tokens, parents, source, excluded = mix_tree(chain.draft_tokens, head.draft_tokens, head.parent_list(), width)
    probs = None
    if head.draft_probs is not None:
        rows = []
        for i, (src, ex) in enumerate(zip(source, excluded)):
            if i < len(chain.draft_tokens):  # the chain's node, whichever head node it also is: one-hot
                row = torch.zeros_like(head.draft_probs[0])
                row[tokens[i]] = 1.0
            else:
                row = head.draft_probs[src].clone()
                if ex >= 0:
                    row[ex] = 0.0
                    row /= row.sum()
            rows.append(row)
        probs = torch.stack(rows)
    return Proposal(tokens, probs, chain.key, parents, ngram=len(chain.draft_tokens))


class MixedProposer:
    """An n-gram proposer's chains mixed into a head proposer's drafts (module docstring). It
    serves the head's method (`name`); the n-gram proposer may be shared with the `ngram`
    method's (one corpus of finished requests)."""

    def __init__(self, ngram, head):
        self.ngram, self.head = ngram, head
        self.name = head.name
        n, h = ngram.capabilities, head.capabilities
        # the head's cost decides how K is sized; the target's top tokens go to the n-gram side
        # (Token Recycling), its features to the head; a draft the head made alone tells its stats
        # (a K policy that reads them judges it), a mixed one does not (the policy's adaptive choice)
        self.capabilities = Capabilities(cheap=h.cheap, trees=True, shapes=h.shapes, target_top_k=n.target_top_k,
                                         target_layers=h.target_layers, draft_stats=h.draft_stats)

    def propose(self, seqs: list[SequenceView], ks: list[int], branching: list[int] | None = None,
                shape: TreeShape | None = None) -> list[Proposal]:
        widths = branching if branching is not None else [1] * len(seqs)
        chains = self.ngram.propose(seqs, ks)  # the n-gram's best continuation: a chain
        trees = [w > 1 for w in widths]
        # a chain cap holds one branch: where the n-gram matched, the head is not asked
        head_ks = [k if tree or not c.draft_tokens else 0 for k, tree, c in zip(ks, trees, chains)]
        if not any(head_ks):
            heads = [Proposal([], None) for _ in seqs]
        elif branching is not None and any(trees) and self.head.capabilities.trees:
            extra = {"shape": shape} if shape is not None and self.head.capabilities.shapes else {}
            heads = self.head.propose(seqs, head_ks, list(widths), **extra)
        else:
            heads = self.head.propose(seqs, head_ks)
        out = []
        for chain, head, width, tree in zip(chains, heads, widths, trees):
            if not tree and chain.draft_tokens:
                out.append(Proposal(list(chain.draft_tokens), None, chain.key, ngram=len(chain.draft_tokens)))
            else:
                out.append(mix(chain, head, width) if tree else head)
        return out

    def observe_targets(self, seq: SequenceView, tokens: list[int], top) -> None:
        self.ngram.observe_targets(seq, tokens, top)

    def observe_features(self, seq: SequenceView, start: int, feats: torch.Tensor) -> None:
        self.head.observe_features(seq, start, feats)

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        self.ngram.rollback(seq, num_valid)
        self.head.rollback(seq, num_valid)

    def release(self, seq: SequenceView) -> None:
        self.ngram.release(seq)
        self.head.release(seq)
