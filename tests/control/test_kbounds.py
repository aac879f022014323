"""The loop's K ceiling per prompt type (specfleet_control.kbounds): set where one more draft no
longer pays at the measured cost, lifted when deeper drafts would pay, halved while a type's TPOT
is over its SLO and raised again after; never on thin evidence, never flapping."""
from __future__ import annotations

import dataclasses
import doctest
import random
import re

import pytest

from specfleet_api.fleet_spec import FleetState, live_state
from specfleet_api.windows import POSITIONS, TPOT_BUCKETS, TypeCounts, Window, bucket_of
from specfleet_control import kbounds
from specfleet_control.kbounds import CHANGED, Ceiling, KTuning, Positions, tune

WINDOW_S = 60.0


def drafts(rng: random.Random, steps: int, conditional: list[float], k: int, cost: float, method: str = "ngram",
           tpot: float | None = None, requests: int = 20) -> dict[str, Window]:
    """One window of a type's steps on `method`: each drafts up to k positions (a K policy's
    choice, 1..k), position p accepted with `conditional[p]` once p - 1 was; a step costs one
    plain step plus `cost` per drafted position."""
    drafted, accepted = [0] * POSITIONS, [0] * POSITIONS
    positions = 0
    for _ in range(steps):
        depth = rng.randint(1, k)
        positions += depth
        ok = True
        for p in range(depth):
            drafted[p] += 1
            ok = ok and rng.random() < conditional[min(p, len(conditional) - 1)]
            accepted[p] += ok
    hist = [0] * (len(TPOT_BUCKETS) + 1)
    if tpot is not None:
        hist[bucket_of(tpot, TPOT_BUCKETS)] = requests
    plain_step = 0.05  # plain-equivalent seconds: a plain step per token emitted (accepted ones, and one a step)
    c = TypeCounts(requests=requests, steps=steps, drafts=steps, draft_tokens=positions,
                   accepted_tokens=sum(accepted), plain_seconds=plain_step * (steps + sum(accepted)),
                   busy_seconds=plain_step * (steps + cost * positions),
                   pos_drafted=tuple(drafted), pos_accepted=tuple(accepted),
                   tpot_count=requests if tpot is not None else 0,
                   tpot_seconds_sum=(tpot or 0.0) * requests, tpot_hist=tuple(hist))
    return {method: Window(c, pods=1, seconds=WINDOW_S)}


ON = KTuning(enabled=True)


def run(ticks, tuning=ON, ceilings=None, start: int = 0):
    """Judge a sequence of {type: {method: Window}}, one per window (the first the start-th); the
    ceilings in force after each, and every event."""
    ceilings, history, events = ceilings or {}, [], []
    for i, by_type in enumerate(ticks, start):
        type_windows = {t: next(iter(ws.values())) for t, ws in by_type.items()}
        ceilings, ev = tune(by_type, type_windows, ceilings, tuning, now=i * WINDOW_S)
        history.append({t: c.k_max(tuning.k_max) for t, c in ceilings.items()})
        events += [(i, reason, message) for reason, message in ev]
    return ceilings, history, events


FALLING = [0.8, 0.5, 0.2, 0.1]  # a draft's chance of holding one position further, by position


def test_a_type_whose_acceptance_falls_gets_the_ceiling_that_pays_most_and_says_why():
    rng = random.Random(0)
    ceilings, history, events = run([{"chat": drafts(rng, 600, FALLING, 8, cost=0.15)}])
    # gains 0.8, 0.4, 0.08, 0.008 ... against 0.15 a position: two positions pay, the third does not
    assert history == [{"chat": 2}]
    [(_, reason, message)] = events
    assert reason == CHANGED
    assert re.fullmatch(r"prompt type chat \(ngram\): kMax none -> 2: acceptance by position 0\.\d\d, 0\.\d\d, "
                        r"0\.0\d, a drafted position costs 0\.15 of a plain step: position 3 adds less than it costs",
                        message), message
    assert ceilings["chat"].since == 0.0


def test_a_type_whose_drafts_hold_keeps_no_ceiling():
    rng = random.Random(1)
    _, history, events = run([{"code": drafts(rng, 600, [0.9], 8, cost=0.05)}] * 3)
    assert history == [{"code": None}] * 3 and events == []


