"""N-gram (prompt lookup) proposer: drafts the continuation of the latest earlier occurrence of
the context's last n tokens. No parameters, no model; q is one-hot on each draft token.

With a corpus (`corpus_tokens` > 0) the search also covers the recent requests this proposer
finished, prompt and output (SGLang's n-gram trie and suffix decoding do the same): a small model
answers alike across requests ("Here is a", its list layout, its closing lines), which a request's
own context cannot offer early on. The corpus is searched as text before the context, so the
context's own matches count as the latest; a continuation never crosses from one request into the
next. Lossless either way; a shared corpus lets one request's speed depend on another's text (as a
shared prefix cache does), so it is a per-deployment choice.

With `recycle` > 0 the proposer also keeps, per request, the target's own top next tokens after
each token it verified (Token Recycling, Luo et al. 2024: the verify forward computes them
anyway), and its trees offer them as siblings of the matches' continuations, and as children
where no match continues. A match's rank-0 continuation is still the chain `ngram_match` drafts
when the matches have one; the target's second and third choices are the alternatives a prompt
lookup cannot offer.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Mapping

import numpy as np
from specfleet_api.enums import Method

from .base import Capabilities, Proposal, SequenceView

SEP = -1  # ends each request in a corpus; never a token, so no match spans it
_MULT = np.random.default_rng(0x5eed).integers(1, 2**62, 64, dtype=np.uint64) | np.uint64(1)  # n-gram hash


def _hash(windows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of token n-grams (wrapping arithmetic; collisions are checked)."""
    return (windows.astype(np.uint64) * _MULT[:windows.shape[-1]]).sum(axis=-1, dtype=np.uint64)


class Corpus:
    """The tokens of recent requests, each followed by SEP, oldest first, at most `capacity`;
    every n-gram that has a continuation is indexed by hash, so a lookup costs a binary search,
    not a scan (a scan of 16k tokens costs about 1 ms a sequence a step on this CPU)."""

    def __init__(self, capacity: int, min_n: int, max_n: int):
        self.capacity, self.ns = capacity, range(min_n, max_n + 1)
        self._docs: deque[np.ndarray] = deque()
        self._held = 0
        self.tokens = np.empty(0, dtype=np.int64)
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def size(self) -> int:
        return self.tokens.size

    def add(self, tokens: np.ndarray) -> None:
        doc = np.append(tokens[max(0, tokens.size - self.capacity + 1):], SEP).astype(np.int64)
        self._docs.append(doc)
        self._held += doc.size
        while self._held > self.capacity:
            self._held -= self._docs.popleft().size
        self.tokens = np.concatenate(self._docs) if self._docs else np.empty(0, dtype=np.int64)
        self._index = {}
        t = self.tokens
        for n in self.ns:
            if t.size <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(t[:-1], n)
            ok = np.flatnonzero((windows >= 0).all(axis=1) & (t[n:] >= 0))  # no SEP in it or right after
            keys = _hash(windows[ok])
            order = np.argsort(keys, kind="stable")  # equal keys keep their positions ascending
            self._index[n] = keys[order], ok[order]

    def find(self, pattern: np.ndarray) -> np.ndarray:
        """Ascending starts of `pattern` in the corpus (each with a token after it)."""
        found = self._index.get(pattern.size)
        if found is None:
            return np.empty(0, dtype=np.int64)
        keys, starts = found
        h = _hash(pattern[None])[0]
        starts = starts[np.searchsorted(keys, h, "left"):np.searchsorted(keys, h, "right")]
        if starts.size:
            same = (self.tokens[starts[:, None] + np.arange(pattern.size)] == pattern).all(axis=1)
            starts = starts[same]
        return starts


def _until_sep(segment: np.ndarray) -> np.ndarray:
    cut = np.flatnonzero(segment < 0)
    return segment[:cut[0]] if cut.size else segment


