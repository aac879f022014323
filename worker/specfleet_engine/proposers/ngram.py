"""N-gram (prompt lookup) proposer: drafts the continuation of the latest earlier occurrence of
the context's last n tokens. No parameters, no model; q is one-hot on each draft token.

With a corpus (`corpus_tokens` > 0) the search also covers the recent requests this proposer
finished, prompt and output (SGLang's n-gram trie and suffix decoding do the same): a small model
answers alike across requests ("Here is a", its list layout, its closing lines), which a request's
own context cannot offer early on. The corpus is searched as text before the context, so the
context's own matches count as the latest; a continuation never crosses from one request into the
next. Lossless either way; a shared corpus lets one request's speed depend on another's text (as a
shared prefix cache does), so it is a per-deployment choice.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from specfleet_api.enums import Method

from .base import Proposal, SequenceView


SEP = -1  # ends each request in a corpus; never a token, so no match spans it


def _until_sep(segment: np.ndarray) -> np.ndarray:
    cut = np.flatnonzero(segment < 0)
    return segment[:cut[0]] if cut.size else segment


def ngram_match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[np.ndarray, int]:
    """`ngram_propose`'s draft and the length n of the match it came from (0: none)."""
    L = tokens.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = tokens[L - n:]
        # candidate starts i with i + n < L, so that a continuation exists
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        hits = hits[tokens[hits + n] >= 0]  # a match at a corpus request's end continues nowhere
        if hits.size == 1:
            start = int(hits[0]) + n
            return _until_sep(tokens[start:start + k]).astype(np.int64), n
        if hits.size:
            return _vote(tokens, hits + n, k), n
    return np.empty(0, dtype=np.int64), 0


def _vote(tokens: np.ndarray, starts: np.ndarray, k: int) -> np.ndarray:
    """The continuation most occurrences agree on, token by token (ties: the latest occurrence).

    After "of the", the phrase the text continued with most often is a better guess than the
    one it continued with last."""
    L = tokens.shape[0]
    draft = []
    for j in range(k):
        starts = starts[starts + j < L]
        starts = starts[tokens[starts + j] >= 0]
        if starts.size == 0:
            break
        nxt = tokens[starts + j]
        if starts.size == 1:
            draft.extend(_until_sep(tokens[starts[0] + j:starts[0] + k]).tolist())
            break
        values, counts = np.unique(nxt, return_counts=True)
        best = values[counts == counts.max()]
        tok = nxt[np.flatnonzero(np.isin(nxt, best))[-1]]  # starts ascend: the latest of the best
        draft.append(int(tok))
        starts = starts[nxt == tok]
    return np.asarray(draft, dtype=np.int64)


