"""engine vllm: the operator's vLLM pools, as pure manifests (every field, kubernetes-validate on
1.29 to 1.35, the restricted Pod Security Standard), the router's flags naming them, the status read
from them and the alerts on vLLM's counters; and with the real operator on the emulator: a vLLM
fleet is reconciled into its pools and is Ready when they are, a pool whose method leaves the spec is
deleted, and a deleted pool comes back."""
import asyncio
import json
import pathlib
import re

import kubernetes_validate
import pytest
import yaml
from specfleet_api import fleet_spec as fs
from specfleet_api import vllm

from specfleet_operator import API_VERSION, KIND, handlers
from specfleet_operator import manifests as m
from specfleet_operator.main import parse_args
from specfleet_operator.spec import problems, with_defaults
from specfleet_operator.status import compute, condition
from specfleet_operator.testing import OperatorThread, sdd_body, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
SDD = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}}
#: The Kubernetes minor versions the children must validate on. kubernetes-validate 1.37.0 holds
#: schemas for 1.28 to 1.37: all of these are there (test_the_schemas_of_every_version_are_there).
K8S_VERSIONS = ("1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
GPU = {"requests": {"cpu": "4", "memory": "24Gi", "nvidia.com/gpu": 1},
       "limits": {"memory": "32Gi", "nvidia.com/gpu": 1}}
#: The volume kinds the restricted Pod Security Standard (v1.30) allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}


def spec(**over):
    base = {"engine": {"name": "vllm"}, "model": {"name": "llama", "uri": "/models/llama"}, "replicas": 2,
            "speculation": {"kPolicy": "fixed", "kInitial": 4, "kMax": 4}}
    base.update(over)
    out = with_defaults(base)
    assert problems(out) == [], problems(out)
    return out


def by_kind(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def pool(kids, role="stable", method="ngram"):
    return kids[("Deployment", f"demo--vllm-{role}-{method}")]


def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def assert_restricted(pod):
    """The restricted Pod Security Standard (v1.30), field by field (as tests/operator/test_chart_redis.py)."""
    sc = pod["securityContext"]
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["runAsNonRoot"] is True
    for v in pod["volumes"]:
        assert set(v) - {"name"} <= RESTRICTED_VOLUMES, v
    for c in pod.get("initContainers", []) + pod["containers"]:
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert csc["runAsNonRoot"] is True and csc["runAsUser"] not in (0, None) and not csc.get("privileged")
        assert csc["readOnlyRootFilesystem"] is True and csc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert all("hostPort" not in p for p in c.get("ports", []))


def test_a_vllm_fleet_runs_pools_in_place_of_the_workers_and_keeps_its_router():
    kids = by_kind(m.children(SDD, spec(), m.Settings()))
    assert set(kids) == {("NetworkPolicy", "demo--workers"), ("Service", "demo--vllm-stable-ngram"),
                         ("Deployment", "demo--vllm-stable-ngram"), ("Service", "demo--vllm-stable-none"),
                         ("Deployment", "demo--vllm-stable-none"), ("PodDisruptionBudget", "demo--stable"),
                         ("ServiceAccount", "demo--router"), ("Role", "demo--router"), ("RoleBinding", "demo--router"),
                         ("Service", "demo"), ("Deployment", "demo--router"), ("PodDisruptionBudget", "demo--router")}
    refs = {(kind, name) for _, kind, name in m.child_refs("demo")}
    assert set(kids) <= refs
    # every pool any arm could run is a ref: a pool whose method leaves the spec is found and deleted
    assert {("Deployment", m.vllm_pool_name("demo", r, meth)) for r in fs.ROLES for meth in vllm.METHODS} <= refs
    # the specfleet children of the same name set are refs too: switching engines removes them
    theirs = {k for k in by_kind(m.children(SDD, with_defaults({**spec(), "engine": {"name": "specfleet"},
                                                                "speculation": {}}), m.Settings()))}
    assert theirs - set(kids) <= refs and ("ConfigMap", "demo--engine") in theirs - set(kids)


def test_a_gpu_pool_asks_for_its_gpu_rolls_without_surge_and_runs_the_cuda_image():
    kids = by_kind(m.children(SDD, spec(device="cuda", dtype="bfloat16"), m.Settings()))
    for method in ("ngram", "none"):
        d = pool(kids, method=method)
        c = container(d)
        assert c["resources"]["limits"][m.GPU_RESOURCE] == c["resources"]["requests"][m.GPU_RESOURCE] == 1
        assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        assert c["image"] == vllm.GPU_IMAGE and c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert c["args"][c["args"].index("--dtype") + 1] == "bfloat16"
    # the spec's own resources (its GPU count) win, as for the workers
    two = container(pool(by_kind(m.children(SDD, spec(template={"resources": {"limits": {m.GPU_RESOURCE: 2}}}),
                                            m.Settings()))))
    assert two["resources"] == {"limits": {m.GPU_RESOURCE: 2}, "requests": {m.GPU_RESOURCE: 2}}
    assert two["image"] == vllm.GPU_IMAGE  # device auto with a GPU: the CUDA build


def test_a_cpu_pool_runs_the_vllm_cpu_image_with_its_own_default_resources():
    d = pool(by_kind(m.children(SDD, spec(), m.Settings())))
    c = container(d)
    assert c["image"] == vllm.CPU_IMAGE and c["resources"] == m.VLLM_RESOURCES
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert c["args"][c["args"].index("--dtype") + 1] == "float32"  # dtype auto on the CPU, as the workers
    cpu = container(pool(by_kind(m.children(SDD, spec(device="cpu", template={"resources": GPU}), m.Settings()))))
    assert cpu["image"] == vllm.CPU_IMAGE  # device cpu: the CPU build, whatever the pod holds


def test_each_pool_serves_its_method_on_8000_with_probes_shm_and_labels():
    s = spec(draft={"method": "eagle", "uri": "/heads/e"}, routing={"byPromptType": {"chat": "none"}},
             template={"podAnnotations": {"team": "ml"}, "nodeSelector": {"gpu": "h100"},
                       "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                      "whenUnsatisfiable": "ScheduleAnyway"}]},
             engine={"name": "vllm", "vllm": {"shmSize": "8Gi", "pools": {"none": {"replicas": 1}},
                                              "args": ["--max-model-len", "8192"]}})
    kids = by_kind(m.children(SDD, s, m.Settings()))
    assert {n for k, n in kids if k == "Deployment"} == {"demo--vllm-stable-ngram", "demo--vllm-stable-eagle",
                                                         "demo--vllm-stable-none", "demo--router"}
    for method, replicas in (("ngram", 2), ("eagle", 2), ("none", 1)):
        d, svc = pool(kids, method=method), kids[("Service", f"demo--vllm-stable-{method}")]
        c, pod = container(d), d["spec"]["template"]["spec"]
        own = {m.LABEL_SDD: "demo", m.LABEL_COMPONENT: "vllm", m.LABEL_ROLE: "stable", m.LABEL_METHOD: method}
        assert d["spec"]["replicas"] == replicas and d["spec"]["selector"]["matchLabels"] == own
        assert own.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        assert own.items() <= svc["metadata"]["labels"].items() and svc["spec"]["selector"] == own
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"] == [
            {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"}]
        assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1800
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert "emptyDir" in volumes[mounts["/tmp"]]  # HOME: the caches of a read-only root
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["HOME"] == "/tmp" and env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
        config = c["args"][c["args"].index("--speculative-config") + 1] if method != "none" else None
        assert (json.loads(config) if config else None) == vllm.speculative_config(s, method)
        assert c["args"][-2:] == ["--max-model-len", "8192"]
        assert d["spec"]["template"]["metadata"]["annotations"] == {"team": "ml"}
        assert pod["nodeSelector"] == {"gpu": "h100"}
        assert pod["topologySpreadConstraints"][0]["labelSelector"] == {"matchLabels": own}
        assert pod["automountServiceAccountToken"] is False
        assert_restricted(pod)


def test_the_weights_come_from_the_same_sources_as_the_workers():
    for source, kind in (({"pvc": {"claimName": "w", "subPath": "llama"}}, "persistentVolumeClaim"),
                         ({"initContainer": {"image": "fetch:1", "sizeLimit": "40Gi"}}, "emptyDir"),
                         ({"volume": {"csi": {"driver": "d"}}}, "csi")):
        s = spec(model={"name": "llama", "uri": "Llama-3.1-8B", "source": source})
        d = pool(by_kind(m.children(SDD, s, m.Settings())))
        c, pod = container(d), d["spec"]["template"]["spec"]
        (cache,) = [v for v in c["volumeMounts"] if v["mountPath"] == m.MODEL_CACHE]
        assert cache["readOnly"] is True and kind in {v["name"]: v for v in pod["volumes"]}[cache["name"]]
        assert c["args"][c["args"].index("--model") + 1] == "/var/cache/specfleet/Llama-3.1-8B"
        assert [i["name"] for i in pod.get("initContainers", [])] == (["fetch-weights"] if kind == "emptyDir" else [])
        assert_restricted(pod)


def test_only_the_fleets_router_reaches_the_vllm_servers_and_a_budget_covers_the_stable_pools():
    kids = by_kind(m.children(SDD, spec(), m.Settings()))
    policy = kids[("NetworkPolicy", "demo--workers")]["spec"]
    assert policy["podSelector"] == {"matchLabels": m.vllm_selector("demo")}
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": m.selector("demo", component="router")}}],
                                  "ports": [{"port": "http", "protocol": "TCP"}]}]
    budget = kids[("PodDisruptionBudget", "demo--stable")]["spec"]
    assert budget == {"maxUnavailable": 1, "selector": {"matchLabels": m.vllm_selector("demo", "stable")}}
    for method in ("ngram", "none"):  # the budget and the policy pick every stable pool's pods
        labels = pool(kids, method=method)["spec"]["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items()
        assert policy["podSelector"]["matchLabels"].items() <= labels.items()


def test_prometheus_scrapes_the_pools_and_the_router():
    kids = by_kind(m.children(SDD, spec(observability={"serviceMonitor": {"enabled": True}}), m.Settings()))
    monitor = kids[("ServiceMonitor", "demo--workers")]["spec"]
    assert monitor["selector"]["matchExpressions"] == [{"key": m.LABEL_COMPONENT, "operator": "In",
                                                        "values": ["vllm", "router"]}]
    assert m.LABEL_METHOD in monitor["podTargetLabels"]
    assert kids[("Service", "demo--vllm-stable-ngram")]["spec"]["ports"][0]["name"] == monitor["endpoints"][0]["port"]


def test_the_canary_runs_pools_of_its_own_sized_by_canary_replicas():
    s = spec(canary={"weight": 5, "replicas": 1, "overrides": {"draft": {"method": "eagle", "uri": "/heads/e"},
                                                                "speculation": {"kInitial": 3, "kMax": 3}}})
    kids = by_kind(m.children(SDD, s, m.Settings()))
    # the canary's routing names its own method (the loop chooses nothing: stable serves ngram alone)
    canary = {n for k, n in kids if k == "Deployment" and "canary" in n}
    assert canary == {"demo--vllm-canary-eagle", "demo--vllm-canary-none"}
    c = container(pool(kids, "canary", "eagle"))
    assert json.loads(c["args"][c["args"].index("--speculative-config") + 1]) == {
        "method": "eagle", "model": "/heads/e", "num_speculative_tokens": 3}
    assert [pool(kids, "canary", meth)["spec"]["replicas"] for meth in ("eagle", "none")] == [1, 1]
    stable = container(pool(kids))
    assert json.loads(stable["args"][stable["args"].index("--speculative-config") + 1])["num_speculative_tokens"] == 4


def flag_values(args, flag):
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_router_discovers_every_pool_by_its_service_and_no_worker_service():
    """--discover-vllm ARM/METHOD=SERVICE for each pool the fleet runs, a pool at 0 replicas too
    (it just has no endpoints), and no --discover-kubernetes: a vLLM fleet has no worker Service."""
    s = spec(draft={"method": "eagle", "uri": "/heads/e"},
             engine={"name": "vllm", "vllm": {"pools": {"none": {"replicas": 0}}}},
             canary={"weight": 5, "replicas": 1, "overrides": {"speculation": {"kInitial": 3, "kMax": 3}}})
    kids = by_kind(m.children(SDD, s, m.Settings()))
    args = container(kids[("Deployment", "demo--router")])["args"]
    assert flag_values(args, "--discover-vllm") == [
        "stable/ngram=demo--vllm-stable-ngram", "stable/eagle=demo--vllm-stable-eagle",
        "stable/none=demo--vllm-stable-none", "canary/ngram=demo--vllm-canary-ngram",
        "canary/eagle=demo--vllm-canary-eagle", "canary/none=demo--vllm-canary-none"]
    assert "--discover-kubernetes" not in args and "--vllm-backend" not in args
    assert pool(kids, method="none")["spec"]["replicas"] == 0
    for value in flag_values(args, "--discover-vllm"):  # each names a Service of the fleet, its port `http`
        arm_method, service = value.split("=")
        role, method = arm_method.split("/")
        svc = kids[("Service", service)]
        assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]
        assert svc["spec"]["selector"] == m.vllm_selector("demo", role, method)
    # the rest of the router's flags are the engine's neither: the routing table, the drain
    assert flag_values(args, "--default-method") == ["eagle"] and flag_values(args, "--drain-seconds") == ["30"]
    # a specfleet fleet: its arms' worker Services, no pool
    theirs = m.router_args(SDD, with_defaults({"model": {"name": "llama", "uri": "/models/llama"}, "replicas": 1}),
                           m.Settings())
    assert flag_values(theirs, "--discover-kubernetes") == ["stable=demo--stable", "canary=demo--canary"]
    assert "--discover-vllm" not in theirs


def test_the_router_takes_the_rendered_flags_and_follows_each_pools_service():
    """The contract, from the router's side: its own parser and discovery read the rendered flags
    (argv less the `router` subcommand) as one Service per arm and method, in the fleet's namespace."""
    from specfleet_router.k8s_discovery import KubernetesDiscovery
    from specfleet_router.main import build_parser, config_from_args
    s = spec(draft={"method": "eagle", "uri": "/heads/e"}, canary={"weight": 5, "replicas": 1})
    args = build_parser().parse_args(container(by_kind(m.children(SDD, s, m.Settings()))[
        ("Deployment", "demo--router")])["args"][1:])
    assert config_from_args(args).namespace == "ml"
    discovery = KubernetesDiscovery.from_flags(args.discover_kubernetes, "ml", vllm_specs=args.discover_vllm)
    assert discovery.services == {f"{p.role}/{p.method}": m.vllm_pool_name("demo", p.role, p.method)
                                  for p in vllm.pools(s)}
    assert set(discovery.services) == {f"{role}/{method}" for role in ("stable", "canary")
                                       for method in ("ngram", "eagle", "none")}


def test_the_operators_vllm_images_are_the_default_and_engine_vllm_image_wins():
    """--vllm-image / --vllm-cpu-image (the chart's vllm.image / vllm.cpuImage) replace the pinned
    upstream images; a fleet's engine.vllm.image replaces both."""
    settings = parse_args(["--vllm-image=registry.local/vllm:gpu", "--vllm-cpu-image=registry.local/vllm:cpu"]).worker
    assert (settings.vllm_image, settings.vllm_cpu_image) == ("registry.local/vllm:gpu", "registry.local/vllm:cpu")
    assert container(pool(by_kind(m.children(SDD, spec(), settings))))["image"] == "registry.local/vllm:cpu"
    assert container(pool(by_kind(m.children(SDD, spec(device="cuda"), settings))))["image"] == \
        "registry.local/vllm:gpu"
    own = spec(engine={"name": "vllm", "vllm": {"image": "mine/vllm:1"}})
    assert container(pool(by_kind(m.children(SDD, own, settings))))["image"] == "mine/vllm:1"
    default = parse_args([]).worker
    assert (default.vllm_image, default.vllm_cpu_image) == (vllm.GPU_IMAGE, vllm.CPU_IMAGE)
    with pytest.raises(SystemExit):
        parse_args(["--vllm-cpu-image="])


def _status_of(s, ready_by_pool, router_ready=2):
    """The status the operator writes for SDD with each pool's Deployment as rendered, `ready_by_pool`
    pods ready in it (method -> n; a method left out: no Deployment yet)."""
    kids = by_kind(m.children(SDD, s, m.Settings()))
    serving = []
    for served in m.serving_deployments("demo", s):
        method = served.name.rsplit("-", 1)[1]
        d = kids[("Deployment", served.name)] if method in ready_by_pool else None
        if d is not None:
            d = {**d, "status": {"readyReplicas": ready_by_pool[method], "updatedReplicas": ready_by_pool[method]}}
        serving.append((served, d))
    router = {"spec": {"replicas": 2}, "status": {"readyReplicas": router_ready, "updatedReplicas": router_ready}}
    body = {**SDD, "spec": s}
    observed = handlers._observed(body, s, handlers.canary_state({}), handlers._arm(serving, "stable"),
                                  handlers._arm(serving, "canary") or None, [], router=router)
    return compute(observed, None, "2025-01-01T00:00:00Z")


def test_ready_reads_the_stable_pools_deployments():
    """Ready is the stable arm's pools (spec.replicas 2 each, the plain pool 1) all rolled out, and the
    router; one pool short is not made up for by another's surge pod."""
    s = spec(engine={"name": "vllm", "vllm": {"pools": {"none": {"replicas": 1}}}})
    assert [(x.name, x.replicas, x.redis) for x in m.serving_deployments("demo", s)] == [
        ("demo--vllm-stable-ngram", 2, False), ("demo--vllm-stable-none", 1, False)]
    ok = _status_of(s, {"ngram": 2, "none": 1})
    ready = condition(ok, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "WorkersReady")
    assert ready["message"].startswith("3/3 stable vLLM servers ready") and ok["replicas"] == {"desired": 3, "ready": 3}
    short = condition(_status_of(s, {"ngram": 3, "none": 0}), "Ready")  # a surge pod in ngram, none down
    assert (short["status"], short["reason"], short["message"]) == ("False", "WorkersNotReady",
                                                                    "2/3 stable vLLM servers ready")
    creating = condition(_status_of(s, {"ngram": 2}), "Ready")  # the plain pool's Deployment not made yet
    assert (creating["status"], creating["reason"]) == ("False", "Creating") and "vLLM servers" in creating["message"]
    router = condition(_status_of(s, {"ngram": 2, "none": 1}, router_ready=0), "Ready")
    assert (router["status"], router["reason"]) == ("False", "RouterNotReady")


def test_a_vllm_fleets_alerts_read_vllms_counters_from_its_stable_pools():
    s = spec(observability={"prometheusRule": {"enabled": True}}, slo={"window": "10m", "minDraftTokens": 50})
    rule = by_kind(m.children(SDD, s, m.Settings()))[("PrometheusRule", "demo--alerts")]
    rules = rule["spec"]["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [m.ALERT_VLLM_ALPHA, m.ALERT_FALLBACK, m.ALERT_ROUTER_REDIS,
                                           m.ALERT_REDIS_AUTH]
    alpha = rules[0]["expr"]
    fleet = 'namespace="ml", serving_specfleet_dev_deployment="demo", serving_specfleet_dev_role!="canary"'
    assert f"increase(vllm:spec_decode_num_accepted_tokens_total{{{fleet}}}[10m])" in alpha
    assert f"increase(vllm:spec_decode_num_draft_tokens_total{{{fleet}}}[10m])) >= 50" in alpha
    assert "spec_decode_acceptance_rate" not in alpha and rules[0]["labels"]["sdd_name"] == "demo"
    from specfleet_operator.alerts import SLO_ALERTS
    assert m.ALERT_VLLM_ALPHA in SLO_ALERTS  # the receiver turns it into the loop's fallback


def test_the_schemas_of_every_version_are_there():
    for version in K8S_VERSIONS:  # a missing version would make the next test validate nothing
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {}},
                                     version, strict=True)


