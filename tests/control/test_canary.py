"""The canary's pure policy (specfleet_control.canary): every semantic of docs/canary.md, tick by tick."""
import dataclasses

import pytest
from specfleet_api.windows import TPOT_BUCKETS, TTFT_BUCKETS, DriftCounts, TypeCounts, Window, bucket_of

from specfleet_control import canary as c
from specfleet_control.observe import Observation
from specfleet_operator.spec import with_defaults

BASE = {"model": {"name": "m", "uri": "u"}, "replicas": 2}


def window(requests=100, alpha=0.5, tau_steps=100, speedup=1.5, ttft=0.1, tpot=0.02, errors=0, drafted=400):
    """A window of `requests` requests with these figures (latencies: every request at that value)."""
    accepted = int(drafted * alpha)
    ttft_hist = [0] * (len(TTFT_BUCKETS) + 1)
    ttft_hist[bucket_of(ttft, TTFT_BUCKETS)] = requests
    tpot_hist = [0] * (len(TPOT_BUCKETS) + 1)
    tpot_hist[bucket_of(tpot, TPOT_BUCKETS)] = requests
    return Window(TypeCounts(requests=requests, steps=tau_steps, draft_tokens=drafted, accepted_tokens=accepted,
                             plain_seconds=speedup * 10, busy_seconds=10.0, errors=errors,
                             ttft_hist=tuple(ttft_hist), tpot_hist=tuple(tpot_hist)), 1, 60.0)


GOOD = window()


def obs(canary=GOOD, stable=GOOD, ready=(1, 1), drift=None, complete=True, gate=None):
    return c.CanaryObservation(c.ArmView(stable, 4, 4), c.ArmView(canary, *ready), drift or {}, complete, gate)


def policy(**over):
    kw = dict(weight=1, steps=((10, 120.0), (50, 120.0)), pause_s=120.0, interval_s=60.0, failure_limit=3,
              min_requests=20, progress_deadline_s=600.0, drift=c.DriftPolicy(sample_share=0), config_hash="cfg-1",
              overrides={"speculation": {"kMax": 12}}, base={"speculation": {"kMax": 8}})
    kw.update(over)
    return c.CanaryPolicy(**kw)


def run(states_obs, p, state=None, start=0.0):
    """Feed (seconds, observation) ticks; return every decision."""
    state = state or c.CanaryState()
    out = []
    for t, o in states_obs:
        d = c.decide_canary(o, state, p, now=start + t)
        out.append(d)
        state = d.state
    return out


def progressing(p, t=0.0):
    """A run whose canary became ready at t: Progressing, last analysis at t."""
    d = run([(t, obs(ready=(0, 1))), (t, obs())], p)[-1]
    assert d.state.phase == "Progressing"
    return d.state


def reasons(decisions):
    return [r for d in decisions for r, _ in d.events]


# -- manual gates in the annotation ----------------------------------------------------------------

def test_gate_from_annotations():
    ann = lambda v: {"annotations": {c.GATE_ANNOTATION: v}}  # noqa: E731
    assert [c.gate_from_annotations(ann(v)) for v in ("pause", "resume", "PROMOTE", " abort ")] == \
        ["pause", "resume", "promote", "abort"]
    assert c.gate_from_annotations({"annotations": {"other": "x"}}) is None
    assert c.gate_from_annotations(None) is None and c.gate_from_annotations(ann("")) is None
    with pytest.raises(ValueError, match=r"serving.specfleet.dev/canary: 'ship-it' is not a canary gate"):
        c.gate_from_annotations(ann("ship-it"))


# -- readiness and the progress deadline ------------------------------------------------------------

