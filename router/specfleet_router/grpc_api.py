"""The worker's own gRPC API (specfleet.v1.Generation) served by the router, so gRPC clients get
the same routing as HTTP ones: the same classify, split, cluster, method and balancing, with the route in
the response's initial metadata (x-specfleet-arm, -method, -prompt-type, -cluster, -probe).

A caller's `prompt_type` is kept when it is one of the fixed set, and a `speculation_method` of
its own is honoured (as the worker would); otherwise the router decides. The session that pins
the arm is the `x-session-id` metadata. The caller's deadline and trace context pass through;
errors keep the worker's status code (UNAVAILABLE when no backend is ready).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from specfleet_api.enums import PROMPT_TYPES, PromptType
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc

from .classify import classify, classify_messages
from .dispatch import Route, Router, RouterError, forwarded_metadata


def prompt_type_of(msg: pb.GenerateRequest) -> str:
    """The caller's prompt type if it is one of ours, else the classifier's."""
    if msg.prompt_type in PROMPT_TYPES:
        return msg.prompt_type
    if msg.messages:
        return classify_messages([{"role": m.role, "content": m.content} for m in msg.messages]).value
    if msg.prompt:
        return classify(msg.prompt).value
    return PromptType.OTHER.value  # token ids: nothing to read


class GenerationFront(pb_grpc.GenerationServicer):
    def __init__(self, router: Router):
        self.router = router

    def _begin(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        md = {k: v for k, v in context.invocation_metadata() or ()}
        route = self.router.route(prompt_type_of(request), md.get("x-session-id"), request)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        return route, deadline, forwarded_metadata(md.get)

    async def _fail(self, e: RouterError, route: Route, context) -> None:
        self.router.observe(route, e.kind)
        await context.send_initial_metadata(tuple(route.headers().items()))
        await context.abort(e.code, e.message)

    async def Generate(self, request, context):
        arrival = time.monotonic()
        route, deadline, metadata = self._begin(request, context)
        self.router.in_flight += 1
        try:
            try:
                route, resp = await self.router.generate(route, request, deadline=deadline, metadata=metadata)
            except RouterError as e:
                await self._fail(e, route, context)
            finished = time.monotonic()
            self.router.observe(route, "ok", arrival=arrival,
                                first_at=finished - max(0.0, resp.latency_s - resp.time_to_first_token_s),
                                finished_at=finished, prompt_tokens=resp.usage.prompt_tokens,
                                completion_tokens=resp.usage.completion_tokens, finish_reason=resp.finish_reason)
            self.router.completed(route, request, resp.token_ids, resp.speculation,
                                  resp.request_id or request.request_id)
            await context.send_initial_metadata(tuple(route.headers().items()))
            return resp
        except asyncio.CancelledError:  # the caller went away or its deadline passed
            self.router.observe(route, "cancelled")
            raise
        finally:
            self.router.in_flight -= 1

    async def GenerateStream(self, request, context):
        arrival = time.monotonic()
        route, deadline, metadata = self._begin(request, context)
        self.router.in_flight += 1
        try:
            try:
                up = await self.router.stream(route, request, deadline=deadline, metadata=metadata)
            except RouterError as e:
                await self._fail(e, route, context)
            route, first_at, last, token_ids = up.route, time.monotonic(), None, []
            await context.send_initial_metadata(tuple(route.headers().items()))
            try:
                async for m in up.messages():
                    last = m
                    token_ids.extend(m.token_ids)
                    yield m
            except RouterError as e:  # after the first token: the worker's status, no retry
                self.router.observe(route, e.kind)
                await context.abort(e.code, e.message)
            finally:
                up.close()
            self.router.observe(route, "ok", arrival=arrival, first_at=first_at, finished_at=time.monotonic(),
                                prompt_tokens=last.usage.prompt_tokens if last else 0,
                                completion_tokens=last.usage.completion_tokens if last else 0,
                                finish_reason=last.finish_reason if last else None)
            if last is not None:
                self.router.completed(route, request, token_ids, last.speculation,
                                      last.request_id or request.request_id)
        except asyncio.CancelledError:
            self.router.observe(route, "cancelled")
            raise
        finally:
            self.router.in_flight -= 1
