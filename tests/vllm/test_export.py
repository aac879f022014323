"""`specfleet export-hf`: the bundled model as a Hugging Face folder another engine loads as is,
checked with .venv's own tools (no vLLM): the config against the GGUF's metadata, every tensor
against our loader's dequantized weights, the tokenizer and its chat template against ours, and HF
transformers' greedy answer on the folder against our engine's."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specfleet_engine.hf_export import FILES, export_hf

pytestmark = pytest.mark.slow  # the real model

STRINGS = ["Hello, world!", "  two leading spaces and a tab\there", "def f(x):\n    return x ** 2  # squares",
           "Grüße aus Köln: 3.5 °C, naïve café, 東京 🙂", "<|im_start|>user\nhi<|im_end|>\n"]


def test_the_folder_holds_the_files_an_export_writes_and_nothing_else(export_dir):
    assert sorted(os.listdir(export_dir)) == sorted(FILES)
    assert not [p for p in export_dir.parent.iterdir() if p.name.startswith(".")], "a temporary folder was left"


def test_the_config_is_the_gguf_models(export_dir):
    """Every field vLLM builds the model from, against the GGUF header read here, and as
    transformers reads the file."""
    from transformers import AutoConfig

    from specfleet_engine.gguf_file import GGUFFile
    from specfleet_engine.loader import default_gguf_path

    meta = GGUFFile(default_gguf_path()).metadata
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    expected = {"hidden_size": meta["llama.embedding_length"], "num_hidden_layers": meta["llama.block_count"],
                "num_attention_heads": meta["llama.attention.head_count"],
                "num_key_value_heads": meta["llama.attention.head_count_kv"],
                "intermediate_size": meta["llama.feed_forward_length"], "vocab_size": meta["llama.vocab_size"],
                "max_position_embeddings": meta["llama.context_length"], "rope_theta": meta["llama.rope.freq_base"],
                "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"],
                "head_dim": meta["llama.rope.dimension_count"],
                "bos_token_id": meta["tokenizer.ggml.bos_token_id"], "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
                "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32"}
    assert {k: cfg.get(k) for k in expected} == expected
    assert cfg.get("rope_scaling") is None
    hf = AutoConfig.from_pretrained(export_dir, local_files_only=True)
    assert (type(hf).__name__, hf.hidden_size, hf.num_key_value_heads, hf.tie_word_embeddings) == \
        ("LlamaConfig", 576, 3, True)


def test_the_weights_are_our_loaders_exactly(export_dir):
    """Names and shapes of HF's Llama, float32, no lm_head (tied), and every value the one our
    loader dequantized from the GGUF blocks (read_gguf, which shares no code with the export's path
    through our model's fused layout)."""
    from safetensors import safe_open

    from specfleet_engine.loader import default_gguf_path, read_gguf

    args, raw, _ = read_gguf(default_gguf_path())
    d, kv, ff = args.dim, args.n_kv_heads * args.head_dim, args.intermediate_size
    shapes = {"model.embed_tokens.weight": (args.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                   p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                   p + "mlp.down_proj.weight": (d, ff)}
    with safe_open(export_dir / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(shapes), set(f.keys()) ^ set(shapes)
        for name, shape in shapes.items():
            t = f.get_tensor(name)
            assert (tuple(t.shape), t.dtype) == (shape, torch.float32), name
            assert torch.equal(t, raw[name]), f"{name} differs from our loader's"


def test_the_tokenizer_is_ours(export_dir, ours):
    """The bare tokenizers library and transformers (.venv's) read the folder to our ids on text,
    code, non-Latin text and special tokens, decode them back, and render our chat prompts."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = ours.tokenizer
    bare = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    for s in STRINGS:
        ids = tokenizer.encode(s)
        assert bare.encode(s, add_special_tokens=False).ids == ids, s
        assert hf.encode(s, add_special_tokens=False) == ids, s
        assert bare.decode(ids, skip_special_tokens=False) == s
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
    convo = [{"role": "user", "content": "Name three primary colors."}]
    rendered = hf.apply_chat_template(convo, add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert list(rendered) == tokenizer.chat("Name three primary colors.")
    with_system = [{"role": "system", "content": "Be brief."}, *convo]
    rendered = hf.apply_chat_template(with_system, add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert list(rendered) == tokenizer.chat("Name three primary colors.", system="Be brief.")


def test_generation_config_stops_where_our_engine_stops(export_dir, ours):
    gen = json.loads((export_dir / "generation_config.json").read_text())
    eos = ours.tokenizer.eos_token_ids
    assert gen == {"bos_token_id": 1, "eos_token_id": eos if len(eos) > 1 else eos[0], "pad_token_id": 2}


def test_hf_transformers_greedy_on_the_folder_is_our_engines(export_dir, ours, prompts, same_greedy):
    """The whole folder at work: HF transformers' own Llama built from it (config, weights,
    tokenizer) decodes what our engine decodes, 32 tokens, token for token (up to a near-tie)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True).eval()
    assert hf.dtype == torch.float32
    config = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=2)
    q = prompts[0]
    prompt, output = ours(q["turns"][0], 32)
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
    same_greedy(prompt, output, theirs, "HF transformers")


def test_an_export_never_writes_over_what_it_did_not_write(tmp_path):
    """Refused before the model is read: a non-empty folder without --overwrite, and with it a
    folder that holds anything an export does not write; a file in --out's place."""
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        export_hf("smollm2-135m", tmp_path)
    with pytest.raises(FileExistsError, match=r"does not write \(notes.txt\)"):
        export_hf("smollm2-135m", tmp_path, overwrite=True)
    with pytest.raises(FileExistsError, match="a file, not a folder"):
        export_hf("smollm2-135m", tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_cli_says_what_was_wrong(tmp_path, capsys):
    from specfleet_cli.main import main

    (tmp_path / "notes.txt").write_text("mine")
    assert main(["export-hf", "--out", str(tmp_path)]) == 2
    assert "specfleet export-hf: error: --out" in capsys.readouterr().err
