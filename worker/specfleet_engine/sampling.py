"""Sampling parameters and the target distribution p they define (temperature, top-k, top-p).

Verification of draft tokens against p lives in kernels/rejection.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from specfleet_api.limits import WIRE_DEFAULT_TEMPERATURE, is_greedy
from torch import Tensor


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = WIRE_DEFAULT_TEMPERATURE  # greedy (0), as an unset gRPC field; is_greedy says what is
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

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
        probs = top_p_filter(probs, params.top_p)
    return probs


TOP_P_CANDIDATES = 1024  # top-p looks among the most likely this many tokens first


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """probs [N, V] cut to the smallest set of most likely tokens whose mass reaches top_p (the
    token that crosses it included), renormalised.

    On the CPU the set is found among the TOP_P_CANDIDATES most likely tokens (a partial top-k)
    when their mass reaches top_p in every row, which is the usual case; else among all of them (a
    full sort, ~4-8 ms a row at V 49152 on this CPU, where the partial one costs ~0.3 ms). The two
    find the same set: past the candidates every token comes after the mass has reached top_p.
    Elsewhere always by the full sort, which a GPU does in microseconds without the host sync
    the check would cost.

    >>> p = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    >>> top_p_filter(p, 0.7)                      # 0.5 + 0.25 crosses 0.7
    tensor([[0.0000, 0.6667, 0.0000, 0.3333]])
    >>> top_p_filter(p, 1e-60)                    # the smallest set is the most likely token
    tensor([[0., 1., 0., 0.]])
    """
    k = min(probs.shape[-1], TOP_P_CANDIDATES) if probs.device.type == "cpu" else probs.shape[-1]
    top, idx = torch.topk(probs, k, dim=-1) if k < probs.shape[-1] else torch.sort(probs, dim=-1, descending=True)
    mass = top.cumsum(-1)
    if k < probs.shape[-1] and not bool((mass[:, -1] >= top_p).all()):
        top, idx = torch.sort(probs, dim=-1, descending=True)
        mass = top.cumsum(-1)
    drop = mass - top >= top_p
    # the most likely token always stays: a top_p under float32's smallest number (1e-60 is
    # valid input) rounds to 0, and `0 >= 0` would drop every token (a row of NaN)
    drop[..., 0] = False
    top = top.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, idx, top)
    return out / out.sum(-1, keepdim=True)


def sample_from(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [N, V] -> [N], drawn from the row exactly (up to rounding).

    On the CPU by the inverse CDF: one uniform per row from `generator` against the row's
    cumulative sum in fp64; a row's zero-probability tokens are never drawn. Elsewhere by the
    exponential race (argmax of p / Exp(1), V draws per row): multinomial sampling without a host
    sync, as the Triton rejection kernel draws it. Both draw from p exactly; the CPU's costs one
    cumulative sum where the race costs V exponentials (vocabulary 49152: ~0.15 ms against ~1.1-2
    ms a row on this 2-core CPU), which every sampled token of every request pays.

    >>> g = torch.Generator().manual_seed(0)
    >>> p = torch.tensor([[0.0, 0.25, 0.0, 0.75], [1.0, 0.0, 0.0, 0.0]])
    >>> draws = torch.stack([sample_from(p, g) for _ in range(4000)])
    >>> sorted(set(draws[:, 0].tolist())), abs(float((draws[:, 0] == 3).float().mean()) - 0.75) < 0.03
    ([1, 3], True)
    >>> set(draws[:, 1].tolist())
    {0}
    """
    if probs.device.type != "cpu":
        q = torch.empty_like(probs).exponential_(1.0, generator=generator)
        return (probs / q).argmax(dim=-1)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    x = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator) * total
    # the first index whose cumulative sum passes x has a positive probability; x rounding up to
    # the total would pass none, so it is held at the last token with a positive probability
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(torch.searchsorted(cdf, x, right=True), last).squeeze(-1)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> Tensor:
    # logits: [N, V] -> tokens [N]
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from(logits_to_probs(logits, params), generator)