def test_thin_evidence_moves_nothing_until_it_adds_up():
    rng = random.Random(2)
    thin = [{"chat": drafts(rng, 40, FALLING, 8, cost=0.15)} for _ in range(6)]
    _, history, _ = run(thin, KTuning(enabled=True, min_steps=64))
    assert history[0] == {"chat": None}  # 40 steps: no position has 64
    assert history[-1] == {"chat": 2}  # carried (halved a window), the first positions add up to 80 and 70


def test_a_ceiling_in_force_lifts_when_the_drafts_improve_and_does_not_flap():
    rng = random.Random(3)
    falling = [{"chat": drafts(rng, 600, FALLING, 8, cost=0.15)} for _ in range(3)]
    ceilings, history, _ = run(falling)
    assert history == [{"chat": 2}] * 3  # one change, then it holds
    # the traffic changes: drafts now hold; under the ceiling only two positions are measured,
    # the third is extrapolated, and the ceiling lifts
    # (a rise waits out the dwell from the ceiling's move: 5 windows)
    better = [{"chat": drafts(rng, 600, [0.95], 2, cost=0.15)} for _ in range(4)]
    _, history, events = run(better, ceilings=ceilings, start=3)
    assert history[-1] == {"chat": None}
    assert len([e for e in events if e[1] == CHANGED]) == 1


def test_a_rise_on_one_measured_position_is_a_probe_once_a_dwell_and_a_cap_acts_at_once():
    """Under a ceiling of 1, position 2's gain is a guess from position 1's; where the guess is
    too kind (a real fleet: n-gram's first draft accepted 0.82, the second 0.47 of the times the
    first was), the ceiling rises, the measurement caps it again at once, and the next rise waits
    out the dwell: a probe of deeper drafts once in minDwell, not a flap every other window."""
    window_s, dwell = 20.0, 300.0
    tuning = KTuning(enabled=True, k_max=6, min_dwell_s=dwell)
    moves = 0
    for seed in range(5):
        rng = random.Random(seed)
        ceilings: dict = {}
        changes = []  # (time, old kMax, new kMax)
        for i in range(45):  # 15 minutes
            k = ceilings["translation"].k_max(6) if "translation" in ceilings else None
            w = drafts(rng, 150, [0.82, 0.47, 0.5], k or 6, cost=0.56)
            ceilings, events = tune({"translation": w}, {"translation": w["ngram"]}, ceilings, tuning, now=i * window_s)
            new = ceilings["translation"].k_max(6)
            if new != k:
                changes.append((i * window_s, k, new))
        assert changes[0][1:] == (None, 1), changes  # the cap, measured
        for (t0, *_), (t1, old, new) in zip(changes, changes[1:]):
            if new is None or (old is not None and new > old):  # a rise: a dwell after the last move
                assert t1 - t0 >= dwell, f"seed {seed}: a rise {t1 - t0:.0f} s after the last move: {changes}"
            else:  # a cap: the window after the rise measured deeper drafts
                assert t1 - t0 <= 2 * window_s, f"seed {seed}: a rise held {t1 - t0:.0f} s: {changes}"
        assert changes[-1][2] == 1 or changes[-1][0] >= 43 * window_s, changes  # capped again, or just probed
        moves += len(changes)
    assert moves <= 5 * 7, moves  # at most a probe and its cap per dwell after the first cap


def test_load_halves_a_ceiling_and_it_rises_one_position_a_window_after():
    rng = random.Random(4)
    tuning = KTuning(enabled=True, tpot_p99_s=0.1, k_max=8)
    hold = [0.9]  # drafts pay at every depth: no acceptance ceiling
    loaded = [{"chat": drafts(rng, 600, hold, 8, cost=0.05, tpot=0.2)} for _ in range(2)]
    calm = [{"chat": drafts(rng, 600, hold, 8, cost=0.05, tpot=0.02)} for _ in range(6)]
    _, history, events = run(loaded + calm, tuning)
    assert [h["chat"] for h in history] == [4, 2, 3, 4, 5, 6, 7, None]
    assert "TPOT P99 0.2" in events[0][2] and "over its SLO 0.1s" in events[0][2]
    assert "back under its SLO" in events[2][2]
    # in between the SLO and (1 - hysteresis) of it: nothing moves
    between = [{"chat": drafts(rng, 600, hold, 8, cost=0.05, tpot=0.095)} for _ in range(2)]
    _, history, _ = run(loaded[:1] + between, tuning)
    assert [h["chat"] for h in history] == [4, 4, 4]


