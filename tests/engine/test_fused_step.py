"""The fused decoder step (kernels/csrc/decoder_step.cpp through model.py's FusedStack): a few-row
forward's layers in one C++ call give what the layer-by-layer Python path gives, on every CPU
kernel path, for decoding, verify chains, trees, several sequences and gathered contexts."""

from __future__ import annotations

import copy

import pytest
import torch

from specfleet_engine import model as model_mod
from specfleet_engine.engine import Engine
from specfleet_engine.kernels import cpu_gemm
from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata
from specfleet_engine.model import PREFILL_ROWS, fuse_layers, interleave_rope
from specfleet_engine.quant import pack_linears, quantize_int8
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import repeating_prompts, tiny_model

SHAPES = {
    "gqa": dict(),  # 4 heads over 2 KV heads of 16
    "odd": dict(dim=48, n_heads=4, n_kv_heads=1, head_dim=12, intermediate_size=100),  # no multiple of 16 or 32
    "qwen2": dict(attention_bias=True, architecture="qwen2", n_kv_heads=4),  # a QKV bias
    "wide": dict(dim=96, n_heads=6, n_kv_heads=2, head_dim=48),  # heads of three 16-float vectors
}


def fused_model(shape: str = "gqa", weights: str = "fp32", seed: int = 3):
    model = tiny_model(seed=seed, scale=4.0, **SHAPES[shape])
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # norms of their own (a mixed-up norm must show)
        if name.endswith("norm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
    model = interleave_rope(model)
    if weights == "int8":
        quantize_int8(model, backend="kernel")
    else:
        assert pack_linears(model, force=True), "the CPU kernel did not build"
    assert fuse_layers(model), "fuse_layers refused a model on the CPU kernel"
    return model


def prefilled(model, prompts: list[list[int]], interleave: bool = True):
    """A cache holding `prompts` (prefilled layer by layer). With `interleave`, the sequences'
    blocks alternate, so that every context but the first is gathered, not one run of slots."""
    cache = PagedKVCache.for_model(model.args, 1024, 4)
    tables = [BlockTable(cache) for _ in prompts]
    fused, model.fused = model.fused, None
    with torch.inference_mode():
        if interleave:
            for i in range(max(len(p) for p in prompts)):  # a token a sequence at a time
                pick = [b for b, p in enumerate(prompts) if i < len(p)]
                tokens, meta, _ = batch_metadata([tables[b] for b in pick], [[prompts[b][i]] for b in pick])
                model(tokens, meta, cache.layers)
        else:
            tokens, meta, _ = batch_metadata(tables, prompts)
            model(tokens, meta, cache.layers)
    model.fused = fused
    return cache, tables


def both_paths(model, prompts, new, trees=None, features=(), rows=None):
    """The same forward of `new` tokens after `prompts`, fused and layer by layer, on copies of one
    cache: (fused logits, reference logits, fused cache, reference cache[, features of each])."""
    cache, tables = prefilled(model, prompts)
    ref_cache = copy.deepcopy(cache)
    out = []
    for c, fused in ((cache, model.fused), (ref_cache, None)):
        tabs = [BlockTable(c) for _ in tables]
        for t, src in zip(tabs, tables):
            t.blocks, t.num_tokens = list(src.blocks), src.num_tokens
        tokens, meta, _ = batch_metadata(tabs, new, trees)
        if fused is not None:
            assert fused.takes(meta, c.layers)
        saved, model.fused = model.fused, fused
        try:
            with torch.inference_mode():
                out.append(model(tokens, meta, c.layers, rows, features=features) if features else
                           model(tokens, meta, c.layers, rows))
        finally:
            model.fused = saved
    return out, cache, ref_cache


def assert_same(a, b, tol=2e-4):
    """Close to within float32 rounding: the paths sum in different orders (absolute error scaled
    to the largest value, which grows along the residual stream)."""
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max()) / 10))


def tolerance(weights: str) -> float:
    """assert_same's for a model's weights on the active path: int8 on AVX2 rounds each GEMM's
    input to int16 (int8_linear.cpp's integer tiles), so a float difference between the two paths
    upstream can move an input by one step of its block's scale, about 3e-5 of its largest value,
    and that grows through the layers."""
    return 3e-3 if weights == "int8" and cpu_gemm.active_isa() == "avx2" else 2e-4


