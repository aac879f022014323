"""The Helm chart, rendered by the real Helm engine (helm-python-sdk)."""
import json
import pathlib
import re

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from specfleet_operator import manifests
from specfleet_operator.spec import with_defaults

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specfleet"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
# prometheus-operator's kinds have no schema in kubernetes-validate: checked by hand below.
OWN_SCHEMA_KINDS = {"PrometheusRule"}


def render(values):
    out = helm.Chart.load(str(CHART)).render(values, name="specfleet", namespace="specfleet-system",
                                             is_install=True)
    docs = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    return docs, out


@pytest.mark.parametrize("path", VALUES_FILES, ids=lambda p: p.name)
def test_renders_and_every_object_validates(path):
    values = yaml.safe_load(path.read_text()) or {}
    docs, out = render(values)
    assert any(d["kind"] == "Deployment" for d in docs)
    for doc in docs:
        if doc["kind"] in OWN_SCHEMA_KINDS:
            continue
        kubernetes_validate.validate(doc, "1.30", strict=True)
    assert "NOTES.txt" in "".join(out)


def test_lint_strict_passes_for_every_values_file():
    for path in [None, *VALUES_FILES]:
        values = yaml.safe_load(path.read_text()) if path else None
        report = helm.lint(str(CHART), values or None, strict=True)
        assert report["errors"] == [], (path, report)
        assert not [m for m in report["messages"] if m["severity"] >= 2], (path, report)


def test_schema_rejects_a_misspelt_value():
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema({"replicaCount": 3})
    for bad in ({"replicaCont": 3}, {"image": {"tga": "x"}}, {"leaderElection": {"enable": True}},
                {"prometheusRule": {"enabled": "yes"}}):
        with pytest.raises(helm.HelmError):
            chart.validate_schema(bad)


def test_values_are_all_documented():
    """Each key has a comment right above it, or sits inside a documented parent (e.g. resources)."""
    lines = (CHART / "values.yaml").read_text().splitlines()

    def documented(i):
        line = lines[i]
        indent = len(line) - len(line.lstrip())
        if i > 0 and lines[i - 1].strip().startswith("#"):
            return True
        for j in range(i - 1, -1, -1):  # the parent key: the nearest line indented less
            above = lines[j]
            if above.strip() and not above.strip().startswith("#") and len(above) - len(above.lstrip()) < indent:
                return above.strip().endswith(":") and documented(j) and not lines[j + 1].strip().startswith("#")
        return False

    keys = [i for i, line in enumerate(lines) if re.match(r"^\s*[A-Za-z_][\w.-]*:", line)]
    assert len(keys) > 30
    for i in keys:
        if not lines[i].strip().endswith(":"):
            assert documented(i), f"values.yaml line {i + 1} is not documented: {lines[i]}"


def test_crd_copy_is_byte_identical():
    assert (CHART / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml").read_bytes() == \
        (ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml").read_bytes()


# The Kubernetes release each feature the operator or the CRD uses first appeared in (GA or beta
# on by default): the chart's kubeVersion must be at least the highest of those in use.
FEATURE_SINCE = {"lifecycle.preStop.sleep": (1, 30), "x-kubernetes-validations fieldPath": (1, 28),
                 "CEL isSorted()": (1, 27), "x-kubernetes-validations": (1, 25)}


def _walk(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield path + (key,), value
            yield from _walk(value, path + (key,))
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, path)


