"""A learned draft head (EAGLE): one decoder layer that drafts from the target's own features.

At position t the head reads the target's residual stream after a few of its layers (a low, a
middle and a high one, fused: EAGLE-3) and the embedding of the token at t + 1, runs one decoder
layer with its own paged KV cache, and scores the token at t + 2 over a **reduced draft
vocabulary** (the target tokens it saw most in training, mapped back to the target's ids: on
SmolLM2 the 49152 x 576 LM head is a fifth of the model's bytes, too much per draft token on a
CPU). Drafting further, it feeds its own output (its hidden state and the token it drafted) back
in place of the target's features. Verification stays the target's, so whatever the head says the
output is the target's distribution.

On disk: a directory with `head.safetensors` (the weights and the draft vocabulary) and
`config.json` (the architecture, and the target it fits: layers, width, vocabulary and a
fingerprint of its weights); `load_head` refuses a head that does not fit its target, naming what
differs. The head shares the target's token embeddings (not stored).

What every head file shares (the target it fits, its reduced draft vocabulary, its safetensors
file) lives here, in `FitsTarget`, `DraftVocabHead`, `save_head` and `load_module`; Medusa's
heads (medusa_head.py) reuse them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from .model import (Block, FusedStack, ModelArgs, RMSNorm, Transformer, dense_block, fused_stack, interleave_blocks,
                    linear, plan_attention, rms_norm, rope_cache)
from .quant import dense_weight

CONFIG_FILE, WEIGHTS_FILE = "config.json", "head.safetensors"
FORMAT = "specfleet-eagle/1"


class HeadMismatch(ValueError):
    """A head trained for another target (its config names what differs)."""


def default_feature_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of an n-layer target.

    >>> default_feature_layers(30), default_feature_layers(2)
    ((1, 14, 29), (0, 1))
    """
    return tuple(sorted({min(1, n_layers - 1), n_layers // 2 - 1, n_layers - 1}))


def target_fingerprint(model: Transformer) -> str:
    """A short hash of what a head depends on: the target's shape and its token embeddings (which
    every precision and quantization of one model shares)."""
    a = model.args
    h = hashlib.sha256(json.dumps([a.vocab_size, a.dim, a.n_layers, a.n_heads, a.n_kv_heads]).encode())
    emb = model.tok_embeddings.weight.detach()
    h.update(emb[: min(512, emb.shape[0])].float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class FitsTarget:
    """What a head's config says of the target it fits (its dataclass fields `target_vocab_size`,
    `target_dim`, `target_layers`, `target_fingerprint` and `format`), and the checks against a
    target that name what differs."""

    FORMAT: ClassVar[str]
    TUPLES: ClassVar[tuple[str, ...]] = ()  # fields JSON holds as lists

    def shape_problems(self, a: ModelArgs) -> list[str]:
        """How this head does not fit a target of these arguments ([]: its shape fits)."""
        out = []
        if self.format != self.FORMAT:
            out.append(f"format {self.format!r}, this engine reads {self.FORMAT!r}")
        for what, mine, theirs in (("vocabulary size", self.target_vocab_size, a.vocab_size),
                                   ("hidden size", self.target_dim, a.dim), ("layers", self.target_layers, a.n_layers)):
            if mine != theirs:
                out.append(f"the head was trained for a target with {what} {mine}, this target has {theirs}")
        return out

    def mismatches(self, target: Transformer) -> list[str]:
        """How this head does not fit `target` ([]: it fits): its shape, then its weights."""
        out = self.shape_problems(target.args)
        if not out and self.target_fingerprint != target_fingerprint(target):
            out.append(f"the head was trained for a target whose weights' fingerprint is {self.target_fingerprint}, "
                       f"this target's is {target_fingerprint(target)} (another model of the same shape)")
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for name in self.TUPLES:
            d[name] = list(d[name])
        return d

    @classmethod
    def from_json(cls, d: dict):
        if d.get("format", cls.FORMAT) != cls.FORMAT:  # another kind of head: say so, not its fields
            raise HeadMismatch(f"{CONFIG_FILE}: a {d['format']!r} head, where a {cls.FORMAT!r} one is wanted")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{CONFIG_FILE}: unknown fields {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ValueError(f"{CONFIG_FILE}: missing fields {missing}")
        return cls(**{**d, **{name: tuple(d[name]) for name in cls.TUPLES}})


@dataclass(frozen=True)
class HeadConfig(FitsTarget):
    FORMAT: ClassVar[str] = FORMAT
    TUPLES: ClassVar[tuple[str, ...]] = ("feature_layers",)

    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    intermediate_size: int
    # the target it fits
    target_vocab_size: int
    target_dim: int
    target_layers: int
    target_fingerprint: str
    format: str = FORMAT
    trained: dict = dataclasses.field(default_factory=dict)  # how it was made (command, tokens, time, acceptance)

    @classmethod
    def for_target(cls, target: Transformer, draft_vocab_size: int, feature_layers: tuple[int, ...] | None = None,
                   intermediate_size: int | None = None) -> HeadConfig:
        a = target.args
        layers = tuple(feature_layers) if feature_layers else default_feature_layers(a.n_layers)
        return cls(feature_layers=layers, draft_vocab_size=min(draft_vocab_size, a.vocab_size),
                   intermediate_size=intermediate_size or a.intermediate_size, target_vocab_size=a.vocab_size,
                   target_dim=a.dim, target_layers=a.n_layers, target_fingerprint=target_fingerprint(target))

    def head_args(self, target_args: ModelArgs) -> ModelArgs:
        """The head's decoder layer: the target's attention shape, one layer."""
        return dataclasses.replace(target_args, n_layers=1, intermediate_size=self.intermediate_size,
                                   vocab_size=self.draft_vocab_size, tie_word_embeddings=False)


class DraftVocabHead(nn.Module):
    """A head scoring a reduced draft vocabulary (`draft_vocab`: row -> the target's token id),
    which `to_target_logits` maps back to the target's ids."""

    def __init__(self, draft_vocab_size: int):
        super().__init__()
        self.register_buffer("draft_vocab", torch.arange(draft_vocab_size), persistent=True)

    @property
    def dtype(self) -> torch.dtype:
        return self.draft_vocab_weight().dtype

    @property
    def device(self) -> torch.device:
        return self.draft_vocab_weight().device

    def draft_vocab_weight(self) -> Tensor:
        """A weight of the head (its dtype and device are the head's)."""
        raise NotImplementedError

    def to_target_logits(self, logits: Tensor, vocab_size: int) -> Tensor:
        """Draft-vocabulary logits [..., Vd] -> the target's vocabulary [..., V] (-inf off the draft
        vocabulary: the head never drafts those tokens)."""
        out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_vocab, logits)


def lm_head_rows(target: Transformer, draft_vocab: Tensor) -> Tensor:
    """The target's LM-head rows of the draft vocabulary (whatever layout serves it): where a
    head's projection starts."""
    return dense_weight(target.output)[draft_vocab]


class EagleHead(DraftVocabHead):
    """The head's weights and its two forwards: `forward` over the paged cache (serving), and
    `forward_dense` under an explicit mask (training)."""

    def __init__(self, config: HeadConfig, target_args: ModelArgs):
        super().__init__(config.draft_vocab_size)
        self.config = config
        self.args = args = config.head_args(target_args)
        d = args.dim
        self.fuse = nn.Linear(len(config.feature_layers) * d, d, bias=False)  # the target's layers -> one feature
        self.embed_norm = RMSNorm(d, args.norm_eps)
        self.feature_norm = RMSNorm(d, args.norm_eps)
        self.input = nn.Linear(2 * d, d, bias=False)  # [token embedding; feature] -> the layer's input
        self.layer = Block(args)
        self.norm = RMSNorm(d, args.norm_eps)
        self.output = nn.Linear(d, config.draft_vocab_size, bias=False)
        cos, sin = rope_cache(args, args.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.rope_cis: Tensor | None = None  # set by `serving_layout`
        self.stack: FusedStack | None = None  # likewise

    def draft_vocab_weight(self) -> Tensor:
        return self.norm.weight  # a weight every layout keeps as a plain tensor

    def serving_layout(self) -> EagleHead:
        """The target's CPU serving layout for this head, in place (drafting only: training reads
        nn.Linear weights): interleaved RoPE, fp32 linears packed for the CPU kernel, and its
        decoder layer run by the fused step (`fuse_layers`), where each can be had."""
        from .quant import pack_linears
        if self.device.type != "cpu" or self.dtype != torch.float32 or self.rope_cis is not None:
            return self
        self.rope_cis = interleave_blocks([self.layer], self.args, self.rope_cos, self.rope_sin)
        if pack_linears(self):
            self.stack = fused_stack([self.layer], self.args, self.rope_cis, self.device, self.dtype)
        return self

    def init_from(self, target: Transformer, draft_vocab: Tensor) -> EagleHead:
        """A starting point that already drafts something: the target's LM-head rows of the draft
        vocabulary and its last layer's norm; the fusion reads the top feature layer as is."""
        with torch.no_grad():
            self.draft_vocab.copy_(draft_vocab)
            self.output.weight.copy_(lm_head_rows(target, draft_vocab))
            # the target's final norm, damped: its LM head read the target's next token, the head
            # predicts the one after (a confident start would be confidently wrong)
            self.norm.weight.copy_(target.norm.weight.detach().float() * 0.1)
            d, n = self.args.dim, len(self.config.feature_layers)
            self.fuse.weight.zero_()
            self.fuse.weight[:, (n - 1) * d:].copy_(torch.eye(d))
            self.input.weight.mul_(0.1)
            self.input.weight[:, d:].add_(torch.eye(d))
            self.layer.attention.wo.weight.mul_(0.1)
            self.layer.feed_forward.w2.weight.mul_(0.1)
        return self

    def fused(self, feats: Tensor) -> Tensor:
        """The target's layers' features [T, n * dim] -> the head's feature input [T, dim]."""
        return linear(self.fuse, feats.to(self.dtype))

    def _input(self, emb: Tensor, feature: Tensor) -> Tensor:
        a = self.args
        x = torch.cat([rms_norm(emb.to(feature.dtype), self.embed_norm.weight, a.norm_eps),
                       rms_norm(feature, self.feature_norm.weight, a.norm_eps)], dim=-1)
        return linear(self.input, x)

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits [R, Vd] (fp32) of hidden states [R, dim]."""
        return linear(self.output, rms_norm(hidden, self.norm.weight, self.args.norm_eps)).float()

    def forward(self, emb: Tensor, feature: Tensor, meta, kv_caches: list[tuple[Tensor, Tensor]],
                rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """emb: the next tokens' embeddings [T, dim]; feature: the feature each row reads [T, dim]
        (`fused` target features, or the head's own hidden state). Returns the draft-vocabulary
        logits of `rows` (all without) [R, Vd] and the hidden state of every row [T, dim]."""
        x = self._input(emb, feature)
        if self.stack is not None and self.stack.takes(meta, kv_caches):
            hidden = self.stack(x, meta, kv_caches, ())[0]
        else:
            plan = plan_attention(meta, self.args, self.rope_cos.device, kv_caches[0][0].shape[1])
            meta = plan.meta
            if self.rope_cis is not None:
                cos, sin = self.rope_cis.index_select(0, meta.positions), None
            else:
                cos = self.rope_cos.index_select(0, meta.positions).to(feature.dtype)
                sin = self.rope_sin.index_select(0, meta.positions).to(feature.dtype)
            hidden = self.layer(x, cos, sin, meta, plan, kv_caches[0])
        picked = hidden if rows is None else hidden.index_select(0, rows.to(hidden.device, non_blocking=True))
        return self.logits(picked), hidden

    def forward_dense(self, emb: Tensor, feature: Tensor, positions: Tensor, mask: Tensor,
                      past: tuple[Tensor, Tensor] | None = None, queries: Tensor | None = None
                      ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Training: rows [N] at their positions add their keys and values after `past`; the
        `queries` rows (all without) attend under a bool mask [Q, P + N] (True: may attend).
        Returns the queries' hidden states [Q, dim] (`logits` scores them) and the keys and values
        so far (see model.dense_block)."""
        if self.rope_cis is not None:
            raise RuntimeError("this head is in its serving layout (serving_layout): load it again to train it")
        cos = self.rope_cos.index_select(0, positions).to(feature.dtype)
        sin = self.rope_sin.index_select(0, positions).to(feature.dtype)
        return dense_block(self.layer, self._input(emb, feature), cos, sin, mask, past, queries)


def save_head(head: DraftVocabHead, out: str | Path) -> Path:
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": head.config.format})
    (out / CONFIG_FILE).write_text(json.dumps(head.config.to_json(), indent=1) + "\n")
    return out


def read_config(path: str | Path, config_class: type = HeadConfig):
    path = Path(path)
    f = path / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"no draft head at {path}: {CONFIG_FILE} is missing")
    try:
        return config_class.from_json(json.loads(f.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{f}: not a draft head config ({e})") from e


def load_head(path: str | Path, target: Transformer, dtype: torch.dtype | None = None) -> EagleHead:
    """The EAGLE head at `path` for `target` (safetensors only, never a pickle); HeadMismatch
    names what does not fit."""
    return load_module(path, target, HeadConfig, EagleHead, dtype)


def load_module(path: str | Path, target: Transformer, config_class: type, head_class: type,
                dtype: torch.dtype | None = None):
    """A head of `head_class` (its config a `config_class`) at `path` for `target`, from
    safetensors only (never a pickle); HeadMismatch names what does not fit."""
    from safetensors.torch import load_file
    path = Path(path)
    config = read_config(path, config_class)
    problems = config.mismatches(target)
    if problems:
        raise HeadMismatch(f"draft head {path} does not fit the target: " + "; ".join(problems))
    head = head_class(config, target.args)
    state = load_file(str(path / WEIGHTS_FILE))
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft head {path}: missing weights {missing}, unexpected {unexpected}")
    if int(head.draft_vocab.max()) >= target.args.vocab_size:
        raise HeadMismatch(f"draft head {path}: its draft vocabulary names token ids past the target's "
                           f"{target.args.vocab_size}")
    return head.to(dtype or torch.float32).eval().requires_grad_(False)
