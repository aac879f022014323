"""One request's way through the router, whatever front it came in by: the route (arm, draft
method, prompt type), the backend, and the retry before the first token.

The split picks the arm, the live state the method: a prompt type or prompt cluster in fallback runs
plain decoding, except its probes (a share of its requests, by a draw from the request id, that
still speculate so that the loop keeps observing). An arm with no ready backend hands its requests to the other arm (a
fallback, counted and shown in the response headers). Within the arm the least busy backend gets
the request. A backend that answers UNAVAILABLE before the first token (stopped, draining, not
reachable) is ejected for a while and the request is sent once more elsewhere; one that answers
RESOURCE_EXHAUSTED (shedding load) makes the request try the arm's other backends, and when
every one sheds, the request fails as overloaded. Errors are this module's `RouterError`
kinds; each front maps them to its own status codes.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from specfleet_api.enums import METHODS
from specfleet_proto import worker_pb2 as pb

from .backends import Backend, Backends
from .clusters import ClusterWindows, Clusters
from .metrics import RouterMetrics
from .split import CANARY, STABLE, arm_for
from .state import StateSource
from .vllm_backend import BASELINE_SHARE

PLAIN = "none"  # the method of plain decoding (Method.NONE): every arm serves it
HEADER_ARM = "x-specfleet-arm"
HEADER_METHOD = "x-specfleet-method"
HEADER_PROMPT_TYPE = "x-specfleet-prompt-type"
HEADER_FALLBACK = "x-specfleet-fallback-from"
HEADER_STATE_VERSION = "x-specfleet-state-version"
HEADER_PROBE = "x-specfleet-probe"
HEADER_CLUSTER = "x-specfleet-cluster"
TRACE_KEYS = ("traceparent", "tracestate")
MAX_TRACE_HEADER = 512  # W3C's tracestate is propagated up to at least 512 characters; a traceparent has 55


def other_arm(arm: str) -> str:
    return CANARY if arm == STABLE else STABLE


def draw(request_id: str, purpose: str) -> float:
    """A request's fixed draw, uniform in [0, 100), for one purpose ("probe", "mirror"): a retried
    request draws the same, and two purposes draw independently.

    >>> draw("req-1", "probe") == draw("req-1", "probe"), draw("req-1", "probe") == draw("req-1", "mirror")
    (True, False)
    """
    digest = hashlib.sha256(f"{purpose}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


def prompt_text(msg: pb.GenerateRequest) -> str | None:
    """What a request's prompt cluster is learned from: its last user message, or its text
    prompt; None for token ids (nothing to read)."""
    users = [m.content for m in msg.messages if m.role == "user"]
    if users:
        return users[-1]
    return msg.prompt or None


@dataclass(frozen=True)
class Route:
    """Where one request goes. `arm` serves it; `split_arm` is what the split chose (they differ
    after a fallback)."""

    arm: str
    split_arm: str
    method: str
    prompt_type: str
    state_version: int
    cluster: str | None = None
    probe: bool = False  # speculates although its type or cluster is in fallback
    draw: float = 100.0  # the request's probe draw
    backend: str | None = None  # the backend that answered (set once one did)

    @property
    def fell_back(self) -> bool:
        return self.arm != self.split_arm

    def headers(self) -> dict[str, str]:
        out = {HEADER_ARM: self.arm, HEADER_METHOD: self.method, HEADER_PROMPT_TYPE: self.prompt_type,
               HEADER_STATE_VERSION: str(self.state_version)}
        if self.fell_back:
            out[HEADER_FALLBACK] = self.split_arm
        if self.probe:
            out[HEADER_PROBE] = "1"
        if self.cluster is not None:
            out[HEADER_CLUSTER] = self.cluster
        return out


class RouterError(Exception):
    """A request the router could not serve. `kind` is one of metrics.OUTCOMES (not "ok");
    `field` is the request field a worker's INVALID_ARGUMENT named, if any."""

    def __init__(self, kind: str, message: str, code: grpc.StatusCode, field: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.code, self.field = kind, message, code, field


_KIND = {grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
         grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
         grpc.StatusCode.CANCELLED: "cancelled"}
_FIELD = re.compile(r"^([a-z_]+)(\[\d+\](\.[a-z_]+)?)?(, [a-z_]+)*[: ]")
_REQUEST_FIELDS = frozenset(pb.GenerateRequest.DESCRIPTOR.fields_by_name)


def field_of(message: str) -> str | None:
    """The GenerateRequest field a worker's INVALID_ARGUMENT message starts with, if any.

    >>> field_of("max_tokens must be <= 2048, got 9999"), field_of("prompt_token_ids[3]: 5000 is outside")
    ('max_tokens', 'prompt_token_ids')
    >>> field_of("messages[0].role: 'robot' is not one of"), field_of("prompt, messages: set exactly one")
    ('messages', 'prompt')
    >>> field_of("request: 2000000 bytes; the limit is 1048576") is None
    True
    """
    m = _FIELD.match(message)
    return m.group(1) if m and m.group(1) in _REQUEST_FIELDS else None


def from_grpc(e: grpc.aio.AioRpcError, backend: str | None = None) -> RouterError:
    code, message = e.code(), e.details() or e.code().name
    field = field_of(message) if code == grpc.StatusCode.INVALID_ARGUMENT else None
    where = f" (backend {backend})" if backend and code != grpc.StatusCode.INVALID_ARGUMENT else ""
    return RouterError(_KIND.get(code, "error"), message + where, code, field)


class Upstream:
    """A streaming call that has produced its first message; `messages()` yields it and the rest.
    Closing it (or finishing the iteration) cancels what is left of the call and releases the
    backend."""

    def __init__(self, router: Router, backend: Backend, route: Route, call, first: pb.GenerateStreamResponse):
        self.router, self.backend, self.route, self.call, self.first = router, backend, route, call, first
        self._released = False

    async def messages(self) -> AsyncIterator[pb.GenerateStreamResponse]:
        """The first message, then the rest as they arrive."""
        try:
            yield self.first
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    return
                yield msg
        except grpc.aio.AioRpcError as e:
            # after the first token nothing is retried: the client has text it cannot take back
            raise from_grpc(e, self.backend.target) from None
        finally:
            self.close()

    def close(self) -> None:
        if not self._released:
            self._released = True
            self.call.cancel()
            self.router.backends.release(self.backend)


class Router:
    def __init__(self, backends: Backends, state: StateSource, metrics: RouterMetrics, *,
                 retries: int = 1, rng: random.Random | None = None, clusters: Clusters | None = None,
                 windows: ClusterWindows | None = None, drift=None):
        self.backends, self.state, self.metrics = backends, state, metrics
        self.retries, self.rng = retries, rng or random.Random()
        self.clusters, self.windows, self.drift = clusters, windows, drift
        self.in_flight = 0  # requests inside a front now (what a drain waits for)
        metrics.in_flight.set_function(lambda: self.in_flight)

    def route(self, prompt_type: str, session: str | None, msg: pb.GenerateRequest | None = None) -> Route:
        """The split's arm, the prompt cluster and the method, from the live state in force (memory
        only: nothing here waits on Redis). Whether the arm can serve is the dispatch's business.
        Without `msg` (a request refused before it was read) there is no cluster and no probe."""
        state = self.state.current
        arm = arm_for(session, state.canary_weight, self.rng)
        cluster, d = None, 100.0
        if msg is not None:
            text = prompt_text(msg)
            if self.clusters is not None and text:
                cluster = self.clusters.assign(prompt_type, text)
            d = draw(msg.request_id, "probe") if msg.request_id else self.rng.random() * 100.0
        method, probe = state.route(prompt_type, arm, cluster, d)
        if msg is not None and msg.speculation_method in METHODS:
            # a gRPC caller's own method, honoured (on vLLM, its pool); one the router does not know
            # goes on as it is, for the worker to refuse, and never becomes a metric label
            method, probe = msg.speculation_method, False
        elif method != PLAIN and msg is not None and self._baseline_due(arm, msg):
            method, probe = PLAIN, False
        return Route(arm, arm, method, prompt_type, state.version, cluster, probe, d)

    def _baseline_due(self, arm: str, msg: pb.GenerateRequest) -> bool:
        """Whether this request measures the arm's plain pool (vLLM pools: vllm_backend.BASELINE_SHARE
        of the requests while its baseline is stale). Workers price plain decoding themselves."""
        evidence = self.backends.evidence
        if evidence is None or not any(b.method == PLAIN for b in self.backends.pools[arm].backends):
            return False
        share = draw(msg.request_id, "baseline") if msg.request_id else self.rng.random() * 100.0
        return share < BASELINE_SHARE and evidence.needs_baseline(arm)

    def _next_backend(self, route: Route, tried: list[Backend]) -> tuple[Backend | None, Route]:
        """The arm's least busy backend not tried yet that serves the route's method (every worker
        does; a vLLM server serves one); the arm's plain pool when no backend serves the method; the
        other arm's when this arm has no backend ready at all (the fallback)."""
        b, served = self._in_arm(route, tried)
        if served is not None:
            return b, served  # b None: nothing left in the arm but backends that shed load; no fallback for that
        other = other_arm(route.arm)
        # the arm that serves decides the method: an arm may have a table of its own
        method, probe = self.state.current.route(route.prompt_type, other, route.cluster, route.draw)
        b, served = self._in_arm(replace(route, arm=other, method=method, probe=probe), tried)
        return b, (served or route)

    def _in_arm(self, route: Route, tried: list[Backend]) -> tuple[Backend | None, Route | None]:
        """(backend, the route it serves) within the route's arm: the method's pool, else the plain
        one (a vLLM arm without a pool for the method: lossless all the same); (None, route) when
        the arm has backends for it that are all tried; (None, None) when it has none ready."""
        pool = self.backends.pools[route.arm]
        for r in (route, replace(route, method=PLAIN, probe=False)) if route.method != PLAIN else (route,):
            b = pool.pick(tried, r.method)
            if b is not None:
                return b, r
            if pool.any_available(r.method):
                return None, r
        return None, None

    async def _attempts(self, route: Route, msg: pb.GenerateRequest, deadline: float | None,
                        metadata: tuple[tuple[str, str], ...], start):
        """Calls `start(backend, route, timeout)` on backends until one gives a first answer; returns
        (backend, route, answer). Retries once on UNAVAILABLE; tries every backend on
        RESOURCE_EXHAUSTED."""
        tried: list[Backend] = []
        retries_left, overloaded, unavailable = self.retries, None, None
        while True:
            backend, route = self._next_backend(route, tried)
            if backend is None:
                if overloaded is not None:
                    raise RouterError("overloaded", f"every {route.arm} backend is at capacity; retry later "
                                      f"(last: {overloaded.details()})", grpc.StatusCode.RESOURCE_EXHAUSTED)
                if unavailable is not None:
                    raise from_grpc(unavailable, tried[-1].target)
                raise RouterError("unavailable", f"no ready backend in the {route.split_arm} or "
                                  f"{other_arm(route.split_arm)} arm", grpc.StatusCode.UNAVAILABLE)
            timeout = None
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    raise RouterError("timeout", "the request's deadline passed before a backend answered",
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
            tried.append(backend)
            self.backends.acquire(backend)
            try:
                answer = await start(backend, route, timeout)
            except grpc.aio.AioRpcError as e:
                self.backends.release(backend)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = e
                    continue
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.backends.eject(backend)
                    if retries_left > 0:
                        retries_left -= 1
                        unavailable = e
                        self.metrics.retries.labels(route.arm, "unavailable").inc()
                        continue
                raise from_grpc(e, backend.target) from None
            except BaseException:
                self.backends.release(backend)
                raise
            if route.fell_back:
                self.metrics.arm_fallbacks.labels(route.split_arm, route.arm).inc()
            return backend, replace(route, backend=backend.target), answer

    async def generate(self, route: Route, msg: pb.GenerateRequest, *, deadline: float | None = None,
                       metadata: tuple[tuple[str, str], ...] = ()) -> tuple[Route, pb.GenerateResponse]:
        """The whole completion (the worker's unary call)."""
        async def start(b: Backend, to: Route, timeout):
            return await b.generation.Generate(self._stamped(to, msg), timeout=timeout, metadata=metadata)

        backend, route, resp = await self._attempts(route, msg, deadline, metadata, start)
        self.backends.release(backend)
        return route, resp

    async def stream(self, route: Route, msg: pb.GenerateRequest, *, deadline: float | None = None,
                     metadata: tuple[tuple[str, str], ...] = ()) -> Upstream:
        """A stream that has produced its first message (so any retry is behind it)."""
        calls = {}

        async def start(b: Backend, to: Route, timeout):
            call = calls[b] = b.generation.GenerateStream(self._stamped(to, msg), timeout=timeout, metadata=metadata)
            try:
                first = await call.read()
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise RouterError("error", f"backend {b.target} ended the stream without a message",
                                  grpc.StatusCode.INTERNAL)
            return first

        backend, route, first = await self._attempts(route, msg, deadline, metadata, start)
        return Upstream(self, backend, route, calls[backend], first)

    def _stamped(self, route: Route, msg: pb.GenerateRequest) -> pb.GenerateRequest:
        """The request as the worker gets it: the route's method (a probe's too, named explicitly)
        and prompt type, unless a gRPC caller named a method of its own."""
        out = pb.GenerateRequest()
        out.CopyFrom(msg)
        if not out.speculation_method or out.speculation_method == "auto":
            out.speculation_method = route.method
        out.prompt_type = route.prompt_type
        out.probe = route.probe  # a probe speculates through a soft fallback on the worker
        return out

    def observe(self, route: Route, outcome: str, *, arrival: float | None = None, first_at: float | None = None,
                finished_at: float | None = None, prompt_tokens: int = 0, completion_tokens: int = 0,
                finish_reason: str | None = None) -> None:
        """Count one finished request (any front)."""
        m = self.metrics
        m.requests.labels(route.arm, route.prompt_type, route.method, outcome).inc()
        if route.probe:
            m.probes.labels(route.prompt_type).inc()
        if outcome != "ok":
            return
        m.request_success.labels(route.arm, finish_reason or "stop").inc()
        m.prompt_tokens.labels(route.arm).inc(prompt_tokens)
        m.generation_tokens.labels(route.arm).inc(completion_tokens)
        if arrival is not None and first_at is not None:
            m.ttft.labels(route.arm).observe(first_at - arrival)
        if arrival is not None and finished_at is not None:
            m.e2e.labels(route.arm).observe(finished_at - arrival)
        if first_at is not None and finished_at is not None and completion_tokens > 1:
            m.tpot.labels(route.arm).observe((finished_at - first_at) / (completion_tokens - 1))


    def completed(self, route: Route, msg: pb.GenerateRequest, token_ids, speculation: pb.SpeculationStats,
                  request_id: str) -> None:
        """A request answered in full (any front): its cluster's window counts it, and the drift
        check may mirror it (in the background: nothing here waits)."""
        if self.windows is not None and route.cluster is not None:
            self.windows.record(route.cluster, route.prompt_type, speculation, route.arm)
        if self.drift is not None:
            self.drift.offer(route, msg, list(token_ids), request_id)


def forwarded_metadata(get) -> tuple[tuple[str, str], ...]:
    """W3C trace context to pass on, from a header or metadata getter (`get(key) -> str | None`).
    A value that gRPC metadata cannot carry (not printable ASCII) or past MAX_TRACE_HEADER is
    dropped, not refused: W3C has a receiver ignore a trace context it cannot parse (the trace
    restarts there).

    >>> forwarded_metadata({"traceparent": "00-ab-cd-01", "tracestate": "caf\xe9"}.get)
    (('traceparent', '00-ab-cd-01'),)
    """
    return tuple((k, v) for k in TRACE_KEYS
                 if (v := get(k)) and len(v) <= MAX_TRACE_HEADER and v.isascii() and v.isprintable())
