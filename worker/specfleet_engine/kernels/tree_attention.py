"""Tree attention for verification: the draft-tree nodes of each sequence in a ragged batch attend to
the sequence's paged KV prefix (through its block table) plus their own ancestors and themselves.

A tree is its nodes in topological order with `parents` local to the sequence (-1: attached to the
last prefix token). A chain is parents [-1, 0, 1, ...]; plain decoding is one node. Grouped-query
attention: n_heads is a multiple of n_kv_heads. Softmax in fp32.

`tree_attention_ref` (torch) is the CPU path and the reference; `tree_attention_triton` has the same
signature. The Triton kernel runs one program per (sequence, KV head, tile of query rows, prefix
split): the rows are the (node, query head) pairs of a sequence that share the KV head, so each
prefix block is read once for the whole tree and every query head of the group, and both products
are `tl.dot`s (fp32 inputs in IEEE precision, not TF32). A long prefix with few programs is split
across programs and the partial softmaxes merged (flash-decoding). The cache may be any strided
view whose last dim is contiguous: the model passes its [Hkv, slots, hd] tensors as
[num_blocks, block_size, Hkv, hd] views, no copy. The kernel lives in _tree_attention_triton.py,
imported at its first launch here: importing this module never imports triton. Runs under
TRITON_INTERPRET=1 too, which Triton reads as that module is imported. `tree_attention` dispatches: Triton
on CUDA (or anywhere with SPECFLEET_KERNELS=triton), else the reference; SPECFLEET_KERNELS=torch
forces the reference.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

KERNELS_ENV = "SPECFLEET_KERNELS"  # "torch": the references only; "triton": Triton even off CUDA
MAX_TREE_NODES = 1024  # per sequence: the ancestry mask is [total_nodes, max_nodes] int8


def tree_mask(parents: Tensor | list[int]) -> Tensor:
    """bool [n, n]: node i attends to j iff j is i or an ancestor of i."""
    p = [int(x) for x in (parents.tolist() if isinstance(parents, Tensor) else parents)]
    n = len(p)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(p):
        if not -1 <= parent < i:
            raise ValueError(f"tree parents must be topological (-1 <= parents[i] < i): parents[{i}] = {parent}")
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def _check(q, k_cache, v_cache, block_tables, prefix_lens, k_tree, v_tree, tree_parents, cu_nodes) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [total_nodes, n_heads, head_dim], got shape {tuple(q.shape)}")
    total, n_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, n_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    n_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or n_heads % n_kv:
        raise ValueError(f"q heads/dim {n_heads}/{head_dim} do not fit the cache's kv heads/dim "
                         f"{n_kv}/{k_cache.shape[3]} (n_heads must be a multiple of n_kv_heads)")
    if k_tree.shape != (total, n_kv, head_dim) or v_tree.shape != k_tree.shape:
        raise ValueError(f"k_tree and v_tree must be [{total}, {n_kv}, {head_dim}], "
                         f"got {tuple(k_tree.shape)} and {tuple(v_tree.shape)}")
    if tree_parents.shape != (total,):
        raise ValueError(f"tree_parents must be [{total}], got {tuple(tree_parents.shape)}")
    batch = prefix_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or cu_nodes.shape != (batch + 1,):
        raise ValueError(f"block_tables must be [batch, max_blocks] and cu_nodes [batch + 1] for batch {batch}, "
                         f"got {tuple(block_tables.shape)} and {tuple(cu_nodes.shape)}")
    cu = cu_nodes.tolist()
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_nodes must rise from 0 to total_nodes {total}, got {cu}")
    need = (int(prefix_lens.max()) + k_cache.shape[1] - 1) // k_cache.shape[1] if batch else 0
    if need > block_tables.shape[1] or (batch and int(prefix_lens.min()) < 0):
        raise ValueError(f"prefix_lens {prefix_lens.tolist()} need {need} blocks; block_tables holds "
                         f"{block_tables.shape[1]}")


def tree_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, prefix_lens: Tensor,
                       k_tree: Tensor, v_tree: Tensor, tree_parents: Tensor, cu_nodes: Tensor,
                       scale: float) -> Tensor:
    """[total_nodes, n_heads, head_dim]: each node over its sequence's prefix, its ancestors and itself."""
    _check(q, k_cache, v_cache, block_tables, prefix_lens, k_tree, v_tree, tree_parents, cu_nodes)
    n_heads, n_kv, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    cu = cu_nodes.tolist()
    for b, plen in enumerate(prefix_lens.tolist()):
        s, e = cu[b], cu[b + 1]
        if s == e:
            continue
        blocks = block_tables[b, :(plen + bs - 1) // bs].long()
        k = torch.cat([k_cache[blocks].reshape(-1, n_kv, q.shape[2])[:plen], k_tree[s:e]]).float()
        v = torch.cat([v_cache[blocks].reshape(-1, n_kv, q.shape[2])[:plen], v_tree[s:e]]).float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        allowed = torch.cat([torch.ones(e - s, plen, dtype=torch.bool),
                             tree_mask(tree_parents[s:e])], dim=1).to(q.device)
        scores = torch.einsum("nhd,lhd->hnl", q[s:e].float(), k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[s:e] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


@dataclass(frozen=True)
class TreeBatch:
    """The host-side description of a batch for the kernel, built once (one copy to the device) and
    reused by every layer of a forward.

    block_tables: int32 [B, max_blocks]; prefix_lens: int32 [B]; cu_nodes: int32 [B + 1];
    ancestry: int8 [total_nodes, max_nodes], row i: which of its sequence's nodes node i sees."""

    block_tables: Tensor
    prefix_lens: Tensor
    cu_nodes: Tensor
    ancestry: Tensor
    max_nodes: int
    max_prefix: int

    @property
    def batch(self) -> int:
        return self.prefix_lens.shape[0]


def tree_batch(block_tables: Tensor, prefix_lens: list[int], parents: list[list[int]],
               device: torch.device) -> TreeBatch:
    """block_tables: [B, max_blocks] (host); prefix_lens: B ints; parents: B lists (each sequence's
    tree parents, local to it)."""
    sizes = [len(p) for p in parents]
    max_nodes = max(sizes, default=0)
    if max_nodes > MAX_TREE_NODES:
        raise ValueError(f"a tree of {max_nodes} nodes exceeds the kernel's {MAX_TREE_NODES} per sequence")
    ancestry = torch.zeros(sum(sizes), max(max_nodes, 1), dtype=torch.int8)
    cu = [0, *itertools.accumulate(sizes)]
    for a, n, p in zip(cu, sizes, parents):
        if n:
            ancestry[a:a + n, :n] = tree_mask(p)
    as_i32 = lambda t: torch.as_tensor(t, dtype=torch.int32).to(device, non_blocking=True)
    return TreeBatch(as_i32(block_tables), as_i32(prefix_lens), as_i32(cu), ancestry.to(device, non_blocking=True),
                     max_nodes, max(prefix_lens, default=0))


def tree_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, prefix_lens: Tensor,
                          k_tree: Tensor, v_tree: Tensor, tree_parents: Tensor, cu_nodes: Tensor,
                          scale: float) -> Tensor:
    """Same as tree_attention_ref, by the Triton kernel."""
    _check(q, k_cache, v_cache, block_tables, prefix_lens, k_tree, v_tree, tree_parents, cu_nodes)
    cu, parents = cu_nodes.tolist(), tree_parents.tolist()
    batch = tree_batch(block_tables.cpu(), prefix_lens.tolist(), [parents[a:b] for a, b in itertools.pairwise(cu)],
                       q.device)
    return tree_attention_launch(q, k_cache, v_cache, batch, k_tree, v_tree, scale)


BLOCK_N = 64  # prefix tokens (and tree nodes) per step of a program
TARGET_PROGRAMS = 512  # split long prefixes until a launch has about this many programs (H200: 132 SMs)
MIN_SPLIT = 256  # prefix tokens a split covers at least


def tree_attention_launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: TreeBatch, k_tree: Tensor,
                          v_tree: Tensor, scale: float) -> Tensor:
    """The kernel on a prepared batch, no host sync: q [total, H, hd]; k_cache, v_cache
    [num_blocks, block_size, Hkv, hd] (any strides, last dim contiguous); k_tree, v_tree
    [total, Hkv, hd] (likewise). Returns [total, H, hd] in q's dtype."""
    import triton

    total, n_heads, head_dim = q.shape
    n_kv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(total, n_heads, head_dim, dtype=q.dtype, device=q.device)
    if total == 0:
        return out
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_tree", k_tree), ("v_tree", v_tree)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if not q.dtype == k_cache.dtype == v_cache.dtype == k_tree.dtype == v_tree.dtype:
        raise ValueError(f"q, the caches and the tree K/V must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}, {k_tree.dtype}, {v_tree.dtype}")
    group = n_heads // n_kv
    rows = batch.max_nodes * group
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    tiles = triton.cdiv(rows, block_m)
    programs = batch.batch * n_kv * tiles
    splits = max(1, min(triton.cdiv(batch.max_prefix, MIN_SPLIT), TARGET_PROGRAMS // programs))
    chunk = triton.cdiv(triton.cdiv(max(batch.max_prefix, 1), splits), BLOCK_N) * BLOCK_N
    splits = max(1, triton.cdiv(batch.max_prefix, chunk))
    if splits > 1:  # partial (unnormalised) outputs, their running maxima and sums
        part = torch.empty(splits, total, n_heads, head_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(2, splits, total, n_heads, dtype=torch.float32, device=q.device)
    else:
        part, ml = out, out  # unused
    bt = batch.block_tables
    _kernel()[(batch.batch, n_kv * tiles, splits)](
        q, k_cache, v_cache, bt, batch.prefix_lens, k_tree, v_tree, batch.ancestry, batch.cu_nodes, out, part, ml,
        float(scale), tiles, chunk, total,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        k_tree.stride(0), k_tree.stride(1), v_tree.stride(0), v_tree.stride(1), batch.ancestry.stride(0),
        GROUP=group, N_HEADS=n_heads, BLOCK_SIZE=bs, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, SPLIT=splits > 1, num_warps=4,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # fp32 exactly, not as TF32; bf16 natively
    if splits > 1:  # merge the splits' softmaxes; a split past a sequence's prefix has m = -inf, l = 0
        m, l = ml[0], ml[1]
        top = m.amax(0)
        w = torch.exp(m - top)  # [splits, total, H]
        out.copy_((w[..., None] * part).sum(0) / (w * l).sum(0)[..., None])
    return out


def _kernel():
    """The @triton.jit kernel, imported on first use: its module imports triton (this one must not), and
    Triton reads TRITON_INTERPRET as it is imported, so a setting made before the first launch takes effect."""
    from ._tree_attention_triton import tree_attention_kernel

    return tree_attention_kernel


def use_triton(device: torch.device) -> bool:
    """Triton on CUDA unless SPECFLEET_KERNELS=torch (or Triton is missing); SPECFLEET_KERNELS=triton
    forces it on any device (with TRITON_INTERPRET=1, on the CPU: for tests)."""
    choice = os.environ.get(KERNELS_ENV, "").lower()
    if choice == "torch" or (device.type != "cuda" and choice != "triton"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, prefix_lens: Tensor,
                   k_tree: Tensor, v_tree: Tensor, tree_parents: Tensor, cu_nodes: Tensor, scale: float) -> Tensor:
    """tree_attention_triton on CUDA, else tree_attention_ref (same signature)."""
    fn = tree_attention_triton if use_triton(q.device) else tree_attention_ref
    return fn(q, k_cache, v_cache, block_tables, prefix_lens, k_tree, v_tree, tree_parents, cu_nodes, scale)