def test_a_type_that_changes_method_starts_afresh():
    rng = random.Random(5)
    ceilings, _, _ = run([{"chat": drafts(rng, 600, FALLING, 8, cost=0.15)}])
    assert ceilings["chat"].k_max(8) == 2
    ceilings, history, events = run([{"chat": drafts(rng, 600, [0.9], 8, cost=0.05, method="eagle")}],
                                     ceilings=ceilings)
    assert history == [{"chat": None}] and ceilings["chat"].method == "eagle"
    assert events == [(0, CHANGED, "prompt type chat (eagle): kMax 2 -> none: it runs eagle now, not ngram")]
    assert ceilings["chat"].evidence.steps == 600  # not the ngram steps carried


def test_disabled_or_no_room_between_the_bounds_sets_nothing():
    rng = random.Random(6)
    ticks = [{"chat": drafts(rng, 600, FALLING, 8, cost=0.15)}]
    assert run(ticks, KTuning())[1] == [{}]  # off by default
    assert run(ticks, KTuning(enabled=True, k_min=0, k_max=1))[1] == [{}]


def test_a_ceiling_round_trips_through_the_status():
    rng = random.Random(7)
    ceilings, _, _ = run([{"chat": drafts(rng, 600, FALLING, 8, cost=0.15)}])
    back = Ceiling.from_status(ceilings["chat"].to_status())
    assert back.method == "ngram" and back.acceptance == 2 and back.since == 0.0 and back.acceptance_since == 0.0
    assert back.evidence.drafted == pytest.approx(ceilings["chat"].evidence.drafted, abs=0.01)
    assert Positions.from_status({}).drafted == (0.0,) * POSITIONS


def test_the_live_state_carries_ceilings_below_kmax_to_the_stable_arm():
    spec = {"draft": {"method": "ngram"}, "speculation": {"kMin": 0, "kMax": 6}}
    ls = live_state(spec, FleetState(k_ceilings={"chat": 2, "code": 6}))
    assert ls.k_ceilings == {"chat": 2}  # at kMax it is no ceiling
    assert type(ls).from_json(ls.to_json()).k_ceilings == {"chat": 2}
    with pytest.raises(ValueError, match=r"k_ceilings\['chat'\]: need a prompt type and 1 <= kMax"):
        type(ls).from_json(dataclasses.replace(ls, k_ceilings={"chat": 0}).to_json())


def test_the_loop_sets_ceilings_at_its_judgements_and_the_live_state_and_status_carry_them():
    """From windows to the workers: `loop.tick` with the spec's KTuning sets a ceiling at a
    judgement (not between), the memory round-trips through the status, and the live state
    carries the ceiling in force."""
    from specfleet_control import canary, loop
    from specfleet_control.fleet import fleet_state
    from specfleet_control.observe import Observation
    from specfleet_control.slo import SloPolicy

    spec = {"draft": {"method": "ngram"}, "speculation": {"kMin": 0, "kMax": 6, "kTuning": {"enabled": True}}}
    rng = random.Random(8)
    by_type = {"chat": drafts(rng, 600, FALLING, 6, cost=0.15), "code": drafts(rng, 600, [0.9], 6, cost=0.05)}
    obs = Observation(windows={"stable": {t: ws["ngram"] for t, ws in by_type.items()}},
                      methods={"stable": by_type})
    policy = SloPolicy(window_s=WINDOW_S)
    t = loop.tick(obs, loop.Memory(), policy, now=100.0, tuning=KTuning.from_spec(spec))
    assert t.memory.k_ceilings() == {"chat": 2}
    assert [r for r, _ in t.events if r == CHANGED] == [CHANGED]
    back = loop.Memory.from_status(t.memory.to_status())
    assert back.k_ceilings() == {"chat": 2} and back.ceilings["code"].acceptance is None
    state = live_state(spec, fleet_state(back, canary.CanaryState(), spec))
    assert state.k_ceilings == {"chat": 2}
    # between two judgements nothing is re-judged; off, the ceilings go
    assert loop.tick(obs, back, policy, now=130.0, tuning=KTuning.from_spec(spec)).memory.ceilings == back.ceilings
    off = {**spec, "speculation": {**spec["speculation"], "kTuning": {"enabled": False}}}
    assert loop.tick(obs, back, policy, now=200.0, tuning=KTuning.from_spec(off)).memory.k_ceilings() == {}


def test_the_doctests():
    assert doctest.testmod(kbounds).failed == 0
