"""The loop's choice of draft method per prompt type (specfleet_control.methods): moves only on
clear evidence, once per shift, never against a pin, never before its dwell."""
from __future__ import annotations

import doctest
import math
import random
import re

import pytest

from specfleet_api.windows import TypeCounts, Window
from specfleet_control import methods
from specfleet_control.methods import MOVED, Choice, SelectPolicy, choose

CANDIDATES = ("ngram", "eagle")
WINDOW_S = 60.0


def window(rng: random.Random, n: int, speedup: float, spread: float = 0.15, alpha: float = 0.6,
           alpha_spread: float = 0.15) -> Window:
    """n speculating requests of 1 busy second and 40 drafted tokens each whose speedups are
    log-normal around `speedup` and acceptance rates normal around `alpha` (within [0, 1])."""
    logs = [rng.gauss(math.log(speedup), spread) for _ in range(n)]
    draw = random.Random(repr(logs))  # its own stream: the speedups stay those `rng` gave before rates were drawn
    alphas = [min(1.0, max(0.0, draw.gauss(alpha, alpha_spread))) for _ in range(n)]
    return Window(TypeCounts(requests=n, spec_requests=n, spec_busy_seconds=float(n),
                             spec_plain_seconds=sum(math.exp(x) for x in logs), spec_speedups=n,
                             spec_log_speedup_sum=sum(logs), spec_log_speedup_sq=sum(x * x for x in logs),
                             draft_tokens=40 * n, accepted_tokens=round(40 * sum(alphas)), spec_alphas=n,
                             spec_alpha_sum=sum(alphas), spec_alpha_sq=sum(a * a for a in alphas)),
                  pods=1, seconds=WINDOW_S)


def run(windows_by_tick, policy=SelectPolicy(min_dwell_s=3 * WINDOW_S), pins=None, default="ngram", choices=None):
    """Judge a sequence of {type: {method: Window}}, one per window; returns the choices after each
    and every move."""
    choices, history, events = choices or {}, [], []
    for i, windows in enumerate(windows_by_tick):
        choices, ev = choose(windows, choices, policy, now=i * WINDOW_S, candidates=CANDIDATES, default=default,
                             pins=pins or {})
        history.append({t: c.method for t, c in choices.items()})
        events += [(i, reason, message) for reason, message in ev if reason == MOVED]
    return choices, history, events


def explored(rng, current: str, n: int, speedups: dict[str, float], share: float = 0.1) -> dict[str, Window]:
    """One window of a type: most requests on its current method, `share` on the other."""
    other = next(m for m in CANDIDATES if m != current)
    return {current: window(rng, round(n * (1 - share)), speedups[current]),
            other: window(rng, max(1, round(n * share)), speedups[other])}


def test_a_clearly_faster_method_takes_the_type_and_says_why():
    rng = random.Random(1)
    ticks = [{"chat": explored(rng, "ngram", 60, {"ngram": 1.1, "eagle": 1.7})}]
    choices, history, events = run(ticks)
    assert history == [{"chat": "eagle"}]
    [(_, reason, message)] = events
    assert reason == MOVED
    assert re.fullmatch(r"prompt type chat: ngram -> eagle: speedup 1\.\d\dx against 1\.\d\dx, ratio 1\.\d\d "
                        r"\[1\.\d\d, 1\.\d\d\] over 6 and 54 requests \(weighted\)", message), message
    assert choices["chat"].since == 0.0


def test_too_few_requests_of_a_method_decide_nothing_until_they_add_up():
    rng = random.Random(2)
    ticks = [{"chat": {"ngram": window(rng, 30, 1.1), "eagle": window(rng, 1, 1.7)}} for _ in range(6)]
    _, history, events = run(ticks)
    assert history[0] == history[1] == history[2] == {"chat": "ngram"}  # 1, 1.9, 2.71 weighted requests
    assert history[-1] == {"chat": "eagle"} and len(events) == 1  # then the carried evidence is enough