def features_used():
    crd = yaml.safe_load((ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml").read_text())
    sdd = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u"}}
    spec = with_defaults({"model": {"name": "m", "uri": "/m"}, "replicas": 1, "canary": {"weight": 1}})
    used = set()
    for obj in [crd, *manifests.children(sdd, spec, manifests.Settings())]:
        for path, value in _walk(obj):
            if path[-3:] == ("lifecycle", "preStop", "sleep"):
                used.add("lifecycle.preStop.sleep")
            if path[-1] == "x-kubernetes-validations":
                used.add("x-kubernetes-validations")
                used |= {"x-kubernetes-validations fieldPath" for rule in value if "fieldPath" in rule}
                used |= {"CEL isSorted()" for rule in value if "isSorted()" in rule["rule"]}
    return used


def test_chart_kube_version_covers_every_feature_used():
    used = features_used()
    assert {"lifecycle.preStop.sleep", "x-kubernetes-validations fieldPath"} <= used  # the scan finds them
    need = max(FEATURE_SINCE[f] for f in used)
    kube_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    have = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)\.\d+(-0)?", kube_version).group(1, 2))
    assert have >= need, f"Chart.yaml kubeVersion {kube_version} but {used} need >= {need}"
    assert f"Kubernetes ≥ {need[0]}.{need[1]}" in (ROOT / "docs" / "operator.md").read_text()


def test_dashboard_json_is_the_same_in_deploy_and_covers_the_panels():
    chart_copy = (CHART / "files" / "specfleet-dashboard.json").read_bytes()
    assert chart_copy == (ROOT / "deploy" / "dashboards" / "specfleet.json").read_bytes()
    dash = json.loads(chart_copy)
    text = json.dumps(dash)
    for metric in ("spec_decode_acceptance_rate", "spec_decode_avg_accepted_tokens",
                   "spec_decode_draft_k_distribution_bucket", "spec_decode_tree_branch_factor",
                   "spec_decode_total_speedup_ratio", "histogram_quantile", "specfleet_fallback_active",
                   # vLLM pools: their own counters, per pool and per draft position
                   "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert metric in text
    assert "specfleet_fallback_active{sdd_namespace=" in text  # labels a scrape keeps (no namespace clash)
    docs, _ = render({"dashboard": {"enabled": True}})
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "specfleet.json" in d["data"]]
    assert json.loads(cm["data"]["specfleet.json"]) == dash


def test_prometheus_rule_has_the_standard_alerts_matching_the_operator():
    values = {"window": "10m", "alphaDrop": 0.3, "alphaFloor": 0.1, "speedupFloor": 1.2, "minDraftTokens": 50,
              "baselineRange": "2h"}
    docs, _ = render({"prometheusRule": {"enabled": True, **values}})
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    rendered = rule["spec"]["groups"][0]["rules"]
    # the same rules, word for word, as the operator's builder (which tests/metrics runs in promtool)
    assert rendered == manifests.alert_rules("", "10m", 0.3, 0.1, 1.2, 50, "2h")
    # every engine's: the chart's rules cover specfleet's and vLLM's fleets at once
    assert [r["alert"] for r in rendered] == [manifests.ALERT_ALPHA, manifests.ALERT_SPEEDUP,
                                              manifests.ALERT_DRAFT_ERRORS, manifests.ALERT_FALLBACK,
                                              manifests.ALERT_ROUTER_REDIS, manifests.ALERT_WORKER_REDIS,
                                              manifests.ALERT_REDIS_AUTH, manifests.ALERT_VLLM_ALPHA]
    for r in rendered:  # the shape prometheus-operator requires
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"} and isinstance(r["expr"], str)
    defaults, _ = render({"prometheusRule": {"enabled": True}})
    (rule,) = [d for d in defaults if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"][0]["rules"] == manifests.alert_rules()  # the CRD's slo defaults


def test_alertmanager_token_secret_is_mounted_and_passed_only_when_named():
    docs, _ = render({"alertmanager": {"tokenSecret": {"name": "am-token", "key": "bearer"}, "alertTTL": 600}})
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "alertmanager-token", "secret": {
        "secretName": "am-token", "items": [{"key": "bearer", "path": "token"}]}} in pod["volumes"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "alertmanager-token"]
    assert mount["name"] == "alertmanager-token" and mount["readOnly"]
    args = pod["containers"][0]["args"]
    assert f"--alertmanager-token-file={mount['mountPath']}/token" in args and "--alert-ttl=600" in args
    for doc in docs:
        if doc["kind"] not in OWN_SCHEMA_KINDS:
            kubernetes_validate.validate(doc, "1.30", strict=True)
    from specfleet_operator.main import parse_args
    options = parse_args(args)
    assert options.alert_token.path == f"{mount['mountPath']}/token" and options.alerts.ttl_s == 600
    off, _ = render({})  # no Secret named: no mount, no flag, and the receiver stays off (never open)
    (dep,) = [d for d in off if d["kind"] == "Deployment"]
    assert not any(v["name"] == "alertmanager-token" for v in dep["spec"]["template"]["spec"]["volumes"])
    assert not any(a.startswith("--alertmanager-token-file") for a in _operator_args(off))
    assert parse_args(_operator_args(off)).alert_token.get() is None


def _rules(docs, kind):
    return [rule for d in docs if d["kind"] == kind for rule in d["rules"]]


def test_rbac_is_least_privilege_and_matches_the_kustomize_base():
    # the kustomize base installs no Redis: the chart without its Redis grants what the base does
    docs, _ = render({"redis": {"enabled": False}})
    chart_rules = _rules(docs, "ClusterRole")
    base = [d for d in yaml.safe_load_all((ROOT / "deploy" / "base" / "rbac.yaml").read_text())]
    assert chart_rules == _rules(base, "ClusterRole")
    assert _rules(docs, "Role") == _rules(base, "Role")
    assert not any(r["resources"] == ["secrets"] for r in chart_rules)
    # with its Redis, the fleets' Redis users: Secrets written, never read
    docs, _ = render({})
    with_redis = _rules(docs, "ClusterRole")
    assert [r for r in with_redis if r not in chart_rules] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    for rule in with_redis + _rules(docs, "Role"):
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert "escalate" not in rule["verbs"] and "bind" not in rule["verbs"]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] != "cluster-admin"


