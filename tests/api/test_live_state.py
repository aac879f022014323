"""The live state document: round trip, versions, and refusals that name the field."""
from __future__ import annotations

import doctest

import pytest

from specfleet_api import live_state
from specfleet_api.live_state import KBounds, LiveState, Routing


def test_docstring_examples():
    assert doctest.testmod(live_state).failed == 0


def test_round_trip_and_next_version():
    s = LiveState(version=3, canary_weight=1.25, routes={"code": "none", "translation": "ngram"},
                  fallback=("rag",), k={"stable": KBounds(0, 8), "canary": KBounds(2, 4)})
    assert LiveState.from_json(s.to_json()) == s
    n = s.next(canary_weight=5.0)
    assert n.version == 4 and n.canary_weight == 5.0 and n.updated > 0 and n.k == s.k
    assert s.method_for("code") == "none" and s.method_for("rag") == "none" and s.method_for("chat") == "ngram"
    assert LiveState(speculate=False).method_for("chat") == "none"


def test_an_arm_with_its_own_table():
    s = LiveState(version=1, routes={"code": "none"}, arms={"canary": Routing("draft-model", {"rag": "none"})})
    assert LiveState.from_json(s.to_json()) == s
    assert s.method_for("code", "stable") == "none" and s.method_for("code", "canary") == "draft-model"
    assert s.method_for("rag", "canary") == "none" and s.next(canary_weight=2.0).arms == s.arms
    assert "arms" not in LiveState(version=1).to_json()  # older readers see the document they know
    assert LiveState(version=1, fallback=("code",), arms=s.arms).method_for("code", "canary") == "none"


def test_exploration_round_trips_splits_its_share_evenly_and_keeps_clear_of_probes_pins_and_own_tables():
    s = LiveState(version=2, routes={"chat": "eagle"}, explore_share=6.0, candidates=("ngram", "eagle", "medusa"),
                  pinned=("code",), fallback=("rag",), probe_share=5.0)
    assert LiveState.from_json(s.to_json()) == s and s.next(version=9).candidates == s.candidates
    assert "explore_share" not in LiveState(version=1).to_json()  # older readers see the document they know
    draws = [i / 100 for i in range(10000)]
    chat = [s.route("chat", draw=d) for d in draws]
    assert chat.count(("eagle", False)) == 9400
    assert chat.count(("ngram", False)) == chat.count(("medusa", False)) == 300  # 6% over the two others
    assert {s.route("code", draw=d) for d in draws} == {("ngram", False)}  # pinned: never explored
    rag = [s.route("rag", draw=d) for d in draws]  # in fallback: probes at the bottom, explorers at the top
    assert rag.count(("ngram", True)) == 500 and rag.count(("eagle", True)) == rag.count(("medusa", True)) == 300
    assert rag.count(("none", False)) == 10000 - 500 - 600
    own = LiveState(explore_share=6.0, candidates=("ngram", "eagle"), arms={"canary": Routing("ngram")})
    assert {own.route("chat", "canary", draw=d) for d in draws} == {("ngram", False)}  # its own table: not explored


@pytest.mark.parametrize("doc,field", [
    ('{"version": 1, "explore_share": 120}', "explore_share"),
    ('{"version": 1, "candidates": ["ngram", "none"]}', "candidates"),
    ('{"version": 1, "pinned": ["poetry"]}', "poetry"),
    ('{"version": 1, "canary_weight": 1.234}', "canary_weight"),
    ('{"version": 1, "routes": {"code": "eagle2"}}', "routes['code']"),
    ('{"version": 1, "fallback": ["poetry"]}', "poetry"),
    ('{"version": 1, "k": {"stable": {"kMin": 5, "kMax": 2}}}', "k['stable']"),
    ('{"version": 1, "arms": {"canary": {"default_method": "medusa2"}}}', "arms['canary'].default_method"),
    ('{"version": 1, "arms": {"blue": {"default_method": "ngram"}}}', "arms['blue']"),
    ('{"canary_weight": 1}', "version"),
    ("not json", "not a state document"),
])
def test_bad_documents_are_refused_naming_what_is_wrong(doc, field):
    with pytest.raises(ValueError, match="live state") as e:
        LiveState.from_json(doc)
    assert field in str(e.value)
