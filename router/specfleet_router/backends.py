"""The workers behind the router: one pool per arm (stable, canary), each backend's readiness
from its health, and least-outstanding-requests choice within a pool.

A backend is a specfleet worker (gRPC, every draft method) or a vLLM server of one draft method
(HTTP, through the engine adapter in `vllm_backend.py`); both answer the Generation stub's calls,
so a pool holds either, and a request that names a method goes to a backend that serves it.

Where backends come from is a `Discovery`: a static list (`--backend ARM=HOST:PORT`,
`--vllm-backend ARM/METHOD=HOST:PORT`) here; the Kubernetes one (EndpointSlices of each arm's
worker Service or vLLM pool Services, watched) implements the same protocol in
`k8s_discovery.py`. A backend counts as ready while its health says so (a worker's
grpc.health.v1 Watch stream SERVING for `specfleet.v1.Generation`; a vLLM server's /health), and
not for a while after a request to it failed with UNAVAILABLE (ejection), so the next request goes
elsewhere before the health check catches up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specfleet_proto import worker_pb2_grpc as pb_grpc

from .metrics import RouterMetrics
from .split import CANARY, STABLE
from .vllm_backend import VLLM, Evidence, VllmConnection, parse_target, vllm_target

log = logging.getLogger("specfleet.router.backends")

ARMS = (STABLE, CANARY)
HEALTH_SERVICE = "specfleet.v1.Generation"
EJECT_S = 2.0  # after an UNAVAILABLE, how long a backend is passed over unless its health says SERVING again
FORGET_GRACE_S = 30.0  # a backend discovery removed keeps its channel this long for the requests on it
CHANNEL_OPTIONS = [
    # grpc's own reconnect backoff grows to 120 s; a worker that comes back must be seen in seconds
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


def parse_backends(specs: list[str]) -> dict[str, list[str]]:
    """`--backend` values (`ARM=HOST:PORT`) as targets per arm.

    >>> parse_backends(["stable=127.0.0.1:50051", "canary=127.0.0.1:50052", "stable=10.0.0.7:50051"])
    {'stable': ['127.0.0.1:50051', '10.0.0.7:50051'], 'canary': ['127.0.0.1:50052']}
    >>> parse_backends(["blue=h:1"])
    Traceback (most recent call last):
    ...
    ValueError: --backend 'blue=h:1': the arm must be stable or canary (ARM=HOST:PORT)
    """
    out: dict[str, list[str]] = {arm: [] for arm in ARMS}
    for spec in specs:
        arm, sep, target = spec.partition("=")
        if arm not in ARMS:
            raise ValueError(f"--backend {spec!r}: the arm must be stable or canary (ARM=HOST:PORT)")
        host, colon, port = target.rpartition(":")
        if not sep or not colon or not host or not port.isdigit():
            raise ValueError(f"--backend {spec!r}: expected ARM=HOST:PORT, for example stable=127.0.0.1:50051")
        if target not in out[arm]:
            out[arm].append(target)
    return out


def parse_vllm_backends(specs: list[str], methods: tuple[str, ...]) -> dict[str, list[str]]:
    """`--vllm-backend` values (`ARM/METHOD=HOST:PORT`: a vLLM server of the arm's pool for a draft
    method) as targets per arm.

    >>> parse_vllm_backends(["stable/ngram=127.0.0.1:8001", "stable/none=127.0.0.1:8002"], ("none", "ngram"))
    {'stable': ['vllm/ngram@127.0.0.1:8001', 'vllm/none@127.0.0.1:8002'], 'canary': []}
    >>> parse_vllm_backends(["stable/fast=h:1"], ("none", "ngram"))
    Traceback (most recent call last):
    ...
    ValueError: --vllm-backend 'stable/fast=h:1': the method must be one of none, ngram (ARM/METHOD=HOST:PORT)
    """
    out: dict[str, list[str]] = {arm: [] for arm in ARMS}
    for spec in specs:
        pool, sep, address = spec.partition("=")
        arm, slash, method = pool.partition("/")
        if arm not in ARMS or not slash:
            raise ValueError(f"--vllm-backend {spec!r}: expected ARM/METHOD=HOST:PORT with ARM stable or canary, "
                             "for example stable/ngram=127.0.0.1:8001")
        if method not in methods:
            raise ValueError(f"--vllm-backend {spec!r}: the method must be one of {', '.join(methods)} "
                             "(ARM/METHOD=HOST:PORT)")
        host, colon, port = address.rpartition(":")
        if not sep or not colon or not host or not port.isdigit():
            raise ValueError(f"--vllm-backend {spec!r}: expected ARM/METHOD=HOST:PORT, for example "
                             "stable/ngram=127.0.0.1:8001")
        target = vllm_target(method, address)
        if target not in out[arm]:
            out[arm].append(target)
    return out


class Discovery(Protocol):
    """Where each arm's backends are: yields the whole picture ({arm: [host:port, ...]}) at once
    and again whenever it changes."""

    def watch(self) -> AsyncIterator[dict[str, list[str]]]: ...


class StaticDiscovery:
    """A fixed list, from `--backend` flags (local runs, `specfleet up`, tests)."""

    def __init__(self, targets: dict[str, list[str]]):
        self.targets = {arm: list(targets.get(arm, ())) for arm in ARMS}

    async def watch(self) -> AsyncIterator[dict[str, list[str]]]:
        yield self.targets


@dataclass(eq=False)
class Backend:
    arm: str
    target: str
    channel: grpc.aio.Channel | VllmConnection  # what is closed when it leaves
    generation: pb_grpc.GenerationStub | VllmConnection
    method: str | None = None  # the one draft method it serves (a vLLM server); None: every method
    healthy: bool = False  # what its health says
    outstanding: int = 0
    ejected_until: float = 0.0
    task: asyncio.Task | None = field(default=None, repr=False)

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until

    def serves(self, method: str | None) -> bool:
        """Whether a request for `method` (None: any) may go here."""
        return method is None or self.method is None or self.method == method


class Pool:
    """One arm's backends."""

    def __init__(self, arm: str, clock: Callable[[], float] = time.monotonic):
        self.arm, self.clock = arm, clock
        self.backends: list[Backend] = []
        self._turn = 0

    def any_available(self, method: str | None = None) -> bool:
        now = self.clock()
        return any(b.available(now) and b.serves(method) for b in self.backends)

    def pick(self, exclude: list[Backend] = (), method: str | None = None) -> Backend | None:
        """The available backend serving `method` (None: any) with the fewest requests in flight;
        equal ones take turns."""
        now = self.clock()
        candidates = [b for b in self.backends if b.available(now) and b not in exclude and b.serves(method)]
        if not candidates:
            return None
        least = min(b.outstanding for b in candidates)
        best = [b for b in candidates if b.outstanding == least]
        self._turn += 1
        return best[self._turn % len(best)]


