"""The worker on the real default model (SmolLM2-135M-Instruct): concurrent chat requests return
exactly what each returns alone, text streams, and n-gram drafts get accepted."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from specfleet_engine.engine import Engine
from specfleet_engine.sampling import SamplingParams
from specfleet_worker.config import EngineConfig
from specfleet_worker.main import build_engine
from specfleet_worker.testing import pb, running_worker, wait_idle

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in two sentences: The quick brown fox jumps over the lazy dog. The dog sleeps on.",
    "List three prime numbers and explain why each is prime.",
    "What is the capital of France? Answer in one sentence and repeat the question first.",
]


@pytest.fixture(scope="module")
def smollm2():
    engine = build_engine(EngineConfig(), max_kv_tokens=8192, threads=1)
    return engine


def test_concurrent_chat_requests_equal_single_runs_and_stream_text(smollm2):
    tok = smollm2.tokenizer
    alone = Engine(smollm2.model, tok, proposers=smollm2.proposers, max_kv_tokens=4096)
    expected = [alone.generate(tok.chat(q), SamplingParams(max_tokens=48), method="none").output for q in QUESTIONS]
    with running_worker(smollm2, EngineConfig()) as r:

        def one(i: int):
            msg = pb.GenerateRequest(prompt=QUESTIONS[i], apply_chat_template=True, max_tokens=48,
                                     prompt_type="code" if i == 0 else "chat")
            if i % 2:
                resp = r.gen.Generate(msg, timeout=300)
                return list(resp.token_ids), resp.text, resp.speculation
            chunks = list(r.gen.GenerateStream(msg, timeout=300))
            return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].speculation)

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(len(QUESTIONS))))
        stats = wait_idle(r)
    for (ids, text, spec), want in zip(results, expected):
        assert ids == want
        assert text == tok.decode(want) and text.strip()
    assert sum(spec.num_accepted_tokens for _, _, spec in results) > 0  # chat answers echo their prompts
    assert (stats.running, stats.kv_blocks_used) == (0, 0)


def test_the_bundled_eagle_head_serves_the_plain_output_over_grpc():
    """draft.uri: smollm2-135m-eagle (the head the image carries) with a draft tree: greedy answers
    over gRPC equal plain decoding's, and the head's drafts get accepted."""
    cfg = EngineConfig(draft_method="eagle", draft_uri="smollm2-135m-eagle", default_method="eagle",
                       tree_branching=2, tree_depth=4)
    engine = build_engine(cfg, max_kv_tokens=8192, threads=1)
    assert "eagle" in engine.proposers
    tok = engine.tokenizer
    expected = [engine.generate(tok.chat(q), SamplingParams(max_tokens=48), method="none").output for q in QUESTIONS]
    with running_worker(engine, cfg) as r:
        assert "eagle" in r.admin.GetConfig(pb.GetConfigRequest()).methods
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda q: r.gen.Generate(
                pb.GenerateRequest(prompt=q, apply_chat_template=True, max_tokens=48), timeout=300), QUESTIONS))
        wait_idle(r)
    assert [list(resp.token_ids) for resp in results] == expected
    assert {resp.speculation.method for resp in results} == {"eagle"}
    assert sum(resp.speculation.num_accepted_tokens for resp in results) > 0
