"""Fleets in one namespace keep to their own children, with the real kopf operator on the emulator:
names that once collided (`llama`, `llama-canary`, `llama-stable`), a child's name already taken
by another owner's object, and the children an upgrade finds under the names of before."""
import asyncio

from specfleet_operator import API_VERSION, KIND
from specfleet_operator import manifests as m
from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for

PLURALS = {"ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments",
           "PodDisruptionBudget": "poddisruptionbudgets", "ServiceAccount": "serviceaccounts", "Role": "roles",
           "RoleBinding": "rolebindings", "HorizontalPodAutoscaler": "horizontalpodautoscalers",
           "ServiceMonitor": "servicemonitors", "PrometheusRule": "prometheusrules",
           "NetworkPolicy": "networkpolicies"}
SDDS = "specdecodedeployments"
FAST_CONVERGE = {"converge_interval": 0.3}  # a converge of every fleet every 0.3 s: a storm would show
FOREIGN = {"apiVersion": "helm.example/v1", "kind": "Release", "name": "web", "uid": "uid-of-web", "controller": True}


def live_children(cluster, name):
    return {(k, n): obj for a, k, n in m.child_refs(name) if (obj := cluster.live(a, PLURALS[k], "default", n))}


def child_writes(cluster):
    """The PATCHes and PUTs of children (not of the resources' status, nor events)."""
    return [(v, p) for v, p in cluster.log if v in ("PATCH", "PUT") and f"/{SDDS}/" not in p and "/events" not in p]


def condition(cluster, name, ctype="Ready"):
    sdd = cluster.live(API_VERSION, SDDS, "default", name) or {}
    return next((c for c in (sdd.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)


def events(cluster, reason):
    return [e for e in cluster.all_live("v1", "events") if e.get("reason") == reason]


async def test_fleets_named_like_each_others_children_keep_to_their_own(cluster, kube):
    """`llama-canary`'s front Service was `llama`'s canary arm and `llama-stable`'s its stable arm:
    each reconcile took them over from the other (selectors and owners flipping, 20 PATCHes in
    10 s, all Ready), and deleting `llama-canary` deleted `llama`'s canary Service."""
    names = ("llama", "llama-canary", "llama-stable")
    op = OperatorThread(cluster.endpoint, "op-a", memo=dict(FAST_CONVERGE)).start()
    try:
        for name in names:
            await kube.create(sdd_body(name, canary={"weight": 5}))
        for name in names:
            await wait_for(lambda: ready(cluster, name), 20, f"{name} Ready")
        uids = {n: cluster.live(API_VERSION, SDDS, "default", n)["metadata"]["uid"] for n in names}
        await asyncio.sleep(1.0)  # the first applies settle (the status writes of the Deployments' events)
        before = len(child_writes(cluster))
        await asyncio.sleep(2.0)  # about six converges of each fleet
        assert child_writes(cluster)[before:] == [], "the fleets keep rewriting their children"
        kids = {}
        for name in names:
            kids[name] = live_children(cluster, name)
            assert len(kids[name]) == 15, sorted(kids[name])  # with the canary, no monitoring, no HPA
            for (kind, child), obj in kids[name].items():
                assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uids[name]], (name, kind, child)
                assert obj["metadata"]["labels"][m.LABEL_SDD] == name
                if kind == "Service":
                    assert obj["spec"]["selector"][m.LABEL_SDD] == name
        assert kids["llama"][("Service", "llama")]["spec"]["selector"][m.LABEL_COMPONENT] == "router"
        assert kids["llama-canary"][("Service", "llama-canary")]["spec"]["selector"][m.LABEL_COMPONENT] == "router"

        await kube.delete(API_VERSION, KIND, "default", "llama-canary")
        await wait_for(lambda: cluster.live(API_VERSION, SDDS, "default", "llama-canary") is None, 20, "deleted")
        assert live_children(cluster, "llama-canary") == {}
        for name in ("llama", "llama-stable"):
            after = live_children(cluster, name)
            assert {k: o["metadata"]["uid"] for k, o in after.items()} == \
                {k: o["metadata"]["uid"] for k, o in kids[name].items()}, name
    finally:
        await op.stop_and_join()


async def test_a_child_name_held_by_another_owner_is_left_alone_and_said(cluster, kube):
    """The front Service's name is taken by an object another controller owns: not patched (not
    adopted), Ready False saying whose it is, one Event; once it is gone the fleet gets its own."""
    theirs = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "demo", "namespace": "default", "ownerReferences": [FOREIGN],
                           "labels": {"app": "web"}},
              "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80}]}}
    await kube.create(theirs)
    before = cluster.live("v1", "services", "default", "demo")
    op = OperatorThread(cluster.endpoint, "op-a", memo=dict(FAST_CONVERGE)).start()
    try:
        await kube.create(sdd_body("demo"))
        cond = await wait_for(lambda: (c := condition(cluster, "demo")) and c["reason"] == "ChildOwnedByAnother" and c,
                              20, "Ready False, ChildOwnedByAnother")
        assert cond["status"] == "False"
        assert "Service demo" in cond["message"] and "Release web" in cond["message"], cond["message"]
        assert condition(cluster, "demo", "Degraded")["reason"] == "ChildOwnedByAnother"
        await wait_for(lambda: cluster.live("apps/v1", "deployments", "default", "demo--router"), 10, "the router")
        await wait_for(lambda: events(cluster, "ChildOwnedByAnother"), 10, "the event")
        for generation, replicas in ((2, 2), (3, 1)):  # reconciles of new generations find the same child held
            await kube.patch(API_VERSION, KIND, "default", "demo", {"spec": {"replicas": replicas}})
            await wait_for(lambda: (c := condition(cluster, "demo")) and c["reason"] == "ChildOwnedByAnother"
                           and c["observedGeneration"] == generation, 10, f"generation {generation} reconciled")
        await asyncio.sleep(2.0)  # converges and status writes: none patches it, none posts again
        assert cluster.writes("PATCH", "/services/demo") - cluster.writes("PATCH", "/services/demo--") == 0
        assert cluster.live("v1", "services", "default", "demo") == before
        assert len(events(cluster, "ChildOwnedByAnother")) == 1
        assert condition(cluster, "demo")["reason"] == "ChildOwnedByAnother"  # status refreshes keep saying it

        await kube.delete("v1", "Service", "default", "demo")
        await wait_for(lambda: ready(cluster, "demo"), 20, "Ready once the name is free")
        ours = cluster.live("v1", "services", "default", "demo")
        assert ours["metadata"]["ownerReferences"][0]["kind"] == KIND
        assert ours["spec"]["selector"] == m.selector("demo", component="router")
    finally:
        await op.stop_and_join()


