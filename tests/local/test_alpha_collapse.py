"""The alpha-collapse episode on a real local fleet (specfleet_bench.alpha_collapse): `specfleet up`
on SmolLM2 with the control loop, Redis, the router, the official openai client as the traffic.

One prompt type's traffic turns to sampling at temperature 1.5 (its n-gram drafts stop being
accepted): that type falls back, the other type keeps speculating, no request fails, the type's
throughput in fallback is at least 0.95x plain decoding (measured in place against its own plain
requests, and priced by the cost model), and when good traffic returns the probe brings
speculation back, one transition each way. Then an out-of-distribution prompt cluster inside the
healthy type falls back alone: its type and the type's own clusters keep speculating.

Phases last until they have shown what they are for (`--until-evidence`), not for fixed seconds:
the loop waits for evidence (a window too thin adds to the next), and a slower machine gathers it
more slowly (a collapsed type drafts little: its requests' K falls to 0, a probe token every 32
steps). So "within two windows" is timed from when the loop first held what a miss needs (the
key's pending evidence plus its window, judged as the loop judges), and on a fast machine that is
the collapse's first window. A phase that reaches its limit fails the test naming what the loop
lacked: the key's drafted tokens against what a miss needs at its alpha, and the loop's reason.

Clusters of the other type are judged on their own evidence against its baseline, and one may
fall back on its own: math word problems form clusters whose n-gram alpha differs (the docs run's
math cluster sat at 0.17-0.21 against its line 0.24, not yet clear after 10 requests; a run with
more of them crosses it). That is the loop doing what clusters are for, whatever the OOD phase
does, so "alone" is asserted within the OOD's own type. The same run with fixed, longer phases is
the episode plotted in docs/control-loop.md.
"""
from __future__ import annotations

import pytest

from specfleet_bench.alpha_collapse import Episode, build_parser

# each phase's limit on a fleet serving 200 tokens/s (a 2-core AVX-512 machine): about 4x what the
# slowest needs there. A slower fleet (measured as it runs) gets as much longer, at most 5x.
PHASE_LIMIT_S, MAX_STRETCH = 240, 5
# a hang guard: `up`'s start (at most 600 s) and the phases' own limits end it first
pytestmark = pytest.mark.timeout(600 + 4 * PHASE_LIMIT_S * MAX_STRETCH + 300)


@pytest.fixture(scope="module")
def episode():
    args = build_parser().parse_args([
        "--window", "10", "--dwell", "10", "--recover-after", "20", "--probe-share", "25", "--clients", "2",
        "--other-clients", "1", "--max-tokens", "64", "--warm", "10", "--collapse", "0", "--recover-phase", "0",
        "--cluster", "--cluster-phase", "0", "--until-evidence", "--phase-limit", str(PHASE_LIMIT_S),
        "--reference-tps", "200", "--max-stretch", str(MAX_STRETCH),
        "--ready-timeout", "600"])
    result = Episode(args).run()
    print({k: v for k, v in result.items() if k not in ("timeline", "calls")})  # the loop's events say why
    return result


def test_a_collapsed_type_falls_back_alone_within_two_windows_and_loses_no_request(episode):
    assert episode["error_count"] == 0, episode["errors"]
    assert episode["fallback_after_s"] is not None, episode["missing"]
    # within two windows of the loop holding what a miss needs (on a fast machine: of the collapse)
    assert episode["fallback_after_evidence_windows"] <= 2.0, episode
    assert episode["other_type_modes_by_phase"]["collapse"] == ["speculative"], episode
    # in later phases the other type may fall back on its own measured speedup (speculation slower
    # than plain decoding at that load: CI measured 0.93 once), never on its alpha
    assert all(why.startswith("speculation off: speedup ") for why in episode["other_type_fallbacks"]), episode


def test_the_type_in_fallback_runs_at_least_095x_plain_decoding(episode):
    assert episode["type_requests_in_fallback"] > 0 and episode["type_probes_in_fallback"] > 0, \
        episode["missing"] or episode
    assert episode["fallback_vs_plain_measured"] >= 0.95, episode
    assert episode["fallback_vs_plain_priced"] >= 0.95, episode


def test_speculation_returns_through_the_probe_one_transition_each_way(episode):
    assert episode["recovered_after_s"] is not None, episode["missing"] or episode
    assert episode["transitions"][f"type:{episode['type']}"] == ["enter", "leave"], episode["transitions"]
    assert all(len(moves) <= 2 for moves in episode["transitions"].values()), episode["transitions"]


def test_an_out_of_distribution_cluster_falls_back_alone(episode):
    cluster = episode["cluster"]
    assert cluster["fallback_after_s"] is not None, episode["missing"] or cluster
    # the loop's events say why when it is late (its type fell back first: clusters of a type that
    # runs plain are not judged)
    assert cluster["fallback_after_evidence_windows"] <= 2.0, (cluster, episode["loop_events"])
    assert cluster["type_clusters_in_fallback"] == [], cluster  # the type's own traffic keeps speculating
    assert cluster["type_modes"] == ["speculative"], cluster
    assert cluster["normal_request_methods_after"] == ["ngram"], cluster
    assert cluster["ood_methods_after"] == ["none"], cluster  # its requests run plain (probes aside)
