"""The OpenAI-compatible HTTP front, driven by the official `openai` client, in front of a real
worker (the tiny random model, character tokenizer, real gRPC)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from specfleet_proto import worker_pb2 as pb
from specfleet_worker.testing import wait_idle


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a python function"}]


def direct(worker, **kw) -> pb.GenerateResponse:
    """The same request straight to the worker: what the router must give back."""
    return worker.gen.Generate(pb.GenerateRequest(**kw), timeout=30)


def test_completion_equals_the_workers_own_answer_and_names_its_route(h, router, worker):
    raw = h.client(router).completions.with_raw_response.create(
        model="specfleet", prompt="Please summarize: the cat sat on the mat.", max_tokens=12, temperature=0)
    c = raw.parse()
    want = direct(worker, prompt="Please summarize: the cat sat on the mat.", max_tokens=12, temperature=0)
    assert c.choices[0].text == want.text and len(want.text) > 0
    assert c.choices[0].finish_reason == want.finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (want.usage.prompt_tokens, 12)
    assert c.usage.total_tokens == want.usage.prompt_tokens + 12
    assert c.object == "text_completion" and c.model == "specfleet" and c.id.startswith("cmpl-")
    h = raw.headers
    assert (h["x-specfleet-arm"], h["x-specfleet-method"], h["x-specfleet-prompt-type"]) == (
        "stable", "ngram", "summarization")


def test_chat_sends_messages_and_streaming_equals_unary(h, router, worker):
    c = h.client(router)
    unary = c.chat.completions.with_raw_response.create(model="specfleet", messages=CHAT, max_tokens=16,
                                                        temperature=0)
    want = direct(worker, messages=[pb.ChatMessage(**m) for m in CHAT], max_tokens=16, temperature=0)
    got = unary.parse()
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.object == "chat.completion" and got.usage.completion_tokens == 16
    assert unary.headers["x-specfleet-prompt-type"] == "code"

    with c.chat.completions.with_streaming_response.create(model="specfleet", messages=CHAT, max_tokens=16,
                                                           temperature=0, stream=True) as s:
        assert s.headers["x-specfleet-prompt-type"] == "code" and s.headers["x-specfleet-arm"] == "stable"
        assert s.headers["content-type"].startswith("text/event-stream")
        chunks = list(s.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert all(ch.usage is None for ch in chunks)  # no usage unless asked


def test_stream_usage_comes_last_when_asked(h, router):
    for create, kw in [(h.client(router).chat.completions.create, {"messages": CHAT}),
                       (h.client(router).completions.create, {"prompt": "Hello"})]:
        chunks = list(create(model="specfleet", max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True}, **kw))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
        assert all(ch.usage is None for ch in chunks[:-1])
        assert chunks[-2].choices[0].finish_reason == "length"


def test_the_sse_wire_format_ends_with_done(h, router):
    req = urllib.request.Request(router.base_url + "/completions", method="POST", data=json.dumps(
        {"model": "specfleet", "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_stop_strings_cut_the_text_streaming_or_not(h, router, worker):
    free = direct(worker, prompt="Hello", max_tokens=24, temperature=0).text
    stop = free[5:7]  # two characters from the middle of what it would write
    want = free[:free.index(stop)]
    c = h.client(router)
    got = c.completions.create(model="specfleet", prompt="Hello", max_tokens=24, temperature=0, stop=stop)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="specfleet", prompt="Hello", max_tokens=24, temperature=0,
                                    stop=[stop, "never"], stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want


def test_seeded_sampling_repeats_and_the_seed_matters(h, router):
    c = h.client(router)

    def sample(seed):
        return c.chat.completions.create(model="specfleet", messages=CHAT, max_tokens=24, temperature=1.0,
                                         top_p=0.95, seed=seed).choices[0].message.content

    a, b, other = sample(1234), sample(1234), sample(99)
    assert a == b and a != other


def test_logprobs_for_each_token(h, router, worker):
    c = h.client(router)
    chat = c.chat.completions.create(model="specfleet", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=1)
    want = direct(worker, messages=[pb.ChatMessage(**m) for m in CHAT], max_tokens=6, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == [f"token_id:{i}" for i in want.token_ids]
    assert [t.logprob for t in content] == pytest.approx(list(want.logprobs))
    assert all(len(t.top_logprobs) == 1 for t in content)
    comp = c.completions.create(model="specfleet", prompt="Hello", max_tokens=4, temperature=0, logprobs=0)
    assert len(comp.choices[0].logprobs.token_logprobs) == 4 and comp.choices[0].logprobs.top_logprobs is None
    streamed = list(c.completions.create(model="specfleet", prompt="Hello", max_tokens=4, temperature=0, logprobs=1,
                                         stream=True))
    lps = [lp for ch in streamed if ch.choices[0].logprobs for lp in ch.choices[0].logprobs.token_logprobs]
    assert lps == pytest.approx(comp.choices[0].logprobs.token_logprobs)


def test_models_lists_the_deployment_and_its_alias_is_served(h, router):
    c = h.client(router)
    assert [m.id for m in c.models.list()] == ["specfleet"]
    assert c.models.retrieve("tiny-random").id == "specfleet"
    out = c.completions.create(model="tiny-random", prompt="Hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"
    assert e.value.body["code"] == "model_not_found" and "specfleet" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


@pytest.mark.parametrize("kw, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"max_tokens": 10_000_000}, "max_tokens"),  # past the worker's limit: the worker names it
    ({"n": 2}, "n"),
    ({"stop": [""]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"seed": "abc"}, "seed"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"model": ""}, "model"),
    ({"user": 42}, "user"),
])
def test_bad_chat_inputs_are_400_naming_the_field(h, router, kw, param):
    body = {"model": "specfleet", "messages": CHAT, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        h.client(router).chat.completions.create(**body)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and param in err["message"], err
    headers = e.value.response.headers
    assert {"x-specfleet-arm", "x-specfleet-method", "x-specfleet-prompt-type"} <= set(headers)


@pytest.mark.parametrize("kw, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, 2, 10_000]}, "prompt"),  # a token id outside the vocabulary: the worker names it
    ({"logprobs": 9}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
])
def test_bad_completion_inputs_are_400_naming_the_field(h, router, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        h.client(router).completions.create(**{"model": "specfleet", "prompt": "Hi", "max_tokens": 4, **kw})
    assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body


def test_a_body_that_is_not_json_is_400(h, router):
    req = urllib.request.Request(router.base_url + "/chat/completions", method="POST", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and "not JSON" in body["error"]["message"]
    assert e.value.headers["x-specfleet-arm"] == "-"


def test_no_ready_backend_is_503_and_readyz_says_so(h, worker):
    from specfleet_local.redis_server import free_port

    dead = f"127.0.0.1:{free_port()}"
    with h.router_over([dead], [dead]) as r:
        with pytest.raises(openai.InternalServerError) as e:
            h.client(r).chat.completions.create(model="specfleet", messages=CHAT, max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "no_ready_backend"
        assert e.value.response.headers["x-specfleet-prompt-type"] == "code"
        with pytest.raises(openai.InternalServerError):  # streaming: a plain 503 too, not a broken stream
            h.client(r).chat.completions.create(model="specfleet", messages=CHAT, max_tokens=2, stream=True)
        status, text = r.get("/readyz")
        assert status == 503 and "no ready backend" in text
        assert r.metric("specfleet_router_requests_total", {"arm": "stable", "prompt_type": "code",
                                                              "method": "ngram", "outcome": "unavailable"}) == 2



def slow_ngram(h) -> dict:
    """The routing table names only real methods: these workers' n-gram proposer is a slow one."""
    return {"ngram": h.SlowProposer(0.02)}


