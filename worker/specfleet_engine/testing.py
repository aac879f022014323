"""Tiny random Llama-family models for tests and examples: real code paths, milliseconds a step."""

from __future__ import annotations

import torch

from .model import ModelArgs, Transformer, rope_cache


def tiny_args(vocab_size: int = 111, **overrides) -> ModelArgs:
    base = dict(vocab_size=vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True,
                eos_token_ids=[vocab_size - 1], bos_token_id=0)
    base.update(overrides)
    return ModelArgs(**base)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0, **overrides) -> Transformer:
    """A randomly initialised model. `scale` sharpens the logits (larger: more peaked outputs,
    so that n-gram drafts get accepted and sampled tests see varied acceptance)."""
    args = tiny_args(**overrides)
    g = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (scale / p.shape[-1] ** 0.5))
    model.rope_cos, model.rope_sin = rope_cache(args, args.max_position_embeddings)
    return model.to(dtype).eval().requires_grad_(False)
