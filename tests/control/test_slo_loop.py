"""The SLO loop, pure: fallback per prompt type, per cluster and per deployment, recovery through
the probe with hysteresis and dwell, no decision on missing data, alerts as SLO misses."""

from __future__ import annotations

import dataclasses

import pytest

from specfleet_api.windows import ClusterWindow, TypeCounts, Window
from specfleet_control.loop import DEPLOYMENT, Memory, cluster_key, tick, type_key
from specfleet_control.observe import Alert, Observation
from specfleet_control.slo import FALLBACK, SPECULATIVE, Evidence, KeyState, Sample, SloPolicy, judge, step

P = SloPolicy(window_s=10, alpha_floor=0.05, alpha_drop=0.5, speedup_floor=1.0, min_draft_tokens=100,
              min_requests=2, recover_after_s=30, min_dwell_s=20, hysteresis=0.1, probe_share=5)


def window(alpha: float, speedup: float = 1.4, drafted: int = 1000, requests: int = 10) -> Window:
    busy = 10.0
    return Window(TypeCounts(requests=requests, draft_tokens=drafted, accepted_tokens=int(alpha * drafted),
                             spec_requests=requests, spec_plain_seconds=speedup * busy, spec_busy_seconds=busy), 1, 10.0)


def obs(**by_type: Window) -> Observation:
    return Observation(windows={"stable": by_type})


def run(episode, memory=Memory(), policy=P, per_type=True, dt=10.0, start=1000.0):
    """Feed one observation per window; the memory and events after each."""
    out = []
    for i, o in enumerate(episode):
        t = tick(o, memory, policy, now=start + i * dt, per_type=per_type)
        memory = t.memory
        out.append(t)
    return out


def modes(ticks, key):
    return [t.memory.keys.get(key, KeyState()).mode for t in ticks]


def transitions(ticks):
    return [(r, m.split(":")[0]) for t in ticks for r, m in t.events]


def test_a_collapsed_type_falls_back_alone_within_two_windows_and_recovers_through_the_probe():
    good, bad = window(0.6), window(0.02, speedup=0.9)
    episode = [obs(code=good, chat=good)] * 3 + [obs(code=bad, chat=good)] * 4 + [obs(code=good, chat=good)] * 8
    ticks = run(episode)
    code, chat = modes(ticks, type_key("code")), modes(ticks, type_key("chat"))
    assert code[:3] == [SPECULATIVE] * 3
    assert code.index(FALLBACK) == 3  # the first bad window (within 2 windows)
    assert chat == [SPECULATIVE] * len(ticks)
    # the probe is healthy from tick 7; recoverAfter 30 s: back at tick 10
    assert code[7:10] == [FALLBACK] * 3 and code[10:] == [SPECULATIVE] * 5
    assert transitions(ticks) == [("FallbackEntered", "prompt type code"), ("FallbackLeft", "prompt type code")]
    assert ticks[-1].memory.fallback_types() == ()
    assert ticks[5].memory.fallback_types() == ("code",)


def test_flapping_traffic_moves_a_type_at_most_once_each_way():
    good, bad = window(0.6), window(0.02, speedup=0.9)
    episode = [obs(code=good)] * 2 + [obs(code=bad), obs(code=good)] * 6 + [obs(code=good)] * 6
    ticks = run(episode)
    assert transitions(ticks) == [("FallbackEntered", "prompt type code"), ("FallbackLeft", "prompt type code")]


def test_a_probe_at_the_floor_does_not_recover_hysteresis():
    at_floor = window(0.6, speedup=1.05)  # above speedupFloor 1.0, under 1.0 x (1 + 0.1)
    ticks = run([obs(code=window(0.6))] * 2 + [obs(code=window(0.02, 0.9))] + [obs(code=at_floor)] * 10)
    assert modes(ticks, type_key("code"))[-1] == FALLBACK
    assert "under 1.10" in ticks[-1].memory.keys[type_key("code")].reason


