"""The graphed decode and verify step (graphs.py). On the CPU, SPECFLEET_CUDA_GRAPHS=eager runs the
same padded, static-shape step a CUDA graph captures, through the Triton tree-attention kernel
(interpreted, in a subprocess): its logits, features and cache writes equal the eager step's,
padding rows write only the scratch block, one graph serves every step of its bucket, and the
engine decodes the same tokens with it. Tests marked `gpu` capture real graphs (bench/gpu_check.sh)."""

import os

import pytest
import torch
from specfleet_engine import graphs
from specfleet_engine.engine import Engine
from specfleet_engine.kernels import tree_attention as ta
from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata
from specfleet_engine.model import AttentionMetadata
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import TINY_ARCHITECTURES, repeating_prompts, run_interpreted, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the test_triton_model batch, less its prefill: two trees, a causal run of 2, a chain of 3
TREES = [[-1, 0, 0, 1, 2, -1], None, [-1, 0, 1], None]
BRANCHY = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]]


def verify_batch(cache: PagedKVCache, model, seed: int = 0, trees=TREES):
    """A verify step over prefixes in interleaved blocks: (tokens, metadata) of `trees`' nodes."""
    tables = [BlockTable(cache) for _ in trees]
    prompts = repeating_prompts(len(trees), seed=5)
    for i, bt in enumerate(tables):  # interleaved prefills: each sequence's blocks are not one run
        for chunk in range(0, 20 + 5 * i, 7):
            tokens, meta, _ = batch_metadata([bt], [(prompts[i] * 9)[chunk:chunk + 7]])
            model(tokens, meta, cache.layers)
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, 100, (len(p) if p else 2,), generator=g).tolist() for p in trees]
    tokens, meta, _ = batch_metadata(tables, inputs)
    positions, masks = meta.positions.clone(), []
    for b, parents in enumerate(trees):
        lo, S = meta.cu_seqlens[b], meta.context_slots[b].shape[0]
        if parents is None:
            masks.append(None)
            continue
        n = len(parents)
        positions[lo:lo + n] = S - n + ta.tree_mask(parents).sum(1) - 1
        masks.append(torch.cat([torch.ones(n, S - n, dtype=torch.bool), ta.tree_mask(parents)], dim=1))
    return tokens, AttentionMetadata(positions, meta.slot_mapping, meta.cu_seqlens, meta.context_slots, masks,
                                     meta.context_starts, trees)


def step_against_eager(arch: str, device: str = "cpu", capture: bool = False) -> dict:
    """One verify step graphed and eager on two copies of one cache: the largest differences of
    their logits, features and caches (the scratch block aside), what the padding rows wrote outside
    it, and how many graphs three steps of two buckets made."""
    model = tiny_model(seed=3, scale=4.0, **TINY_ARCHITECTURES[arch]).to(device)
    cache = PagedKVCache.for_model(model.args, 512, block_size=8, dtype=model.dtype, device=device)
    step = graphs.StepGraphs(model, cache, capture=capture)
    scratch = slice(step.scratch_slot, step.scratch_slot + cache.block_size)
    tokens, meta = verify_batch(cache, model)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    eager_cache = [(k.clone(), v.clone()) for k, v in cache.layers]
    rows = torch.tensor([0, 3, 7, 12])
    want, want_feats = model(tokens, meta, eager_cache, rows, features=(0, 1))
    got, got_feats = step(tokens, meta, rows, (0, 1))
    res = {"logits": (got - want).abs().max().item(), "features": (got_feats - want_feats).abs().max().item(),
           "rows": list(got.shape)}
    cache_diff, outside = 0.0, 0
    for (k, v), (ek, ev), (bk, bv) in zip(cache.layers, eager_cache, before):
        for a, e, b in ((k, ek, bk), (v, ev, bv)):
            keep = torch.ones(a.shape[1], dtype=torch.bool, device=a.device)
            keep[scratch] = False
            cache_diff = max(cache_diff, (a[:, keep] - e[:, keep]).abs().max().item())
            outside += int(((a != b)[:, keep].any(0) & ~(e != b)[:, keep].any(0)).sum())
    res["cache"], res["written_outside"] = cache_diff, outside
    res["scratch_written"] = any(bool((k[:, scratch] != bk[:, scratch]).any()) for (k, _), (bk, _)
                                 in zip(cache.layers, before))
    # a second step of the same bucket (16 rows, 4 sequences, trees of up to 8 nodes) reuses the graph
    tokens2, meta2 = verify_batch(cache, model, seed=1, trees=[[-1, 0, 1, 1, 0], None, [-1], None])
    step(tokens2, meta2, None, (0, 1))
    res["graphs_after_same_bucket"] = len(step.graphs)
    tokens3, meta3 = verify_batch(cache, model, seed=2, trees=[[-1] + list(range(15))])
    step(tokens3, meta3, None, (0, 1))
    res["graphs_after_new_bucket"] = len(step.graphs)
    res["stats"] = step.stats
    return res


