"""The router's Kubernetes discovery (specfleet_router.k8s_discovery) against the emulated API
server: EndpointSlices of the arms' worker Services are created, updated and deleted, and the
discovered picture, and the router's pools fed by it, follow."""
import asyncio

import kubernetes
import pytest

from specfleet_router.backends import Backends
from specfleet_router.k8s_discovery import SERVICE_LABEL, KubernetesDiscovery, targets
from specfleet_router.metrics import RouterMetrics

SERVICES = {"stable": "chat-stable", "canary": "chat-canary"}
WAIT_S = 10.0


def endpoint_slice(name, service, endpoints, port=50051, port_name="grpc"):
    """endpoints: (ip, serving) pairs."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "default", "labels": {SERVICE_LABEL: service}},
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": serving, "serving": serving,
                                                              "terminating": False}} for ip, serving in endpoints]}


@pytest.fixture()
def api_client(cluster):
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.endpoint))
    yield client
    client.close()


class Pictures:
    """The discovery's yields, awaited one at a time with a deadline."""

    def __init__(self, discovery):
        self.it = discovery.watch().__aiter__()

    async def next(self):
        return await asyncio.wait_for(self.it.__anext__(), WAIT_S)

    async def until(self, wanted):
        """Pictures until `wanted` (intermediate ones are allowed: a watch may report each slice)."""
        seen = []
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while asyncio.get_running_loop().time() < deadline:
            picture = await asyncio.wait_for(self.it.__anext__(), deadline - asyncio.get_running_loop().time())
            seen.append(picture)
            if picture == wanted:
                return seen
        raise AssertionError(f"never saw {wanted}; saw {seen}")


async def test_the_picture_follows_endpointslices(cluster, kube, api_client):
    await kube.create(endpoint_slice("chat-stable-abc", "chat-stable", [("10.0.0.1", True), ("10.0.0.2", False)]))
    await kube.create(endpoint_slice("other-xyz", "other", [("10.9.9.9", True)]))  # not a worker Service
    pictures = Pictures(KubernetesDiscovery("default", SERVICES, api_client=api_client, retry_s=0.1))
    try:
        # the first picture is the listed state: the serving stable endpoint only
        assert await pictures.next() == {"stable": ["10.0.0.1:50051"], "canary": []}
        await kube.create(endpoint_slice("chat-canary-def", "chat-canary", [("10.0.1.1", True)]))
        await pictures.until({"stable": ["10.0.0.1:50051"], "canary": ["10.0.1.1:50051"]})
        # the not-ready stable pod becomes ready; a second slice of the same Service adds a pod
        await kube.patch("discovery.k8s.io/v1", "EndpointSlice", "default", "chat-stable-abc",
                         {"endpoints": endpoint_slice("x", "chat-stable", [("10.0.0.1", True),
                                                                            ("10.0.0.2", True)])["endpoints"]})
        await kube.create(endpoint_slice("chat-stable-ghi", "chat-stable", [("10.0.0.3", True)]))
        await pictures.until({"stable": ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"],
                              "canary": ["10.0.1.1:50051"]})
        # the canary's pods go (slice deleted), a stable pod stops serving
        await kube.delete("discovery.k8s.io/v1", "EndpointSlice", "default", "chat-canary-def")
        await kube.patch("discovery.k8s.io/v1", "EndpointSlice", "default", "chat-stable-ghi",
                         {"endpoints": endpoint_slice("x", "chat-stable", [("10.0.0.3", False)])["endpoints"]})
        seen = await pictures.until({"stable": ["10.0.0.1:50051", "10.0.0.2:50051"], "canary": []})
        assert all("10.9.9.9:50051" not in arm for p in seen for arm in p.values())
    finally:
        await pictures.it.aclose()


