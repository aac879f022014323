"""What the chart lets the operator do, and where: every namespace (a ClusterRole) or only the
listed ones (Roles there, nothing cluster-wide), read as one table of grants per mode."""
import pathlib

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from specfleet_operator.main import operator_settings, parse_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specfleet"
NS = "specfleet-system"
SA = ("ServiceAccount", "specfleet", NS)
CRUD = frozenset({"get", "list", "watch", "create", "patch", "delete"})
READ = frozenset({"get", "list", "watch"})
# What the operator does in each namespace it watches: (API group, resource) -> verbs.
IN_A_WATCHED_NAMESPACE = {
    ("serving.specfleet.dev", "specdecodedeployments"): frozenset({"get", "list", "watch", "patch"}),
    ("serving.specfleet.dev", "specdecodedeployments/status"): frozenset({"get", "patch"}),
    ("apps", "deployments"): CRUD,
    ("", "services"): CRUD, ("", "configmaps"): CRUD, ("", "serviceaccounts"): CRUD,
    ("rbac.authorization.k8s.io", "roles"): CRUD, ("rbac.authorization.k8s.io", "rolebindings"): CRUD,
    ("discovery.k8s.io", "endpointslices"): READ,
    ("policy", "poddisruptionbudgets"): CRUD,
    ("autoscaling", "horizontalpodautoscalers"): CRUD,
    ("monitoring.coreos.com", "servicemonitors"): CRUD, ("monitoring.coreos.com", "prometheusrules"): CRUD,
    ("networking.k8s.io", "networkpolicies"): CRUD,
    ("", "events"): frozenset({"create"}),
    # each fleet's Redis user goes in a Secret the operator creates and never reads, edits or deletes
    ("", "secrets"): frozenset({"create"}),
}
LEASES = {("coordination.k8s.io", "leases"): frozenset({"get", "create", "patch"})}
CRDS = {("apiextensions.k8s.io", "customresourcedefinitions"): frozenset({"list", "watch"})}


def render(values):
    out = helm.Chart.load(str(CHART)).render(values, name="specfleet", namespace=NS, is_install=True)
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def grants(docs):
    """{where: {(group, resource): verbs}} for the operator's ServiceAccount, where "*" is every
    namespace; each binding is followed to the role it names, as the API server does."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d["rules"]
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out = {}
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any((s["kind"], s["name"], s.get("namespace")) == SA for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        where = b["metadata"]["namespace"] if b["kind"] == "RoleBinding" else "*"
        rules = roles[(ref["kind"], where if ref["kind"] == "Role" else None, ref["name"])]
        table = out.setdefault(where, {})
        for rule in rules:
            assert "resourceNames" not in rule and "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    table[(group, resource)] = table.get((group, resource), frozenset()) | set(rule["verbs"])
    return out


def test_cluster_wide_mode_is_one_cluster_role_with_exactly_what_the_operator_does():
    docs = render({})
    assert grants(docs) == {"*": {**CRDS, **IN_A_WATCHED_NAMESPACE}, NS: LEASES}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    options = parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert options.namespaces == () and operator_settings(options).scanning.disabled is False


@pytest.mark.parametrize("namespaces", [["team-a"], ["team-a", "team-b"], [NS, "team-c"]])
def test_namespaced_mode_grants_roles_in_the_listed_namespaces_and_nothing_cluster_wide(namespaces):
    docs = render({"watchNamespaces": namespaces})
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    expected = {ns: dict(IN_A_WATCHED_NAMESPACE) for ns in namespaces}
    expected.setdefault(NS, {}).update(LEASES)
    assert grants(docs) == expected
    for doc in docs:
        if doc["kind"] != "PrometheusRule":
            kubernetes_validate.validate(doc, "1.30", strict=True)
    # the operator watches those namespaces, and with no right to watch CRDs or Namespaces, kopf
    # must not try (it finds the CRD once at start through API discovery)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    options = parse_args(args)
    assert options.namespaces == tuple(namespaces)
    assert operator_settings(options).scanning.disabled is True


def test_without_leader_election_there_is_no_lease_role_and_secrets_are_opt_in():
    docs = render({"replicaCount": 1, "leaderElection": {"enabled": False}, "watchNamespaces": ["team-a"]})
    assert grants(docs) == {"team-a": IN_A_WATCHED_NAMESPACE}
    docs = render({"watchNamespaces": ["team-a"], "router": {"readRedisSecrets": True}})
    assert grants(docs)["team-a"][("", "secrets")] == {"create"}  # the read is granted per Secret, not here
    assert grants(render({}))["*"][("", "secrets")] == {"create"}
    assert ("", "secrets") not in grants(render({"redis": {"enabled": False}}))["*"]  # no Redis, no users
    external = render({"redis": {"enabled": False, "external": {"url": "redis://r:6379/0"}}})
    assert grants(external)["*"][("", "secrets")] == {"create"}


def test_rbac_create_false_renders_no_rbac():
    docs = render({"rbac": {"create": False}, "watchNamespaces": ["team-a"]})
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io")]


async def test_a_namespaced_operator_reconciles_only_its_namespaces(cluster, kube):
    """The real operator with `--namespace team-a` (kopf's scanning off, as in namespaced mode)
    finds the CRD and serves team-a; a fleet in team-b is never touched."""
    import dataclasses

    from specfleet_operator.manifests import child_name
    from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for

    op = OperatorThread(cluster.endpoint, "op-ns")
    op.options = dataclasses.replace(op.options, namespaces=("team-a",))
    assert operator_settings(op.options).scanning.disabled
    op.start()
    try:
        await kube.create(sdd_body("outside", namespace="team-b"))
        await kube.create(sdd_body("first", namespace="team-a"))
        await wait_for(lambda: ready(cluster, "first", "team-a"), 20, "team-a/first Ready")
        # a second fleet in team-a, created after the one in team-b, is served too: by then the
        # one in team-b has waited through two reconciles
        await kube.create(sdd_body("second", namespace="team-a"))
        await wait_for(lambda: ready(cluster, "second", "team-a"), 20, "team-a/second Ready")
        outside = cluster.live("serving.specfleet.dev/v1alpha1", "specdecodedeployments", "team-b", "outside")
        assert "status" not in outside and not outside["metadata"].get("finalizers")
        assert cluster.live("apps/v1", "deployments", "team-b", child_name("outside", "stable")) is None
        assert cluster.live("apps/v1", "deployments", "team-a", child_name("first", "stable")) is not None
    finally:
        await op.stop_and_join()
    assert op.result == 0