def test_no_analysis_until_every_canary_worker_is_ready():
    p = policy()
    bad = window(alpha=0.01, ttft=20.0)  # would fail every check
    ds = run([(0, obs(bad, ready=(0, 2))), (120, obs(bad, ready=(1, 2))), (300, obs(bad, ready=(1, 2)))], p)
    assert [d.state.phase for d in ds] == ["Waiting"] * 3
    assert all(d.weight == 0 and d.mirror_share == 0 for d in ds)
    assert all(d.state.failed_checks == 0 and d.state.last_analysis is None for d in ds)
    assert "1/2 ready" in ds[-1].state.message and ds[0].drift_epoch == ds[0].state.epoch != ""
    section = ds[-1].state.to_status()  # `kubectl get sdd` shows the share routed now
    assert (section["weight"], section["stepWeight"]) == (0.0, 1)
    d = c.decide_canary(obs(ready=(2, 2)), ds[-1].state, p, now=310.0)
    assert d.state.phase == "Progressing" and d.weight == 1 and d.state.ready_since == 310.0
    assert [r for r, _ in d.events] == ["CanaryReady"]


def test_not_ready_by_the_progress_deadline_aborts():
    p = policy(progress_deadline_s=600.0)
    ds = run([(0, obs(ready=(0, 1))), (600, obs(ready=(0, 1))), (601, obs(ready=(0, 1)))], p)
    assert [d.state.phase for d in ds] == ["Waiting", "Waiting", "Aborted"]
    reason, message = ds[-1].events[-1]
    assert reason == "CanaryAborted" and "not ready within progressDeadline 600s (0/1 ready)" in message
    assert ds[-1].weight == 0 and ds[-1].state.weight == 0


def test_a_canary_loading_longer_than_the_analysis_window_is_not_judged():
    """The old loop counted "no metrics" as a failed check: a pod still loading was aborted after
    failureLimit x interval. Now it waits, up to the deadline."""
    p = policy(failure_limit=3, interval_s=60.0, progress_deadline_s=900.0)
    ds = run([(t, obs(canary=None, ready=(0, 1))) for t in range(0, 841, 60)], p)
    assert {d.state.phase for d in ds} == {"Waiting"} and ds[-1].state.failed_checks == 0


# -- missing data halts ----------------------------------------------------------------------------

@pytest.mark.parametrize("missing, words", [
    (dict(complete=False), "could not be read"),
    (dict(canary=None), "no window from the canary workers"),
    (dict(stable=None), "no window from the stable workers"),
    (dict(canary=window(requests=5)), "5 canary requests in the interval, fewer than minRequests 20"),
    (dict(stable=window(requests=0)), "0 stable requests"),
    (dict(ready=(0, 1)), "0/1 canary workers ready"),
])
def test_missing_data_halts_the_analysis_and_aborts_only_after_the_deadline(missing, words):
    p = policy(progress_deadline_s=600.0)
    s = progressing(p)
    ds = run([(t, obs(**missing)) for t in range(60, 601, 60)], p, s)
    for d in ds:
        assert d.state.phase == "Progressing" and d.state.step == 0 and d.state.analysed_s == 0
        assert d.state.failed_checks == 0 and d.state.last_analysis == 0.0
        assert words in d.state.message
    assert reasons(ds) == ["CanaryAnalysisHalted"]  # once, not every tick
    late = c.decide_canary(obs(**missing), ds[-1].state, p, now=601.0)
    assert late.state.phase == "Aborted" and late.weight == 0
    assert "no analysis for progressDeadline 600s" in late.events[-1][1] and words in late.events[-1][1]


def test_halted_time_does_not_count_towards_a_step():
    p = policy(pause_s=180.0)
    s = progressing(p)
    ds = run([(60, obs()), (120, obs(complete=False)), (180, obs(complete=False)), (240, obs()), (300, obs())], p, s)
    assert [(d.state.step, d.state.analysed_s) for d in ds] == [(0, 60.0), (0, 60.0), (0, 60.0), (0, 120.0), (1, 0.0)]
    assert ds[-1].weight == 10  # after three passing intervals (180 s analysed), not at t=180


# -- the comparison checks -------------------------------------------------------------------------