def engine_outputs(arch: str, graphed: str) -> dict:
    """Greedy outputs of a continuous batch, plain, n-gram chains and n-gram trees, with
    SPECFLEET_CUDA_GRAPHS=`graphed`; and the graph steps' replays."""
    os.environ[graphs.GRAPHS_ENV] = graphed
    model = tiny_model(seed=1, scale=4.0, **TINY_ARCHITECTURES[arch])
    out = {"replays": 0}
    for name, method, branching in (("none", "none", 1), ("ngram", "ngram", 1), ("ngram tree", "ngram", 3)):
        engine = Engine(model, max_kv_tokens=2048, block_size=8, k_policy="fixed", tree_branching=branching)
        seqs = [engine.add(p, SamplingParams(max_tokens=12, ignore_eos=True), method, 4)
                for p in BRANCHY + repeating_prompts(2)]
        while not all(s.finished for s in seqs):
            engine.step()
        out[name] = [s.output for s in seqs]
        out[name + " accepted"] = sum(s.stats.num_accepted_tokens for s in seqs)
        out["replays"] += engine.graphs.stats["replays"] if engine.graphs is not None else 0
    return out


_SUBPROCESS = """
import json, sys
sys.path.insert(0, {testdir!r})
import test_graphs as t
res = {{"step": {{a: t.step_against_eager(a) for a in ("llama", "mha-rope-llama3")}},
        "engine": {{g: t.engine_outputs("llama", g) for g in ("eager", "0")}}}}
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    return run_interpreted(_SUBPROCESS.format(testdir=os.path.dirname(__file__)), kernels="triton", timeout=600)


@pytest.mark.parametrize("arch", ["llama", "mha-rope-llama3"])
def test_the_padded_step_equals_the_eager_step(interpreted, arch):
    res = interpreted["step"][arch]
    assert res["rows"][0] == 4, "logits_indices picked the rows"
    assert res["logits"] < 1e-4 and res["features"] < 1e-4
    assert res["cache"] < 1e-5


@pytest.mark.parametrize("arch", ["llama", "mha-rope-llama3"])
def test_padding_rows_write_only_the_scratch_block(interpreted, arch):
    res = interpreted["step"][arch]
    assert res["scratch_written"], "the 13 rows were padded to 16: three rows should have gone to the scratch"
    assert res["written_outside"] == 0


def test_one_graph_serves_a_bucket(interpreted):
    res = interpreted["step"]["llama"]
    assert res["graphs_after_same_bucket"] == 1
    assert res["graphs_after_new_bucket"] == 2


def test_the_engine_decodes_the_same_tokens_graphed(interpreted):
    graphed, eager = interpreted["engine"]["eager"], interpreted["engine"]["0"]
    assert graphed["replays"] > 0 and eager["replays"] == 0
    for name in ("none", "ngram", "ngram tree"):
        assert graphed[name] == eager[name], name
    assert graphed["ngram"] == graphed["none"] and graphed["ngram tree"] == graphed["none"]
    assert graphed["ngram accepted"] > 0


@pytest.mark.parametrize("n,least,want", [(1, 1, 1), (3, 1, 4), (16, 1, 16), (17, 1, 32), (5, 256, 256), (0, 1, 1)])
def test_bucket(n, least, want):
    assert graphs.bucket(n, least) == want


def test_graphs_apply_only_where_asked(monkeypatch):
    model = tiny_model()
    cache = PagedKVCache.for_model(model.args, 64, block_size=8)
    monkeypatch.delenv(graphs.GRAPHS_ENV, raising=False)
    monkeypatch.setenv(ta.KERNELS_ENV, "triton")
    assert graphs.step_graphs(model, cache) is None, "on for CUDA models only"
    monkeypatch.setenv(graphs.GRAPHS_ENV, "eager")
    step = graphs.step_graphs(model, cache)
    assert step is not None and not step.capture
    assert cache.allocator.num_free == cache.allocator.num_blocks - 1, "the scratch block is kept"
    monkeypatch.setenv(ta.KERNELS_ENV, "torch")
    assert graphs.step_graphs(model, cache) is None, "graphs need the Triton tree attention"
    monkeypatch.setenv(ta.KERNELS_ENV, "triton")
    window = tiny_model(**TINY_ARCHITECTURES["mistral-window"])
    assert graphs.step_graphs(window, PagedKVCache.for_model(window.args, 64, block_size=8)) is None
    monkeypatch.setenv(graphs.GRAPHS_ENV, "0")
    assert graphs.step_graphs(model, cache) is None


def test_prefills_and_untreed_masks_are_not_graphed():
    model = tiny_model()
    cache = PagedKVCache.for_model(model.args, 512, block_size=8)
    step = graphs.StepGraphs(model, cache, capture=False)
    _, meta, _ = batch_metadata([BlockTable(cache)], [list(range(40))])
    assert not step.takes(meta), "40 new rows: a prefill"
    tokens, meta = verify_batch(cache, model)
    assert step.takes(meta)
    untreed = AttentionMetadata(meta.positions, meta.slot_mapping, meta.cu_seqlens, meta.context_slots, meta.masks,
                                meta.context_starts, None)
    assert not step.takes(untreed)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2-bias"])
def test_captured_graphs_replay_the_eager_step_on_cuda(arch):
    res = step_against_eager(arch, device="cuda", capture=True)
    assert res["stats"]["captures"] == 2 and res["stats"]["replays"] == 3
    assert res["logits"] < 1e-3 and res["features"] < 1e-3 and res["cache"] < 1e-4
    assert res["scratch_written"] and res["written_outside"] == 0
