"""Pure builders: no cluster."""
import json

import pytest

from specfleet_operator import manifests as m
from specfleet_operator.spec import with_defaults

SDD = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}}


def spec(**over):
    base = {"model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"}, "replicas": 2}
    base.update(over)
    return with_defaults(base)


def by_kind(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_children_have_deterministic_names_and_labels():
    kids = by_kind(m.children(SDD, spec(), m.Settings()))
    assert set(kids) == {("ConfigMap", "demo-engine"), ("Service", "demo"), ("Service", "demo-metrics"),
                         ("Deployment", "demo-stable"), ("PodDisruptionBudget", "demo-stable")}
    for obj in kids.values():
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"][m.LABEL_SDD] == "demo"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == m.MANAGED_BY
    assert m.children(SDD, spec(), m.Settings()) == m.children(SDD, spec(), m.Settings())
    # every child is one the cleanup knows about
    refs = {(kind, name) for _, kind, name in m.child_refs("demo")}
    assert set(kids) <= refs


def test_engine_json_follows_the_worker_contract():
    cfg = m.engine_config(spec(routing={"byPromptType": {"code": "ngram"}}), "stable")
    assert cfg == {
        "model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf", "tokenizer": None},
        "draft": {"method": "ngram", "uri": None},
        "speculation": {"kMin": 0, "kMax": 8, "kInitial": 4, "kPolicy": "adaptive",
                        "tree": {"branching": 1, "depth": 0}},
        "routing": {"default": "ngram", "byPromptType": {"code": "ngram"}},
        "quantization": "none", "dtype": "auto", "role": "stable",
    }
    cm = m.engine_configmap(SDD, spec())
    assert json.loads(cm["data"]["engine.json"]) == m.engine_config(spec(), "stable")
    assert json.loads(cm["data"]["control.json"]) == {"speculate": True, "kMin": 0, "kMax": 8}


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


def test_canary_gets_its_overrides_and_a_one_percent_share():
    s = spec(replicas=100, canary={"weight": 1, "overrides": {"speculation": {"kMax": 12}, "image": "w:2"}})
    kids = by_kind(m.children(SDD, s, m.Settings()))
    stable, canary = kids[("Deployment", "demo-stable")], kids[("Deployment", "demo-canary")]
    assert (stable["spec"]["replicas"], canary["spec"]["replicas"]) == (100, 1)
    assert canary["spec"]["template"]["spec"]["containers"][0]["image"] == "w:2"
    assert stable["spec"]["selector"]["matchLabels"][m.LABEL_ROLE] == "stable"
    assert canary["spec"]["selector"]["matchLabels"][m.LABEL_ROLE] == "canary"
    cm = kids[("ConfigMap", "demo-engine")]
    assert json.loads(cm["data"]["engine-canary.json"])["speculation"]["kMax"] == 12
    assert json.loads(cm["data"]["engine-canary.json"])["role"] == "canary"
    assert json.loads(cm["data"]["engine.json"])["speculation"]["kMax"] == 8
    # the gRPC Service sends traffic to both roles
    assert m.LABEL_ROLE not in kids[("Service", "demo")]["spec"]["selector"]
    # promotion makes the overrides stable and the canary empty
    promoted = m.FleetState(canary_phase="Promoted")
    assert m.engine_config(s, "stable", promoted)["speculation"]["kMax"] == 12
    assert m.replica_counts(s, promoted) == (100, 0)


def test_fallback_changes_control_json_but_not_the_pods():
    s = spec()
    fb = m.FleetState(mode="fallback")
    assert json.loads(m.engine_configmap(SDD, s, fb)["data"]["control.json"])["speculate"] is False
    assert m.deployment(SDD, s, "stable", m.Settings()) == m.deployment(SDD, s, "stable", m.Settings(), fb)


def test_scaling_makes_an_autoscaler_and_leaves_replicas_to_it():
    s = spec(replicas=None, scaling={"minReplicas": 2, "maxReplicas": 6})
    s.pop("replicas")
    s = with_defaults(s)
    kids = by_kind(m.children(SDD, s, m.Settings()))
    hpa = kids[("HorizontalPodAutoscaler", "demo-stable")]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert "replicas" not in kids[("Deployment", "demo-stable")]["spec"]


def test_monitoring_objects_only_when_enabled():
    off = by_kind(m.children(SDD, spec(), m.Settings()))
    on = by_kind(m.children(SDD, spec(observability={"serviceMonitor": {"enabled": True, "labels": {"r": "p"}},
                                                    "prometheusRule": {"enabled": True}}), m.Settings()))
    assert not any(k[0] in ("ServiceMonitor", "PrometheusRule") for k in off)
    sm = on[("ServiceMonitor", "demo-workers")]
    assert sm["metadata"]["labels"]["r"] == "p"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    rules = on[("PrometheusRule", "demo-alerts")]["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"SpecDecodeAlphaDrop", "SpecDecodeSpeedupBelowOne",
                                           "SpecDecodeDraftErrors", "SpecDecodeFallbackEntered"}
    assert all('namespace="ml"' in r["expr"] for r in rules)


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
        assert len(child) <= 63 and child.endswith(suffix)
    assert m.child_name("y" * 63, "stable") != m.child_name("y" * 62 + "z", "stable")
