"""Greedy decoding, plain and speculative, must reproduce HF transformers' `generate`: 64 tokens,
token for token, on a tiny model of every architecture and on SmolLM2.

HF's modeling code shares nothing with ours, so a bug that plain and speculative decoding share
(a position off by one in both) shows here, where comparing the engine with itself cannot see it.
A divergence is allowed only at a near-tie, where HF's best logit leads ours by less than 1e-4
(rounding decides there, not the model); each one is reported as a warning.
"""

import warnings

import pytest
import torch

from specfleet_engine.engine import Engine
from specfleet_engine.proposers import NgramProposer
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import (TINY_ARCHITECTURES, branching_prompts, hf_transformers_model, repeating_prompts,
                                      tiny_draft, tiny_model)

TOKENS, TIE = 64, 1e-4


def hf_generate(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens [TOKENS] and the raw logits each was chosen from [TOKENS, V]."""
    from transformers import GenerationConfig

    hf.generation_config.eos_token_id = None  # never stop early: ours runs with ignore_eos
    config = GenerationConfig(do_sample=False, max_new_tokens=TOKENS, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), generation_config=config)
    tokens, logits = out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()
    assert tokens == logits.argmax(-1).tolist(), "HF's generate did not take the argmax: a logits processor is on"
    return tokens, logits


def near_ties(hf, prompt: list[int], ours: list[int], theirs: list[int], logits: torch.Tensor) -> list[str]:
    """Fails unless ours is HF's greedy output up to near-ties; returns the near-ties ours took."""
    assert len(ours) == len(theirs) == TOKENS
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is None:
        return []
    # past a near-tie the two continue different texts: judge ours by HF's logits on ours
    with torch.inference_mode():
        forced = hf(torch.tensor([prompt + ours[:-1]])).logits[0].float()  # row len(prompt) - 1 + i predicts ours[i]
    rows = torch.cat([logits[: first + 1], forced[len(prompt) + first:]])
    ties = []
    for i in range(first, TOKENS):
        best = int(rows[i].argmax())
        gap = float(rows[i, best] - rows[i, ours[i]])
        assert gap < TIE, (f"token {i}: ours is {ours[i]}, HF's is {best}, whose logit is {gap:.2e} higher: "
                           f"not a near-tie\n ours {ours[: i + 1]}\n HF's {theirs[: i + 1]}")
        if ours[i] != best:
            ties.append(f"token {i}: {ours[i]} for HF's {best} ({gap:.1e} apart)")
    return ties


def check_against_hf(engine, hf, prompts, runs: list[tuple[str, int]], branching: int = 1) -> None:
    """Each run (method, K) on every prompt; with branching > 1, the runs draft trees too and the
    speculative ones together must have verified branching trees."""
    tree_steps = 0
    for n, prompt in enumerate(prompts):
        theirs, logits = hf_generate(hf, prompt)
        for method, k in runs:
            for width in [1] if method == "none" else sorted({1, branching}):
                engine.tree_branching = width
                seq = engine.generate(prompt, SamplingParams(max_tokens=TOKENS, ignore_eos=True), method, k)
                tree_steps += seq.stats.num_tree_steps
                if method != "none":
                    assert seq.stats.num_draft_tokens > 0 and seq.stats.draft_errors == 0, (method, seq.stats)
                ties = near_ties(hf, prompt, seq.output, theirs, logits)
                if ties:
                    warnings.warn(f"prompt {n}, {method}, branching {width}: ours took the other side of HF's "
                                  f"near-ties: {'; '.join(ties)}")
    assert branching == 1 or tree_steps > 0, "no step verified a branching tree: trees were not compared with HF"


def test_a_divergence_passes_only_at_a_near_tie():
    row = torch.tensor([1.0, 1.0 - 5e-5, 0.0])  # token 0 leads token 1 by 5e-5, token 2 by 1

    class Flat:  # HF's logits are `row` at every position
        def __call__(self, ids):
            return type("Out", (), {"logits": row.expand(1, ids.shape[1], 3)})()

    theirs, logits = [0] * TOKENS, row.expand(TOKENS, 3)
    assert near_ties(Flat(), [0], theirs, theirs, logits) == []
    assert near_ties(Flat(), [0], [0, 1] + [0] * (TOKENS - 2), theirs, logits) == ["token 1: 1 for HF's 0 (5.0e-05 apart)"]
    with pytest.raises(AssertionError, match="token 1: ours is 2, HF's is 0.*not a near-tie"):
        near_ties(Flat(), [0], [0, 2] + [0] * (TOKENS - 2), theirs, logits)


@pytest.mark.parametrize("arch", sorted(TINY_ARCHITECTURES))
def test_tiny_models_generate_what_hf_generates(arch):
    target = tiny_model(seed=1, scale=4.0, **TINY_ARCHITECTURES[arch])
    proposers = {"ngram": NgramProposer(), "draft-model": DraftModelProposer(tiny_draft(target))}
    engine = Engine(target, proposers=proposers, k_policy="fixed")
    # the third prompt (35 tokens) outgrows Mistral's window of 24 already in the prefill
    check_against_hf(engine, hf_transformers_model(target), repeating_prompts(2) + branching_prompts(1),
                     [("none", 0), ("ngram", 4), ("draft-model", 4)], branching=3)


@pytest.mark.slow
def test_smollm2_generates_what_hf_generates():
    from transformers import AutoModelForCausalLM

    from specfleet_engine.factory import prepare_model
    from specfleet_engine.loader import default_gguf_path, load_tokenizer

    # one thread: on a shared 2-core machine two make HF's generate several times slower, not faster
    torch.set_num_threads(1)
    tokenizer = load_tokenizer("smollm2-135m")
    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    engine = Engine(prepare_model("smollm2-135m", "fp32"), tokenizer, max_kv_tokens=8192, k_policy="fixed")
    prompts = [tokenizer.chat("Write a short story about a robot who learns to paint."),
               tokenizer.chat("List the planets of the solar system, one line each, with a fact about each.")]
    check_against_hf(engine, hf, prompts, [("none", 0), ("ngram", 4)], branching=4)