CASES = {
    "decode": ([[5, 6, 7, 8, 9, 10, 11]], [[12]], None),
    "chain": ([[5, 6, 7, 8, 9, 10, 11, 12, 13]], [[14, 15, 16, 17, 18]], None),
    "tree": ([[5, 6, 7, 8, 9, 10, 11]], [[12, 13, 14, 15, 16, 17]], [[-1, 0, 0, 1, 1, 2]]),
    # contexts over several 16-row blocks of the attention loops, each ending mid-block
    "long": ([list(range(1, 41)), list(range(3, 51))], [[60], [61, 62, 63]], None),
    # three sequences of different lengths: a decode, a chain and a tree in one forward
    "batch": ([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]],
              [[30], [31, 32, 33, 34], [35, 36, 37, 38]], [None, None, [-1, 0, 0, 2]]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_fused_step_matches_layer_by_layer(ops, case, shape, weights):
    """Logits and the K/V written to the cache match the Python path's (every row of the forward;
    the cache's gathered contexts, several sequences, trees)."""
    model = fused_model(shape, weights)
    prompts, new, trees = CASES[case]
    if trees is not None and len(trees) == 1:
        trees = trees * len(prompts)
    (fused, ref), cache, ref_cache = both_paths(model, prompts, new, trees)
    assert fused.shape == ref.shape == (sum(map(len, new)), model.args.vocab_size)
    assert_same(fused, ref, tolerance(weights))
    for (k, v), (rk, rv) in zip(cache.layers, ref_cache.layers):
        assert_same(k, rk, tolerance(weights))
        assert_same(v, rv, tolerance(weights))


def test_fused_step_returns_the_features_an_eagle_head_reads(ops):
    model = fused_model()
    prompts, new, trees = CASES["batch"]
    (fused, ref), _, _ = both_paths(model, prompts, new, trees, features=(0, 1))
    assert_same(fused[0], ref[0])
    assert fused[1].shape == ref[1].shape == (sum(map(len, new)), 2 * model.args.dim)
    assert_same(fused[1], ref[1])
    (fused, ref), _, _ = both_paths(model, prompts, new, trees, features=(1,))
    assert_same(fused[1], ref[1])


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_the_lm_head_in_the_call_scores_the_rows_asked_for(ops, weights):
    model = fused_model(weights=weights)
    assert model.fused.lm_head, "the packed LM head was not taken into the fused step"
    prompts, new, trees = CASES["batch"]
    rows = torch.tensor([7, 0, 3, 3])  # any order, repeats
    (fused, ref), _, _ = both_paths(model, prompts, new, trees, rows=rows)
    assert fused.shape == (4, model.args.vocab_size)
    assert_same(fused, ref, tolerance(weights))
    with pytest.raises(RuntimeError, match="logits row 99 of 9"):
        both_paths(model, prompts, new, trees, rows=torch.tensor([99]))


def test_every_cpu_path_gives_the_same_step(ops, restore_isa):
    """The GEMMs inside the fused step run the active path: each path the CPU has, forced, still
    matches the layer-by-layer forward (which runs that path too)."""
    model = fused_model("odd", "int8")
    prompts, new, trees = CASES["batch"]
    seen = {}
    for isa in cpu_gemm.available_isas():
        assert cpu_gemm.select_isa(isa) == isa
        (fused, ref), _, _ = both_paths(model, prompts, new, trees)
        assert_same(fused, ref, tolerance("int8"))
        seen[isa] = fused
    assert len(seen) == len(cpu_gemm.available_isas()) >= 1


@pytest.mark.parametrize("method,k,tree", [("none", 0, 1), ("ngram", 4, 1), ("ngram", 6, 3)])
def test_greedy_decoding_through_the_fused_step_is_the_plain_output(ops, method, k, tree):
    """Greedy decoding with the fused step (plain, n-gram chains, n-gram trees) equals plain
    decoding layer by layer, token for token."""
    model = fused_model(seed=5)
    ref = copy.deepcopy(model)
    ref.fused = None
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in repeating_prompts(3, seed=2):
        expected = Engine(ref).generate(prompt, params, "none").output
        engine = Engine(model)
        engine.tree_branching = tree
        calls = []
        real = model.fused.op
        model.fused.op = lambda *a: calls.append(1) or real(*a)
        try:
            got = engine.generate(prompt, params, method, k).output
        finally:
            model.fused.op = real
        assert got == expected
        assert calls, "the engine's forwards never took the fused step"


def test_prefills_and_long_verifies_run_layer_by_layer(ops):
    """A sequence with PREFILL_ROWS new rows or more takes the Python path (its GEMMs are
    compute-bound there and SDPA's flash attention wins)."""
    model = fused_model()
    cache = PagedKVCache.for_model(model.args, 256, 16)
    _, meta, _ = batch_metadata([BlockTable(cache)], [list(range(PREFILL_ROWS))])
    assert not model.fused.takes(meta, cache.layers)
    _, meta, _ = batch_metadata([BlockTable(cache), BlockTable(cache)], [[1] * (PREFILL_ROWS - 1), [2]])
    assert model.fused.takes(meta, cache.layers)


def test_fuse_layers_declines_what_it_cannot_run(ops, monkeypatch):
    # layer-by-layer RoPE (not interleaved), a sliding window, linears off the kernel, the switch
    assert not fuse_layers(tiny_model())
    windowed = interleave_rope(tiny_model(sliding_window=8))
    pack_linears(windowed, force=True)
    assert not fuse_layers(windowed) and windowed.fused is None
    transposed = interleave_rope(tiny_model())
    model_mod.transpose_linears(transposed)
    assert not fuse_layers(transposed)
    packed = interleave_rope(tiny_model())
    pack_linears(packed, force=True)
    monkeypatch.setenv(model_mod.FUSED_ENV, "0")
    assert not fuse_layers(packed)
    monkeypatch.setenv(model_mod.FUSED_ENV, "1")
    assert fuse_layers(packed)  # the same model, switched on


def test_bad_batch_descriptions_are_errors_not_reads_out_of_bounds(ops):
    """The op checks every index it is handed against the cache and the tables."""
    model = fused_model()
    cache = PagedKVCache.for_model(model.args, 64, 16)
    bt = BlockTable(cache)
    tokens, meta, _ = batch_metadata([bt], [[1, 2, 3]])
    x = model.tok_embeddings(tokens)
    f = model.fused
    bad_slot = copy.copy(meta)
    bad_slot.slot_mapping = meta.slot_mapping.clone()
    bad_slot.slot_mapping[1] = 10_000
    with pytest.raises(RuntimeError, match="slot 10000 outside the cache"):
        f(x, bad_slot, cache.layers, ())
    bad_pos = copy.copy(meta)
    bad_pos.positions = meta.positions.clone()
    bad_pos.positions[0] = 10_000
    with pytest.raises(RuntimeError, match="position 10000 outside the RoPE table"):
        f(x, bad_pos, cache.layers, ())
    bad_ctx = copy.copy(meta)
    bad_ctx.context_starts = [None]
    bad_ctx.context_slots = [torch.tensor([0, 1, -5])]
    with pytest.raises(RuntimeError, match="context slot -5 outside the cache"):
        f(x, bad_ctx, cache.layers, ())
    with pytest.raises(RuntimeError, match="feature layer 7 of 2"):
        f(x, meta, cache.layers, (7,))
    f(x, meta, cache.layers, ())  # the good one runs


def test_an_eagle_head_in_its_serving_layout_drafts_what_it_was_trained_to(ops):
    """`EagleHead.serving_layout` (interleaved RoPE, packed linears, its layer through the fused
    step): the same draft logits as the trained layout, the same drafts accepted, and greedy
    output still the target's plain output."""
    from specfleet_engine.proposers.eagle import EagleProposer
    from specfleet_engine.testing import tiny_head

    target = tiny_model(seed=1, scale=4.0)
    head = tiny_head(target, repeating_prompts(6), steps=60)
    fast = copy.deepcopy(head).serving_layout()
    assert fast.stack is not None and fast.rope_cis is not None
    with pytest.raises(RuntimeError, match="serving layout"):
        fast.forward_dense(None, None, None, None)
    # the same rows through both: a catch-up of 9 rows, then a chain of 3
    feats = torch.randn(12, len(head.config.feature_layers) * target.args.dim, generator=torch.Generator().manual_seed(0))
    out = []
    for h in (head, fast):
        cache = PagedKVCache.for_model(h.args, 64, 4)
        bt = BlockTable(cache)
        with torch.inference_mode():
            for rows in (list(range(9)), [9, 10, 11]):
                tokens, meta, _ = batch_metadata([bt], [[t + 3 for t in rows]])
                emb = target.tok_embeddings(tokens)
                out.append(h(emb, h.fused(feats[rows]), meta, cache.layers)[0])
    assert_same(out[0], out[2])
    assert_same(out[1], out[3])

    fast_target = interleave_rope(copy.deepcopy(target))
    assert pack_linears(fast_target, force=True) and fuse_layers(fast_target)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    accepted = 0
    for prompt in repeating_prompts(6)[:3]:
        plain = Engine(target).generate(prompt, params, "none")
        slow = Engine(target, proposers={"eagle": EagleProposer(head, target)}, k_policy="fixed").generate(
            prompt, params, "eagle", 4)
        quick = Engine(fast_target, proposers={"eagle": EagleProposer(fast, fast_target)}, k_policy="fixed").generate(
            prompt, params, "eagle", 4)
        assert quick.output == slow.output == plain.output
        assert quick.stats.num_accepted_tokens == slow.stats.num_accepted_tokens
        accepted += quick.stats.num_accepted_tokens
    assert accepted > 0, "the head drafted nothing that was accepted: the test would show nothing"
