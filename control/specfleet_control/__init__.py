"""The fleet's control loop, pure and torch-free: what the operator's daemon and `specfleet up`
both run (docs/control-loop.md).

    observe.py  what the loop reads: the workers' and routers' windows in Redis, readiness, alerts
    slo.py      the alpha / speedup SLO per prompt type, per prompt cluster and per deployment:
                fallback, probing, recovery, hysteresis and dwell
    canary.py   canary analysis (Argo Rollouts / Flagger semantics over the request-level split)
    loop.py     one tick of both: (observation, memory, spec, now) -> (memory, live state, events)
"""