def test_missing_data_decides_nothing_and_does_not_break_a_healthy_probe_run():
    good, bad = window(0.6), window(0.02, speedup=0.9)
    missing = Observation(complete=False, error="ConnectionError")
    ticks = run([obs(code=good)] * 2 + [missing] * 3 + [obs(code=bad)] + [missing] * 5)
    assert modes(ticks, type_key("code"))[:5] == [SPECULATIVE] * 5
    assert all(not t.decided for t in ticks[2:5]) and ticks[-1].memory.keys[type_key("code")].mode == FALLBACK
    # too little data is not a miss either: it is kept, and the next window adds to it
    thin = window(0.0, speedup=0.5, drafted=10, requests=1)
    ticks = run([obs(code=good)] * 2 + [obs(code=thin)])
    assert modes(ticks, type_key("code"))[-1] == SPECULATIVE and ticks[-1].memory.keys[type_key("code")].verdict == "unknown"
    assert ticks[-1].memory.evidence[type_key("code")].requests == 1
    ticks = run([obs(code=thin)], memory=ticks[-1].memory, start=1030.0)  # two requests: enough for a speedup
    assert modes(ticks, type_key("code")) == [FALLBACK] and type_key("code") not in ticks[-1].memory.evidence


def test_keys_are_judged_once_per_window_so_no_request_counts_twice():
    thin = window(0.35, drafted=40, requests=1)  # too little alone (alpha near its line): each judgement adds one
    ticks = run([obs(code=window(0.6))] + [obs(code=thin)] * 8, dt=2.5)  # four ticks per 10 s window
    assert [t.memory.judged_at for t in ticks] == [1000.0] * 4 + [1010.0] * 4 + [1020.0]
    # kept for four ticks (one judgement), judged with the next window's: two requests, a healthy
    # speedup, and kept on while alpha (0.35 against the line 0.3) is not yet clear of it
    assert [t.memory.evidence.get(type_key("code"), Evidence()).windows for t in ticks] == [0] * 4 + [1] * 4 + [2]
    assert ticks[-1].memory.keys[type_key("code")].verdict == "healthy"
    # an alert is judged at once, between two windows
    alerted = run([obs(code=window(0.6)), obs(code=window(0.6)).with_alerts((Alert("A", "code"),))], dt=1.0)
    assert modes(alerted, type_key("code")) == [SPECULATIVE, FALLBACK]


def test_alpha_halving_against_its_own_baseline_is_a_miss_the_floor_is_not_reached():
    ticks = run([obs(code=window(0.8))] * 3 + [obs(code=window(0.3, speedup=1.3))])
    assert modes(ticks, type_key("code"))[-1] == FALLBACK
    assert "baseline" in ticks[-1].events[0][1]
    # the measured default (n-gram, alpha 0.19 at 1.41x) never falls back on the defaults
    assert modes(run([obs(code=window(0.19, 1.41))] * 6, policy=SloPolicy(min_draft_tokens=100, min_requests=2)),
                 type_key("code")) == [SPECULATIVE] * 6


def test_a_thin_first_window_does_not_set_the_baseline_a_collapse_is_judged_against():
    # a first healthy window of 100 drafted tokens at 0.2 (two odd questions), then the type's usual 0.7
    ticks = run([obs(code=window(0.2, drafted=100))] + [obs(code=window(0.7, drafted=400))] * 3)
    learnt = ticks[-1].memory.keys[type_key("code")]
    assert learnt.baseline_tokens == 1300
    assert learnt.baseline == pytest.approx((0.2 * 100 + 0.7 * 1200) / 1300, abs=0.002)  # weighted by tokens
    # so a collapse to 0.1 misses against it (against 0.2 x 0.8 + ... it would not: 0.1 > 0.5 x 0.2)
    collapsed = run([obs(code=window(0.1, speedup=1.2, drafted=400))], memory=ticks[-1].memory, start=1040.0)
    assert modes(collapsed, type_key("code")) == [FALLBACK]
    # once it rests on many tokens, each window moves it by the running mean's weight, no less
    settled = run([obs(code=window(0.7, drafted=400))] * 40 + [obs(code=window(0.6, drafted=400))])
    before, after = (t.memory.keys[type_key("code")].baseline for t in settled[-2:])
    assert after == pytest.approx(before + P.baseline_weight * (0.6 - before))


