"""An upgrade from the children's names of before moves each PodDisruptionBudget without ever
having two over one pod set (Kubernetes evicts no pod two budgets cover: a drain, and a rollout
without spare capacity, would stall), while the old workers serve until the fleet is Ready.
The real operator on the emulator, whose record of creates and deletes is replayed."""
from specfleet_operator import manifests as m
from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for

PDBS = "poddisruptionbudgets"


def overlap(a, b):
    """Whether some pod matches both matchLabels selectors (no key they share differs)."""
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def moved_said(cluster):
    """The messages of the events that say a budget was moved ahead of its successor."""
    return [e["message"] for e in cluster.all_live("v1", "events")
            if "two PodDisruptionBudgets" in e.get("message", "")]


def budget_history(cluster):
    """Each create or delete of a PodDisruptionBudget with the budgets live after it, by name."""
    live, out = {}, []
    for verb, plural, _, name, obj in cluster.changes:
        if plural != PDBS:
            continue
        if verb == "create":
            live[name] = obj["spec"]["selector"]["matchLabels"]
        else:
            live.pop(name)
        out.append((verb, name, dict(live)))
    return out


async def test_an_upgrade_moves_each_budget_without_two_over_one_pod_set(cluster, kube):
    created = await kube.create(sdd_body("demo", replicas=2))
    owner = m.owner_reference(created)
    predecessors = m.legacy_predecessors("demo")
    assert set(predecessors) == {("PodDisruptionBudget", "demo--stable"), ("PodDisruptionBudget", "demo--router")}
    # the children as the operator of before made them: the same budgets (and workers) under the old names
    for component in ("worker", "router"):
        budget = m.pod_disruption_budget(created, component)
        _, _, old = predecessors[("PodDisruptionBudget", budget["metadata"]["name"])]
        budget["metadata"].update(name=old, ownerReferences=[owner])
        await kube.create(budget)
    for old in ("demo-stable", "demo-router"):
        await kube.create({"apiVersion": "apps/v1", "kind": "Deployment",
                           "metadata": {"name": old, "namespace": "default", "ownerReferences": [owner]},
                           "spec": {"replicas": 2}})
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await wait_for(lambda: ready(cluster, "demo"), 20, "Ready")
        await wait_for(lambda: not cluster.live("apps/v1", "deployments", "default", "demo-stable"), 10,
                       "the old workers retired")
        await wait_for(lambda: all(any(f"PodDisruptionBudget {old} " in s for s in moved_said(cluster))
                                   for old in ("demo-stable", "demo-router")), 10, "an event for each budget moved")
    finally:
        await op.stop_and_join()

    history = budget_history(cluster)
    for verb, name, live in history:
        pairs = [(a, b) for a in live for b in live if a < b and overlap(live[a], live[b])]
        assert not pairs, f"after the {verb} of {name}, {pairs} select one pod set: {[h[:2] for h in history]}"
    assert [(verb, name) for verb, name, _ in history] == [
        ("create", "demo-stable"), ("create", "demo-router"),
        ("delete", "demo-stable"), ("create", "demo--stable"), ("delete", "demo-router"), ("create", "demo--router")]
    # exactly one budget per pod set, the new one, over what the old one covered
    budgets = {b["metadata"]["name"]: b["spec"]["selector"]["matchLabels"] for b in cluster.all_live("policy/v1", PDBS)}
    assert budgets == {"demo--stable": m.selector("demo", "stable"),
                       "demo--router": m.selector("demo", component="router")}
    # only the budgets moved early: the old workers still served when the new budgets came
    order = [(verb, plural, name) for verb, plural, _, name, _ in cluster.changes]
    assert order.index(("create", PDBS, "demo--stable")) < order.index(("delete", "deployments", "demo-stable"))
    assert order.index(("create", PDBS, "demo--router")) < order.index(("delete", "deployments", "demo-router"))
