"""`specfleet bench --configs vllm/none,vllm/ngram` end to end on 2 Spec-Bench questions: two real
vLLM servers (one a configuration, on the bench's cached export), beside our fp32 plain decoding.
vLLM's greedy token ids are ours on both questions (as tests/vllm's greedy tests find), n-gram
drafts at the bench's K and is lossless, and the results keep each server's start, cores and
flags, and its answers' own seconds within the seconds timed here.

`./dev setup --vllm`, then `flock /tmp/vllm.lock ./dev test -m vllm tests/vllm/test_bench_vllm.py`.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

# two server starts (each bounded as conftest's SERVER_START_S bounds one) and the run
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2 * 1800 + 600)]

TOKENS, K = 24, 3


def test_vllm_configs_beside_ours(tmp_path):
    from specfleet_bench.questions import default_questions, pick_prompts
    from specfleet_bench.spec_bench import run_bench
    from specfleet_bench.spec_bench_vllm import cpu_set

    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in pick_prompts(default_questions(), 2)))
    threads = min(2, len(os.sched_getaffinity(0)))
    out = tmp_path / "bench.json"
    args = argparse.Namespace(questions=questions, model="smollm2-135m", configs="vllm/none,vllm/ngram",
                              per_category=0, max_tokens=TOKENS, k=K, hf_lookup_tokens=10, threads=threads,
                              out=out, plot=tmp_path / "bench.png")
    assert run_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["configs"] == ["fp32/none", "vllm/none", "vllm/ngram"] and result["questions"] == 2
    overall = result["table"]["overall"]
    for name in ("vllm/none", "vllm/ngram"):
        row = overall[name]
        assert row["tokens"] > 0 and row["tok_s"] > 0
        assert (row["equal_to_fp32_plain"], row["questions"]) == (2, 2), result["vllm"][name]
        info = result["vllm"][name]
        assert info["agreement_with_fp32_plain"] == {"equal": 2, "questions": 2, "first_difference": {}}
        assert info["ready_after_s"] > 0 and info["cpus"] == cpu_set(threads)
        assert 0 < info["server_seconds"] < info["client_seconds"]
        assert "--enable-per-request-metrics" in info["argv"]
        runs = [r for r in result["runs"] if r["config"] == name]
        assert len(runs) == 2 and all(r["tokens"] <= TOKENS and r["seconds"] > 0 for r in runs)
    assert overall["vllm/none"]["tokens"] == overall["fp32/none"]["tokens"] == overall["vllm/ngram"]["tokens"]
    spec = result["vllm"]["vllm/ngram"]
    argv = spec["argv"]
    assert spec["k"] == K and json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == K
    assert "--per-request-spec-decode-metrics" in argv
    assert overall["vllm/ngram"]["alpha"] is not None and overall["vllm/ngram"]["tau"] >= 1.0
    assert result["spec_equals_plain"]["vllm/ngram"] == 2
    assert "=2/2" in out.with_suffix(".md").read_text()