def ngram_tree(tokens: np.ndarray, min_n: int, max_n: int, k: int, branching: int,
               max_nodes: int = 64, max_matches: int = 32) -> tuple[list[int], list[int], int]:
    """A draft tree from the distinct continuations of every earlier match of the context's tail.

    Matches of the longest n come first, then those of shorter n (each n's latest `max_matches`);
    their continuations (up to k tokens, cut at the context's end) are merged into a trie. Each
    node's children are ranked by the longest match through them, then by how many continuations
    share them, then by recency, and the best `branching` are kept; nodes are laid out depth first,
    rank 0 first, so the tree's first nodes are the chain `ngram_match` drafts. At most max_nodes.
    Returns (tokens, parents, n of the longest match; 0: nothing matched).

    >>> ngram_tree(np.array([1, 2, 8, 3, 1, 2, 9, 4, 1, 2]), 1, 2, k=2, branching=2)
    ([9, 4, 8, 3], [-1, 0, -1, 2], 2)
    """
    L = tokens.shape[0]
    starts: list[tuple[int, int]] = []  # (start of a continuation, n of its match)
    best_n = 0
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))[-max_matches:]
        if hits.size:
            best_n = best_n or n
            starts += [(int(h) + n, n) for h in hits]
    if not starts or k <= 0:
        return [], [], 0
    # trie: node -> {token: child}; per node (longest n, count, latest start)
    children: list[dict[int, int]] = [{}]
    score: list[list[int]] = [[0, 0, 0]]
    node_token: list[int] = [-1]
    for start, n in starts:
        node = 0
        for tok in tokens[start:start + k].tolist():
            if tok < 0:  # a corpus request's end
                break
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = children[node][tok] = len(children)
                children.append({})
                score.append([n, 0, start])
                node_token.append(tok)
            s = score[nxt]
            s[0], s[1], s[2] = max(s[0], n), s[1] + 1, max(s[2], start)
            node = nxt
    out_tokens: list[int] = []
    out_parents: list[int] = []

    def visit(node: int, parent: int) -> None:
        ranked = sorted(children[node].values(), key=lambda c: score[c], reverse=True)[:branching]
        for child in ranked:
            if len(out_tokens) >= max_nodes:
                return
            out_tokens.append(node_token[child])
            out_parents.append(parent)
            visit(child, len(out_tokens) - 1)

    visit(0, -1)
    return out_tokens, out_parents, best_n


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Draft up to k tokens by matching the last n tokens (n from max_n down to min_n).

    Among several earlier occurrences of the longest match, the continuation most of them share
    wins, token by token (ties: the latest); the draft is cut at the context's end.

    >>> ngram_propose(np.array([5, 6, 7, 9, 5, 6]), min_n=1, max_n=3, k=3)
    array([7, 9, 5])
    >>> ngram_propose(np.array([1, 2, 8, 1, 2, 9, 1, 2, 8, 1, 2]), min_n=1, max_n=2, k=2)  # 8 twice, 9 once
    array([8, 1])
    >>> ngram_propose(np.array([1, 2, 3]), min_n=1, max_n=2, k=4)   # nothing repeats
    array([], dtype=int64)
    """
    return ngram_match(tokens, min_n, max_n, k)[0]


class NgramProposer:
    name = Method.NGRAM.value
    cheap = True
    trees = True  # propose() takes branching: distinct continuations become a tree

    def __init__(self, min_n: int = 1, max_n: int = 4, corpus_tokens: int = 0):
        """corpus_tokens: how many tokens of recently finished requests to search besides each
        request's own context (0: none, the classic prompt lookup)."""
        if corpus_tokens < 0:
            raise ValueError(f"corpus_tokens must be >= 0, got {corpus_tokens}")
        self.min_n, self.max_n, self.corpus_tokens = min_n, max_n, corpus_tokens
        self._docs: deque[np.ndarray] = deque()  # each request's tokens, then SEP; oldest first
        self._held = 0
        self.corpus = np.empty(0, dtype=np.int64)

    def propose(self, seqs: list[SequenceView], ks: list[int], branching: list[int] | None = None) -> list[Proposal]:
        out = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            width = branching[i] if branching is not None else 1
            if k <= 0:
                out.append(Proposal([], None))
                continue
            tokens = seq.token_array()
            if self.corpus.size:
                tokens = np.concatenate([self.corpus, tokens])
            if width > 1:
                draft, parents, n = ngram_tree(tokens, self.min_n, self.max_n, k, width)
                out.append(Proposal(draft, None, key=n, parents=parents))
            else:
                chain, n = ngram_match(tokens, self.min_n, self.max_n, k)
                out.append(Proposal(chain.tolist(), None, key=n))  # longer matches draft better
        return out

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        pass

    def release(self, seq: SequenceView) -> None:
        """A finished (or aborted) request joins the corpus; the oldest leave it past corpus_tokens."""
        if not self.corpus_tokens:
            return
        tokens = seq.token_array()
        doc = np.append(tokens[max(0, tokens.size - self.corpus_tokens + 1):], SEP).astype(np.int64)
        self._docs.append(doc)
        self._held += doc.size
        while self._held > self.corpus_tokens:
            self._held -= self._docs.popleft().size
        self.corpus = np.concatenate(self._docs) if self._docs else np.empty(0, dtype=np.int64)
