"""The control loop's pure policy."""
from specfleet_operator.policy import LoopState, Metrics, Policy, RoleMetrics, decide
from specfleet_operator.spec import with_defaults

P = Policy(alpha_floor=0.3, speedup_floor=1.0, recover_after_s=600, canary_weight=1,
           steps=((5, 120.0), (50, 120.0)), analysis_interval_s=60, failure_limit=2,
           checks=(("alpha", 0.4, None), ("errorRate", None, 0.01)))
GOOD = Metrics(stable=RoleMetrics(alpha=0.6, speedup=1.5), canary=RoleMetrics(alpha=0.6, error_rate=0.0))


def run(metrics, state, times):
    events = []
    for t in times:
        d = decide(metrics, state, P, t)
        state = d.state
        events += [e[0] for e in d.events]
    return state, events


def test_fallback_entered_on_low_alpha_or_speedup_and_left_after_recovery():
    for bad in (RoleMetrics(alpha=0.2), RoleMetrics(alpha=0.5, speedup=0.8)):
        d = decide(Metrics(stable=bad), LoopState(), P, 0.0)
        assert d.state.mode == "fallback" and d.events[0][0] == "FallbackEntered"
    state = decide(Metrics(stable=RoleMetrics(alpha=0.2)), LoopState(), P, 0.0).state
    assert decide(Metrics(), state, P, 599.0).state.mode == "fallback"
    left = decide(Metrics(), state, P, 600.0)
    assert left.state.mode == "speculative" and ("FallbackLeft" in [e[0] for e in left.events])


def test_no_metrics_no_change():
    assert decide(Metrics(), LoopState(mode="speculative"), Policy(), 10.0).state.mode == "speculative"


def test_canary_walks_the_steps_then_promotes():
    state, events = run(GOOD, LoopState(), [0, 60, 120, 180, 240, 300, 360])
    assert events[0] == "CanaryStarted"
    assert events.count("CanaryStepped") == 2 and events[-1] == "CanaryPromoted"
    assert state.canary_phase == "Promoted" and state.canary_weight == 0


def test_canary_aborts_after_failure_limit():
    bad = Metrics(stable=RoleMetrics(alpha=0.6), canary=RoleMetrics(alpha=0.2, error_rate=0.0))
    state, events = run(bad, LoopState(), [0, 60, 120])
    assert events == ["CanaryStarted", "CanaryCheckFailed", "CanaryAborted"]
    assert state.canary_phase == "Aborted" and state.canary_weight == 0 and state.failed_checks == 2


def test_analysis_waits_for_the_interval():
    state = decide(GOOD, LoopState(), P, 0).state
    assert decide(GOOD, state, P, 30).state == state


def test_policy_from_spec():
    spec = with_defaults({"model": {"name": "m", "uri": "u"}, "replicas": 1,
                          "canary": {"steps": [{"weight": 10, "pause": "2m"}],
                                     "analysis": {"metrics": [{"name": "alpha", "min": 0.5}]}}})
    p = Policy.from_spec(spec)
    assert p.canary_weight == 1 and p.steps == ((10, 120.0),) and p.checks == (("alpha", 0.5, None),)
    assert p.recover_after_s == 600.0 and p.analysis_interval_s == 60.0
