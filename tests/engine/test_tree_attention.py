"""Tree attention for verification (kernels/tree_attention.py): the torch reference against a naive
token-by-token computation, and the Triton kernel (TRITON_INTERPRET=1 on the CPU, in a subprocess so
the setting does not leak into this process) against the reference."""

import math
import os
import subprocess
import sys

import pytest
import torch
from specfleet_engine.kernels import tree_attention as ta
from specfleet_engine.testing import run_interpreted

BLOCK = 16
TREE = [-1, 0, 0, 1, 1, 2, -1, 6, 3]  # 9 nodes, two roots, branching at 0, 1 and 6
CHAIN5 = [-1, 0, 1, 2, 3]
WIDE64 = [-1] + [int(torch.randint(i, (1,), generator=torch.Generator().manual_seed(i))) for i in range(1, 64)]
WIDE100 = [-1] + [int(torch.randint(-1, i, (1,), generator=torch.Generator().manual_seed(i))) for i in range(1, 100)]
# (name, head_dim, [(prefix_len, parents), ...]): ragged batches mixing a tree, a chain and plain rows
CASES = [
    ("mixed", 64, [(37, TREE), (5, CHAIN5), (0, [-1]), (16, [-1, 0, 0])]),
    ("empty-prefix-tree", 64, [(0, TREE), (33, [-1])]),
    ("dim80", 80, [(21, [-1, 0, 0, 2]), (48, CHAIN5[:3]), (7, [-1])]),
    ("tree64", 64, [(19, WIDE64), (3, [-1, 0])]),
    ("tree100-roots", 32, [(0, WIDE100), (2, [-1])]),  # the tree spans two tiles of nodes, late roots
]
# the kernel alone: prefixes long enough to be split across programs (the merge of partial
# softmaxes, a split past a short sequence's prefix), and the cache in the engine's layout
KERNEL_CASES = CASES + [
    ("split", 64, [(700, TREE), (300, [-1])]),
    ("engine-layout", 64, [(37, TREE), (5, CHAIN5), (0, [-1])]),
    ("engine-layout-split", 16, [(1500, CHAIN5)]),
]


def make_case(head_dim, seqs, n_heads=4, n_kv=2, seed=0, engine_layout=False):
    """Inputs with shuffled, non-contiguous physical blocks and spare blocks full of noise.
    engine_layout: the caches as views of the model's [n_kv, slots, head_dim] tensors (strided)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-p // BLOCK) for p, _ in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(max(need), 1), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    parents = [p for _, ps in seqs for p in ps]
    total = len(parents)
    r = lambda *s: torch.randn(*s, generator=g)
    if engine_layout:
        kc, vc = (r(n_kv, num_blocks * BLOCK, head_dim).view(n_kv, num_blocks, BLOCK, head_dim).permute(1, 2, 0, 3)
                  for _ in "kv")
        assert not kc.is_contiguous()
    else:
        kc, vc = r(num_blocks, BLOCK, n_kv, head_dim), r(num_blocks, BLOCK, n_kv, head_dim)
    return {"q": r(total, n_heads, head_dim), "k_cache": kc, "v_cache": vc, "block_tables": tables,
            "prefix_lens": torch.tensor([p for p, _ in seqs], dtype=torch.int32),
            "k_tree": r(total, n_kv, head_dim), "v_tree": r(total, n_kv, head_dim),
            "tree_parents": torch.tensor(parents, dtype=torch.int32),
            "cu_nodes": torch.tensor([0] + [sum(len(ps) for _, ps in seqs[:i + 1]) for i in range(len(seqs))],
                                     dtype=torch.int32),
            "scale": 1 / math.sqrt(head_dim)}


def naive(q, k_cache, v_cache, block_tables, prefix_lens, k_tree, v_tree, tree_parents, cu_nodes, scale):
    """One (node, head) at a time: prefix token by token through the table, ancestors by walking up."""
    out = torch.zeros_like(q)
    n_heads, n_kv = q.shape[1], k_cache.shape[2]
    for b in range(len(prefix_lens)):
        s, e = int(cu_nodes[b]), int(cu_nodes[b + 1])
        for i in range(s, e):
            seen, j = [], i - s
            while j >= 0:
                seen.append(s + j)
                j = int(tree_parents[s + j])
            for h in range(n_heads):
                kvh = h // (n_heads // n_kv)
                keys, vals = [], []
                for pos in range(int(prefix_lens[b])):
                    blk = int(block_tables[b, pos // BLOCK])
                    keys.append(k_cache[blk, pos % BLOCK, kvh])
                    vals.append(v_cache[blk, pos % BLOCK, kvh])
                keys += [k_tree[n, kvh] for n in seen]
                vals += [v_tree[n, kvh] for n in seen]
                w = torch.softmax(torch.stack(keys).double() @ q[i, h].double() * scale, 0)
                out[i, h] = (w[:, None] * torch.stack(vals).double()).sum(0).float()
    return out


def test_tree_mask_chain_is_causal_and_tree_follows_ancestry():
    assert torch.equal(ta.tree_mask([-1, 0, 1, 2]), torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(ta.tree_mask([-1]), torch.ones(1, 1, dtype=torch.bool))
    m = ta.tree_mask(TREE)
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {6}, 7: {6, 7},
            8: {0, 1, 3, 8}}
    assert {i: set(m[i].nonzero().flatten().tolist()) for i in range(len(TREE))} == want


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2], [-1, 0, 3, 1]])
def test_tree_mask_rejects_non_topological_parents(parents):
    with pytest.raises(ValueError, match="topological"):
        ta.tree_mask(parents)


@pytest.mark.parametrize("name,head_dim,seqs", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_naive(name, head_dim, seqs):
    case = make_case(head_dim, seqs)
    got = ta.tree_attention_ref(**case)
    torch.testing.assert_close(got, naive(**case), atol=1e-5, rtol=1e-5)


def test_reference_single_node_is_plain_decoding():
    """One node with no tree: ordinary attention over the prefix plus the new token."""
    case = make_case(64, [(37, [-1])])
    k = torch.cat([case["k_cache"][case["block_tables"][0, :3].long()].reshape(-1, 2, 64)[:37], case["k_tree"]])
    v = torch.cat([case["v_cache"][case["block_tables"][0, :3].long()].reshape(-1, 2, 64)[:37], case["v_tree"]])
    want = torch.nn.functional.scaled_dot_product_attention(
        case["q"].transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(ta.tree_attention_ref(**case), want, atol=1e-5, rtol=1e-5)


def test_bad_input_is_named():
    case = make_case(64, [(5, CHAIN5)])
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ta.tree_attention_ref(**{**case, "q": case["q"][:, :3]})
    with pytest.raises(ValueError, match="cu_nodes"):
        ta.tree_attention_ref(**{**case, "cu_nodes": torch.tensor([0, 4], dtype=torch.int32)})
    with pytest.raises(ValueError, match="block_tables holds"):
        ta.tree_attention_ref(**{**case, "prefix_lens": torch.tensor([17], dtype=torch.int32)})


def test_dispatcher_uses_the_reference_off_cuda_and_when_forced(monkeypatch):
    assert not ta.use_triton(torch.device("cpu"))
    monkeypatch.setenv(ta.KERNELS_ENV, "torch")
    assert not ta.use_triton(torch.device("cuda"))
    case = make_case(64, [(5, CHAIN5)])
    assert torch.equal(ta.tree_attention(**case), ta.tree_attention_ref(**case))


def test_importing_the_engine_does_not_import_triton():
    """Triton comes in with the kernel's own module, at its first launch; the check after it makes sure
    this test looks at the right sys.modules."""
    code = ("import sys\n"
            "import specfleet_engine, specfleet_engine.engine, specfleet_engine.model\n"
            "from specfleet_engine.kernels import rejection, tree_attention\n"
            "assert 'triton' not in sys.modules, 'importing the engine imported triton'\n"
            "tree_attention._kernel()\n"
            "assert 'triton' in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-4000:]


_SUBPROCESS = """
import json, sys, torch
sys.path.insert(0, {testdir!r})
from test_tree_attention import KERNEL_CASES, make_case
from specfleet_engine.kernels import tree_attention as ta
errs = {{}}
for name, head_dim, seqs in KERNEL_CASES:
    case = make_case(head_dim, seqs, seed=1, engine_layout=name.startswith("engine-layout"))
    errs[name] = (ta.tree_attention_triton(**case) - ta.tree_attention_ref(**case)).abs().max().item()
