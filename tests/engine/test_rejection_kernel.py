"""Fused verification of draft trees (kernels/rejection.py): the torch reference against an independent
walk and the chain rule (greedy), losslessness by distribution (sampling: the first two emitted tokens
follow the target's joint), and the Triton kernel (TRITON_INTERPRET=1 on the CPU, in a subprocess so the
setting does not leak into this process; CUDA when there is one) against the reference."""

import doctest
import math
import os

import pytest
import torch
from specfleet_engine.kernels import rejection as rk
from specfleet_engine.kernels import tree_attention as ta
from specfleet_engine.testing import run_interpreted

V = 111
# (draft nodes, chain?): ragged batches mixing plain rows, chains and random trees of up to 64 nodes
GREEDY_SIZES = [(0, False), (1, False), (3, True), (5, True), (7, True), (8, False), (17, False), (33, False),
                (64, False), (0, False), (64, True), (12, False)]


def make_batch(seqs, greedy) -> rk.TreeVerifyBatch:
    """seqs: [(parents, tokens, has_q)] local to each sequence, root row included."""
    cu = [0]
    for parents, _, _ in seqs:
        cu.append(cu[-1] + len(parents))
    cat = lambda i, dtype: torch.tensor([x for s in seqs for x in s[i]], dtype=dtype)
    return rk.TreeVerifyBatch(torch.tensor(cu), cat(1, torch.int64), cat(0, torch.int64),
                              torch.tensor(greedy), cat(2, torch.bool))


def greedy_case(seed, sizes=GREEDY_SIZES, vocab=V):
    """Random trees whose draft tokens are often the target's argmax; half the rows have integer logits,
    so ties (first maximum wins) are common."""
    g = torch.Generator().manual_seed(seed)
    seqs, rows = [], []
    for b, (n, chain) in enumerate(sizes):
        parents = [-1] + [i - 1 if chain else int(torch.randint(i, (), generator=g)) for i in range(1, n + 1)]
        if b % 2:
            logits = torch.randint(0, 6, (n + 1, vocab), generator=g).float()
        else:
            logits = torch.randn(n + 1, vocab, generator=g)
        tokens = [-1]
        for i in range(1, n + 1):
            hit = float(torch.rand((), generator=g)) < 0.7
            tokens.append(int(logits[parents[i]].argmax()) if hit else int(torch.randint(vocab, (), generator=g)))
        seqs.append((parents, tokens, [False] * (n + 1)))
        rows.append(logits)
    return torch.cat(rows), make_batch(seqs, [True] * len(sizes))


def walk_greedy(rows: list[list[float]], parents: list[int], tokens: list[int]):
    """One sequence in plain Python: (path, next_token, bonus)."""
    cur, path = 0, []
    while True:
        row = rows[cur]
        t = row.index(max(row))
        kids = [i for i, p in enumerate(parents) if p == cur]
        hits = [i for i in kids if tokens[i] == t]
        if not hits:
            return path, t, not kids
        cur = hits[0]
        path.append(cur)


def as_lists(r: rk.TreeVerifyResult):
    return {k: getattr(r, k).cpu().tolist() for k in ("num_accepted", "path", "next_token", "bonus")}


def test_doctests():
    assert doctest.testmod(rk).failed == 0


def test_reference_greedy_matches_an_independent_walk():
    for seed in range(3):
        logits, batch = greedy_case(seed)
        got = rk.rejection_sample_ref(logits, None, batch, [None] * len(GREEDY_SIZES))
        cu = batch.cu_rows.tolist()
        assert got.path.shape == (len(GREEDY_SIZES), got.path.shape[1])
        for b in range(len(GREEDY_SIZES)):
            s, e = cu[b], cu[b + 1]
            path, t, bonus = walk_greedy(logits[s:e].tolist(), batch.parents[s:e].tolist(), batch.tokens[s:e].tolist())
            assert got.num_accepted[b] == len(path)
            assert got.path[b].tolist() == path + [-1] * (got.path.shape[1] - len(path))
            assert (int(got.next_token[b]), bool(got.bonus[b])) == (t, bonus)
        # the case cannot pass for the wrong reason: deep acceptances, bonus and recovered tokens all occur
        assert got.num_accepted.max() >= 4 and got.bonus.any() and not got.bonus.all()


