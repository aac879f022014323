"""`specfleet router`: the flags, and the process around RouterServer (SIGTERM drains).

    specfleet router --backend stable=127.0.0.1:50051 --backend canary=127.0.0.1:50052 \\
        --redis-url redis://127.0.0.1:6379/0 --deployment default/chat
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from specfleet_api.enums import METHODS, PROMPT_TYPES, SERVED_METHODS, Method, not_served
from specfleet_api.limits import OPENAI_DEFAULT_TEMPERATURE
from specfleet_api.live_state import LiveState

from . import clusters as cl
from . import drift as dr
from .backends import parse_backends, parse_vllm_backends
from .fleet import router_name
from .server import RouterConfig, RouterServer

log = logging.getLogger("specfleet.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfleet router",
        description="The OpenAI-compatible front door: classifies each request, splits the stable and canary "
                    "arms per request, picks the draft method per prompt type, balances over the workers. "
                    "See docs/router.md.")
    g = p.add_argument_group("listeners")
    g.add_argument("--host", default="127.0.0.1", help="address both listeners bind (default 127.0.0.1)")
    g.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI API, /metrics, /healthz, /readyz (default 8000; 0 picks a free port)")
    g.add_argument("--grpc-port", type=int, default=50050,
                   help="specfleet.v1.Generation and grpc.health.v1 (default 50050; 0 picks a free port)")
    g = p.add_argument_group("backends")
    g.add_argument("--backend", action="append", default=[], metavar="ARM=HOST:PORT",
                   help="a worker's gRPC address in the stable or canary arm; repeat for more")
    g.add_argument("--vllm-backend", action="append", default=[], metavar="ARM/METHOD=HOST:PORT",
                   help="a vLLM OpenAI server of the arm's pool for one draft method (none: its plain pool), "
                        "beside or instead of workers; repeat for more (docs/vllm.md)")
    g.add_argument("--discover-vllm", action="append", default=[], metavar="ARM/METHOD=SERVICE",
                   help="the arm's vLLM pool for a draft method is the endpoints of this Service (port named "
                        "http) in the --deployment's namespace, followed through its EndpointSlices")
    g.add_argument("--discover-kubernetes", action="append", default=[], metavar="ARM=SERVICE",
                   help="instead of --backend: the arm's workers are the endpoints of this Service in the "
                        "--deployment's namespace, followed through its EndpointSlices (k8s_discovery.py)")
    g.add_argument("--no-health-check", action="store_true",
                   help="count every backend ready instead of following its grpc.health.v1 status")
    g.add_argument("--eject-seconds", type=float, default=2.0,
                   help="how long a backend that answered UNAVAILABLE is passed over (default 2)")
    g.add_argument("--retries", type=int, default=1,
                   help="times a request that has not streamed a token is sent again elsewhere on UNAVAILABLE "
                        "(default 1)")
    g = p.add_argument_group("deployment and live state")
    g.add_argument("--deployment", default="default/specfleet", metavar="NAMESPACE/NAME",
                   help="the SpecDecodeDeployment served: its name is the model id, and its live state is read "
                        "from Redis (default default/specfleet)")
    g.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                   help="another model id accepted for it (its model.name); repeatable")
    g.add_argument("--redis-url", default=os.environ.get("SPECFLEET_REDIS_URL"),
                   help="follow the deployment's live state in Redis (default $SPECFLEET_REDIS_URL); without it "
                        "the flags below are the state")
    g.add_argument("--redis-poll-seconds", type=float, default=0.5, help="how often the state is read (default 0.5)")
    g.add_argument("--canary-weight", type=float, default=0.0, metavar="PERCENT",
                   help="the canary arm's share of requests, 0 to 100 with two decimals (default 0)")
    g.add_argument("--route", action="append", default=[], metavar="TYPE=METHOD",
                   help=f"draft method for a prompt type ({', '.join(PROMPT_TYPES)}); repeatable")
    g.add_argument("--default-method", default=Method.NGRAM.value, choices=SERVED_METHODS,
                   help="draft method for prompt types without a --route (default ngram)")
    g = p.add_argument_group("prompt clusters and drift check (published to Redis for the loop)")
    g.add_argument("--router-name", default=None,
                   help="this router in cluster ids (<name>/<n>) and in the Redis keys it writes (default $POD_NAME, "
                        "else the host name)")
    g.add_argument("--max-clusters", type=int,
                   default=os.environ.get("SPECFLEET_MAX_CLUSTERS", str(cl.DEFAULT_MAX_CLUSTERS)),
                   help="prompt clusters learned per prompt type (default $SPECFLEET_MAX_CLUSTERS, else "
                        f"{cl.DEFAULT_MAX_CLUSTERS})")
    g.add_argument("--cluster-similarity", type=float,
                   default=os.environ.get("SPECFLEET_CLUSTER_SIMILARITY", str(cl.DEFAULT_THRESHOLD)),
                   help="mean cosine similarity to a cluster's members a prompt needs to join it rather than open one while under "
                        f"--max-clusters (default $SPECFLEET_CLUSTER_SIMILARITY, else {cl.DEFAULT_THRESHOLD})")
    g.add_argument("--fleet-window-seconds", type=float,
                   default=os.environ.get("SPECFLEET_FLEET_WINDOW_S", str(cl.DEFAULT_WINDOW_S)),
                   help="the sliding window of each cluster's counts, published every 5 s (default "
                        f"$SPECFLEET_FLEET_WINDOW_S, else {cl.DEFAULT_WINDOW_S:g})")
    g.add_argument("--mirror-concurrency", type=int, default=dr.DEFAULT_CONCURRENCY,
                   help="drift-check pairs mirrored at a time; one more is dropped and counted (default "
                        f"{dr.DEFAULT_CONCURRENCY})")
    g = p.add_argument_group("requests")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="deadline of an HTTP request, passed to the worker (default 600)")
    g.add_argument("--default-temperature", type=float, default=OPENAI_DEFAULT_TEMPERATURE,
                   help="temperature of an HTTP request that names none (default 1, as OpenAI's API)")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest HTTP body (default 1 MiB)")
    g = p.add_argument_group("process")
    g.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight get to finish (default 30)")
    g.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed flags; ValueError says which flag is wrong."""
    namespace, slash, name = args.deployment.partition("/")
    if not slash or not namespace or not name:
        raise ValueError(f"--deployment {args.deployment!r}: expected NAMESPACE/NAME")
    routes = {}
    for spec in args.route:
        t, eq, m = spec.partition("=")
        if not eq:
            raise ValueError(f"--route {spec!r}: expected TYPE=METHOD, for example code=ngram")
        if t not in PROMPT_TYPES:
            raise ValueError(f"--route {spec!r}: the prompt type must be one of {', '.join(PROMPT_TYPES)}")
        if m not in METHODS:
            raise ValueError(f"--route {spec!r}: the method must be one of {', '.join(SERVED_METHODS)}")
        if m not in SERVED_METHODS:
            raise ValueError(f"--route {spec!r}: " + not_served("method", m, SERVED_METHODS))
        routes[t] = m
    state = LiveState(version=0, canary_weight=args.canary_weight, default_method=args.default_method, routes=routes)
    problems = state.problems()
    if problems:
        raise ValueError("; ".join(problems))
    if args.max_clusters < 1:
        raise ValueError(f"--max-clusters {args.max_clusters}: need at least 1")
    if not -1.0 <= args.cluster_similarity <= 1.0:
        raise ValueError(f"--cluster-similarity {args.cluster_similarity}: a cosine similarity in [-1, 1]")
    if args.fleet_window_seconds <= 0:
        raise ValueError(f"--fleet-window-seconds {args.fleet_window_seconds:g}: need a positive number of seconds")
    if args.mirror_concurrency < 0:
        raise ValueError(f"--mirror-concurrency {args.mirror_concurrency}: need 0 or more")
    backends = parse_backends(args.backend)
    for arm, targets in parse_vllm_backends(args.vllm_backend, METHODS).items():
        backends[arm] += targets
    discovered = args.discover_kubernetes or args.discover_vllm
    if any(backends.values()) and discovered:
        raise ValueError("--backend/--vllm-backend and --discover-kubernetes/--discover-vllm: use static backends "
                         "or discovery, not both")
    if not any(backends.values()) and not discovered:
        raise ValueError("--backend: name at least one worker, for example --backend stable=127.0.0.1:50051 "
                         "(or a vLLM server: --vllm-backend stable/ngram=127.0.0.1:8001)")
    return RouterConfig(backends=backends, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                        namespace=namespace, name=name, model_aliases=args.model_alias, state=state,
                        redis_url=args.redis_url or None, redis_poll_s=args.redis_poll_seconds,
                        request_timeout_s=args.request_timeout, default_temperature=args.default_temperature,
                        health_check=not args.no_health_check, eject_s=args.eject_seconds, retries=args.retries,
                        max_request_bytes=args.max_request_bytes, drain_s=args.drain_seconds,
                        router_name=router_name(args.router_name, os.environ, socket.gethostname),
                        max_clusters=args.max_clusters, cluster_similarity=args.cluster_similarity,
                        fleet_window_s=args.fleet_window_seconds, mirror_concurrency=args.mirror_concurrency)


async def serve(cfg: RouterConfig, drain_s: float, discovery=None) -> int:
    server = await RouterServer(cfg, discovery).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    done = await server.shutdown(drain_s)
    log.info("stopped", extra={"drained": done})
    return 0 if done else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specfleet_worker import logs  # torch-free: the fleet's one JSON log format

    logs.configure(args.log_level)
    try:
        cfg = config_from_args(args)
        discovery = None
        if args.discover_kubernetes or args.discover_vllm:
            from .k8s_discovery import KubernetesDiscovery

            discovery = KubernetesDiscovery.from_flags(args.discover_kubernetes, cfg.namespace,
                                                       vllm_specs=args.discover_vllm)
    except ValueError as e:
        print(f"specfleet router: error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve(cfg, args.drain_seconds, discovery))


if __name__ == "__main__":
    sys.exit(main())
