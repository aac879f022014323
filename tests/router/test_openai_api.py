"""The OpenAI shapes without a server: what a body becomes, and every module's worked examples."""
from __future__ import annotations

import doctest

import pytest

from specfleet_router import backends, dispatch, openai_api, state
from specfleet_router.openai_api import BadRequest, parse_chat, parse_completion


@pytest.mark.parametrize("module", [openai_api, dispatch, backends, state], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_a_chat_body_becomes_the_workers_request():
    job = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Summarize "}, {"type": "text", "text": "this."}]},
        {"role": "assistant", "content": None}],
        "max_tokens": 9, "max_completion_tokens": 7, "temperature": 0, "top_k": -1, "seed": 5, "stop": "END",
        "user": "u1", "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0})
    msg = job.to_proto("rid")
    assert [(m.role, m.content) for m in msg.messages] == [
        ("system", "Be brief."), ("user", "Summarize this."), ("assistant", "")]
    assert (msg.max_tokens, job.max_tokens_param) == (7, "max_completion_tokens")  # the newer name wins
    assert (msg.temperature, msg.HasField("top_k"), msg.top_k, msg.seed, list(msg.stop)) == (0.0, True, 0, 5, ["END"])
    assert not msg.HasField("top_p")  # unset stays unset: the worker's default
    assert msg.prompt_type == "summarization" and job.user == "u1" and job.stream and job.include_usage


def test_defaults_follow_openai():
    job = parse_completion({"model": "m", "prompt": ["Tell me a story"]})
    msg = job.to_proto("rid")
    assert msg.prompt == "Tell me a story" and msg.temperature == 1.0 and not msg.HasField("max_tokens")
    assert not job.stream and not job.logprobs
    ids = parse_completion({"model": "m", "prompt": [1, 2, 3], "logprobs": 0})
    assert list(ids.to_proto("r").prompt_token_ids) == [1, 2, 3] and ids.prompt_type.value == "other"
    assert ids.logprobs and ids.top_logprobs == 0


def test_a_refusal_after_classification_still_knows_the_prompt_type():
    with pytest.raises(BadRequest) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "Translate into French: hi"}], "n": 3})
    assert e.value.param == "n" and e.value.prompt_type.value == "translation"
    with pytest.raises(BadRequest) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}]})
    assert e.value.param == "model" and e.value.prompt_type is None
