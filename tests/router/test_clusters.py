"""Prompt clusters and probe draws, without a fleet: two kinds of prompt inside one prompt type
land in clusters of their own, the same way in every process; the cap holds; a probe share of 5%
probes 5% of a fallen-back type's requests."""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from specfleet_api.live_state import LiveState
from specfleet_router.clusters import Clusters, embed
from specfleet_router.dispatch import draw
from specfleet_router.testing import finnish_prose, python_code

def mixed(n: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(kind, gen(rng)) for kind, gen in (rng.choice([("python", python_code), ("finnish", finnish_prose)])
                                                for _ in range(n))]


def test_the_embedding_is_the_same_in_another_process():
    text = "Kirjoita minulle runo keväästä: def f(x): return x ** 2"
    code = f"import json; from specfleet_router.clusters import embed; print(json.dumps(embed({text!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={"PYTHONHASHSEED": "random", "PATH": ""})
    assert json.loads(out.stdout) == list(embed(text))


def test_python_code_and_finnish_prose_of_one_type_land_in_different_clusters_consistently():
    clusters = Clusters("r0", max_clusters=16)
    learned: dict[str, set[str]] = {"python": set(), "finnish": set()}
    for kind, text in mixed(300, seed=1):
        learned[kind].add(clusters.assign("chat", text))
    assert learned["python"] and learned["finnish"] and not learned["python"] & learned["finnish"], learned
    assert len(learned["python"] | learned["finnish"]) < 16  # the kinds grouped, not one cluster per prompt
    # prompts never seen before go where their kind went
    for kind, text in mixed(100, seed=2):
        assert clusters.assign("chat", text) in learned[kind], (kind, text)


def test_two_routers_fed_the_same_prompts_learn_the_same_clusters():
    a, b = Clusters("r0"), Clusters("r0")
    prompts = [t for _, t in mixed(200, seed=3)]
    assert [a.assign("chat", t) for t in prompts] == [b.assign("chat", t) for t in prompts]


def test_the_cap_holds_per_prompt_type_and_ids_name_one_type():
    rng = random.Random(4)
    noise = ["".join(chr(rng.randrange(33, 127)) for _ in range(rng.randint(40, 200))) for _ in range(200)]
    clusters = Clusters("r0", max_clusters=3)
    ids = {t: {clusters.assign(t, text) for text in noise[:100]} for t in ("chat", "code")}
    assert len(ids["chat"]) == 3 and len(ids["code"]) == 3 and not ids["chat"] & ids["code"]
    assert clusters.assign("chat", "hi") is None  # too short to embed: no cluster


@pytest.mark.parametrize("kw, wrong", [({"max_clusters": 0}, "max clusters"), ({"threshold": 1.5}, "threshold")])
def test_bad_settings_say_what_is_wrong(kw, wrong):
    with pytest.raises(ValueError, match=wrong):
        Clusters("r0", **kw)


def test_a_five_percent_probe_share_probes_five_percent_of_a_fallen_back_types_requests():
    n, p = 10_000, 0.05
    state = LiveState(fallback=("code",), probe_share=5.0)
    routes = [state.route("code", "stable", None, draw(f"req-{i}", "probe")) for i in range(n)]
    probes = sum(probe for _, probe in routes)
    sd = math.sqrt(n * p * (1 - p))
    assert n * p - 3.29 * sd <= probes <= n * p + 3.29 * sd, probes
    assert {m for m, probe in routes if probe} == {"ngram"} and {m for m, probe in routes if not probe} == {"none"}
    # the draw is the request's: the same id is a probe every time, and the mirror's draw is another
    assert [draw(f"req-{i}", "probe") for i in range(50)] == [draw(f"req-{i}", "probe") for i in range(50)]
    mirror = [draw(f"req-{i}", "mirror") < 5.0 for i in range(n)]
    both = sum(m and probe for m, (_, probe) in zip(mirror, routes))
    assert both < 3 * n * p * p + 10  # independent draws: about 0.25% are both


def test_a_grown_cluster_does_not_absorb_another_kind_sharing_its_template():
    """Finnish requests to translate never join the German translation cluster, whatever the arrival
    order, however large the German cluster grew first. (Judged by the cosine to the cluster's mean,
    a big cluster scores everything higher: it absorbed the Finnish prompts in most orders, and the
    alpha-collapse episode's Finnish cluster then never fell back.)"""
    from specfleet_bench.alpha_collapse import ood_prompt
    from specfleet_bench.questions import default_questions, load_questions
    from specfleet_router.classify import classify

    german = [q["turns"][0] for q in load_questions(default_questions())
              if classify(q["turns"][0]).value == "translation" and "German" in q["turns"][0]]
    assert len(german) >= 20
    for seed in range(12):
        rng = random.Random(seed)
        clusters = Clusters("r0")
        learned: dict[str, set[str]] = {"german": set(), "finnish": set()}
        for _ in range(rng.randint(20, 80)):  # the type's usual traffic first
            learned["german"].add(clusters.assign("translation", rng.choice(german)))
        for _ in range(120):
            if rng.random() < 0.3:
                learned["finnish"].add(clusters.assign("translation", ood_prompt(rng)))
            else:
                learned["german"].add(clusters.assign("translation", rng.choice(german)))
        assert not learned["german"] & learned["finnish"], (seed, learned)
        assert len(learned["finnish"]) <= 2, (seed, learned)
