"""vLLM servers behind the router: the engine adapter that lets a vLLM OpenAI server stand where a
specfleet worker stands, and the evidence its answers leave for the loop.

The router talks to every backend through the `specfleet.v1.Generation` stub's calls
(`Generate`, `GenerateStream`, `Score`) and a health watch. `VllmConnection` is that stub over
vLLM's HTTP API: a GenerateRequest becomes an OpenAI request (chat, or a completion of a text or
of token ids), the answer becomes a GenerateResponse (text, token ids, log-probabilities, usage),
and a failure becomes the gRPC status the dispatch already acts on (UNAVAILABLE: eject and retry
elsewhere; RESOURCE_EXHAUSTED: try the arm's other backends; INVALID_ARGUMENT: the client's 400,
with vLLM's message). So the dispatch, the fronts, the drift check and the loop never branch on the
engine; another engine is one more adapter.

A vLLM server runs one draft configuration, so a pool is (arm, draft method), the target names
it (`vllm_target`), and the route's method picks the pool. Each answer asks for token ids
(`return_token_ids`) and, in a stream, for usage (`include_usage`): the last message then carries
`metrics.speculative_decoding`, which `vllm_evidence` counts as a worker counts a request.
`Evidence` keeps those counts per (arm, prompt type) and (arm, prompt type, method) as running
totals and publishes them as sliding windows under one pod name per router, the keys the loop
and `specfleet status` already sum per arm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import grpc

from specfleet_api.limits import WIRE_DEFAULT_MAX_TOKENS, WIRE_DEFAULT_TEMPERATURE
from specfleet_api.live_state import window_key
from specfleet_api.windows import TypeCounts, Windows, method_field, window_json
from specfleet_proto import worker_pb2 as pb

from . import vllm_evidence
from .split import STABLE

log = logging.getLogger("specfleet.router.vllm")

VLLM = "vllm"
PREFIX = "vllm/"
NONE = "none"
#: Percent of a speculating arm's requests sent to its plain pool while that pool's measure of a
#: plain token (the speedup's plain side) is older than BASELINE_STALE_S seconds; none once fresh.
BASELINE_SHARE = 2.0
BASELINE_STALE_S = 60.0
HEALTH_PERIOD_S = 1.0  # how often a ready server's /health is asked
CONNECT_TIMEOUT_S = 5.0
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True)
class Target:
    """Where a backend is: `address` (HOST:PORT), the engine that serves there, and for vLLM the
    one draft method its server runs (None: a specfleet worker serves every method)."""

    address: str
    engine: str = "specfleet"
    method: str | None = None


def vllm_target(method: str, address: str) -> str:
    """A vLLM pool server's target, as discovery lists it beside workers' HOST:PORT.

    >>> vllm_target("ngram", "10.0.0.7:8000")
    'vllm/ngram@10.0.0.7:8000'
    """
    return f"{PREFIX}{method}@{address}"


def parse_target(target: str) -> Target:
    """A discovered target: HOST:PORT (a specfleet worker, gRPC) or vllm/METHOD@HOST:PORT.

    >>> parse_target("10.0.0.7:50051"), parse_target("vllm/none@127.0.0.1:8001")
    (Target(address='10.0.0.7:50051', engine='specfleet', method=None), Target(address='127.0.0.1:8001', engine='vllm', method='none'))
    """
    if target.startswith(PREFIX):
        method, _, address = target[len(PREFIX):].partition("@")
        return Target(address, VLLM, method)
    return Target(target)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a gRPC call would have raised: what the dispatch and the drift check catch."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def status_for(http_status: int) -> grpc.StatusCode:
    """The gRPC status of a vLLM HTTP error.

    >>> [status_for(s).name for s in (400, 404, 413, 429, 500, 503)]
    ['INVALID_ARGUMENT', 'INTERNAL', 'INVALID_ARGUMENT', 'RESOURCE_EXHAUSTED', 'INTERNAL', 'UNAVAILABLE']
    """
    if http_status in (400, 413, 422):
        return grpc.StatusCode.INVALID_ARGUMENT
    if http_status == 429:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if http_status in (502, 503, 504):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def openai_request(req: pb.GenerateRequest, model: str, *, stream: bool) -> tuple[str, dict]:
    """(path, body) of the OpenAI request that asks a vLLM server what `req` asks a worker: the
    same prompt (messages, text or token ids), sampling and limits, with the token ids of the
    answer and, streaming, its usage and metrics in the last chunk.

    >>> path, body = openai_request(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hi")],
    ...                                                max_tokens=5, stop=["\\n"]), "m", stream=False)
    >>> path, body["messages"], body["max_tokens"], body["temperature"], body["stop"], body["return_token_ids"]
    ('/v1/chat/completions', [{'role': 'user', 'content': 'Hi'}], 5, 0.0, ['\\n'], True)
    >>> openai_request(pb.GenerateRequest(prompt_token_ids=[1, 2], top_k=0), "m", stream=True)[1]["prompt"]
    [1, 2]
    """
    body: dict = {"model": model,
                  "max_tokens": req.max_tokens if req.HasField("max_tokens") else WIRE_DEFAULT_MAX_TOKENS,
                  "temperature": req.temperature if req.HasField("temperature") else WIRE_DEFAULT_TEMPERATURE,
                  "return_token_ids": True}
    if req.HasField("top_p"):
        body["top_p"] = req.top_p
    if req.HasField("top_k") and req.top_k > 0:
        body["top_k"] = req.top_k
    if req.HasField("seed"):
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.messages or (req.prompt and req.apply_chat_template):
        path = "/v1/chat/completions"
        body["messages"] = ([{"role": m.role, "content": m.content} for m in req.messages] if req.messages
                            else [{"role": "user", "content": req.prompt}])
        if req.logprobs:
            body["logprobs"], body["top_logprobs"] = True, 0
    else:
        path = "/v1/completions"
        body["prompt"] = list(req.prompt_token_ids) if req.prompt_token_ids else req.prompt
        if req.logprobs:
            body["logprobs"] = 0
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    return path, body


def _choice_logprobs(choice: dict) -> list[float]:
    lp = choice.get("logprobs") or {}
    if "content" in lp:  # chat
        return [float(t.get("logprob", 0.0)) for t in lp.get("content") or []]
    return [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []]


def _choice_text(choice: dict) -> str:
    if "message" in choice:
        return (choice.get("message") or {}).get("content") or ""
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _usage(usage: dict) -> pb.Usage:
    return pb.Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens") or 0))


def speculation_stats(method: str, answer: vllm_evidence.Answer, counts: TypeCounts) -> pb.SpeculationStats:
    """An answer's speculation as a worker reports it (the fronts' headers, the cluster windows).

    >>> a = vllm_evidence.Answer(9, spec=vllm_evidence.SpecMetrics((1, 0, 2), 6, 4))
    >>> s = speculation_stats("ngram", a, vllm_evidence.counts(a, speculating=True, plain_itl_s=None))
    >>> s.method, s.num_steps, s.num_draft_tokens, s.num_accepted_tokens, round(s.acceptance_rate, 3), s.final_k
    ('ngram', 4, 6, 4, 0.667, 2)
    """
    s = pb.SpeculationStats(method=method, num_steps=counts.steps, num_drafts=counts.drafts,
                            num_draft_tokens=counts.draft_tokens, num_accepted_tokens=counts.accepted_tokens,
                            num_draft_nodes=counts.draft_tokens, spec_plain_seconds=counts.spec_plain_seconds,
                            spec_busy_seconds=counts.spec_busy_seconds)
    if answer.spec is not None:
        s.final_k = len(answer.spec.histogram) - 1
        s.accepted_per_position.extend(n for n in counts.pos_accepted if n)
    if counts.draft_tokens:
        s.acceptance_rate = counts.accepted_tokens / counts.draft_tokens
    if counts.steps:
        s.mean_accepted_length = max(answer.output_tokens - 1, 0) / counts.steps
    return s


class Evidence:
    """What the router's vLLM answers showed, per arm: running totals per prompt type and per
    (prompt type, method), each arm's plain baseline (vllm_evidence.PlainBaseline), and the sliding
    windows the FleetPublisher writes under `key(arm)`."""

    def __init__(self, namespace: str, name: str, router: str, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.namespace, self.name, self.router, self.window_s, self.clock = namespace, name, router, window_s, clock
        self.totals: dict[str, dict[str, TypeCounts]] = {}
        self.baselines: dict[str, vllm_evidence.PlainBaseline] = {}
        self._windows: dict[str, Windows] = {}

    def key(self, arm: str) -> str:
        """The hash of this router's vLLM windows of one arm: a pod of the arm as the loop sums them.

        >>> Evidence("default", "chat", "chat-router-7f-x").key("stable")
        'specfleet:v1:default/chat:window:stable:chat-router-7f-x--vllm'
        """
        return f"{window_key(self.namespace, self.name, arm)}:{self.router}--vllm"

    def baseline(self, arm: str) -> vllm_evidence.PlainBaseline:
        return self.baselines.setdefault(arm, vllm_evidence.PlainBaseline())

    def needs_baseline(self, arm: str) -> bool:
        """Whether the arm's plain pool has answered nothing for BASELINE_STALE_S: then a share of
        the arm's requests (BASELINE_SHARE) goes to it, so that the speculating pools' speedups stay
        readable while no type is in fallback."""
        return self.baseline(arm).stale(self.clock(), BASELINE_STALE_S)

    def record(self, arm: str, prompt_type: str, method: str, answer: vllm_evidence.Answer) -> TypeCounts:
        """One finished answer from the arm's pool of `method`; returns its counts."""
        speculating = method != NONE
        if not speculating:
            self.baseline(arm).observe(answer, self.clock())
        plain_itl_s = self.baseline(arm).itl_s
        if plain_itl_s is None and arm != STABLE:  # a canary's plain pool sees ~1% of 2%: stable's, until it has one
            plain_itl_s = self.baseline(STABLE).itl_s
        counts = vllm_evidence.counts(answer, speculating=speculating, plain_itl_s=plain_itl_s)
        self.record_counts(arm, prompt_type, method, counts)
        return counts

    def error(self, arm: str, prompt_type: str, method: str) -> None:
        """A request the pool failed (counted in the windows' error rate)."""
        self.record_counts(arm, prompt_type, method, TypeCounts(requests=1, errors=1))

    def record_counts(self, arm: str, prompt_type: str, method: str, counts: TypeCounts) -> None:
        if arm not in self.totals:
            self.totals[arm] = {}
            self._windows[arm] = Windows(lambda a=arm: dict(self.totals[a]), self.window_s, self.clock)
        for field in (prompt_type, method_field(prompt_type, method)):
            self.totals[arm][field] = self.totals[arm].get(field, TypeCounts()).plus(counts)

    def hashes(self) -> list[tuple[str, dict[str, str]]]:
        """(key, fields) per arm seen: this period's windows, one JSON object per field."""
        updated = round(time.time(), 3)
        out = []
        for arm, windows in self._windows.items():
            seconds, by_field = windows.take()
            out.append((self.key(arm), {f: window_json(c, seconds, updated) for f, c in sorted(by_field.items())}))
        return out


