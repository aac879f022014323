"""The Triton tree-attention path wired into the model (SPECFLEET_KERNELS=triton, TRITON_INTERPRET=1 on
the CPU, in a subprocess so the settings do not leak): a verify forward over hand-built draft trees
gives the torch path's logits, and the engine decodes the same tokens, greedy, with n-gram chains
and with n-gram trees. The subprocess counts the kernel's launches, so a run that never took the path fails."""

import os

import pytest
import torch
from specfleet_engine import model as model_mod
from specfleet_engine.engine import Engine
from specfleet_engine.kernels import tree_attention as ta
from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata
from specfleet_engine.model import AttentionMetadata, laid_out_in, plan_tree
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import TINY_ARCHITECTURES, repeating_prompts, run_interpreted, tiny_model

ARCHS = ["llama", "qwen2-bias", "mha-rope-llama3"]  # the sliding-window model keeps the torch path
ENGINE_ARCHS = ["llama", "mha-rope-llama3"]  # grouped and plain multi-head attention (the interpreter is slow)
TREES = [[-1, 0, 0, 1, 2, -1], None, [-1, 0, 1]]  # a tree, a causal run of 2 (parents implied), a chain


def verify_logits(arch: str, device: str = "cpu") -> torch.Tensor:
    """Logits of one forward mixing two draft trees, a causal run of two rows and a prefill of 40
    (which SDPA takes), over prefixes in shuffled blocks of 8."""
    model = tiny_model(seed=3, scale=4.0, **TINY_ARCHITECTURES[arch]).to(device)
    cache = PagedKVCache.for_model(model.args, 512, block_size=8, dtype=model.dtype, device=device)
    tables = [BlockTable(cache) for _ in range(4)]
    prompts = repeating_prompts(4, seed=5)
    for i, bt in enumerate(tables[:3]):  # interleaved prefills: each sequence's blocks are not one run
        for chunk in range(0, 30, 7):
            tokens, meta, _ = batch_metadata([bt], [(prompts[i] * 9)[chunk:chunk + 7]])
            model(tokens, meta, cache.layers)
    g = torch.Generator().manual_seed(0)
    trees = TREES + [None]
    inputs = [torch.randint(0, 100, (len(p) if p else 2,), generator=g).tolist() for p in TREES] + [prompts[3] * 9]
    inputs[3] = (inputs[3] * 3)[:40]
    tokens, meta, _ = batch_metadata(tables, inputs)
    positions, masks = meta.positions.clone(), []
    for b, parents in enumerate(trees):
        lo, S = meta.cu_seqlens[b], meta.context_slots[b].shape[0]
        if parents is None:
            masks.append(None)
            continue
        n = len(parents)
        depth = ta.tree_mask(parents).sum(1) - 1
        positions[lo:lo + n] = S - n + depth
        masks.append(torch.cat([torch.ones(n, S - n, dtype=torch.bool), ta.tree_mask(parents)], dim=1))
    meta = AttentionMetadata(positions, meta.slot_mapping, meta.cu_seqlens, meta.context_slots, masks,
                             meta.context_starts, trees)
    return model(tokens, meta, cache.layers).cpu()


# prompts whose n-grams branch ("5 6" went on with 7 and with 9), so that n-gram trees have siblings
BRANCHY = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]]


def engine_outputs(arch: str) -> dict:
    """Greedy outputs of a continuous batch: plain, n-gram chains and n-gram trees (3 children a node)."""
    model = tiny_model(seed=1, scale=4.0, **TINY_ARCHITECTURES[arch])
    out = {}
    for name, method, branching in (("none", "none", 1), ("ngram", "ngram", 1), ("ngram tree", "ngram", 3)):
        engine = Engine(model, max_kv_tokens=2048, block_size=8, k_policy="fixed", tree_branching=branching)
        seqs = [engine.add(p, SamplingParams(max_tokens=16, ignore_eos=True), method, 4)
                for p in BRANCHY + repeating_prompts(2)]
        branched = 0
        while not all(s.finished for s in seqs):
            for step in engine.step():
                branched += step.stats is not None and step.stats.num_draft_tokens > step.stats.draft_depth
        out[name] = [s.output for s in seqs]
        out[name + " drafted"] = sum(s.stats.num_draft_tokens for s in seqs)
        out[name + " accepted"] = sum(s.stats.num_accepted_tokens for s in seqs)
        out[name + " branched"] = branched
    return out


