"""A compact Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) over a paged KV cache.

One forward takes the new tokens of several sequences flattened into one row ([T]) and the
per-sequence `AttentionMetadata`; it writes their keys and values into the paged cache and
returns logits only for the rows asked for. Nothing from HF transformers is on this path.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kernels.tree_attention import TreeBatch, tree_attention_launch, tree_batch, use_triton
from .quant import replace_linears


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    sliding_window: int | None = None  # Mistral; None means full attention
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    architecture: str = "llama"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        """Reads a Hugging Face config.json (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)."""
        archs = cfg.get("architectures") or [cfg.get("model_type", "llama")]
        arch = archs[0].lower()
        family = next((f for f in ("qwen2", "mistral", "llama") if f in arch), None)
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs[0]!r}: expected a Llama, Qwen2 or Mistral causal LM"
            )
        n_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id", 2)
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta", 10000.0)
        if rope_scaling is None and isinstance(cfg.get("rope_parameters"), dict):
            # transformers >= 5 writes RoPE settings as rope_parameters.
            params = dict(cfg["rope_parameters"])
            rope_theta = params.pop("rope_theta", rope_theta)
            rope_scaling = params if params.get("rope_type", "default") != "default" else None
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", family == "qwen2"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", family == "mistral") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=list(eos) if isinstance(eos, list) else [eos],
            architecture=family,
        )

    def to_hf_config(self) -> dict:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        cfg = {
            "architectures": [arch[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            "hidden_act": "silu",
        }
        if self.sliding_window is not None:
            cfg["sliding_window"] = self.sliding_window
        return cfg


def rope_inv_freq(args: ModelArgs) -> tuple[Tensor, float]:
    """Inverse frequencies and the attention scaling factor for each RoPE variant.

    Variants as in HF transformers' `ROPE_INIT_FUNCTIONS`: default, linear, dynamic (NTK, taken
    at the configured maximum length), llama3 and yarn.
    """
    dim = args.head_dim
    base = args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    attn_factor = 1.0
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "dynamic":
        # NTK-aware scaling evaluated at the longest context the model will see.
        seq_len = args.max_position_embeddings
        orig = scaling.get("original_max_position_embeddings", seq_len)
        if seq_len > orig:
            base = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    elif kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "yarn":
        orig = float(scaling.get("original_max_position_embeddings", args.max_position_embeddings))
        beta_fast = float(scaling.get("beta_fast", 32))
        beta_slow = float(scaling.get("beta_slow", 1))
        mscale = scaling.get("attention_factor")
        attn_factor = float(mscale) if mscale is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def correction_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r}: expected default, linear, dynamic, llama3 or yarn")
    return inv_freq.float(), attn_factor


def rope_cache(args: ModelArgs, max_len: int) -> tuple[Tensor, Tensor]:
    inv_freq, attn_factor = rope_inv_freq(args)
    t = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [L, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, hd]
    return emb.cos() * attn_factor, emb.sin() * attn_factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor | None) -> Tensor:
    # x: [T, H, hd]; cos, sin: [T, hd] (rotate-half layout, as HF checkpoints store q and k), or
    # cos: [T, hd / 2] complex and sin None (interleaved layout, see `interleave_rope`)
    if sin is None:
        T, H, hd = x.shape
        xc = torch.view_as_complex(x.float().reshape(T, H, hd // 2, 2))
        return torch.view_as_real(xc * cos[:, None, :]).view(T, H, hd).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon. Holds no forward: `Block` applies it through `rms_norm`,
    without nn.Module's call machinery, so there is one place the math lives."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


def linear(layer: nn.Module, x: Tensor, residual: Tensor | None = None) -> Tensor:
    """layer(x) (+ residual) without nn.Module's call machinery: our layers (TransposedLinear,
    PackedLinear, Int8WeightOnlyLinear) each apply themselves in their `linear` method, the one
    home of their math (their `forward` calls it too); a plain nn.Linear goes to F.linear."""
    own = getattr(type(layer), "linear", None)  # a class lookup: no nn.Module.__getattr__
    if own is not None:
        return own(layer, x, residual)
    y = F.linear(x, layer.weight, layer.bias) if type(layer) is nn.Linear else layer(x)
    return y if residual is None else residual + y


class TransposedLinear(nn.Module):
    """nn.Linear with its weight stored [in, out]: y = x @ W^T as a plain x @ weight_t.

    On the CPU, fp32 GEMM with a handful of rows (decoding, verifying a draft) is 1.5x to 10x
    faster in this layout than F.linear's, which repacks the weight on every call; one row is
    no slower. Measured by bench: see README."""

    def __init__(self, linear_: nn.Linear):
        super().__init__()
        self.register_buffer("weight_t", linear_.weight.data.t().contiguous())
        self.register_buffer("bias", None if linear_.bias is None else linear_.bias.data.clone())
        self.in_features, self.out_features = linear_.in_features, linear_.out_features

    def linear(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        # x: [T, in] -> [T, out] (+ residual, fused into the GEMM)
        w, b = self._buffers["weight_t"], self._buffers["bias"]
        if b is None:
            return torch.mm(x, w) if residual is None else torch.addmm(residual, x, w)
        y = torch.addmm(b, x, w)
        return y if residual is None else residual + y

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def transpose_linears(model: nn.Module) -> nn.Module:
    """Swaps every nn.Linear (the LM head included, untied from the embedding) for TransposedLinear.
    A CPU layout: a model on another device is left as it is (cuBLAS wants F.linear's)."""
    if any(not p.is_cpu for p in model.parameters()):
        return model
    return replace_linears(model, TransposedLinear)


def interleave_rope(model: Transformer) -> Transformer:
    """Reorders each head's q and k features from the rotate-half layout to interleaved pairs
    (feature i next to i + hd/2), so RoPE becomes one complex multiply instead of six ops.

    Attention only ever takes q . k, which a permutation applied to both leaves unchanged; v, the
    outputs and the logits are untouched. Keys are cached in the new layout. Call it on
    nn.Linear weights, before `transpose_linears`."""
    model.rope_cis = interleave_blocks(model.layers, model.args, model.rope_cos, model.rope_sin)
    return model


def interleave_blocks(blocks, args: ModelArgs, rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
    """`interleave_rope` for any stack of `Block`s (a model's, a draft head's): reorders their
    q and k rows in place and returns the complex RoPE table [L, hd / 2] they now take."""
    hd, half = args.head_dim, args.head_dim // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    qk = args.n_heads + args.n_kv_heads
    rows = torch.cat([h * hd + pairs for h in range(qk)] + [torch.arange(qk * hd, (qk + args.n_kv_heads) * hd)])
    for layer in blocks:
        wqkv = layer.attention.wqkv
        if not isinstance(wqkv, nn.Linear):
            raise TypeError("interleave_rope needs nn.Linear weights: call it before transposing or quantizing")
        wqkv.weight.data = wqkv.weight.data[rows].contiguous()
        if wqkv.bias is not None:
            wqkv.bias.data = wqkv.bias.data[rows].contiguous()
    return torch.complex(rope_cos[:, :half].float(), rope_sin[:, :half].float())


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one op call instead of six
    # computed in fp32 whatever the model's dtype, as HF's LlamaRMSNorm does
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * xf.to(x.dtype)


@dataclass
class AttentionMetadata:
    """Where the T new tokens of a forward live: B sequences, flattened.

    positions:    [T] absolute position of each new token
    slot_mapping: [T] cache slot (block * block_size + offset) that receives each token's K/V
    cu_seqlens:   B + 1 offsets of each sequence's new tokens in the flat row
    context_slots: per sequence, [S_b] the cache slots of its whole context (new tokens included)
    masks:        per sequence, None for plain causal attention or a bool [q_b, S_b] mask
                  (True = may attend), used by tree verification
    context_starts: per sequence, the first slot when its context is one run of consecutive
                  slots (read as a view, not gathered), else None
    tree_parents: per sequence, None when its new tokens are a causal run, else the parent of each
                  new token local to them (-1: attached to the cached prefix); `masks` holds the
                  same tree as a dense mask, which the CPU path reads
    """

    positions: Tensor
    slot_mapping: Tensor
    cu_seqlens: list[int]
    context_slots: list[Tensor]
    masks: list[Tensor | None]
    context_starts: list[int | None] | None = None
    tree_parents: list[list[int] | None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1


@dataclass(frozen=True)
class TreePlan:
    """The Triton path of a forward: its decode and verify sequences (fewer than PREFILL_ROWS new
    rows each) as one `TreeBatch` over the paged cache, read as [num_blocks, block_size, Hkv, hd].

    block_size: a block size every one of their prefixes is laid out in (the cache's, or a divisor)
    rows:       their rows in the flat batch on the device, None when they are all of it
    prefill:    the sequences left to `prefill_attention`
    """

    batch: TreeBatch
    block_size: int
    rows: Tensor | None
    prefill: list[int]


@dataclass(frozen=True)
class AttentionPlan:
    """What `Transformer.forward` derives from the metadata once for all its layers.

    biases:     per sequence, the additive attention bias (or prefill mask), None when plain causal
                or taken by the Triton path
    slot_start: the first slot when a long run of new tokens goes to consecutive slots (written
                as one copy), else None
    meta:       the metadata on the model's device
    tree:       the Triton path's plan, None on the torch path
    """

    biases: list[Tensor | None]
    slot_start: int | None
    meta: AttentionMetadata | None = None
    tree: TreePlan | None = None


def plan_attention(meta: AttentionMetadata, args: ModelArgs, device: torch.device | None = None,
                   cache_slots: int | None = None) -> AttentionPlan:
    """device: the model's (default: the metadata's); cache_slots: the slots of a layer's cache."""
    device = meta.slot_mapping.device if device is None else device
    tree = None
    # Sliding-window models keep the torch path: the kernel has no window.
    if args.sliding_window is None and cache_slots is not None and use_triton(device):
        tree = plan_tree(meta, device, cache_slots)
    if meta.slot_mapping.device != device:  # the engine builds a batch on the host
        meta = metadata_to(meta, device, None if tree is None else tree.prefill)
    slot_start = None
    sm = meta.slot_mapping
    if sm.shape[0] >= PREFILL_ROWS and bool((sm[1:] - sm[:-1] == 1).all()):
        slot_start = int(sm[0])
    biases = []
    for b in range(meta.num_seqs):
        n_q, S = meta.cu_seqlens[b + 1] - meta.cu_seqlens[b], meta.context_slots[b].shape[0]
        # a tree's window is measured from its nodes' positions
        pos = None if meta.masks[b] is None else meta.positions[meta.cu_seqlens[b]:meta.cu_seqlens[b + 1]]
        if n_q >= PREFILL_ROWS:
            biases.append(prefill_mask(n_q, S, meta.masks[b], args.sliding_window, pos))
        elif tree is not None:
            biases.append(None)
        else:
            biases.append(attention_bias(n_q, S, args.n_heads // args.n_kv_heads, meta.masks[b], args.sliding_window,
                                         pos))
    if device.type != "cpu":
        biases = [None if x is None else x.to(device, non_blocking=True) for x in biases]
    return AttentionPlan(biases, slot_start, meta, tree)


def metadata_to(meta: AttentionMetadata, device: torch.device, torch_seqs: list[int] | None) -> AttentionMetadata:
    """The metadata on `device`; context slots only of `torch_seqs` (None: all), the sequences whose
    attention gathers them (a long context is megabytes a step)."""
    slots = list(meta.context_slots)
    for b in range(meta.num_seqs) if torch_seqs is None else torch_seqs:
        slots[b] = slots[b].to(device, non_blocking=True)
    return replace(meta, positions=meta.positions.to(device, non_blocking=True),
                   slot_mapping=meta.slot_mapping.to(device, non_blocking=True), context_slots=slots)


BLOCK_SIZES = (16, 8, 4, 2, 1)  # tried in turn for the block tables the kernel reads (16: the engine's)


def plan_tree(meta: AttentionMetadata, device: torch.device, cache_slots: int) -> TreePlan | None:
    """The decode and verify sequences as one TreeBatch: each one's prefix is its context less its
    new rows, its tree the new rows under `tree_parents` (a causal run: a chain). None when a
    sequence has a mask but no tree (only the torch path reads a general mask) or none decodes."""
    cu, parents, prefixes, decode, prefill = meta.cu_seqlens, [], [], [], []
    for b in range(meta.num_seqs):
        n_q = cu[b + 1] - cu[b]
        if n_q >= PREFILL_ROWS:
            prefill.append(b)
            continue
        tp = meta.tree_parents[b] if meta.tree_parents else None
        if tp is None:
            if meta.masks[b] is not None:
                return None
            tp = list(range(-1, n_q - 1))
        plen = meta.context_slots[b].shape[0] - n_q
        decode.append(b)
        parents.append(list(tp))
        first = meta.context_starts[b] if meta.context_starts else None
        prefixes.append((meta.context_slots[b][:plen], first))
    if not decode:
        return None
    bs = next(bs for bs in BLOCK_SIZES if cache_slots % bs == 0 and all(laid_out_in(s, f, bs) for s, f in prefixes))
    max_blocks = max(1, max(-(-s.shape[0] // bs) for s, _ in prefixes))
    tables = torch.zeros(len(decode), max_blocks, dtype=torch.int32)
    for i, (s, _) in enumerate(prefixes):
        tables[i, :-(-s.shape[0] // bs)] = s[::bs] // bs
    batch = tree_batch(tables, [s.shape[0] for s, _ in prefixes], parents, device)
    rows = None
    if prefill:
        rows = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in decode]).to(device, non_blocking=True)
    return TreePlan(batch, bs, rows, prefill)


def laid_out_in(slots: Tensor, first: int | None, bs: int) -> bool:
    """Whether slots [n] (of positions 0..n-1) are blocks of `bs` slots, each block aligned to bs:
    slot(p) = table[p // bs] * bs + p % bs. first: slots[0] when they are one run, else None."""
    if first is not None or slots.shape[0] == 0:
        return first is None or first % bs == 0
    if bs == 1:
        return True
    starts = slots[::bs]
    if bool((starts % bs).any()):
        return False
    n = slots.shape[0]
    return torch.equal(starts.repeat_interleave(bs)[:n] + torch.arange(n) % bs, slots)


def context_kv(k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, b: int) -> tuple[Tensor, Tensor]:
    """Sequence b's whole context from a layer's cache: [Hkv, S, hd] each."""
    first = meta.context_starts[b] if meta.context_starts else None
    if first is not None:  # blocks laid out in order: a view, no gather
        S = meta.context_slots[b].shape[0]
        return k_cache.narrow(1, first, S), v_cache.narrow(1, first, S)
    slots = meta.context_slots[b]
    return k_cache.index_select(1, slots), v_cache.index_select(1, slots)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, q + 2 * kv, bias=args.attention_bias)
        self.wo = nn.Linear(q, args.dim, bias=False)
        self.sliding_window = args.sliding_window

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor | None, meta: AttentionMetadata, plan: AttentionPlan,
                kv: tuple[Tensor, Tensor], residual: Tensor | None = None) -> Tensor:
        # x: [T, D]; kv: ([Hkv, slots, hd], [Hkv, slots, hd]) of this layer; returns residual + attention(x)
        T = x.shape[0]
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = linear(self.wqkv, x)
        qk = apply_rope(qkv[:, : (H + Hkv) * hd].view(T, H + Hkv, hd), cos, sin)  # q and k in one go
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * hd:].view(T, Hkv, hd)
        k_cache, v_cache = kv  # [Hkv, slots, hd]
        if plan.slot_start is not None:  # a prefill into fresh blocks: one strided copy
            k_cache.narrow(1, plan.slot_start, T).copy_(k.transpose(0, 1))
            v_cache.narrow(1, plan.slot_start, T).copy_(v.transpose(0, 1))
        else:
            k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
            v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))

        if plan.tree is not None:
            return linear(self.wo, self.tree_attention(q, k, v, k_cache, v_cache, meta, plan), residual)
        group = H // Hkv
        out = []
        for b in range(meta.num_seqs):
            lo, hi = meta.cu_seqlens[b], meta.cu_seqlens[b + 1]
            n_q = hi - lo
            first = meta.context_starts[b] if meta.context_starts else None
            if first is not None:  # blocks laid out in order: a view, no gather
                S = meta.context_slots[b].shape[0]
                kb, vb = k_cache.narrow(1, first, S), v_cache.narrow(1, first, S)  # [Hkv, S, hd]
            else:
                slots = meta.context_slots[b]
                kb, vb = k_cache.index_select(1, slots), v_cache.index_select(1, slots)
            kb, vb = kb.to(q.dtype), vb.to(q.dtype)
            if n_q >= PREFILL_ROWS:
                out.append(prefill_attention(q[lo:hi], kb, vb, plan.biases[b], self.scale))
                continue
            # grouped-query attention without repeating K/V: the query heads that share a KV
            # head become extra query rows of it. [n_q, H, hd] -> [Hkv, G * n_q, hd]
            qb = q[lo:hi].reshape(n_q, Hkv, group, hd).permute(1, 2, 0, 3).reshape(Hkv, group * n_q, hd)
            o = attend(qb, kb, vb, plan.biases[b], self.scale)  # [Hkv, G * n_q, hd]
            out.append(o.view(Hkv, group, n_q, hd).permute(2, 0, 1, 3).reshape(n_q, H * hd))
        return linear(self.wo, out[0] if len(out) == 1 else torch.cat(out), residual)

    def tree_attention(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                       meta: AttentionMetadata, plan: AttentionPlan) -> Tensor:
        """The Triton path: q [T, H, hd], k and v [T, Hkv, hd] (views, written to the cache already);
        returns [T, H * hd]. Decode and verify rows in one launch, prefills through SDPA."""
        tp, (T, H, hd), Hkv = plan.tree, q.shape, self.n_kv_heads
        paged = (Hkv, k_cache.shape[1] // tp.block_size, tp.block_size, hd)  # -> [blocks, block_size, Hkv, hd]
        kc, vc = k_cache.view(paged).permute(1, 2, 0, 3), v_cache.view(paged).permute(1, 2, 0, 3)
        if tp.rows is None:
            return tree_attention_launch(q, kc, vc, tp.batch, k, v, self.scale).view(T, H * hd)
        pick = tp.rows
        o = tree_attention_launch(q.index_select(0, pick), kc, vc, tp.batch, k.index_select(0, pick),
                                  v.index_select(0, pick), self.scale)
        out = q.new_empty(T, H * hd).index_copy_(0, pick, o.view(-1, H * hd))
        for b in tp.prefill:
            lo, hi = meta.cu_seqlens[b], meta.cu_seqlens[b + 1]
            kb, vb = context_kv(k_cache, v_cache, meta, b)
            out[lo:hi] = prefill_attention(q[lo:hi], kb.to(q.dtype), vb.to(q.dtype), plan.biases[b], self.scale)
        return out

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


PREFILL_ROWS = 32  # a sequence with at least this many new tokens takes the fused kernel


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Fused (flash) attention for many query rows. q: [n_q, H, hd]; k, v: [Hkv, S, hd];
    mask: bool [n_q, S] (True = may attend), or None for a causal prefill with no cached prefix.
    Returns [n_q, H * hd]."""
    n_q, H, hd = q.shape
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=H != k.shape[0])
    return o[0].transpose(0, 1).reshape(n_q, H * hd)


def allowed(n_q: int, S: int, mask: Tensor | None, sliding_window: int | None,
            positions: Tensor | None = None) -> Tensor:
    """bool [n_q, S], True where a query may attend: `mask` (tree verification) or causal, where
    new token i sits at context index S - n_q + i; both cut to the sliding window, measured from
    each query's position (`positions`: a tree node's position is its depth, not its index)."""
    if mask is None:
        mask = torch.ones(n_q, S, dtype=torch.bool).tril(S - n_q)
    if sliding_window is not None and S > sliding_window:
        qpos = (torch.arange(S - n_q, S) if positions is None else positions.cpu())[:, None]
        mask = mask & (torch.arange(S)[None, :] > qpos - sliding_window)
    return mask


def prefill_mask(n_q: int, S: int, mask: Tensor | None, sliding_window: int | None,
                 positions: Tensor | None = None) -> Tensor | None:
    """The bool mask `prefill_attention` takes; None when plain causal attention from position 0 fits."""
    if mask is None and S == n_q and (sliding_window is None or S <= sliding_window):
        return None
    return allowed(n_q, S, mask, sliding_window, positions)


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """Softmax attention. q: [Hkv, R, hd]; k, v: [Hkv, S, hd]; bias: [R, S] additive (0 / -inf) or None.

    Decoding and verification have a handful of query rows: two batched matmuls beat the
    fused kernel's set-up there."""
    if bias is None:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    else:
        scores = torch.baddbmm(bias.to(q.dtype), q, k.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), v)


