"""Level-triggered reconcile (specfleet_operator.converge) with the real kopf operator on the
emulator: a deleted child comes back, a hand edit of an owned field is reverted, what the operator
does not own is left alone, and its own writes cause no further writes."""
import asyncio
import copy
import json
import pathlib

import pytest
import yaml
from specfleet_api import fleet_spec
from specfleet_operator import API_VERSION, KIND, converge
from specfleet_operator import manifests as m
from specfleet_operator.kube import LAST_APPLIED, apply_patch
from specfleet_operator.spec import with_defaults
from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLURALS = {"ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments",
           "PodDisruptionBudget": "poddisruptionbudgets", "HorizontalPodAutoscaler": "horizontalpodautoscalers",
           "ServiceMonitor": "servicemonitors", "PrometheusRule": "prometheusrules",
           "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
           "NetworkPolicy": "networkpolicies"}
EVENTS_ONLY = {"converge_interval": 3600.0}  # the periodic converge out of the way: the watches act alone


def child(cluster, kind, name, ns="default"):
    api_version = next(a for a, k, _ in m.child_refs("x") if k == kind)
    return cluster.live(api_version, PLURALS[kind], ns, name)


def children(cluster, sdd):
    return {(k, n): obj for a, k, n in m.child_refs(sdd) if (obj := cluster.live(a, PLURALS[k], "default", n))}


async def started(cluster, kube, body, memo=EVENTS_ONLY):
    op = OperatorThread(cluster.endpoint, "op-a", memo=dict(memo)).start()
    await kube.create(body)
    await wait_for(lambda: ready(cluster, body["metadata"]["name"]), 20, "Ready")
    return op


def full_fleet():
    """Every child kind: canary, autoscaler, ServiceMonitor and PrometheusRule on."""
    body = yaml.safe_load((ROOT / "deploy" / "examples" / "draft-model.yaml").read_text())
    body["spec"]["canary"] = {"weight": 10}
    return body


async def test_ready_only_once_every_child_is_applied(cluster, kube):
    """The workers' Deployments report ready while the last child (the PrometheusRule, behind a slow
    admission) is still being created: Ready waits for it (CI once saw Ready with 16 of 17)."""
    cluster.create_delays["prometheusrules"] = 1.5
    op = await started(cluster, kube, full_fleet())
    try:
        kids = children(cluster, "smollm2-draft")
        assert len(kids) == 18, f"Ready with {sorted(kids)}"
    finally:
        await op.stop_and_join()


async def test_every_deleted_child_is_recreated(cluster, kube):
    op = await started(cluster, kube, full_fleet())
    try:
        kids = children(cluster, "smollm2-draft")
        assert {k for k, _ in kids} == set(PLURALS)
        for (kind, name), before in kids.items():
            api_version = before["apiVersion"]
            await kube.delete(api_version, kind, "default", name)
            back = await wait_for(lambda: (c := child(cluster, kind, name)) and c["metadata"]["uid"] != before[
                "metadata"]["uid"] and c, 10, f"{kind} {name} recreated")
            assert back["metadata"]["ownerReferences"] == before["metadata"]["ownerReferences"]
            assert apply_patch(back, json.loads(before["metadata"]["annotations"][LAST_APPLIED])) == {}
        assert set(children(cluster, "smollm2-draft")) == set(kids)
    finally:
        await op.stop_and_join()


async def test_a_worker_deployment_scaled_by_hand_is_scaled_back(cluster, kube):
    op = await started(cluster, kube, sdd_body("demo", replicas=2))
    try:
        await kube.patch("apps/v1", "Deployment", "default", "demo--stable", {"spec": {"replicas": 7}})
        await wait_for(lambda: child(cluster, "Deployment", "demo--stable")["spec"]["replicas"] == 2, 10,
                       "replicas back to 2")
    finally:
        await op.stop_and_join()


