"""The real kopf operator, in-process, against kmock's KubernetesEmulator on loopback."""
import json
import pathlib
import time

import yaml

from specfleet_operator import API_VERSION, KIND, manifests as m
from specfleet_operator.kube import ApiError
from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
SDDS = "specdecodedeployments"
CHILD_PLURALS = {"ConfigMap": ("v1", "configmaps"), "Service": ("v1", "services"),
                 "Deployment": ("apps/v1", "deployments"), "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
                 "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
                 "ServiceMonitor": ("monitoring.coreos.com/v1", "servicemonitors"),
                 "PrometheusRule": ("monitoring.coreos.com/v1", "prometheusrules"),
                 "ServiceAccount": ("v1", "serviceaccounts"), "Role": ("rbac.authorization.k8s.io/v1", "roles"),
                 "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
                 "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies")}


def example(name):
    return yaml.safe_load((ROOT / "deploy" / "examples" / f"{name}.yaml").read_text())


def children_of(cluster, sdd_name, ns="default"):
    out = {}
    for api_version, kind, name in m.child_refs(sdd_name):
        obj = cluster.live(api_version, CHILD_PLURALS[kind][1], ns, name)
        if obj is not None:
            out[(kind, name)] = obj
    return out


def pod_hash(deployment):
    return deployment["spec"]["template"]["metadata"]["annotations"][m.ANNOTATION_CONFIG_HASH]


def events(cluster, reason):
    return [e for e in cluster.all_live("v1", "events") if e.get("reason") == reason]