class Backends:
    """The pools, kept in step with a Discovery, and each backend's health followed."""

    def __init__(self, discovery: Discovery, metrics: RouterMetrics, *, health_check: bool = True,
                 eject_s: float = EJECT_S, forget_grace_s: float = FORGET_GRACE_S,
                 clock: Callable[[], float] = time.monotonic, evidence: Evidence | None = None):
        self.discovery, self.metrics, self.evidence = discovery, metrics, evidence
        self.forget_grace_s = forget_grace_s
        self._closing: dict[asyncio.Task, grpc.aio.Channel] = {}  # removed backends, closing after their grace
        self.health_check, self.eject_s, self.clock = health_check, eject_s, clock
        self.pools = {arm: Pool(arm, clock) for arm in ARMS}
        self._task: asyncio.Task | None = None
        self.discovered = asyncio.Event()

    # -- bookkeeping around one request --------------------------------------------------------

    def acquire(self, b: Backend) -> None:
        b.outstanding += 1
        self.metrics.backend_outstanding.labels(b.arm, b.target).set(b.outstanding)

    def release(self, b: Backend) -> None:
        b.outstanding -= 1
        self.metrics.backend_outstanding.labels(b.arm, b.target).set(b.outstanding)

    def eject(self, b: Backend) -> None:
        """A request to `b` failed with UNAVAILABLE: pass it over for a while."""
        b.ejected_until = self.clock() + self.eject_s
        log.warning("backend unavailable; ejected", extra={"arm": b.arm, "backend": b.target,
                                                           "eject_s": self.eject_s})

    def ready_counts(self) -> dict[str, int]:
        now = self.clock()
        return {arm: sum(b.available(now) for b in pool.backends) for arm, pool in self.pools.items()}

    # -- discovery and health --------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._follow_discovery(), name="discovery")

    async def _follow_discovery(self) -> None:
        async for targets in self.discovery.watch():
            self._apply(targets)
            self.discovered.set()
        await asyncio.Event().wait()  # a static list never changes: keep the task (and its backends) alive

    def _apply(self, targets: dict[str, list[str]]) -> None:
        for arm, pool in self.pools.items():
            want = list(dict.fromkeys(targets.get(arm, ())))
            for b in [b for b in pool.backends if b.target not in want]:
                pool.backends.remove(b)
                self._forget(b)
            have = {b.target for b in pool.backends}
            for target in want:
                if target not in have:
                    pool.backends.append(self._open(arm, target))

    def _open(self, arm: str, target: str) -> Backend:
        where = parse_target(target)
        if where.engine == VLLM:
            conn = VllmConnection(where.address, arm, where.method, self.evidence)
            b = Backend(arm, target, conn, conn, method=where.method)
            watch = conn.watch_health(lambda healthy: self._set_healthy(b, healthy))
        else:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            b = Backend(arm, target, channel, pb_grpc.GenerationStub(channel))
            watch = self._watch_health(b)
        self.metrics.backend_outstanding.labels(arm, target).set(0)
        if self.health_check:
            self._set_healthy(b, False)
            b.task = asyncio.get_running_loop().create_task(watch, name=f"health {target}")
        else:
            watch.close()
            self._set_healthy(b, True)
        log.info("backend added", extra={"arm": arm, "backend": target})
        return b

    def _forget(self, b: Backend) -> None:
        if b.task is not None:
            b.task.cancel()
        # a removed endpoint is usually a pod draining: what it is serving still completes (the channel
        # takes no new calls, and none are routed to it); it is cut only after the grace
        self._closing = {t: c for t, c in self._closing.items() if not t.done()}
        self._closing[asyncio.get_running_loop().create_task(b.channel.close(grace=self.forget_grace_s))] = b.channel
        for gauge in (self.metrics.backend_ready, self.metrics.backend_outstanding):
            try:
                gauge.remove(b.arm, b.target)
            except KeyError:
                pass
        log.info("backend removed", extra={"arm": b.arm, "backend": b.target})

    def _set_healthy(self, b: Backend, healthy: bool) -> None:
        if healthy != b.healthy:
            log.info("backend ready" if healthy else "backend not ready", extra={"arm": b.arm, "backend": b.target})
        b.healthy = healthy
        if healthy:
            b.ejected_until = 0.0  # a fresh SERVING outranks an older failure
        self.metrics.backend_ready.labels(b.arm, b.target).set(1 if healthy else 0)

    async def _watch_health(self, b: Backend) -> None:
        stub = health_pb2_grpc.HealthStub(b.channel)
        delay = 0.05
        while True:
            try:
                async for resp in stub.Watch(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)):
                    self._set_healthy(b, resp.status == health_pb2.HealthCheckResponse.SERVING)
                    delay = 0.05
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("backend has no grpc.health.v1; counted ready", extra={"backend": b.target})
                    self._set_healthy(b, True)
                    return
            self._set_healthy(b, False)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def close(self) -> None:
        tasks = [t for t in [self._task, *self._closing, *(b.task for p in self.pools.values() for b in p.backends)]
                 if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channels = [*self._closing.values(), *(b.channel for p in self.pools.values() for b in p.backends)]
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)
