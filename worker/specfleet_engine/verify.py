"""Lossless verification of draft tokens: one vocabulary for everything a verify step yields.

Words used everywhere: the *draft tokens* a proposer suggests, the *accepted tokens* (the longest
prefix of them the target agrees with), and one more token the target always contributes: the
*bonus token* when every draft token was accepted, or the *recovered token* (resampled from the
residual distribution) at the first rejection. Greedy verification accepts a draft token when it
is the target's argmax; sampled verification accepts it with probability min(1, p/q) and
recovers from norm(max(0, p - q)), so the emitted tokens follow the target's distribution p
exactly (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import sample_from


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
