"""Where the Admin port lives in a cluster: the operator starts workers with it on a port of its
own, on the pod's loopback, and no Service exposes it; the chart (whose NetworkPolicy closes it:
tests/operator/test_admin_access.py) agrees on the number with `specfleet serve --admin-port`'s
default."""
from __future__ import annotations

import pathlib

import yaml

from specfleet_operator import manifests
from specfleet_operator.spec import with_defaults
from specfleet_worker.main import parse_args

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "specfleet"
SDD = {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
       "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1"},
       "spec": {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"},
                "canary": {"weight": 10}}}


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