async def test_an_upgrade_retires_the_children_named_as_before_once_the_new_ones_serve(cluster, kube):
    """An operator of before made `demo-stable`, `demo-router`, ...: they serve until the children
    under the current names are ready, then go; one of those names held by another owner stays."""
    cluster.ready_delay = 3.0
    created = await kube.create(sdd_body("demo"))
    owner = m.owner_reference(created)
    old = {("Deployment", "demo-stable"), ("Deployment", "demo-router"), ("Service", "demo-stable"),
           ("ConfigMap", "demo-engine"), ("ServiceAccount", "demo-router"), ("PodDisruptionBudget", "demo-stable")}
    versions = {k: a for a, k, _ in m.child_refs("x")}
    for kind, name in old:
        await kube.create({"apiVersion": versions[kind], "kind": kind,
                           "metadata": {"name": name, "namespace": "default", "ownerReferences": [owner]}})
    await kube.create({"apiVersion": "v1", "kind": "Service",  # a name of before, now another's
                       "metadata": {"name": "demo-canary", "namespace": "default", "ownerReferences": [FOREIGN]}})
    assert {(k, n) for _, k, n in m.legacy_child_refs("demo")} >= old | {("Service", "demo-canary")}
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await wait_for(lambda: (c := condition(cluster, "demo")) and c["reason"] in ("WorkersNotReady", "RouterNotReady"),
                       10, "a status written while the new workers or router start")
        await asyncio.sleep(1.0)  # what that status write does after it, it has done
        assert not ready(cluster, "demo") and cluster.live("apps/v1", "deployments", "default", "demo--stable")
        assert cluster.live("apps/v1", "deployments", "default", "demo-stable") is not None  # still serving
        await wait_for(lambda: ready(cluster, "demo"), 20, "Ready")
        await wait_for(lambda: all(cluster.live(versions[k], PLURALS[k], "default", n) is None for k, n in old),
                       10, "the old children gone")
        assert cluster.live("v1", "services", "default", "demo-canary") is not None
        assert len(live_children(cluster, "demo")) == 12
        (event,) = await wait_for(lambda: [e for e in events(cluster, "Removed") if "before the upgrade" in e["message"]],
                                  10, "the Removed event")  # kopf posts events after the handler returns
        assert "Deployment demo-router" in event["message"]
    finally:
        await op.stop_and_join()