@pytest.mark.parametrize("worse, ok, tolerance, words", [
    (dict(alpha=0.2), dict(alpha=0.46), {}, "alpha 0.2 < stable 0.5"),
    (dict(tau_steps=130), dict(tau_steps=105), {}, "tau"),
    (dict(speedup=1.3), dict(speedup=1.4), {}, "speedup 1.3 < stable 1.5"),
    (dict(ttft=0.2), dict(ttft=0.2), dict(ttft_p50=2.0, ttft_p99=2.0), "TTFT P50"),
    (dict(tpot=0.03), dict(tpot=0.03), dict(tpot_p50=2.0, tpot_p99=2.0), "TPOT P50"),
    (dict(errors=5), dict(errors=1), {}, "error rate"),
])
def test_each_comparison_fails_a_worse_canary_and_passes_one_within_tolerance(worse, ok, tolerance, words):
    """(Latencies are histograms: a canary in the next bucket up is judged with a wider tolerance.)"""
    failed = c.analyse(obs(canary=window(**worse)), policy()).failed
    assert failed and any(words in f for f in failed), failed
    assert c.analyse(obs(canary=window(**ok)), policy(compare=c.Compare(**tolerance))).failed == ()


def test_an_acceptance_regression_fails_when_its_interval_says_so_not_on_a_point():
    """A retrained head at 0.84x stable's alpha: over 400 drafted tokens an arm (a 1% canary's
    interval) that is within chance of the line, and passes; over 40000 on each arm it is a
    regression, and the failure names the ratio's interval."""
    p = policy(compare=c.Compare(tau=0.5))  # tau, a point check, follows alpha
    few = c.analyse(obs(canary=window(alpha=0.42)), p).failed
    assert few == (), few
    many = c.analyse(obs(canary=window(alpha=0.42, drafted=40000), stable=window(drafted=40000)), p).failed
    assert len(many) == 1 and many[0].startswith("alpha 0.42 < stable 0.5 x (1 - 0.1) = 0.45; the ratio 0.84, "
                                                 "95% interval ["), many
    assert "(over 40000 and 40000 drafted tokens)" in many[0]


def with_request_speedups(w, spread, seed=0):
    """`w` with each request's own speedup counted: log speedups spread around the window's."""
    import math
    import random
    rng = random.Random(seed)
    n = w.counts.requests
    logs = [math.log(w.speedup) + rng.gauss(0.0, spread) for _ in range(n)]
    return dataclasses.replace(w, counts=dataclasses.replace(
        w.counts, spec_speedups=n, spec_log_speedup_sum=sum(logs), spec_log_speedup_sq=sum(x * x for x in logs)))


def test_a_slower_canary_speedup_fails_only_when_its_requests_say_so():
    """1% of the traffic is a few requests an interval, and requests' speedups spread with their
    prompts: a canary at 0.8x stable's speedup over 20 requests as spread as n-gram drafts make them
    is not failed; the same ratio over requests alike is, the interval in the message; a canary
    within the tolerance passes however sure."""
    stable = with_request_speedups(window(requests=400, speedup=1.5), 0.5, seed=1)
    spread = with_request_speedups(window(requests=20, speedup=1.2), 0.6, seed=2)
    assert c.analyse(obs(canary=spread, stable=stable), policy()).failed == ()
    alike = with_request_speedups(window(requests=20, speedup=1.2), 0.05, seed=3)
    failed = c.analyse(obs(canary=alike, stable=stable), policy()).failed
    assert len(failed) == 1 and "speedup 1.2 < stable 1.5" in failed[0] and "95% interval" in failed[0], failed
    many = with_request_speedups(window(requests=2000, speedup=1.2), 0.6, seed=4)  # spread, but many: sure
    assert c.analyse(obs(canary=many, stable=stable), policy()).failed != ()
    close = with_request_speedups(window(requests=2000, speedup=1.4), 0.05, seed=5)
    assert c.analyse(obs(canary=close, stable=stable), policy()).failed == ()


def test_p99_latencies_are_compared_with_their_own_tolerance():
    tail = window()
    hist = list(tail.counts.ttft_hist)
    hist[bucket_of(0.1, TTFT_BUCKETS)] -= 3
    hist[bucket_of(8.0, TTFT_BUCKETS)] += 3  # 3% of requests 80x slower: P50 unchanged, P99 not
    slow = dataclasses.replace(tail, counts=dataclasses.replace(tail.counts, ttft_hist=tuple(hist)))
    failed = c.analyse(obs(canary=slow), policy()).failed
    assert len(failed) == 1 and failed[0].startswith("TTFT P99")
    assert c.analyse(obs(canary=slow), policy(compare=c.Compare(ttft_p99=100.0))).failed == ()


