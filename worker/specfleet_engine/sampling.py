"""Sampling and the lossless verification of draft tokens.

Words used everywhere: the *draft tokens* a proposer suggests, the *accepted tokens* (the longest
prefix of them the target agrees with), and one more token the target always contributes: the
*bonus token* when every draft token was accepted, or the *recovered token* (resampled from the
residual distribution) at the first rejection. Greedy verification accepts a draft token when it
is the target's argmax; sampled verification accepts it with probability min(1, p/q) and
recovers from norm(max(0, p - q)), so the emitted tokens follow the target's distribution p
exactly (Leviathan et al. 2023; Chen et al. 2023).
"""

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


@dataclass
class VerifyResult:
    num_accepted: int  # accepted draft tokens
    tokens: list[int]  # accepted tokens + the bonus or recovered token
    bonus: bool  # True when every draft token was accepted


def verify_greedy(target_logits: Tensor, draft_tokens: Tensor) -> VerifyResult:
    """target_logits: [K+1, V]; draft_tokens: [K].

    >>> logits = torch.eye(5)[[1, 2, 4, 0]]          # target argmax: 1, 2, 4, 0
    >>> verify_greedy(logits, torch.tensor([1, 2, 3]))
    VerifyResult(num_accepted=2, tokens=[1, 2, 4], bonus=False)
    """
    k = draft_tokens.shape[0]
    target_tokens = target_logits.argmax(dim=-1)  # [K+1]
    n = int(torch.cumprod(target_tokens[:k] == draft_tokens, dim=0).sum())
    return VerifyResult(n, target_tokens[: n + 1].tolist(), n == k)


def verify_sampling(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Rejection sampling. target_probs: [K+1, V]; draft_tokens: [K]; draft_probs: [K, V], or None
    for a deterministic proposer (n-gram), whose q is one-hot on its draft token."""
    k = draft_tokens.shape[0]
    rows = torch.arange(k)
    p = target_probs[rows, draft_tokens]  # [K]
    q = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(k, generator=generator, dtype=p.dtype)
    accepted = u * q < p  # u < p/q without dividing by a zero q
    n = int(torch.cumprod(accepted, dim=0).sum())
    tokens = draft_tokens[:n].tolist()
    if n == k:
        tokens.append(int(sample_from(target_probs[k:k + 1], generator)))
        return VerifyResult(n, tokens, True)
    if draft_probs is not None:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0.0)
    else:
        residual = target_probs[n].clone()
        residual[draft_tokens[n]] = 0.0
    total = residual.sum()
    # A rejection implies p(x) < q(x), hence mass elsewhere; guard against round-off only.
    residual = residual / total if total > 0 else target_probs[n]
    tokens.append(int(sample_from(residual[None], generator)))
    return VerifyResult(n, tokens, False)