def test_an_out_of_distribution_cluster_falls_back_alone_its_type_keeps_speculating():
    good = window(0.6)
    ood = ClusterWindow("code", requests=10, spec_requests=10, draft_tokens=200, accepted_tokens=4)
    fine = ClusterWindow("code", requests=40, spec_requests=40, draft_tokens=2000, accepted_tokens=1300)
    clusters = {"r1/0": fine, "r1/1": ood}
    ticks = run([obs(code=good)] * 2 + [Observation(windows={"stable": {"code": good}}, clusters=clusters)] * 3)
    assert ticks[-1].memory.fallback_clusters() == ("r1/1",)
    assert ticks[-1].memory.fallback_types() == ()
    assert modes(ticks, cluster_key("r1/1"))[2] == FALLBACK  # the first window that shows it
    # a cluster no router reports any more is forgotten after ten windows, saying so
    gone = run([obs(code=good)] * 12, memory=ticks[-1].memory, start=1050.0)
    assert gone[-1].memory.fallback_clusters() == () and any("forgotten" in m for _, m in sum((t.events for t in gone), ()))
    assert gone[9].memory.fallback_clusters() == ("r1/1",)  # not before ten windows


def test_an_alert_is_a_miss_for_its_key_and_a_whole_deployment_alert_moves_only_the_deployment():
    good = window(0.6)
    typed = run([obs(code=good, chat=good).with_alerts((Alert("SpecDecodeAlphaBelowSLO", "chat"),))])
    assert typed[-1].memory.fallback_types() == ("chat",) and not typed[-1].memory.whole
    whole = run([obs(code=good).with_alerts((Alert("SpecDecodeSpeedupBelowFloor"),))] + [obs(code=good)] * 6)
    assert modes(whole, DEPLOYMENT)[0] == FALLBACK and whole[0].memory.fallback_types() == ()
    assert modes(whole, DEPLOYMENT)[-1] == SPECULATIVE  # the probes' window was healthy after the alert resolved


def test_without_a_router_the_whole_deployment_is_the_only_key():
    ticks = run([obs(code=window(0.6), chat=window(0.6))] * 2 + [obs(code=window(0.01, 0.8), chat=window(0.01, 0.8))],
                per_type=False)
    assert set(ticks[-1].memory.keys) == {DEPLOYMENT} and ticks[-1].memory.whole


def test_fallback_disabled_never_enters_and_leaves_at_once():
    off = SloPolicy(**{**P.__dict__, "enabled": False})
    assert modes(run([obs(code=window(0.01, 0.5))] * 3, policy=off), type_key("code")) == [SPECULATIVE] * 3
    state, event = step(Sample(alpha=0.0, draft_tokens=0), KeyState(FALLBACK, 0.0), off, 5.0)
    assert state.mode == SPECULATIVE and event[0] == "FallbackLeft"


def test_memory_round_trips_through_the_status():
    ticks = run([obs(code=window(0.6))] * 2 + [obs(code=window(0.01, 0.5))])
    assert Memory.from_status(ticks[-1].memory.to_status()) == ticks[-1].memory


ALPHA = {"alpha": 0.5, "draft_tokens": 500, "alpha_bounds": (0.44, 0.56)}  # as the loop's samples carry it


@pytest.mark.parametrize("sample, verdict", [
    (Sample(speedup=0.85, requests=5, **ALPHA), "missed"),
    (Sample(speedup=0.95, requests=5, **ALPHA), "healthy"),  # within the entry margin (0.9)
    (Sample(speedup=1.3, requests=5, **ALPHA), "healthy"),
    (Sample(speedup=0.5, requests=1, **ALPHA), "healthy"),  # speedup of 1 request: not judged
    (Sample(alert="X"), "missed"),
])
def test_judge(sample, verdict):
    assert judge(sample, KeyState(), P)[0] == verdict


def test_every_alpha_the_loop_judges_carries_its_interval():
    """Alpha is judged by its interval only (judging it by value was a path the loop never took,
    removed): every sample the loop builds with an alpha has bounds, and one without them says
    nothing of alpha, however far under the baseline its value is."""
    from specfleet_control.loop import cluster_sample, sample_of

    e = Evidence(draft_tokens=300, accepted_tokens=30, requests=10, seen=10, windows=1)
    for s in (sample_of(e), cluster_sample(e, P)):
        assert s.alpha == 0.1 and s.alpha_bounds is not None
    assert sample_of(Evidence(windows=1)).alpha is None  # nothing drafted: no alpha either
    bare = Sample(alpha=0.1, draft_tokens=500)
    assert judge(bare, KeyState(baseline=0.6), P)[0] == "unknown"
    assert judge(dataclasses.replace(bare, alpha_bounds=(0.07, 0.14)), KeyState(baseline=0.6), P) == (
        "missed", "alpha 0.100 (interval [0.070, 0.140] over 500 drafted tokens) under 0.5 x its baseline 0.600")


