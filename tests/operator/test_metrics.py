"""The scrape parser reads what the worker exports, P99 latency included, so that a canary that
checks p99LatencySeconds is judged on a number instead of "not reported"."""
import doctest
import math
import random

import pytest
from prometheus_client import generate_latest

from specfleet_operator import metrics, policy
from specfleet_operator import spec as specs
from specfleet_worker.metrics import LATENCY_BUCKETS, Metrics


def test_the_docstrings_hold():
    for module in (metrics, specs):
        assert doctest.testmod(module).failed == 0


def worker_text(latencies: list[float]) -> str:
    """/metrics of a worker that finished requests with these arrival-to-last-token latencies."""
    m = Metrics("smollm2-135m", "none")
    for seconds in latencies:
        m.e2e.labels("smollm2-135m").observe(seconds)
    return generate_latest(m.registry).decode()


def bucket_of(value: float) -> tuple[float, float]:
    bounds = (0.0, *LATENCY_BUCKETS, math.inf)
    return next((lo, hi) for lo, hi in zip(bounds, bounds[1:]) if lo < value <= hi)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_p99_comes_from_the_workers_latency_histogram(seed):
    rng = random.Random(seed)
    latencies = [rng.lognormvariate(0.0, 1.0) for _ in range(500)]
    p99 = metrics.parse_role_metrics(worker_text(latencies)).p99_latency_seconds
    true_p99 = sorted(latencies)[math.ceil(0.99 * len(latencies)) - 1]
    lo, hi = bucket_of(true_p99)
    assert p99 is not None and lo <= p99 <= hi, (p99, true_p99)


def test_p99_interpolates_inside_its_bucket_and_is_absent_without_requests():
    # 90 requests in (0.5, 1], 10 in (1, 2.5]: the 99th lies 9/10 of the way into (1, 2.5]
    text = worker_text([0.75] * 90 + [2.0] * 10)
    assert metrics.parse_role_metrics(text).p99_latency_seconds == pytest.approx(1.0 + 1.5 * 0.9)
    assert metrics.parse_role_metrics(worker_text([])).p99_latency_seconds is None
    # beyond the last finite bucket, the histogram can only say "at least this"
    assert metrics.parse_role_metrics(worker_text([500.0] * 3)).p99_latency_seconds == LATENCY_BUCKETS[-1]


def test_a_canary_checking_p99_is_judged_not_aborted_for_a_missing_metric():
    p = policy.Policy(canary_weight=1, steps=((10, 60.0),), analysis_interval_s=60,
                      checks=(("p99LatencySeconds", None, 5.0),))
    state = policy.decide_canary(policy.Metrics(), policy.LoopState(), p, now=0.0).state
    fast = metrics.parse_role_metrics(worker_text([0.2] * 200))
    moved = policy.decide_canary(policy.Metrics(canary=fast), state, p, now=60.0)
    assert moved.state.canary_weight == 10 and moved.state.failed_checks == 0
    slow = metrics.parse_role_metrics(worker_text([20.0] * 200))
    failed = policy.decide_canary(policy.Metrics(canary=slow), state, p, now=60.0)
    assert failed.state.failed_checks == 1
    assert "p99LatencySeconds" in failed.events[0][1] and "not reported" not in failed.events[0][1]
