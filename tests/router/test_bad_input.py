"""Bad input never gets a 500: each request that once did (an int32 field past its range, a body
nested 5,000 deep, a 100 kB header, a lone surrogate, a header byte that is not UTF-8) is a 400
with OpenAI's error naming the field and the limit, and the router serves on. Then both fronts
fuzzed (hypothesis): never a 5xx or INTERNAL, always a 4xx / INVALID_ARGUMENT with a message, or
a success, and a valid request served after each.

The worker is the tiny random model with max_tokens capped at 8, so that whatever the fuzz asks
for is answered in milliseconds; both arms are that worker at a 50% canary weight, so that every
session id goes through the split's hash.
"""
from __future__ import annotations

import http.client
import json
import string

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfleet_api.limits import INT32_MAX, MAX_HEADER_BYTES, MAX_JSON_DEPTH
from specfleet_api.live_state import LiveState
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc

MAX_TOKENS_LIMIT = 8
CHAT = {"model": "specfleet", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": "specfleet", "prompt": "Hi", "max_tokens": 2}
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def odd(h):
    """A router over one short-answering worker in both arms, half the sessions to each."""
    with h.text_worker(max_tokens_limit=MAX_TOKENS_LIMIT) as w, \
            h.router_over([w], [w], state=LiveState(canary_weight=50.0)) as r:
        yield r


def post(router, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None):
    """(status, content type, body bytes) of one POST; headers' values go out as latin-1 bytes."""
    port = int(router.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = raw if raw is not None else json.dumps(body).encode()
    try:
        conn.putrequest("POST", path)
        headers = headers or {}
        if not any(k.lower() == "content-type" for k in headers):  # a second one is the HTTP parser's 400
            headers = {"Content-Type": "application/json", **headers}
        for k, v in headers.items():
            conn.putheader(k, v.encode("latin-1") if isinstance(v, str) else v)
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def openai_error(status: int, ctype: str, data: bytes) -> dict:
    """The error object of a 4xx in OpenAI's shape (fails the test if it is not)."""
    assert 400 <= status < 500, (status, data[:500])
    assert ctype.startswith("application/json"), (status, ctype, data[:500])
    err = json.loads(data)["error"]
    assert err["message"] and err["type"] == "invalid_request_error", err
    return err


def serves(router) -> None:
    status, _, data = post(router, "/v1/chat/completions", {**CHAT, "temperature": 0, "ignore_eos": True})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2, data[:500]


# -- the requests that were 500s -----------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "top_k"])
def test_an_int32_field_past_its_range_is_a_400_naming_it_and_the_limit(odd, path, body, stream, field):
    for value in (INT32_MAX + 1, 2**63, 10**30):
        err = openai_error(*post(odd, path, {**body, field: value, "stream": stream}))
        assert err["param"] == field and str(INT32_MAX) in err["message"] and str(value) in err["message"], err
    ok = post(odd, path, {**body, field: INT32_MAX, "stream": stream})  # the bound itself is the worker's business
    assert ok[0] == 200 or openai_error(*ok)["param"] == field, ok
    serves(odd)


def test_token_ids_and_numbers_past_what_the_wire_holds_are_400s(odd):
    for ids in ([1, INT32_MAX + 1], [-1, 5], [5, -(2**31) - 1]):
        err = openai_error(*post(odd, "/v1/completions", {**COMPLETION, "prompt": ids}))
        assert err["param"] == "prompt" and "prompt[" in err["message"] and str(INT32_MAX) in err["message"], err
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):  # an int too large for a float
        err = openai_error(*post(odd, "/v1/completions", {**COMPLETION, field: 10**400}))
        assert err["param"] == field, err
    err = openai_error(*post(odd, "/v1/completions", {**COMPLETION, "seed": 2**63}))
    assert err["param"] == "seed" and str(2**63 - 1) in err["message"], err
    serves(odd)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 5_000, 100_000])
@pytest.mark.parametrize("where", ["body", "field"])
def test_a_body_nested_past_the_limit_is_a_400_naming_it(odd, depth, where):
    nested = b"[" * depth + b"]" * depth
    raw = nested if where == "body" else b'{"model": "specfleet", "messages": ' + nested + b"}"
    for path in ("/v1/chat/completions", "/v1/completions"):
        err = openai_error(*post(odd, path, raw=raw))
        assert f"deeper than {MAX_JSON_DEPTH} levels" in err["message"], err
    serves(odd)


def test_a_body_at_the_depth_limit_is_read(odd):
    nested = {"type": "text", "text": "Hi"}
    for _ in range(MAX_JSON_DEPTH - 4):  # the content part sits 4 deep in the body
        nested = [nested]
    err = openai_error(*post(odd, "/v1/chat/completions",
                             {**CHAT, "messages": [{"role": "user", "content": nested}]}))
    assert "deeper" not in err["message"] and err["param"] == "messages", err  # refused for its shape, not depth