def test_absolute_metrics_checks():
    p = policy(checks=(("alpha", 0.6, None), ("errorRate", None, 0.5)))
    assert c.analyse(obs(), p).failed == ("alpha 0.5 outside [0.6, inf]",)
    assert c.analyse(obs(), policy(checks=(("alpha", 0.4, 0.9),))).failed == ()


def test_failure_limit_failed_analyses_abort_with_weight_zero():
    p = policy(failure_limit=3)
    s = progressing(p)
    bad = obs(canary=window(alpha=0.2))
    ds = run([(60, bad), (90, bad), (120, bad), (180, bad)], p, s)
    assert [d.state.failed_checks for d in ds] == [1, 1, 2, 3]  # one analysis per interval
    assert [d.state.phase for d in ds] == ["Progressing"] * 3 + ["Aborted"]
    assert reasons(ds) == ["CanaryCheckFailed", "CanaryCheckFailed", "CanaryAborted"]
    assert ds[-1].weight == 0 and "3 failed analyses (failureLimit 3)" in ds[-1].events[-1][1]
    assert "alpha" in ds[-1].events[-1][1]
    after = c.decide_canary(obs(), ds[-1].state, p, now=400.0)
    assert after.state.phase == "Aborted" and after.weight == 0 and after.events == ()


def test_steps_advance_after_their_pause_and_the_last_promotes():
    p = policy(steps=((10, 120.0), (50, 60.0)), pause_s=60.0)
    s = progressing(p)
    ds = run([(t, obs()) for t in (60, 120, 180, 240, 300)], p, s)
    assert [(d.state.phase, d.state.step, d.weight) for d in ds] == [
        ("Progressing", 1, 10), ("Progressing", 1, 10), ("Progressing", 2, 50), ("Promoted", 2, 0.0),
        ("Promoted", 2, 0.0)]
    assert reasons(ds) == ["CanaryStepped", "CanaryStepped", "CanaryPromoted"]
    record = ds[-1].state.promoted
    assert record["overrides"] == {"speculation": {"kMax": 12}} and record["base"] == {"speculation": {"kMax": 8}}
    assert "fold them into the spec" in ds[3].events[-1][1]
    assert ds[-1].drift_epoch == "" and ds[-1].mirror_share == 0


def test_no_steps_promotes_after_the_pause_at_the_start_weight_and_never_without_data():
    p = policy(steps=(), pause_s=180.0)
    s = progressing(p)
    starved = run([(t, obs(canary=None)) for t in range(60, 541, 60)], p, s)
    assert {d.state.phase for d in starved} == {"Progressing"}
    ds = run([(t, obs()) for t in (60, 120, 180)], p, s)
    assert [d.state.phase for d in ds] == ["Progressing", "Progressing", "Promoted"]


# -- output drift ----------------------------------------------------------------------------------

DIFF = {"request_id": "req-42", "position": 17, "a": 1001, "b": 2002}


def drift_policy(**over):
    return policy(steps=(), pause_s=60.0, drift=c.DriftPolicy(**{"sample_share": 2.0, "threshold": 1.0,
                                                                  "min_pairs": 20, **over}))


def test_exact_drift_fails_at_the_first_differing_pair_and_names_it():
    p = drift_policy()
    d = {"canary": DriftCounts("e", pairs=5, agree=4, first_diff=DIFF), "control": DriftCounts("e", pairs=5, agree=5)}
    (failed,) = c.analyse(obs(drift=d), p).failed
    assert "4/5 greedy pairs agree" in failed and "first differing request req-42 at token 17" in failed
    assert "stable 1001, canary 2002" in failed


def test_greedy_drift_is_judged_against_the_control_pairs_and_the_threshold():
    p = drift_policy(threshold=0.95)
    noisy = DriftCounts("e", pairs=100, agree=96)  # the fleet itself reproduces 96%
    assert c.analyse(obs(drift={"canary": DriftCounts("e", pairs=100, agree=92), "control": noisy}), p).failed == ()
    failed = c.analyse(obs(drift={"canary": DriftCounts("e", pairs=100, agree=90, first_diff=DIFF),
                                  "control": noisy}), p).failed
    assert len(failed) == 1 and "need 0.912" in failed[0] and "req-42" in failed[0]
    # below minPairs and not exact: not judged yet
    early = c.analyse(obs(drift={"canary": DriftCounts("e", pairs=10, agree=5)}), p)
    assert early.failed == () and not early.drift_judged