@pytest.mark.parametrize("over", [
    {"device": "cuda"},
    {"model": {"name": "llama", "uri": "llama", "source": {"initContainer": {"image": "fetch:1"}}},
     "canary": {"weight": 1}, "observability": {"prometheusRule": {"enabled": True}}},
    {"draft": {"method": "medusa", "uri": "/heads/m"}, "template": {"resources": GPU, "tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], "runtimeClassName": "nvidia"},
     "strategy": {"type": "Recreate"}},
], ids=["cuda", "canary-init", "medusa-gpu"])
def test_every_vllm_child_validates_on_kubernetes_1_29_to_1_35(over):
    for obj in m.children(SDD, spec(**over), m.Settings()):
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", ["llama", "qwen2.5-72b-instruct", "x" * 63, "7b-chat", "a--b"])
def test_pool_names_are_dns_labels_whatever_the_resource_is_named(name):
    for role in fs.ROLES:
        for method in vllm.METHODS:
            child = m.vllm_pool_name(name, role, method)
            assert len(child) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", child), child


def _doc_specs():
    for block in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "vllm.md").read_text(), re.S):
        found = yaml.safe_load(block)
        if found.get("kind") == KIND:
            yield pytest.param(found, id=found["metadata"]["name"])


@pytest.mark.parametrize("doc", _doc_specs())
def test_the_vllm_docs_examples_are_accepted_and_render_valid_restricted_pools(doc):
    s = with_defaults(doc["spec"])
    assert problems(s) == []
    pools = [o for o in m.children({"metadata": {**doc["metadata"], "uid": "u"}}, s, m.Settings())
             if o["kind"] == "Deployment" and m.LABEL_METHOD in o["metadata"]["labels"]]
    assert pools
    for d in pools:
        kubernetes_validate.validate(d, "1.35", strict=True)
        assert_restricted(d["spec"]["template"]["spec"])