def test_every_backend_shedding_load_is_429(h):
    with h.text_worker(proposers=slow_ngram(h), max_batch_size=1, max_queue=0) as w, h.router_over([w]) as r:
        hog = w.gen.GenerateStream(pb.GenerateRequest(prompt="x", max_tokens=400, ignore_eos=True), timeout=60)
        next(hog)  # running: the worker has no room left
        with pytest.raises(openai.RateLimitError) as e:
            h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert "at capacity" in e.value.body["message"] and e.value.body["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            list(h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=2, stream=True))
        hog.cancel()
        wait_idle(w)
        # greedy: at the default temperature 1.0 the tiny model may draw its EOS first (CI once did)
        assert h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=2,
                                              temperature=0).usage.completion_tokens == 2
        assert r.metric("specfleet_router_requests_total", {"arm": "stable", "prompt_type": "chat",
                                                              "method": "ngram", "outcome": "overloaded"}) == 2


def test_the_request_timeout_reaches_the_worker(h):
    with h.text_worker(proposers=slow_ngram(h)) as w, h.router_over([w], request_timeout_s=0.3) as r:
        req = urllib.request.Request(r.base_url + "/completions", method="POST", data=json.dumps(
            {"model": "specfleet", "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 504
        stats = wait_idle(w)
        assert (stats.running, stats.kv_blocks_used) == (0, 0)


def test_metrics_count_requests_by_route_and_time_tokens(h, router):
    before = router.metric("specfleet_router_time_to_first_token_seconds_count", {"arm": "stable"})
    h.client(router).completions.create(model="specfleet", prompt="Translate to French: cat", max_tokens=4,
                                      temperature=0)
    list(h.client(router).completions.create(model="specfleet", prompt="Translate to French: cat", max_tokens=4,
                                           temperature=0, stream=True))
    assert router.metric("specfleet_router_requests_total", {"arm": "stable", "prompt_type": "translation",
                                                             "method": "ngram", "outcome": "ok"}) == 2
    assert router.metric("specfleet_router_time_to_first_token_seconds_count", {"arm": "stable"}) == before + 2
    assert router.metric("specfleet_router_time_per_output_token_seconds_count", {"arm": "stable"}) >= 2
    status, text = router.get("/metrics")
    for name in ("specfleet_router_requests_total", "specfleet_router_e2e_request_latency_seconds_bucket",
                 "specfleet_router_retries_total", "specfleet_router_state_version",
                 "specfleet_router_redis_staleness_seconds", "specfleet_router_backend_ready"):
        assert name in text, name
    assert router.get("/healthz")[0] == 200 and router.get("/readyz")[0] == 200


def test_trace_context_passes_through_to_the_worker(h, router, worker):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    h.client(router).completions.create(model="specfleet", prompt="Hi", max_tokens=2, temperature=0, extra_headers={
        "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    spans = worker.exporter.get_finished_spans()
    assert any(format(s.context.trace_id, "032x") == trace_id and s.parent is not None
               and format(s.parent.span_id, "016x") == "00f067aa0ba902b7" for s in spans)


def test_a_stream_that_breaks_after_its_first_token_ends_with_an_error(h):
    with h.text_worker(proposers=slow_ngram(h)) as w, h.router_over([w]) as r:
        stream = h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=400, stream=True,
                                              extra_body={"ignore_eos": True})
        next(iter(stream))
        w.server.grpc.stop(0)  # the worker goes away mid-stream
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert "backend" in str(e.value.message)
        assert r.metric("specfleet_router_retries_total", {"arm": "stable", "reason": "unavailable"}) == 0


def test_a_client_that_goes_away_mid_stream_cancels_the_workers_request(h):
    with h.text_worker(proposers=slow_ngram(h)) as w, h.router_over([w]) as r:
        stream = h.client(r).completions.create(model="specfleet", prompt="Hi", max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))
        assert w.stats().running == 1
        stream.close()  # the connection closes under the router
        stats = wait_idle(w)
        assert (stats.running, stats.kv_blocks_used) == (0, 0)
        end = time.monotonic() + 5
        while r.server.router.in_flight:
            assert time.monotonic() < end, "the router still counts the request in flight"
            time.sleep(0.02)
        assert r.metric("specfleet_router_backend_outstanding_requests", {"arm": "stable", "backend": h.target(w)}) == 0
        counts = {o: r.metric("specfleet_router_requests_total", {"arm": "stable", "prompt_type": "chat",
                                                                  "method": "ngram", "outcome": o})
                  for o in ("ok", "cancelled")}
        assert counts == {"ok": 0, "cancelled": 1}
