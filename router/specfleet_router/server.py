"""The router process's parts put together on one asyncio loop: the live state (Redis or flags),
the backend pools, the prompt clusters, the drift check, the dispatcher, the HTTP front and the
gRPC front, what is published for the loop (with Redis), and their life cycle (start, drain on
SIGTERM, stop)."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specfleet_api.limits import OPENAI_DEFAULT_TEMPERATURE
from specfleet_api.live_state import LiveState
from specfleet_api.windows import publish_period
from specfleet_proto import worker_pb2_grpc as pb_grpc

from . import clusters as cl
from . import drift as dr
from .backends import Backends, Discovery, StaticDiscovery
from .dispatch import Router
from .fleet import FleetPublisher
from .grpc_api import GenerationFront
from .http_api import HttpFront, Models
from .metrics import RouterMetrics
from .openai_api import error_body
from .state import RedisState, RedisTask, StaticState
from .vllm_backend import Evidence

log = logging.getLogger("specfleet.router")

SHUTDOWN_TIMEOUT_S = 1.0  # what HTTP handlers still running get at stop


@dataclass
class RouterConfig:
    backends: dict[str, list[str]] = field(default_factory=dict)  # arm -> [host:port]
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    namespace: str = "default"
    name: str = "specfleet"  # the deployment's resource name: the model id clients ask for
    model_aliases: list[str] = field(default_factory=list)
    state: LiveState = field(default_factory=LiveState)  # from flags; with Redis, until the first read
    redis_url: str | None = None
    redis_poll_s: float = 0.5
    request_timeout_s: float = 600.0
    default_temperature: float = OPENAI_DEFAULT_TEMPERATURE
    health_check: bool = True
    eject_s: float = 2.0
    retries: int = 1
    max_request_bytes: int = 1 << 20
    drain_s: float = 30.0  # what requests in flight get: on SIGTERM, and on a backend discovery removed
    router_name: str = field(default_factory=socket.gethostname)  # in cluster ids and the keys it publishes
    max_clusters: int = cl.DEFAULT_MAX_CLUSTERS  # per prompt type
    cluster_similarity: float = cl.DEFAULT_THRESHOLD
    fleet_window_s: float = cl.DEFAULT_WINDOW_S
    fleet_publish_s: float | None = None  # None: specfleet_worker's rule (5 s, a quarter of a short window)
    mirror_concurrency: int = dr.DEFAULT_CONCURRENCY
    mirror_timeout_s: float = dr.DEFAULT_TIMEOUT_S


class RouterServer:
    def __init__(self, cfg: RouterConfig, discovery: Discovery | None = None):
        self.cfg = cfg
        self.discovery = discovery or StaticDiscovery(cfg.backends)
        self.metrics = RouterMetrics()
        self.draining = False
        self.http_port = self.grpc_port = 0

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        counts = self.backends.ready_counts()
        if not any(counts.values()):
            return False, "no ready backend (" + ", ".join(f"{a}: 0 of {len(p.backends)}"
                                                          for a, p in self.backends.pools.items()) + ")"
        return True, "ready (" + ", ".join(f"{a}: {n}" for a, n in counts.items()) + ")"

    async def start(self) -> RouterServer:
        cfg = self.cfg
        if cfg.redis_url:
            self.state = RedisState(cfg.redis_url, cfg.namespace, cfg.name, cfg.state, self.metrics,
                                    poll_s=cfg.redis_poll_s)
            await self.state.poll_once()  # serve the stored state from the first request when Redis is up
            self.state.start()
        else:
            self.state = StaticState(cfg.state, self.metrics)
        self.evidence = Evidence(cfg.namespace, cfg.name, cfg.router_name, cfg.fleet_window_s)
        self.backends = Backends(self.discovery, self.metrics, health_check=cfg.health_check, eject_s=cfg.eject_s,
                                 forget_grace_s=cfg.drain_s, evidence=self.evidence)
        self.backends.start()
        self.clusters = cl.Clusters(cfg.router_name, cfg.max_clusters, cfg.cluster_similarity)
        self.windows = cl.ClusterWindows(cfg.fleet_window_s)
        self.drift = dr.Drift(self.backends, self.state, self.metrics, concurrency=cfg.mirror_concurrency,
                              timeout_s=cfg.mirror_timeout_s)
        self.router = Router(self.backends, self.state, self.metrics, retries=cfg.retries, clusters=self.clusters,
                             windows=self.windows, drift=self.drift)
        self.publisher = None
        if cfg.redis_url:
            self.publisher = FleetPublisher(cfg.redis_url, cfg.namespace, cfg.name, cfg.router_name, self.metrics,
                                            windows=self.windows, drift=self.drift, evidence=self.evidence,
                                            period_s=cfg.fleet_publish_s if cfg.fleet_publish_s is not None else
                                            publish_period(cfg.fleet_window_s))
            self.publisher.start()

        front = HttpFront(self.router, Models(cfg.name, cfg.model_aliases), self.metrics,
                          request_timeout_s=cfg.request_timeout_s, default_temperature=cfg.default_temperature,
                          ready=self.ready, max_request_bytes=cfg.max_request_bytes)
        app = front.app()
        app.middlewares.append(self._refuse_while_draining)
        # a client that goes away cancels its handler, and with it the worker's request
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, cfg.host, cfg.http_port)
        await site.start()
        self.http_port = self.runner.addresses[0][1]

        self.grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                             ("grpc.so_reuseport", 0)])
        pb_grpc.add_GenerationServicer_to_server(GenerationFront(self.router), self.grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.grpc_port = self.grpc.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
        await self.grpc.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("listening", extra={"http_port": self.http_port, "grpc_port": self.grpc_port,
                                     "deployment": f"{cfg.namespace}/{cfg.name}",
                                     "redis": bool(cfg.redis_url), "backends": cfg.backends})
        return self

    @web.middleware
    async def _refuse_while_draining(self, request: web.Request, handler):
        # new work during a drain would keep it from ever ending under a steady load
        if self.draining and request.method == "POST":
            return web.json_response(error_body(503, "the router is shutting down; retry on another replica",
                                                None, "draining"), status=503, headers={"Connection": "close"})
        return await handler(request)

    async def drain(self, grace_s: float) -> bool:
        """Not ready, new requests refused (HTTP 503, gRPC UNAVAILABLE), then wait for the requests
        in flight (True: all finished within the grace)."""
        self.draining = True
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        # grpc.aio stops taking new calls at once and gives those in flight the grace
        self._grpc_stopping = asyncio.get_running_loop().create_task(self.grpc.stop(grace_s))
        log.info("draining", extra={"in_flight": self.in_flight(), "grace_s": grace_s})
        end = asyncio.get_running_loop().time() + grace_s
        while self.in_flight() and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.05)
        return self.in_flight() == 0

    def in_flight(self) -> int:
        return self.router.in_flight

    def stop_bound_s(self) -> float:
        """The longest `stop(0)` takes: the HTTP handlers' shutdown timeout, then each Redis task's
        close (RedisTask.stop_bound_s: bounded by the client's own timeouts, whether Redis is up,
        dead, paused or unreachable). The rest of a stop cancels tasks and closes channels, and waits
        on no peer."""
        redis = [t for t in (self.publisher, self.state) if isinstance(t, RedisTask)]
        return SHUTDOWN_TIMEOUT_S + sum(t.stop_bound_s() for t in redis)

    async def shutdown(self, drain_s: float) -> bool:
        """SIGTERM's way out: `drain(drain_s)`, then `stop(0)`; True when the requests in flight all
        finished. Takes at most drain_s + stop_bound_s()."""
        done = await self.drain(drain_s)
        await self.stop(0)
        return done

    async def stop(self, grace_s: float = 0.0) -> None:
        await self.grpc.stop(grace_s)
        await self.runner.cleanup()
        await self.drift.close()
        if self.publisher is not None:
            await self.publisher.close()
        await self.backends.close()
        if isinstance(self.state, RedisState):
            await self.state.close()