@pytest.mark.parametrize("header", ["x-session-id", "x-request-id", "tracestate", "x-anything"])
@pytest.mark.parametrize("size", [MAX_HEADER_BYTES + 1, 100_000])
def test_a_header_past_the_limit_is_an_openai_400_naming_it(odd, header, size):
    err = openai_error(*post(odd, "/v1/chat/completions", CHAT, headers={header: "s" * size}))
    assert err["param"] == header and str(size) in err["message"] and str(MAX_HEADER_BYTES) in err["message"], err
    status, _, _ = post(odd, "/v1/chat/completions", CHAT, headers={header: "s" * MAX_HEADER_BYTES})
    assert status == 200
    serves(odd)


@pytest.mark.parametrize("field,body", [
    ("messages", {**CHAT, "messages": [{"role": "user", "content": "a \ud800 b"}]}),
    ("messages", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}),
    ("prompt", {**COMPLETION, "prompt": "x\udc80"}),
    ("stop", {**COMPLETION, "stop": ["ok", "\ud800"]}),
])
def test_a_lone_surrogate_the_worker_cannot_take_is_a_400_naming_the_field(odd, field, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = openai_error(*post(odd, path, raw=json.dumps(body).encode()))  # json.dumps writes "\ud800"
    assert err["param"] == field and "surrogate" in err["message"], err


def test_odd_sessions_request_ids_and_trace_headers_are_served(odd):
    """What the router only hashes, echoes or forwards: a session and a `user` with a lone
    surrogate or a byte that is not UTF-8 still land on an arm; such a request id is replaced; a
    trace header gRPC metadata cannot carry is dropped (W3C: the trace restarts)."""
    for headers in ({"x-session-id": b"\xff\xfe"}, {"x-request-id": b"r\xe9q"}, {"traceparent": b"\xe9"},
                    {"tracestate": "t" * 4000}):
        status, _, data = post(odd, "/v1/completions", COMPLETION, headers=headers)
        assert status == 200, (headers, data[:300])
    status, _, data = post(odd, "/v1/completions", raw=json.dumps({**COMPLETION, "user": "\ud800"}).encode())
    assert status == 200, data[:300]
    status, _, data = post(odd, "/v1/completions", {**COMPLETION, "max_tokens": -1, "user": "\ud800"},
                           headers={"x-session-id": b"\xff"})  # refused, and routed for its headers
    assert openai_error(status, "application/json", data)["param"] == "max_tokens"


def test_a_body_past_the_size_limit_or_a_wrong_method_is_a_client_error(odd):
    err = openai_error(*post(odd, "/v1/completions", {**COMPLETION, "prompt": "x" * (1 << 20)}))
    assert "Too Large" in err["message"], err  # 413, typed as the client's error, not the server's
    port = int(odd.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/completions")
    resp = conn.getresponse()
    openai_error(resp.status, resp.getheader("Content-Type"), resp.read())  # 405
    conn.close()
    serves(odd)


# -- the HTTP front, fuzzed ------------------------------------------------------------------------

# integers where the checks are (the worker's cap, int32, int64, past a float) and anywhere else
INTS = st.sampled_from([0, 1, -1, MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT + 1, INT32_MAX, INT32_MAX + 1, -(2**31) - 1,
                        2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**400]) | st.integers()
# text with everything JSON can carry: lone surrogates (json.dumps writes "\ud800"), NUL, newlines
TEXT = st.text(st.characters(exclude_categories=()) | st.sampled_from(["\ud800", "\udfff", "\x00", "\n", "\u2028"]),
               max_size=12)
SCALARS = st.none() | st.booleans() | st.floats() | TEXT | INTS
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]) | JSON,
    "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text") | JSON, "text": TEXT | JSON}),
                               max_size=2) | JSON})
# what each field may be besides anything at all: values near the ones that pass
NEAR = {
    "model": st.just("specfleet") | TEXT, "messages": st.lists(MESSAGE, max_size=3),
    "prompt": TEXT | st.lists(INTS, min_size=1, max_size=4) | st.lists(TEXT | st.lists(INTS), max_size=2),
    "max_tokens": INTS, "max_completion_tokens": INTS, "top_k": INTS, "n": INTS, "best_of": INTS, "seed": INTS,
    "logprobs": INTS | st.booleans(), "top_logprobs": INTS, "temperature": st.floats() | INTS,
    "top_p": st.floats() | INTS, "presence_penalty": st.floats() | INTS, "frequency_penalty": st.floats() | INTS,
    "stop": TEXT | st.lists(TEXT, max_size=10), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}),
    "response_format": st.fixed_dictionaries({"type": st.just("text") | JSON}), "echo": st.booleans(),
    "user": TEXT, "tools": JSON, "tool_choice": JSON, "functions": JSON, "function_call": JSON, "logit_bias": JSON,
    "suffix": TEXT, "audio": JSON, "prediction": JSON, "unknown_field": JSON,
}


