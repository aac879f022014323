"""Sampling parameters and the target distribution p they define (temperature, top-k, top-p).

Verification of draft tokens against p lives in kernels/rejection.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_tokens_limit: int | None = None) -> None:
        """Raises ValueError naming the first field that is out of range."""
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ValueError(f"max_tokens must be <= {max_tokens_limit}, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also catches NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The target distribution p that sampling (and so verification) draws from.

    logits: [N, V] fp32 -> probs [N, V] after temperature, top-k and top-p.
    """
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the token that crosses it included)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    # probs: [N, V] -> [N]; the exponential race is multinomial sampling without a sync
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / q).argmax(dim=-1)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    # logits: [N, V] -> tokens [N]
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from(logits_to_probs(logits, params), generator)
