"""What every K policy shares: the protocol the engine calls, and the expected-tokens arithmetic.

A step decides K at two points, and the engine asks the sequence's policy at both:
`draft_lengths` before proposing (how deep each sequence may draft) and `select_nodes` after
(which nodes of each draft chain or tree the target verifies: the tree budget; a cheap proposer
drafts first and is pruned here). `observe` hears each verify step's outcome along the main
chain (rank-0 children), `observe_branches` which sibling rank was accepted where. Bounds come from the sequence (`k_min`,
`k_max`, set by the caller from the live config); costs come from the one `StepCostModel`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

Cost = Callable[[int], float]  # seconds of a forward by its rows (the rest of the batch included)


class KPolicy(Protocol):
    name: str

    def start(self, seq, prior: float | None = None, batch: int = 1) -> None:
        """Sets up `seq.kstate` and `seq.k` for a new sequence (prior: alpha of its kind of request)."""

    def draft_lengths(self, seqs: list, room: list[int], cost: Cost, cheap: bool, batch: int) -> list[int]:
        """Tokens each sequence may draft this step, each <= room[i] (what the context and
        max_tokens leave). batch: sequences decoding in this step."""

    def select_nodes(self, seqs: list, proposals: list, cost: Cost, cheap: bool, batch: int,
                     bystander_credit: float = 0.0) -> list[list[int]]:
        """Of each proposal (a chain or a tree), the nodes to verify: ascending indices, each
        node's parent included. batch: sequences in this step's forward (seqs and others);
        bystander_credit: the least `latency_credit` among the others (the latency guard's)."""

    def observe(self, seq, key: int, drafted: int, accepted: int) -> None:
        """The verify step's outcome for one sequence along its main chain (drafted 0: a plain
        decoding step)."""

    def observe_branches(self, parents: list[int], path: list[int]) -> None:
        """A verified tree (parents) and the nodes accepted (path): which sibling ranks won."""


def sibling_ranks(parents: list[int]) -> list[int]:
    """Each node's rank among its siblings (0: tried first).

    >>> sibling_ranks([-1, 0, 0, -1, 3])
    [0, 0, 1, 1, 0]
    """
    seen: dict[int, int] = {}
    out = []
    for p in parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def path_scores(parents: list[int], win: Callable[[int, int], float]) -> list[float]:
    """The chance each node is accepted, given win(rank, depth): the chance a child of that
    sibling rank and depth is accepted when tried (its parent accepted, its earlier siblings
    rejected). A node's score is its parent's times the chance its earlier siblings all lose
    times its own win.

    >>> path_scores([-1, 0, -1], lambda rank, depth: 0.5 if rank == 0 else 0.2)   # 0.5 * 0.2
    [0.5, 0.25, 0.1]
    """
    scores: list[float] = []
    depths: list[int] = []
    untried: dict[int, tuple[int, float]] = {}  # parent -> (next rank, chance every earlier sibling lost)
    for p in parents:
        depth = 1 if p < 0 else depths[p] + 1
        depths.append(depth)
        rank, lost = untried.get(p, (0, 1.0))
        w = win(rank, depth)
        scores.append((1.0 if p < 0 else scores[p]) * lost * w)
        untried[p] = (rank + 1, lost * (1.0 - w))
    return scores


def choose_nodes(scores: list[list[float]], parents: list[list[int]], floors: list[int], cost: Cost,
                 max_slowdown: float | None = None, bystanders: int = 0, credits: list[float] | None = None,
                 bystander_credit: float = 0.0) -> list[list[int]]:
    """The nodes each sequence verifies, maximising the batch's expected tokens / cost(rows).

    scores[i][j]: the chance node j of sequence i is accepted (a child never above its parent);
    every accepted node is one more token, every node one more row. Nodes are added best first,
    across the batch, while the ratio improves; the first floors[i] nodes are always kept (k_min).
    A chain is the tree whose node j has score a^(j+1): then this is `choose_ks`.

    max_slowdown: a latency guard. Throughput alone would let the requests whose drafts fail pay
    for the others' (every row slows the whole step): no request may fall behind plain decoding's
    pace, slowed by more than this fraction, over its life so far. Its `latency_credit` (credits[i],
    seconds, priced: what (1 + max_slowdown) x plain decoding would have spent on the tokens it has,
    less what its steps cost) plus this step's must stay >= 0: cost(rows) <= (1 + max_slowdown)
    cost(batch) (1 + its expected accepted) + its credit; None: no guard. A request that gained
    from its own drafts may be slowed later by others' (a bystander this step, with nothing to
    draft); one that never gained allows only max_slowdown a step. bystanders: sequences in the
    same forward that draft nothing here (their rows are in `cost` already; they gain nothing from
    these rows), the least credit among them `bystander_credit`.

    >>> linear = lambda T: 1.0 + 0.25 * (T - 1)
    >>> choose_nodes([[0.9, 0.81, 0.3], [0.1]], [[-1, 0, -1], [-1]], [0, 0], linear)
    [[0, 1], []]
    >>> cheap = lambda T: 1.0 + 0.02 * (T - 1)         # rows nearly free: all in, unless a guard
    >>> choose_nodes([[0.9, 0.81, 0.3], [0.1]], [[-1, 0, -1], [-1]], [0, 0], cheap)
    [[0, 1, 2], [0]]
    >>> choose_nodes([[0.9, 0.81, 0.3], [0.1]], [[-1, 0, -1], [-1]], [0, 0], cheap, max_slowdown=0.03)
    [[0], [0]]
    >>> choose_nodes([[0.9, 0.81, 0.3], [0.1]], [[-1, 0, -1], [-1]], [0, 0], cheap, max_slowdown=0.03,
    ...              credits=[0.0, 0.05])             # the second is ahead of plain decoding's pace
    [[0, 1, 2], [0]]
    """
    keep = [set(range(min(f, len(s)))) for f, s in zip(floors, scores)]
    rows = len(scores) + sum(map(len, keep))
    expected = [sum(scores[i][j] for j in k) for i, k in enumerate(keep)]
    tokens = float(len(scores)) + sum(expected)
    limit = None if max_slowdown is None else (1.0 + max_slowdown) * cost(len(scores))
    credit = list(credits) if credits is not None else [0.0] * len(scores)
    order = sorted(((-sc, i, j) for i, s in enumerate(scores) for j, sc in enumerate(s) if j not in keep[i]))
    for neg, i, j in order:
        gain = -neg
        p = parents[i][j]
        if gain <= 0 or (p >= 0 and p not in keep[i]):
            continue
        if (tokens + gain) / cost(rows + 1) <= tokens / cost(rows):
            break
        if limit is not None:
            allowed = min(limit * (1.0 + e + (gain if k == i else 0.0)) + credit[k] for k, e in enumerate(expected))
            if bystanders:
                allowed = min(allowed, limit + bystander_credit)
            if cost(rows + 1) > allowed:
                continue  # a node of the worst-off sequence may still fit
        keep[i].add(j)
        expected[i] += gain
        tokens += gain
        rows += 1
    return [sorted(k) for k in keep]


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step yields with k draft tokens each accepted with chance a: the
    accepted drafts plus the bonus or recovered token, 1 + a + ... + a^k.

    >>> expected_tokens(0.0, 4), expected_tokens(1.0, 4), round(expected_tokens(0.5, 3), 4)
    (1.0, 5.0, 1.875)
    """
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_ks(alphas: list[float], caps: list[int], cost: Cost) -> list[int]:
    """Draft lengths for a batch, each k_i <= caps[i], maximising expected tokens / cost(T).

    The i-th sequence's (k+1)-th draft token adds a_i^(k+1) expected tokens and one row to the
    forward; rows are added best gain first while the ratio improves.

    >>> linear = lambda T: 1.0 + 0.25 * (T - 1)          # each extra row costs a quarter step
    >>> choose_ks([0.9, 0.1], [4, 4], linear)
    [4, 0]
    >>> choose_ks([0.9], [4], lambda T: float(T))        # a row costs a full step: never draft
    [0]
    """
    ks = [0] * len(alphas)
    tokens, rows = float(len(alphas)), len(alphas)
    heap = [(-a, i) for i, (a, cap) in enumerate(zip(alphas, caps)) if cap > 0 and a > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if (tokens + gain) / cost(rows + 1) <= tokens / cost(rows):
            break
        ks[i] += 1
        tokens += gain
        rows += 1
        if ks[i] < caps[i]:
            heapq.heappush(heap, (-(alphas[i] ** (ks[i] + 1)), i))
    return ks


def best_k(alpha: float, batch: int, k_min: int, k_max: int, cost: Cost) -> tuple[int, list[float]]:
    """argmax over K of a batch's tokens per second when every sequence drafts K, and the rate
    of every K from k_min.

    >>> best_k(0.8, 1, 0, 8, lambda T: 1.0)[0]            # free verify rows: draft all allowed
    8
    >>> best_k(0.8, 16, 0, 8, lambda T: float(T))[0]       # each row costs a whole step: never
    0
    """
    rates = [batch * expected_tokens(alpha, k) / cost(batch * (1 + k)) for k in range(k_min, k_max + 1)]
    best = max(range(len(rates)), key=rates.__getitem__)
    return k_min + best, rates
