"""The router process SIGTERMed mid-load: it drains. Requests in flight finish, new ones are
refused (503 while it drains, then connection refused), and it exits 0."""
from __future__ import annotations

import signal

from specfleet_router.faults import run_load
from specfleet_router.testing import RouterProcess


def test_the_router_sigtermed_mid_load_drains_and_exits_0(h, arms):
    with RouterProcess("--backend", f"stable={h.target(arms.stable)}", "--drain-seconds", "10") as router:
        router.wait_ready()
        report = run_load(router.base_url, model="specfleet", requests=200, clients=16, max_tokens=16,
                          fault=lambda: router.proc.send_signal(signal.SIGTERM), timeout_s=15)
        print(report.summary())
        assert router.proc.wait(timeout=15) == 0, "".join(router.lines[-20:])
        assert not report.hung(), report.summary()
        in_flight = report.in_flight_at_fault()
        assert in_flight and any(o.ok for o in in_flight), report.summary()
        for o in report.failed():
            assert o.started > report.fault_at - 0.05, f"request {o.index} sent before the SIGTERM failed: {o}"
            assert not o.streamed, f"request {o.index} was cut mid-stream: {o}"
            assert o.error == "connection" or (o.error == "503" and "shutting down" in o.message), o
        # once a client has been refused ("shutting down", or the port closed), no request sent after that is taken
        refused = report.failed()
        assert refused, report.summary()
        draining_seen = min(o.ended for o in refused)
        late = [o for o in report.outcomes if o.started > draining_seen + 0.05]
        assert late and not any(o.ok for o in late), "the draining router took new requests"
        assert '"drained": true' in "".join(router.lines)
