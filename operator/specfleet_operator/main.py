"""Running the operator: `run(argv)` for the `specfleet operator` command, `operate()` to embed it.

First the installed CRD is checked against this operator's (crd_check): an older one and it does
not start (`specfleet operator` exits 3). With leader election on (the default), a replica first
acquires the Lease, then starts kopf; if it loses the Lease it stops kopf and exits non-zero so
that Kubernetes restarts it as a standby. On a clean stop it releases the Lease so the standby
takes over at once. Alertmanager's posts land in `Options.alerts`, which the control loop reads as
`memo.alerts` (docs/alerts.md).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import logging
import os
import re
import signal
import socket
import threading
from typing import Any, Sequence

import kopf
from specfleet_api import redis_auth

from . import GROUP
from . import converge, handlers  # noqa: F401  (registers the handlers with kopf)
from . import crd_check
from .alerts import DEFAULT_TTL_S, AlertInbox, BearerToken
from .health import AlertReceiver, Heartbeat
from .kube import Kube
from .leader import LeaseElector
from .manifests import Settings
from .redis_state import DefaultRedis

logger = logging.getLogger("specfleet.operator")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclasses.dataclass
class Options:
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    worker: Settings = dataclasses.field(default_factory=Settings)
    leader_election: bool = True
    lease_name: str = "specfleet-operator"
    lease_namespace: str = "specfleet-system"
    identity: str = dataclasses.field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    lease_duration_s: float = 15.0
    renew_s: float = 5.0
    retry_s: float = 2.0
    loop_interval_s: float = 15.0
    liveness: str | None = None  # e.g. http://0.0.0.0:8080/healthz
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # a pod passes 0.0.0.0: the kubelet, Prometheus, Alertmanager
    workers: int = 32  # concurrent reconciles
    release_on_exit: bool = True  # False mimics a crash: the standby waits the Lease out
    heartbeat: Heartbeat = dataclasses.field(default_factory=Heartbeat)  # what /healthz reads
    alerts: AlertInbox = dataclasses.field(default_factory=AlertInbox)  # what /alertmanager writes
    alert_token: BearerToken = dataclasses.field(default_factory=BearerToken)  # none: /alertmanager is off
    # The Redis the install provides (the chart's, or redis.external): a URL without a password, and
    # the file of a mounted Secret holding it; the handlers get it as memo.default_redis (the
    # fleets without spec.redis live there, each as its own Redis user); None: none provided.
    redis_url: str | None = None
    redis_password_file: str | None = None

    @property
    def instance(self) -> str:
        """This install's name, which each fleet it reconciles carries (handlers.CLAIM_ANNOTATION):
        its Lease's namespace/name, unique per chart release."""
        return f"{self.lease_namespace}/{self.lease_name}"

    @property
    def kopf_prefix(self) -> str:
        """Where kopf keeps this install's record of each fleet (its handlers' progress, the spec
        it last handled): an annotation prefix of its own, so two installs watching one namespace
        never read each other's. Shared, the install that does not own a fleet took the claimant's
        record of a handled spec for its own (and so never looked at the fleet again), and the
        reverse could hide a spec change from the claimant. `<lease>.<namespace>.serving.specfleet.dev`,
        or a hash of the instance where that is no valid annotation prefix."""
        readable = f"{self.lease_name}.{self.lease_namespace}.{GROUP}"
        if len(readable) <= 253 and all(_DNS_LABEL.fullmatch(p) for p in readable.split(".")):
            return readable
        return f"i{hashlib.sha256(self.instance.encode()).hexdigest()[:10]}.{GROUP}"

    def default_redis(self) -> DefaultRedis | None:
        """The fleets' default Redis with its admin password read from the file (OSError naming it)."""
        if not self.redis_url:
            return None
        password = redis_auth.read_secret_file(self.redis_password_file) if self.redis_password_file else ""
        return DefaultRedis(self.redis_url, password, self.redis_password_file)


def operator_settings(options: Options) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    # Progress and the diff base live in annotations: the status schema is ours alone.
    # Each install its own (Options.kopf_prefix); the finalizer is shared (handlers.await_claimant).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=options.kopf_prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=options.kopf_prefix, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.peering.standalone = True  # the Lease, not kopf peering, decides who runs
    # Watching listed namespaces, the operator holds Roles there and nothing cluster-wide: kopf then
    # finds the CRD once at start (API discovery needs no RBAC) instead of watching CRDs and Namespaces.
    settings.scanning.disabled = bool(options.namespaces)
    settings.batching.worker_limit = options.workers
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 60
    settings.execution.max_workers = 4
    return settings