class _Call:
    """One streaming call: `read()` gives the next GenerateStreamResponse or grpc.aio.EOF, as a
    grpc.aio stream call does; `cancel()` ends it."""

    def __init__(self, conn: VllmConnection, req: pb.GenerateRequest, timeout: float | None, metadata):
        self.conn, self.req = conn, req
        self._messages = conn._stream(req, timeout, metadata)
        self._done = False

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        try:
            return await self._messages.__anext__()
        except StopAsyncIteration:
            self._done = True
            return grpc.aio.EOF

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        asyncio.get_running_loop().create_task(self._messages.aclose())
        return True


class VllmConnection:
    """One vLLM server (a pool member) as the router's backend: the Generation stub's calls over
    HTTP, its health from /health, and the evidence of every answer."""

    def __init__(self, address: str, arm: str, method: str, evidence: Evidence | None = None,
                 model: str | None = None):
        self.address, self.arm, self.method, self.evidence, self.model = address, arm, method, evidence, model
        self.base = f"http://{address}"
        self._session: aiohttp.ClientSession | None = None
        self.in_flight = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))
        return self._session

    # -- the Generation stub ------------------------------------------------------------------------

    async def Generate(self, req: pb.GenerateRequest, timeout: float | None = None, metadata=()) -> pb.GenerateResponse:
        arrival = time.monotonic()
        path, body = openai_request(req, await self._model(), stream=False)
        self.in_flight += 1
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(self.base + path, json=body, headers=self._headers(req, metadata)) as r:
                    if r.status != 200:
                        raise await self._http_error(req, r)
                    answer_body = await r.json(content_type=None)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM server {self.address}: {type(e).__name__}: {e}") from None
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded waiting for the vLLM server") from None
        finally:
            self.in_flight -= 1
        choice = (answer_body.get("choices") or [{}])[0]
        usage = answer_body.get("usage") or {}
        answer, counts = self._counted(req, answer_body)
        resp = pb.GenerateResponse(
            request_id=req.request_id, text=_choice_text(choice), token_ids=choice.get("token_ids") or [],
            logprobs=_choice_logprobs(choice), finish_reason=_FINISH.get(choice.get("finish_reason"), "stop"),
            usage=_usage(usage),
            speculation=speculation_stats(self.method, answer, counts),
            latency_s=time.monotonic() - arrival)
        if answer.ttft_s is not None:
            resp.time_to_first_token_s = answer.ttft_s
        return resp

    def GenerateStream(self, req: pb.GenerateRequest, timeout: float | None = None, metadata=()) -> _Call:
        return _Call(self, req, timeout, metadata)

    async def Score(self, req, timeout: float | None = None, metadata=()):
        raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, "a vLLM server scores no tokens for the drift check")

    async def _stream(self, req: pb.GenerateRequest, timeout: float | None, metadata):
        """The answer's messages: one per chunk with text or tokens; the finishing chunk held back
        until the usage and metrics after it, and sent with them."""
        path, body = openai_request(req, await self._model(), stream=True)
        held: pb.GenerateStreamResponse | None = None
        self.in_flight += 1
        try:
            async with asyncio.timeout(timeout):
                async with self.session.post(self.base + path, json=body, headers=self._headers(req, metadata)) as r:
                    if r.status != 200:
                        raise await self._http_error(req, r)
                    async for raw in r.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:  # vLLM reports a failure after the headers in the stream itself
                            err = chunk["error"] or {}
                            raise self._failed(req, status_for(int(err.get("code") or 500)),
                                               f"vLLM server {self.address}: {err.get('message') or err}")
                        choice = (chunk.get("choices") or [None])[0]
                        if choice is not None:
                            msg = pb.GenerateStreamResponse(request_id=req.request_id, text=_choice_text(choice),
                                                            token_ids=choice.get("token_ids") or [],
                                                            logprobs=_choice_logprobs(choice))
                            if choice.get("finish_reason"):
                                msg.finish_reason = _FINISH.get(choice["finish_reason"], "stop")
                                held = msg
                                continue
                            if msg.text or msg.token_ids:
                                yield msg
                        if chunk.get("usage") is not None:  # the last chunk: usage and metrics
                            usage = chunk["usage"]
                            answer, counts = self._counted(req, chunk)
                            last = held or pb.GenerateStreamResponse(request_id=req.request_id, finish_reason="stop")
                            last.usage.CopyFrom(_usage(usage))
                            last.speculation.CopyFrom(speculation_stats(self.method, answer, counts))
                            held = None
                            yield last
                    if held is not None:  # a server that sent no usage: the answer without its counts
                        yield held
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM server {self.address}: {type(e).__name__}: {e}") from None
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded waiting for the vLLM server") from None
        except (ValueError, KeyError, TypeError) as e:
            raise self._failed(req, grpc.StatusCode.INTERNAL, f"vLLM server {self.address} sent a chunk this "
                               f"router cannot read: {e}") from None
        finally:
            self.in_flight -= 1

    # -- helpers ---------------------------------------------------------------------------------------

    def _counted(self, req: pb.GenerateRequest, body: dict) -> tuple[vllm_evidence.Answer, TypeCounts]:
        """The answer's counts, recorded in the evidence under its prompt type and this pool's method."""
        try:
            answer = vllm_evidence.parse(body)
        except ValueError as e:
            log.warning("a vLLM answer without readable metrics", extra={"backend": self.address, "error": str(e)})
            answer = vllm_evidence.Answer(int((body.get("usage") or {}).get("completion_tokens") or 0))
        if self.evidence is None:
            return answer, vllm_evidence.counts(answer, speculating=self.method != NONE, plain_itl_s=None)
        return answer, self.evidence.record(self.arm, req.prompt_type or "chat", self.method, answer)

    def _headers(self, req: pb.GenerateRequest, metadata) -> dict[str, str]:
        headers = dict(metadata or ())
        if req.request_id:
            headers["X-Request-Id"] = req.request_id
        return headers

    def _failed(self, req: pb.GenerateRequest, code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
        """The error to raise; a failure inside the server (INTERNAL) counts in the windows' errors."""
        if code == grpc.StatusCode.INTERNAL and self.evidence is not None:
            self.evidence.error(self.arm, req.prompt_type or "chat", self.method)
        return rpc_error(code, message)

    async def _http_error(self, req: pb.GenerateRequest, r: aiohttp.ClientResponse) -> grpc.aio.AioRpcError:
        try:
            body = await r.json(content_type=None)
            message = ((body.get("error") or {}).get("message") if isinstance(body.get("error"), dict)
                       else body.get("message") or body.get("detail")) or str(body)
        except Exception:  # noqa: BLE001 - a body that is not JSON: its text
            message = (await r.text())[:500]
        code = status_for(r.status)
        where = "" if code == grpc.StatusCode.INVALID_ARGUMENT else f"vLLM server {self.address}: HTTP {r.status}: "
        return self._failed(req, code, f"{where}{message}")

    async def _model(self) -> str:
        """The model id the server serves (its --served-model-name), asked once."""
        if self.model is None:
            try:
                async with self.session.get(self.base + "/v1/models",
                                            timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as r:
                    data = (await r.json(content_type=None)).get("data") or []
                self.model = data[0]["id"]
            except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError, AttributeError) as e:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                f"vLLM server {self.address}: cannot read its model id: {e}") from None
        return self.model

    async def watch_health(self, set_healthy: Callable[[bool], None]) -> None:
        """GET /health every HEALTH_PERIOD_S (faster while not ready): ready on 200 once the model id
        is known."""
        delay = 0.05
        while True:
            healthy = False
            try:
                async with self.session.get(self.base + "/health",
                                            timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as r:
                    healthy = r.status == 200
                if healthy:
                    await self._model()
            except (aiohttp.ClientError, TimeoutError, grpc.aio.AioRpcError):
                healthy = False
            set_healthy(healthy)
            delay = HEALTH_PERIOD_S if healthy else min(delay * 2, HEALTH_PERIOD_S)
            await asyncio.sleep(delay)

    async def close(self, grace: float | None = None) -> None:
        """Closes the HTTP session once the calls on it finished (or the grace passed)."""
        if grace:
            end = time.monotonic() + grace
            while self.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        if self._session is not None:
            await self._session.close()
