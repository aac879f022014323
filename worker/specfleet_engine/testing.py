"""Tiny random Llama-family models for tests and examples: real code paths, milliseconds a step;
and a character tokenizer, so that the tiny model serves text and chat messages."""

from __future__ import annotations

import copy

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


class CharTokenizer:
    """Ids 0..94 are printable ASCII; 95..109 decode to nothing; 110 (the tiny model's EOS) ends.

    Its chat template marks each turn with its role and ends with the assistant's open tag:

    >>> t = CharTokenizer()
    >>> t.decode(t.chat_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]))
    '<system>Be brief.</system><user>Hi</user><assistant>'
    >>> t.decode(t.chat("Hi")) == t.decode(t.chat_messages([{"role": "user", "content": "Hi"}]))
    True
    """

    eos_token_ids = [110]

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 if 32 <= ord(c) < 127 else ord("?") - 32 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i) for i in ids if i < 95)

    def chat_messages(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return self.encode(text + "<assistant>")  # the generation prompt

    def chat(self, user: str, system: str | None = None) -> list[int]:
        return self.chat_messages(([{"role": "system", "content": system}] if system else [])
                                  + [{"role": "user", "content": user}])


# The architectures the engine claims, each as a tiny model: Llama (grouped-query attention),
# Qwen2 (q/k/v biases, untied head), Mistral (a sliding window shorter than the test contexts)
# and Llama 3 RoPE scaling (multi-head attention; positions pass the original context length).
TINY_ARCHITECTURES: dict[str, dict] = {
    "llama": dict(),
    "qwen2-bias": dict(attention_bias=True, architecture="qwen2", tie_word_embeddings=False),
    "mistral-window": dict(sliding_window=24, architecture="mistral"),
    "mha-rope-llama3": dict(n_kv_heads=4, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}),
}


def repeating_prompts(n: int, seed: int = 0, vocab: int = 100) -> list[list[int]]:
    """n random prompts of 3 to 36 tokens, most of them a short run repeated, so that the
    n-gram proposer finds something to draft."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(0, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(base * (1 + i % 3) + base[: i % 4])
    return out


def branching_prompts(n: int, seed: int = 0, vocab: int = 100) -> list[list[int]]:
    """n random prompts of a short run repeated with a token changed in each repeat, so that the
    n-gram proposer finds several continuations of the same tail: its drafts are trees."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(0, vocab, (int(torch.randint(5, 9, (1,), generator=g)),), generator=g).tolist()
        prompt = []
        for r in range(4):
            run = list(base)
            run[1 + r % (len(base) - 1)] = int(torch.randint(0, vocab, (1,), generator=g))
            prompt += run
        out.append(prompt + base[:2])
    return out


def run_interpreted(code: str, kernels: str | None = None, timeout: int = 120) -> dict:
    """Runs `code` in a fresh Python under TRITON_INTERPRET=1 (Triton reads it when a kernel is
    built, so it must be set before this process's first launch; a subprocess keeps it from
    leaking) and returns the JSON object its last stdout line prints. kernels: the
    SPECFLEET_KERNELS value there (None: unset)."""
    import json
    import os
    import subprocess
    import sys

    from .kernels.tree_attention import KERNELS_ENV

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(KERNELS_ENV, None)
    if kernels is not None:
        env[KERNELS_ENV] = kernels
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, f"interpreted Triton run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hf_transformers_model(model: Transformer):
    """The same weights in HF transformers' own modeling code, built from the config (no download):
    the outside reference our model must agree with."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .loader import ours_to_hf_state_dict

    cfg = model.args.to_hf_config()
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(ours_to_hf_state_dict(model), strict=False)
    tied = ["lm_head.weight"] if model.args.tie_word_embeddings else []  # HF ties it to the embedding
    if missing != tied or unexpected:
        raise ValueError(f"our checkpoint does not fit HF's {type(hf).__name__}: "
                         f"missing {missing}, unexpected {unexpected}")
    return hf.eval().requires_grad_(False)


def tiny_draft(target: Transformer, noise: float = 0.03, seed: int = 0) -> Transformer:
    """A draft model for `target`: a copy with relative Gaussian noise on every weight, so that it
    agrees with the target often but not always (an independent random model almost never does)."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (noise * float(p.std())))
    return draft


def tiny_head(target: Transformer, prompts: list[list[int]] | None = None, steps: int = 120, seed: int = 0):
    """An EAGLE head for `target`, trained for a few seconds by the real training code on the
    target's greedy answers to repeating prompts, so that its drafts are accepted often but not
    always (an untrained head's almost never are)."""
    from .draft_head import EagleHead, HeadConfig
    from .draft_training import float_embeddings, sequence_loss, target_pass
    from .engine import Engine
    from .sampling import SamplingParams

    prompts = prompts or repeating_prompts(8) + branching_prompts(4)  # what the engine's tests decode
    engine = Engine(target, proposers={})
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    rows = [{"prompt": p, "output": engine.generate(p, params, "none").output} for p in prompts]
    vocab = target.args.vocab_size
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(HeadConfig.for_target(target, vocab), target.args).float().init_from(target, torch.arange(vocab))
    data = target_pass(target, head.config.feature_layers, [r["prompt"] + r["output"] for r in rows], 8)
    emb = float_embeddings(target)
    opt = torch.optim.AdamW(head.parameters(), lr=5e-3)
    for step in range(steps):
        r = step % len(rows)
        opt.zero_grad()
        loss, _, _ = sequence_loss(head, emb, rows[r], *data[r], torch.arange(vocab), 2)
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


def tiny_medusa_head(target: Transformer, prompts: list[list[int]] | None = None, steps: int = 120, seed: int = 0,
                     heads: int = 4):
    """Medusa heads for `target`, trained for a few seconds by the real training loss on the
    target's greedy answers to `prompts` (as `tiny_head`), so that their drafts are often accepted."""
    from .draft_training import medusa_loss, target_pass
    from .engine import Engine
    from .medusa_head import MedusaConfig, MedusaHead
    from .sampling import SamplingParams

    prompts = prompts or repeating_prompts(8) + branching_prompts(4)
    engine = Engine(target, proposers={})
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    rows = [{"prompt": p, "output": engine.generate(p, params, "none").output} for p in prompts]
    vocab = target.args.vocab_size
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = MedusaHead(MedusaConfig.for_target(target, vocab, heads), target.args).float()
        head.init_from(target, torch.arange(vocab))
    data = target_pass(target, head.config.feature_layers, [r["prompt"] + r["output"] for r in rows], 1)
    opt = torch.optim.AdamW(head.parameters(), lr=5e-3)
    for step in range(steps):
        r = step % len(rows)
        opt.zero_grad()
        loss, _, _ = medusa_loss(head, rows[r], data[r][0], torch.arange(vocab))
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)