def test_without_windows_the_alerts_alone_move_the_deployment_both_ways():
    firing = Observation().with_alerts((Alert("SpecDecodeAlphaBelowSLO", "code"),))
    ticks = run([firing] * 2 + [Observation()] * 6, per_type=False)
    assert modes(ticks, DEPLOYMENT) == [FALLBACK] * 5 + [SPECULATIVE] * 3  # healthy from 1020, 30 s later


def test_a_cluster_is_judged_by_its_interval_a_few_rejected_drafts_decide_nothing():
    good = window(0.6)
    few = ClusterWindow("code", requests=10, spec_requests=10, draft_tokens=12, accepted_tokens=0)
    many = ClusterWindow("code", requests=10, spec_requests=10, draft_tokens=300, accepted_tokens=30)
    ticks = run([obs(code=good)] * 2 + [Observation(windows={"stable": {"code": good}}, clusters={"r/0": few})])
    assert ticks[-1].memory.fallback_clusters() == ()
    assert "not yet clear" in ticks[-1].memory.keys[cluster_key("r/0")].reason
    # the next window adds to its evidence: two such windows say it
    more = run([Observation(windows={"stable": {"code": good}}, clusters={"r/0": few})] * 2, memory=ticks[-1].memory,
               start=1030.0)
    assert [t.memory.fallback_clusters() for t in more] == [("r/0",)] * 2  # 24 drafted tokens: under 0.3 at 95%
    ticks = run([obs(code=good)] * 2 + [Observation(windows={"stable": {"code": good}}, clusters={"r/0": many})])
    assert ticks[-1].memory.fallback_clusters() == ("r/0",)  # 0.1, its interval under 0.5 x 0.6


def test_half_way_between_judgements_a_window_that_misses_on_its_own_falls_back():
    """Judged every 10 s; the collapse (at 1011) is in the window checked half way (1015): it
    falls back then, not at the next judgement (1020). A healthy window half way changes nothing."""
    good, bad = window(0.6), window(0.02, speedup=0.9)
    ticks = run([obs(code=good)] * 3 + [obs(code=bad)] * 3, dt=5.0)  # 1000 .. 1025
    assert modes(ticks, type_key("code")) == [SPECULATIVE] * 3 + [FALLBACK] * 3
    assert ticks[3].memory.judged_at == 1010.0 and ticks[3].memory.early_at == 1015.0
    assert ticks[2].memory.keys[type_key("code")].baseline == ticks[1].memory.keys[type_key("code")].baseline


def spread_window(speedups: list[float], alpha: float = 0.6, drafted: int = 1000) -> Window:
    """A window whose requests each ran at their own speedup (1 s of plain-equivalent time each)."""
    import math
    busy = [1.0 / s for s in speedups]
    logs = [math.log(s) for s in speedups]
    return Window(TypeCounts(requests=len(speedups), draft_tokens=drafted, accepted_tokens=int(alpha * drafted),
                             spec_requests=len(speedups), spec_plain_seconds=float(len(speedups)),
                             spec_busy_seconds=sum(busy), spec_speedups=len(speedups),
                             spec_log_speedup_sum=sum(logs), spec_log_speedup_sq=sum(x * x for x in logs)), 1, 10.0)


def test_a_speedup_under_the_line_enters_fallback_only_when_its_requests_say_so_clearly():
    # requests spread 0.75-1.05 (a prompt with long n-gram runs, most without) around 0.84: a
    # window of four says nothing clear, and adds to the next until the interval is under 0.9;
    # four requests alike are clear at once
    spread = spread_window([0.75, 0.8, 1.05, 0.8])
    ticks = run([obs(code=window(0.6))] * 2 + [obs(code=spread)])
    state = ticks[-1].memory.keys[type_key("code")]
    assert state.mode == SPECULATIVE and "not yet clearly under" in state.reason, state
    assert ticks[-1].memory.evidence[type_key("code")].speedups == 4  # kept for the next window
    ticks = run([obs(code=spread)] * 8, memory=ticks[-1].memory, start=1030.0)
    entered = modes(ticks, type_key("code")).index(FALLBACK)  # the interval narrows as windows add up
    assert 2 <= entered < 8, [t.memory.keys[type_key("code")].reason for t in ticks]
    assert "interval" in ticks[entered].events[0][1]
    # requests alike: one window of four is clear
    alike = spread_window([0.84, 0.86, 0.85, 0.85])
    ticks = run([obs(code=window(0.6))] * 2 + [obs(code=alike)])
    assert modes(ticks, type_key("code"))[-1] == FALLBACK