def _longest(tokens: np.ndarray, max_n: int, corpus: Corpus | None) -> int:
    """The longest n worth trying: an earlier occurrence needs the context to hold n + 1 tokens;
    a corpus occurrence only n."""
    own = tokens.shape[0] - (corpus.size if corpus else 0)
    return min(max_n, own if corpus and corpus.size else own - 1)


def _hits(tokens: np.ndarray, n: int, corpus: Corpus | None) -> np.ndarray:
    """Ascending starts of the earlier occurrences of the last n tokens that have a continuation:
    in the corpus (when `tokens` is the corpus's tokens, then the context), then the context."""
    L, base = tokens.shape[0], corpus.size if corpus else 0
    pattern = tokens[L - n:]
    if L - 1 - base >= n:
        windows = np.lib.stride_tricks.sliding_window_view(tokens[base:L - 1], n)
        own = np.flatnonzero((windows == pattern).all(axis=1)) + base
    else:
        own = np.empty(0, dtype=np.int64)
    return np.concatenate([corpus.find(pattern), own]) if base else own


def _text(context: np.ndarray, corpus: Corpus | None) -> np.ndarray:
    """What the matches are searched in: the corpus's tokens, then the context."""
    return np.concatenate([corpus.tokens, context]) if corpus is not None and corpus.size else context


def ngram_match(context: np.ndarray, min_n: int, max_n: int, k: int,
                corpus: Corpus | None = None) -> tuple[np.ndarray, int]:
    """`ngram_propose`'s draft and the length n of the match it came from (0: none)."""
    tokens = _text(context, corpus)
    for n in range(_longest(tokens, max_n, corpus), min_n - 1, -1):
        hits = _hits(tokens, n, corpus)
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


def _match_starts(tokens: np.ndarray, min_n: int, max_n: int, max_matches: int,
                  corpus: Corpus | None) -> tuple[list[tuple[int, int]], int]:
    """(start of a continuation, n of its match) for the latest `max_matches` matches of each n,
    longest n first, and the longest n that matched (0: none)."""
    starts: list[tuple[int, int]] = []
    best_n = 0
    for n in range(_longest(tokens, max_n, corpus), min_n - 1, -1):
        hits = _hits(tokens, n, corpus)[-max_matches:]
        if hits.size:
            best_n = best_n or n
            starts += [(int(h) + n, n) for h in hits]
    return starts, best_n


class _Trie:
    """The matches' continuations merged: node 0 is the root; per node its children by token and
    a rank key (longest match through it, how many continuations share it, latest start)."""

    def __init__(self, tokens: np.ndarray, starts: list[tuple[int, int]], k: int):
        self.children: list[dict[int, int]] = [{}]
        self.score: list[list[int]] = [[0, 0, 0]]
        self.token: list[int] = [-1]
        for start, n in starts:
            node = 0
            for tok in tokens[start:start + k].tolist():
                if tok < 0:  # a corpus request's end
                    break
                nxt = self.children[node].get(tok)
                if nxt is None:
                    nxt = self.children[node][tok] = len(self.token)
                    self.children.append({})
                    self.score.append([n, 0, start])
                    self.token.append(tok)
                s = self.score[nxt]
                s[0], s[1], s[2] = max(s[0], n), s[1] + 1, max(s[2], start)
                node = nxt

    def ranked(self, node: int) -> list[int]:
        return sorted(self.children[node].values(), key=lambda c: self.score[c], reverse=True)


