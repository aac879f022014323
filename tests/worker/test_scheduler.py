"""The scheduler is the worker's core without a transport: it runs, refuses and reports with
gRPC and OpenTelemetry unimportable (a subprocess blocks both)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, time
    for name in ("grpc", "opentelemetry", "grpc_health", "grpc_reflection"):
        sys.modules[name] = None  # an import of any of them now raises ImportError
    from specfleet_api.engine_config import EngineConfig
    from specfleet_engine.engine import Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model
    from specfleet_worker.config import LiveConfig
    from specfleet_worker.metrics import Metrics
    from specfleet_worker.scheduler import Refusal, Rejected, Request, Scheduler

    engine = Engine(tiny_model(seed=0, scale=4.0), k_policy="fixed")
    live = LiveConfig(EngineConfig(model_name="tiny-random"), list(engine.proposers))
    sch = Scheduler(engine, live, Metrics("tiny", "none"), max_batch_size=1, max_queue=0).start()
    finished = []

    def request(rid, max_tokens, deadline=None):
        return Request(rid, [5, 6, 7, 5, 6], SamplingParams(max_tokens=max_tokens, ignore_eos=True), "ngram",
                       "chat", 4, deadline, on_finish=lambda r, e: finished.append((r.request_id, e and e.kind)))

    ok = request("ok", 40)
    sch.submit(ok)
    try:
        sch.submit(request("over", 4))  # batch of 1, no queue: refused at once
        raise SystemExit("an overloaded scheduler accepted a request")
    except Rejected as e:
        assert e.kind is Refusal.OVERLOADED, e.kind
    events = []
    while not events or events[-1].kind not in ("done", "error"):
        events.append(ok.events.get(timeout=30))
    assert events[-1].kind == "done" and sum(len(e.tokens or []) for e in events) == 40, events[-1]
    late = request("late", 2000, deadline=time.monotonic() + 0.05)
    sch.submit(late)
    ev = late.events.get(timeout=30)
    while ev.kind == "tokens":
        ev = late.events.get(timeout=30)
    assert ev.kind == "error" and ev.error.kind is Refusal.DEADLINE, ev
    sch.stop()
    assert finished == [("ok", None), ("late", Refusal.DEADLINE)], finished
    assert sys.modules["grpc"] is None and not any(
        m.startswith(("grpc.", "opentelemetry.")) for m in sys.modules), "a transport was imported"
    print("ok")
""")


def test_the_scheduler_runs_without_grpc_or_opentelemetry():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