PLURALS = {"Deployment": "deployments", "Service": "services", "ConfigMap": "configmaps",
           "PodDisruptionBudget": "poddisruptionbudgets", "NetworkPolicy": "networkpolicies"}


def live(cluster, kind, name):
    api_version = {"Deployment": "apps/v1", "PodDisruptionBudget": "policy/v1",
                   "NetworkPolicy": "networking.k8s.io/v1"}.get(kind, "v1")
    return cluster.live(api_version, PLURALS[kind], "default", name)


def vllm_body(name, **spec_over):
    return sdd_body(name, **{"engine": {"name": "vllm"}, "model": {"name": "llama", "uri": "/models/llama"},
                             "speculation": {"kPolicy": "fixed", "kInitial": 4, "kMax": 4}, **spec_over})


async def test_a_vllm_fleet_is_ready_when_its_stable_pools_are_and_not_when_one_falls(cluster, kube):
    """engine vllm is served: the operator creates the pools and a router that discovers them, and
    the fleet's Ready (and status.replicas) read the pools' Deployments, not a worker Deployment."""
    op = OperatorThread(cluster.endpoint, "op-a", memo={"converge_interval": 3600.0}).start()
    try:
        await kube.create(vllm_body("served", replicas=1, engine={"name": "vllm", "vllm": {"pools": {
            "none": {"replicas": 2}}}}))

        def status():
            return (cluster.live(API_VERSION, "specdecodedeployments", "default", "served") or {}).get("status") or {}

        def ready_cond():
            cond = condition(status(), "Ready")
            return cond if cond and cond["status"] == "True" else None
        cond = await wait_for(ready_cond, 20, "Ready True")
        assert cond["reason"] == "WorkersReady" and cond["message"].startswith("3/3 stable vLLM servers ready")
        assert status()["replicas"] == {"desired": 3, "ready": 3}
        assert live(cluster, "Deployment", "served--stable") is None
        router = container(live(cluster, "Deployment", "served--router"))
        assert flag_values(router["args"], "--discover-vllm") == ["stable/ngram=served--vllm-stable-ngram",
                                                                  "stable/none=served--vllm-stable-none"]

        # the plain pool loses a server: the fleet is not Ready, and says how many are
        await kube.patch("apps/v1", "Deployment", "default", "served--vllm-stable-none",
                         {"status": {"readyReplicas": 1, "availableReplicas": 1}}, subresource="status")
        fell = await wait_for(lambda: (c := condition(status(), "Ready")) and c["status"] == "False" and c, 20,
                              "Ready False")
        assert (fell["reason"], fell["message"]) == ("WorkersNotReady", "2/3 stable vLLM servers ready")
    finally:
        await op.stop_and_join()