async def operate(options: Options, *, connection: Any = None, stop: asyncio.Event | threading.Event | None = None,
                  ready: threading.Event | asyncio.Event | None = None, memo: dict[str, Any] | None = None,
                  leading: threading.Event | None = None) -> int:
    """Run until `stop` is set (0) or the Lease is lost (1); crd_check.OutdatedCRD before anything
    starts, when the installed CRD is older than this operator. `connection`: a kopf.ConnectionInfo;
    None logs in as kopf does (in-cluster service account, else kubeconfig)."""
    settings = operator_settings(options)
    if connection is None:
        connection = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    stop_event = stop if isinstance(stop, asyncio.Event) else asyncio.Event()
    if isinstance(stop, threading.Event):  # embedded in a thread: poll, so no thread is left blocked
        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            stop_event.set()
        watcher = asyncio.create_task(watch())

    kube = Kube(connection)
    beating = asyncio.create_task(options.heartbeat.run())
    elector = LeaseElector(kube, options.lease_namespace, options.lease_name, options.identity,
                           duration_s=options.lease_duration_s, renew_s=options.renew_s, retry_s=options.retry_s)
    try:
        # before the Lease: a standby refuses too, rather than take over against an older CRD later
        await crd_check.check(kube)
        if options.leader_election:
            acquiring = asyncio.create_task(elector.acquire())
            stopping = asyncio.create_task(stop_event.wait())
            await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not acquiring.done():
                acquiring.cancel()
                return 0
            stopping.cancel()
            logger.info("%s leads; starting the reconcilers", options.identity)
        if leading is not None:
            leading.set()
        the_memo = kopf.Memo(connection=connection, settings=options.worker, loop_interval=options.loop_interval_s,
                             heartbeat=options.heartbeat, **{"alerts": options.alerts, "instance": options.instance,
                                                             "default_redis": options.default_redis(),
                                                             **(memo or {})})
        kopf_stop = asyncio.Event()
        running = asyncio.create_task(kopf.operator(
            settings=settings, memo=the_memo, standalone=True, stop_flag=kopf_stop, ready_flag=ready,
            clusterwide=not options.namespaces, namespaces=list(options.namespaces),
            liveness_endpoint=options.liveness))
        holding = asyncio.create_task(elector.hold()) if options.leader_election else None
        waiters = {running, asyncio.create_task(stop_event.wait())} | ({holding} if holding else set())
        done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        lost = holding is not None and holding in done
        for task in pending - {running, holding}:
            task.cancel()
        kopf_stop.set()
        # stop reconciling before the Lease is released, and go on renewing it while kopf stops
        # (its daemons may take longer than the Lease): never two leaders
        await running
        if holding is not None:
            holding.cancel()
        if isinstance(stop, threading.Event):
            watcher.cancel()
        if lost:
            logger.error("lost the lease: exiting so that a fresh standby starts")
            return 1
        return 0
    finally:
        beating.cancel()
        if leading is not None:
            leading.clear()
        if options.leader_election and options.release_on_exit:
            try:
                await elector.release()
            except Exception as exc:  # the Lease expires on its own anyway
                logger.warning("could not release the lease: %s", exc)
        await kube.close()