def ngram_tree(context: np.ndarray, min_n: int, max_n: int, k: int, branching: int,
               max_nodes: int = 64, max_matches: int = 32,
               corpus: Corpus | None = None,
               successors: Mapping[int, np.ndarray] | None = None) -> tuple[list[int], list[int], int]:
    """A draft tree from the distinct continuations of every earlier match of the context's tail.

    Matches of the longest n come first, then those of shorter n (each n's latest `max_matches`);
    their continuations (up to k tokens, cut at the context's end) are merged into a trie. Each
    node's children are ranked by the longest match through them, then by how many continuations
    share them, then by recency, and the best `branching` are kept; nodes are laid out depth first,
    rank 0 first, so the tree's first nodes are the chain `ngram_match` drafts. At most max_nodes.
    With `successors` (token -> the target's top next tokens after it, best first) the tree is
    `recycled_tree`'s instead. Returns (tokens, parents, n of the longest match; 0: nothing matched).

    >>> ngram_tree(np.array([1, 2, 8, 3, 1, 2, 9, 4, 1, 2]), 1, 2, k=2, branching=2)
    ([9, 4, 8, 3], [-1, 0, -1, 2], 2)
    """
    tokens = _text(context, corpus)
    starts, best_n = _match_starts(tokens, min_n, max_n, max_matches, corpus)
    if k <= 0 or not (starts or successors):
        return [], [], 0
    trie = _Trie(tokens, starts, k)
    if successors is not None:
        out_tokens, out_parents = recycled_tree(trie, int(context[-1]), successors, k, branching, max_nodes)
        return out_tokens, out_parents, best_n
    out_tokens: list[int] = []
    out_parents: list[int] = []

    def visit(node: int, parent: int) -> None:
        for child in trie.ranked(node)[:branching]:
            if len(out_tokens) >= max_nodes:
                return
            out_tokens.append(trie.token[child])
            out_parents.append(parent)
            visit(child, len(out_tokens) - 1)

    visit(0, -1)
    return out_tokens, out_parents, best_n


#: rough chances that a child is the next token, for ordering candidates only (the K policy scores
#: what it verifies from the acceptance it measures): a match's rank-0 continuation by the match's
#: length n, its lower ranks, and the target's own choices by rank after the token
_MATCH_FIRST = {1: 0.25, 2: 0.5, 3: 0.6}  # n >= 4: _MATCH_FIRST_LONG
_MATCH_FIRST_LONG = 0.8
_MATCH_OTHER = 0.08
_TARGET_RANK = (0.45, 0.08, 0.04, 0.025)


