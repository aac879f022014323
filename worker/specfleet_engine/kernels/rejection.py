"""Fused verification of draft trees (chains included) for a ragged batch: greedy or rejection sampling.

Words used everywhere: the *draft tokens* (tree nodes) a proposer suggests, the *accepted tokens* (the
path the target agrees with), and one more token the target always contributes: the *bonus token*
when the path ends at a leaf, or the *recovered token* (drawn from the residual) where every child
was rejected. For a chain this is Leviathan et al. 2023 / Chen et al. 2023: accept with
min(1, p/q), recover from norm(max(0, p - q)). Each sequence is a root row (its last token) and its draft nodes in
topological order, siblings in the order they are tried. From the root: greedy accepts the child whose
token is the target's argmax; sampling tries the children in turn, accepts child c (token x, draft q_c)
when u * q_c(x) < p(x), else replaces p by norm(max(0, p - q_c)) and tries the next child (multi-draft
recursive rejection sampling: SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024). On acceptance it
descends with p = the target row of c. Where it stops, the bonus token (the node has no children) or
the recovered token (every child rejected) is drawn from the current p, so the emitted tokens follow
the target's distribution exactly. A chain is parents [-1, 0, 1, ...]; plain decoding is a root alone.

`rejection_sample_ref` (torch) is the CPU path and the reference; `rejection_sample_triton` has the same
signature (one program per sequence, one pass over its rows: a tree's nodes in topological order meet
the current node's children in try order, and an accepted child's children after it; the residual in
an fp32 scratch row; uniforms from tl.rand under a seed drawn from each sequence's generator).
The kernel lives in _rejection_triton.py, imported at its first launch (as tree_attention's).
`rejection_sample` dispatches like tree_attention: Triton on CUDA unless SPECFLEET_KERNELS=torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..sampling import sample_from
from .tree_attention import MAX_TREE_NODES, use_triton

BLOCK_V = 1024  # the kernel's vocabulary chunk (capped at the vocabulary's next power of two)


@dataclass
class TreeVerifyBatch:
    """Ragged: B sequences, each a root row followed by its n_b draft nodes."""

    cu_rows: Tensor  # int [B + 1]: sequence b owns rows cu_rows[b]:cu_rows[b + 1]; its first row is the root
    tokens: Tensor  # int64 [R]: each row's draft token (root rows: ignored)
    parents: Tensor  # int64 [R]: parent row local to the sequence (root: -1; node i's parent p -> row p + 1)
    greedy: Tensor  # bool [B]
    has_q: Tensor  # bool [R]: the row's token was drawn from draft_probs[row] (False: q one-hot on the token)


@dataclass
class TreeVerifyResult:
    num_accepted: Tensor  # int64 [B]: accepted draft nodes
    path: Tensor  # int64 [B, max_depth]: local rows of the accepted nodes in order, -1 padded
    next_token: Tensor  # int64 [B]: the bonus or the recovered token
    bonus: Tensor  # bool [B]: the path ends at a node with no children (nothing was rejected there)


def _check(target_probs: Tensor, draft_probs: Tensor | None, batch: TreeVerifyBatch,
           generators: list) -> tuple[list[int], list[int], int]:
    """Validates the shapes and the trees; returns (cu_rows, parents) as lists and max_depth."""
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [rows, vocab], got shape {tuple(target_probs.shape)}")
    rows, vocab = target_probs.shape
    b = batch.greedy.shape[0]
    if batch.greedy.shape != (b,) or batch.cu_rows.shape != (b + 1,):
        raise ValueError(f"cu_rows must be [batch + 1] and greedy [batch], got {tuple(batch.cu_rows.shape)} "
                         f"and {tuple(batch.greedy.shape)}")
    if len(generators) != b:
        raise ValueError(f"generators must hold one entry per sequence ({b}), got {len(generators)}")
    cu = batch.cu_rows.tolist()
    if cu[0] != 0 or any(e <= s for s, e in itertools.pairwise(cu)):
        raise ValueError(f"cu_rows must rise strictly from 0 (every sequence has a root row), got {cu}")
    if cu[-1] != rows:
        raise ValueError(f"target_probs has {rows} rows but cu_rows ends at {cu[-1]}")
    for name in ("tokens", "parents", "has_q"):
        if getattr(batch, name).shape != (rows,):
            raise ValueError(f"{name} must be [{rows}] (one per row), got {tuple(getattr(batch, name).shape)}")
    if draft_probs is not None and draft_probs.shape != (rows, vocab):
        raise ValueError(f"draft_probs must be [{rows}, {vocab}] like target_probs, got {tuple(draft_probs.shape)}")
    if draft_probs is None and bool(batch.has_q.any()):
        raise ValueError("has_q marks rows drawn from draft_probs, but draft_probs is None")
    parents = batch.parents.tolist()
    tokens = batch.tokens.tolist()
    max_depth = 1
    for s, e in itertools.pairwise(cu):
        depth = [0]
        if parents[s] != -1:
            raise ValueError(f"the root row {s} must have parent -1, got {parents[s]}")
        for i in range(1, e - s):
            p = parents[s + i]
            if not 0 <= p < i:
                raise ValueError(f"parents must be topological (0 <= parent < local row) for the draft rows: "
                                 f"row {s + i} (local {i}) has parent {p}")
            if not 0 <= tokens[s + i] < vocab:
                raise ValueError(f"row {s + i}'s draft token {tokens[s + i]} is outside the vocabulary [0, {vocab})")
            depth.append(depth[p] + 1)
        max_depth = max(max_depth, max(depth))
    return cu, parents, max_depth


def rejection_sample_ref(target_probs: Tensor, draft_probs: Tensor | None, batch: TreeVerifyBatch,
                         generators: list[torch.Generator | None]) -> TreeVerifyResult:
    """target_probs: [R, V] (greedy sequences: logits do as well); draft_probs: [R, V] or None (all one-hot).

    Randomness, per sampled sequence from its generator (None: torch's default): one uniform per child
    tried, in the order tried, then sample_from's draw (on the CPU one uniform, elsewhere an
    exponential race over V) for the next token.
    Greedy sequences draw nothing.

    >>> t = torch.eye(4)[[1, 2, 3]]                  # target argmax after root: 1, after row 1: 2, after row 2: 3
    >>> batch = TreeVerifyBatch(torch.tensor([0, 3]), torch.tensor([-1, 1, 0]), torch.tensor([-1, 0, 0]),
    ...                         torch.tensor([True]), torch.tensor([False] * 3))
    >>> r = rejection_sample_ref(t, None, batch, [None])    # root's children: tokens 1 and 0
    >>> r.num_accepted.tolist(), r.path.tolist(), r.next_token.tolist(), r.bonus.tolist()
    ([1], [[1]], [2], [True])
    """
    cu, parents, max_depth = _check(target_probs, draft_probs, batch, generators)
    n_seqs = len(cu) - 1
    tokens, has_q, greedy = batch.tokens.tolist(), batch.has_q.tolist(), batch.greedy.tolist()
    num_accepted, next_token, bonus = [0] * n_seqs, [0] * n_seqs, [True] * n_seqs
    path = [[-1] * max_depth for _ in range(n_seqs)]
    for b, (s, e) in enumerate(itertools.pairwise(cu)):
        children: list[list[int]] = [[] for _ in range(e - s)]
        for i in range(1, e - s):
            children[parents[s + i]].append(i)
        g = generators[b]
        gdev = g.device if g is not None else torch.device("cpu")
        cur, depth = 0, 0
        if greedy[b]:
            t = int(target_probs[s].argmax())
            while (nxt := next((c for c in children[cur] if tokens[s + c] == t), None)) is not None:
                path[b][depth], depth, cur = nxt, depth + 1, nxt
                t = int(target_probs[s + cur].argmax())
            num_accepted[b], next_token[b], bonus[b] = depth, t, not children[cur]
            continue
        p = target_probs[s].float()  # [V]: the current node's target row, then its residual
        descended = True
        while descended:
            descended = False
            for c in children[cur]:
                x = tokens[s + c]
                q = float(draft_probs[s + c, x]) if has_q[s + c] else 1.0
                u = float(torch.rand((), generator=g, device=gdev))
                if u * q < float(p[x]):  # u < p/q without dividing by a zero q
                    path[b][depth], depth, cur, descended = c, depth + 1, c, True
                    p = target_probs[s + c].float()
                    break
                if has_q[s + c]:
                    residual = (p - draft_probs[s + c].float()).clamp_min(0.0)
                else:
                    residual = p.clone()
                    residual[x] = 0.0
                total = residual.sum()
                # A rejection implies p(x) < q(x), hence mass elsewhere; guard against round-off only.
                p = residual / total if total > 0 else target_probs[s + cur].float()
        num_accepted[b], bonus[b] = depth, not children[cur]
        next_token[b] = int(sample_from(p[None].to(gdev), g))
    dev = target_probs.device
    return TreeVerifyResult(torch.tensor(num_accepted, device=dev), torch.tensor(path, device=dev).view(-1, max_depth),
                            torch.tensor(next_token, device=dev), torch.tensor(bonus, device=dev))


def rejection_sample_triton(target_probs: Tensor, draft_probs: Tensor | None, batch: TreeVerifyBatch,
                            generators: list[torch.Generator | None]) -> TreeVerifyResult:
    """Same as rejection_sample_ref, by the Triton kernel. Each sampled sequence draws one int64 seed from
    its generator (greedy ones draw nothing); the kernel's uniforms are tl.rand(seed, row) for the child
    at that (global) row and tl.rand(seed, cu_rows[b + 1] + v) for the race over token v. The same seeds
    give the same result, though not the reference's: the two agree in distribution (greedy: exactly)."""
    import triton

    cu, _, max_depth = _check(target_probs, draft_probs, batch, generators)
    vocab = target_probs.shape[1]
    n_seqs = len(cu) - 1
    max_rows = max((e - s for s, e in itertools.pairwise(cu)), default=1)
    if max_rows > MAX_TREE_NODES + 1:
        raise ValueError(f"a tree of {max_rows - 1} nodes exceeds the kernel's {MAX_TREE_NODES} per sequence")
    dev = target_probs.device
    greedy = batch.greedy.tolist()
    seeds = torch.zeros(n_seqs, dtype=torch.int64)
    for b, g in enumerate(generators):
        if not greedy[b]:
            seeds[b] = torch.randint(1 << 62, (), generator=g, device=g.device if g is not None else "cpu")
    tp = target_probs.contiguous()
    dp = draft_probs.contiguous() if draft_probs is not None else tp  # never read when has_q is all False
    num_accepted = torch.zeros(n_seqs, dtype=torch.int64, device=dev)
    path = torch.full((n_seqs, max_depth), -1, dtype=torch.int64, device=dev)
    next_token = torch.zeros(n_seqs, dtype=torch.int64, device=dev)
    bonus = torch.zeros(n_seqs, dtype=torch.int8, device=dev)
    scratch = torch.empty(n_seqs, vocab, dtype=torch.float32, device=dev)  # each sequence's residual
    if n_seqs == 0:
        return TreeVerifyResult(num_accepted, path, next_token, bonus.bool())
    _kernel()[(n_seqs,)](
        tp, dp, batch.tokens.to(dev, torch.int64).contiguous(), batch.parents.to(dev, torch.int32).contiguous(),
        batch.has_q.to(dev, torch.int8).contiguous(), batch.cu_rows.to(dev, torch.int64).contiguous(),
        batch.greedy.to(dev, torch.int8).contiguous(), seeds.to(dev), scratch,
        num_accepted, path, next_token, bonus, vocab, tp.stride(0), dp.stride(0), max_depth,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)), BLOCK_R=triton.next_power_of_2(max_rows))
    return TreeVerifyResult(num_accepted, path, next_token, bonus.bool())


