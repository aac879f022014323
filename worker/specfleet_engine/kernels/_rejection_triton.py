"""The Triton kernel behind rejection.rejection_sample_triton (see that module for the contract and the
launch). Imported only when the kernel is first launched: it imports triton, and Triton reads
TRITON_INTERPRET as the @triton.jit functions here are defined. Helpers sit at module level because the
interpreter resolves called jit functions through the module's globals."""

import triton
import triton.language as tl


@triton.jit
def _current_p(TP_ROW, res, v, m, fresh, tot):
    """The current node's p over the vocabulary chunk v (masked by m): its target row while fresh, else
    the scratch row res divided by tot (only one of the two loads reads memory)."""
    mt, mr = tl.where(fresh != 0, m, False), tl.where(fresh == 0, m, False)
    p = tl.load(TP_ROW + v, mask=mt, other=0.0).to(tl.float32)
    return p + tl.load(res + v, mask=mr, other=0.0) / tot


@triton.jit
def _running_argmax(x, v0, best, arg):
    """Folds the chunk x (tokens v0, v0 + 1, ...) into the running (best value, its token): the first
    maximum, as torch.argmax."""
    m = tl.max(x, axis=0)
    i = v0 + tl.argmax(x, axis=0, tie_break_left=True)
    return tl.maximum(m, best), tl.where(m > best, i, arg)


@triton.jit
def rejection_kernel(TP, DP, TOK, PAR, HASQ, CU, GREEDY, SEED, RES, NACC, PATH, NEXT, BONUS,
                     V, s_tp, s_dp, max_depth, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(CU + b)
    n = (tl.load(CU + b + 1) - start).to(tl.int32)
    greedy = tl.load(GREEDY + b) != 0
    seed = tl.load(SEED + b)
    res = RES + b.to(tl.int64) * V
    offs = tl.arange(0, BLOCK_V)  # masks built with tl.where: the interpreter rejects `vector & scalar`
    local = tl.arange(0, BLOCK_R)
    us = tl.rand(seed, start + local)  # each row's uniform, at once (one Philox call, not one per child)
    # State: cur (local row of the current node), its target argmax t (greedy), its p: the target row
    # while fresh, else the scratch row divided by tot; tried: a child of cur was rejected.
    cur = tl.full((), -1, tl.int32)  # the root is "accepted" as row 0's parent -1: one place for acceptance
    n_acc = tl.full((), -1, tl.int32)
    t = tl.full((), 0, tl.int32)
    fresh = tl.full((), 1, tl.int32)
    tot = tl.full((), 1.0, tl.float32)
    tried = tl.full((), 0, tl.int32)
    for c in range(n):
        if tl.load(PAR + start + c) == cur:
            x = tl.load(TOK + start + c)
            row = start + cur
            if c == 0:
                accept = c == 0
            elif greedy:
                accept = x == t
            else:
                hq = tl.load(HASQ + start + c) != 0
                qx = tl.where(hq, tl.load(DP + (start + c) * s_dp + x).to(tl.float32), 1.0)
                pt = tl.load(TP + row * s_tp + x).to(tl.float32)
                pr = tl.load(res + x)
                px = tl.where(fresh != 0, pt, pr / tot)
                u = tl.sum(tl.where(local == c, us, 0.0), axis=0)
                accept = u * qx < px  # u < p/q without dividing by a zero q
                if not accept:  # p <- max(0, p - q_c), normalised via tot
                    new_tot = tl.full((), 0.0, tl.float32)
                    for v0 in range(0, V, BLOCK_V):
                        v = v0 + offs
                        m = v < V
                        p = _current_p(TP + row * s_tp, res, v, m, fresh, tot)
                        q = tl.load(DP + (start + c) * s_dp + v, mask=tl.where(hq, m, False), other=0.0)
                        q = q.to(tl.float32)
                        q = tl.where(hq, q, tl.where(v == x, 1.0, 0.0))
                        r = tl.maximum(p - q, 0.0)
                        tl.store(res + v, r, mask=m)
                        new_tot += tl.sum(tl.where(m, r, 0.0), axis=0)
                    tl.debug_barrier()  # the next child reads the scratch row other threads wrote
                    # a rejection implies mass elsewhere; guard against round-off: back to the target row
                    fresh = tl.where(new_tot > 0.0, 0, 1)
                    tot = tl.where(new_tot > 0.0, new_tot, 1.0)
            if accept:
                if c > 0:
                    tl.store(PATH + b * max_depth + n_acc, c)
                cur = c
                n_acc += 1
                fresh = 1
                tot = 1.0
                tried = 0
                if greedy:  # the first maximum, as torch.argmax
                    best = tl.full((), float("-inf"), tl.float32)
                    t = tl.full((), 0, tl.int32)
                    for v0 in range(0, V, BLOCK_V):
                        v = v0 + offs
                        logit = tl.load(TP + (start + c) * s_tp + v, mask=v < V, other=float("-inf"))
                        logit = logit.to(tl.float32)
                        best, t = _running_argmax(logit, v0, best, t)
            else:
                tried = 1
    if greedy:
        token = t
    else:  # the exponential race over p (scale-free, so the scratch row needs no division)
        best = tl.full((), -1.0, tl.float32)
        token = tl.full((), 0, tl.int32)
        row = start + cur
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            m = v < V
            p = _current_p(TP + row * s_tp, res, v, m, fresh, 1.0)
            score = tl.where(m, p / -tl.log(tl.rand(seed, start + n + v)), -1.0)
            best, token = _running_argmax(score, v0, best, token)
    tl.store(NACC + b, n_acc)
    tl.store(NEXT + b, token)
    tl.store(BONUS + b, 1 - tried)