def test_promotion_waits_for_the_drift_evidence_and_the_deadline_ends_a_run_without_it():
    p = drift_policy(min_pairs=20)
    s = progressing(p)
    few = {"canary": DriftCounts("e", pairs=3, agree=3)}
    ds = run([(t, obs(drift=few)) for t in range(60, 601, 60)], p, s)
    assert {d.state.phase for d in ds} == {"Progressing"} and "output-drift pairs" in ds[-1].state.message
    assert ds[0].mirror_share == 2.0 and ds[0].drift_epoch == s.epoch
    assert c.decide_canary(obs(drift=few), ds[-1].state, p, now=660.0).state.phase == "Aborted"
    enough = {"canary": DriftCounts("e", pairs=20, agree=20)}
    assert c.decide_canary(obs(drift=enough), ds[2].state, p, now=240.0).state.phase == "Promoted"


def test_a_drifting_canary_is_aborted_within_failure_limit_intervals():
    p = dataclasses.replace(drift_policy(), steps=((10, 600.0),), failure_limit=3)
    s = progressing(p)
    d = {"canary": DriftCounts("e", pairs=2, agree=1, first_diff=DIFF)}
    ds = run([(t, obs(drift=d)) for t in (60, 120, 180)], p, s)
    assert ds[-1].state.phase == "Aborted" and ds[-1].weight == 0 and "req-42" in ds[-1].events[-1][1]


def test_the_default_threshold_is_exact_on_the_same_precision_and_not_judged_across_precisions():
    same = c.CanaryPolicy.from_spec(with_defaults({**BASE, "canary": {"overrides": {"speculation": {"kMax": 4}}}}))
    assert same.drift.threshold == 1.0 and same.drift.sampled_max_mean_diff == 0.01
    other = c.CanaryPolicy.from_spec(with_defaults({**BASE, "canary": {"overrides": {"quantization": "int8"}}}))
    assert other.drift.threshold is None and other.drift.sampled_max_mean_diff is None
    set_ = c.CanaryPolicy.from_spec(with_defaults({**BASE, "canary": {
        "overrides": {"quantization": "int8"}, "analysis": {"drift": {"threshold": 1.0}}}}))
    assert set_.drift.threshold == 1.0


def test_sampled_drift_two_sample_test_with_an_effect_size_floor():
    noise = DriftCounts("e", scored=50, logprob_diff_sum=0.0, logprob_diff_sq_sum=0.0004 * 5000, logprob_tokens=5000)
    # float noise: tiny differences, very well measured (t is huge): the floor keeps it passing
    tiny = DriftCounts("e", scored=50, logprob_diff_sum=0.002 * 5000, logprob_diff_sq_sum=1e-5 * 5000,
                       logprob_tokens=5000)
    assert c.sampled_drift(tiny, None, 0.01, 20) is None
    # a real shift, well measured: fails, Welch against the control pairs
    shifted = DriftCounts("e", scored=50, logprob_diff_sum=0.2 * 5000, logprob_diff_sq_sum=0.09 * 5000,
                          logprob_tokens=5000)
    msg = c.sampled_drift(shifted, noise, 0.01, 20)
    assert msg and "Welch t" in msg and "0.20000 nats/token" in msg
    assert "paired t" in c.sampled_drift(shifted, None, 0.01, 20)
    # a large mean from a handful of noisy tokens: not significant
    vague = DriftCounts("e", scored=50, logprob_diff_sum=0.5 * 3, logprob_diff_sq_sum=25.0 * 3, logprob_tokens=3)
    assert c.sampled_drift(vague, noise, 0.01, 20) is None
    assert c.sampled_drift(dataclasses.replace(shifted, scored=5), noise, 0.01, 20) is None  # below minPairs
    p = drift_policy()
    failed = c.analyse(obs(drift={"canary": shifted, "control": noise}), p)
    assert failed.drift_judged and len(failed.failed) == 1 and "sampled drift" in failed.failed[0]


