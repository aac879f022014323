"""Who reaches what the operator and the workers listen on: the operator's metrics port binds
loopback unless told (a pod passes 0.0.0.0), its NetworkPolicy admits that port alone (chart and
kustomize alike), and the workers' unauthenticated Admin port admits no peer unless named."""
import pathlib
import subprocess
import sys

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from specfleet_operator.health import Heartbeat, serve
from specfleet_operator.main import parse_args
from specfleet_operator.manifests import Settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specfleet"
NS = "specfleet-system"


def render(values):
    out = helm.Chart.load(str(CHART)).render(values, name="specfleet", namespace=NS, is_install=True)
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def kustomized():
    out = subprocess.run([str(pathlib.Path(sys.executable).parent / "kubectl"), "kustomize", str(ROOT / "deploy" / "base")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def operator_policy(docs):
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"
                 and d["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    return deployment, policy


def test_the_metrics_port_binds_loopback_unless_told():
    assert parse_args([]).metrics_host == "127.0.0.1"
    server = serve(0, Heartbeat())
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("source", ["chart", "kustomize"])
def test_in_a_pod_the_metrics_port_is_open_to_the_cluster_and_nothing_else_is(source):
    docs = render({}) if source == "chart" else kustomized()
    deployment, policy = operator_policy(docs)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    options = parse_args(container["args"])
    assert options.metrics_host == "0.0.0.0"  # the kubelet's probe, Prometheus and Alertmanager
    assert [p["name"] for p in container["ports"]] == ["metrics"]
    assert container["ports"][0]["containerPort"] == options.metrics_port
    assert policy["metadata"]["namespace"] == NS and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]}]
    kubernetes_validate.validate(policy, "1.30", strict=True)


def worker_policies(docs):
    return [d for d in docs if d["kind"] == "NetworkPolicy"
            and d["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "worker"]


@pytest.mark.parametrize("values, namespaces", [({}, [NS]), ({"watchNamespaces": ["team-a", "team-b"]},
                                                            ["team-a", "team-b"])])
def test_the_workers_admin_port_admits_no_peer_by_default(values, namespaces):
    policies = worker_policies(render(values))
    assert [p["metadata"]["namespace"] for p in policies] == namespaces
    for p in policies:
        # an Ingress policy whose only rule opens HTTP: the Admin port is closed to all pods, and gRPC
        # is each fleet's own policy's (its router only: manifests.worker_network_policy)
        assert p["spec"]["policyTypes"] == ["Ingress"]
        assert p["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    assert Settings().admin_port == 50060 and Settings().grpc_port != 50060 and Settings().http_port != 50060


def test_admin_from_names_the_peers_admitted_to_the_admin_port():
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": {"app": "specfleet-admin"}}}
    (policy,) = worker_policies(render({"networkPolicy": {"adminFrom": [peer], "adminPort": 50061}}))
    assert policy["spec"]["ingress"][1] == {"from": [peer], "ports": [{"port": 50061, "protocol": "TCP"}]}
    kubernetes_validate.validate(policy, "1.30", strict=True)


def test_network_policies_can_be_turned_off():
    assert not [d for d in render({"networkPolicy": {"enabled": False}, "redis": {"networkPolicy": {"enabled": False}}})
                if d["kind"] == "NetworkPolicy"]

