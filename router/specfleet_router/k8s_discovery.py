"""Backends from Kubernetes: each arm's workers are the endpoints of that arm's worker Service,
followed through its EndpointSlices (discovery.k8s.io/v1, labelled kubernetes.io/service-name).

`KubernetesDiscovery` is a `backends.Discovery`. One thread lists the slices of the arms' Services
and then watches them with the kubernetes client (a blocking HTTP stream); every change of the
picture ({arm: [host:port]}) is handed to the asyncio loop and yielded from `watch()`. A watch that
ends (the server's timeout) or breaks is followed by a fresh list after `retry_s`, which also
catches a deletion missed while disconnected. The router's ServiceAccount needs only `get, list,
watch` on endpointslices in its own namespace.

An endpoint is a backend while its `serving` condition is not false (`ready` on clusters that
lack `serving`): a terminating worker stays in the pool while it still serves, so requests in
flight on it can finish; new requests leave it as soon as its gRPC health says NOT_SERVING, which
a draining worker does at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Any

from .split import CANARY, STABLE
from .vllm_backend import vllm_target

log = logging.getLogger("specfleet.router.discovery")

ARMS = (STABLE, CANARY)
SERVICE_LABEL = "kubernetes.io/service-name"
PORT_NAME = "grpc"  # the worker Services' gRPC port (specfleet_operator.manifests.DISCOVERY_PORT)
VLLM_PORT_NAME = "http"  # a vLLM pool Service's OpenAI port (specfleet_operator.manifests.vllm_service)


def parse_services(specs: list[str]) -> dict[str, str]:
    """`--discover-kubernetes` values (`ARM=SERVICE`) as the worker Service of each arm.

    >>> parse_services(["stable=chat-stable", "canary=chat-canary"])
    {'stable': 'chat-stable', 'canary': 'chat-canary'}
    >>> parse_services(["blue=chat"])
    Traceback (most recent call last):
    ...
    ValueError: --discover-kubernetes 'blue=chat': the arm must be stable or canary (ARM=SERVICE)
    """
    out: dict[str, str] = {}
    for spec in specs:
        arm, sep, service = spec.partition("=")
        if arm not in ARMS:
            raise ValueError(f"--discover-kubernetes {spec!r}: the arm must be stable or canary (ARM=SERVICE)")
        if not sep or not service or "/" in service:
            raise ValueError(f"--discover-kubernetes {spec!r}: expected ARM=SERVICE, a Service in the "
                             f"deployment's namespace, for example stable=chat-stable")
        if arm in out and out[arm] != service:
            raise ValueError(f"--discover-kubernetes {spec!r}: arm {arm} already follows Service {out[arm]}")
        out[arm] = service
    return out


def parse_vllm_services(specs: list[str], methods: tuple[str, ...]) -> dict[str, str]:
    """`--discover-vllm` values (`ARM/METHOD=SERVICE`) as the Service of each vLLM pool, keyed ARM/METHOD.

    >>> parse_vllm_services(["stable/ngram=chat-vllm-stable-ngram"], ("none", "ngram"))
    {'stable/ngram': 'chat-vllm-stable-ngram'}
    >>> parse_vllm_services(["stable=chat"], ("none", "ngram"))
    Traceback (most recent call last):
    ...
    ValueError: --discover-vllm 'stable=chat': expected ARM/METHOD=SERVICE, ARM stable or canary, METHOD one of none, ngram
    """
    out: dict[str, str] = {}
    for spec in specs:
        pool, sep, service = spec.partition("=")
        arm, slash, method = pool.partition("/")
        if arm not in ARMS or not slash or method not in methods or not sep or not service or "/" in service:
            raise ValueError(f"--discover-vllm {spec!r}: expected ARM/METHOD=SERVICE, ARM stable or canary, "
                             f"METHOD one of {', '.join(methods)}")
        if out.get(pool, service) != service:
            raise ValueError(f"--discover-vllm {spec!r}: pool {pool} already follows Service {out[pool]}")
        out[pool] = service
    return out


def label_selector(services: dict[str, str]) -> str:
    """The slices of these Services, in one set-based selector (one watch for both arms).

    >>> label_selector({"stable": "chat-stable", "canary": "chat-canary"})
    'kubernetes.io/service-name in (chat-canary,chat-stable)'
    """
    return f"{SERVICE_LABEL} in ({','.join(sorted(set(services.values())))})"


def targets(slices: Iterable[dict[str, Any]], services: dict[str, str], port_name: str = PORT_NAME
            ) -> dict[str, list[str]]:
    """The backends of each arm in these EndpointSlices (JSON as the API server serves them):
    the first address of every endpoint that serves, at the slice's port named `port_name`; for
    a vLLM pool's Service (keyed ARM/METHOD), at its port named `http`, as a vLLM target.

    >>> s = {"metadata": {"labels": {SERVICE_LABEL: "chat-stable"}}, "addressType": "IPv4",
    ...      "ports": [{"name": "grpc", "port": 50051}],
    ...      "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True, "serving": True}},
    ...                    {"addresses": ["10.0.0.8"], "conditions": {"ready": False, "serving": False}},
    ...                    {"addresses": ["10.0.0.9"], "conditions": {"ready": False, "serving": True,
    ...                                                             "terminating": True}}]}
    >>> targets([s], {"stable": "chat-stable", "canary": "chat-canary"})
    {'stable': ['10.0.0.7:50051', '10.0.0.9:50051'], 'canary': []}
    >>> v = {"metadata": {"labels": {SERVICE_LABEL: "chat-vllm-stable-none"}}, "ports": [{"name": "http", "port": 8000}],
    ...      "endpoints": [{"addresses": ["10.0.1.4"]}]}
    >>> targets([v], {"stable/none": "chat-vllm-stable-none"})
    {'stable': ['vllm/none@10.0.1.4:8000'], 'canary': []}
    """
    key_of = {service: key for key, service in services.items()}
    out: dict[str, list[str]] = {arm: [] for arm in ARMS}
    for s in slices:
        key = key_of.get(((s.get("metadata") or {}).get("labels") or {}).get(SERVICE_LABEL))
        if key is None or s.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue
        arm, vllm_pool, method = key.partition("/")
        want = VLLM_PORT_NAME if vllm_pool else port_name
        ports = [p["port"] for p in s.get("ports") or [] if p.get("name") == want and p.get("port")]
        if not ports:
            continue
        for endpoint in s.get("endpoints") or []:
            cond = endpoint.get("conditions") or {}
            if cond.get("serving", cond.get("ready")) is False:  # unset means serving (the API's rule)
                continue
            addresses = endpoint.get("addresses") or []
            if addresses:  # the API: consumers use the first address, the others are the same endpoint
                host = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]
                address = f"{host}:{ports[0]}"
                out[arm].append(vllm_target(method, address) if vllm_pool else address)
    return {arm: sorted(set(found)) for arm, found in out.items()}


def api_client_from_environment() -> Any:
    """A kubernetes ApiClient: the pod's ServiceAccount in a cluster, else the kubeconfig."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(client_configuration=cfg)
    return client.ApiClient(cfg)


