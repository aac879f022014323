"""The operator checks the installed CRD at start, from the API server's OpenAPI v3 document (no
RBAC on CustomResourceDefinitions needed): an older one, which would prune the status fields it
lacks, is refused naming the command that upgrades it; the current one runs; a server that does
not publish the document gets a warning and a running operator."""
import asyncio
import copy
import logging
import subprocess
import sys

from specfleet_operator import API_VERSION, crd_check
from specfleet_operator.spec import crd
from specfleet_operator.testing import (OperatorThread, crd_without, openapi_document, ready, sdd_body, wait_for,
                                       write_kubeconfig)

LOOP_MEMORY = ("status.kCeilings", "status.methods", "status.clusterMethods")
OPENAPI = "/openapi/v3/apis/serving.specfleet.dev/v1alpha1"
UPGRADE = "kubectl apply --server-side -f crds/serving.specfleet.dev_specdecodedeployments.yaml"


def lacking(installed):
    """What the check finds missing in the document an API server publishes for `installed`."""
    (version,) = installed["spec"]["versions"]
    return sorted(crd_check.lacking(openapi_document(installed["spec"]["group"], "SpecDecodeDeployment", version)))


def test_what_an_older_crd_lacks_is_found_at_any_depth_and_a_newer_one_passes():
    assert lacking(crd()) == []
    assert lacking(crd_without(*LOOP_MEMORY)) == sorted(LOOP_MEMORY)
    assert lacking(crd_without("spec.speculation.tree", "status.canary.promoted.base")) == [
        "spec.speculation.tree", "status.canary.promoted.base"]
    newer = copy.deepcopy(crd())
    newer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["later"] = {
        "type": "string"}
    assert lacking(newer) == []


async def test_an_older_crd_is_refused_naming_the_command_that_upgrades_it(cluster, kube):
    cluster.crd = crd_without(*LOOP_MEMORY)
    await kube.create(sdd_body("chat"))
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await wait_for(lambda: not op.thread.is_alive(), 20, "the operator to refuse and return")
    finally:
        await op.stop_and_join()
    assert isinstance(op.result, crd_check.OutdatedCRD), op.result
    message = str(op.result)
    assert UPGRADE in message and "helm upgrade does not apply" in message, message
    assert all(field in message for field in LOOP_MEMORY), message
    assert ("GET", OPENAPI) in cluster.log
    # nothing ran: no status written, no child made, no watch opened
    assert "status" not in cluster.live(API_VERSION, "specdecodedeployments", "default", "chat")
    assert cluster.all_live("apps/v1", "deployments") == []
    assert not [p for m, p in cluster.log if "specdecodedeployments" in p and m != "POST"]


async def test_the_current_crd_runs(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await kube.create(sdd_body("chat"))
        await wait_for(lambda: ready(cluster, "chat"), 20, "Ready")
        assert ("GET", OPENAPI) in cluster.log  # checked, and passed
    finally:
        await op.stop_and_join()
    assert op.result == 0


async def test_a_server_without_openapi_v3_gets_a_warning_and_a_running_operator(cluster, kube, caplog):
    cluster.openapi_v3 = False
    with caplog.at_level(logging.WARNING, logger=crd_check.log.name):
        op = OperatorThread(cluster.endpoint, "op-a").start()
        try:
            await kube.create(sdd_body("chat"))
            await wait_for(lambda: ready(cluster, "chat"), 20, "Ready")
        finally:
            await op.stop_and_join()
    assert op.result == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.name == crd_check.log.name]
    assert "cannot check the installed CRD" in warning and "not served" in warning and UPGRADE in warning


async def test_the_command_exits_non_zero_on_an_older_crd(cluster, tmp_path):
    """`specfleet operator` as the pod runs it: the exit status Kubernetes restarts it on, the
    command in its log."""
    cluster.crd = crd_without(*LOOP_MEMORY)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.endpoint)
    code = "import sys; from specfleet_operator.main import run; sys.exit(run(sys.argv[1:]))"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "--no-leader-election", "--metrics-port", "0",
        env={"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)  # an import of the operator: seconds, 4x slower
    text = out.decode()
    assert proc.returncode == crd_check.EXIT_CODE, text
    assert UPGRADE in text and "status.kCeilings" in text, text
