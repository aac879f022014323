"""Where the Admin port lives in a cluster: the operator starts workers with it on a port of its
own, no Service exposes it, and the chart's NetworkPolicy admits only the operator to it; the
three agree on the number with `specfleet serve --admin-port`'s default."""
from __future__ import annotations

import pathlib

import helm_python as helm
import kubernetes_validate
import yaml

from specfleet_operator import manifests
from specfleet_operator.spec import with_defaults
from specfleet_worker.main import parse_args

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "specfleet"
SDD = {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
       "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
       "spec": {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"},
                "canary": {"weight": 10}}}


def render(values: dict) -> list[dict]:
    out = helm.Chart.load(str(CHART)).render(values, name="specfleet", namespace="specfleet-system",
                                             is_install=True)
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def test_one_admin_port_in_worker_operator_and_chart():
    settings = manifests.Settings()
    chart_default = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["adminPort"]
    assert parse_args([]).admin_port == settings.admin_port == chart_default


def test_workers_listen_for_admin_on_their_own_port_which_no_service_exposes():
    settings = manifests.Settings(admin_port=50070)
    kids = manifests.children(SDD, with_defaults(SDD["spec"]), settings)
    workers = [k for k in kids if k["kind"] == "Deployment" and "--admin-port" in
               k["spec"]["template"]["spec"]["containers"][0]["args"]]
    assert len(workers) == 2  # stable and canary
    for d in workers:
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--admin-port") + 1] == "50070" and args[args.index("--admin-host") + 1] == "127.0.0.1"
    for svc in (k for k in kids if k["kind"] == "Service"):
        for port in svc["spec"]["ports"]:
            assert port["port"] != 50070 and port["targetPort"] not in (50070, "admin"), svc["metadata"]["name"]


def test_chart_network_policy_admits_only_the_operator_to_the_admin_port():
    docs = render({"watchNamespaces": ["team-a", "team-b"], "networkPolicy": {"adminPort": 50070}})
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    operator = next(d for d in docs if d["kind"] == "Deployment")
    for p in policies:
        kubernetes_validate.validate(p, "1.30", strict=True)
        assert p["spec"]["podSelector"]["matchLabels"].items() <= manifests.labels("chat", "stable").items()
        open_rules = [r for r in p["spec"]["ingress"] if "from" not in r]
        assert {port["port"] for r in open_rules for port in r["ports"]} == {"grpc", "http"}
        (admin_rule,) = [r for r in p["spec"]["ingress"] if "from" in r]
        assert [port["port"] for port in admin_rule["ports"]] == [50070]
        (peer,) = admin_rule["from"]
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "specfleet-system"}
        assert peer["podSelector"]["matchLabels"].items() <= operator["spec"]["template"]["metadata"]["labels"].items()
    # no watched namespaces: the release's own; and it can be turned off
    assert [d["metadata"]["namespace"] for d in render({}) if d["kind"] == "NetworkPolicy"] == ["specfleet-system"]
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]