_SUBPROCESS = """
import json, sys, torch
sys.path.insert(0, {testdir!r})
import test_triton_model as t
from specfleet_engine import model as model_mod
launches = [0]
real = model_mod.tree_attention_launch
def counted(*a, **kw):
    launches[0] += 1
    return real(*a, **kw)
model_mod.tree_attention_launch = counted
res = {{}}
for arch in t.ARCHS:
    res[arch] = {{"logits": t.verify_logits(arch).tolist()}}
    if arch in t.ENGINE_ARCHS:
        res[arch]["engine"] = t.engine_outputs(arch)
res["launches"] = launches[0]
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def triton_run():
    pytest.importorskip("triton")
    return run_interpreted(_SUBPROCESS.format(testdir=os.path.dirname(__file__)), kernels="triton", timeout=300)


def test_the_triton_path_was_taken(triton_run):
    assert triton_run["launches"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_forward_logits_match_the_torch_path(triton_run, arch, monkeypatch):
    monkeypatch.delenv(ta.KERNELS_ENV, raising=False)
    want = verify_logits(arch)
    got = torch.tensor(triton_run[arch]["logits"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_engine_tokens_match_the_torch_path(triton_run, arch, monkeypatch):
    monkeypatch.delenv(ta.KERNELS_ENV, raising=False)
    got = triton_run[arch]["engine"]
    assert got == engine_outputs(arch)
    assert got["ngram"] == got["none"] and got["ngram tree"] == got["none"]
    assert got["ngram drafted"] > 0, "no draft was made: verification rows were not exercised"


def test_some_draft_was_accepted_and_some_tree_branched(triton_run):
    """Accepted drafts, so that verified rows reached the output, and trees with siblings (random tiny
    models repeat little: counted over the architectures)."""
    assert sum(triton_run[arch]["engine"]["ngram tree branched"] for arch in ENGINE_ARCHS) > 0
    for name in ("ngram", "ngram tree"):
        assert sum(triton_run[arch]["engine"][name + " accepted"] for arch in ENGINE_ARCHS) > 0, name


def test_block_size_detection():
    """The kernel's block tables need a block size the prefixes are laid out in: the cache's or a divisor."""
    slots = torch.tensor([16, 17, 18, 19, 4, 5, 6, 7, 40, 41])  # blocks of 4: 4, 1, 10
    assert laid_out_in(slots, None, 4) and laid_out_in(slots, None, 2) and laid_out_in(slots, None, 1)
    assert not laid_out_in(slots, None, 8)
    assert laid_out_in(torch.arange(24, 40), 24, 8) and not laid_out_in(torch.arange(24, 40), 24, 16)
    meta = AttentionMetadata(torch.zeros(3, dtype=torch.long), torch.tensor([42, 43, 8]), [0, 2, 3],
                             [torch.cat([slots, torch.tensor([42, 43])]), torch.arange(0, 9)], [None, None],
                             [None, 0], None)
    plan = plan_tree(meta, torch.device("cpu"), cache_slots=64)
    assert plan.block_size == 4 and plan.rows is None and plan.prefill == []
    assert plan.batch.block_tables.tolist() == [[4, 1, 10], [0, 1, 0]]
    assert plan.batch.prefix_lens.tolist() == [10, 8]
    assert plan.batch.ancestry.tolist() == [[1, 0], [1, 1], [1, 0]]  # the causal run became a chain


def test_a_mask_without_a_tree_keeps_the_torch_path():
    meta = AttentionMetadata(torch.zeros(2, dtype=torch.long), torch.tensor([4, 5]), [0, 2], [torch.arange(6)],
                             [torch.ones(2, 6, dtype=torch.bool)], [0], None)
    assert plan_tree(meta, torch.device("cpu"), cache_slots=64) is None


def test_cpu_default_path_does_not_plan_a_tree(monkeypatch):
    monkeypatch.delenv(ta.KERNELS_ENV, raising=False)
    model = tiny_model()
    cache = PagedKVCache.for_model(model.args, 64, block_size=8)
    _, meta, _ = batch_metadata([BlockTable(cache)], [[1, 2, 3]])
    plan = model_mod.plan_attention(meta, model.args, model.device, cache.layers[0][0].shape[1])
    assert plan.tree is None and plan.meta is meta
