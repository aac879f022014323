"""The Triton kernel behind tree_attention.tree_attention_launch (see that module for the contract and the
launch). Imported only when the kernel is first launched: it imports triton, and Triton reads
TRITON_INTERPRET as the @triton.jit functions here are defined. Helpers sit at module level because the
interpreter resolves called jit functions through the module's globals."""

import triton
import triton.language as tl


@triton.jit
def _online_softmax(q, k, v, seen, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One block of keys k, values v [BLOCK_N, BLOCK_D] into each row's running max m_i, sum l_i and
    unnormalised output acc; seen masks the scores ([BLOCK_M or 1, BLOCK_N]). A row that has seen nothing
    keeps m = -inf (its exponentials are taken against 0, not -inf, so they are 0, not NaN)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def tree_attention_kernel(Q, KC, VC, BT, PL, KT, VT, ANC, CU, OUT, PART, ML, scale, tiles, chunk, total,
                          s_qn, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_bt, s_ktn, s_kth, s_vtn, s_vth, s_a,
                          GROUP: tl.constexpr, N_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1) // tiles
    kvh64 = kvh.to(tl.int64)  # a layer's cache can pass 2^31 elements
    tile = tl.program_id(1) % tiles
    split = tl.program_id(2)
    start = tl.load(CU + seq)
    n_nodes = tl.load(CU + seq + 1) - start
    plen = tl.load(PL + seq)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's rows: (node, query head of the group)
    node = r // GROUP
    head = kvh * GROUP + r % GROUP
    rv = node < n_nodes
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    q = tl.load(Q + (start + node)[:, None] * s_qn + head[:, None] * s_qh + d[None, :],
                mask=rv[:, None] & dm[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo = 0
    hi = plen
    if SPLIT:
        lo = split * chunk
        hi = tl.minimum(plen, lo + chunk)
    n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):  # the prefix, through the block table
        pos = n0 + n
        pv = pos < hi
        blk = tl.load(BT + seq * s_bt + pos // BLOCK_SIZE, mask=pv, other=0).to(tl.int64)
        within = (pos % BLOCK_SIZE).to(tl.int64)
        lm = pv[:, None] & dm[None, :]
        k = tl.load(KC + (blk * s_kb + within * s_ks + kvh64 * s_kh)[:, None] + d[None, :], mask=lm, other=0.0)
        v = tl.load(VC + (blk * s_vb + within * s_vs + kvh64 * s_vh)[:, None] + d[None, :], mask=lm, other=0.0)
        m_i, l_i, acc = _online_softmax(q, k, v, pv[None, :], m_i, l_i, acc, scale, PRECISION)
    t_end = n_nodes
    if SPLIT:
        t_end = n_nodes * (split == 0).to(tl.int32)  # the tree once, in split 0
    for t0 in range(0, t_end, BLOCK_N):  # the sequence's tree nodes, under the ancestry mask
        col = t0 + n
        cv = col < n_nodes
        seen = tl.load(ANC + (start + node)[:, None] * s_a + col[None, :], mask=rv[:, None] & cv[None, :],
                       other=0) != 0
        lm = cv[:, None] & dm[None, :]
        k = tl.load(KT + ((start + col) * s_ktn + kvh * s_kth)[:, None] + d[None, :], mask=lm, other=0.0)
        v = tl.load(VT + ((start + col) * s_vtn + kvh * s_vth)[:, None] + d[None, :], mask=lm, other=0.0)
        m_i, l_i, acc = _online_softmax(q, k, v, seen, m_i, l_i, acc, scale, PRECISION)
    sm = rv[:, None] & dm[None, :]
    row = (start + node).to(tl.int64) * N_HEADS + head  # OUT, PART and ML are contiguous, rows (node, head)
    if SPLIT:
        row += split.to(tl.int64) * total * N_HEADS
        tl.store(PART + row[:, None] * HEAD_DIM + d[None, :], acc, mask=sm)
        tl.store(ML + row, m_i, mask=rv)
        tl.store(ML + tl.num_programs(2).to(tl.int64) * total * N_HEADS + row, l_i, mask=rv)
    else:
        l_i = tl.where(rv, l_i, 1.0)  # rows past the tree saw nothing
        tl.store(OUT + row[:, None] * HEAD_DIM + d[None, :], (acc / l_i[:, None]).to(OUT.dtype.element_ty),
                 mask=sm)