async def test_the_operator_reconciles_a_vllm_fleet_into_its_pools_and_drops_a_pool_whose_method_left(cluster, kube):
    body = vllm_body("chat", draft={"method": "eagle", "uri": "/heads/e"}, replicas=2)
    op = OperatorThread(cluster.endpoint, "op-a", memo={"converge_interval": 3600.0}).start()
    try:
        await kube.create(body)
        pools = {f"chat--vllm-stable-{method}" for method in ("ngram", "eagle", "none")}
        # a reconcile takes ~0.1 s on a 2-core box; 20 s holds on a CPU four times slower and a busy one
        await wait_for(lambda: all(live(cluster, k, n) for n in pools for k in ("Deployment", "Service"))
                       and live(cluster, "Deployment", "chat--router"), 20, "the pools and the router")
        owner = cluster.live(API_VERSION, "specdecodedeployments", "default", "chat")["metadata"]["uid"]
        for name in pools:
            d = live(cluster, "Deployment", name)
            assert [r["uid"] for r in d["metadata"]["ownerReferences"]] == [owner]
            assert d["spec"]["replicas"] == 2 and container(d)["image"] == vllm.CPU_IMAGE
        # no specfleet worker, worker Service or engine.json beside the pools
        for kind, name in (("Deployment", "chat--stable"), ("Service", "chat--stable"), ("ConfigMap", "chat--engine"),
                           ("Service", "chat--metrics")):
            assert live(cluster, kind, name) is None, (kind, name)
        assert live(cluster, "NetworkPolicy", "chat--workers")["spec"]["podSelector"]["matchLabels"] == \
            m.vllm_selector("chat")

        # eagle leaves the spec: its pool goes; ngram's stays, now the arm's draft method
        await kube.patch(API_VERSION, KIND, "default", "chat", {"spec": {"draft": {"method": "ngram", "uri": None}}})
        await wait_for(lambda: live(cluster, "Deployment", "chat--vllm-stable-eagle") is None
                       and live(cluster, "Service", "chat--vllm-stable-eagle") is None, 20, "the eagle pool deleted")
        kept = {n: live(cluster, "Deployment", n) for n in ("chat--vllm-stable-ngram", "chat--vllm-stable-none")}
        assert all(kept.values())
        removed = [e["message"] for e in cluster.all_live("v1", "events") if e.get("reason") == "Removed"]
        assert any("Deployment chat--vllm-stable-eagle" in msg for msg in removed), removed

        # level-triggered: a pool deleted by hand comes back
        await kube.delete("apps/v1", "Deployment", "default", "chat--vllm-stable-none")
        await asyncio.sleep(0)  # the watch event, then the converge of that child
        back = await wait_for(lambda: (d := live(cluster, "Deployment", "chat--vllm-stable-none")) and
                              d["metadata"]["uid"] != kept["chat--vllm-stable-none"]["metadata"]["uid"] and d,
                              20, "the plain pool recreated")
        assert container(back)["args"] == container(kept["chat--vllm-stable-none"])["args"]
    finally:
        await op.stop_and_join()


async def test_a_spec_vllm_cannot_serve_creates_no_pool(cluster, kube):
    """Past an API server without the CEL rules: the operator holds it at Ready False, InvalidSpec,
    naming the field, and creates nothing."""
    op = OperatorThread(cluster.endpoint, "op-a", memo={"converge_interval": 3600.0}).start()
    try:
        await kube.create(vllm_body("adaptive", speculation={"kPolicy": "adaptive", "kInitial": 4, "kMax": 8}))

        def refused():
            sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", "adaptive") or {}
            return next((c for c in (sdd.get("status") or {}).get("conditions", [])
                         if c["type"] == "Ready" and c["reason"] == "InvalidSpec"), None)
        cond = await wait_for(refused, 20, "Ready False, InvalidSpec")
        assert "spec.speculation.kPolicy: " + vllm.K_POLICY in cond["message"]
        names = [d["metadata"]["name"] for d in cluster.all_live("apps/v1", "deployments")]
        assert not [n for n in names if n.startswith("adaptive")], names
    finally:
        await op.stop_and_join()
