"""The answers captured from real vLLM servers (tests/vllm/data, written by tests/vllm/capture.py;
docs/vllm-local.md describes them): what a parser of vLLM's answers may rely on, held here without
vLLM. The official `openai` client's types read every body and chunk; the plain server's answers
carry timings and no speculative counts; the n-gram server's carry counts that agree with
themselves and with the answer's length; a stream's metrics come in its last chunk only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
SERVERS = ("plain", "ngram")


def bodies(server: str) -> list[dict]:
    files = sorted((DATA / server).glob("chat-q*.json"))
    assert len(files) >= 3, f"{DATA / server}: the captured answers are missing (tests/vllm/capture.py)"
    return [json.loads(f.read_text()) for f in files]


def stream_events(server: str) -> list[dict | str]:
    """A captured stream's events in order: each `data:` payload, parsed, and the final [DONE]."""
    (sse,) = (DATA / server).glob("stream-q*.sse")
    events = []
    for block in sse.read_text().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def server_k(server: str) -> int | None:
    argv = json.loads((DATA / "servers.json").read_text())["argv"][server]
    if "--speculative-config" not in argv:
        return None
    return json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"]


@pytest.mark.parametrize("server", SERVERS)
def test_whole_answers(server, spec_metrics, timing_metrics):
    from openai.types.chat import ChatCompletion

    k = server_k(server)
    accepted = 0
    for record in bodies(server):
        body = record["response"]
        parsed = ChatCompletion.model_validate(body)
        tokens = parsed.usage.completion_tokens
        assert tokens == record["request"]["max_tokens"] and parsed.choices[0].finish_reason == "length"
        timing_metrics(body["metrics"], tokens)
        if k is None:
            assert body["metrics"]["speculative_decoding"] is None
        else:
            accepted += spec_metrics(body["metrics"], tokens, k)["num_accepted_draft_tokens"]
    assert k is None or accepted > 0


@pytest.mark.parametrize("server", SERVERS)
def test_a_stream(server, spec_metrics, timing_metrics):
    """Chunks with one choice each until the one that says finish_reason, then one with usage and
    metrics and no choices, then [DONE]; the text is the deltas' in order."""
    from openai.types.chat import ChatCompletionChunk

    k = server_k(server)
    events = stream_events(server)
    assert events[-1] == "[DONE]"
    *chunks, last = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert all(len(c.choices) == 1 for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all("metrics" not in e for e in events[:-2])
    assert last.choices == [] and last.usage is not None
    metrics = events[-2]["metrics"]
    timing_metrics(metrics, last.usage.completion_tokens)
    if k is None:
        assert "speculative_decoding" not in metrics
    else:
        spec = spec_metrics(metrics, last.usage.completion_tokens, k)
        # a step that accepts drafts sends them in one chunk: fewer chunks than tokens
        assert len(chunks) - 1 < last.usage.completion_tokens or spec["num_accepted_draft_tokens"] == 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_the_spec_metrics_check_catches_counts_that_disagree(spec_metrics):
    """The check the tests above and the live tests use fails on each kind of inconsistency."""
    good = {"speculative_decoding": {"mean_acceptance_length": 2.0, "draft_acceptance_rate": 0.5,
                                     "acceptance_histogram": [1, 0, 1], "num_spec_steps": 2,
                                     "num_accepted_draft_tokens": 2, "num_draft_tokens": 4, "num_spec_tokens": 2}}
    spec_metrics(good, 10, 2)
    spec = good["speculative_decoding"]
    for bad in ({"num_spec_steps": 3}, {"num_accepted_draft_tokens": 3}, {"num_draft_tokens": 1},
                {"num_draft_tokens": 5}, {"acceptance_histogram": [1, 1]}, {"mean_acceptance_length": 1.5},
                {"draft_acceptance_rate": 0.25},
                {"num_spec_tokens": 3}):
        with pytest.raises(AssertionError):
            spec_metrics({"speculative_decoding": {**spec, **bad}}, 10, 2)
    with pytest.raises(AssertionError):
        spec_metrics(good, 4, 2)  # 2 steps emitting 2 accepted + 2 tokens after the prefill's one: 5 at least
    with pytest.raises(AssertionError):
        spec_metrics({"speculative_decoding": None}, 10, 2)