print(json.dumps(errs))
"""


@pytest.fixture(scope="module")
def triton_errors():
    pytest.importorskip("triton")
    return run_interpreted(_SUBPROCESS.format(testdir=os.path.dirname(__file__)))


@pytest.mark.parametrize("name", [c[0] for c in KERNEL_CASES])
def test_triton_interpreted_matches_reference(triton_errors, name):
    assert triton_errors[name] < 1e-4, triton_errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,head_dim,seqs", KERNEL_CASES + [("dim128", 128, [(300, TREE), (1000, [-1])])],
                         ids=[c[0] for c in KERNEL_CASES] + ["dim128"])
def test_triton_cuda_matches_reference(name, head_dim, seqs, dtype):
    case = make_case(head_dim, seqs, engine_layout=name.startswith("engine-layout"))
    case = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    for k in ("q", "k_cache", "v_cache", "k_tree", "v_tree"):
        case[k] = case[k].to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ta.tree_attention_triton(**case).float(), ta.tree_attention_ref(**case).float(),
                               atol=tol, rtol=tol)


def _compile_for_h200(dtype: str, split: bool, group: int, head_dim: int):
    """The kernel compiled ahead of time for sm_90 (the H200) with the ptxas Triton ships: no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = ta._kernel()
    const = {"GROUP": group, "N_HEADS": group * 8, "BLOCK_SIZE": 16, "HEAD_DIM": head_dim,
             "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "BLOCK_M": 64, "BLOCK_N": ta.BLOCK_N,
             "SPLIT": split, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    ptrs = {"Q": f"*{dtype}", "KC": f"*{dtype}", "VC": f"*{dtype}", "KT": f"*{dtype}", "VT": f"*{dtype}",
            "OUT": f"*{dtype}", "PART": "*fp32", "ML": "*fp32", "BT": "*i32", "PL": "*i32", "CU": "*i32",
            "ANC": "*i8", "scale": "fp32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "i32") for n in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@pytest.mark.parametrize("dtype,split,group,head_dim", [("bf16", False, 4, 128), ("bf16", True, 4, 128),
                                                        ("fp32", True, 3, 64)])
def test_kernel_compiles_for_the_h200(dtype, split, group, head_dim):
    """What the interpreter cannot see (dot shapes and precisions, types a GPU build rejects) fails here."""
    pytest.importorskip("triton.backends.nvidia")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter replaces the compiler")
    compiled = _compile_for_h200(dtype, split, group, head_dim)
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 227 * 1024  # an H200 SM's shared memory