def test_operator_pods_are_restricted_and_ha():
    docs, _ = render({})
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2 and pod["securityContext"]["runAsNonRoot"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert any(d["kind"] == "PodDisruptionBudget" for d in docs)


def test_long_release_names_are_truncated_to_63():
    out = helm.Chart.load(str(CHART)).render({}, name="r" * 60, namespace="ns", is_install=True)
    docs = [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    assert all(len(d["metadata"]["name"]) <= 63 for d in docs)


def _grants(rules, wanted):
    """Whether `rules` allow every verb of `wanted` (one RBAC rule) on its resources."""
    return all(any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)
               for group in wanted["apiGroups"] for resource in wanted["resources"] for verb in wanted["verbs"])


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster-wide", "namespaced"])
def test_the_operator_may_create_each_fleets_router_and_grant_it_what_it_reads(values):
    """Kubernetes lets a ServiceAccount grant only what it holds (no escalate, no bind): the
    operator holds the router Role's rules, and may manage the router's objects."""
    docs, _ = render(values)
    rules = _rules(docs, "ClusterRole") + _rules(docs, "Role")
    for wanted in manifests.ROUTER_RULES:
        assert _grants(rules, wanted), wanted
    for group, resource in [("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                            ("rbac.authorization.k8s.io", "rolebindings"), ("apps", "deployments"),
                            ("", "services"), ("policy", "poddisruptionbudgets")]:
        assert _grants(rules, {"apiGroups": [group], "resources": [resource], "verbs": ["get", "create", "patch", "delete"]})
    assert not _grants(rules, {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                               "verbs": ["create"]})
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--router-image=ghcr.io/specfleet/router:0.1.0" in args and "--read-redis-secrets" not in args


def test_reading_redis_secrets_is_opt_in_and_granted_by_no_chart_role():
    """readRedisSecrets passes the operator flag; the read itself is granted per Secret by its
    namespace's owner (docs/redis.md), never by the chart."""
    docs, _ = render({"router": {"readRedisSecrets": True, "image": "registry.local/router:dev"}})
    rules = _rules(docs, "ClusterRole")
    assert not any("secrets" in r["resources"] and set(r["verbs"]) - {"create"} for r in rules)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--read-redis-secrets" in args and "--router-image=registry.local/router:dev" in args
    off, _ = render({})
    assert not any("secrets" in r["resources"] and "get" in r["verbs"] for r in _rules(off, "ClusterRole"))


def _operator_args(docs):
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def test_two_releases_in_one_namespace_elect_on_their_own_leases():
    chart = helm.Chart.load(str(CHART))
    leases = []
    for release in ("specfleet", "team-b"):
        out = chart.render({}, name=release, namespace="shared", is_install=True)
        docs = [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
        (lease,) = [a.split("=", 1)[1] for a in _operator_args(docs) if a.startswith("--lease-name=")]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", lease) and len(lease) <= 63
        leases.append(lease)
    assert leases == ["specfleet", "team-b-specfleet"]


def test_several_replicas_without_leader_election_are_refused():
    with pytest.raises(helm.HelmError, match="replicaCount is 3 but leaderElection.enabled is false"):
        render({"replicaCount": 3, "leaderElection": {"enabled": False}})
    docs, _ = render({"replicaCount": 1, "leaderElection": {"enabled": False}})
    assert "--no-leader-election" in _operator_args(docs)
    docs, _ = render({"replicaCount": 3})
    assert "--no-leader-election" not in _operator_args(docs)


def test_the_operator_liveness_probe_is_the_heartbeat_in_chart_and_kustomize():
    docs, _ = render({})
    kustomized = yaml.safe_load_all((ROOT / "deploy" / "base" / "deployment.yaml").read_text())
    for dep in [d for d in docs if d["kind"] == "Deployment"] + [d for d in kustomized if d]:
        probe = dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]
        assert probe == {"path": "/healthz", "port": "metrics"}


def test_the_operator_flags_the_chart_passes_exist():
    from specfleet_operator.main import parse_args
    docs, _ = render({"router": {"readRedisSecrets": True}})
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    options = parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert options.worker.router_image == "ghcr.io/specfleet/router:0.1.0" and options.worker.read_redis_secrets


def test_the_vllm_images_are_chart_values_passed_to_the_operator():
    """vllm.image / vllm.cpuImage: the operator's images for fleets with engine vllm and no
    engine.vllm.image; by default the pinned upstream ones (specfleet_api.vllm)."""
    from specfleet_api import vllm
    from specfleet_operator.main import parse_args
    options = parse_args(_operator_args(render({})[0]))
    assert (options.worker.vllm_image, options.worker.vllm_cpu_image) == (vllm.GPU_IMAGE, vllm.CPU_IMAGE)
    ours = {"image": "registry.local/vllm-openai@sha256:" + "e" * 64, "cpuImage": "registry.local/vllm-cpu:0.32.0"}
    options = parse_args(_operator_args(render({"vllm": ours})[0]))
    assert (options.worker.vllm_image, options.worker.vllm_cpu_image) == (ours["image"], ours["cpuImage"])
    sdd = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u1"}}
    spec = with_defaults({"engine": {"name": "vllm"}, "model": {"name": "m", "uri": "/models/m"}, "replicas": 1,
                          "speculation": {"kPolicy": "fixed", "kInitial": 4, "kMax": 4}})
    pools = [d for d in manifests.children(sdd, spec, options.worker) if d["metadata"]["name"].startswith("chat--vllm")
             and d["kind"] == "Deployment"]
    assert pools and {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in pools} == {ours["cpuImage"]}
    for bad in ({"vllm": {"image": ""}}, {"vllm": {"cpuImage": "has space"}}, {"vllm": {"gpuImage": "x"}}):
        with pytest.raises(helm.HelmError):
            helm.Chart.load(str(CHART)).validate_schema(bad)


def test_prometheus_reaches_the_vllm_servers_only_where_networkpolicy_vllm_metrics_from_admits_it():
    """The vLLM servers' one port serves /metrics and generation: a fleet's own policy admits its
    router only; networkPolicy.vllmMetricsFrom (Prometheus) is admitted there in every watched
    namespace, and nothing is opened by default."""
    docs, _ = render({})
    assert not [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-vllm-metrics")]
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    docs, _ = render({"networkPolicy": {"vllmMetricsFrom": prometheus}, "watchNamespaces": ["ml", "chat"]})
    policies = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-vllm-metrics")]
    assert sorted(d["metadata"]["namespace"] for d in policies) == ["chat", "ml"]
    sdd = {"metadata": {"name": "chat", "namespace": "ml", "uid": "u1"}}
    spec = with_defaults({"engine": {"name": "vllm"}, "model": {"name": "m", "uri": "/models/m"}, "replicas": 1,
                          "speculation": {"kPolicy": "fixed", "kInitial": 4, "kMax": 4}})
    pod_labels = next(d for d in manifests.children(sdd, spec, manifests.Settings()) if d["kind"] == "Deployment"
                      and d["metadata"]["name"] == "chat--vllm-stable-ngram")["spec"]["template"]["metadata"]["labels"]
    for policy in policies:
        kubernetes_validate.validate(policy, "1.30", strict=True)
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert policy["spec"]["ingress"] == [{"from": prometheus, "ports": [{"port": "http", "protocol": "TCP"}]}]
    # the port the ServiceMonitor scrapes the pools on
    svc = next(d for d in manifests.children(sdd, spec, manifests.Settings()) if d["kind"] == "Service"
               and d["metadata"]["name"] == "chat--vllm-stable-ngram")
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]


def test_the_liveness_staleness_is_a_chart_value():
    from specfleet_operator.main import parse_args
    for values, seconds in (({}, 60.0), ({"metrics": {"livenessStaleAfter": 180}}, 180.0)):
        docs, _ = render(values)
        assert parse_args(_operator_args(docs)).heartbeat.stale_after_s == seconds
    for bad in (0, -5, "1m"):
        with pytest.raises(helm.HelmError):
            helm.Chart.load(str(CHART)).validate_schema({"metrics": {"livenessStaleAfter": bad}})


@pytest.mark.parametrize("values, release, namespace", [
    ({}, "specfleet", "specfleet-system"),
    ({}, "team-b", "shared"),
    ({"fullnameOverride": "fleet-ops"}, "specfleet", "ops"),
    ({"nameOverride": "sf"}, "a-very-long-release-name-that-goes-on-and-on-past-the-dns-limit-x", "ml"),
])
def test_notes_name_the_lease_the_operator_elects_on(values, release, namespace, monkeypatch):
    """NOTES.txt's `kubectl get lease` names the Lease the operator's flags make it use: its name
    (--lease-name) in the namespace the pod runs in (POD_NAMESPACE, the release namespace)."""
    from specfleet_operator.main import parse_args
    out = helm.Chart.load(str(CHART)).render(values, name=release, namespace=namespace, is_install=True)
    docs = [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    notes = next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    (command,) = re.findall(r"kubectl -n (\S+) get lease (\S+) ", notes)
    monkeypatch.setenv("POD_NAMESPACE", namespace)  # the Deployment sets it from metadata.namespace
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("valueFrom") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    options = parse_args(_operator_args(docs))
    assert options.leader_election and command == (options.lease_namespace, options.lease_name)


def test_notes_name_no_lease_without_leader_election():
    _, out = render({"replicaCount": 1, "leaderElection": {"enabled": False}})
    notes = next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    assert not re.search(r"\blease\b", notes, re.IGNORECASE), notes
    _, out = render({})
    assert "get lease specfleet " in next(t for p, t in out.items() if p.endswith("NOTES.txt"))


DIGESTS = {name: "sha256:" + (c * 64) for name, c in (("operator", "a"), ("worker", "b"), ("router", "c"),
                                                       ("redis", "d"))}


def test_every_image_is_pinnable_by_digest():
    """image.digest, worker.digest, router.digest, redis.image.digest: each image runs as
    repository@sha256:... (the tag dropped), down to the worker and router pods the operator creates."""
    from specfleet_operator.main import parse_args
    docs, out = render({"image": {"tag": "0.1.0", "digest": DIGESTS["operator"]},
                        "worker": {"image": "localhost:5000/specfleet/worker:0.1.0", "digest": DIGESTS["worker"]},
                        "router": {"image": "ghcr.io/specfleet/router@sha256:" + "0" * 64, "digest": DIGESTS["router"]},
                        "redis": {"image": {"digest": DIGESTS["redis"]}}})
    images = {c["name"]: c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"operator": "ghcr.io/specfleet/operator@" + DIGESTS["operator"],
                      "redis": "docker.io/library/redis@" + DIGESTS["redis"]}
    options = parse_args(_operator_args(docs))
    assert options.worker.worker_image == "localhost:5000/specfleet/worker@" + DIGESTS["worker"]
    assert options.worker.router_image == "ghcr.io/specfleet/router@" + DIGESTS["router"]
    assert "ghcr.io/specfleet/router@" + DIGESTS["router"] in next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    for doc in docs:
        if doc["kind"] not in OWN_SCHEMA_KINDS:
            kubernetes_validate.validate(doc, "1.30", strict=True)
    fleet = manifests.children(_sdd(), with_defaults(_sdd()["spec"]), options.worker)
    pods = {d["metadata"]["name"]: [c["image"] for c in d["spec"]["template"]["spec"]["containers"]]
            for d in fleet if d["kind"] == "Deployment"}
    assert sorted(set(sum(pods.values(), []))) == sorted({options.worker.worker_image, options.worker.router_image})
    # no digest: the tags, as before
    docs, _ = render({})
    assert parse_args(_operator_args(docs)).worker.worker_image == "ghcr.io/specfleet/worker:0.1.0"
    assert [d for d in docs if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["image"] \
        == "ghcr.io/specfleet/operator:0.1.0"


def _sdd():
    return {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u1"},
            "spec": {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"}, "replicas": 1}}


@pytest.mark.parametrize("where", [{"image": {"digest": "sha256:abc"}}, {"worker": {"digest": "b" * 64}},
                                   {"router": {"digest": "sha512:" + "c" * 64}}])
def test_a_malformed_digest_is_refused(where):
    with pytest.raises(helm.HelmError, match="digest"):
        helm.Chart.load(str(CHART)).validate_schema(where)


def test_the_alertmanager_receiver_gets_a_generated_token_or_the_named_one():
    """alertmanager.enabled: the chart generates the token in `<fullname>-alertmanager`, mounts it and
    passes it; a named tokenSecret is used instead (nothing generated); neither: off, no Secret."""
    import base64
    from specfleet_operator.main import parse_args
    docs, _ = render({"alertmanager": {"enabled": True}, "watchNamespaces": ["ml"]})
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "specfleet-alertmanager"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    kubernetes_validate.validate(secret, "1.30", strict=True)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    volumes = dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "alertmanager-token", "secret": {"secretName": "specfleet-alertmanager",
                                                     "items": [{"key": "token", "path": "token"}]}} in volumes
    options = parse_args(_operator_args(docs))
    assert options.alert_token.path == "/var/run/secrets/specfleet/alertmanager/token"
    assert options.namespaces == ("ml",)  # what the receiver refuses alerts outside of
    again, _ = render({"alertmanager": {"enabled": True}})
    assert [d for d in again if d["kind"] == "Secret" and d["metadata"]["name"] == "specfleet-alertmanager"][0][
        "data"]["token"] != secret["data"]["token"]  # random per install (an upgrade looks the Secret up)
    named, _ = render({"alertmanager": {"enabled": True, "tokenSecret": {"name": "mine"}}})
    assert not [d for d in named if d["kind"] == "Secret" and "alertmanager" in d["metadata"]["name"]]
    assert "secretName" in str(named) and "'secretName': 'mine'" in str(named)
    off, _ = render({})
    assert not [d for d in off if d["kind"] == "Secret" and "alertmanager" in d["metadata"]["name"]]