async def test_the_router_pools_follow(cluster, kube, api_client):
    """Backends (the router's pools) fed by the discovery: pods join and leave without a restart."""
    await kube.create(endpoint_slice("chat-stable-abc", "chat-stable", [("127.0.0.1", True)], port=50061))
    backends = Backends(KubernetesDiscovery("default", SERVICES, api_client=api_client, retry_s=0.1),
                        RouterMetrics(), health_check=False)
    backends.start()

    async def pools(wanted):
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while asyncio.get_running_loop().time() < deadline:
            now = {arm: sorted(b.target for b in p.backends) for arm, p in backends.pools.items()}
            if now == wanted:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"pools are {now}, not {wanted}")
    try:
        await pools({"stable": ["127.0.0.1:50061"], "canary": []})
        assert backends.ready_counts() == {"stable": 1, "canary": 0}
        await kube.create(endpoint_slice("chat-canary-def", "chat-canary", [("127.0.0.2", True)], port=50062))
        await pools({"stable": ["127.0.0.1:50061"], "canary": ["127.0.0.2:50062"]})
        await kube.delete("discovery.k8s.io/v1", "EndpointSlice", "default", "chat-stable-abc")
        await pools({"stable": [], "canary": ["127.0.0.2:50062"]})
    finally:
        await backends.close()


def test_targets_keep_ipv6_and_skip_fqdn_and_unnamed_ports():
    v6 = endpoint_slice("a", "chat-stable", [("fd00::7", True)])
    v6["addressType"] = "IPv6"
    fqdn = endpoint_slice("b", "chat-stable", [("worker.example", True)])
    fqdn["addressType"] = "FQDN"
    wrong_port = endpoint_slice("c", "chat-canary", [("10.0.0.5", True)], port_name="http")
    unset = endpoint_slice("d", "chat-canary", [("10.0.0.6", True)])
    del unset["endpoints"][0]["conditions"]  # no conditions: serving, as the API says
    assert targets([v6, fqdn, wrong_port, unset], SERVICES) == {"stable": ["[fd00::7]:50051"],
                                                               "canary": ["10.0.0.6:50051"]}


@pytest.mark.parametrize("flags, words", [
    (["blue=x"], "the arm must be stable or canary"),
    (["stable"], "expected ARM=SERVICE"),
    (["stable=ns/x"], "expected ARM=SERVICE"),
    (["stable=a", "stable=b"], "already follows Service a"),
])
def test_bad_flags_are_named(flags, words):
    with pytest.raises(ValueError, match=words):
        KubernetesDiscovery.from_flags(flags, "default")


async def test_specfleet_router_discovers_its_workers_from_the_cluster(cluster, kube, tmp_path):
    """`specfleet router --discover-kubernetes ...` as the operator runs it (kubeconfig instead of
    the in-cluster ServiceAccount): /readyz counts the backends it found in the EndpointSlices (none
    answers gRPC health here, so they are found but not ready)."""
    import json
    import os
    import queue
    import subprocess
    import sys
    import threading
    import urllib.error
    import urllib.request

    from specfleet_operator.testing import write_kubeconfig

    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, cluster.endpoint)
    await kube.create(endpoint_slice("chat-stable-abc", "chat-stable", [("127.0.0.1", True), ("127.0.0.3", True)],
                                     port=1))
    env = {k: v for k, v in os.environ.items() if k != "SPECFLEET_REDIS_URL"}
    env["KUBECONFIG"] = str(kubeconfig)
    proc = subprocess.Popen([sys.executable, "-m", "specfleet_cli.main", "router", "--http-port", "0", "--grpc-port",
                             "0", "--deployment", "default/chat", "--discover-kubernetes", "stable=chat-stable",
                             "--discover-kubernetes", "canary=chat-canary"], stderr=subprocess.PIPE, text=True, env=env)
    ports: queue.Queue = queue.Queue()

    def read():
        for line in proc.stderr:
            if '"listening"' in line:
                ports.put(json.loads(line)["http_port"])
    threading.Thread(target=read, daemon=True).start()

    def readyz(port):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
    try:
        port = await asyncio.to_thread(ports.get, timeout=30)
        await kube.create(endpoint_slice("chat-canary-def", "chat-canary", [("127.0.0.2", True)], port=1))
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:
            status, body = await asyncio.to_thread(readyz, port)
            if "stable: 0 of 2" in body and "canary: 0 of 1" in body:
                break
            assert asyncio.get_running_loop().time() < deadline, (status, body)
            await asyncio.sleep(0.1)
        assert status == 503
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 20)


def test_the_router_refuses_both_a_backend_list_and_discovery():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "router", "--backend", "stable=h:1",
                          "--discover-kubernetes", "stable=chat-stable"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "use static backends or discovery, not both" in out.stderr
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "router", "--discover-kubernetes", "blue=x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "the arm must be stable or canary" in out.stderr
