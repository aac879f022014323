"""Every bad input is INVALID_ARGUMENT with a message that names the field, and the worker keeps
serving; a hypothesis fuzz over the request's fields finds no other outcome."""
from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfleet_worker.testing import CharTokenizer, pb, running_worker, tiny_engine, wait_idle

OK_PROMPT = [1, 2, 3, 4]
CONTEXT = 512  # the tiny model's
LIMIT = 64  # max_tokens limit the worker below runs with

BAD = [
    ("empty prompt", dict(), "prompt"),
    ("empty token list and text", dict(prompt=""), "prompt"),
    ("prompt longer than the context", dict(prompt_token_ids=[1] * CONTEXT), "prompt"),
    ("both prompt forms", dict(prompt="hi", prompt_token_ids=[1]), "prompt, prompt_token_ids"),
    ("text and messages", dict(prompt="hi", messages=[pb.ChatMessage(role="user", content="hi")]), "prompt, messages"),
    ("a role chat does not have", dict(messages=[pb.ChatMessage(role="tool", content="{}")]), "messages[0].role"),
    ("token id outside the vocabulary", dict(prompt_token_ids=[1, 111]), "prompt_token_ids[1]"),
    ("negative token id", dict(prompt_token_ids=[-1]), "prompt_token_ids[0]"),
    ("max_tokens zero", dict(prompt_token_ids=OK_PROMPT, max_tokens=0), "max_tokens"),
    ("max_tokens negative", dict(prompt_token_ids=OK_PROMPT, max_tokens=-5), "max_tokens"),
    ("max_tokens above the limit", dict(prompt_token_ids=OK_PROMPT, max_tokens=LIMIT + 1), "max_tokens"),
    ("temperature negative", dict(prompt_token_ids=OK_PROMPT, temperature=-0.1), "temperature"),
    ("temperature NaN", dict(prompt_token_ids=OK_PROMPT, temperature=math.nan), "temperature"),
    ("temperature infinite", dict(prompt_token_ids=OK_PROMPT, temperature=math.inf), "temperature"),
    ("top_p zero", dict(prompt_token_ids=OK_PROMPT, top_p=0.0), "top_p"),
    ("top_p above one", dict(prompt_token_ids=OK_PROMPT, top_p=1.5), "top_p"),
    ("top_p NaN", dict(prompt_token_ids=OK_PROMPT, top_p=math.nan), "top_p"),
    ("top_k negative", dict(prompt_token_ids=OK_PROMPT, top_k=-1), "top_k"),
    ("a method the worker lacks", dict(prompt_token_ids=OK_PROMPT, speculation_method="medusa"), "speculation_method"),
    ("empty stop string", dict(prompt="hi", stop=[""]), "stop"),
    ("too many stop strings", dict(prompt="hi", stop=["a"] * 9), "stop"),
    ("oversized request", dict(prompt_token_ids=OK_PROMPT, request_id="x" * 100, stop=["y" * 200] * 300), "request"),
    ("request id too long", dict(prompt_token_ids=OK_PROMPT, request_id="x" * 129), "request_id"),
    ("prompt type too long", dict(prompt_token_ids=OK_PROMPT, prompt_type="t" * 65), "prompt_type"),
]


@pytest.fixture(scope="module")
def small_worker():
    with running_worker(tiny_engine(tokenizer=CharTokenizer()), max_tokens_limit=LIMIT,
                        max_request_bytes=32 << 10) as r:
        yield r


@pytest.mark.parametrize("fields, name", [(f, n) for _, f, n in BAD], ids=[d for d, _, _ in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(small_worker, fields, name):
    for call in (small_worker.gen.Generate, lambda m: list(small_worker.gen.GenerateStream(m))):
        with pytest.raises(grpc.RpcError) as e:
            call(pb.GenerateRequest(**fields))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(name), e.value.details()
    ok = small_worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=OK_PROMPT, max_tokens=2, ignore_eos=True))
    assert len(ok.token_ids) == 2


def test_a_request_far_above_the_limit_is_still_invalid_argument(small_worker):
    with pytest.raises(grpc.RpcError) as e:
        small_worker.gen.Generate(pb.GenerateRequest(prompt="x" * (5 << 20)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request:")


def test_text_prompts_and_stop_strings_need_a_tokenizer():
    with running_worker() as r:  # the tiny model alone: token ids only
        for fields, name in [(dict(prompt="hello"), "prompt"), (dict(prompt_token_ids=[1], stop=["x"]), "stop")]:
            with pytest.raises(grpc.RpcError) as e:
                r.gen.Generate(pb.GenerateRequest(**fields))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(name)


requests = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=40),
    "prompt_token_ids": st.lists(st.integers(-3, 115), max_size=40),
    "max_tokens": st.integers(-3, LIMIT + 3),
    "temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 3)),
    "top_k": st.integers(-3, 200),
    "top_p": st.one_of(st.floats(allow_nan=True), st.floats(0, 1)),
    "seed": st.integers(-(2 ** 63), 2 ** 63 - 1),
    "stop": st.lists(st.text(max_size=4), max_size=3),
    "logprobs": st.booleans(),
    "ignore_eos": st.booleans(),
    "apply_chat_template": st.booleans(),
    "messages": st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant", "tool", ""]),
                                   content=st.text(max_size=12)), max_size=3),
    "speculation_method": st.sampled_from(["", "auto", "none", "ngram", "eagle", "NGRAM", "\x00"]),
    "prompt_type": st.text(max_size=8),
    "request_id": st.text(max_size=12),
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=requests, stream=st.booleans())
def test_fuzzed_requests_either_complete_or_are_invalid_arguments(small_worker, fields, stream):
    if "max_tokens" not in fields:
        fields["max_tokens"] = 8  # keep examples quick; the limit is fuzzed when present
    msg = pb.GenerateRequest(**fields)
    try:
        if stream:
            chunks = list(small_worker.gen.GenerateStream(msg, timeout=30))
            assert chunks and chunks[-1].finish_reason in ("stop", "length")
            assert sum(len(c.token_ids) for c in chunks) <= msg.max_tokens
        else:
            resp = small_worker.gen.Generate(msg, timeout=30)
            assert resp.finish_reason in ("stop", "length") and len(resp.token_ids) <= msg.max_tokens
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())


def test_after_the_fuzzing_the_worker_is_idle_and_nothing_failed(small_worker):
    stats = wait_idle(small_worker)
    assert (stats.queue_depth, stats.running, stats.kv_blocks_used, stats.failed_total) == (0, 0, 0, 0)
    assert small_worker.worker.scheduler.alive
