"""A `helm upgrade` that changes the built-in Redis' persistence is refused with what to do instead:
the real Helm engine renders cluster-aware (helm_python's Config.render, whose `lookup` asks the API
server) against the emulated cluster holding the StatefulSet an earlier release made."""
import asyncio
import pathlib

import aiohttp
import helm_python as helm
import pytest
import yaml

from specfleet_operator.testing import Cluster

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "specfleet"
NS = "specfleet-system"
NAME = "specfleet-redis"
CLAIM = f"data-{NAME}-0"


def documents(out: dict[str, str]) -> list[dict]:
    return [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]


def statefulset(values: dict) -> dict:
    """The Redis StatefulSet `helm install` makes (offline: nothing to look up)."""
    out = helm.Chart.load(str(CHART)).render(values, name="specfleet", namespace=NS, is_install=True)
    (sts,) = [d for d in documents(out) if d["kind"] == "StatefulSet"]
    return sts


def kubeconfig(cluster: Cluster) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": cluster.endpoint}}],
        "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "nobody"}}]})


async def installed(cluster: Cluster, values: dict) -> dict:
    """The StatefulSet the chart made for `values`, stored in the cluster as `helm install` would."""
    sts = statefulset(values)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{cluster.endpoint}/apis/apps/v1/namespaces/{NS}/statefulsets", json=sts) as resp:
            assert resp.status < 300, await resp.text()
    return sts


async def upgrade(cluster: Cluster, values: dict) -> dict[str, str]:
    """`helm upgrade`'s render: lookup sees the cluster (the Helm client blocks: off the loop that
    serves the emulator)."""
    def run():
        with helm.Config(kubeconfig_content=kubeconfig(cluster), namespace=NS) as config, \
                helm.Chart.load(str(CHART)) as chart:
            return config.render(chart, values, name="specfleet", namespace=NS, is_install=False, is_upgrade=True)
    return await asyncio.to_thread(run)


def persistence(**kw):
    return {"redis": {"persistence": kw}}


OFF, ON = persistence(enabled=False), persistence(enabled=True, size="1Gi")


@pytest.mark.parametrize("before, after, says", [
    (OFF, ON, ["has no claim (persistence off)", "ask for a claim of 1Gi in the default StorageClass",
               f"kubectl -n {NS} delete statefulset {NAME} --cascade=orphan", "then run helm upgrade again"]),
    (ON, OFF, ["has a claim of 1Gi", "ask for no claim", f"delete pvc {CLAIM}", "--cascade=orphan"]),
    (ON, persistence(enabled=True, size="1Gi", storageClass="fast"),
     ['ask for a claim of 1Gi in StorageClass "fast"', f"delete pvc {CLAIM}", "--cascade=orphan"]),
    (ON, persistence(enabled=True, size="5Gi"),
     ["has a claim of 1Gi", "ask for a claim of 5Gi", f"kubectl -n {NS} patch pvc {CLAIM}", '"storage":"5Gi"',
      "must allow volume expansion", f"delete statefulset {NAME} --cascade=orphan", "cannot shrink"]),
])
async def test_a_persistence_change_is_refused_with_what_to_do(cluster, before, after, says):
    await installed(cluster, before)
    with pytest.raises(helm.HelmError) as refused:
        await upgrade(cluster, after)
    message = str(refused.value)
    assert "volumeClaimTemplates are immutable" in message and 'docs/redis.md, "Changing persistence"' in message
    for part in says:
        assert part in message, (part, message)


@pytest.mark.parametrize("before, after", [
    (OFF, OFF), (ON, ON),
    (OFF, persistence(enabled=False, size="2Gi")),  # an emptyDir's limit: in the pod template, which may change
    (persistence(enabled=True, size="1024Mi", storageClass="fast"),  # the same size, written otherwise
     persistence(enabled=True, size="1Gi", storageClass="fast")),
])
async def test_an_upgrade_that_keeps_the_claim_renders(cluster, before, after):
    await installed(cluster, before)
    out = await upgrade(cluster, {**after, "redis": {**after["redis"], "maxMemory": "150mb"}})
    (sts,) = [d for d in documents(out) if d["kind"] == "StatefulSet"]
    assert sts["metadata"]["name"] == NAME
    assert ("volumeClaimTemplates" in sts["spec"]) == after["redis"]["persistence"]["enabled"]


async def test_install_and_template_have_nothing_to_look_up(cluster):
    """No StatefulSet yet (install, or `helm template`, which looks nothing up): any persistence renders."""
    for values in (OFF, ON, persistence(enabled=True, size="5Gi", storageClass="fast")):
        (sts,) = [d for d in documents(await upgrade(cluster, values)) if d["kind"] == "StatefulSet"]
        assert sts["metadata"]["name"] == NAME and statefulset(values)["metadata"]["name"] == NAME
    assert ("GET", f"/apis/apps/v1/namespaces/{NS}/statefulsets/{NAME}") in cluster.log  # it did look
