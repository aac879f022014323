"""The OpenAI-compatible HTTP front (aiohttp): /v1/chat/completions, /v1/completions and
/v1/models, plus /metrics, /healthz and /readyz.

Every completion response, errors included, carries x-specfleet-arm, x-specfleet-method and
x-specfleet-prompt-type (`-` when the request was refused before it could be routed), and
x-specfleet-cluster (its prompt cluster) and x-specfleet-probe (1 on a probe) once it was read. A stream's
headers go out with its first token, so a failure before that (no backend, every backend
shedding load) is still a plain HTTP error with the right status; a failure after it ends the
stream with an `error` event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specfleet_api.limits import MAX_REQUEST_ID, OPENAI_DEFAULT_TEMPERATURE
from specfleet_proto import worker_pb2 as pb

from . import openai_api as oa
from .dispatch import HEADER_ARM, HEADER_METHOD, HEADER_PROMPT_TYPE, Route, Router, RouterError, forwarded_metadata
from .metrics import RouterMetrics

log = logging.getLogger("specfleet.router.http")

# how long a header may be and still reach the app, so that one past MAX_HEADER_BYTES gets OpenAI's
# JSON error rather than aiohttp's plain-text 400 (its own default is MAX_HEADER_BYTES); at most
# 128 headers (aiohttp's count limit) of this size, 32 MiB, is what one request's headers can hold
HEADER_PARSE_BYTES = 1 << 18
UNROUTED = {HEADER_ARM: "-", HEADER_METHOD: "-", HEADER_PROMPT_TYPE: "-"}
STATUS = {"invalid": 400, "overloaded": 429, "unavailable": 503, "cancelled": 503, "timeout": 504, "error": 500}
CODES = {400: None, 404: "model_not_found", 429: "overloaded", 503: "no_ready_backend", 504: "timeout",
         500: "internal_error"}


@dataclass
class Models:
    """The deployment this router serves, by resource name, and the names it also answers to
    (its model.name)."""

    name: str
    aliases: list[str] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.aliases

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "specfleet",
                "aliases": list(self.aliases)}


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class HttpFront:
    def __init__(self, router: Router, models: Models, metrics: RouterMetrics, *, request_timeout_s: float = 600.0,
                 default_temperature: float = OPENAI_DEFAULT_TEMPERATURE,
                 ready: Callable[[], tuple[bool, str]] = lambda: (True, "ready"),
                 max_request_bytes: int = 1 << 20):
        self.router, self.models, self.metrics = router, models, metrics
        self.request_timeout_s, self.default_temperature = request_timeout_s, default_temperature
        self.ready = ready
        self.max_request_bytes = max_request_bytes

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._errors_as_openai],
                              handler_args={"max_field_size": HEADER_PARSE_BYTES})
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        return app

    @web.middleware
    async def _errors_as_openai(self, request: web.Request, handler):
        """aiohttp's own refusals (unknown path, wrong method, body too large) in OpenAI's shape."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400 or not request.path.startswith("/v1/"):
                raise
            return self._error(e.status, f"{request.method} {request.path}: {e.reason}", None, UNROUTED,
                               request_id=None)

    # -- probes and metrics --------------------------------------------------------------------

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        ok, why = self.ready()
        return web.Response(status=200 if ok else 503, text=why + "\n")

    # -- models --------------------------------------------------------------------------------

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.models.card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if not self.models.serves(model):
            return self._not_found(model, None)
        return web.json_response(self.models.card())

    def _not_found(self, model: str, request_id: str | None) -> web.Response:
        return self._error(404, f"model {model!r} does not exist here; this router serves {self.models.name!r}"
                           + (f" (also known as {', '.join(map(repr, self.models.aliases))})"
                              if self.models.aliases else ""), "model", UNROUTED, request_id)

    # -- completions ---------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, oa.parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, oa.parse_completion)

    async def _complete(self, request: web.Request, parse) -> web.StreamResponse:
        arrival = time.monotonic()
        rid = request.headers.get("x-request-id", "")
        rid = rid if 0 < len(rid) <= MAX_REQUEST_ID and oa.lone_surrogate(rid) is None else uuid.uuid4().hex
        session = request.headers.get("x-session-id")
        try:
            oa.check_headers(request.headers)
            body = await request.json(loads=oa.loads)
        except UnicodeDecodeError as e:
            return self._error(400, f"the request body is not JSON: {e}", None, UNROUTED, rid)
        except oa.BadRequest as e:
            return self._error(400, str(e), e.param, UNROUTED, rid)
        try:
            job = parse(body, self.default_temperature)
        except oa.BadRequest as e:
            headers = UNROUTED
            if e.prompt_type is not None:
                user = body.get("user")
                headers = self.router.route(e.prompt_type.value, session or (user if isinstance(user, str) else None)
                                            ).headers()
            return self._error(400, str(e), e.param, headers, rid)
        if not self.models.serves(job.model):
            return self._not_found(job.model, rid)
        msg = job.to_proto(rid)
        route = self.router.route(job.prompt_type.value, session or job.user, msg)
        deadline = arrival + self.request_timeout_s
        metadata = forwarded_metadata(request.headers.get)
        self.router.in_flight += 1
        try:
            if job.stream:
                return await self._stream(request, job, route, msg, rid, arrival, deadline, metadata)
            return await self._unary(job, route, msg, rid, arrival, deadline, metadata)
        finally:
            self.router.in_flight -= 1

    async def _unary(self, job: oa.Job, route: Route, msg, rid: str, arrival: float, deadline: float,
                     metadata) -> web.Response:
        try:
            route, resp = await self.router.generate(route, msg, deadline=deadline, metadata=metadata)
        except RouterError as e:
            self.router.observe(route, e.kind)
            return self._router_error(e, job, route, rid)
        except asyncio.CancelledError:  # the client went away
            self.router.observe(route, "cancelled")
            raise
        finished = time.monotonic()
        # the worker's own split of its time: what came after its first token came after ours
        first_at = finished - max(0.0, resp.latency_s - resp.time_to_first_token_s)
        self.router.observe(route, "ok", arrival=arrival, first_at=first_at, finished_at=finished,
                            prompt_tokens=resp.usage.prompt_tokens, completion_tokens=resp.usage.completion_tokens,
                            finish_reason=resp.finish_reason)
        self.router.completed(route, msg, resp.token_ids, resp.speculation, rid)
        return web.json_response(oa.full_response(job, rid, int(time.time()), resp),
                                 headers={**route.headers(), "x-request-id": rid})

    async def _stream(self, request: web.Request, job: oa.Job, route: Route, msg, rid: str, arrival: float,
                      deadline: float, metadata) -> web.StreamResponse:
        try:
            up = await self.router.stream(route, msg, deadline=deadline, metadata=metadata)
        except RouterError as e:
            self.router.observe(route, e.kind)
            return self._router_error(e, job, route, rid)
        except asyncio.CancelledError:
            self.router.observe(route, "cancelled")
            raise
        route = up.route
        first_at = time.monotonic()
        created = int(time.time())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **route.headers(), "x-request-id": rid})
        prompt_tokens = completion_tokens = 0
        finish_reason, counted, token_ids, speculation = None, False, [], pb.SpeculationStats()
        try:
            await resp.prepare(request)
            if job.kind == "chat":
                await resp.write(sse(oa.chunk(job, rid, created, text="", role=True)))
            async for m in up.messages():
                completion_tokens += len(m.token_ids)
                token_ids.extend(m.token_ids)
                if m.text or (job.logprobs and m.token_ids):
                    await resp.write(sse(oa.chunk(job, rid, created, text=m.text, token_ids=m.token_ids,
                                                  logprobs=m.logprobs)))
                if m.finish_reason:
                    finish_reason = m.finish_reason
                    prompt_tokens = m.usage.prompt_tokens
                    completion_tokens = m.usage.completion_tokens or completion_tokens
                    speculation = m.speculation
                    await resp.write(sse(oa.chunk(job, rid, created, finish_reason=finish_reason)))
            # counted before the client can read the end, so that a scrape after it sees this request
            self.router.observe(route, "ok", arrival=arrival, first_at=first_at, finished_at=time.monotonic(),
                                prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                finish_reason=finish_reason)
            counted = True
            self.router.completed(route, msg, token_ids, speculation, rid)
            if job.include_usage:
                await resp.write(sse(oa.usage_chunk(job, rid, created, prompt_tokens, completion_tokens)))
            await resp.write(b"data: [DONE]\n\n")
        except RouterError as e:
            self.router.observe(route, e.kind)
            status = STATUS.get(e.kind, 500)
            log.warning("stream failed after its first token", extra={"request_id": rid, "error": e.message})
            await resp.write(sse(oa.error_body(status, e.message, None, CODES.get(status))))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away
            if not counted:
                self.router.observe(route, "cancelled")
            raise
        finally:
            up.close()
        await resp.write_eof()
        return resp

    # -- errors --------------------------------------------------------------------------------

    def _router_error(self, e: RouterError, job: oa.Job, route: Route, rid: str) -> web.Response:
        status, param = STATUS.get(e.kind, 500), None
        message = e.message
        if e.kind == "invalid":
            if e.field == "speculation_method":  # the routing table's choice, not the client's
                status, message = 500, (f"the routing table sends {route.prompt_type} requests to method "
                                        f"{route.method!r}, which the {route.arm} backend refused: {e.message}")
            else:
                param = job.param_for(e.field)
        return self._error(status, message, param, route.headers(), rid)

    def _error(self, status: int, message: str, param: str | None, headers: dict, request_id: str | None,
               ) -> web.Response:
        extra = {"Retry-After": "1"} if status == 429 else {}
        if request_id is not None:
            extra["x-request-id"] = request_id
        return web.json_response(oa.error_body(status, message, param, CODES.get(status)), status=status,
                                 headers={**headers, **extra})
