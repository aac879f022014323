"""The status is one pure function of what was observed."""
import pytest
from specfleet_api.fleet_spec import FleetState
from specfleet_operator.spec import Problem
from specfleet_operator.status import Observed, Workers, compute, condition

T0, T1 = "2025-01-01T00:00:00Z", "2025-01-01T00:05:00Z"
ROUTER = Workers(desired=2, ready=2, updated=2)


def test_ready_when_every_worker_is_ready():
    s = compute(Observed(generation=3, stable=Workers(desired=2, ready=2, updated=2), k_bounds=(1, 6),
                         router=ROUTER), None, T0)
    ready = condition(s, "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == 3 and ready["lastTransitionTime"] == T0
    assert condition(s, "Progressing")["status"] == "False"
    assert s["observedGeneration"] == 3 and s["replicas"] == {"desired": 2, "ready": 2}
    assert s["kRange"] == "1-6" and s["mode"] == "speculative" and s["router"] == {"desired": 2, "ready": 2}
    assert {c["type"] for c in s["conditions"]} == {"Ready", "Progressing", "Degraded", "Speculating",
                                                    "CanaryProgressing", "Reconciling", "Stalled",
                                                    "PromotedNotInSpec"}
    for c in s["conditions"]:
        assert set(c) == {"type", "status", "reason", "message", "observedGeneration", "lastTransitionTime"}


def test_rolling_out_is_progressing_not_ready():
    s = compute(Observed(generation=2, stable=Workers(desired=2, ready=2, updated=1)), None, T0)
    assert condition(s, "Ready")["status"] == "False"
    assert condition(s, "Progressing")["reason"] == "RollingOut"


def test_a_generation_whose_children_are_not_all_applied_is_not_ready():
    """The workers observed are the last generation's while this one's children are applied."""
    ready = Workers(desired=2, ready=2, updated=2)
    s = compute(Observed(generation=4, applied_generation=3, stable=ready, router=ROUTER), None, T0)
    assert (condition(s, "Ready")["status"], condition(s, "Ready")["reason"]) == ("False", "Reconciling")
    assert "generation 4" in condition(s, "Ready")["message"]
    assert condition(s, "Progressing")["status"] == "True"
    for applied in (4, None):  # applied, or unknown (an operator just restarted): the workers decide
        s = compute(Observed(generation=4, applied_generation=applied, stable=ready, router=ROUTER), None, T0)
        assert condition(s, "Ready")["status"] == "True" and condition(s, "Progressing")["status"] == "False"


def test_transition_time_kept_while_status_unchanged():
    first = compute(Observed(generation=1, stable=Workers(desired=1, ready=1, updated=1), router=ROUTER), None, T0)
    again = compute(Observed(generation=2, stable=Workers(desired=1, ready=1, updated=1), router=ROUTER), first, T1)
    assert condition(again, "Ready")["lastTransitionTime"] == T0
    down = compute(Observed(generation=2, stable=Workers(desired=1, ready=0, updated=1), router=ROUTER), again, T1)
    assert condition(down, "Ready")["lastTransitionTime"] == T1


def test_invalid_spec_names_the_field():
    s = compute(Observed(generation=1, problems=(Problem("spec.speculation", "kMin <= kInitial <= kMax"),)), None, T0)
    ready = condition(s, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.speculation" in ready["message"]
    assert condition(s, "Degraded")["status"] == "True"


def test_fallback_shows_in_mode_conditions_and_k():
    """k_bounds come in force (fleet_spec.k_bounds): the status says them as they are."""
    s = compute(Observed(generation=1, stable=Workers(1, 1, 1), state=FleetState(mode="fallback"),
                         k_bounds=(0, 0)), None, T0)
    assert s["mode"] == "fallback" and s["kBounds"] == {"min": 0, "max": 0} and s["kRange"] == "0-0"
    assert condition(s, "Speculating")["status"] == "False"
    assert condition(s, "Degraded")["reason"] == "Fallback"


def test_canary_progress_reported():
    s = compute(Observed(generation=1, stable=Workers(100, 100, 100), canary=Workers(1, 1, 1),
                         state=FleetState(canary_weight=0.5, canary_phase="Progressing"), canary_step=0,
                         failed_checks=1, router=ROUTER), None, T0)
    assert s["canary"] == {"weight": 0.5, "step": 0, "phase": "Progressing", "failedChecks": 1}
    assert condition(s, "Ready")["status"] == "True"
    assert condition(s, "CanaryProgressing")["status"] == "True"
    assert s["replicas"] == {"desired": 101, "ready": 101}


def test_workers_from_deployment_wait_for_the_controller():
    body = {"metadata": {"generation": 2}, "spec": {"replicas": 2},
            "status": {"observedGeneration": 1, "readyReplicas": 2, "updatedReplicas": 2}}
    assert not Workers.from_deployment(body).rolled_out
    body["status"]["observedGeneration"] = 2
    assert Workers.from_deployment(body).rolled_out


def test_a_spec_no_worker_serves_is_unsupported_not_ready_and_not_speculating():
    fp8 = Problem("spec.quantization", "quantization 'fp8' is not supported yet; supported: none, int8", "Unsupported")
    s = compute(Observed(generation=1, problems=(fp8,), draft_method="eagle"), None, T0)
    ready, speculating = condition(s, "Ready"), condition(s, "Speculating")
    assert (ready["status"], ready["reason"]) == ("False", "Unsupported") and "not supported yet" in ready["message"]
    assert (speculating["status"], speculating["reason"]) == ("False", "Unsupported")
    mixed = compute(Observed(generation=1, problems=(fp8, Problem("spec", "set exactly one of ..."))), None, T0)
    assert condition(mixed, "Ready")["reason"] == "InvalidSpec"  # something the user must fix comes first


def test_not_ready_until_the_router_is():
    """Workers without a ready router are unreachable: the fleet is not Ready, and says why."""
    workers = Workers(desired=2, ready=2, updated=2)
    for router, message in [(None, "the router is being created"),
                            (Workers(desired=2, ready=1, updated=2), "1/2 router pods ready")]:
        s = compute(Observed(generation=1, stable=workers, router=router), None, T0)
        ready = condition(s, "Ready")
        assert (ready["status"], ready["reason"], ready["message"]) == ("False", "RouterNotReady", message)
    rolling = compute(Observed(generation=1, stable=workers, router=Workers(desired=2, ready=1, updated=1)), None, T0)
    assert condition(rolling, "Progressing")["status"] == "True"
    ok = compute(Observed(generation=1, stable=workers, router=ROUTER), None, T0)
    assert condition(ok, "Ready")["status"] == "True" and condition(ok, "Progressing")["status"] == "False"


def test_a_status_write_for_an_invalid_spec_keeps_the_mode_and_the_canary_run():
    """An invalid spec stops the loop; it must not reset its memory (fallback -> speculative with no
    Event, a canary run back to Idle)."""
    before = compute(Observed(generation=1, stable=Workers(1, 1, 1), router=ROUTER, state=FleetState(mode="fallback"),
                              canary_status={"phase": "Progressing", "step": 1, "weight": 10.0, "failedChecks": 1,
                                             "epoch": "e-1"}), None, T0)
    assert before["mode"] == "fallback"
    bad = compute(Observed(generation=2, problems=(Problem("spec.speculation", "kMin <= kInitial <= kMax"),)),
                  before, T1)
    assert bad["mode"] == "fallback" and bad["canary"] == before["canary"]
    assert condition(bad, "Ready")["reason"] == "InvalidSpec"
    fresh = compute(Observed(generation=1, problems=(Problem("spec", "x"),)), None, T0)
    assert fresh["mode"] == "speculative" and fresh["canary"]["phase"] == "Idle"


def test_the_canary_section_is_the_canary_runs():
    from specfleet_control.canary import CanaryState

    run = CanaryState("Waiting", 0, 1.0, started=1.7e9, epoch="abc-1", config_hash="abc",
                      message="waiting for the canary workers: 0/1 ready")
    s = compute(Observed(generation=1, stable=Workers(2, 2, 2), canary=Workers(1, 0, 0), router=ROUTER,
                         canary_status=run.to_status()), None, T0)
    assert s["canary"] == run.to_status()
    cond = condition(s, "CanaryProgressing")
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "True", "CanaryWaiting", "waiting for the canary workers: 0/1 ready")
    paused = compute(Observed(generation=1, stable=Workers(2, 2, 2), router=ROUTER,
                              canary_status={"phase": "Paused", "step": 0, "weight": 1.0}), None, T0)
    assert condition(paused, "CanaryProgressing")["reason"] == "CanaryPaused"
    assert condition(paused, "CanaryProgressing")["status"] == "True"


def _promoted(spec_over=None, phase="Promoted", prev=None, problems=()):
    """The status the operator writes for a fleet whose canary promoted kMax 12 over the spec's 8."""
    from specfleet_control.canary import CanaryState
    from specfleet_operator import handlers
    from specfleet_operator.spec import with_defaults
    from specfleet_operator.testing import sdd_body

    body = sdd_body("demo", speculation={"kMax": 8, **(spec_over or {})})
    record = {"overrides": {"speculation": {"kMax": 12}}, "base": {"speculation": {"kMax": 8}}}
    cstate = CanaryState.from_status({"phase": phase, "step": 0, "weight": 0.0, "promoted": record})
    if problems:
        return compute(Observed(generation=2, problems=problems), prev, T1)
    observed = handlers._observed(body, with_defaults(body["spec"]), cstate, None, None, [],
                                  router={"spec": {"replicas": 2}, "status": {"readyReplicas": 2, "updatedReplicas": 2}})
    return handlers._status(observed, {"status": prev or {}}, handlers.memory_of({}))


def test_a_promotion_not_in_the_spec_is_a_condition_and_a_column_until_folded():
    for phase in ("Promoted", "Idle"):  # Idle: spec.canary removed after the promotion
        s = _promoted(phase=phase)
        cond = condition(s, "PromotedNotInSpec")
        assert (cond["status"], cond["reason"]) == ("True", "PromotedOverridesNotInSpec")
        assert "speculation.kMax=12" in cond["message"] and "fold them into the spec" in cond["message"]
        assert s["notInSpec"] == "speculation.kMax=12"
    folded = _promoted({"kMax": 12}, prev=s)  # the spec now holds it: nothing left to say
    assert condition(folded, "PromotedNotInSpec")["status"] == "False"
    assert folded["notInSpec"] is None  # the merge patch removes the column's value
    superseded = _promoted({"kMax": 6}, prev=s)  # set otherwise: the spec wins
    assert condition(superseded, "PromotedNotInSpec")["status"] == "False"
    # an invalid spec writes nothing new: what was last known stays
    held = _promoted(prev=s, problems=(Problem("spec.speculation", "kMin <= kInitial <= kMax"),))
    assert condition(held, "PromotedNotInSpec") == condition(s, "PromotedNotInSpec")
    assert held["notInSpec"] == "speculation.kMax=12"


def test_kstatus_reconciling_while_rolling_out_then_reconciled():
    creating = compute(Observed(generation=1), None, T0)
    assert [condition(creating, t)["status"] for t in ("Reconciling", "Stalled")] == ["True", "False"]
    assert condition(creating, "Reconciling")["reason"] == "Creating"
    rolling = compute(Observed(generation=2, stable=Workers(2, 2, 1), router=ROUTER), None, T0)
    assert (condition(rolling, "Reconciling")["status"], condition(rolling, "Reconciling")["reason"]) == \
        ("True", "WorkersNotReady")
    pending = compute(Observed(generation=4, applied_generation=3, stable=Workers(2, 2, 2), router=ROUTER), None, T0)
    assert condition(pending, "Reconciling")["status"] == "True"
    router = compute(Observed(generation=1, stable=Workers(2, 2, 2)), None, T0)
    assert condition(router, "Reconciling")["reason"] == "RouterNotReady"
    done = compute(Observed(generation=1, stable=Workers(2, 2, 2), router=ROUTER), None, T0)
    assert [(condition(done, t)["status"], condition(done, t)["reason"]) for t in ("Reconciling", "Stalled")] == \
        [("False", "Reconciled"), ("False", "AsExpected")]


@pytest.mark.parametrize("observed, reason", [
    (Observed(generation=1, problems=(Problem("spec.speculation", "kMin <= kInitial <= kMax"),)), "InvalidSpec"),
    (Observed(generation=1, stable=Workers(2, 0, 0), router=ROUTER,
              conflicts=("Deployment demo-stable is controlled by Job x (uid 1), not by this resource",)),
     "ChildOwnedByAnother"),
    (Observed(generation=1, stable=Workers(2, 0, 0), apply_error="HorizontalPodAutoscaler: HTTP 403 Forbidden"),
     "ApplyFailed"),
])
def test_kstatus_stalled_names_why_and_is_not_reconciling(observed, reason):
    s = compute(observed, None, T0)
    stalled, reconciling = condition(s, "Stalled"), condition(s, "Reconciling")
    assert (stalled["status"], stalled["reason"]) == ("True", reason) and stalled["message"]
    assert reconciling["status"] == "False"  # kstatus reads Reconciling first: a stalled fleet is Failed
    assert condition(s, "Ready")["reason"] == reason  # the Reason column


def test_kstatus_stalled_when_redis_cannot_be_written():
    from specfleet_operator.redis_state import Health
    s = compute(Observed(generation=1, stable=Workers(2, 2, 2), router=ROUTER,
                         redis=Health(False, "Unreachable", "connection refused")), None, T0)
    assert (condition(s, "Stalled")["status"], condition(s, "Stalled")["reason"]) == ("True", "RedisUnreachable")
    assert "connection refused" in condition(s, "Stalled")["message"]


def test_the_crd_lists_every_condition_the_status_writes():
    from specfleet_operator.spec import crd
    from specfleet_operator.status import CONDITION_TYPES
    status = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["conditions"]["items"]["properties"]["type"]["enum"]) == {*CONDITION_TYPES, "RedisReady"}
    assert "notInSpec" in status