@pytest.mark.parametrize("bounds, margin, verdict", [
    ((0.70, 1.03), 0.0, "unknown"),  # 0.85 with requests spread wide: not yet a miss
    ((0.80, 0.89), 0.0, "missed"),  # the whole interval under 0.9
    ((0.70, 1.03), 0.1, "missed"),  # a probe in fallback must clear 1.1 by its value
])
def test_judge_a_speedup_by_its_interval_when_entering(bounds, margin, verdict):
    sample = Sample(alpha=0.5, speedup=0.85, draft_tokens=500, requests=5, speedup_bounds=bounds)
    assert judge(sample, KeyState(), P, margin=margin)[0] == verdict


def test_doctests():
    import doctest

    import specfleet_control.loop as loop
    import specfleet_control.slo as slo
    assert doctest.testmod(loop).failed == 0 and doctest.testmod(slo).failed == 0


def test_evidence_without_a_verdict_adds_up_over_twelve_windows_at_most():
    # a speedup that stays about its line (0.9) never becomes clear either way
    about = spread_window([0.7, 1.1, 0.85, 0.95])  # 0.88, spread wide
    ticks = run([obs(code=window(0.6))] * 2 + [obs(code=about)] * 30)
    held = [t.memory.evidence.get(type_key("code")) for t in ticks[2:]]
    assert all(e is not None for e in held)  # never a verdict
    assert max(e.windows for e in held) == 12 and held[-1].windows < 12
    assert modes(ticks, type_key("code")) == [SPECULATIVE] * 32


def test_windows_too_thin_for_alpha_add_up_to_a_baseline_though_each_one_s_speedup_is_healthy():
    """A slow machine's windows each hold fewer drafted tokens than minDraftTokens, while their
    speedup (enough requests) is healthy: the healthy verdict does not throw the alpha evidence
    away, so the windows add up to a baseline, and a collapse is then judged against it."""
    thin = window(0.6, drafted=40, requests=4)  # minDraftTokens 100: three windows are needed
    ticks = run([obs(code=thin)] * 3)
    assert [t.memory.keys[type_key("code")].verdict for t in ticks] == ["healthy"] * 3
    assert [t.memory.keys[type_key("code")].baseline for t in ticks] == [None, None, 0.6]
    assert ticks[-1].memory.evidence.get(type_key("code")) is None  # spent on the baseline
    # against that baseline (line 0.3), thin windows of a collapsed alpha whose speedup is still
    # healthy (K fell to 0: little is drafted, little lost) add up to a miss within two
    bad = window(0.05, speedup=1.0, drafted=20, requests=4)
    after = run([obs(code=bad)] * 2, memory=ticks[-1].memory, start=1030.0)
    assert after[-1].memory.fallback_types() == ("code",), after[-1].memory.keys[type_key("code")]


def test_windows_healthy_on_their_speedup_alone_never_walk_the_baseline_down_to_a_collapse():
    """A collapsing type whose K fell to 0 loses little time: each window's speedup is healthy while
    its alpha sits between the line and the baseline, not yet clear of either. Those windows say
    nothing of alpha, so the baseline does not learn from them (it learnt from the kept evidence
    again at every tick, and walked down to meet the collapse, which then never missed); their
    evidence adds up until the alpha is clearly under half the baseline."""
    ticks = run([obs(code=window(0.65))] * 2)
    base = ticks[-1].memory.keys[type_key("code")].baseline
    assert base == pytest.approx(0.65, abs=0.001)
    sliding = window(0.24, speedup=1.0, drafted=30, requests=4)  # the line 0.325: unclear for a while
    after = run([obs(code=sliding)] * 12, memory=ticks[-1].memory, start=1030.0)
    assert [t.memory.keys[type_key("code")].baseline for t in after] == [base] * len(after)
    assert after[-1].memory.fallback_types() == ("code",), after[-1].memory.keys[type_key("code")]
    assert any("under 0.5 x its baseline 0.650" in m for t in after for _, m in t.events)