def recycled_tree(trie: _Trie, last: int, successors: Mapping[int, np.ndarray], k: int, branching: int,
                  max_nodes: int = 64) -> tuple[list[int], list[int]]:
    """The matches' trie with the target's own next-token choices merged in, best first.

    A node's candidate children are its trie children (ranked as `ngram_tree` ranks them), then the
    target's top choices after its token (`successors`) that the trie does not have; each gets a
    rough chance (`_MATCH_FIRST`, `_TARGET_RANK`; a target choice beside match continuations at
    half of it, as the matches already hold the likeliest), a node's score is its parent's times
    its own, and the `max_nodes` best nodes up to depth k are taken, at most `branching` children
    each. Parents come before children and siblings in the order they are to be tried.

    >>> t = _Trie(np.array([5, 6, 5, 6]), [(1, 1)], k=2)      # after 5 the text had 6, 5
    >>> recycled_tree(t, 5, {5: np.array([6, 7]), 6: np.array([5, 9])}, k=2, branching=2)
    ([6, 5, 7, 9], [-1, 0, -1, 0])

    (the match's 6 and 5 under it; the target's second choice after 5, 7, beside the 6; its
    second after 6, 9, beside the 5)
    """
    out_tokens: list[int] = []
    out_parents: list[int] = []
    heap: list[tuple[float, int, int, int, int, int]] = []  # (-score, order, token, parent, trie node, depth)
    order = 0

    def offer(node: int, token: int, parent: int, score: float, depth: int) -> None:
        nonlocal order
        if depth >= k:
            return
        kids = trie.ranked(node) if node >= 0 else []
        seen = set()
        for rank, child in enumerate(kids[:branching]):
            n = trie.score[child][0]
            p = (_MATCH_FIRST.get(n, _MATCH_FIRST_LONG) if rank == 0 else _MATCH_OTHER / rank)
            seen.add(trie.token[child])
            heapq.heappush(heap, (-score * p, order, trie.token[child], parent, child, depth + 1))
            order += 1
        room = branching - len(seen)
        for rank, tok in enumerate(successors.get(token, ())[:len(_TARGET_RANK)]):
            tok = int(tok)
            if room <= 0:
                break
            if tok in seen:
                continue
            p = _TARGET_RANK[rank] * (0.5 if kids else 1.0)
            heapq.heappush(heap, (-score * p, order, tok, parent, -1, depth + 1))
            order += 1
            room -= 1

    offer(0, last, -1, 1.0, 0)
    while heap and len(out_tokens) < max_nodes:
        neg, _, tok, parent, node, depth = heapq.heappop(heap)
        out_tokens.append(tok)
        out_parents.append(parent)
        offer(node, tok, len(out_tokens) - 1, -neg, depth)
    return out_tokens, out_parents


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
    # a search: cheap; distinct continuations become a tree; with `recycle`, the target's top tokens
    capabilities = Capabilities(cheap=True, trees=True)

    def __init__(self, min_n: int = 1, max_n: int = 4, corpus_tokens: int = 0, recycle: int = 0):
        """corpus_tokens: how many tokens of recently finished requests to search besides each
        request's own context (0: none, the classic prompt lookup). recycle: how many of the
        target's top next tokens to keep after each verified token and offer in drafts (0: none);
        the engine hands them over through `observe_targets`."""
        if corpus_tokens < 0:
            raise ValueError(f"corpus_tokens must be >= 0, got {corpus_tokens}")
        if not 0 <= recycle <= len(_TARGET_RANK):
            raise ValueError(f"recycle must be between 0 and {len(_TARGET_RANK)}, got {recycle}")
        self.min_n, self.max_n = min_n, max_n
        self.corpus = Corpus(corpus_tokens, min_n, max_n) if corpus_tokens else None
        self.recycle = recycle
        if recycle:
            self.capabilities = dataclasses.replace(type(self).capabilities, target_top_k=recycle)
        self.successors: dict[int, dict[int, np.ndarray]] = {}  # seq_id -> token -> target's top next tokens

    def propose(self, seqs: list[SequenceView], ks: list[int], branching: list[int] | None = None) -> list[Proposal]:
        out = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            width = branching[i] if branching is not None else 1
            if k <= 0:
                out.append(Proposal([], None))
                continue
            after = self.successors.get(seq.seq_id) if self.recycle else None
            if width > 1:
                draft, parents, n = ngram_tree(seq.token_array(), self.min_n, self.max_n, k, width,
                                               corpus=self.corpus, successors=after)
                out.append(Proposal(draft, None, key=n, parents=parents))
            else:
                chain, n = ngram_match(seq.token_array(), self.min_n, self.max_n, k, self.corpus)
                chain = chain.tolist()
                if after:  # where the match's continuation ends, the target's own first choices
                    tok = chain[-1] if chain else seq.tokens[-1]
                    while len(chain) < k and len(after.get(tok, ())):
                        tok = int(after[tok][0])
                        chain.append(tok)
                out.append(Proposal(chain, None, key=n))  # longer matches draft better
        return out

    def observe_targets(self, seq: SequenceView, tokens: list[int], top: np.ndarray) -> None:
        """The target's top next tokens (`top[i]`, best first) after `tokens[i]`, in the order the
        sequence's context holds them: the latest view of a token is kept."""
        after = self.successors.setdefault(seq.seq_id, {})
        for tok, nxt in zip(tokens, top):
            after[int(tok)] = nxt

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        pass

    def release(self, seq: SequenceView) -> None:
        """A finished (or aborted) request joins the corpus; the oldest leave it past corpus_tokens."""
        if self.successors:
            self.successors.pop(seq.seq_id, None)
        if self.corpus is not None:
            self.corpus.add(seq.token_array())
