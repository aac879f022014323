"""A real vLLM server (the CPU build) without speculation on the exported bundled model, through
the official `openai` client: its greedy answers are our engine's, token for token, streamed and
not, and each answer carries the per-request timings and no speculative counts. Also: HF
transformers of vLLM's own venv (another version than .venv's) loads the export to our answer.

`./dev setup --vllm`, then `./dev test -m vllm`.
"""

from __future__ import annotations

import json
import subprocess
import warnings

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKENS = 64


@pytest.fixture(scope="module")
def server(start_vllm):
    return start_vllm()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


def chat(client, prompt: str, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)


def test_greedy_answers_are_our_engines(client, ours, prompts, same_greedy, timing_metrics):
    for q in prompts:
        prompt, mine = ours(q["turns"][0], TOKENS)
        r = chat(client, q["turns"][0])
        assert r.prompt_token_ids == prompt, "vLLM rendered the chat template to other tokens than ours"
        choice = r.choices[0]
        assert (choice.finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens) == ("length", TOKENS,
                                                                                          len(prompt))
        note = same_greedy(prompt, mine, choice.token_ids, "vLLM")
        if note:
            warnings.warn(f"question {q['question_id']}: {note}")
        metrics = r.model_extra["metrics"]
        timing_metrics(metrics, TOKENS)
        assert metrics["speculative_decoding"] is None


def test_a_stream_carries_the_same_tokens_and_ends_with_usage_and_metrics(client, ours, prompts, same_greedy,
                                                                          timing_metrics):
    q = prompts[0]
    prompt, mine = ours(q["turns"][0], TOKENS)
    chunks = list(chat(client, q["turns"][0], stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    tokens = [t for c in body for choice in c.choices for t in (choice.model_extra.get("token_ids") or [])]
    assert tokens == chat(client, q["turns"][0]).choices[0].token_ids
    same_greedy(prompt, mine, tokens, "vLLM")
    assert body[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == TOKENS
    metrics = last.model_extra["metrics"]
    timing_metrics(metrics, TOKENS)
    assert "speculative_decoding" not in metrics  # a stream's last chunk leaves out what is None


def test_transformers_of_the_vllm_venv_loads_the_export_to_our_answer(export_dir, ours, prompts, same_greedy):
    from specfleet_local.vllm import vllm_python

    q = prompts[1]
    prompt, mine = ours(q["turns"][0], 32)
    script = """
import json, sys, torch
from transformers import AutoModelForCausalLM, GenerationConfig
folder, prompt = sys.argv[1], json.loads(sys.argv[2])
m = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
config = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=2)
with torch.inference_mode():
    out = m.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
print(json.dumps({"dtype": str(m.dtype), "output": out}))
"""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([str(vllm_python()), "-c", script, str(export_dir), json.dumps(prompt)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["dtype"] == "torch.float32"
    same_greedy(prompt, mine, theirs["output"], "HF transformers (vLLM's venv)")
