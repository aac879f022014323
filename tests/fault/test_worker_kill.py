"""One of two `specfleet serve` workers SIGKILLed mid-load: requests that had streamed nothing are
retried on the other (none lost), streamed ones end with an error event that says what happened,
and every request finishes within its timeout."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from specfleet_router.faults import run_load
from specfleet_worker.testing import WorkerProcess


def test_a_worker_sigkilled_mid_load_loses_no_request_that_had_not_streamed(h, tmp_path):
    config = h.worker_config(tmp_path / "stable.json")
    workers = [WorkerProcess(config, "--threads", "1") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:  # two cold starts at once
        list(pool.map(lambda w: w.start(60), workers))
    try:
        with h.router_over([f"127.0.0.1:{w.grpc_port}" for w in workers], eject_s=30) as r:
            r.wait_ready(2, timeout_s=30)
            report = run_load(r.base_url, model="specfleet", requests=200, clients=16, max_tokens=16,
                              fault=workers[0].kill, timeout_s=15)
            print(report.summary())
            assert len(report.in_flight_at_fault()) > 0, "the kill landed outside the load: " + report.summary()
            assert not report.lost(), [(o.index, o.error, o.message) for o in report.lost()]
            assert not report.hung(), report.summary()
            for o in report.failed():  # streamed, then cut: a clear error event, not a silent end
                assert o.error == "stream-error" and f"backend 127.0.0.1:{workers[0].grpc_port}" in o.message, o
            retried = r.metric("specfleet_router_retries_total", {"arm": "stable", "reason": "unavailable"})
            print(f"retried before the first token: {retried:.0f}")
            assert retried >= 1, "no request was retried: the kill did not exercise the retry"
            assert r.ready_counts()["stable"] == 1
    finally:
        for w in workers:
            w.kill()