def test_methods_that_pay_alike_never_flap():
    """Equal speedups, noisy requests, 200 windows of two types: the margin and the interval hold
    every type where it is."""
    rng = random.Random(3)
    ticks = [{t: explored(rng, "ngram", 40, {"ngram": 1.3, "eagle": 1.3}) for t in ("chat", "math")}
             for _ in range(200)]
    _, history, events = run(ticks, policy=SelectPolicy(min_dwell_s=0.0))
    assert events == [] and history[-1] == {"chat": "ngram", "math": "ngram"}


def test_a_method_a_little_better_than_the_margin_does_not_move_the_type():
    rng = random.Random(4)
    ticks = [{"chat": explored(rng, "ngram", 60, {"ngram": 1.30, "eagle": 1.33})} for _ in range(100)]
    _, _, events = run(ticks, policy=SelectPolicy(min_dwell_s=0.0))
    assert events == []  # 2.3% better, under the 5% margin


def test_a_traffic_shift_moves_only_the_shifted_type_once_within_three_windows():
    rng = random.Random(5)
    calm = {"ngram": 1.6, "eagle": 1.3}  # n-gram pays on both types at first
    shifted = {"ngram": 0.95, "eagle": 1.4}  # code's prompts change to text n-gram cannot draft
    ticks = []
    current = {"code": "ngram", "chat": "ngram"}
    choices: dict[str, Choice] = {}
    events = []
    for i in range(20):
        code = shifted if i >= 10 else calm
        windows = {"code": explored(rng, current["code"], 40, code, share=0.05),
                   "chat": explored(rng, current["chat"], 40, calm, share=0.05)}
        choices, ev = choose(windows, choices, SelectPolicy(min_dwell_s=3 * WINDOW_S), now=i * WINDOW_S,
                             candidates=CANDIDATES, default="ngram", pins={})
        current = {t: c.method for t, c in choices.items()}
        events += [(i, m) for reason, m in ev if reason == MOVED]
        ticks.append(current)
    assert all(t == {"code": "ngram", "chat": "ngram"} for t in ticks[:10])
    moved_at = [i for i, m in events]
    assert len(events) == 1 and events[0][1].startswith("prompt type code: ngram -> eagle")
    assert 10 <= moved_at[0] <= 12  # within 3 windows of the shift
    assert all(t == {"code": "eagle", "chat": "ngram"} for t in ticks[moved_at[0]:])


def shifted_explored_method(seed: int) -> tuple[list[dict[str, str]], list[tuple[int, str, str]]]:
    """Code runs the head; n-gram, explored by 8 of its 40 requests a window, pays like it (1.0x,
    its drafts accepted half the time) until window 15, when code's prompts become edits of pasted
    code: n-gram's drafts copy it (accepted 0.85 of the time, 1.25x) and the head's do not change.
    Chat's traffic never changes. Returns the methods after each window and every event."""
    rng = random.Random(seed)
    calm = {"eagle": (1.0, 0.3), "ngram": (1.0, 0.5)}  # (speedup, alpha)
    edits = {"eagle": (1.0, 0.3), "ngram": (1.25, 0.85)}
    choices: dict[str, Choice] = {}
    current = {"code": "eagle", "chat": "eagle"}
    history, events = [], []
    for i in range(22):
        windows = {}
        for t in ("code", "chat"):
            speed = edits if t == "code" and i >= 15 else calm
            other = next(m for m in CANDIDATES if m != current[t])
            windows[t] = {current[t]: window(rng, 32, speed[current[t]][0], alpha=speed[current[t]][1]),
                          other: window(rng, 8, speed[other][0], alpha=speed[other][1])}
        choices, ev = choose(windows, choices, SelectPolicy(min_dwell_s=3 * WINDOW_S), now=i * WINDOW_S,
                             candidates=CANDIDATES, default="eagle", pins={})
        current = {t: c.method for t, c in choices.items()}
        history.append(current)
        events += [(i, reason, message) for reason, message in ev]
    return history, events


