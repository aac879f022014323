"""A model as specfleet's loader reads it (GGUF, HF folder or a bundled name), written out as a
Hugging Face checkpoint folder that other engines (vLLM, HF transformers) load as is.

The folder holds config.json (the architecture, dimensions, RoPE, tied embeddings, bos and eos ids
our loader read), generation_config.json (the token ids only, so that a server takes no sampling
defaults from it), tokenizer.json and tokenizer_config.json (the vocabulary, merges and special
tokens our tokenizer uses, and the model's chat template: a GGUF's own), and model.safetensors: the
weights in float32, the values our engine computes with (a GGUF's blocks dequantized), so that
another engine run on the folder in float32 is the same model as ours. Nothing is downloaded and
nothing is pickled; files are written to a temporary folder beside `out` and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .gguf_file import GGUFFile
from .loader import load_model, load_tokenizer, ours_to_hf_state_dict, resolve_model_path

#: What an export writes, and all it writes.
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


def _chat_template(name_or_path: str, tokenizer) -> str | None:
    """The model's chat template: a GGUF file's own (tokenizer.chat_template), else the one its
    tokenizer carries."""
    p = resolve_model_path(name_or_path)
    if p.suffix == ".gguf":
        template = GGUFFile(p).metadata.get("tokenizer.chat_template")
        if template:
            return template
    return getattr(tokenizer.hf, "chat_template", None)


def tokenizer_config(name_or_path: str, tokenizer, max_length: int) -> dict:
    """tokenizer_config.json for the fast tokenizer in tokenizer.json: its special tokens and the
    chat template, as transformers 4 and 5 both read them (PreTrainedTokenizerFast, no bos added:
    the chat template writes every special token itself)."""
    hf = tokenizer.hf
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    for role in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = getattr(hf, role, None)
        if token is not None:
            cfg[role] = str(token)
    template = _chat_template(name_or_path, tokenizer)
    if template:
        cfg["chat_template"] = template
    return cfg


def hf_config(model) -> dict:
    """config.json: the model's arguments in HF's words, float32 as the weights are written."""
    return {**model.args.to_hf_config(), "torch_dtype": "float32"}


def generation_config(model, tokenizer) -> dict:
    """generation_config.json: bos, eos and pad ids only. eos is every token our engine stops on
    (the tokenizer's), so that another engine stops where ours does; no temperature or top-p, so
    that a server's defaults are the request's own."""
    eos = list(tokenizer.eos_token_ids) or list(model.args.eos_token_ids)
    out = {"bos_token_id": model.args.bos_token_id, "eos_token_id": eos if len(eos) > 1 else eos[0]}
    pad = tokenizer.hf.pad_token_id
    if pad is not None:
        out["pad_token_id"] = pad
    return out


def _readable(path: Path, mode: int) -> None:
    """The mode a plain mkdir or open gives (`mode` less the umask): mkdtemp and safetensors make
    owner-only files, and a server in another user's container must read the folder."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


def export_hf(name_or_path: str, out: str | os.PathLike, overwrite: bool = False,
              progress=print) -> Path:
    """Writes `name_or_path` (a .gguf file, a HF folder, or a bundled model's name) to the folder
    `out` as a HF checkpoint (FILES); returns `out`. A folder that holds anything already is
    refused unless `overwrite`, and then only if it holds nothing but FILES: an export never
    deletes what it did not write."""
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"--out {out}: a file, not a folder")
        present = sorted(p.name for p in out.iterdir())
        if present and not overwrite:
            raise FileExistsError(f"--out {out}: not empty ({', '.join(present[:5])}); choose an empty folder, "
                                  "or pass --overwrite to replace an earlier export")
        foreign = [name for name in present if name not in FILES]
        if foreign:
            raise FileExistsError(f"--out {out}: holds files an export does not write ({', '.join(foreign[:5])}); "
                                  "--overwrite replaces only an earlier export")
    progress(f"reading {name_or_path}")
    model = load_model(name_or_path, torch.float32, "cpu")
    tokenizer = load_tokenizer(name_or_path)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(f"{name_or_path}: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{model.args.vocab_size} embeddings")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        _readable(tmp, 0o777)
        state = ours_to_hf_state_dict(model)
        progress(f"writing {len(state)} tensors, {sum(t.numel() for t in state.values()) / 1e6:.0f}M parameters "
                 "in float32")
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(model), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(model, tokenizer), indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(tokenizer.hf.backend_tokenizer.to_str())
        cfg = tokenizer_config(name_or_path, tokenizer, model.args.max_position_embeddings)
        (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        for f in tmp.iterdir():
            _readable(f, 0o666)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"wrote {out}: {', '.join(FILES)}")
    return out