# -- manual gates ----------------------------------------------------------------------------------

def test_pause_freezes_the_run_and_resume_continues_it():
    p = policy(progress_deadline_s=300.0, failure_limit=1)
    s = progressing(p)
    s = c.decide_canary(obs(), s, p, now=60.0).state
    assert (s.step, s.analysed_s) == (0, 60.0)
    bad = obs(canary=window(alpha=0.1), gate="pause")
    ds = run([(t, bad) for t in (120, 600, 1200)], p, s)
    assert [d.state.phase for d in ds] == ["Paused"] * 3 and reasons(ds) == ["CanaryPaused"]
    assert all(d.weight == 1 and d.state.failed_checks == 0 and d.state.analysed_s == 60.0 for d in ds)
    resumed = c.decide_canary(obs(gate="resume"), ds[-1].state, p, now=1210.0)
    assert resumed.state.phase == "Progressing" and [r for r, _ in resumed.events] == ["CanaryResumed"]
    assert resumed.weight == 1  # the pause past the deadline did not abort it
    nxt = c.decide_canary(obs(gate="resume"), resumed.state, p, now=1270.0)
    assert nxt.state.step == 1 and nxt.weight == 10


def test_pause_while_waiting_keeps_weight_zero():
    p = policy()
    d = run([(0, obs(ready=(0, 1))), (10, obs(gate="pause"))], p)[-1]
    assert d.state.phase == "Paused" and d.weight == 0
    d = c.decide_canary(obs(gate=None), d.state, p, now=20.0)
    assert d.state.phase == "Progressing" or d.state.phase == "Waiting"
    assert ("CanaryResumed" in [r for r, _ in d.events])


def test_promote_gate_promotes_now_and_abort_gate_aborts_now():
    p = policy()
    s = progressing(p)
    d = c.decide_canary(obs(gate="promote"), s, p, now=5.0)
    assert d.state.phase == "Promoted" and d.weight == 0 and d.clear_gate
    assert d.state.promoted["overrides"] == {"speculation": {"kMax": 12}} and "annotation" in d.events[-1][1]
    d = c.decide_canary(obs(gate="abort"), s, p, now=5.0)
    assert d.state.phase == "Aborted" and d.weight == 0 and d.clear_gate and d.state.promoted is None
    # a gate in a finished run does nothing
    again = c.decide_canary(obs(gate="promote"), d.state, p, now=6.0)
    assert again.state.phase == "Aborted" and again.events == ()


def test_a_stale_promote_gate_does_not_end_the_next_run():
    p = policy()
    done = c.decide_canary(obs(gate="promote"), progressing(p), p, now=5.0).state
    p2 = dataclasses.replace(p, config_hash="cfg-2")
    d = c.decide_canary(obs(gate="promote", ready=(0, 1)), done, p2, now=100.0)
    assert d.state.phase == "Waiting" and d.state.config_hash == "cfg-2"
    assert [r for r, _ in d.events] == ["CanaryStarted"] and d.state.promoted == done.promoted
    # the user asks again (the annotation changes): it acts
    d = c.decide_canary(obs(gate=None), d.state, p2, now=110.0)
    d = c.decide_canary(obs(gate="abort"), d.state, p2, now=120.0)
    assert d.state.phase == "Aborted"


# -- runs, removal, status -------------------------------------------------------------------------

def test_a_changed_canary_restarts_the_run():
    p = policy()
    s = progressing(p)
    s = c.decide_canary(obs(canary=window(alpha=0.1)), s, p, now=60.0).state
    assert s.failed_checks == 1
    d = c.decide_canary(obs(ready=(0, 1)), s, dataclasses.replace(p, config_hash="cfg-2"), now=100.0)
    assert [r for r, _ in d.events] == ["CanaryRestarted", "CanaryStarted"]
    assert d.state.phase == "Waiting" and d.state.failed_checks == 0 and d.state.epoch != s.epoch