def chain_rule(logits, draft):
    """Greedy verification of a chain as it was written before trees: the longest prefix of the draft
    equal to the target's argmax, then the argmax after it (a bonus token when the whole draft was)."""
    k = draft.shape[0]
    target = logits.argmax(-1)
    n = int(torch.cumprod(target[:k] == draft, dim=0).sum())
    return n, target[:n + 1].tolist(), n == k


def test_reference_greedy_chains_equal_the_chain_rule():
    g = torch.Generator().manual_seed(0)
    seqs, rows, want = [], [], []
    for k in [1, 3, 5, 7] * 4:
        logits = torch.randn(k + 1, V, generator=g)
        n_right = int(torch.randint(k + 1, (), generator=g))
        draft = logits[:k].argmax(-1)
        draft[n_right:] = torch.randint(V, (k - n_right,), generator=g)
        want.append(chain_rule(logits, draft))
        seqs.append(([-1] + list(range(k)), [-1] + draft.tolist(), [False] * (k + 1)))
        rows.append(logits)
    got = rk.rejection_sample_ref(torch.cat(rows), None, make_batch(seqs, [True] * len(seqs)), [None] * len(seqs))
    for b, w in enumerate(want):
        n = int(got.num_accepted[b])
        tokens = [seqs[b][1][r] for r in got.path[b, :n].tolist()] + [int(got.next_token[b])]
        assert (n, tokens, bool(got.bonus[b])) == w
    assert {w[2] for w in want} == {True, False}