def test_a_shift_seen_only_by_an_explored_method_moves_its_type_within_three_windows():
    """The explored method's older windows (other traffic) would hold it back for windows; its
    acceptance tells the shift at once and restarts the type's evidence. Over 12 seeds: code
    runs n-gram from the third window of the shift on, in 10 or more from the second (carrying
    the old windows: 9); chat, whose traffic did not change, never moves; before the shift (equal
    speedups) at most one seed's noise moves code."""
    early, second = 0, 0
    for seed in range(12):
        history, events = shifted_explored_method(seed)
        moves = [(i, m) for i, r, m in events if r == MOVED]
        assert all(h["chat"] == "eagle" for h in history), (seed, moves)
        assert all(h["code"] == "ngram" for h in history[17:]), (seed, moves)  # windows 15, 16, 17
        assert len(moves) == 1 and moves[0][1].startswith("prompt type code: eagle -> ngram"), (seed, moves)
        if moves[0][0] < 15:
            early += 1
            continue
        second += moves[0][0] <= 16
        shifts = [(i, m) for i, r, m in events if r == methods.SHIFTED]
        assert any(i >= 15 and re.match(r"prompt type code: ngram's acceptance 0\.[789]", m) for i, m in shifts), shifts
    assert early <= 1 and early + second >= 10, (early, second)


def test_a_traffic_shift_restarts_every_method_s_evidence_and_says_why():
    rng = random.Random(11)
    calm = {"eagle": window(rng, 30, 1.0, alpha=0.3), "ngram": window(rng, 10, 1.0, alpha=0.5)}
    choices, _ = choose({"code": calm}, {}, SelectPolicy(), now=0.0, candidates=CANDIDATES, default="eagle", pins={})
    assert choices["code"].evidence["ngram"].speedups == 10
    edits = {"eagle": window(rng, 30, 1.0, alpha=0.3), "ngram": window(rng, 6, 1.25, alpha=0.85)}
    choices, events = choose({"code": edits}, choices, SelectPolicy(), now=60.0, candidates=CANDIDATES,
                             default="eagle", pins={})
    [(reason, message), (moved, _)] = events  # the shift, then the move it let the evidence show
    assert (reason, moved) == (methods.SHIFTED, MOVED)
    assert re.fullmatch(r"prompt type code: ngram's acceptance 0\.8\d over 6 requests against 0\.\d\d over 10 "
                        r"before \(99% of the difference: 0\.\d\d\); every method's evidence on it restarts from "
                        r"this window", message), message
    e = choices["code"].evidence
    assert (e["ngram"].speedups, e["eagle"].speedups, e["ngram"].windows) == (6, 30, 1)  # this window's alone


def test_steady_traffic_rarely_looks_shifted():
    """Noisy but unchanging traffic: the 99% test restarts a type's evidence in about 1% of
    windows per method (each restart costs evidence, never a wrong move)."""
    rng = random.Random(12)
    choices: dict[str, Choice] = {}
    shifts = 0
    for i in range(1000):
        windows = {"chat": {"ngram": window(rng, 30, 1.2, alpha=0.5, alpha_spread=0.25),
                            "eagle": window(rng, 3, 1.1, alpha=0.3, alpha_spread=0.25)}}
        choices, ev = choose(windows, choices, SelectPolicy(min_dwell_s=0.0), now=i * WINDOW_S,
                             candidates=CANDIDATES, default="ngram", pins={})
        shifts += sum(r == methods.SHIFTED for r, _ in ev)
        assert all(r != MOVED for r, _ in ev)
    assert shifts <= 30  # 3%: two tests a window at 1% each, and the weighted evidence's looser fit


def test_a_type_does_not_move_back_before_its_dwell():
    rng = random.Random(6)
    fast_eagle = {"ngram": 1.1, "eagle": 1.8}
    fast_ngram = {"ngram": 1.8, "eagle": 1.1}
    policy = SelectPolicy(min_dwell_s=5 * WINDOW_S)
    choices, current, moves = {}, "ngram", []
    for i in range(12):
        speed = fast_eagle if i < 2 else fast_ngram
        choices, ev = choose({"chat": explored(rng, current, 60, speed)}, choices, policy, now=i * WINDOW_S,
                             candidates=CANDIDATES, default="ngram", pins={})
        current = choices["chat"].method
        moves += [i for reason, _ in ev if reason == MOVED]
    assert moves[0] == 0 and moves[1] == 5  # back to n-gram only once the dwell passed
    assert len(moves) == 2


