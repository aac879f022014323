"""What the operator may do with Secrets, read off every Role the chart and the kustomize base can
render (and the one the operator writes for its routers) with an RBAC rule matcher, as the API server
matches rules: no read, list, watch, edit or delete of any Secret, in every mode and value set;
`create` only where fleets get Redis users, and held by the chart's admission policy (its CEL
evaluated here) to the credentials Secrets the operator makes: never a service-account token."""
import itertools
import pathlib

import celpy
import celpy.celtypes as ct
import helm_python as helm
import pytest
import yaml

from specfleet_operator import manifests
from specfleet_operator.redis_state import credentials_objects
from specfleet_operator.testing import sdd_body

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specfleet"
NS = "specfleet-system"
OPERATOR = f"system:serviceaccount:{NS}:specfleet"
#: Verbs whose answer carries a Secret's data, or that change or remove one someone else holds.
NEVER = ("get", "list", "watch", "patch", "update", "delete", "deletecollection")
#: What would let the operator act as more than it is (mint tokens, impersonate, grant what it lacks).
ESCALATIONS = [("", "serviceaccounts/token", "create"), ("", "pods/exec", "create"), ("", "users", "impersonate"),
               ("", "serviceaccounts", "impersonate"), ("rbac.authorization.k8s.io", "roles", "escalate"),
               ("rbac.authorization.k8s.io", "roles", "bind"), ("rbac.authorization.k8s.io", "clusterroles", "bind"),
               ("certificates.k8s.io", "certificatesigningrequests", "create")]


def value_sets():
    """Every value set worth a look: the chart's CI files and the product of the switches that
    change RBAC (mode, Redis, the opt-in read of spec.redis.secretRef, leader election)."""
    out = [("ci/" + p.name, yaml.safe_load(p.read_text()) or {}) for p in sorted((CHART / "ci").glob("*.yaml"))]
    modes = {"cluster-wide": {}, "one namespace": {"watchNamespaces": ["team-a"]},
             "with the release's": {"watchNamespaces": [NS, "team-c"]}}
    redis = {"built-in": {}, "external": {"redis": {"enabled": False, "external": {"url": "redis://r:6379/0"}}},
             "none": {"redis": {"enabled": False}}}
    for (m, mode), (r, red), read, leader in itertools.product(modes.items(), redis.items(), (False, True), (True, False)):
        values = {**mode, **red, "router": {"readRedisSecrets": read}}
        if not leader:
            values.update(replicaCount=1, leaderElection={"enabled": False})
        out.append((f"{m}, {r} Redis, readRedisSecrets={read}, leader election={leader}", values))
    return out