async def test_a_changed_container_image_and_args_are_reverted(cluster, kube):
    op = await started(cluster, kube, sdd_body("demo"))
    try:
        for deployment in ("demo--stable", "demo--router"):
            pod = child(cluster, "Deployment", deployment)["spec"]["template"]["spec"]
            container = copy.deepcopy(pod["containers"][0])
            edited = {**container, "image": "evil.example/worker:latest", "args": [*container.get("args", []), "--x"]}
            await kube.patch("apps/v1", "Deployment", "default", deployment,
                             {"spec": {"template": {"spec": {"containers": [edited]}}}})
            await wait_for(lambda: child(cluster, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
                           == [container], 10, f"{deployment} container restored")
    finally:
        await op.stop_and_join()


async def test_edited_configmap_data_is_reverted_and_a_stray_key_removed(cluster, kube):
    op = await started(cluster, kube, sdd_body("demo"))
    try:
        data = dict(child(cluster, "ConfigMap", "demo--engine")["data"])
        engine = json.loads(data["engine.json"])
        engine["speculation"]["kMax"] = 64
        await kube.patch("v1", "ConfigMap", "default", "demo--engine",
                         {"data": {"engine.json": json.dumps(engine), "extra.json": "{}"}})
        await wait_for(lambda: child(cluster, "ConfigMap", "demo--engine")["data"] == data, 10, "data restored")
    finally:
        await op.stop_and_join()


async def test_an_edited_service_selector_and_port_are_reverted(cluster, kube):
    op = await started(cluster, kube, sdd_body("demo"))
    try:
        for service in ("demo", "demo--stable"):
            spec = copy.deepcopy(child(cluster, "Service", service)["spec"])
            ports = [{**p, "port": p["port"] + 1} for p in spec["ports"]]
            await kube.patch("v1", "Service", "default", service, {"spec": {
                "selector": {**{k: "other" for k in spec["selector"]}, "app": "someone-else"}, "ports": ports}})
            await wait_for(lambda: {k: child(cluster, "Service", service)["spec"][k] for k in ("selector", "ports")}
                           == {k: spec[k] for k in ("selector", "ports")}, 10, f"Service {service} restored")
    finally:
        await op.stop_and_join()


async def test_an_owned_child_the_spec_no_longer_wants_is_removed(cluster, kube):
    """A canary Deployment brought back (a backup restored, a stale GitOps copy) after the canary
    left the spec is removed again; one that is not the operator's is left alone."""
    op = await started(cluster, kube, sdd_body("demo", canary={"weight": 10}))
    try:
        stale = copy.deepcopy(child(cluster, "Deployment", "demo--canary"))
        await kube.patch(API_VERSION, KIND, "default", "demo", {"spec": {"canary": None}})
        await wait_for(lambda: child(cluster, "Deployment", "demo--canary") is None, 10, "canary removed")
        await wait_for(lambda: ready(cluster, "demo"), 10, "Ready without a canary")
        for key in ("uid", "resourceVersion", "creationTimestamp", "generation"):
            stale["metadata"].pop(key)
        await kube.create(stale)
        await wait_for(lambda: child(cluster, "Deployment", "demo--canary") is None, 10, "restored canary removed")
        stale["metadata"]["ownerReferences"] = []  # someone else's, by the same name: not the operator's
        await kube.create(stale)
        await asyncio.sleep(1.0)
        assert child(cluster, "Deployment", "demo--canary") is not None
    finally:
        await op.stop_and_join()


async def test_what_the_operator_does_not_own_is_left_alone(cluster, kube):
    op = await started(cluster, kube, sdd_body("demo"), {"converge_interval": 0.2})
    try:
        note = {"metadata": {"annotations": {"team.example/owner": "search"}, "labels": {"team": "search"}}}
        await kube.patch("v1", "Service", "default", "demo--stable", note)
        await kube.patch("apps/v1", "Deployment", "default", "demo--stable", {
            **note, "spec": {"template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": "now"}}}}})
        await kube.patch("v1", "ConfigMap", "default", "demo--engine", note)
        writes = cluster.writes("PATCH", "/services/demo--stable") + cluster.writes("PATCH", "/configmaps/")
        deployment_writes = cluster.writes("PATCH", "/deployments/demo--stable")
        await asyncio.sleep(1.5)  # several periodic converges and the watches' checks
        assert cluster.writes("PATCH", "/services/demo--stable") + cluster.writes("PATCH", "/configmaps/") == writes
        assert cluster.writes("PATCH", "/deployments/demo--stable") == deployment_writes
        for kind, name in (("Service", "demo--stable"), ("Deployment", "demo--stable"), ("ConfigMap", "demo--engine")):
            meta = child(cluster, kind, name)["metadata"]
            assert meta["annotations"]["team.example/owner"] == "search" and meta["labels"]["team"] == "search"
        deployment = child(cluster, "Deployment", "demo--stable")
        assert deployment["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] == "now"
        assert deployment["status"]["readyReplicas"] == 1  # status is the Deployment controller's
    finally:
        await op.stop_and_join()


def writes(cluster):
    """The writes served so far, Events aside (kopf posts them from a queue, late)."""
    return [(v, p) for v, p in cluster.log if v in ("POST", "PATCH", "PUT", "DELETE") and "/events" not in p]


async def quiet(cluster, for_s=0.5, timeout=10.0):
    """Wait until no write has come for `for_s` seconds: the operator has done what it does."""
    seen, since = len(writes(cluster)), asyncio.get_running_loop().time()
    deadline = since + timeout
    while (now := asyncio.get_running_loop().time()) - since < for_s:
        assert now < deadline, f"still writing after {timeout}s: {writes(cluster)[-5:]}"
        if len(writes(cluster)) != seen:
            seen, since = len(writes(cluster)), now
        await asyncio.sleep(0.05)


async def test_the_operators_own_writes_end_there(cluster, kube):
    """A converge that finds nothing to do writes nothing: no reconcile loop feeding on its events."""
    op = await started(cluster, kube, full_fleet(), {"converge_interval": 0.2})
    try:
        await quiet(cluster)  # the create's trailing status writes
        reads, before = len(cluster.log), writes(cluster)
        await asyncio.sleep(1.5)  # several periodic converges
        assert writes(cluster) == before, writes(cluster)[len(before):]
        assert len(cluster.log) > reads  # the periodic converge did read
        await kube.patch("apps/v1", "Deployment", "default", "smollm2-draft--router", {"spec": {"replicas": 9}})
        await wait_for(lambda: child(cluster, "Deployment", "smollm2-draft--router")["spec"]["replicas"] == 2, 10,
                       "router replicas restored")
        await quiet(cluster)
        settled = writes(cluster)
        await asyncio.sleep(1.5)
        assert writes(cluster) == settled, writes(cluster)[len(settled):]
    finally:
        await op.stop_and_join()


async def test_an_autoscaled_deployments_replicas_are_the_autoscalers(cluster, kube):
    """Under spec.scaling the HPA moves the stable workers' replicas: the operator sets none, so a
    converge never fights it."""
    op = await started(cluster, kube, full_fleet(), {"converge_interval": 0.2})
    try:
        await kube.patch("apps/v1", "Deployment", "default", "smollm2-draft--stable", {"spec": {"replicas": 5}})
        await asyncio.sleep(1.5)  # several periodic converges
        assert child(cluster, "Deployment", "smollm2-draft--stable")["spec"]["replicas"] == 5
        assert not [e for e in cluster.all_live("v1", "events") if e.get("reason") == "Converged"]  # not drift
    finally:
        await op.stop_and_join()


async def test_the_periodic_converge_repairs_what_no_watch_saw(cluster, kube):
    """A child stripped of the fleet's managed-by label drops out of the label-filtered watch: only
    the periodic converge sees that it was also scaled, and restores both."""
    op = await started(cluster, kube, sdd_body("demo", replicas=2), {"converge_interval": 0.3})
    try:
        label = "app.kubernetes.io/managed-by"
        await kube.patch("apps/v1", "Deployment", "default", "demo--stable",
                         {"metadata": {"labels": {label: None}}, "spec": {"replicas": 5}})
        await wait_for(lambda: (d := child(cluster, "Deployment", "demo--stable"))["spec"]["replicas"] == 2
                       and d["metadata"]["labels"].get(label) == m.MANAGED_BY, 10, "replicas and label restored")
        (event, *_) = await wait_for(lambda: [e for e in cluster.all_live("v1", "events") if e.get(
            "reason") == "Converged"], 10, "Converged event")
        assert "Deployment demo--stable edited" in event["message"] and "spec.replicas" in event["message"]
    finally:
        await op.stop_and_join()


async def test_children_converge_to_the_loops_memory_and_stay_there(cluster, kube):
    """The loop keeps its memory in the status: converge derives the children from it as reconcile
    does, so a whole-deployment fallback there is what control.json says, and nothing flaps."""
    from specfleet_control.loop import DEPLOYMENT, Memory
    from specfleet_control.slo import FALLBACK, KeyState
    op = await started(cluster, kube, sdd_body("demo"), {"converge_interval": 0.2})
    try:
        control = lambda: json.loads(child(cluster, "ConfigMap", "demo--engine")["data"][m.CONTROL_KEY])
        assert control()["speculate"] is True
        memory = Memory({DEPLOYMENT: KeyState(mode=FALLBACK, since=1.0, reason="alpha 0.02 < floor")})
        await kube.patch(API_VERSION, KIND, "default", "demo", {"status": {"slo": memory.to_status()}},
                         subresource="status")
        spec = with_defaults(sdd_body("demo")["spec"])
        off = fleet_spec.live_state(spec, fleet_spec.FleetState(mode=FALLBACK))  # the probes keep the K bounds
        assert off.k["stable"].k_max > 0
        await wait_for(lambda: control() == {"speculate": False, "kMin": off.k["stable"].k_min,
                                             "kMax": off.k["stable"].k_max}, 10, "control.json off")
        await asyncio.sleep(0.5)
        writes = cluster.writes("PATCH", "/configmaps/demo--engine")
        await asyncio.sleep(1.5)  # several periodic converges
        assert cluster.writes("PATCH", "/configmaps/demo--engine") == writes and control()["speculate"] is False
    finally:
        await op.stop_and_join()


def test_every_watched_kind_may_be_listed_and_watched():
    """The watches need list and watch on every child kind (deploy/base, and the chart, which a
    test holds equal to it)."""
    rules = [r for d in yaml.safe_load_all((ROOT / "deploy" / "base" / "rbac.yaml").read_text())
             if d["kind"] == "ClusterRole" for r in d["rules"]]
    for api_version, kind in converge.CHILD_KINDS:
        group = api_version.rpartition("/")[0]
        assert any(group in r["apiGroups"] and PLURALS[kind] in r["resources"]
                   and {"list", "watch"} <= set(r["verbs"]) for r in rules), f"{kind}: no list, watch"


@pytest.mark.parametrize("live, desired, patch", [
    ({"spec": {"replicas": 5, "paused": False}}, {"spec": {"replicas": 2}}, {"spec": {"replicas": 2}}),
    ({"spec": {"selector": {"a": "1", "b": "2"}}}, {"spec": {"selector": {"a": "1"}}}, {"spec": {"selector": {"b": None}}}),
    ({"metadata": {"annotations": {"mine": "x"}}, "data": {"k": "v"}}, {"metadata": {}, "data": {"k": "v"}}, {}),
    ({"spec": {"ports": [{"port": 80, "protocol": "TCP"}]}}, {"spec": {"ports": [{"port": 80}]}}, {}),
    # the API server's canonical quantities are no drift (else every converge would patch them)
    ({"c": [{"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}]},
     {"c": [{"resources": {"requests": {"cpu": 0.5, "memory": "1024Mi"}}}]}, {}),
    ({"c": [{"resources": {"limits": {"cpu": "2"}}}]}, {"c": [{"resources": {"limits": {"cpu": "1"}}}]},
     {"c": [{"resources": {"limits": {"cpu": "1"}}}]}),
    ({"c": [{"image": "1000m"}]}, {"c": [{"image": "1"}]}, {"c": [{"image": "1"}]}),  # quantities only there
])
def test_apply_patch_owns_the_desired_fields_and_whole_selectors(live, desired, patch):
    assert apply_patch(live, desired) == patch


def test_a_child_maps_to_its_owner_by_reference_before_label():
    ref = {"kind": KIND, "apiVersion": API_VERSION, "name": "x" * 80, "uid": "u"}
    body = {"metadata": {"ownerReferences": [ref], "labels": {m.LABEL_SDD: m.label_value("x" * 80)}}}
    assert converge.owner_name(body) == "x" * 80
    assert converge.owner_name({"metadata": {"labels": {m.LABEL_SDD: "short"}}}) == "short"