def test_a_pinned_type_is_never_moved_and_an_unserved_choice_falls_back_to_the_default():
    rng = random.Random(7)
    ticks = [{"code": explored(rng, "ngram", 60, {"ngram": 1.0, "eagle": 2.0})} for _ in range(5)]
    choices, history, events = run(ticks, pins={"code": "ngram"})
    assert events == [] and choices == {}
    stale = {"chat": Choice("medusa", since=0.0)}  # the spec no longer serves what the loop chose
    choices, _ = choose({}, stale, SelectPolicy(), now=1e6, candidates=CANDIDATES, default="eagle", pins={})
    assert choices["chat"].method == "eagle"


def test_nothing_is_chosen_with_one_candidate_or_when_disabled():
    rng = random.Random(8)
    windows = {"chat": explored(rng, "ngram", 60, {"ngram": 1.0, "eagle": 2.0})}
    assert choose(windows, {}, SelectPolicy(), 0.0, candidates=("ngram",), default="ngram", pins={}) == ({}, [])
    assert choose(windows, {}, SelectPolicy(enabled=False), 0.0, candidates=CANDIDATES, default="ngram",
                  pins={}) == ({}, [])


def test_a_choice_survives_the_status_round_trip_with_its_weighted_evidence():
    rng = random.Random(9)
    choices, _, _ = run([{"chat": explored(rng, "ngram", 60, {"ngram": 1.1, "eagle": 1.7})}] * 3)
    for c in choices.values():
        back = Choice.from_status(c.to_status())
        assert back.method == c.method and back.since == c.since
        for m, e in c.evidence.items():
            assert back.evidence[m].speedups == pytest.approx(e.speedups, rel=1e-3)
            assert back.evidence[m].speedup == pytest.approx(e.speedup, rel=1e-3)


def test_policy_from_spec():
    p = SelectPolicy.from_spec({"routing": {"select": {"exploreShare": 2, "margin": 0.1, "minDwell": "5m"}}})
    assert (p.enabled, p.margin, p.min_dwell_s) == (True, 0.1, 300.0)
    assert SelectPolicy.from_spec({}) == SelectPolicy()


def test_docstring_examples():
    assert doctest.testmod(methods).failed == 0


def test_the_loop_moves_a_type_learns_its_baseline_afresh_and_the_live_state_routes_and_explores():
    """From windows to routing: `loop.tick` with a Selection from the spec chooses, the status
    round-trips it, and the live state routes the type to its new method, explores the other,
    and leaves the pinned type alone."""
    from specfleet_api import fleet_spec
    from specfleet_control import canary, loop
    from specfleet_control.fleet import fleet_state
    from specfleet_control.methods import Selection
    from specfleet_control.observe import Observation
    from specfleet_control.slo import KeyState, SloPolicy

    spec = {"draft": {"method": "eagle", "uri": "x"}, "speculation": {"kMin": 0, "kMax": 6},
            "routing": {"default": "ngram", "byPromptType": {"code": "ngram"}}}
    rng = random.Random(10)
    obs = Observation(methods={"stable": {"chat": explored(rng, "ngram", 60, {"ngram": 1.1, "eagle": 1.8}),
                                          "code": explored(rng, "ngram", 60, {"ngram": 1.0, "eagle": 2.0})}})
    memory = loop.Memory(keys={"type:chat": KeyState(baseline=0.7, baseline_tokens=5000)})
    selection = Selection.from_spec(spec)
    assert selection.candidates == ("ngram", "eagle") and selection.pins == {"code": "ngram"}
    t = loop.tick(obs, memory, SloPolicy(window_s=WINDOW_S), now=100.0, selection=selection)
    assert t.memory.chosen_methods() == {"chat": "eagle"}  # code is pinned: never chosen for
    assert [r for r, _ in t.events] == [MOVED]
    assert t.memory.keys["type:chat"].baseline is None  # eagle accepts at its own rate
    assert loop.Memory.from_status(t.memory.to_status()).chosen_methods() == {"chat": "eagle"}

    state = fleet_spec.live_state(spec, fleet_state(t.memory, canary.CanaryState(), spec))
    assert state.method_for("chat") == "eagle" and state.method_for("code") == "ngram"
    assert state.method_for("math") == "ngram"  # not seen yet: the default
    draws = [i / 10 for i in range(1000)]
    chat = [state.route("chat", draw=d)[0] for d in draws]
    assert chat.count("ngram") == 50 and chat.count("eagle") == 950  # 5% explore n-gram
    assert {state.route("code", draw=d)[0] for d in draws} == {"ngram"}  # a pin is never explored

    off = {**spec, "routing": {**spec["routing"], "select": {"enabled": False}}}
    t2 = loop.tick(obs, t.memory, SloPolicy(window_s=WINDOW_S), now=200.0, selection=Selection.from_spec(off))
    assert t2.memory.chosen_methods() == {}  # turned off: the spec's table again
    state = fleet_spec.live_state(off, fleet_state(t2.memory, canary.CanaryState(), off))
    assert state.method_for("chat") == "ngram" and state.explore_share == 0.0