@pytest.mark.parametrize("fallback", [{"enabled": True, "probeShare": 5}, {"enabled": True, "probeShare": 0}])
@pytest.mark.parametrize("method", ["ngram", "none"])
@pytest.mark.parametrize("whole", [False, True])
def test_the_status_k_bounds_are_the_live_states(fallback, method, whole):
    """status.kBounds is what the workers run with: the live state's stable bounds. It once said
    kMax 0 in a fallback whose probes still speculated, and kMax 8 with draft.method none."""
    from specfleet_api import fleet_spec
    from specfleet_control.loop import DEPLOYMENT, Memory
    from specfleet_control.slo import FALLBACK, KeyState
    from specfleet_operator import handlers
    from specfleet_operator.spec import with_defaults
    from specfleet_operator.testing import sdd_body

    body = sdd_body("demo", draft={"method": method}, slo={"fallback": fallback})
    spec = with_defaults(body["spec"])
    memory = Memory({DEPLOYMENT: KeyState(mode=FALLBACK, since=1.0)}) if whole else Memory()
    cstate = handlers.canary_state({})
    observed = handlers._observed(body, spec, cstate, None, None, [], memory=memory)
    s = compute(observed, None, T0)
    live = fleet_spec.live_state(spec, handlers.fleet_state(cstate, spec, memory)).k["stable"]
    assert s["kBounds"] == {"min": live.k_min, "max": live.k_max}
    assert (s["kBounds"]["max"] > 0) == (method == "ngram" and (not whole or fallback["probeShare"] > 0))
