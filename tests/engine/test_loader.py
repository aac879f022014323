import json

import pytest
import torch
from safetensors.torch import save_file

from specfleet_engine.loader import ModelFormatError, load_model, ours_to_hf_state_dict
from specfleet_engine.engine import Engine
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import tiny_model


def save_hf_folder(model, path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.args.to_hf_config()))
    save_file(ours_to_hf_state_dict(model), path / "model.safetensors")


@pytest.mark.parametrize("overrides", [dict(), dict(attention_bias=True, architecture="qwen2", tie_word_embeddings=False)])
def test_hf_folder_round_trip_gives_the_same_outputs(tmp_path, overrides):
    model = tiny_model(seed=5, scale=4.0, **overrides)
    save_hf_folder(model, tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = [3, 5, 7, 11, 13]
    a = Engine(model).generate(prompt, params, "none").output
    b = Engine(loaded).generate(prompt, params, "none").output
    assert a == b


def test_pickle_checkpoints_are_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_model().args.to_hf_config()))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ModelFormatError, match="never unpickles"):
        load_model(str(folder))
    with pytest.raises(ModelFormatError, match="pickle checkpoint"):
        load_model(str(folder / "pytorch_model.bin"))


def test_missing_and_unknown_models_are_named(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        load_model(str(tmp_path / "nope"))
    odd = tmp_path / "weights.npz"
    odd.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="unknown model format"):
        load_model(str(odd))


def test_unsupported_architecture_is_named():
    from specfleet_engine.model import ModelArgs

    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelArgs.from_hf_config({"architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("overrides", [dict(), dict(attention_bias=True, architecture="qwen2", n_kv_heads=4),
                                       dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 64})])
@pytest.mark.parametrize("linears", ["transposed", "packed"])
def test_fast_layouts_match_the_checkpoint_layout(overrides, linears):
    """Interleaved RoPE and transposed or packed linears (what prepare_model applies for fp32)
    change neither the logits nor the greedy output."""
    from specfleet_engine.kv_cache import BlockTable, batch_metadata
    from specfleet_engine.model import interleave_rope, transpose_linears
    from specfleet_engine.quant import PackedLinear, pack_linears

    ref = tiny_model(seed=6, scale=4.0, **overrides)
    fast = interleave_rope(tiny_model(seed=6, scale=4.0, **overrides))
    if linears == "packed":
        assert pack_linears(fast, force=True), "the CPU kernel did not build"
        assert isinstance(fast.output, PackedLinear)
    else:
        transpose_linears(fast)
    prompt = [1, 2, 3, 1, 2, 7, 9, 1, 2]
    logits = []
    for model in (ref, fast):
        engine = Engine(model)
        tokens, meta, _ = batch_metadata([BlockTable(engine.cache)], [prompt])
        logits.append(model(tokens, meta, engine.cache.layers))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    a = Engine(ref).generate(prompt, params, "none").output
    b = Engine(fast).generate(prompt, params, "ngram", 4).output
    assert a == b


def write_gguf(path, alignment=None):
    """A small GGUF file through gguf's own writer: metadata of every kind, a tokenizer's arrays,
    F32, F16 and Q8_0 tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.chat_template", "{{ messages }} ünïcode")
    w.add_array("llama.some_list", [1, 2, 3])
    w.add_bool("llama.flag", True)
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_token_merges([f"a{i} b{i}" for i in range(200)])
    w.add_token_types([1] * 300)
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((4, 7)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 256])
def test_the_gguf_header_reader_agrees_with_ggufs_own(tmp_path, alignment):
    """What the loader reads of a GGUF file (metadata, tensor shapes and data) equals what
    gguf.GGUFReader reads, the tokenizer's arrays counted instead of read."""
    import gguf
    import numpy as np

    from specfleet_engine.gguf_file import GGUFFile

    path = tmp_path / "m.gguf"
    write_gguf(path, alignment)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in ours.lengths:
            assert ours.lengths[key] == len(field.data), key
        else:
            assert ours.metadata[key] == field.contents(), key
    assert ours.lengths == {"tokenizer.ggml.tokens": 300, "tokenizer.ggml.merges": 200, "tokenizer.ggml.token_type": 300}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] == ["a", "b", "c"]
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(s) for s in t.shape) and mine.ggml_type == int(t.tensor_type)
        data = ours.tensor_data(mine)
        assert data.dtype == t.data.dtype and data.shape == t.data.shape and np.array_equal(data, t.data), t.name
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(mine.shape)))
        np.testing.assert_array_equal(ours.dequantized(mine), expected)


def test_a_file_that_is_no_gguf_or_is_cut_short_is_named(tmp_path):
    from specfleet_engine.gguf_file import GGUFFile

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)
    good = tmp_path / "m.gguf"
    write_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:900])
    with pytest.raises(ValueError, match="truncated GGUF header"):
        GGUFFile(cut)


@pytest.mark.slow
def test_a_gguf_tokenizer_converted_once_loads_from_the_cache_the_same(tmp_path, monkeypatch, caplog):
    """The tokenizer converted from SmolLM2's GGUF is kept under the cache folder; the next load
    reads it from there and tokenizes, detokenizes and renders chats exactly as the conversion
    did; a damaged entry is converted again and repaired."""
    from specfleet_engine.loader import load_tokenizer

    monkeypatch.setenv("SPECFLEET_CACHE", str(tmp_path))
    converted = load_tokenizer("smollm2-135m")
    [entry] = (tmp_path / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()

    def same(a, b):
        for text in ["Hello, world! ünïcode 中文 \n\n  spaces\tand tabs", "def f(x):\n    return x**2",
                     "<|im_start|>user\nhi<|im_end|>"]:
            assert a.encode(text) == b.encode(text)
            assert a.decode(a.encode(text)) == b.decode(b.encode(text))
        assert a.chat("Summarize this.", system="Be brief.") == b.chat("Summarize this.", system="Be brief.")
        assert a.eos_token_ids == b.eos_token_ids and a.vocab_size == b.vocab_size

    same(load_tokenizer("smollm2-135m"), converted)
    (entry / "tokenizer.json").write_text("{not json")
    same(load_tokenizer("smollm2-135m"), converted)
    assert "unreadable" in caplog.text
    same(load_tokenizer("smollm2-135m"), converted)  # repaired