def render(values):
    out = helm.Chart.load(str(CHART)).render(values, name="specfleet", namespace=NS, is_install=True)
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def kustomize_base():
    return [d for p in sorted((ROOT / "deploy" / "base").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d and "kind" in d]


def _match(values, wanted):
    return "*" in values or wanted in values


def allows(rule, verb, group, resource, name=None):
    """Whether one PolicyRule admits the request, as RBAC's rule matcher does (wildcards,
    subresources named `resource/sub`, resourceNames, which never narrow list, watch or create)."""
    if "nonResourceURLs" in rule:
        return False
    if not (_match(rule.get("verbs", []), verb) and _match(rule.get("apiGroups", []), group)):
        return False
    base = resource.split("/", 1)[0]
    resources = rule.get("resources", [])
    if not (_match(resources, resource) or (resource != base and f"{base}/*" in resources)):
        return False
    names = rule.get("resourceNames")
    return not names or (name is not None and name in names)


def bound_rules(docs):
    """[(who, where, rule)] for every subject of every binding in `docs`, following its roleRef."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d.get("rules") or []
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out = []
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = b["roleRef"]
        where = b["metadata"].get("namespace", "*") if b["kind"] == "RoleBinding" else "*"
        rules = roles.get((ref["kind"], b["metadata"].get("namespace") if ref["kind"] == "Role" else None, ref["name"]))
        assert rules is not None, f"{b['kind']} {b['metadata']['name']} binds a role the chart does not render"
        for s in b.get("subjects") or []:
            who = f"system:serviceaccount:{s.get('namespace', where)}:{s['name']}" if s["kind"] == "ServiceAccount" \
                else f"{s['kind']}:{s['name']}"
            out += [(who, where, rule) for rule in rules]
    # a ClusterRole aggregated into the built-in admin/edit/view would grant to whoever holds those
    assert not [d for d in docs if d["kind"] == "ClusterRole" and any(
        "aggregate-to" in k for k in (d["metadata"].get("labels") or {}))]
    return out


def secret_verbs(rules):
    return {verb for verb in (*NEVER, "create") for (_, _, rule) in rules if allows(rule, verb, "", "secrets", "any")}


@pytest.mark.parametrize("label, values", value_sets(), ids=[label for label, _ in value_sets()])
def test_no_role_the_chart_renders_reads_or_edits_a_secret(label, values):
    docs = render(values)
    rules = bound_rules(docs)
    assert rules, "no binding rendered"
    for verb in NEVER:
        found = [(who, where, rule) for who, where, rule in rules if allows(rule, verb, "", "secrets", "any")]
        assert not found, f"{label}: {verb} on secrets granted: {found}"
    for group, resource, verb in ESCALATIONS:
        assert not [r for _, _, r in rules if allows(r, verb, group, resource, "any")], (label, verb, resource)
    red = values.get("redis") or {}
    users = red.get("enabled", True) or bool((red.get("external") or {}).get("url"))
    operator = [r for who, _, r in rules if who == OPERATOR]
    assert secret_verbs([(None, None, r) for r in operator]) == ({"create"} if users else set()), label
    if users and (values.get("rbac") or {}).get("create", True):
        policy = {d["kind"]: d for d in docs if d["apiVersion"].startswith("admissionregistration.k8s.io/")}
        assert set(policy) == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}, label
        assert policy["ValidatingAdmissionPolicyBinding"]["spec"]["policyName"] == \
            policy["ValidatingAdmissionPolicy"]["metadata"]["name"]


def test_the_kustomize_base_and_the_routers_role_touch_no_secret():
    assert secret_verbs(bound_rules(kustomize_base())) == set()
    router = [d for d in manifests.router_rbac(sdd_body("chat")) if d["kind"] == "Role"]
    assert secret_verbs([(None, None, r) for d in router for r in d["rules"]]) == set()


def test_the_rule_matcher_matches_as_rbac_does():
    """The matcher must see what a reviewer would: wildcards, a subresource, resourceNames."""
    assert allows({"apiGroups": [""], "resources": ["*"], "verbs": ["get"]}, "get", "", "secrets", "x")
    assert allows({"apiGroups": ["*"], "resources": ["secrets"], "verbs": ["*"]}, "watch", "", "secrets", "x")
    assert allows({"apiGroups": [""], "resources": ["serviceaccounts/*"], "verbs": ["create"]},
                  "create", "", "serviceaccounts/token", "x")
    assert not allows({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["mine"]},
                      "get", "", "secrets", "yours")
    assert not allows({"apiGroups": ["apps"], "resources": ["secrets"], "verbs": ["get"]}, "get", "", "secrets", "x")


_ENV = celpy.Environment()


def _cel(expression, activation):
    result = _ENV.program(_ENV.compile(expression)).evaluate(
        {k: celpy.json_to_cel(v) for k, v in activation.items()})
    assert isinstance(result, ct.BoolType), f"{expression} -> {result!r}"
    return bool(result)


def admitted(policy, obj, username=OPERATOR):
    """None when the policy does not apply to the request, else the messages of the validations it fails."""
    request = {"userInfo": {"username": username}, "operation": "CREATE"}
    if not all(_cel(c["expression"], {"request": request, "object": obj}) for c in policy["spec"]["matchConditions"]):
        return None
    return [v["message"] for v in policy["spec"]["validations"] if not _cel(v["expression"], {"object": obj})]


def test_the_admission_policy_admits_only_the_fleets_credentials_secrets():
    (policy,) = [d for d in render({}) if d["kind"] == "ValidatingAdmissionPolicy"]
    handle, secret = credentials_objects(sdd_body("chat"), "specfleet:default:chat", "p" * 64)
    secret["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": handle["metadata"][
        "name"], "uid": "u1", "controller": True, "blockOwnerDeletion": False}]
    assert admitted(policy, secret) == []
    hashed, hashed_secret = credentials_objects(sdd_body("qwen2.5-7b"), "u", "p")
    hashed_secret["metadata"]["ownerReferences"] = [{**secret["metadata"]["ownerReferences"][0],
                                                     "name": hashed["metadata"]["name"]}]
    assert admitted(policy, hashed_secret) == []

    token = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token", "immutable": True,
             "metadata": {**secret["metadata"], "annotations": {"kubernetes.io/service-account.name": "admin"}}}
    mutable = {**secret, "immutable": False}
    named = {**secret, "metadata": {**secret["metadata"], "name": "db-password"}}
    orphan = {**secret, "metadata": {k: v for k, v in secret["metadata"].items() if k != "ownerReferences"}}
    docker = {**secret, "type": "kubernetes.io/dockerconfigjson"}
    for bad in (token, mutable, named, orphan, docker):
        assert admitted(policy, bad), bad
    assert admitted(policy, token, username="system:serviceaccount:team-a:builder") is None  # others' are theirs