def test_removing_the_canary_goes_idle_and_keeps_the_promotion_record():
    p = policy()
    promoted = c.decide_canary(obs(gate="promote"), progressing(p), p, now=5.0).state
    d = c.decide_canary(obs(), promoted, None, now=10.0)
    assert d.state.phase == "Idle" and d.state.promoted == promoted.promoted
    ((reason, message),) = d.events
    assert reason == "PromotionKept" and '{"speculation": {"kMax": 12}}' in message
    assert c.decide_canary(obs(), d.state, None, now=20.0).events == ()  # said once
    aborted = c.decide_canary(obs(gate="abort"), progressing(p), p, now=5.0).state
    assert [r for r, _ in c.decide_canary(obs(), aborted, None, now=10.0).events] == ["CanaryRemoved"]
    live = progressing(p)
    d = c.decide_canary(obs(), live, None, now=10.0)
    assert d.state.phase == "Idle" and [r for r, _ in d.events] == ["CanaryRemoved"] and d.weight == 0


def test_a_second_promotion_stacks_on_the_first():
    p = policy()
    first = c.decide_canary(obs(gate="promote"), progressing(p), p, now=5.0).state
    p2 = dataclasses.replace(p, config_hash="cfg-2", overrides={"draft": {"method": "none"}},
                             base={"draft": {"method": "ngram"}})
    s = c.decide_canary(obs(ready=(0, 1)), first, p2, now=10.0).state
    s = c.decide_canary(obs(), s, p2, now=20.0).state
    second = c.decide_canary(obs(gate="promote"), s, p2, now=30.0).state
    assert second.promoted["overrides"] == {"speculation": {"kMax": 12}, "draft": {"method": "none"}}
    assert second.promoted["base"] == {"speculation": {"kMax": 8}, "draft": {"method": "ngram"}}


def test_status_round_trip_and_section_names():
    p = policy()
    s = c.decide_canary(obs(gate="promote"), progressing(p), p, now=1_700_000_000.5).state
    section = s.to_status()
    assert section["phase"] == "Promoted" and section["promoted"]["at"] == "2023-11-14T22:13:20.500000Z"
    assert {"phase", "step", "weight", "failedChecks", "startedAt", "epoch", "configHash", "message",
            "promoted", "lastGate"} <= set(section)
    assert c.CanaryState.from_status(section) == s
    assert c.CanaryState.from_status(None) == c.CanaryState()
    assert c.CanaryState.from_status({"phase": "Bogus"}).phase == "Idle"


def test_policy_from_a_defaulted_spec():
    spec = with_defaults({**BASE, "canary": {"weight": 0.5, "steps": [{"weight": 5}], "overrides": {
        "image": "w:2", "speculation": {"kMax": 12}}}})
    p = c.CanaryPolicy.from_spec(spec)
    assert p.weight == 0.5 and p.steps == ((5, 300.0),) and p.interval_s == 60.0 and p.failure_limit == 3
    assert p.progress_deadline_s == 600.0 and p.min_requests >= 1 and p.drift.min_pairs >= 1
    assert p.base == {"speculation": {"kMax": 8}}
    assert c.CanaryPolicy.from_spec(with_defaults(BASE)) is None
    changed = c.CanaryPolicy.from_spec(with_defaults({**BASE, "speculation": {"kMax": 6, "kInitial": 4},
                                                      "canary": spec["canary"]}))
    assert changed.config_hash != p.config_hash  # what the canary inherits is part of its run


def test_observation_from_the_loops_reading():
    o = Observation(windows={"stable": {"chat": GOOD, "code": GOOD}, "canary": {}},
                    ready={"stable": (4, 4), "canary": (0, 1)}, drift={"canary": DriftCounts("e", pairs=1, agree=1)})
    v = c.observation(o, "pause")
    assert v.stable.window.counts.requests == 200 and v.canary.window is None and v.canary.desired == 1
    assert v.gate == "pause" and v.drift["canary"].pairs == 1
    assert c.observation(Observation(complete=False), None).complete is False


