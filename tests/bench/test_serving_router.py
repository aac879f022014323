"""The serving benchmark through a router (`--router`): speculation off and on per request, which on
a fleet of vLLM pools picks the arm's plain or n-gram pool (servers speaking vLLM's API:
specfleet_router.testing.FakeVllm), with outputs compared across the two."""
from __future__ import annotations

import json

from specfleet_bench import serving
from specfleet_router.backends import parse_vllm_backends
from specfleet_router.testing import FakeVllm, running_router, serving_app


def test_the_serving_benchmark_drives_a_vllm_fleet_through_the_router(tmp_path):
    ngram, plain = FakeVllm(4, 0.6), FakeVllm(None)
    with serving_app(ngram.app()) as p_ngram, serving_app(plain.app()) as p_plain:
        backends = parse_vllm_backends([f"stable/ngram=127.0.0.1:{p_ngram}", f"stable/none=127.0.0.1:{p_plain}"],
                                       ("none", "ngram"))
        with running_router(backends=backends, name="fleet") as r:
            r.wait_ready(stable=2)
            out = tmp_path / "serving.json"
            assert serving.main(["--router", r.grpc_target, "--limit", "4", "--max-tokens", "16",
                                 "--concurrency", "1,2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["concurrency"] for row in rows] == [1, 2]
    for row in rows:
        assert row["identical"] and not row["on"]["errors"] and not row["off"]["errors"]
        assert row["on"]["tau"] > 1.0 and row["off"]["tau"] == 1.0  # the n-gram pool drafted; the plain one not
    # off went to the plain pool, on to the n-gram pool: 4 prompts x 2 levels each (and the warm-up)
    assert plain.requests >= 8 and ngram.requests >= 8
