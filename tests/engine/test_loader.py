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
