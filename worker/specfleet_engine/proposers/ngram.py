"""N-gram (prompt lookup) proposer: drafts the continuation of the latest earlier occurrence of
the context's last n tokens. No parameters, no model; q is one-hot on each draft token."""

from __future__ import annotations

import numpy as np

from specfleet_api.enums import Method

from .base import Proposal, SequenceView


def ngram_match(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[np.ndarray, int]:
    """`ngram_propose`'s draft and the length n of the match it came from (0: none)."""
    L = tokens.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = tokens[L - n:]
        # candidate starts i with i + n < L, so that a continuation exists
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size == 1:
            start = int(hits[0]) + n
            return tokens[start:start + k].astype(np.int64), n
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
        if starts.size == 0:
            break
        nxt = tokens[starts + j]
        if starts.size == 1:
            draft.extend(tokens[starts[0] + j:starts[0] + k].tolist())
            break
        values, counts = np.unique(nxt, return_counts=True)
        best = values[counts == counts.max()]
        tok = nxt[np.flatnonzero(np.isin(nxt, best))[-1]]  # starts ascend: the latest of the best
        draft.append(int(tok))
        starts = starts[nxt == tok]
    return np.asarray(draft, dtype=np.int64)


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

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[SequenceView], ks: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, ks):
            draft, n = ngram_match(seq.token_array(), self.min_n, self.max_n, k) if k > 0 else (np.empty(0, np.int64), 0)
            out.append(Proposal(draft.tolist(), None, key=n))  # longer matches draft better
        return out

    def rollback(self, seq: SequenceView, num_valid: int) -> None:
        pass

    def release(self, seq: SequenceView) -> None:
        pass