def test_a_type_that_fell_back_moves_to_another_method_that_clearly_pays_and_only_then():
    """In fallback the type runs plain decoding (its method did not pay); its explorers keep
    drafting with the other method, and once that one's own speedup is clearly above plain
    decoding's the type moves to it, to come back on it. One near 1.0 is not enough."""
    rng = random.Random(11)
    pays = {"chat": {"eagle": window(rng, 2, 0.9), "ngram": window(rng, 6, 1.3)}}
    choices, events = choose(pays, {}, SelectPolicy(), 0.0, candidates=CANDIDATES, default="eagle", pins={},
                             plain=frozenset({"chat"}))
    assert choices["chat"].method == "ngram"
    [(reason, message)] = events
    assert reason == MOVED and message.startswith("prompt type chat: eagle -> ngram: eagle fell back to plain "
                                                  "decoding, ngram's speedup 1.3")
    even = {"chat": {"eagle": window(rng, 2, 0.9), "ngram": window(rng, 30, 1.02)}}
    choices, events = choose(even, {}, SelectPolicy(), 0.0, candidates=CANDIDATES, default="eagle", pins={},
                             plain=frozenset({"chat"}))
    assert choices["chat"].method == "eagle" and events == []
    choices, events = choose(pays, {}, SelectPolicy(), 0.0, candidates=CANDIDATES, default="eagle",
                             pins={"chat": "eagle"}, plain=frozenset({"chat"}))
    assert choices == {} and events == []


def cluster_window(rng: random.Random, prompt_type: str, speedups: dict[str, tuple[int, float]],
                   alpha: float = 0.6):
    """A router's window of one prompt cluster: per method, (requests, speedup) of its stable requests."""
    from specfleet_api.windows import ClusterMethod, ClusterWindow

    methods = {}
    for m, (n, speedup) in speedups.items():
        c = ClusterMethod()
        for _ in range(n):
            c = c.plus_request(40, int(40 * alpha), math.exp(rng.gauss(math.log(speedup), 0.15)), 1.0)
        methods[m] = c
    n = sum(c.requests for c in methods.values())
    return ClusterWindow(prompt_type, requests=n, spec_requests=n, draft_tokens=40 * n,
                         accepted_tokens=sum(c.accepted_tokens for c in methods.values()), seconds=WINDOW_S,
                         methods=methods)