def attention_bias(n_q: int, S: int, group: int, mask: Tensor | None, sliding_window: int | None,
                   positions: Tensor | None = None) -> Tensor | None:
    """The additive mask of one sequence, rows ordered (g, i) as `Attention` lays queries out.

    mask: an explicit bool [n_q, S] (tree verification), or None for causal attention (`allowed`)."""
    if mask is None and n_q == 1 and (sliding_window is None or S <= sliding_window):
        return None
    bias = torch.zeros(n_q, S).masked_fill_(~allowed(n_q, S, mask, sliding_window, positions), float("-inf"))
    return bias.repeat(group, 1)


class FeedForward(nn.Module):
    """SwiGLU's weights: w2(silu(gate) * up) with gate and up from one fused w13. Holds no
    forward: `Block.forward` applies it (one place the math lives)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x, cos, sin, meta, plan, kv):
        # The norms and the feed-forward are inlined: at one token a step, a 135M model spends
        # as long in Python's module calls as in some of its matmuls.
        attn_norm, ffn_norm, ff = self.attention_norm, self.ffn_norm, self.feed_forward
        h = self.attention(rms_norm(x, attn_norm.weight, attn_norm.eps), cos, sin, meta, plan, kv, residual=x)
        gate, up = linear(ff.w13, rms_norm(h, ffn_norm.weight, ffn_norm.eps)).chunk(2, dim=-1)
        return linear(ff.w2, F.silu(gate).mul_(up), residual=h)


def dense_block(block: Block, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None = None, queries: Tensor | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """`Block.forward`'s math without a KV cache, for training a draft head, with autograd.

    Rows x [N, D] (RoPE'd at cos, sin) add their keys and values after `past`'s ([P, Hkv, hd]
    each, from earlier calls); the `queries` rows of x (all without) attend to those P + N keys
    under a bool mask [Q, P + N] (True: may attend). Returns the queries' outputs [Q, D] and the
    keys and values so far (the next call's `past`)."""
    att, ff = block.attention, block.feed_forward
    N, H, Hkv, hd = x.shape[0], att.n_heads, att.n_kv_heads, att.head_dim
    qkv = linear(att.wqkv, rms_norm(x, block.attention_norm.weight, block.attention_norm.eps))
    qk = apply_rope(qkv[:, : (H + Hkv) * hd].view(N, H + Hkv, hd), cos, sin)
    q, k = qk[:, :H], qk[:, H:]
    v = qkv[:, (H + Hkv) * hd:].view(N, Hkv, hd)
    if past is not None:
        k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
    if queries is not None:
        q, x = q.index_select(0, queries), x.index_select(0, queries)
    Q = q.shape[0]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=att.scale, enable_gqa=H != Hkv)
    h = linear(att.wo, o[0].transpose(0, 1).reshape(Q, H * hd), x)
    gate, up = linear(ff.w13, rms_norm(h, block.ffn_norm.weight, block.ffn_norm.eps)).chunk(2, dim=-1)
    return linear(ff.w2, F.silu(gate) * up, h), (k, v)


FUSED_ENV = "SPECFLEET_FUSED_STEP"  # "0": every forward runs layer by layer from Python
_EMPTY = torch.empty(0)  # "no scales" / "no bias" in the fused step's weight list


class FusedStack:
    """A few-row forward's decoder layers in one call of the CPU kernel library
    (`specfleet_int8::decoder_step`, kernels/csrc/decoder_step.cpp): the same math as
    `Block.forward` (interleaved RoPE, the paged cache, causal or tree attention), without Python
    between the layers. It holds references to the model's weight tensors, not copies.

    `Transformer.forward` hands it a forward when `takes` says so: every sequence with fewer
    than PREFILL_ROWS new rows, fp32 caches. Build it with `fuse_layers`."""

    def __init__(self, blocks, args: ModelArgs, rope_cis: Tensor, op, norm: RMSNorm | None = None,
                 output: nn.Module | None = None):
        """blocks: the `Block`s (a model's layers, a draft head's one), their linears on the CPU
        kernel; rope_cis: their interleaved RoPE table (`interleave_blocks`); norm and output:
        the final norm and LM head, taken into the call where the output layer is on the kernel
        too (then it returns logits, see `lm_head`)."""
        self.op = op
        self.weights: list[Tensor] = []
        for layer in blocks:
            att, ff = layer.attention, layer.feed_forward
            for name, lin in (("wqkv", att.wqkv), ("wo", att.wo), ("w13", ff.w13), ("w2", ff.w2)):
                packed, scales, bias = _fusable(lin)
                if name != "wqkv" and bias is not None:
                    raise ValueError(f"{name} has a bias: the fused step takes one only on wqkv")
                if name in ("wqkv", "w13"):  # each follows its norm
                    before = layer.attention_norm if name == "wqkv" else layer.ffn_norm
                    self.weights.append(before.weight.detach())
                self.weights += [packed, _EMPTY if scales is None else scales]
                if name == "wqkv":
                    self.weights.append(_EMPTY if bias is None else bias.detach())
        self.dims = [args.n_heads, args.n_kv_heads, args.head_dim, args.intermediate_size]
        self.eps = blocks[0].attention_norm.eps
        self.scale = blocks[0].attention.scale
        self.rope_cos = rope_cis.real.contiguous()
        self.rope_sin = rope_cis.imag.contiguous()
        self.lm_head: list[Tensor] = []  # [final norm, packed weight, scales or _EMPTY]: logits from the call
        self.vocab = 0
        if norm is not None and output is not None:
            try:
                packed, scales, bias = _fusable(output)
            except ValueError:
                packed = None
            if packed is not None and bias is None:
                self.lm_head = [norm.weight.detach(), packed, _EMPTY if scales is None else scales]
                self.vocab = output.out_features

    @staticmethod
    def takes(meta: AttentionMetadata, kv_caches: list[tuple[Tensor, Tensor]]) -> bool:
        cu = meta.cu_seqlens
        return (all(cu[b + 1] - cu[b] < PREFILL_ROWS for b in range(meta.num_seqs))
                and kv_caches[0][0].dtype == torch.float32 and meta.slot_mapping.device.type == "cpu")

    def __call__(self, x: Tensor, meta: AttentionMetadata, kv_caches: list[tuple[Tensor, Tensor]],
                 features: tuple[int, ...], logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [T, D] (the embedded tokens) -> (x after the last layer, or with `lm_head` the logits
        of `logit_rows` (all without), the `features` layers' outputs [T, len(features) * D])."""
        cu, rows, gathered, masks, at_slot, at_mask = meta.cu_seqlens, [], [], [], 0, 0
        for b in range(meta.num_seqs):
            S = meta.context_slots[b].shape[0]
            start = meta.context_starts[b] if meta.context_starts else None
            slots_at = 0
            if start is None:
                gathered.append(meta.context_slots[b])
                start, slots_at, at_slot = -1, at_slot, at_slot + S
            mask, mask_at = meta.masks[b], -1
            if mask is not None:
                masks.append(mask.reshape(-1))
                mask_at, at_mask = at_mask, at_mask + mask.numel()
            rows.append((cu[b], cu[b + 1], S, start, slots_at, mask_at))
        ctx = torch.cat(gathered) if gathered else _NO_SLOTS
        mask_flat = torch.cat(masks) if masks else _NO_MASK
        return self.op(x, self.weights, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.positions,
                       meta.slot_mapping, self.rope_cos, self.rope_sin, torch.tensor(rows, dtype=torch.long), ctx,
                       mask_flat, self.dims, self.eps, self.scale, list(features), self.lm_head, self.vocab,
                       _NO_SLOTS if logit_rows is None else logit_rows)


_NO_SLOTS = torch.empty(0, dtype=torch.long)
_NO_MASK = torch.empty(0, dtype=torch.bool)


def _fusable(lin: nn.Module) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(packed weight, scales or None, bias or None) of a layer the fused step reads: a
    PackedLinear, or an Int8WeightOnlyLinear on the kernel; ValueError for anything else."""
    from .quant import Int8WeightOnlyLinear, PackedLinear
    if isinstance(lin, PackedLinear):
        return lin.weight_packed, None, lin.bias
    if isinstance(lin, Int8WeightOnlyLinear) and lin.use_kernel and lin.scales.dtype == torch.float32:
        return lin.weight_packed, lin.scales, lin.bias
    raise ValueError(f"{type(lin).__name__} is not on the CPU kernel")


def fuse_layers(model: Transformer) -> bool:
    """Gives `model` a FusedStack where its few-row forwards can take one (sets `model.fused`):
    on the CPU, fp32, interleaved RoPE, no sliding window, every linear on the CPU kernel
    (PackedLinear or int8), the kernel library built, SPECFLEET_FUSED_STEP not "0". Returns
    whether it did; where not, forwards run layer by layer, as before."""
    model.fused = fused_stack(model.layers, model.args, model.rope_cis, model.device, model.dtype, model.norm,
                              model.output)
    return model.fused is not None


def fused_stack(blocks, args: ModelArgs, rope_cis: Tensor | None, device: torch.device, dtype: torch.dtype,
                norm: RMSNorm | None = None, output: nn.Module | None = None) -> FusedStack | None:
    """A FusedStack over `blocks` where the fused step can run them (see `fuse_layers`), else None."""
    from .kernels.cpu_gemm import _KernelState, int8_kernel
    if os.environ.get(FUSED_ENV, "").strip() == "0" or device.type != "cpu" or dtype != torch.float32:
        return None
    if rope_cis is None or args.sliding_window is not None or int8_kernel() is None:
        return None
    try:
        return FusedStack(blocks, args, rope_cis, _KernelState.decoder_step, norm, output)
    except ValueError:
        return None


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(args, args.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.rope_cis: Tensor | None = None  # set by `interleave_rope`
        self.fused: FusedStack | None = None  # set by `fuse_layers`

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        tokens: Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[Tensor, Tensor]],
        logits_indices: Tensor | None = None,
        features: tuple[int, ...] = (),
    ) -> Tensor | tuple[Tensor, Tensor]:
        # tokens: [T]; returns logits [len(logits_indices) or T, V] in fp32, on the model's device
        # (the metadata and indices may come from the host). With `features` (layer indices), also
        # the residual stream after each of those layers at every input row, concatenated:
        # [T, len(features) * dim], what an EAGLE head reads (logits_indices does not select them)
        device = self.norm.weight.device
        if self.fused is not None and self.fused.takes(meta, kv_caches):
            out, feats = self.fused(self.tok_embeddings(tokens), meta, kv_caches, features, logits_indices)
            if not self.fused.lm_head:  # the LM head is not on the kernel: out is x
                if logits_indices is not None:
                    out = out.index_select(0, logits_indices)
                out = linear(self.output, rms_norm(out, self.norm.weight, self.norm.eps))
            return out if not features else (out, feats)
        plan = plan_attention(meta, self.args, device, kv_caches[0][0].shape[1] if kv_caches else None)
        if tokens.device != device:
            tokens = tokens.to(device, non_blocking=True)
        if logits_indices is not None and logits_indices.device != device:
            logits_indices = logits_indices.to(device, non_blocking=True)
        return self.forward_planned(tokens, plan, kv_caches, logits_indices, features)

    def forward_planned(self, tokens: Tensor, plan: AttentionPlan, kv_caches: list[tuple[Tensor, Tensor]],
                        logits_indices: Tensor | None = None,
                        features: tuple[int, ...] = ()) -> Tensor | tuple[Tensor, Tensor]:
        """`forward`'s layers on a planned batch (`plan_attention`), every tensor already on the
        model's device: no host work and no sync on the Triton path, so a CUDA graph can capture it
        (graphs.py)."""
        meta = plan.meta
        x = self.tok_embeddings(tokens)
        if self.rope_cis is not None:
            cos, sin = self.rope_cis.index_select(0, meta.positions), None
        else:
            cos = self.rope_cos.index_select(0, meta.positions).to(x.dtype)
            sin = self.rope_sin.index_select(0, meta.positions).to(x.dtype)
        taken: dict[int, Tensor] = {}
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, meta, plan, kv)
            if i in features:
                taken[i] = x
        feats = torch.cat([taken[i] for i in features], dim=-1) if features else None
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        logits = linear(self.output, rms_norm(x, self.norm.weight, self.norm.eps)).float()
        return logits if feats is None else (logits, feats)
