"""The canary decision on what the fleet really publishes: worker windows and the routers' drift
counts written to a real Redis in their wire format, read back by the loop's reader
(specfleet_control.observe), and a Redis that dies mid-run halts the analysis instead of judging."""
import dataclasses
import json

from specfleet_api.live_state import window_key
from specfleet_api.windows import DriftCounts, TypeCounts, drift_key

from specfleet_control import canary as c
from specfleet_control import observe

NS, NAME = "ml", "chat"


def publish_window(client, arm, pod, prompt_type, **counts):
    raw = dataclasses.asdict(TypeCounts(**counts))
    raw["window_seconds"] = 60.0
    client.hset(f"{window_key(NS, NAME, arm)}:{pod}", prompt_type, json.dumps(raw))


def read(client, epoch, gate=None):
    o = observe.read(client, NS, NAME, drift_epoch=epoch)
    o = dataclasses.replace(o, ready={"stable": (2, 2), "canary": (1, 1)})
    return c.observation(o, gate)


def test_a_drifting_canary_is_aborted_on_published_counts_naming_the_request(redis_server):
    client = redis_server.client()
    good = dict(requests=30, steps=60, draft_tokens=100, accepted_tokens=50, plain_seconds=3.0, busy_seconds=2.0)
    for arm, pods in (("stable", ("s-0", "s-1")), ("canary", ("c-0",))):
        for pod in pods:
            for prompt_type in ("chat", "code"):
                publish_window(client, arm, pod, prompt_type, **good)
    p = c.CanaryPolicy(steps=((10, 600.0),), interval_s=60.0, failure_limit=2, min_requests=20,
                       drift=c.DriftPolicy(sample_share=5.0, threshold=1.0, min_pairs=20), config_hash="h")
    state = c.decide_canary(read(client, ""), c.CanaryState(), p, now=0.0).state
    assert state.phase == "Progressing" and state.epoch
    # two routers' counts of this epoch, and a stale epoch's that must not count
    diff = {"request_id": "chatcmpl-9", "position": 3, "a": 11, "b": 12}
    client.hset(drift_key(NS, NAME, "r-1"), "canary", DriftCounts(state.epoch, pairs=4, agree=4).to_json())
    client.hset(drift_key(NS, NAME, "r-2"), "canary",
                DriftCounts(state.epoch, pairs=3, agree=2, first_diff=diff).to_json())
    client.hset(drift_key(NS, NAME, "r-2"), "control", DriftCounts(state.epoch, pairs=7, agree=7).to_json())
    client.hset(drift_key(NS, NAME, "r-3"), "canary", DriftCounts("old-run", pairs=100, agree=0).to_json())
    o = read(client, state.epoch)
    assert o.stable.window.counts.requests == 120 and o.canary.window.counts.requests == 60
    assert (o.drift["canary"].pairs, o.drift["canary"].agree) == (7, 6)
    d = c.decide_canary(o, state, p, now=60.0)
    assert d.state.failed_checks == 1 and "6/7 greedy pairs agree" in d.events[-1][1]
    d = c.decide_canary(read(client, state.epoch), d.state, p, now=120.0)
    assert d.state.phase == "Aborted" and d.weight == 0
    assert "first differing request chatcmpl-9 at token 3: stable 11, canary 12" in d.events[-1][1]


def test_redis_gone_mid_run_halts_the_analysis(redis_server):
    client = redis_server.client()
    for arm in ("stable", "canary"):
        publish_window(client, arm, f"{arm}-0", "chat", requests=30, steps=60, draft_tokens=100, accepted_tokens=50)
    p = c.CanaryPolicy(interval_s=60.0, min_requests=20, drift=c.DriftPolicy(sample_share=0), config_hash="h")
    state = c.decide_canary(read(client, ""), c.CanaryState(), p, now=0.0).state
    state = c.decide_canary(read(client, ""), state, p, now=60.0).state
    assert state.analysed_s == 60.0
    redis_server.kill()
    o = read(redis_server.client(socket_timeout=1), "")
    assert o.complete is False
    d = c.decide_canary(o, state, p, now=120.0)
    assert d.state.phase == "Progressing" and d.state.analysed_s == 60.0 and d.state.failed_checks == 0
    assert "could not be read" in d.state.message


def _head_spec():
    from specfleet_operator.spec import with_defaults

    return with_defaults({
        "model": {"name": "smollm2-135m", "uri": "gguf://SmolLM2-135M-Instruct.Q4_1.gguf"}, "replicas": 2,
        "draft": {"method": "eagle", "uri": "heads/v1"},
        "canary": {"weight": 1, "overrides": {"draft": {"uri": "heads/v2"}},  # a retrained head
                   "steps": [{"weight": 10, "pause": "2m"}],
                   "analysis": {"interval": "60s", "failureLimit": 2, "minRequests": 20,
                                "drift": {"sampleShare": 0}}}})


def _publish_arms(client, canary_alpha: float, drafted: int = 4000):
    """Both arms' windows alike but for the canary head's acceptance."""
    same = dict(requests=40, steps=400, plain_seconds=14.0, busy_seconds=10.0, ttft_seconds_sum=4.0, ttft_count=40,
                tpot_seconds_sum=1.2, tpot_count=40, spec_requests=40, spec_plain_seconds=14.0,
                spec_busy_seconds=10.0)
    for arm, alpha in (("stable", 0.6), ("canary", canary_alpha)):
        publish_window(client, arm, f"{arm}-0", "chat", draft_tokens=drafted, accepted_tokens=int(alpha * drafted),
                       **same)


def _run(client, spec, times):
    section, decisions = None, []
    for now in times:
        d = c.tick(spec, {}, section, read(client, ""), now)
        section = d.state.to_status()
        decisions.append(d)
    return decisions


def test_a_degraded_head_is_aborted_within_failure_limit_intervals_naming_its_acceptance(redis_server):
    """A retrained head (canary.overrides.draft.uri) that accepts far less than stable's: each
    interval fails on the acceptance ratio's interval, and after failureLimit of them the run is
    aborted with weight 0, the evidence in the status's message."""
    client = redis_server.client()
    _publish_arms(client, canary_alpha=0.25)
    ds = _run(client, _head_spec(), (0.0, 60.0, 120.0))
    assert [d.state.phase for d in ds] == ["Progressing", "Progressing", "Aborted"] and ds[-1].weight == 0
    assert ds[1].state.failed_checks == 1
    status = ds[-1].state.to_status()
    assert "alpha 0.25 < stable 0.6" in status["message"] and "95% interval [" in status["message"], status
    assert ds[-1].state.promoted is None


def test_a_better_head_is_promoted_through_its_steps_and_the_record_names_it(redis_server):
    client = redis_server.client()
    _publish_arms(client, canary_alpha=0.7)
    ds = _run(client, _head_spec(), [60.0 * i for i in range(8)])
    phases = [(d.state.phase, d.state.step) for d in ds]
    assert ("Progressing", 1) in phases and phases[-1][0] == "Promoted", phases
    assert all(d.state.failed_checks == 0 for d in ds)
    assert ds[-1].state.promoted["overrides"] == {"draft": {"uri": "heads/v2"}}
