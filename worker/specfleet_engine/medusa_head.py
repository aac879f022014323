"""Medusa heads: N small heads that each guess a token further ahead from the target's last hidden state.

At position t, head i reads the target's last hidden state and scores the token at t + i + 2
(head 0: the token after next; the target's own LM head already gives t + 1). One call scores
every head: no KV cache, no feedback of drafted tokens, so a draft costs the same whatever its
length. Each head is a residual block `h + SiLU(W h)` followed by a projection onto the reduced
draft vocabulary of the EAGLE head (draft_head.py), mapped back to the target's ids.

The hidden state read: the target's **final-norm input** (the residual stream after its last
layer, what the engine hands a proposer whose `target_layers` is the last layer). The heads apply
their own copy of the target's final RMSNorm to it (trained with them, starting as the target's),
so at initialisation they see exactly what the target's LM head sees, as in Medusa.

On disk: the EAGLE head's layout and checks (`config.json` naming the target and its fingerprint,
`head.safetensors`), format `specfleet-medusa/1`; `load_medusa_head` refuses a head for another
target naming what differs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from .draft_head import DraftVocabHead, FitsTarget, lm_head_rows, load_module, target_fingerprint
from .model import ModelArgs, RMSNorm, Transformer, linear, rms_norm

FORMAT = "specfleet-medusa/1"
DEFAULT_HEADS = 4


@dataclass(frozen=True)
class MedusaConfig(FitsTarget):
    FORMAT: ClassVar[str] = FORMAT

    heads: int
    draft_vocab_size: int
    # the target it fits
    target_vocab_size: int
    target_dim: int
    target_layers: int
    target_fingerprint: str
    format: str = FORMAT
    trained: dict = dataclasses.field(default_factory=dict)  # how it was made (command, tokens, time, acceptance)

    @classmethod
    def for_target(cls, target: Transformer, draft_vocab_size: int, heads: int = DEFAULT_HEADS) -> MedusaConfig:
        a = target.args
        return cls(heads=heads, draft_vocab_size=min(draft_vocab_size, a.vocab_size), target_vocab_size=a.vocab_size,
                   target_dim=a.dim, target_layers=a.n_layers, target_fingerprint=target_fingerprint(target))

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layer whose output the heads read: the last (the final norm's input)."""
        return (self.target_layers - 1,)


class MedusaHead(DraftVocabHead):
    """The heads' weights; `forward` scores all of them at once."""

    def __init__(self, config: MedusaConfig, target_args: ModelArgs):
        super().__init__(config.draft_vocab_size)
        self.config = config
        d, self.eps = target_args.dim, target_args.norm_eps
        self.norm = RMSNorm(d, self.eps)  # the target's final norm, a copy
        self.blocks = nn.ModuleList(nn.Linear(d, d, bias=True) for _ in range(config.heads))
        self.outputs = nn.ModuleList(nn.Linear(d, config.draft_vocab_size, bias=False) for _ in range(config.heads))

    def draft_vocab_weight(self) -> Tensor:
        return self.norm.weight

    def init_from(self, target: Transformer, draft_vocab: Tensor) -> MedusaHead:
        """Medusa's starting point: every block the identity (W = 0), every projection the
        target's LM-head rows of the draft vocabulary, the target's final norm: each head starts
        out predicting the target's next token."""
        with torch.no_grad():
            self.draft_vocab.copy_(draft_vocab)
            self.norm.weight.copy_(target.norm.weight.detach().float())
            rows = lm_head_rows(target, draft_vocab)
            for block, out in zip(self.blocks, self.outputs):
                block.weight.zero_()
                block.bias.zero_()
                out.weight.copy_(rows)
        return self

    def forward(self, hidden: Tensor, heads: int | None = None) -> Tensor:
        """The target's final-norm inputs [R, dim] -> draft-vocabulary logits [R, heads, Vd] (fp32)
        of the first `heads` heads (all without)."""
        x = rms_norm(hidden.to(self.norm.weight.dtype), self.norm.weight, self.eps)
        out = []
        for block, proj in list(zip(self.blocks, self.outputs))[:heads]:
            out.append(linear(proj, x + nn.functional.silu(linear(block, x))).float())
        return torch.stack(out, dim=1)


def load_medusa_head(path: str | Path, target: Transformer, dtype: torch.dtype | None = None) -> MedusaHead:
    """The Medusa heads at `path` for `target` (safetensors only); HeadMismatch names what does not fit."""
    return load_module(path, target, MedusaConfig, MedusaHead, dtype)