@st.composite
def http_bodies(draw, base: dict):
    """A valid request with up to three fields changed (so that each odd value meets the checks
    past the others), or anything at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    body = {**base, "stream": draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(sorted(NEAR)), min_size=1, max_size=3, unique=True)):
        change = draw(st.sampled_from(["near", "near", "any", "drop"]))
        if change == "drop":
            body.pop(name, None)
        else:
            body[name] = draw(NEAR[name] if change == "near" else JSON)
    return body


# what a header may carry (visible ASCII, space, tab, obs-text bytes); one in four past the limit
SHORT_HEADER = st.text(st.sampled_from(string.printable[:95] + "\t" + "".join(map(chr, range(0x80, 0x100)))),
                       min_size=1, max_size=30)
HEADER_VALUE = st.one_of(SHORT_HEADER, SHORT_HEADER, SHORT_HEADER,
                         st.integers(MAX_HEADER_BYTES - 2, 3 * MAX_HEADER_BYTES).map(lambda n: "s" * n))
HEADERS = st.dictionaries(st.sampled_from(["x-session-id", "x-request-id", "traceparent", "tracestate",
                                           "user-agent", "content-type", "x-odd"]), HEADER_VALUE, max_size=2)


def check_answer(status: int, ctype: str, data: bytes) -> None:
    if status != 200:
        openai_error(status, ctype, data)
        return
    if ctype.startswith("text/event-stream"):
        events = [line[len(b"data: "):] for line in data.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", data[-500:]
        for e in events[:-1]:  # an error after the first token is an event, and never a server error either
            assert json.loads(e).get("error", {}).get("type") in (None, "invalid_request_error"), e
    else:
        assert json.loads(data)["choices"], data[:500]


@FUZZ
@given(chat=st.booleans(), data=st.data(), headers=HEADERS)
def test_fuzz_http_never_a_5xx_and_the_router_serves_after(odd, chat, data, headers):
    body = data.draw(http_bodies(CHAT if chat else COMPLETION))
    # Python's JSON: NaN and Infinity included, as some clients send them
    check_answer(*post(odd, "/v1/chat/completions" if chat else "/v1/completions", raw=json.dumps(body).encode(),
                       headers=headers))
    serves(odd)


# -- the gRPC front, fuzzed ------------------------------------------------------------------------

PROTO_TEXT = st.text(max_size=12)  # a protobuf string is UTF-8: no surrogates
INT32, INT64 = st.integers(-(2**31), INT32_MAX), st.integers(-(2**63), 2**63 - 1)
DOUBLE = st.floats() | st.sampled_from([0.0, 1e-40, 1e-5, 1.0, 2.0, 1e308])


# each field of GenerateRequest: values near the ones that pass, and anywhere in its type
FIELDS = {
    "request_id": st.one_of(PROTO_TEXT, PROTO_TEXT, st.integers(120, 200).map(lambda n: "r" * n)),
    "prompt": PROTO_TEXT, "apply_chat_template": st.booleans(),
    "prompt_token_ids": st.lists(st.integers(-1, 120) | INT32, max_size=5),
    "messages": st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant"]) | PROTO_TEXT,
                                   content=PROTO_TEXT), max_size=3),
    "max_tokens": st.integers(-1, 2 * MAX_TOKENS_LIMIT) | INT32, "temperature": DOUBLE,
    "top_k": st.integers(-1, 200) | INT32, "top_p": DOUBLE, "seed": INT64, "stop": st.lists(PROTO_TEXT, max_size=10),
    "logprobs": st.booleans(), "ignore_eos": st.booleans(),
    "speculation_method": st.sampled_from(["", "auto", "none", "ngram", "draft-model"]) | PROTO_TEXT,
    "prompt_type": st.sampled_from(["", "chat", "code", "math"]) | PROTO_TEXT, "probe": st.booleans(),
}


@st.composite
def grpc_requests(draw) -> pb.GenerateRequest:
    """A valid request with up to three fields set otherwise (a prompt field set beside `prompt`
    replaces it half the time), or every field drawn."""
    if draw(st.integers(0, 9)) == 0:
        return pb.GenerateRequest(**{name: draw(s) for name, s in FIELDS.items()})
    fields = {"prompt": "Hi", "max_tokens": 2}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True)):
        fields[name] = draw(FIELDS[name])
        if name in ("prompt_token_ids", "messages") and draw(st.booleans()):
            fields.pop("prompt", None)
    return pb.GenerateRequest(**fields)


METADATA = st.dictionaries(st.sampled_from(["x-session-id", "traceparent", "tracestate", "x-request-id"]),
                           st.text(st.sampled_from(string.printable[:95]), min_size=1, max_size=40), max_size=3)


@pytest.fixture(scope="module")
def stub(odd):
    with grpc.insecure_channel(odd.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


@FUZZ
@given(msg=grpc_requests(), metadata=METADATA, streaming=st.booleans())
def test_fuzz_grpc_never_internal_and_the_router_serves_after(odd, stub, msg, metadata, streaming):
    try:
        if streaming:
            parts = list(stub.GenerateStream(msg, timeout=30, metadata=tuple(metadata.items())))
            assert parts and parts[-1].finish_reason, parts
        else:
            assert stub.Generate(msg, timeout=30, metadata=tuple(metadata.items())).finish_reason
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details(), (e.code(), e.details(), msg)
    ok = stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2, ignore_eos=True), timeout=30)
    assert ok.usage.completion_tokens == 2