async def test_example_creates_every_child_owned_labelled_and_secured(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        created = await kube.create(example("draft-model"))
        try:
            await wait_for(lambda: ready(cluster, "smollm2-draft"), 8, "smollm2-draft Ready")
        except AssertionError:
            print(cluster.live(API_VERSION, SDDS, "default", "smollm2-draft"))
            print([e.get("message") for e in cluster.all_live("v1", "events")])
            raise
        kids = children_of(cluster, "smollm2-draft")
        assert set(kids) == {("ConfigMap", "smollm2-draft--engine"), ("Service", "smollm2-draft"),
                             ("Service", "smollm2-draft--stable"),
                             ("Service", "smollm2-draft--metrics"), ("Deployment", "smollm2-draft--stable"),
                             ("PodDisruptionBudget", "smollm2-draft--stable"),
                             ("HorizontalPodAutoscaler", "smollm2-draft--stable"),
                             ("ServiceMonitor", "smollm2-draft--workers"), ("PrometheusRule", "smollm2-draft--alerts"),
                             ("Deployment", "smollm2-draft--router"), ("ServiceAccount", "smollm2-draft--router"),
                             ("Role", "smollm2-draft--router"), ("RoleBinding", "smollm2-draft--router"),
                             ("PodDisruptionBudget", "smollm2-draft--router"), ("NetworkPolicy", "smollm2-draft--workers")}
        for obj in kids.values():
            (owner,) = obj["metadata"]["ownerReferences"]
            assert owner == {"apiVersion": API_VERSION, "kind": KIND, "name": "smollm2-draft",
                             "uid": created["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
            assert obj["metadata"]["labels"][m.LABEL_SDD] == "smollm2-draft"
        pod = kids[("Deployment", "smollm2-draft--stable")]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert pod["containers"][0]["resources"]["requests"]["cpu"] == "4"
        assert pod["containers"][0]["image"] == example("draft-model")["spec"]["template"]["image"]
        engine = json.loads(kids[("ConfigMap", "smollm2-draft--engine")]["data"]["engine.json"])
        assert engine["draft"] == {"method": "draft-model", "uri": "gguf:///models/SmolLM2-135M-Instruct.Q8_0.gguf"}
        assert engine["routing"]["byPromptType"] == {"code": "ngram", "chat": "draft-model"}
        assert engine["quantization"] == "int8" and engine["role"] == "stable"
        status = cluster.live(API_VERSION, SDDS, "default", "smollm2-draft")["status"]
        assert status["observedGeneration"] == 1 and status["kRange"] == "1-6"
        assert status["router"] == {"desired": 2, "ready": 2}
        router = kids[("Deployment", "smollm2-draft--router")]["spec"]["template"]["spec"]
        assert router["serviceAccountName"] == "smollm2-draft--router"
        assert "--discover-kubernetes" in router["containers"][0]["args"]
        await wait_for(lambda: events(cluster, "Created"), 10, "Created event")
    finally:
        await op.stop_and_join()
    assert op.result == 0


async def test_update_rolls_exactly_the_stable_deployment(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await kube.create(example("canary-1pct"))
        await wait_for(lambda: ready(cluster, "smollm2-canary"), 20, "Ready")
        before = children_of(cluster, "smollm2-canary")
        canary_writes = cluster.writes("PATCH", "/deployments/smollm2-canary--canary")
        # kMax is overridden by the canary, so only the stable workers' config changes.
        await kube.patch(API_VERSION, KIND, "default", "smollm2-canary", {"spec": {"speculation": {"kMax": 6}}})
        stable_key = ("Deployment", "smollm2-canary--stable")
        await wait_for(lambda: pod_hash(children_of(cluster, "smollm2-canary")[stable_key]) != pod_hash(
            before[stable_key]), 20, "stable rolled")
        await wait_for(lambda: cluster.live(API_VERSION, SDDS, "default", "smollm2-canary")["status"]
                       .get("observedGeneration") == 2, 20, "generation 2 observed")
        after = children_of(cluster, "smollm2-canary")
        canary_key = ("Deployment", "smollm2-canary--canary")
        assert pod_hash(after[canary_key]) == pod_hash(before[canary_key])
        assert cluster.writes("PATCH", "/deployments/smollm2-canary--canary") == canary_writes
        engine = json.loads(after[("ConfigMap", "smollm2-canary--engine")]["data"]["engine.json"])
        assert engine["speculation"]["kMax"] == 6
        # kopf posts events from a background queue, after the handler has returned.
        await wait_for(lambda: events(cluster, "Rolled"), 10, "Rolled event")
        assert len(events(cluster, "Rolled")) == 1
    finally:
        await op.stop_and_join()


async def test_only_the_routers_reach_the_workers_and_an_edit_that_opens_them_is_reverted(cluster, kube):
    """The reconcile creates the workers' NetworkPolicy as manifests builds it, owned like every child,
    and the converge watch puts back a hand edit that admits every pod to every port."""
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        created = await kube.create(sdd_body("demo", canary={"weight": 5}))
        await wait_for(lambda: ready(cluster, "demo"), 20, "demo Ready")
        name, (api_version, plural) = m.child_name("demo", "workers"), CHILD_PLURALS["NetworkPolicy"]
        want = m.worker_network_policy(created)

        def live():
            return cluster.live(api_version, plural, "default", name)
        assert live()["spec"] == want["spec"] and live()["metadata"]["labels"] == want["metadata"]["labels"]
        assert live()["metadata"]["ownerReferences"] == [m.owner_reference(created)]
        selected = want["spec"]["podSelector"]["matchLabels"].items()
        for arm in ("stable", "canary"):  # both arms' pods are the policy's
            pods = children_of(cluster, "demo")[("Deployment", f"demo--{arm}")]["spec"]["template"]["metadata"]
            assert selected <= pods["labels"].items()
        await kube.patch(api_version, "NetworkPolicy", "default", name, {"spec": {"ingress": [{}]}})
        await wait_for(lambda: live()["spec"] == want["spec"], 10, "the NetworkPolicy restored")
    finally:
        await op.stop_and_join()
    assert op.result == 0


async def test_delete_removes_every_child_and_the_finalizer(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await kube.create(example("canary-1pct"))
        await wait_for(lambda: ready(cluster, "smollm2-canary"), 20, "Ready")
        # engine ConfigMap; front, stable, canary, 2 metrics Services; 2 worker Deployments + PDB; the
        # router's Deployment, ServiceAccount, Role, RoleBinding, PDB; the workers' NetworkPolicy
        assert len(children_of(cluster, "smollm2-canary")) == 15
        await kube.delete(API_VERSION, KIND, "default", "smollm2-canary")
        await wait_for(lambda: cluster.live(API_VERSION, SDDS, "default", "smollm2-canary") is None, 20, "SDD gone")
        assert children_of(cluster, "smollm2-canary") == {}
    finally:
        await op.stop_and_join()


async def test_dropping_the_canary_removes_its_children(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await kube.create(example("canary-1pct"))
        await wait_for(lambda: ready(cluster, "smollm2-canary"), 20, "Ready")
        await kube.patch(API_VERSION, KIND, "default", "smollm2-canary", {"spec": {"canary": None}})
        await wait_for(lambda: ("Deployment", "smollm2-canary--canary") not in children_of(cluster, "smollm2-canary"),
                       20, "canary removed")
        assert ("Service", "smollm2-canary--canary-metrics") not in children_of(cluster, "smollm2-canary")
    finally:
        await op.stop_and_join()


async def test_invalid_spec_gets_a_condition_and_event_not_a_crash(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        bad = sdd_body("bad", speculation={"kMin": 6, "kInitial": 2, "kMax": 8})  # CEL would reject it
        await kube.create(bad)

        def invalid():
            st = (cluster.live(API_VERSION, SDDS, "default", "bad") or {}).get("status", {})
            return [c for c in st.get("conditions", []) if c["type"] == "Ready" and c["reason"] == "InvalidSpec"]
        (cond,) = await wait_for(invalid, 20, "InvalidSpec condition")
        assert cond["status"] == "False" and "spec.speculation" in cond["message"]
        await wait_for(lambda: events(cluster, "InvalidSpec"), 10, "InvalidSpec event")
        assert children_of(cluster, "bad") == {}
        # a tree shape CEL cannot judge (not prefix-closed): engine_config's words reach the condition and an event
        await kube.create(sdd_body("bad-tree", speculation={"tree": {"branching": 2, "choices": [[0], [1, 0]]}}))
        words = "spec.speculation.tree.choices: speculation.tree.choices[1] [1, 0]: its prefix [1] is not listed"
        cond = await wait_for(lambda: conditions(cluster, "bad-tree").get("Ready", {}).get("reason") == "InvalidSpec"
                              and conditions(cluster, "bad-tree")["Ready"], 20, "bad-tree InvalidSpec")
        assert cond["status"] == "False" and words in cond["message"]
        await wait_for(lambda: [e for e in events(cluster, "InvalidSpec") if words in e.get("message", "")], 10,
                       "bad-tree InvalidSpec event")
        assert children_of(cluster, "bad-tree") == {}
        await kube.create(sdd_body("good"))  # the operator keeps working
        await wait_for(lambda: ready(cluster, "good"), 20, "good Ready")
    finally:
        await op.stop_and_join()
    assert op.result == 0


def conditions(cluster, name):
    st = (cluster.live(API_VERSION, SDDS, "default", name) or {}).get("status", {})
    return {c["type"]: c for c in st.get("conditions", [])}


async def test_what_no_worker_serves_is_held_unsupported_before_any_pod(cluster, kube):
    """The emulator runs no CEL, as an API server that predates a rule would not: the operator
    itself holds a reserved quantization, and a URI scheme only it judges, at Ready=False."""
    op = OperatorThread(cluster.endpoint, "op-a").start()
    try:
        await kube.create(sdd_body("fp8-tree", quantization="fp8", speculation={"tree": {"branching": 3, "depth": 5}}))
        await kube.create(sdd_body("from-hub", model={"name": "m", "uri": "hf://org/model"}))
        for name, words in [("fp8-tree", ["quantization 'fp8' is not supported yet"]),
                            ("from-hub", ["model.uri scheme 'hf' is not supported yet"])]:
            cond = await wait_for(lambda: conditions(cluster, name).get("Ready", {}).get("reason") == "Unsupported"
                                  and conditions(cluster, name), 20, f"{name} Unsupported")
            assert cond["Ready"]["status"] == "False" and all(w in cond["Ready"]["message"] for w in words)
            assert "speculation.tree" not in cond["Ready"]["message"]  # branching 3 is a cap every method serves
            assert cond["Speculating"]["status"] == "False" and cond["Speculating"]["reason"] == "Unsupported"
            assert children_of(cluster, name) == {}  # no ConfigMap, no Deployment: no pod ever starts
        await wait_for(lambda: len(events(cluster, "Unsupported")) >= 2, 10, "Unsupported events")
        assert cluster.writes("POST", "/deployments") == 0
        # fixing the spec is all it takes: the same resource then gets its workers
        await kube.patch(API_VERSION, KIND, "default", "from-hub",
                         {"spec": {"model": {"uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"}}})
        await wait_for(lambda: ready(cluster, "from-hub"), 20, "from-hub Ready once served")
        assert ("Deployment", "from-hub--stable") in children_of(cluster, "from-hub")
    finally:
        await op.stop_and_join()
    assert op.result == 0


async def test_restart_mid_reconcile_creates_no_duplicates_and_no_writes(cluster, kube):
    names = [f"fleet-{i}" for i in range(6)]
    op = OperatorThread(cluster.endpoint, "op-a").start()
    for name in names:
        await kube.create(sdd_body(name, canary={"weight": 10}))
    await wait_for(lambda: cluster.all_live("apps/v1", "deployments"), 20, "a first Deployment")
    await op.stop_and_join()  # stopped in the middle of the work
    op2 = OperatorThread(cluster.endpoint, "op-b").start()
    try:
        await wait_for(lambda: all(ready(cluster, n) for n in names), 30, "all Ready after restart")
        deployments = [d["metadata"]["name"] for d in cluster.all_live("apps/v1", "deployments")]
        assert sorted(deployments) == sorted(f"{n}--{r}" for n in names for r in ("stable", "canary", "router"))
        assert cluster.writes("POST", "/deployments") >= len(deployments)  # a 409 on a retried create is fine
    finally:
        await op2.stop_and_join()
    writes = lambda: sum(cluster.writes(v, p) for v in ("POST", "PATCH") for p in (
        "/deployments", "/services", "/configmaps", "/serviceaccounts", "/roles", "/rolebindings"))
    before = writes()
    op3 = OperatorThread(cluster.endpoint, "op-c").start()  # a restart with nothing to do
    try:
        await wait_for(lambda: op3.ready.is_set(), 10, "op-c ready")
        await wait_for(lambda: cluster.writes("GET", "/deployments/fleet-5--canary") > 0, 10, "resumed")
        time_limit = time.monotonic() + 1.0
        while time.monotonic() < time_limit:
            await __import__("asyncio").sleep(0.1)
        assert writes() == before
    finally:
        await op3.stop_and_join()


async def test_kubectl_objects_conflict_is_handled_as_already_there(cluster, kube):
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "default"},
            "data": {"a": "1", "b": "2"}}
    assert (await kube.apply(body))[0] == "created"
    assert (await kube.apply(body))[0] == "unchanged"
    body["data"].pop("b")
    action, live = await kube.apply(body)
    assert action == "updated" and live["data"] == {"a": "1"}
    try:
        await kube.create(body)
    except ApiError as exc:
        assert exc.status == 409
    else:
        raise AssertionError("a second create must conflict")


async def test_a_json_patch_on_a_stale_resource_version_is_unprocessable(cluster, kube):
    """What kopf relies on when it writes finalizers: a JSON patch whose `test` of the
    resourceVersion fails is answered 422 (kopf tries again on its next cycle), not 500 (kopf
    would retry the stale patch with backoffs for up to a minute)."""
    path = "api/v1/namespaces/default/configmaps/c"
    created = await kube.create({"apiVersion": "v1", "kind": "ConfigMap",
                                 "metadata": {"name": "c", "namespace": "default"}, "data": {"a": "1"}})
    rv = created["metadata"]["resourceVersion"]
    patched = await kube.request("PATCH", path, [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/data/b", "value": "2"}], content_type="application/json-patch+json")
    assert patched["data"] == {"a": "1", "b": "2"}
    await kube.patch("v1", "ConfigMap", "default", "c", {"data": {"b": "3"}})  # a write since rv
    try:
        await kube.request("PATCH", path, [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                                           {"op": "add", "path": "/data/c", "value": "3"}],
                           content_type="application/json-patch+json")
    except ApiError as exc:
        assert exc.status == 422, exc
    else:
        raise AssertionError("a JSON patch testing a stale resourceVersion must not apply")
    assert "c" not in cluster.live("v1", "configmaps", "default", "c")["data"]


async def test_control_loop_falls_back_per_prompt_type_and_recovers_through_the_probe(cluster, kube, redis_server):
    """The loop reads the workers' windows in Redis: a prompt type whose alpha collapses falls
    back alone (status, Event, the live state's fallback list), the workers are not restarted, and
    a healthy probe brings it back after recoverAfter."""
    from specfleet_operator.testing import publish_window, stored_live_state as stored
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=0.2).start()
    client = redis_server.client()
    slo = {"window": "1s", "minDraftTokens": 100, "fallback": {"recoverAfter": "1s", "minDwell": "1s"}}
    try:
        await kube.create(sdd_body("slo", redis={"url": redis_server.url}, slo=slo))
        await wait_for(lambda: ready(cluster, "slo"), 20, "Ready")
        sdd = lambda: cluster.live(API_VERSION, SDDS, "default", "slo")["status"]
        hash_before = pod_hash(children_of(cluster, "slo")[("Deployment", "slo--stable")])
        publish_window(client, "default", "slo", "code", alpha=0.6)
        publish_window(client, "default", "slo", "chat", alpha=0.6)
        await wait_for(lambda: sdd().get("slo", {}).get("keys", {}).get("type:code", {}).get("baseline"), 10,
                       "a baseline learned")
        publish_window(client, "default", "slo", "code", alpha=0.02, speedup=0.9)  # the SLO is missed
        await wait_for(lambda: sdd().get("fallback", {}).get("promptTypes") == ["code"], 10, "code in fallback")
        # the status is written first, then the live state (in the same status write): wait for both
        state = await wait_for(lambda: (st := stored(client, name="slo")) is not None and st.fallback == ("code",) and st, 5,
                               "code in the live state's fallback")
        assert state.speculate and state.method_for("chat") == "ngram"
        assert state.route("code", draw=1.0) == ("ngram", True)  # the probe
        assert sdd()["mode"] == "speculative"  # the deployment as a whole still speculates
        assert pod_hash(children_of(cluster, "slo")[("Deployment", "slo--stable")]) == hash_before
        await wait_for(lambda: events(cluster, "FallbackEntered"), 10, "FallbackEntered event")
        publish_window(client, "default", "slo", "code", alpha=0.6)  # the probe is healthy again
        await wait_for(lambda: sdd().get("fallback", {}).get("promptTypes") == [], 10, "code back")
        await wait_for(lambda: stored(client, name="slo").fallback == (), 5, "code out of the live state's fallback")
        await wait_for(lambda: events(cluster, "FallbackLeft"), 10, "FallbackLeft event")
    finally:
        await op.stop_and_join()

async def test_control_loop_moves_a_prompt_type_to_the_draft_method_that_pays_on_it(cluster, kube, redis_server):
    """An EAGLE deployment serves two methods: the loop reads each method's window on a type,
    moves chat to n-gram where it is clearly faster (status.methods, a MethodChanged Event, the
    live state's routes and exploration), leaves the pinned type alone, restarts no worker."""
    from specfleet_operator.testing import publish_window, stored_live_state as stored
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=0.2).start()
    client = redis_server.client()
    try:
        await kube.create(sdd_body("sel", redis={"url": redis_server.url}, slo={"window": "1s"},
                                   draft={"method": "eagle", "uri": "smollm2-135m-eagle"},
                                   speculation={"kTuning": {"enabled": True}},
                                   routing={"byPromptType": {"code": "eagle"}, "select": {"minDwell": "1s"}}))
        await wait_for(lambda: ready(cluster, "sel"), 20, "Ready")
        sdd = lambda: cluster.live(API_VERSION, SDDS, "default", "sel")["status"]
        hash_before = pod_hash(children_of(cluster, "sel")[("Deployment", "sel--stable")])
        state = await wait_for(lambda: stored(client, name="sel"), 10, "a live state")
        assert state.candidates == ("ngram", "eagle") and state.explore_share == 5.0 and state.pinned == ("code",)
        for t in ("chat", "code"):  # n-gram is 1.6x faster than the head on both
            publish_window(client, "default", "sel", t, alpha=0.5, speedup=1.05)
            publish_window(client, "default", "sel", t, alpha=0.4, speedup=1.0, method="eagle", spread=0.1)
            publish_window(client, "default", "sel", t, alpha=0.6, speedup=1.6, method="ngram", requests=6, spread=0.1)
        await wait_for(lambda: sdd().get("methods") == {"chat": "ngram"}, 10, "chat moved to n-gram")
        state = await wait_for(lambda: (st := stored(client, name="sel")).method_for("chat") == "ngram" and st, 5,
                               "chat routed to n-gram in the live state")
        assert state.method_for("code") == "eagle" and state.method_for("math") == "eagle"  # a pin; the default
        assert state.route("chat", draw=99.0) == ("eagle", False)  # chat now explores the head
        [event] = await wait_for(lambda: events(cluster, "MethodChanged"), 10, "MethodChanged event")
        assert event["message"].startswith("prompt type chat: eagle -> ngram: speedup 1.60x against 1.00x")
        assert pod_hash(children_of(cluster, "sel")[("Deployment", "sel--stable")]) == hash_before
        # on n-gram (most of its steps now; the head explores), chat's drafts rarely hold past two
        # positions: the loop sets its K ceiling there
        publish_window(client, "default", "sel", "chat", alpha=0.4, speedup=1.0, method="eagle", requests=1)
        publish_window(client, "default", "sel", "chat", alpha=0.6, speedup=1.6, method="ngram", requests=6,
                       spread=0.1, gains=(0.8, 0.4, 0.08, 0.01))
        await wait_for(lambda: sdd().get("kCeilings") == {"chat": 2}, 10, "chat's K ceiling in the status")
        await wait_for(lambda: stored(client, name="sel").k_ceilings == {"chat": 2}, 5, "in the live state")
        [event] = await wait_for(lambda: events(cluster, "KCeilingChanged"), 10, "KCeilingChanged event")
        assert event["message"].startswith("prompt type chat (ngram): kMax none -> 2: acceptance by position 0.80")
        assert pod_hash(children_of(cluster, "sel")[("Deployment", "sel--stable")]) == hash_before
    finally:
        await op.stop_and_join()