def parse_args(argv: Sequence[str] | None) -> Options:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="specfleet operator", description="Run the SpecDecodeDeployment operator.")
    p.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable)")
    p.add_argument("--worker-image", default=env("SPECFLEET_WORKER_IMAGE", Settings.worker_image))
    p.add_argument("--worker-pull-policy", default=Settings.image_pull_policy,
                   choices=["Always", "IfNotPresent", "Never"])
    p.add_argument("--drain-seconds", type=int, default=Settings.drain_seconds)
    p.add_argument("--router-image", default=env("SPECFLEET_ROUTER_IMAGE", Settings.router_image),
                   help="image of the router the operator runs for every SpecDecodeDeployment")
    p.add_argument("--router-pull-policy", default=Settings.router_pull_policy,
                   choices=["Always", "IfNotPresent", "Never"])
    p.add_argument("--vllm-image", default=env("SPECFLEET_VLLM_IMAGE", Settings.vllm_image),
                   help="vLLM server image for the GPU pods of fleets with engine vllm and no engine.vllm.image "
                        "(the CUDA build)")
    p.add_argument("--vllm-cpu-image", default=env("SPECFLEET_VLLM_CPU_IMAGE", Settings.vllm_cpu_image),
                   help="vLLM server image for their pods without a GPU (the CPU build, vllm-cpu)")
    p.add_argument("--read-redis-secrets", action="store_true",
                   help="read the Secret of spec.redis.secretRef to write the live state there; the chart grants "
                        "no read of any Secret, so each such Secret's namespace grants get on it by name "
                        "(docs/redis.md); without this flag such fleets' routers take the state from flags")
    p.add_argument("--redis-url", default=env("SPECFLEET_REDIS_URL", ""),
                   help="the Redis the install provides, e.g. redis://specfleet-redis.specfleet-system.svc:6379/0 "
                        "(no password in it: see --redis-password-file)")
    p.add_argument("--redis-password-file", default=env("SPECFLEET_REDIS_PASSWORD_FILE", ""),
                   help="file holding that Redis' password (a mounted Secret key)")
    p.add_argument("--no-leader-election", action="store_true", help="run alone (one replica, or local use)")
    p.add_argument("--lease-name", default="specfleet-operator")
    p.add_argument("--lease-namespace", default=env("POD_NAMESPACE", "specfleet-system"))
    p.add_argument("--identity", default=env("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--lease-duration", type=float, default=15.0, help="seconds")
    p.add_argument("--loop-interval", type=float, default=15.0, help="control-loop period, seconds")
    p.add_argument("--liveness", default="", help="kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz "
                   "(only the leader runs kopf, so probes use /healthz on the metrics port instead)")
    p.add_argument("--metrics-port", type=int, default=8081,
                   help="/metrics and the liveness /healthz; 0 turns them off")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics port listens on; loopback by default, 0.0.0.0 in a pod (the chart "
                        "and deploy/base pass it) so that probes, Prometheus and Alertmanager reach it")
    p.add_argument("--liveness-stale-after", type=float, default=60.0,
                   help="seconds without an event-loop beat, or of one reconcile, after which /healthz answers 503")
    p.add_argument("--alertmanager-token-file", default=env("SPECFLEET_ALERTMANAGER_TOKEN_FILE", ""),
                   help="bearer token Alertmanager must send to POST /alertmanager on the metrics port (a "
                        "mounted Secret key, re-read on each post); without it the receiver is off")
    p.add_argument("--alert-ttl", type=float, default=DEFAULT_TTL_S,
                   help="seconds a firing alert counts without Alertmanager posting it again")
    p.add_argument("--workers", type=int, default=32, help="concurrent reconciles")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    if redis_auth.url_has_password(a.redis_url):
        p.error("--redis-url (SPECFLEET_REDIS_URL) holds a password: put it in a Secret, mount it, and "
                "name the file with --redis-password-file (SPECFLEET_REDIS_PASSWORD_FILE)")
    for flag, value in (("--vllm-image (SPECFLEET_VLLM_IMAGE)", a.vllm_image),
                        ("--vllm-cpu-image (SPECFLEET_VLLM_CPU_IMAGE)", a.vllm_cpu_image)):
        if not value.strip():
            p.error(f"{flag} is empty: name an image, or leave it unset for the pinned upstream one")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Options(
        namespaces=tuple(a.namespace),
        worker=Settings(worker_image=a.worker_image, image_pull_policy=a.worker_pull_policy,
                        drain_seconds=a.drain_seconds, router_image=a.router_image,
                        router_pull_policy=a.router_pull_policy, read_redis_secrets=a.read_redis_secrets,
                        vllm_image=a.vllm_image, vllm_cpu_image=a.vllm_cpu_image),
        leader_election=not a.no_leader_election, lease_name=a.lease_name, lease_namespace=a.lease_namespace,
        identity=a.identity, lease_duration_s=a.lease_duration, renew_s=a.lease_duration / 3,
        retry_s=max(1.0, a.lease_duration / 7), loop_interval_s=a.loop_interval, liveness=a.liveness or None,
        metrics_port=a.metrics_port or None, metrics_host=a.metrics_host, workers=a.workers,
        heartbeat=Heartbeat(stale_after_s=a.liveness_stale_after), alerts=AlertInbox(ttl_s=a.alert_ttl),
        alert_token=BearerToken.from_env(a.alertmanager_token_file),
        redis_url=a.redis_url or None, redis_password_file=a.redis_password_file or None)


def run(argv: Sequence[str] | None = None) -> int:
    """Entry point for `specfleet operator [flags]`; returns the exit status."""
    options = parse_args(argv)
    leading = threading.Event()  # a standby refuses alerts (503), so Alertmanager retries the leader
    if options.metrics_port:
        from .health import serve
        serve(options.metrics_port, options.heartbeat, addr=options.metrics_host,
              alerts=AlertReceiver(options.alerts, options.alert_token, leading, options.namespaces))

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            return await operate(options, stop=stop, leading=leading)
        except crd_check.OutdatedCRD as exc:  # not started: the pod restarts, and starts once it is upgraded
            logger.error("%s", exc)
            return crd_check.EXIT_CODE

    return asyncio.run(main())


if __name__ == "__main__":
    raise SystemExit(run())
