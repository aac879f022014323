"""What `specfleet up` would run for a file, the live state it derives and keeps, the windows it
reads back, and the status document: the pure parts, plus a real redis-server for the writer."""
from __future__ import annotations

import doctest
import json
import pathlib
import re
import time

import pytest
import yaml

from specfleet_api.live_state import KBounds, LiveState, Routing, state_key
from specfleet_api import windows
from specfleet_local import demo, plan, state, status
from specfleet_local.plan import SpecError, load_resource, make_plan
from specfleet_local.state import StateWriter, initial_state
from specfleet_api import fleet_spec as fs
from specfleet_operator import spec as specs

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"


@pytest.mark.parametrize("module", [plan, state, windows, status, demo], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0


def test_engine_json_per_arm_is_the_operators():
    resource = load_resource(EXAMPLES / "canary-1pct.yaml")
    p = make_plan(resource, workers_per_arm=2)
    spec = specs.with_defaults(resource["spec"])
    assert [a.name for a in p.arms] == ["stable", "canary"] and all(a.workers == 2 for a in p.arms)
    for arm in p.arms:
        assert arm.engine == fs.engine_config(spec, arm.name)
    assert p.arm("canary").engine["speculation"]["kMax"] == 12 and p.arm("stable").engine["speculation"]["kMax"] == 8
    assert p.deployment == "default/smollm2-canary"
    assert any("canary steps" in t for t in p.not_run)


def test_cluster_fields_are_overridden_and_named():
    p = make_plan(load_resource(EXAMPLES / "ngram.yaml"), workers_per_arm=3, redis_url="LOCAL")
    said = {o.field: o for o in p.overrides}
    assert set(said) == {"spec.replicas"}  # the example names no Redis: the local one serves it
    assert said["spec.replicas"].was == 2 and "3 worker processes per arm" in said["spec.replicas"].now
    # a field the file leaves out is not reported (defaults are the cluster's too)
    p = make_plan(load_resource(EXAMPLES / "draft-model.yaml"), model="tiny-random")
    said = {o.field for o in p.overrides}
    assert {"spec.scaling", "spec.template.image", "spec.template.resources",
            "spec.observability.otlpEndpoint", "spec.observability.serviceMonitor",
            "spec.observability.prometheusRule", "spec.model"} <= said, said
    assert all(a.engine["model"] == {"name": "tiny-random", "uri": "tiny-random", "tokenizer": None} for a in p.arms)
    resource = load_resource(EXAMPLES / "ngram.yaml")
    resource["spec"].update(strategy={"type": "Recreate"}, router={"nodeSelector": {"pool": "cpu"}})
    resource["spec"]["model"]["source"] = {"pvc": {"claimName": "weights"}}
    said = {o.field: o for o in make_plan(resource).overrides}
    assert {"spec.model.source", "spec.strategy", "spec.router.nodeSelector"} <= set(said), said
    assert "SPECFLEET_MODEL_CACHE" in said["spec.model.source"].now


def test_canary_replicas_and_image_are_overridden(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "canary-1pct.yaml").read_text())
    doc["spec"]["canary"]["replicas"] = 5
    doc["spec"]["canary"]["overrides"]["image"] = "registry.example.com/w:2"
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(doc))
    said = {o.field for o in make_plan(load_resource(f)).overrides}
    assert {"spec.canary.replicas", "spec.canary.overrides.image", "spec.replicas"} <= said


def test_a_spec_with_problems_is_refused_with_the_crds_words(tmp_path):
    reserved = yaml.safe_load((EXAMPLES / "ngram.yaml").read_text())
    reserved["spec"]["quantization"] = "fp8"
    (tmp_path / "fp8.yaml").write_text(yaml.safe_dump(reserved))
    with pytest.raises(SpecError) as e:
        make_plan(load_resource(tmp_path / "fp8.yaml"), "fp8.yaml")
    assert any("quantization 'fp8' is not supported yet" in p for p in e.value.problems), e.value.problems
    # a served method whose heads this machine lacks: refused, naming the folder looked for
    with pytest.raises(SpecError) as e:
        make_plan(load_resource(EXAMPLES / "medusa-tree.yaml"), "medusa-tree.yaml")
    assert any("no Medusa heads here: no folder at /models/llama-3.1-8b-medusa" in p
               for p in e.value.problems), e.value.problems
    # weights this machine lacks: refused before a worker would fail to load them, with the way out
    with pytest.raises(SpecError) as e:
        make_plan(load_resource(EXAMPLES / "draft-model.yaml"))
    assert any("no weights here" in p and "--model" in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("text, words", [
    ("kind: Deployment\napiVersion: apps/v1\nmetadata: {name: x}\n", "exactly one SpecDecodeDeployment"),
    ("apiVersion: serving.specfleet.dev/v1\nkind: SpecDecodeDeployment\nmetadata: {name: x}\nspec: {}\n",
     "apiVersion"),
    ("apiVersion: serving.specfleet.dev/v1alpha1\nkind: SpecDecodeDeployment\nmetadata: {name: X_1}\nspec: {}\n",
     "metadata.name"),
    ("a: [", "not valid YAML"),
])
def test_files_that_are_not_one_resource_are_refused(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=words):
        load_resource(f)


def test_the_local_example_starts_with_a_visible_canary():
    p = make_plan(load_resource(EXAMPLES / "local.yaml"))
    s = initial_state(p.spec)
    assert s.problems() == [] and s.version == 1 and time.time() - s.updated < 60
    assert s.canary_weight == 20.0 and s.speculate and s.default_method == "ngram"
    assert (s.k["stable"].k_min, s.k["stable"].k_max) == (0, 6)
    assert (s.k["canary"].k_min, s.k["canary"].k_max) == (1, 10)
    assert p.model_name == "smollm2-135m" and [a.name for a in p.arms] == ["stable", "canary"]


def test_routes_must_name_prompt_types_the_router_knows(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "local.yaml").read_text())
    doc["spec"]["routing"]["byPromptType"] = {"code": "none", "poetry": "ngram"}
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match="spec.routing.byPromptType"):
        make_plan(load_resource(f))