def test_a_quiet_probe_adds_up_until_it_can_judge_and_speculation_returns():
    """A type in fallback on a slow machine: its probes (a few percent of its requests) finish one
    request every 13 windows. Evidence too thin to judge keeps adding up past the twelve windows
    an indecisive one is held, so two probes make a verdict and the type recovers."""
    probe = window(0.6, drafted=10, requests=1)  # minRequests 2: two probes' speedup judges
    quiet = Window(TypeCounts(requests=3), 1, 10.0)  # plain requests only: nothing speculated
    start = KeyState(FALLBACK, since=0.0, baseline=0.6)
    episode = [obs(code=probe if i % 13 == 0 else quiet) for i in range(60)]
    ticks = run(episode, memory=Memory(keys={type_key("code"): start}))
    code = modes(ticks, type_key("code"))
    assert code[0] == FALLBACK and code[-1] == SPECULATIVE, ticks[-1].memory.keys[type_key("code")]
    assert transitions(ticks) == [("FallbackLeft", "prompt type code")]
    # the first verdict came with the second probe, not before
    assert ticks[12].memory.keys[type_key("code")].healthy_since is None
    assert ticks[13].memory.keys[type_key("code")].healthy_since is not None


def test_a_cluster_whose_requests_draft_little_adds_up_its_drafted_tokens_past_twelve_windows():
    """An out-of-distribution cluster on a slow machine: many requests, each drafting almost
    nothing (K fell to 0, a probe token now and then), all rejected. Its verdict rests on drafted
    tokens alone, so many requests do not make the evidence 'enough' to restart at twelve windows;
    the tokens add up until they say it."""
    good = window(0.6)
    trickle = ClusterWindow("code", requests=3, spec_requests=3, draft_tokens=1, accepted_tokens=0)
    episode = [obs(code=good)] * 2 + [Observation(windows={"stable": {"code": good}}, clusters={"r/0": trickle})] * 30
    ticks = run(episode)
    assert ticks[-1].memory.fallback_clusters() == ("r/0",), ticks[-1].memory.keys[cluster_key("r/0")]
    first = next(i for i, t in enumerate(ticks) if t.memory.fallback_clusters())
    assert first > 12  # after more windows than an indecisive verdict is held: thin evidence kept


def per_request_window(alphas: list[float], drafted_each: int = 92) -> Window:
    """A window of requests that each drafted `drafted_each` tokens and accepted their own share
    (what a vLLM pool's window holds: K drafted at every step, one rate per request)."""
    accepted = [round(a * drafted_each) for a in alphas]
    return Window(TypeCounts(requests=len(alphas), draft_tokens=drafted_each * len(alphas),
                             accepted_tokens=sum(accepted), spec_requests=len(alphas),
                             spec_alphas=len(alphas), spec_alpha_sum=sum(a / drafted_each for a in accepted),
                             spec_alpha_sq=sum((a / drafted_each) ** 2 for a in accepted)), 1, 10.0)


def test_one_odd_prompt_of_a_healthy_type_is_no_collapse_a_type_whose_requests_all_collapse_is():
    """Prompts of one type accept from 0.01 to 0.6 of their drafts (vLLM's n-gram drafts on
    Spec-Bench math: 1 of 92 on one question, 46 of 72 on another). A window that holds one such
    odd request, 92 drafted tokens, would be a miss by its tokens alone (under half the baseline
    0.36 with 99% confidence); it is not one until a second request says how far the type's
    requests spread, and then they spread too far to call it (the next two, at 0.11 and 0.13,
    would make it one by the tokens of the three). Requests that all accept little fall back within
    two windows, and at once where an undecided window before them leaves the sum open."""
    healthy = [0.34, 0.64, 0.13, 0.25, 0.46, 0.36]
    warm = [obs(math=per_request_window(healthy[i:i + 3])) for i in (0, 3, 0)]
    odd = [obs(math=per_request_window([0.011])), obs(math=per_request_window([0.11, 0.13]))]
    ticks = run(warm + odd + warm)
    assert modes(ticks, type_key("math")) == [SPECULATIVE] * len(ticks), [t.events for t in ticks]
    collapsed = [obs(math=per_request_window([0.02, 0.05, 0.03]))] * 2
    ticks = run(warm + collapsed)
    assert FALLBACK in modes(ticks, type_key("math"))[len(warm):len(warm) + 2], [t.events for t in ticks]
    # a window near the line is kept undecided; the collapse after it spreads the sum's requests
    # wide, but misses on its own window: it falls back at once
    near = [obs(math=per_request_window([0.15, 0.2, 0.25]))]
    ticks = run(warm + near + collapsed[:1])
    assert modes(ticks, type_key("math"))[-2:] == [SPECULATIVE, FALLBACK], [t.events for t in ticks]