def test_settle_promotion_drops_folded_and_superseded_leaves_once():
    record = {"overrides": {"speculation": {"kMax": 12}, "draft": {"method": "none"}},
              "base": {"speculation": {"kMax": 8}, "draft": {"method": "ngram"}}, "at": "t", "configHash": "h"}
    state = c.CanaryState(promoted=record)
    spec = with_defaults(BASE)
    same, events = c.settle_promotion(spec, state)
    assert same is state and events == ()
    folded = with_defaults({**BASE, "draft": {"method": "none"}})
    s, events = c.settle_promotion(folded, state)
    assert s.promoted["overrides"] == {"speculation": {"kMax": 12}} and s.promoted["at"] == "t"
    assert [r for r, _ in events] == ["PromotionFolded"] and "draft.method none" in events[0][1]
    assert c.settle_promotion(folded, s) == (s, ())  # said once
    moved = with_defaults({**BASE, "draft": {"method": "none"}, "speculation": {"kMax": 6, "kInitial": 4}})
    s, events = c.settle_promotion(moved, s)
    assert s.promoted is None and [r for r, _ in events] == ["PromotionSuperseded"]
    assert "speculation.kMax to 6 after the promotion of 12" in events[0][1]


def test_apply_overrides_puts_the_image_under_the_template():
    from specfleet_api.fleet_spec import apply_overrides
    out = apply_overrides({"template": {"resources": {}}, "quantization": "none"},
                            {"image": "w:2", "quantization": "int8"})
    assert out == {"template": {"resources": {}, "image": "w:2"}, "quantization": "int8"}


def test_a_whole_run_through_the_status_as_the_operator_keeps_it():
    """tick() from the spec, the annotation and status.canary, the section written back each time:
    nothing of the run is lost between ticks."""
    spec = with_defaults({**BASE, "canary": {"weight": 1, "pause": "1m", "steps": [{"weight": 20, "pause": "1m"}],
                                             "overrides": {"speculation": {"kMax": 12}},
                                             "analysis": {"drift": {"sampleShare": 0}}}})
    section, seen, t0 = None, [], 1_750_000_000.25
    ticks = [(0, obs(ready=(0, 1)), None), (30, obs(), None), (90, obs(), None), (150, obs(), None)]
    for t, o, gate in ticks:
        meta = {"annotations": {c.GATE_ANNOTATION: gate}} if gate else {}
        d = c.tick(spec, meta, section, o, t0 + t)
        section = d.state.to_status()
        seen.append((d.state.phase, d.weight, [r for r, _ in d.events]))
    assert seen == [("Waiting", 0.0, ["CanaryStarted"]), ("Progressing", 1, ["CanaryReady"]),
                    ("Progressing", 20, ["CanaryStepped"]), ("Promoted", 0.0, ["CanaryPromoted"])]
    assert section["promoted"]["overrides"] == {"speculation": {"kMax": 12}}
    # spec.canary removed: stable keeps the promotion, said once
    bare = with_defaults(BASE)
    d = c.tick(bare, {}, section, obs(), t0 + 200)
    assert [r for r, _ in d.events] == ["PromotionKept"] and d.state.promoted == section["promoted"]
    d = c.tick(bare, {}, d.state.to_status(), obs(), t0 + 210)
    assert d.events == () and d.state.phase == "Idle"
    # the user folds kMax 12 into the spec: the record goes
    folded = with_defaults({**BASE, "speculation": {"kMax": 12}})
    d = c.tick(folded, {}, d.state.to_status(), obs(), t0 + 220)
    assert [r for r, _ in d.events] == ["PromotionFolded"] and d.state.promoted is None


def test_an_invalid_gate_is_an_event_once_and_no_gate():
    spec = with_defaults({**BASE, "canary": {"weight": 1}})
    meta = {"annotations": {c.GATE_ANNOTATION: "ship-it"}}
    d = c.tick(spec, meta, None, obs(ready=(0, 1)), 0.0)
    assert [r for r, _ in d.events] == ["CanaryGateInvalid", "CanaryStarted"] and "'ship-it'" in d.events[0][1]
    d = c.tick(spec, meta, d.state.to_status(), obs(ready=(0, 1)), 10.0)
    assert d.events == () and d.state.phase == "Waiting"
    d = c.tick(spec, {"annotations": {c.GATE_ANNOTATION: "abort"}}, d.state.to_status(), obs(), 20.0)
    assert d.state.phase == "Aborted" and d.clear_gate


def test_doctests():
    import doctest

    assert doctest.testmod(c).failed == 0