def test_a_prompt_cluster_moves_off_its_types_method_and_only_it():
    """A type whose drafts pay alike on the whole keeps its method; one of its clusters, where
    another method is clearly faster, moves to it (one event, its SLO baseline learnt afresh);
    the cluster of a pinned type and the type's other cluster stay; the status round-trips the
    choice, the live state routes that cluster's requests to it (and still explores), and a
    cluster no router reports for ten windows is forgotten, choice and all."""
    from specfleet_api import fleet_spec
    from specfleet_control import canary, loop
    from specfleet_control.fleet import fleet_state
    from specfleet_control.methods import Selection
    from specfleet_control.observe import Observation
    from specfleet_control.slo import KeyState, SloPolicy

    spec = {"draft": {"method": "eagle", "uri": "x"}, "speculation": {"kMin": 0, "kMax": 6},
            "routing": {"default": "ngram", "byPromptType": {"code": "ngram"}}}
    rng = random.Random(12)
    obs = Observation(
        methods={"stable": {"chat": explored(rng, "ngram", 60, {"ngram": 1.3, "eagle": 1.3})}},
        clusters={"r/1": cluster_window(rng, "chat", {"ngram": (20, 1.05), "eagle": (6, 1.9)}),
                  "r/2": cluster_window(rng, "chat", {"ngram": (20, 1.4), "eagle": (6, 1.3)}),
                  "r/3": cluster_window(rng, "code", {"ngram": (20, 1.0), "eagle": (6, 2.0)})})
    memory = loop.Memory(keys={"cluster:r/1": KeyState(baseline=0.7, baseline_tokens=900)})
    selection = Selection.from_spec(spec)
    policy = SloPolicy(window_s=WINDOW_S)
    t = loop.tick(obs, memory, policy, now=100.0, selection=selection)
    assert t.memory.chosen_methods() == {"chat": "ngram"}
    assert t.memory.cluster_routes() == {"r/1": "eagle"}
    moves = [m for r, m in t.events if r == MOVED]
    assert len(moves) == 1 and moves[0].startswith("prompt cluster r/1 (chat): ngram -> eagle: speedup 1.9"), moves
    assert t.memory.keys["cluster:r/1"].baseline is None
    assert "r/3" not in t.memory.cluster_methods  # code is pinned, and so are its clusters
    back = loop.Memory.from_status(t.memory.to_status())
    assert back.cluster_routes() == {"r/1": "eagle"} and back.cluster_methods["r/2"].method == "ngram"

    state = fleet_spec.live_state(spec, fleet_state(back, canary.CanaryState(), spec))
    assert state.cluster_routes == {"r/1": "eagle"}
    assert fleet_spec.LiveState.from_json(state.to_json()) == state
    draws = [i / 10 for i in range(1000)]
    r1 = [state.route("chat", cluster="r/1", draw=d)[0] for d in draws]
    assert r1.count("eagle") == 950 and r1.count("ngram") == 50  # the cluster explores n-gram
    assert state.route("chat", cluster="r/2")[0] == "ngram" and state.route("chat")[0] == "ngram"

    again = loop.tick(obs, t.memory, policy, now=160.0, selection=selection)
    assert [r for r, _ in again.events if r == MOVED] == [] and again.memory.cluster_routes() == {"r/1": "eagle"}
    quiet = Observation(methods=obs.methods)
    later = loop.tick(quiet, again.memory, policy, now=160.0 + 11 * WINDOW_S, selection=selection)
    assert later.memory.cluster_methods == {}


def test_a_cluster_follows_its_type_until_it_moves_on_its_own():
    """A cluster the loop never moved runs what its type runs, after the type moves too."""
    rng = random.Random(13)
    flat = {"r/1": {"ngram": cluster_window(rng, "chat", {"ngram": (20, 1.3), "eagle": (6, 1.3)}).methods["ngram"]}}
    choices, events = choose(flat, {"r/1": Choice("ngram")}, SelectPolicy(), 0.0, candidates=CANDIDATES,
                             default="ngram", pins={}, defaults={"r/1": "eagle"},
                             evidence_of=methods.cluster_method_evidence)
    assert choices["r/1"].method == "eagle" and choices["r/1"].since is None and events == []
    moved = {"r/1": Choice("ngram", since=0.0)}
    choices, _ = choose(flat, moved, SelectPolicy(), 10.0, candidates=CANDIDATES, default="ngram", pins={},
                        defaults={"r/1": "eagle"}, evidence_of=methods.cluster_method_evidence)
    assert choices["r/1"].method == "ngram"