def test_plain_rows_are_plain_decoding():
    probs = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(0)), -1)
    batch = make_batch([([-1], [-1], [False])] * 3, [True, False, False])
    gens = [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
    got = rk.rejection_sample_ref(probs, None, batch, gens)
    assert got.num_accepted.tolist() == [0, 0, 0] and got.bonus.all() and got.path.tolist() == [[-1]] * 3
    from specfleet_engine.sampling import sample_from
    assert got.next_token[0] == probs[0].argmax()
    assert got.next_token[1] == sample_from(probs[1:2], torch.Generator().manual_seed(5))[0]


def test_greedy_argmax_is_what_the_reference_returns_for_plain_greedy_rows():
    """The engine's shortcut for plain greedy decoding (no drafts, every sequence greedy) returns
    rejection_sample_ref's answer, field for field."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index, as argmax takes it
    batch = make_batch([([-1], [-1], [False])] * 4, [True] * 4)
    ref = rk.rejection_sample_ref(logits, None, batch, [None] * 4)
    got = rk.greedy_argmax(logits, [0, 1, 2, 3, 4])
    for field in ("num_accepted", "path", "next_token", "bonus"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field


# Sampling: vocabulary SV; the target is a fixed function of the context (up to 3 tokens after the prompt)
SV = 6
TREE = [-1, 0, 0, 0, 1, 1, 2, 4]  # root; 3 children of the root; 2 under row 1; 1 under row 2; row 7 at depth 3
FIXED_TOKENS = [-1, 0, 3, 5, 1, 2, 0, 4]  # deterministic drafts, distinct siblings
DEPTH = [0, 1, 1, 1, 2, 2, 2, 3]


def _table(seed):
    """[SV + 1, SV + 1, SV + 1, SV]: a distribution per context (c1, c2, c3), SV = no token; half of them
    with one token at probability 0."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(SV + 1, SV + 1, SV + 1, SV, generator=g) ** 2 + 0.01
    zero = torch.randint(SV, (SV + 1, SV + 1, SV + 1, 1), generator=g)
    keep = (torch.rand(SV + 1, SV + 1, SV + 1, 1, generator=g) < 0.5).float()
    w = w.scatter(-1, zero, w.gather(-1, zero) * keep)
    return w / w.sum(-1, keepdim=True)


TARGET, DRAFT = _table(1), _table(2)


def _at(table, ctx):  # ctx: [..., 3] -> [..., SV]
    return table[ctx[..., 0], ctx[..., 1], ctx[..., 2]]


def sampling_case(n, mode, seed):
    """n copies of TREE: "onehot" = FIXED_TOKENS with q one-hot; "q" = each node's children drawn without
    replacement from DRAFT given its context (q_j: q with earlier siblings zeroed, renormalised).
    Returns (target_probs [n * 8, SV], draft_probs or None, batch, tokens [n, 8])."""
    g = torch.Generator().manual_seed(seed)
    rows = len(TREE)
    ctx = torch.full((n, rows, 3), SV)
    tokens = torch.full((n, rows), -1)
    dp = torch.zeros(n, rows, SV)
    for u in range(rows):
        kids = [c for c in range(rows) if TREE[c] == u]
        q = _at(DRAFT, ctx[:, u])
        for c in kids:
            if mode == "q":
                x = torch.multinomial(q, 1, generator=g)[:, 0]
                dp[:, c] = q
                q = q.scatter(1, x[:, None], 0.0)
                q = q / q.sum(1, keepdim=True)
            else:
                x = torch.full((n,), FIXED_TOKENS[c])
            tokens[:, c] = x
            ctx[:, c] = ctx[:, u]
            ctx[:, c, DEPTH[c] - 1] = x
    batch = rk.TreeVerifyBatch(torch.arange(0, n * rows + 1, rows), tokens.flatten(), torch.tensor(TREE * n),
                               torch.zeros(n, dtype=torch.bool),
                               torch.tensor([False] + [mode == "q"] * (rows - 1)).repeat(n))
    return _at(TARGET, ctx).reshape(-1, SV), dp.reshape(-1, SV) if mode == "q" else None, batch, tokens


def first_two(res: rk.TreeVerifyResult, tokens, seed):
    """The first two tokens emitted: when the step emitted one, the next step (plain decoding from the
    target) supplies the second."""
    n, path, nxt = res.num_accepted.cpu(), res.path.cpu().clamp_min(0), res.next_token.cpu()
    at = lambda j: tokens.gather(1, path[:, j:j + 1])[:, 0]
    first = torch.where(n >= 1, at(0), nxt)
    cont = torch.multinomial(TARGET[first, SV, SV], 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    second = torch.where(n >= 2, at(1), torch.where(n == 1, nxt, cont))
    return first, second


JOINT = (TARGET[SV, SV, SV][:, None] * TARGET[:SV, SV, SV]).flatten()  # p(a) p(b | a), cell a * SV + b


def chi2_bound(df, z=4.5):
    """Wilson-Hilferty: the chi-square quantile at normal deviate z (4.5: p ~ 3e-6)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_vs(counts, probs):
    """(statistic, bound) for counts against probabilities; cells expected below 5 pooled; a count in a cell
    of probability 0 is an outright failure."""
    counts, probs = counts.double(), probs.double()
    total = counts.sum()
    assert counts[probs == 0].sum() == 0, f"tokens of probability 0 were emitted: {counts.tolist()}"
    small = (probs * total < 5) & (probs > 0)
    c = torch.cat([counts[(probs * total >= 5)], counts[small].sum()[None]])
    e = torch.cat([probs[(probs * total >= 5)], probs[small].sum()[None]]) * total
    c, e = c[e > 0], e[e > 0]
    return float(((c - e) ** 2 / e).sum()), chi2_bound(len(c) - 1)


def chi2_two_sample(a, b):
    """(statistic, bound) that counts a and b come from one distribution."""
    a, b = a.double(), b.double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    stat = ((a * math.sqrt(nb / na) - b * math.sqrt(na / nb)) ** 2 / (a + b)).sum()
    return float(stat), chi2_bound(len(a) - 1)


def joint_counts(res, tokens, seed):
    first, second = first_two(res, tokens, seed)
    return torch.bincount(first * SV + second, minlength=SV * SV)


@pytest.mark.parametrize("mode", ["onehot", "q"])
def test_reference_sampling_is_lossless(mode):
    n = 20000
    tp, dp, batch, tokens = sampling_case(n, mode, seed=3)
    res = rk.rejection_sample_ref(tp, dp, batch, [torch.Generator().manual_seed(4)] * n)
    joint = joint_counts(res, tokens, 5)
    stat, bound = chi2_vs(joint, JOINT)
    assert stat < bound, f"first two tokens off the target's joint: chi2 {stat:.1f} >= {bound:.1f}"
    stat, bound = chi2_vs(joint.view(SV, SV).sum(1), TARGET[SV, SV, SV])
    assert stat < bound, f"first token off p(root): chi2 {stat:.1f} >= {bound:.1f}"
    # not lossless by accepting nothing: depths 1, 2 and 3, bonus and recovered tokens all occur
    acc = torch.bincount(res.num_accepted, minlength=4)
    assert (acc > n / 200).all(), acc.tolist()
    assert res.bonus.any() and not res.bonus.all()
    # later siblings are tried (and accepted): some paths start at rows 2 and 3
    assert {2, 3} <= set(res.path[:, 0].tolist())


def test_rows_without_q_are_one_hot():
    """draft_probs rows whose has_q is False are never read: the same as q one-hot (draft_probs None)."""
    n = 500
    tp, dp, batch, _ = sampling_case(n, "q", seed=7)
    batch.has_q[:] = False
    a = rk.rejection_sample_ref(tp, dp, batch, [torch.Generator().manual_seed(8)] * n)
    b = rk.rejection_sample_ref(tp, None, batch, [torch.Generator().manual_seed(8)] * n)
    assert as_lists(a) == as_lists(b)
    batch.has_q[:] = True
    c = rk.rejection_sample_ref(tp, dp, batch, [torch.Generator().manual_seed(8)] * n)
    assert as_lists(a) != as_lists(c)


def test_an_empty_residual_falls_back_to_the_target_row():
    """Round-off stands in as a root row of mass 0.3, all on the draft token: a rejection leaves nothing,
    so the recovered token comes from the target row; two siblings: the second is tried against it."""
    p = torch.tensor([[0.0, 0.3, 0.0, 0.0], [0.25] * 4, [0.25] * 4])
    batch = make_batch([([-1, 0, 0], [-1, 1, 1], [False] * 3)], [False])
    outcomes = set()
    for s in range(60):
        r = rk.rejection_sample_ref(p, None, batch, [torch.Generator().manual_seed(s)])
        outcomes.add((int(r.num_accepted[0]), int(r.path[0, 0]), int(r.next_token[0]), bool(r.bonus[0])))
    rejected = {o for o in outcomes if o[0] == 0}
    assert rejected == {(0, -1, 1, False)}  # both siblings rejected, token 1 from the target row
    assert {o[1] for o in outcomes if o[0] == 1} == {1, 2}  # the second sibling was tried and accepted


def test_bad_input_is_named():
    logits, batch = greedy_case(0, [(3, False), (2, True)])
    gens = [None, None]
    with pytest.raises(ValueError, match="target_probs has 6 rows but cu_rows ends at 7"):
        rk.rejection_sample_ref(logits[:6], None, batch, gens)
    bad = rk.TreeVerifyBatch(**{**vars(batch), "parents": torch.tensor([-1, 0, 2, 1, -1, 0, 1])})
    with pytest.raises(ValueError, match="topological.*row 2 \\(local 2\\) has parent 2"):
        rk.rejection_sample_ref(logits, None, bad, gens)
    bad = rk.TreeVerifyBatch(**{**vars(batch), "parents": torch.tensor([-1, 0, 0, 1, 0, 0, 1])})
    with pytest.raises(ValueError, match="root row 4 must have parent -1"):
        rk.rejection_sample_ref(logits, None, bad, gens)
    bad = rk.TreeVerifyBatch(**{**vars(batch), "cu_rows": torch.tensor([0, 4, 4])})
    with pytest.raises(ValueError, match="cu_rows must rise strictly"):
        rk.rejection_sample_ref(logits, None, bad, gens)
    with pytest.raises(ValueError, match="draft_probs is None"):
        rk.rejection_sample_ref(logits, None, rk.TreeVerifyBatch(**{**vars(batch), "has_q": torch.ones(7, dtype=bool)}),
                                gens)
    with pytest.raises(ValueError, match="draft_probs must be \\[7, 111\\]"):
        rk.rejection_sample_ref(logits, logits[:5], batch, gens)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rk.rejection_sample_ref(logits, None, rk.TreeVerifyBatch(**{**vars(batch), "tokens": batch.tokens + V}),
                                gens)
    with pytest.raises(ValueError, match="one entry per sequence"):
        rk.rejection_sample_ref(logits, None, batch, [None])


def test_dispatcher_uses_the_reference_off_cuda(monkeypatch):
    assert rk.use_triton is ta.use_triton
    monkeypatch.setenv(ta.KERNELS_ENV, "torch")
    tp, dp, batch, _ = sampling_case(50, "q", seed=1)
    a = rk.rejection_sample(tp, dp, batch, [torch.Generator().manual_seed(2)] * 50)
    b = rk.rejection_sample_ref(tp, dp, batch, [torch.Generator().manual_seed(2)] * 50)
    assert as_lists(a) == as_lists(b)


def two_rejections_case(n):
    """n sequences of a root and two children whose tokens (0, 1) have target probability 0, so both are
    rejected whatever the uniforms. The residual after the first, normalised, is [0, 0, 0, 1]; minus q2 it
    leaves token 3 alone. Left unnormalised ([0, 0, 0, 0.5]) it would leave nothing, and the fallback to
    the target row would emit token 2 half the time."""
    p = torch.tensor([0.0, 0.0, 0.5, 0.5])
    q = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0], [0.0, 0.4, 0.0, 0.6]])  # root (unused), q1, q2
    tp, dp = torch.stack([p, p, p]).repeat(n, 1), q.repeat(n, 1)
    return tp, dp, make_batch([([-1, 0, 0], [-1, 0, 1], [False, True, True])] * n, [False] * n)


def compare_triton(device: str, n_sampled: int, n_ref: int) -> dict:
    """Greedy: Triton equals the reference exactly (several vocabulary chunks); sampling: Triton lossless,
    and num_accepted and next_token distributed as the reference's. Returns what the tests assert on."""
    out = {"greedy_equal": [], "accepted": 0}
    for seed in range(2):
        logits, batch = greedy_case(seed)
        gens = [None] * len(GREEDY_SIZES)
        ref = as_lists(rk.rejection_sample_ref(logits, None, batch, gens))
        got = as_lists(rk.rejection_sample_triton(logits.to(device), None, batch, gens))
        out["greedy_equal"].append(ref == got)
        out["accepted"] += sum(ref["num_accepted"])
    tp, dp, batch = two_rejections_case(64)
    out["two_rejections"] = {name: as_lists(fn(tp.to(dev), dp.to(dev), batch, [torch.Generator().manual_seed(16)] * 64))
                             for name, fn, dev in (("ref", rk.rejection_sample_ref, "cpu"),
                                                   ("triton", rk.rejection_sample_triton, device))}
    for mode in ("onehot", "q"):
        tp, dp, batch, tokens = sampling_case(n_sampled, mode, seed=11)
        batch.has_q.view(n_sampled, -1)[1::2] = False  # q given but one-hot for every other sequence: still lossless
        tri = rk.rejection_sample_triton(tp.to(device), dp.to(device) if dp is not None else None, batch,
                                         [torch.Generator().manual_seed(12)] * n_sampled)
        tp, dp, batch, _ = sampling_case(n_ref, mode, seed=14)
        batch.has_q.view(n_ref, -1)[1::2] = False
        ref = rk.rejection_sample_ref(tp, dp, batch, [torch.Generator().manual_seed(15)] * n_ref)
        out[mode] = {"lossless": chi2_vs(joint_counts(tri, tokens, 13), JOINT),
                     "accepted": chi2_two_sample(torch.bincount(tri.num_accepted.cpu(), minlength=4),
                                                 torch.bincount(ref.num_accepted, minlength=4)),
                     "next_token": chi2_two_sample(torch.bincount(tri.next_token.cpu(), minlength=SV),
                                                   torch.bincount(ref.next_token, minlength=SV)),
                     "bonus_rate": [float(tri.bonus.float().mean()), float(ref.bonus.float().mean())]}
    return out


_SUBPROCESS = """
import json, sys
sys.path.insert(0, {testdir!r})
from test_rejection_kernel import compare_triton
from specfleet_engine.kernels import rejection as rk
rk.BLOCK_V = 32  # several chunks and a ragged tail over vocab 111
print(json.dumps(compare_triton("cpu", 400, 6000)))
"""


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_interpreted(_SUBPROCESS.format(testdir=os.path.dirname(__file__)))


def check_comparison(out):
    assert out["greedy_equal"] == [True, True] and out["accepted"] > 20
    for name, r in out["two_rejections"].items():  # the residual renormalised between siblings
        assert r["num_accepted"] == [0] * 64 and r["next_token"] == [3] * 64 and not any(r["bonus"]), (name, r)
    for mode in ("onehot", "q"):
        for what in ("lossless", "accepted", "next_token"):
            stat, bound = out[mode][what]
            assert stat < bound, f"{mode} {what}: chi2 {stat:.1f} >= {bound:.1f}"


def test_triton_interpreted_matches_reference(interpreted):
    check_comparison(interpreted)


@pytest.mark.parametrize("target_dtype,block_v,block_r", [("*bf16", 1024, 64), ("*fp32", 128, 1024)])
def test_triton_compiles_for_cuda(target_dtype, block_v, block_r):
    """The interpreter runs the kernel as Python; this compiles it for an H100/H200 (sm_90) through ptxas,
    which catches what only the compiler rejects, on a machine without a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's CUDA backend (ptxas) is not installed")
    sig = {"TP": target_dtype, "DP": "*fp32", "TOK": "*i64", "PAR": "*i32", "HASQ": "*i8", "CU": "*i64",
           "GREEDY": "*i8", "SEED": "*i64", "RES": "*fp32", "NACC": "*i64", "PATH": "*i64", "NEXT": "*i64",
           "BONUS": "*i8", "V": "i32", "s_tp": "i32", "s_dp": "i32", "max_depth": "i32",
           "BLOCK_V": "constexpr", "BLOCK_R": "constexpr"}
    src = ASTSource(fn=rk._kernel(), signature=sig, constexprs={"BLOCK_V": block_v, "BLOCK_R": block_r})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert out.asm["cubin"] and "bar.sync" in out.asm["ptx"]  # the barrier before the scratch row is read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cuda_matches_reference():
    check_comparison(compare_triton("cuda", 20000, 20000))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cuda_greedy_at_serving_size():
    """B 64, a real vocabulary (49152, bf16 logits): exact against the reference."""
    g = torch.Generator().manual_seed(0)
    sizes = [(int(torch.randint(0, 12, (), generator=g)), b % 3 == 0) for b in range(64)]
    logits, batch = greedy_case(1, sizes, vocab=49152)
    logits = logits.to(torch.bfloat16)
    ref = as_lists(rk.rejection_sample_ref(logits, None, batch, [None] * 64))
    assert as_lists(rk.rejection_sample_triton(logits.cuda(), None, batch, [None] * 64)) == ref