def rejection_sample(target_probs: Tensor, draft_probs: Tensor | None, batch: TreeVerifyBatch,
                     generators: list[torch.Generator | None]) -> TreeVerifyResult:
    """rejection_sample_triton on CUDA, else rejection_sample_ref (same signature)."""
    fn = rejection_sample_triton if use_triton(target_probs.device) else rejection_sample_ref
    return fn(target_probs, draft_probs, batch, generators)


def greedy_argmax(logits: Tensor, cu: list[int]) -> TreeVerifyResult:
    """What `rejection_sample` returns for greedy sequences with nothing drafted (one row each,
    at cu[b]): no accepted node, the target's argmax as the bonus token. Plain greedy decoding's
    step, without building a verify batch (a few dozen microseconds a step, cache-cold after
    the forward streamed the weights)."""
    n = len(cu) - 1
    dev = logits.device
    return TreeVerifyResult(torch.zeros(n, dtype=torch.long, device=dev), torch.full((n, 1), -1, device=dev),
                            logits[cu[:-1]].argmax(-1), torch.ones(n, dtype=torch.bool, device=dev))


def _kernel():
    """The @triton.jit kernel, imported on first use (as tree_attention._kernel: this module must not
    import triton, and Triton reads TRITON_INTERPRET as the kernel's module is imported)."""
    from ._rejection_triton import rejection_kernel

    return rejection_kernel
