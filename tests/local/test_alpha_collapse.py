"""The alpha-collapse episode on a real local fleet (specfleet_bench.alpha_collapse): `specfleet up`
on SmolLM2 with the control loop, Redis, the router, the official openai client as the traffic.

One prompt type's traffic turns to sampling at temperature 1.5 (its n-gram drafts stop being
accepted): that type falls back within two windows, the other type keeps speculating, no request
fails, the type's throughput in fallback is at least 0.95x plain decoding (measured in place
against its own plain requests, and priced by the cost model), and when good traffic returns the
probe brings speculation back, one transition each way. Then an out-of-distribution prompt
cluster inside the healthy type falls back alone. The same run with longer phases is the episode
plotted in docs/control-loop.md.
"""
from __future__ import annotations

import pytest

from specfleet_bench.alpha_collapse import Episode, build_parser

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def episode():
    args = build_parser().parse_args([
        "--window", "10", "--dwell", "10", "--recover-after", "20", "--probe-share", "25", "--clients", "2",
        "--other-clients", "1", "--max-tokens", "64", "--warm", "35", "--collapse", "35", "--recover-phase", "65",
        "--cluster", "--cluster-phase", "80"])
    result = Episode(args).run()
    print({k: v for k, v in result.items() if k not in ("timeline", "calls")})  # the loop's events say why
    return result


def test_a_collapsed_type_falls_back_alone_within_two_windows_and_loses_no_request(episode):
    assert episode["error_count"] == 0, episode["errors"]
    assert episode["fallback_after_windows"] is not None and episode["fallback_after_windows"] <= 2.0, episode
    assert episode["other_type_modes_by_phase"]["collapse"] == ["speculative"], episode
    assert all(modes == ["speculative"] for modes in episode["other_type_modes_by_phase"].values()), episode


def test_the_type_in_fallback_runs_at_least_095x_plain_decoding(episode):
    assert episode["type_requests_in_fallback"] > 0 and episode["type_probes_in_fallback"] > 0, episode
    assert episode["fallback_vs_plain_measured"] >= 0.95, episode
    assert episode["fallback_vs_plain_priced"] >= 0.95, episode


def test_speculation_returns_through_the_probe_one_transition_each_way(episode):
    assert episode["recovered_after_s"] is not None, episode
    assert episode["transitions"][f"type:{episode['type']}"] == ["enter", "leave"], episode["transitions"]
    assert all(len(moves) <= 2 for moves in episode["transitions"].values()), episode["transitions"]


def test_an_out_of_distribution_cluster_falls_back_alone(episode):
    cluster = episode["cluster"]
    assert cluster["fallback_after_s"] is not None, cluster
    assert set(cluster["clusters_in_fallback"]) <= set(cluster["ood_clusters"]), cluster
    assert cluster["type_modes"] == ["speculative"], cluster  # the rest of its type keeps speculating
    assert cluster["normal_request_methods_after"] == ["ngram"], cluster
    assert cluster["ood_methods_after"] == ["none"], cluster  # its requests run plain (probes aside)
