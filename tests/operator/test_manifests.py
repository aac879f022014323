"""Pure builders: no cluster."""
import doctest
import json
import re

import kubernetes_validate
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from specfleet_api.live_state import KBounds, LiveState

from specfleet_api import fleet_spec as fs
from specfleet_operator import kube, manifests as m
from specfleet_operator.spec import with_defaults

SDD = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}}


def spec(**over):
    base = {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"}, "replicas": 2}
    base.update(over)
    return with_defaults(base)


def by_kind(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_the_docstrings_hold():
    assert doctest.testmod(m).failed == 0


def test_children_have_deterministic_names_and_labels():
    kids = by_kind(m.children(SDD, spec(), m.Settings()))
    assert set(kids) == {("ConfigMap", "demo--engine"), ("Service", "demo"), ("Service", "demo--stable"),
                         ("Service", "demo--metrics"), ("Deployment", "demo--stable"),
                         ("PodDisruptionBudget", "demo--stable"), ("ServiceAccount", "demo--router"),
                         ("Role", "demo--router"), ("RoleBinding", "demo--router"), ("Deployment", "demo--router"),
                         ("PodDisruptionBudget", "demo--router"), ("NetworkPolicy", "demo--workers")}
    for obj in kids.values():
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"][m.LABEL_SDD] == "demo"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == m.MANAGED_BY
    assert m.children(SDD, spec(), m.Settings()) == m.children(SDD, spec(), m.Settings())
    # every child is one the cleanup knows about
    refs = {(kind, name) for _, kind, name in m.child_refs("demo")}
    assert set(kids) <= refs


def test_engine_json_follows_the_worker_contract():
    cfg = fs.engine_config(spec(routing={"byPromptType": {"code": "ngram"}}), "stable")
    assert cfg == {
        "model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf", "tokenizer": None},
        "draft": {"method": "ngram", "uri": None},
        "speculation": {"kMin": 0, "kMax": 8, "kInitial": 4, "kPolicy": "adaptive",
                        "tree": {"branching": 1, "depth": 0}},
        "routing": {"default": "ngram", "byPromptType": {"code": "ngram"}},
        "quantization": "none", "dtype": "auto", "device": "auto", "role": "stable",
    }
    cm = m.engine_configmap(SDD, spec())
    assert json.loads(cm["data"]["engine.json"]) == fs.engine_config(spec(), "stable")
    assert json.loads(cm["data"]["control.json"]) == {"speculate": True, "kMin": 0, "kMax": 8}


def test_the_latency_guard_reaches_engine_json_only_when_set():
    from specfleet_api.engine_config import EngineConfig

    guarded = spec(speculation={"latencyGuard": {"maxSlowdownPercent": 2}})
    raw = fs.engine_config(guarded, "stable")
    assert raw["speculation"]["latencyGuard"] == {"maxSlowdownPercent": 2}
    assert EngineConfig.from_dict(raw).max_slowdown == 0.02  # the worker reads what the operator wrote
    # absent: off, and engine.json (its hash: the pods) exactly as before the field existed
    assert "latencyGuard" not in fs.engine_config(spec(), "stable")["speculation"]
    assert "latencyGuard" not in fs.engine_config(spec(speculation={"latencyGuard": {}}), "stable")["speculation"]

    def pod_hash(s):
        return m.deployment(SDD, s, "stable", m.Settings())["spec"]["template"]["metadata"]["annotations"][
            m.ANNOTATION_CONFIG_HASH]
    assert pod_hash(guarded) != pod_hash(spec()) == pod_hash(spec(speculation={"latencyGuard": {}}))


def test_a_canary_may_try_the_latency_guard_and_a_promotion_keeps_it():
    over = {"speculation": {"latencyGuard": {"maxSlowdownPercent": 3}}}
    s = spec(canary={"weight": 1, "overrides": over})
    cm = m.engine_configmap(SDD, s)["data"]
    assert json.loads(cm["engine-canary.json"])["speculation"]["latencyGuard"] == {"maxSlowdownPercent": 3}
    assert "latencyGuard" not in json.loads(cm["engine.json"])["speculation"]
    promoted = fs.FleetState(promoted={"overrides": over, "base": {}})
    assert fs.engine_config(spec(), "stable", promoted)["speculation"]["latencyGuard"] == {"maxSlowdownPercent": 3}


MEDUSA = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_a_tree_shape_reaches_engine_json_only_when_set():
    from specfleet_api.engine_config import EngineConfig

    shaped = spec(speculation={"tree": {"branching": 3, "choices": MEDUSA}})
    raw = fs.engine_config(shaped, "stable")
    assert raw["speculation"]["tree"] == {"branching": 3, "depth": 0, "choices": MEDUSA}
    assert EngineConfig.from_dict(raw).tree_choices == tuple(map(tuple, MEDUSA))  # the worker reads what was written
    # absent or []: no shape, and engine.json (its hash: the pods) exactly as before the field existed
    for unset in ({"branching": 3}, {"branching": 3, "choices": []}):
        assert fs.engine_config(spec(speculation={"tree": unset}), "stable")["speculation"]["tree"] == \
            {"branching": 3, "depth": 0}

    def pod_hash(s):
        return m.deployment(SDD, s, "stable", m.Settings())["spec"]["template"]["metadata"]["annotations"][
            m.ANNOTATION_CONFIG_HASH]
    assert pod_hash(shaped) != pod_hash(spec(speculation={"tree": {"branching": 3}})) == \
        pod_hash(spec(speculation={"tree": {"branching": 3, "choices": []}}))
    assert pod_hash(spec()) == pod_hash(spec(speculation={"tree": {}}))


def test_a_canary_may_try_a_tree_shape_or_drop_stables_and_a_promotion_keeps_it():
    over = {"speculation": {"tree": {"branching": 3, "choices": MEDUSA}}}
    cm = m.engine_configmap(SDD, spec(canary={"weight": 1, "overrides": over}))["data"]
    assert json.loads(cm["engine-canary.json"])["speculation"]["tree"] == {"branching": 3, "depth": 0,
                                                                          "choices": MEDUSA}
    assert json.loads(cm["engine.json"])["speculation"]["tree"] == {"branching": 1, "depth": 0}
    # stable's shape under the canary's other caps; [] turns the shape off for the canary alone
    stable = {"tree": {"branching": 3, "depth": 3, "choices": MEDUSA}}
    cm = m.engine_configmap(SDD, spec(speculation=stable, canary={"weight": 1, "overrides": {
        "speculation": {"tree": {"depth": 4}}}}))["data"]
    assert json.loads(cm["engine-canary.json"])["speculation"]["tree"] == {"branching": 3, "depth": 4,
                                                                          "choices": MEDUSA}
    cm = m.engine_configmap(SDD, spec(speculation=stable, canary={"weight": 1, "overrides": {
        "speculation": {"tree": {"choices": []}}}}))["data"]
    assert json.loads(cm["engine-canary.json"])["speculation"]["tree"] == {"branching": 3, "depth": 3}
    assert json.loads(cm["engine.json"])["speculation"]["tree"]["choices"] == MEDUSA
    promoted = fs.FleetState(promoted={"overrides": over, "base": {}})
    assert fs.engine_config(spec(), "stable", promoted)["speculation"]["tree"]["choices"] == MEDUSA


def test_the_ngram_corpus_reaches_engine_json_only_when_set_and_a_canary_may_try_it():
    from specfleet_api.engine_config import EngineConfig

    with_corpus = spec(draft={"method": "ngram", "ngram": {"corpusTokens": 16384}})
    raw = fs.engine_config(with_corpus, "stable")
    assert raw["draft"] == {"method": "ngram", "uri": None, "ngram": {"corpusTokens": 16384}}
    assert EngineConfig.from_dict(raw).ngram_corpus_tokens == 16384  # the worker reads what the operator wrote
    # 0 (the CRD's default): engine.json, its hash and the pods exactly as before the field existed
    assert fs.engine_config(spec(draft={"method": "ngram", "ngram": {"corpusTokens": 0}}), "stable")["draft"] == \
        fs.engine_config(spec(), "stable")["draft"] == {"method": "ngram", "uri": None}
    over = {"draft": {"ngram": {"corpusTokens": 8192}}}
    cm = m.engine_configmap(SDD, spec(canary={"weight": 1, "overrides": over}))["data"]
    assert json.loads(cm["engine-canary.json"])["draft"]["ngram"] == {"corpusTokens": 8192}
    assert "ngram" not in json.loads(cm["engine.json"])["draft"]
    promoted = fs.FleetState(promoted={"overrides": over, "base": {}})
    assert fs.engine_config(spec(), "stable", promoted)["draft"]["ngram"] == {"corpusTokens": 8192}


def test_ngram_mix_reaches_engine_json_only_when_on():
    from specfleet_api.engine_config import EngineConfig

    mixed = spec(draft={"method": "eagle", "uri": "/heads/h", "ngram": {"mix": True, "corpusTokens": 0}})
    raw = fs.engine_config(mixed, "stable")
    assert raw["draft"] == {"method": "eagle", "uri": "/heads/h", "ngram": {"mix": True}}
    assert EngineConfig.from_dict(raw).ngram_mix is True  # the worker reads what the operator wrote
    off = fs.engine_config(spec(draft={"method": "eagle", "uri": "/heads/h", "ngram": {"mix": False}}), "stable")
    assert off["draft"] == {"method": "eagle", "uri": "/heads/h"}


def test_pods_meet_the_restricted_pod_security_standard():
    pod = m.deployment(SDD, spec(), "stable", m.Settings())["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (m.MODEL_CACHE, "/tmp"):  # writable caches on emptyDirs
        assert "emptyDir" in volumes[mounts[path]]
    assert not any("hostPath" in v for v in pod["volumes"])


def test_probes_prestop_and_grace_period_let_the_worker_drain():
    settings = m.Settings(drain_seconds=45)
    pod = m.deployment(SDD, spec(), "stable", settings)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert pod["terminationGracePeriodSeconds"] > 45 + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert "--drain-seconds" in c["args"] and c["args"][c["args"].index("--drain-seconds") + 1] == "45"
    assert {p["containerPort"] for p in c["ports"]} == {50051, 8080}
    assert c["args"][c["args"].index("--host") + 1] == "0.0.0.0"


def test_config_hash_rolls_on_spec_change_only():
    def pod_hash(s):
        return m.deployment(SDD, s, "stable", m.Settings())["spec"]["template"]["metadata"]["annotations"][
            m.ANNOTATION_CONFIG_HASH]
    assert pod_hash(spec()) == pod_hash(spec())
    assert pod_hash(spec()) != pod_hash(spec(speculation={"kMax": 6}))
    assert pod_hash(spec()) != pod_hash(spec(template={"image": "other:1"}))
    # replicas and the control file do not restart pods
    assert pod_hash(spec()) == pod_hash(spec(replicas=5))
    assert pod_hash(spec()) == pod_hash(spec(slo={"alphaFloor": 0.9}))


def test_canary_gets_its_overrides_and_its_own_pod_count():
    s = spec(replicas=100, canary={"weight": 1, "overrides": {"speculation": {"kMax": 12}, "image": "w:2"}})
    kids = by_kind(m.children(SDD, s, m.Settings()))
    stable, canary = kids[("Deployment", "demo--stable")], kids[("Deployment", "demo--canary")]
    assert (stable["spec"]["replicas"], canary["spec"]["replicas"]) == (100, 1)  # canary.replicas defaults to 1
    assert canary["spec"]["template"]["spec"]["containers"][0]["image"] == "w:2"
    assert stable["spec"]["selector"]["matchLabels"][m.LABEL_ROLE] == "stable"
    assert canary["spec"]["selector"]["matchLabels"][m.LABEL_ROLE] == "canary"
    cm = kids[("ConfigMap", "demo--engine")]
    assert json.loads(cm["data"]["engine-canary.json"])["speculation"]["kMax"] == 12
    assert json.loads(cm["data"]["engine-canary.json"])["role"] == "canary"
    assert json.loads(cm["data"]["engine.json"])["speculation"]["kMax"] == 8
    # clients call the router (the Service named like the resource); each arm's workers have a
    # headless Service of their own, which the router discovers
    assert kids[("Service", "demo")]["spec"]["selector"] == {m.LABEL_SDD: "demo", m.LABEL_COMPONENT: "router"}
    for role in ("stable", "canary"):
        arm = kids[("Service", f"demo--{role}")]["spec"]
        assert arm["clusterIP"] == "None" and arm["selector"][m.LABEL_ROLE] == role
        assert arm["ports"][0]["name"] == m.DISCOVERY_PORT
    # promotion makes the overrides stable and the canary empty
    promoted = fs.FleetState(canary_phase="Promoted")
    assert fs.engine_config(s, "stable", promoted)["speculation"]["kMax"] == 12
    assert fs.replica_counts(s, promoted) == (100, 0)


def test_fallback_changes_control_json_but_not_the_pods():
    s = spec()
    fb = fs.FleetState(mode="fallback")
    assert json.loads(m.engine_configmap(SDD, s, fb)["data"]["control.json"])["speculate"] is False
    assert m.deployment(SDD, s, "stable", m.Settings()) == m.deployment(SDD, s, "stable", m.Settings(), fb)


def test_scaling_makes_an_autoscaler_and_leaves_replicas_to_it():
    s = spec(replicas=None, scaling={"minReplicas": 2, "maxReplicas": 6})
    s.pop("replicas")
    s = with_defaults(s)
    kids = by_kind(m.children(SDD, s, m.Settings()))
    hpa = kids[("HorizontalPodAutoscaler", "demo--stable")]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in kids[("Deployment", "demo--stable")]["spec"]


def test_monitoring_objects_only_when_enabled():
    off = by_kind(m.children(SDD, spec(), m.Settings()))
    on = by_kind(m.children(SDD, spec(observability={"serviceMonitor": {"enabled": True, "labels": {"r": "p"}},
                                                    "prometheusRule": {"enabled": True}}), m.Settings()))
    assert not any(k[0] in ("ServiceMonitor", "PrometheusRule") for k in off)
    sm = on[("ServiceMonitor", "demo--workers")]
    assert sm["metadata"]["labels"]["r"] == "p"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    rules = on[("PrometheusRule", "demo--alerts")]["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {m.ALERT_ALPHA, m.ALERT_SPEEDUP, m.ALERT_DRAFT_ERRORS, m.ALERT_FALLBACK,
                                           m.ALERT_ROUTER_REDIS, m.ALERT_WORKER_REDIS, m.ALERT_REDIS_AUTH}
    assert all('namespace="ml"' in r["expr"] for r in rules)  # sdd_namespace="ml" on the operator's gauge
    assert all(r["labels"].get("sdd_namespace", "ml") == "ml" for r in rules)


def test_redis_secret_and_otlp_reach_the_environment():
    s = spec(redis={"secretRef": {"name": "r", "key": "u"}}, observability={"otlpEndpoint": "http://otel:4317"})
    env = {e["name"]: e for e in m.deployment(SDD, s, "stable", m.Settings())["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["SPECFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "u"}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4317"
    assert env["SPECFLEET_MODEL_CACHE"]["value"] == m.MODEL_CACHE


@pytest.mark.parametrize("name", ["a", "x" * 40, "y" * 63, "z" * 200])
def test_child_names_are_dns_labels(name):
    for suffix in ("stable", "canary", "canary-metrics", "engine", "alerts"):
        child = m.child_name(name, suffix)
        assert len(child) <= 63 and child.endswith(suffix) and DNS_1035.match(child)
    assert m.child_name("y" * 63, "stable") != m.child_name("y" * 62 + "z", "stable")


@pytest.mark.parametrize("replicas, weight, canary_pods", [(2, 1, 1), (4, 50, 1), (100, 1, 1), (10, 0.01, 3)])
def test_the_canary_pod_count_is_canary_replicas_whatever_the_weight(replicas, weight, canary_pods):
    """The old split gave ceil(replicas x weight / 100) pods: 1% was 50% of the pods at 2 replicas."""
    canary = {"weight": weight} if canary_pods == 1 else {"weight": weight, "replicas": canary_pods}
    s = spec(replicas=replicas, canary=canary)
    assert fs.replica_counts(s, fs.FleetState()) == (replicas, canary_pods)
    assert fs.live_state(s, fs.FleetState()).canary_weight == weight
    kids = by_kind(m.children(SDD, s, m.Settings()))
    assert kids[("Deployment", "demo--canary")]["spec"]["replicas"] == canary_pods
    assert kids[("Deployment", "demo--stable")]["spec"]["replicas"] == replicas
    for phase in ("Promoted", "Aborted"):
        assert fs.replica_counts(s, fs.FleetState(canary_phase=phase)) == (replicas, 0)


def test_every_child_validates_against_the_kubernetes_schemas():
    s = spec(canary={"weight": 2.5, "replicas": 2}, redis={"url": "redis://r:6379/0"},
             observability={"serviceMonitor": {"enabled": True}}, router={"replicas": 3})
    for obj in m.children(SDD, s, m.Settings()):
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue
        kubernetes_validate.validate(obj, "1.30", strict=True)


def _selects(selector, labels):
    """Whether a LabelSelector (matchLabels only: all the policy uses) picks these labels; {} picks all."""
    assert set(selector) <= {"matchLabels"}, selector
    return selector.get("matchLabels", {}).items() <= labels.items()


def admits(policies, target, peer, port):
    """Whether Kubernetes lets `peer` reach the `port` (a container port's name) of `target`, each a
    (namespace, pod labels): open while no policy selects the target, else when one ingress rule of
    a policy selecting it names the port (or no port) and the peer (or no peer). A podSelector peer
    without a namespaceSelector is a pod of the policy's own namespace."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == target[0]
                 and _selects(p["spec"]["podSelector"], target[1]) and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True

    def peer_ok(entry, ns):
        assert set(entry) <= {"podSelector", "namespaceSelector"}, entry  # no ipBlock: not modelled here
        if "namespaceSelector" in entry:
            return False  # none of these peers' namespaces carries labels: a selector with terms picks none
        return peer[0] == ns and _selects(entry["podSelector"], peer[1])

    return any((not rule.get("ports") or any(p["port"] == port and p.get("protocol", "TCP") == "TCP"
                                                for p in rule["ports"]))
               and (not rule.get("from") or any(peer_ok(e, p["metadata"]["namespace"]) for e in rule["from"]))
               for p in selecting for rule in p["spec"].get("ingress", []))


def test_only_the_fleets_own_routers_reach_the_workers_generation_port():
    """The canary share, the routes and the fallback are the router's to apply: a worker's gRPC port
    admits the fleet's routers only, its HTTP port (metrics, probes) anyone. The pods' labels and
    port names are taken from the Deployments the operator renders, not restated."""
    s = spec(canary={"weight": 1})
    kids = by_kind(m.children(SDD, s, m.Settings()))
    policy = kids[("NetworkPolicy", "demo--workers")]
    kubernetes_validate.validate(policy, "1.30", strict=True)

    def pod(kind, name, ns="ml"):
        template = kids[(kind, name)]["spec"]["template"]
        return ns, template["metadata"]["labels"], [p["name"] for p in template["spec"]["containers"][0]["ports"]]

    router = pod("Deployment", "demo--router")[:2]
    other = by_kind(m.children({"metadata": {"name": "demo-b", "namespace": "ml", "uid": "u-2"}}, s, m.Settings()))
    other_router = ("ml", other[("Deployment", "demo-b--router")]["spec"]["template"]["metadata"]["labels"])
    other_worker = ("ml", other[("Deployment", "demo-b--stable")]["spec"]["template"]["metadata"]["labels"])
    strangers = {"a pod of the namespace": ("ml", {"app": "curl"}), "another fleet's router": other_router,
                 "another fleet's worker": other_worker, "the same router's labels elsewhere": ("team-b", router[1]),
                 "a worker of its own fleet": pod("Deployment", "demo--stable")[:2]}
    policies = [policy]
    for arm in ("demo--stable", "demo--canary"):
        ns, labels, ports = pod("Deployment", arm)
        assert set(ports) == {"grpc", "http"}  # the ports the policy names, as the worker names them
        assert admits(policies, (ns, labels), router, "grpc")
        for who, peer in strangers.items():
            assert not admits(policies, (ns, labels), peer, "grpc"), f"{who} reaches {arm}'s gRPC port"
            assert admits(policies, (ns, labels), peer, "http"), f"{who} cannot scrape {arm}'s metrics"
        assert not admits(policies, (ns, labels), router, "admin")  # loopback only, and no rule opens it
    # the policy holds the fleet's workers only: the router, and another fleet's workers, are not its business
    assert admits(policies, pod("Deployment", "demo--router")[:2], ("ml", {"app": "curl"}), "http")
    assert admits(policies, other_worker, ("ml", {"app": "curl"}), "grpc")
    assert ("NetworkPolicy", "demo--workers", "networking.k8s.io/v1") in {
        (k, n, a) for a, k, n in m.child_refs("demo")}  # converged, and cleaned up, as every child is


DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a Service name, as the API server checks it
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
MODEL_STYLE = ["llama-3.1-8b-instruct", "qwen2.5-7b", "7b-chat", "a" + "-b.c" * 30]  # the last is 121 chars


@pytest.mark.parametrize("name", MODEL_STYLE)
def test_model_style_names_give_valid_child_names_and_labels(name):
    """The schemas leave names and label values as plain strings, so the formats are checked here."""
    sdd = {"metadata": {"name": name, "namespace": "ml", "uid": "u-1"}}
    s = spec(canary={"weight": 5}, observability={"serviceMonitor": {"enabled": True},
                                                 "prometheusRule": {"enabled": True}})
    kids = m.children(sdd, s, m.Settings())
    for obj in kids:
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63 and DNS_1035.match(meta["name"]), meta["name"]
        for key, value in meta["labels"].items():
            assert len(value) <= 63 and LABEL_VALUE.match(value), (key, value)
        pod_labels = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
        assert all(len(v) <= 63 and LABEL_VALUE.match(v) for v in pod_labels.values())
        if not obj["apiVersion"].startswith("monitoring.coreos.com"):
            kubernetes_validate.validate(obj, "1.30", strict=True)
    assert m.children(sdd, s, m.Settings()) == kids  # deterministic
    # the cleanup and the status look the children up by the same names
    assert {o["metadata"]["name"] for o in kids} <= {n for _, _, n in m.child_refs(name)}
    rule = next(o for o in kids if o["kind"] == "PrometheusRule")
    assert f'{m.PROM_LABEL_SDD}="{m.label_value(name)}"' in rule["spec"]["groups"][0]["rules"][0]["expr"]


# What the API server takes as a resource's name: a DNS-1123 subdomain (lowercase letters, digits,
# '-' and '.', alphanumeric at both ends of each dot-separated label), up to 253 characters.
_LABEL = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
SDD_NAMES = st.one_of(
    st.lists(_LABEL, min_size=1, max_size=4).map(".".join),
    # names built from another's: the children's words, a hash of one, runs of '-', long ones
    st.tuples(_LABEL, st.lists(st.sampled_from(["", "-", "--", "---", "."]), min_size=1, max_size=3),
              st.sampled_from(list(m.SUFFIXES) + ["", "x", "5f5e975c", "metrics-canary"]))
    .map(lambda t: t[0] + "".join(t[1]) + t[2]).filter(lambda n: re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", n)
                                                       and ".." not in n and "-." not in n and ".-" not in n),
    st.builds(lambda a, n: (a * n)[:253], _LABEL, st.integers(1, 40)).filter(lambda n: n[-1].isalnum()),
)


def child_names(name):
    """Every name the operator gives a child of `name`, whatever the kind."""
    return {n for _, _, n in m.child_refs(name)}


def with_children_of(name):
    """`name` and names that its children's names would give, as resources of their own."""
    return [name, *sorted(child_names(name))]


@settings(max_examples=1500, deadline=None)
@given(SDD_NAMES, SDD_NAMES)
def test_two_resources_never_share_a_child_name(a, b):
    """Of any kind: the front Service users call, the arms' and the router's objects alike."""
    assume(a != b)
    assert not child_names(a) & child_names(b), (a, b)
    assert m.label_value(a) != m.label_value(b)  # so no selector of one picks the other's pods


@settings(max_examples=300, deadline=None)
@given(SDD_NAMES)
def test_a_resource_named_like_anothers_child_gets_children_of_its_own(name):
    """`foo-canary` beside `foo` (the names of before: its Service was foo's canary arm), or a name
    copied from one of foo's children today."""
    names = [name, *(f"{name}-{s}" for s in m.SUFFIXES), *with_children_of(name)]
    for other in {n for n in names if n != name and len(n) <= 253}:
        assert not child_names(name) & child_names(other), (name, other)
        assert m.label_value(name) != m.label_value(other)


@pytest.mark.parametrize("a, b", [("llama", "llama-canary"), ("llama", "llama-stable"), ("llama", "llama-metrics"),
                                  ("llama-canary", "llama-canary-metrics"), ("foo", "foo--stable"),
                                  ("qwen2.5-7b", "qwen2-5-7b--5f5e975c"), ("x" * 80, "x" * 54 + "-d929cdee")])
def test_names_of_the_incidents_and_their_neighbours(a, b):
    assert not child_names(a) & child_names(b)
    assert m.selector(a, "canary") != m.selector(b, "canary") and m.selector(a) != m.selector(b)
    pods_of_b = m.labels(b, "canary")
    assert not set(m.selector(a, "canary").items()) <= set(pods_of_b.items())  # a's Service never picks b's pods


def test_child_names_split_at_the_separator():
    assert m.child_name("llama", "stable") == "llama--stable" and m.front_service_name("llama-canary") == "llama-canary"
    assert m.front_service_name("foo--bar") == m.child_name("foo--bar", "") != "foo--bar"  # SEP is the children's
    with pytest.raises(ValueError):
        m.child_name("llama", "nope")


def test_the_names_of_before_are_the_ones_an_upgrade_retires():
    legacy = {(k, n) for _, k, n in m.legacy_child_refs("llama")}
    assert ("Deployment", "llama-stable") in legacy and ("Service", "llama-canary") in legacy
    assert ("Service", "llama") not in legacy  # the front Service keeps its name
    assert not legacy & {(k, n) for _, k, n in m.child_refs("llama")}


def test_names_that_differ_only_in_dots_get_different_children():
    assert m.child_name("qwen2.5-7b", "stable") != m.child_name("qwen2-5-7b", "stable")
    assert m.front_service_name("qwen2.5-7b") != m.front_service_name("qwen2-5-7b")
    assert m.front_service_name("demo") == "demo"  # a name that is already valid is kept
    assert m.label_value("x" * 80) != m.label_value("x" * 79 + "y")


def test_workers_have_default_resources_that_the_spec_replaces():
    (c,) = m.deployment(SDD, spec(), "stable", m.Settings())["spec"]["template"]["spec"]["containers"]
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}
    assert c["resources"] is not m.WORKER_RESOURCES  # a copy: editing one pod's dict cannot move the default
    gpu = {"limits": {"nvidia.com/gpu": 1, "memory": "24Gi"}, "requests": {"nvidia.com/gpu": 1}}
    custom = m.deployment(SDD, spec(template={"resources": gpu}), "stable", m.Settings())
    assert custom["spec"]["template"]["spec"]["containers"][0]["resources"] == gpu
    canary = m.deployment(SDD, spec(canary={"weight": 1}), "canary", m.Settings())
    assert canary["spec"]["template"]["spec"]["containers"][0]["resources"] == m.WORKER_RESOURCES


@pytest.mark.parametrize("role", fs.ROLES)
def test_cuda_workers_ask_for_one_gpu_unless_the_spec_names_it(role):
    def resources(**over):
        d = m.deployment(SDD, spec(canary={"weight": 1}, **over), role, m.Settings())
        return d["spec"]["template"]["spec"]["containers"][0]["resources"], d

    cuda, d = resources(device="cuda")
    assert cuda == {"requests": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": 1},
                    "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}}
    kubernetes_validate.validate(d, "1.30", strict=True)
    assert m.WORKER_RESOURCES == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}  # untouched
    assert resources(device="auto")[0] == resources(device="cpu")[0] == m.WORKER_RESOURCES
    two = {"limits": {"nvidia.com/gpu": 2, "memory": "24Gi"}}
    for device in ("cuda", "auto"):  # auto asks for GPUs when the spec names them
        assert resources(device=device, template={"resources": two})[0] == {
            "limits": {"nvidia.com/gpu": 2, "memory": "24Gi"}, "requests": {"nvidia.com/gpu": 2}}
    mine = {"limits": {"memory": "24Gi"}}
    assert resources(device="cuda", template={"resources": mine})[0] == {
        "limits": {"memory": "24Gi", "nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}
    assert json.loads(m.engine_configmap(SDD, spec(device="cuda"))["data"]["engine.json"])["device"] == "cuda"


def test_the_router_is_restricted_probed_and_bounded():
    kids = by_kind(m.children(SDD, spec(router={"replicas": 3}), m.Settings(router_image="r:9")))
    router = kids[("Deployment", "demo--router")]
    assert router["spec"]["replicas"] == 3
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo--router" and pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["image"] == "r:9" and c["command"] == ["specfleet"] and c["args"][0] == "router"
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http", "scheme": "HTTP"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTP"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 50050}
    front = kids[("Service", "demo")]["spec"]["ports"]
    assert {(p["name"], p["port"], p["targetPort"]) for p in front} == {("http", 8000, "http"), ("grpc", 50051, "grpc")}
    # the router's own pods: the Service, the PDB and the Deployment agree on the selector
    assert kids[("PodDisruptionBudget", "demo--router")]["spec"]["selector"]["matchLabels"] == \
        router["spec"]["selector"]["matchLabels"] == kids[("Service", "demo")]["spec"]["selector"]
    assert router["spec"]["selector"]["matchLabels"].items() <= router["spec"]["template"]["metadata"]["labels"].items()


def test_the_router_may_only_read_endpointslices_in_its_namespace():
    kids = by_kind(m.children(SDD, spec(), m.Settings()))
    role, binding = kids[("Role", "demo--router")], kids[("RoleBinding", "demo--router")]
    assert role["metadata"]["namespace"] == "ml"
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo--router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo--router", "namespace": "ml"}]
    assert not any(o["kind"] in ("ClusterRole", "ClusterRoleBinding") for o in kids.values())


def _flags(args):
    out = {}
    for flag, value in zip(args, args[1:]):
        if flag.startswith("--"):
            out.setdefault(flag, []).append(value)
    return out


def test_router_flags_without_redis_carry_the_state():
    s = spec(model={"name": "smollm2-135m", "uri": "u"}, routing={"default": "ngram",
                                                                  "byPromptType": {"chat": "none", "code": "ngram"}},
             canary={"weight": 0.25})
    args = m.router_args(SDD, s, m.Settings())
    flags = _flags(args)
    assert flags["--deployment"] == ["ml/demo"] and flags["--model-alias"] == ["smollm2-135m"]
    assert flags["--discover-kubernetes"] == ["stable=demo--stable", "canary=demo--canary"]
    assert flags["--canary-weight"] == ["0.25"] and flags["--route"] == ["chat=none", "code=ngram"]
    assert flags["--host"] == ["0.0.0.0"] and "--backend" not in flags
    env = {e["name"] for e in m.router_deployment(SDD, s, m.Settings())["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "SPECFLEET_REDIS_URL" not in env
    # a canary step (the loop's state) moves the flag: without Redis the router pods roll
    stepped = m.router_args(SDD, s, m.Settings(), fs.FleetState(canary_weight=5, canary_phase="Progressing"))
    assert _flags(stepped)["--canary-weight"] == ["5"]


def test_router_with_redis_follows_it_and_its_pods_do_not_roll_on_a_canary_step():
    s = spec(redis={"url": "redis://r:6379/0"}, canary={"weight": 1})
    before = m.router_deployment(SDD, s, m.Settings())
    after = m.router_deployment(SDD, s, m.Settings(), fs.FleetState(canary_weight=25, canary_phase="Progressing"))
    assert before == after and "--canary-weight" not in before["spec"]["template"]["spec"]["containers"][0]["args"]
    env = {e["name"]: e for e in before["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPECFLEET_REDIS_URL"]["value"] == "redis://r:6379/0"


def test_a_redis_secret_is_followed_only_where_the_operator_may_read_it():
    s = spec(redis={"secretRef": {"name": "r", "key": "u"}})
    assert not fs.writes_live_state(s, m.Settings().read_redis_secrets)
    assert "--canary-weight" in m.router_args(SDD, s, m.Settings())
    allowed = m.Settings(read_redis_secrets=True)
    assert fs.writes_live_state(s, allowed.read_redis_secrets) and "--canary-weight" not in m.router_args(SDD, s, allowed)
    env = {e["name"]: e for e in m.router_deployment(SDD, s, allowed)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPECFLEET_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "u"}


def test_a_router_setting_rolls_no_worker():
    s = spec()
    assert m.deployment(SDD, s, "stable", m.Settings()) == m.deployment(SDD, s, "stable", m.Settings(router_image="x"))


def test_workers_know_their_deployment_for_the_live_state_key():
    env = {e["name"]: e for e in m.deployment(SDD, spec(), "canary", m.Settings())["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["SPECFLEET_DEPLOYMENT"]["value"] == "ml/demo"


def test_live_state_from_spec_and_loop_state():
    s = spec(speculation={"kMin": 1, "kMax": 6, "kInitial": 3},
             routing={"default": "ngram", "byPromptType": {"chat": "none", "code": "ngram"}},
             canary={"weight": 12.5, "overrides": {"speculation": {"kMax": 10}}})
    live = fs.live_state(s, fs.FleetState())
    assert live == LiveState(version=0, canary_weight=12.5, default_method="ngram",
                             routes={"chat": "none", "code": "ngram"}, fallback=(), speculate=True,
                             k={"stable": KBounds(1, 6), "canary": KBounds(1, 10)}, probe_share=5.0)
    assert live.problems() == []  # a document the router and the workers accept
    assert LiveState.from_json(live.to_json()) == live
    fb = fs.live_state(s, fs.FleetState(mode="fallback", canary_weight=12.5, canary_phase="Progressing"))
    # a whole-deployment fallback is a soft off: the probes (5%) keep their K bounds
    assert fb.speculate is False and fb.k == {"stable": KBounds(1, 6), "canary": KBounds(1, 10)}
    assert fb.method_for("code") == "none" and fb.route("code", draw=1.0) == ("ngram", True) and fb.problems() == []
    no_probe = dict(s, slo={"fallback": {"enabled": True, "probeShare": 0}})
    assert fs.live_state(no_probe, fs.FleetState(mode="fallback")).k["stable"] == KBounds(0, 0)
    per_type = fs.live_state(s, fs.FleetState(fallback=("code",), fallback_clusters=("r/1",)))
    assert per_type.speculate and per_type.fallback == ("code",) and per_type.fallback_clusters == ("r/1",)
    promoted = fs.live_state(s, fs.FleetState(canary_phase="Promoted"))
    assert promoted.canary_weight == 0 and promoted.k["stable"] == KBounds(1, 10)
    assert fs.live_state(spec(draft={"method": "none"}), fs.FleetState()).speculate is False


def test_each_arm_gets_its_own_control_json_so_the_canarys_k_is_not_clamped():
    """A worker clamps K to its control.json: one file built from the base spec undid the canary's
    K overrides on start."""
    s = spec(speculation={"kMin": 1, "kInitial": 2, "kMax": 4},
             canary={"overrides": {"speculation": {"kMin": 2, "kMax": 12}}})
    cm = m.engine_configmap(SDD, s)["data"]
    assert json.loads(cm["control.json"]) == {"speculate": True, "kMin": 1, "kMax": 4}
    assert json.loads(cm["control-canary.json"]) == {"speculate": True, "kMin": 2, "kMax": 12}
    for role, key in (("stable", "control.json"), ("canary", "control-canary.json")):
        (volume,) = [v for v in m.deployment(SDD, s, role, m.Settings())["spec"]["template"]["spec"]["volumes"]
                     if v["name"] == "config"]
        assert {"key": key, "path": "control.json"} in volume["configMap"]["items"]
    live = fs.live_state(s, fs.FleetState())
    assert (live.k["stable"], live.k["canary"]) == (KBounds(1, 4), KBounds(2, 12))
    # a canary that turns speculation off has it off in its own file only
    off = spec(canary={"overrides": {"draft": {"method": "none"}}})
    data = m.engine_configmap(SDD, off)["data"]
    assert json.loads(data["control-canary.json"])["speculate"] is False
    assert json.loads(data["control.json"])["speculate"] is True


def test_the_canary_may_run_another_precision():
    s = spec(canary={"overrides": {"quantization": "int8"}})
    assert fs.engine_config(s, "canary")["quantization"] == "int8" and fs.engine_config(s, "stable")["quantization"] == "none"


def test_a_waiting_canary_has_its_pods_but_no_requests():
    s = spec(canary={"weight": 5, "replicas": 2})
    waiting = fs.FleetState(canary_phase="Waiting", canary_weight=0)
    assert fs.replica_counts(s, waiting) == (2, 2) and fs.live_state(s, waiting).canary_weight == 0
    for phase in ("Promoted", "Aborted"):
        assert fs.replica_counts(s, fs.FleetState(canary_phase=phase)) == (2, 0)


RECORD = {"overrides": {"speculation": {"kMax": 12}, "image": "w:2"}, "base": {"speculation": {"kMax": 8}}}


def test_removing_the_canary_after_promotion_keeps_stable_as_promoted():
    with_canary = spec(canary={"overrides": {"speculation": {"kMax": 12}, "image": "w:2"}})
    promoted = fs.FleetState(canary_phase="Promoted", promoted=RECORD)
    before = m.deployment(SDD, with_canary, "stable", m.Settings(), promoted)
    removed = spec()  # spec.canary deleted; the status keeps the record
    after = m.deployment(SDD, removed, "stable", m.Settings(), fs.FleetState(promoted=RECORD))
    assert after == before  # not a pod rolls
    assert fs.engine_config(removed, "stable", fs.FleetState(promoted=RECORD))["speculation"]["kMax"] == 12
    assert after["spec"]["template"]["spec"]["containers"][0]["image"] == "w:2"
    assert json.loads(m.engine_configmap(SDD, removed, fs.FleetState(promoted=RECORD))["data"]["control.json"])[
        "kMax"] == 12


def test_a_promotion_ends_when_the_spec_holds_it_or_says_otherwise():
    folded = spec(speculation={"kMax": 12}, template={"image": "w:2"})
    state = fs.FleetState(promoted=RECORD)
    assert fs.promoted_overrides(folded, state) == {}
    assert fs.engine_config(folded, "stable", state)["speculation"]["kMax"] == 12
    other = spec(speculation={"kMax": 6, "kInitial": 4})  # the user moved kMax after the promotion: the spec wins
    assert fs.promoted_overrides(other, state) == {"image": "w:2"}
    assert fs.engine_config(other, "stable", state)["speculation"]["kMax"] == 6


def test_a_canary_after_a_promotion_starts_from_the_promoted_stable():
    s = spec(canary={"overrides": {"draft": {"method": "none"}}})
    state = fs.FleetState(promoted=RECORD)
    canary = fs.engine_config(s, "canary", state)
    assert canary["speculation"]["kMax"] == 12 and canary["draft"]["method"] == "none"


WEIGHT_SOURCES = {
    "pvc": {"pvc": {"claimName": "weights", "subPath": "qwen2.5-7b"}},
    "initContainer": {"initContainer": {
        "image": "amazon/aws-cli:2.17.0", "command": ["aws", "s3", "cp", "--recursive"],
        "args": ["s3://models/qwen2.5-7b/", "/var/cache/specfleet/qwen2.5-7b/"],
        "env": [{"name": "AWS_REGION", "value": "eu-west-1"}], "secretRef": {"name": "s3-credentials"},
        "sizeLimit": "40Gi"}},
    "volume": {"volume": {"csi": {"driver": "s3.csi.aws.com", "volumeAttributes": {"bucketName": "models"}}}},
}


@pytest.mark.parametrize("kind", WEIGHT_SOURCES)
def test_a_model_source_mounts_the_weights_read_only_at_the_model_cache(kind):
    s = spec(model={"name": "qwen", "uri": "qwen2.5-7b/model.gguf", "source": WEIGHT_SOURCES[kind]},
             canary={"weight": 1})
    for role in m.ROLES:
        d = m.deployment(SDD, s, role, m.Settings())
        kubernetes_validate.validate(d, "1.30", strict=True)
        pod = d["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        (mount,) = [v for v in c["volumeMounts"] if v["mountPath"] == m.MODEL_CACHE]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert mount["readOnly"] is True and "emptyDir" not in volume or kind == "initContainer"
        assert not any("hostPath" in v for v in pod["volumes"])
        if kind == "pvc":
            assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
            assert mount["subPath"] == "qwen2.5-7b"
        if kind == "volume":
            assert volume["csi"]["driver"] == "s3.csi.aws.com"
        if kind != "initContainer":
            assert "initContainers" not in pod
            continue
        assert volume["emptyDir"] == {"sizeLimit": "40Gi"} and mount["readOnly"] is True
        (init,) = pod["initContainers"]
        assert init["image"] == "amazon/aws-cli:2.17.0" and init["args"][0] == "s3://models/qwen2.5-7b/"
        assert {"name": mount["name"], "mountPath": m.MODEL_CACHE} in init["volumeMounts"]  # it writes, the worker reads
        assert init["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
        assert {"name": "AWS_REGION", "value": "eu-west-1"} in init["env"]
        sc = init["securityContext"]  # restricted, like the worker
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert init["resources"] == m.INIT_RESOURCES and init["resources"] is not m.INIT_RESOURCES


def test_without_a_model_source_the_model_cache_is_a_writable_empty_dir():
    pod = m.deployment(SDD, spec(), "stable", m.Settings())["spec"]["template"]["spec"]
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"] and "initContainers" not in pod
    assert {"name": "model-cache", "mountPath": m.MODEL_CACHE} in pod["containers"][0]["volumeMounts"]
    writable = m.model_volume({"pvc": {"claimName": "w", "readOnly": False}})
    assert writable["mount"]["readOnly"] is False and writable["volume"]["persistentVolumeClaim"]["readOnly"] is False


def test_gpu_workers_pass_their_scheduling_fields_and_routers_theirs():
    spread = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}}
    gpu_taint = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pull = [{"name": "registry"}]
    s = spec(device="cuda", canary={"weight": 1}, template={
        "runtimeClassName": "nvidia", "nodeSelector": {"nvidia.com/gpu.present": "true"}, "tolerations": gpu_taint,
        "affinity": affinity, "topologySpreadConstraints": [spread], "imagePullSecrets": pull,
        "priorityClassName": "inference"},
        router={"imagePullSecrets": pull, "nodeSelector": {"pool": "cpu"}, "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "edge", "effect": "NoSchedule"}]})
    for role in m.ROLES:
        d = m.deployment(SDD, s, role, m.Settings())
        kubernetes_validate.validate(d, "1.30", strict=True)
        pod = d["spec"]["template"]["spec"]
        assert pod["runtimeClassName"] == "nvidia" and pod["affinity"] == affinity and pod["tolerations"] == gpu_taint
        assert pod["imagePullSecrets"] == pull and pod["priorityClassName"] == "inference"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        (constraint,) = pod["topologySpreadConstraints"]  # spreads its own arm's pods
        assert constraint == {**spread, "labelSelector": {"matchLabels": m.selector("demo", role)}}
        res = pod["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 1
    router = m.router_deployment(SDD, s, m.Settings())
    kubernetes_validate.validate(router, "1.30", strict=True)
    pod = router["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == pull and pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"][0]["key"] == "dedicated" and "runtimeClassName" not in pod
    plain = m.deployment(SDD, spec(), "stable", m.Settings())["spec"]["template"]["spec"]
    assert not {"runtimeClassName", "affinity", "topologySpreadConstraints", "imagePullSecrets"} & set(plain)
    assert not {"imagePullSecrets", "nodeSelector", "tolerations"} & set(
        m.router_deployment(SDD, spec(), m.Settings())["spec"]["template"]["spec"])


@pytest.mark.parametrize("over, rolling", [
    ({}, {"maxSurge": 1, "maxUnavailable": 0}),  # CPU: a spare pod is cheap, keep every old one until ready
    ({"device": "cuda"}, {"maxSurge": 0, "maxUnavailable": 1}),  # GPU: no spare GPU needed
    ({"template": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}, {"maxSurge": 0, "maxUnavailable": 1}),
    ({"device": "cuda", "strategy": {"type": "RollingUpdate"}}, {"maxSurge": 0, "maxUnavailable": 1}),
    ({"device": "cuda", "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}},
     {"maxSurge": 1, "maxUnavailable": 0}),
    ({"strategy": {"type": "Recreate"}}, None),
])
def test_the_rollout_strategy_is_the_specs_else_by_whether_pods_hold_a_gpu(over, rolling):
    s = spec(canary={"weight": 1}, **over)
    for role in m.ROLES:
        d = m.deployment(SDD, s, role, m.Settings())
        kubernetes_validate.validate(d, "1.30", strict=True)
        expected = {"type": "Recreate"} if rolling is None else {"type": "RollingUpdate", "rollingUpdate": rolling}
        assert d["spec"]["strategy"] == expected
    router = m.router_deployment(SDD, s, m.Settings())["spec"]["strategy"]
    assert router == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def test_switching_to_recreate_drops_the_rolling_update_the_api_server_would_refuse():
    """A Deployment of type Recreate may not keep rollingUpdate: the operator's patch removes it."""
    before = m.deployment(SDD, spec(), "stable", m.Settings())
    live = {**before, "metadata": {**before["metadata"], "annotations": {kube.LAST_APPLIED: json.dumps(before)}}}
    after = m.deployment(SDD, spec(strategy={"type": "Recreate"}), "stable", m.Settings())
    patch = kube.apply_patch(live, after)
    assert patch["spec"]["strategy"] == {"type": "Recreate", "rollingUpdate": None}
