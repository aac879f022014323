"""Tree attention for verification: the draft-tree nodes of each sequence in a ragged batch attend to
the sequence's paged KV prefix (through its block table) plus their own ancestors and themselves.

A tree is its nodes in topological order with `parents` local to the sequence (-1: attached to the
last prefix token). A chain is parents [-1, 0, 1, ...]; plain decoding is one node. Grouped-query
attention: n_heads is a multiple of n_kv_heads. Softmax in fp32.

`tree_attention_ref` (torch) is the CPU path and the reference; `tree_attention_triton` has the same
signature (one program per (node, head), online softmax over prefix blocks, then the sequence's tree
nodes under a host-built ancestry mask; runs under TRITON_INTERPRET=1 too, which Triton reads when
the kernel is built, i.e. at its first launch here). `tree_attention` dispatches: Triton on CUDA,
else the reference; SPECFLEET_KERNELS=torch forces the reference.
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
from torch import Tensor

KERNELS_ENV = "SPECFLEET_KERNELS"  # "torch": use the references, never Triton
MAX_TREE_NODES = 1024  # per sequence; the Triton kernel holds one sequence's tree in one block


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


@functools.cache
def _kernel():
    """Built on first use, so TRITON_INTERPRET set before the first launch takes effect."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, KC, VC, BT, PL, KT, VT, MASK, CU, SEQ, OUT, scale,
               s_qn, s_qh, s_cb, s_cs, s_ch, s_bt, s_tn, s_th, s_on, s_oh, s_m,
               GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
        node = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // GROUP
        seq = tl.load(SEQ + node)
        start = tl.load(CU + seq)
        n_nodes = tl.load(CU + seq + 1) - start
        plen = tl.load(PL + seq)
        d = tl.arange(0, BLOCK_D)
        dm = d < HEAD_DIM
        q = tl.load(Q + node * s_qn + head * s_qh + d, mask=dm, other=0.0).to(tl.float32) * scale
        m_i = tl.full((1,), float("-inf"), tl.float32)
        l_i = tl.zeros((1,), tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        offs = tl.arange(0, BLOCK_SIZE)
        for b in range(tl.cdiv(plen, BLOCK_SIZE)):  # the prefix, block by block through the table
            blk = tl.load(BT + seq * s_bt + b).to(tl.int64)
            valid = b * BLOCK_SIZE + offs < plen
            ptr = blk * s_cb + offs[:, None] * s_cs + kvh * s_ch + d[None, :]
            lm = valid[:, None] & dm[None, :]
            k = tl.load(KC + ptr, mask=lm, other=0.0).to(tl.float32)
            v = tl.load(VC + ptr, mask=lm, other=0.0).to(tl.float32)
            s = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        t = tl.arange(0, BLOCK_T)  # the sequence's tree nodes, under the ancestry mask (self always in)
        tv = (t < n_nodes) & (tl.load(MASK + node * s_m + t, mask=t < n_nodes, other=0) != 0)
        ptr = (start + t)[:, None] * s_tn + kvh * s_th + d[None, :]
        lm = tv[:, None] & dm[None, :]
        k = tl.load(KT + ptr, mask=lm, other=0.0).to(tl.float32)
        v = tl.load(VT + ptr, mask=lm, other=0.0).to(tl.float32)
        s = tl.where(tv, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        tl.store(OUT + node * s_on + head * s_oh + d, (acc / l_i).to(OUT.dtype.element_ty), mask=dm)

    return kernel


def tree_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, prefix_lens: Tensor,
                          k_tree: Tensor, v_tree: Tensor, tree_parents: Tensor, cu_nodes: Tensor,
                          scale: float) -> Tensor:
    """Same as tree_attention_ref, by the Triton kernel."""
    import triton

    _check(q, k_cache, v_cache, block_tables, prefix_lens, k_tree, v_tree, tree_parents, cu_nodes)
    total, n_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if total == 0:
        return out
    cu = cu_nodes.tolist()
    sizes = [b - a for a, b in itertools.pairwise(cu)]
    max_nodes = max(sizes)
    if k_cache.shape[1] & (k_cache.shape[1] - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block size, got {k_cache.shape[1]}")
    if max_nodes > MAX_TREE_NODES:
        raise ValueError(f"a tree of {max_nodes} nodes exceeds the kernel's {MAX_TREE_NODES} per sequence")
    mask = torch.zeros(total, max_nodes, dtype=torch.int8)  # row: which of its sequence's nodes a node sees
    for a, n in zip(cu, sizes):
        if n:
            mask[a:a + n, :n] = tree_mask(tree_parents[a:a + n])
    dev = q.device
    seq = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(sizes)).to(dev)
    q, k_tree, v_tree = q.contiguous(), k_tree.contiguous(), v_tree.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    bt = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    pl = prefix_lens.to(device=dev, dtype=torch.int32).contiguous()
    cun = cu_nodes.to(device=dev, dtype=torch.int32).contiguous()
    mask = mask.to(dev)
    _kernel()[(total, n_heads)](
        q, k_cache, v_cache, bt, pl, k_tree, v_tree, mask, cun, seq, out, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0),
        k_tree.stride(0), k_tree.stride(1), out.stride(0), out.stride(1), mask.stride(0),
        GROUP=n_heads // k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_T=max(16, triton.next_power_of_2(max_nodes)))
    return out


def use_triton(device: torch.device) -> bool:
    """Triton on CUDA unless SPECFLEET_KERNELS=torch (or Triton is missing)."""
    if os.environ.get(KERNELS_ENV, "").lower() == "torch" or device.type != "cuda":
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