class Step:
    """A loop that moves the canary weight once."""

    def __init__(self, version_step: int = 1):
        self.calls, self.version_step = [], version_step

    def tick(self, current, seen, now):
        self.calls.append(seen)
        if current.canary_weight == 20.0:
            return LiveState(**{**current.__dict__, "canary_weight": 50.0,
                                "version": current.version + self.version_step})
        return None


def test_the_writer_keeps_the_key_and_writes_what_the_loop_decides(redis_server):
    client = redis_server.client()
    p = make_plan(load_resource(EXAMPLES / "local.yaml"))
    loop = Step()
    writer = StateWriter(client, "default", "local", initial_state(p.spec), loop=loop, period_s=0.05)
    writer.write()
    key = state_key("default", "local")
    assert LiveState.from_json(client.get(key)).canary_weight == 20.0
    writer.tick_once()
    written = LiveState.from_json(client.get(key))
    assert (written.version, written.canary_weight) == (2, 50.0)
    assert set(loop.calls[0].windows) == {"stable", "canary"}  # the loop sees both arms' windows
    client.delete(key)  # Redis lost it
    writer.start()
    try:
        deadline = time.monotonic() + 5
        while client.get(key) is None:
            assert time.monotonic() < deadline, "the state was not written back"
            time.sleep(0.02)
    finally:
        writer.stop()
    assert LiveState.from_json(client.get(key)).version == 2


def test_a_loop_that_does_not_raise_the_version_is_refused(redis_server):
    p = make_plan(load_resource(EXAMPLES / "local.yaml"))
    writer = StateWriter(redis_server.client(), "default", "local", initial_state(p.spec), loop=Step(version_step=0))
    writer.write()
    with pytest.raises(ValueError, match="state.next"):
        writer.tick_once()


def test_windows_are_summed_over_the_pods_of_an_arm(redis_server):
    client = redis_server.client()
    base = "specfleet:v1:default/local:window:"
    client.hset(base + "stable:pod-a", mapping={
        "code": json.dumps({"requests": 2, "steps": 10, "draft_tokens": 10, "accepted_tokens": 5,
                            "plain_seconds": 2.0, "busy_seconds": 1.0, "window_seconds": 60.0}),
        "chat": "not json"})
    client.hset(base + "stable:pod-b", mapping={
        "code": json.dumps({"requests": 1, "steps": 10, "draft_tokens": 10, "accepted_tokens": 1,
                            "plain_seconds": 1.0, "busy_seconds": 1.0, "window_seconds": 20.0})})
    client.hset(base + "canary:pod-c", mapping={"math": json.dumps({"requests": 4, "steps": 1})})
    client.hset("specfleet:v1:default/other:window:stable:pod-d", mapping={"code": json.dumps({"requests": 9})})
    seen = windows.read_windows(client, "default", "local")
    code = seen["stable"]["code"]
    assert (code.counts.requests, code.pods, code.seconds) == (3, 2, 60.0)
    assert (code.alpha, code.tau, code.speedup) == (0.3, 1.3, 1.5)
    assert set(seen["stable"]) == {"code"} and seen["canary"]["math"].counts.requests == 4
    assert seen["canary"]["math"].alpha is None  # nothing drafted: no alpha, not 0