class KubernetesDiscovery:
    """Each arm's backends: the serving endpoints of its worker Service in `namespace`, and of its
    vLLM pools' Services (`services` keys ARM/METHOD)."""

    def __init__(self, namespace: str, services: dict[str, str], *, api_client: Any = None,
                 port_name: str = PORT_NAME, watch_timeout_s: float = 300.0, retry_s: float = 1.0):
        if not services:
            raise ValueError("--discover-kubernetes: name the worker Service (or with --discover-vllm, a vLLM pool's "
                             "Service) of at least one arm")
        self.namespace, self.services, self.port_name = namespace, dict(services), port_name
        self.watch_timeout_s, self.retry_s = watch_timeout_s, retry_s
        self._api_client = api_client

    @classmethod
    def from_flags(cls, specs: list[str], namespace: str, vllm_specs: list[str] = (), **kw: Any
                   ) -> KubernetesDiscovery:
        """From `--discover-kubernetes ARM=SERVICE` and `--discover-vllm ARM/METHOD=SERVICE` values;
        ValueError names the bad one."""
        from specfleet_api.enums import METHODS

        return cls(namespace, {**parse_services(specs), **parse_vllm_services(list(vllm_specs), METHODS)}, **kw)

    async def watch(self) -> AsyncIterator[dict[str, list[str]]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, list[str]]] = asyncio.Queue()
        follower = _Follower(self, loop, queue)
        thread = threading.Thread(target=follower.run, name="k8s-discovery", daemon=True)
        thread.start()
        try:
            while True:
                yield await queue.get()
        finally:
            follower.stop()


class _Follower:
    """The blocking list-then-watch loop, on its own thread."""

    def __init__(self, discovery: KubernetesDiscovery, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.d, self.loop, self.queue = discovery, loop, queue
        self.stopped = threading.Event()
        self._response: Any = None
        self._last: dict[str, list[str]] | None = None

    def stop(self) -> None:
        self.stopped.set()
        response = self._response
        if response is not None:  # wakes a read blocked on a quiet watch
            try:
                response.shutdown()
            except Exception:
                pass

    def _publish(self, slices: dict[str, dict[str, Any]]) -> None:
        picture = targets(slices.values(), self.d.services, self.d.port_name)
        if picture == self._last:
            return
        self._last = picture
        log.info("backends discovered", extra={"namespace": self.d.namespace,
                                               **{arm: len(found) for arm, found in picture.items()}})
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, picture)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.stopped.set()

    def run(self) -> None:
        from kubernetes import client
        from kubernetes.watch.watch import iter_resp_lines

        api = client.DiscoveryV1Api(self.d._api_client or api_client_from_environment())
        selector = label_selector(self.d.services)
        read_timeout = (5.0, self.d.watch_timeout_s + 10.0)  # (connect, read) on the client's side
        while not self.stopped.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(
                    self.d.namespace, label_selector=selector, _preload_content=False, _request_timeout=read_timeout)
                body = json.loads(listed.data)
                slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
                self._publish(slices)
                self._response = api.list_namespaced_endpoint_slice(
                    self.d.namespace, label_selector=selector, watch=True, allow_watch_bookmarks=True,
                    resource_version=(body.get("metadata") or {}).get("resourceVersion"),
                    timeout_seconds=int(self.d.watch_timeout_s), _preload_content=False,
                    _request_timeout=read_timeout)
                if self.stopped.is_set():
                    break
                for line in iter_resp_lines(self._response):
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # e.g. 410 Gone: the resourceVersion is too old; list again
                        log.info("watch ended by the API server; listing again", extra={"reason": obj.get("reason")})
                        break
                    name = (obj.get("metadata") or {}).get("name")
                    if kind == "BOOKMARK" or not name:
                        continue
                    if kind == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    self._publish(slices)
            except Exception as exc:  # the API server away, a broken stream, a read timeout: list again
                if self.stopped.is_set():
                    break
                log.warning("EndpointSlice watch failed; serving on the last backends and retrying",
                            extra={"namespace": self.d.namespace, "error": f"{type(exc).__name__}: {exc}"})
                self.stopped.wait(self.d.retry_s)
            finally:
                if self._response is not None:
                    self._response.release_conn()
                    self._response = None