def test_the_status_document_from_what_was_observed():
    s = LiveState(version=3, canary_weight=12.5, routes={"chat": "none"}, fallback=("code",),
                  k={"stable": KBounds(0, 6), "canary": KBounds(1, 10)}, updated=100.0,
                  arms={"canary": Routing("ngram", {"rag": "none"})}, k_ceilings={"math": 2},
                  cluster_routes={"r/2": "ngram"})
    w = windows.parse_window(json.dumps({"requests": 2, "steps": 4, "draft_tokens": 8, "accepted_tokens": 4}))
    metrics = {"specfleet_router_backend_ready": [({"arm": "stable", "backend": "a"}, 1.0),
                                                  ({"arm": "canary", "backend": "b"}, 0.0)],
               "specfleet_router_state_version": [({}, 3.0)],
               "specfleet_router_redis_connected": [({}, 1.0)],
               "specfleet_router_redis_staleness_seconds": [({}, 0.25)]}
    obs = status.Observed("default", "local", "redis://127.0.0.1:1/0", "http://127.0.0.1:8000",
                          {"arms": {"stable": {"workers": 1}, "canary": {"workers": 1}}, "model": "m"},
                          state=s, windows={"stable": {"math": w}, "canary": {"math": w}}, metrics=metrics,
                          readyz=(200, "ready (stable: 1, canary: 0)\n"), now=130.0)
    doc = status.document(obs)
    assert [(a["name"], a["weight"], a["replicas"], a["ready"]) for a in doc["arms"]] == [
        ("stable", 87.5, 1, 1), ("canary", 12.5, 1, 0)]
    assert doc["ready"] == "1/2" and doc["mode"] == "speculative" and doc["alpha"] == 0.5
    types = {t["name"]: t for t in doc["promptTypes"]}
    assert (types["chat"]["method"], types["chat"]["mode"]) == ("none", "speculative")
    assert (types["code"]["method"], types["code"]["mode"]) == ("none", "fallback")
    assert (types["math"]["method"], types["math"]["alpha"], types["math"]["tau"], types["math"]["requests"]) == (
        "ngram", 0.5, 2.0, 4)
    assert types["math"]["byArm"]["canary"]["requests"] == 2 and types["rag"]["alpha"] is None
    # the canary's own routing table: its method per type beside the stable arm's
    assert (types["rag"]["method"], types["rag"]["byArm"]["canary"]["method"]) == ("ngram", "none")
    assert (types["chat"]["method"], types["chat"]["byArm"]["canary"]["method"]) == ("none", "ngram")
    assert doc["kBounds"] == {"stable": {"kMin": 0, "kMax": 6}, "canary": {"kMin": 1, "kMax": 10}}
    assert doc["redis"] == {"url": "redis://127.0.0.1:1/0", "connected": True, "error": None, "stateVersion": 3,
                            "stateAgeSeconds": 30.0, "routerConnected": True, "secondsStale": 0.25}
    text = status.table(doc)
    assert re.search(r"^canary +12\.5% +1 +0 +1-10$", text, re.M), text
    assert re.search(r"^code +none +6 +fallback +- +- +- +0$", text, re.M), text
    assert re.search(r"^rag +ngram \(canary: none\) +6 +speculative", text, re.M), text
    assert types["math"]["kMax"] == 2 and re.search(r"^math +ngram +2 +speculative", text, re.M), text  # the loop's
    assert doc["clusterMethods"] == {"r/2": "ngram"}
    assert "prompt clusters on a method of their own: r/2 ngram" in text
    # nothing reachable: the document says so instead of guessing
    empty = status.document(status.Observed("default", "local", "redis://x", None, redis_error="refused"))
    assert empty["mode"] is None and empty["redis"]["connected"] is False and empty["arms"][0]["weight"] is None


def test_the_local_loop_is_the_operators_it_falls_back_per_type_and_says_so_in_redis(redis_server):
    """`specfleet up` runs specfleet_control's loop on the windows in the local Redis: a collapsed
    prompt type goes into the live state's fallback list; the loop's memory and events are mirrored
    for `specfleet status`; missing data (Redis away) decides nothing."""
    from specfleet_local.state import ControlLoop, loop_key
    from specfleet_operator.testing import publish_window

    client = redis_server.client()
    p = make_plan(load_resource(EXAMPLES / "local.yaml"))
    loop = ControlLoop(p.spec, readiness=lambda: {"stable": (1, 1), "canary": (1, 1)})
    now = [1000.0]

    def clock():  # a window (20 s in local.yaml) between two ticks
        now[0] += 30.0
        return now[0]
    writer = StateWriter(client, "default", "local", initial_state(p.spec), loop=loop, clock=clock)
    writer.write()
    for t in ("code", "chat"):
        publish_window(client, "default", "local", t, alpha=0.6)
    writer.tick_once()
    first = writer.state.version  # the canary's run started: its share, the drift epoch
    assert loop.memory.keys["type:code"].baseline == 0.6 and loop.canary.phase == "Progressing"
    assert writer.state.canary_weight == 20 and writer.state.drift_epoch == loop.canary.epoch
    publish_window(client, "default", "local", "code", alpha=0.02, speedup=0.85)
    writer.tick_once()
    state = LiveState.from_json(client.get(state_key("default", "local")))
    assert state.version == first + 1 and state.fallback == ("code",) and state.probe_share == 5.0
    doc = json.loads(client.get(loop_key("default", "local")))
    assert doc["fallback"]["promptTypes"] == ["code"] and doc["events"][-1]["reason"] == "FallbackEntered"
    assert doc["canary"]["phase"] == "Progressing"
    writer.tick_once()
    assert writer.state.version == first + 1  # nothing new: no new version
    from specfleet_control.observe import Observation
    assert loop.tick(writer.state, Observation(complete=False, error="ConnectionError"), clock()) is None
    assert loop.skipped == 1 and loop.memory.fallback_types() == ("code",)
