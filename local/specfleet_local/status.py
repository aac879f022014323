"""`specfleet status`: what `kubectl get sdd -o wide` shows, for the fleet `specfleet up` runs.

It reads the live state and the workers' windows in Redis and the router's /metrics, finding them
in `up`'s run file (or flags), and prints a table or, with `-o json`, the document that
docs/local.md specifies. Observing (`observe`) is kept apart from the document (`document`, pure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from specfleet_api import redis_auth
from specfleet_api.enums import PROMPT_TYPES
from specfleet_api.live_state import ARMS, LiveState, state_key

from . import runfile
from .redis_server import no_retry, run_credentials
from .state import loop_key
from specfleet_api.windows import Window, read_windows, sum_windows


def fetch(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    """(status, body) of a GET; OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def router_metrics(router_url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The router's /metrics: sample name -> [(labels, value)]; OSError when it does not answer."""
    status, text = fetch(router_url.rstrip("/") + "/metrics")
    if status != 200:
        raise OSError(f"{router_url}/metrics answered {status}")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def backends_by_arm(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, tuple[int, int]]:
    """{arm: (backends, ready)} from `specfleet_router_backend_ready`.

    >>> backends_by_arm({"specfleet_router_backend_ready": [({"arm": "stable", "backend": "a"}, 1.0),
    ...                                                     ({"arm": "stable", "backend": "b"}, 0.0)]})
    {'stable': (2, 1)}
    """
    out: dict[str, tuple[int, int]] = {}
    for labels, value in metrics.get("specfleet_router_backend_ready", []):
        total, ready = out.get(labels.get("arm", "?"), (0, 0))
        out[labels.get("arm", "?")] = (total + 1, ready + (value >= 1))
    return out


def router_backends(router_url: str) -> dict[str, tuple[int, int]]:
    return backends_by_arm(router_metrics(router_url))


def _gauge(metrics: dict | None, name: str) -> float | None:
    samples = (metrics or {}).get(name)
    return samples[0][1] if samples else None


@dataclasses.dataclass
class Observed:
    """What `status` could read, each None (or empty) when it could not."""

    namespace: str
    name: str
    redis_url: str | None = None
    router_url: str | None = None
    run: dict[str, Any] | None = None
    redis_error: str | None = None
    state: LiveState | None = None
    state_error: str | None = None
    windows: dict[str, dict[str, Window]] = dataclasses.field(default_factory=dict)
    router_error: str | None = None
    metrics: dict[str, list[tuple[dict[str, str], float]]] | None = None
    readyz: tuple[int, str] | None = None
    loop: dict[str, Any] | None = None  # the control loop's mirror (state.loop_key), when it runs
    now: float = 0.0


def _credentials(redis_url: str, run: dict[str, Any] | None) -> dict[str, str]:
    """The run's admin login for the run's own Redis, else the environment's (docs/redis.md)."""
    if run and (run.get("redis") or {}).get("url") == redis_url:
        return run_credentials(run)
    return redis_auth.credentials_from_env()


def observe(namespace: str, name: str, redis_url: str | None, router_url: str | None,
            run: dict[str, Any] | None = None) -> Observed:
    obs = Observed(namespace, name, redis_url, router_url, run, now=time.time())
    if redis_url:
        import redis

        # a paused Redis costs 2 s a call, not redis-py's default 10 retries of it
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2, retry=no_retry(),
                                      **_credentials(redis_url, run))
        try:
            raw = client.get(state_key(namespace, name))
            if raw is None:
                obs.state_error = f"no live state at {state_key(namespace, name)}"
            else:
                try:
                    obs.state = LiveState.from_json(raw)
                except ValueError as e:
                    obs.state_error = str(e)
            arms = tuple(obs.state.k) if obs.state and obs.state.k else ARMS
            obs.windows = read_windows(client, namespace, name, arms)
            raw_loop = client.get(loop_key(namespace, name))
            obs.loop = json.loads(raw_loop) if raw_loop else None
        except redis.RedisError as e:
            obs.redis_error = f"{type(e).__name__}: {e}"
        finally:
            client.close()
    if router_url:
        try:
            obs.metrics = router_metrics(router_url)
            obs.readyz = fetch(router_url.rstrip("/") + "/readyz")
        except OSError as e:
            obs.router_error = f"{type(e).__name__}: {e}"
    return obs


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _window_doc(w: Window | None) -> dict[str, Any]:
    w = w or Window()
    return {"alpha": _round(w.alpha), "tau": _round(w.tau), "speedup": _round(w.speedup),
            "requests": w.counts.requests, "windowSeconds": _round(w.seconds, 1)}


def document(obs: Observed) -> dict[str, Any]:
    """The `-o json` document (docs/local.md): pure, from what was observed."""
    state, run = obs.state, obs.run or {}
    backends = backends_by_arm(obs.metrics) if obs.metrics is not None else {}
    run_arms = run.get("arms") or {}
    arm_names = list(state.k) if state and state.k else list(run_arms) or list(backends) or ["stable"]
    arm_names.sort(key=lambda a: ARMS.index(a) if a in ARMS else len(ARMS))
    arms = []
    for arm in arm_names:
        weight = None if state is None else (state.canary_weight if arm == "canary" else
                                             round(100.0 - state.canary_weight, 2))
        bounds = state.k.get(arm) if state else None
        replicas = (run_arms.get(arm) or {}).get("workers", backends.get(arm, (None, None))[0])
        arms.append({"name": arm, "weight": weight, "replicas": replicas,
                     "ready": backends[arm][1] if arm in backends else (0 if obs.metrics is not None else None),
                     "kMin": bounds.k_min if bounds else None, "kMax": bounds.k_max if bounds else None})
    types = []
    for t in PROMPT_TYPES:
        by_arm = {arm: obs.windows.get(arm, {}).get(t) for arm in arm_names}
        stable_k = state.k.get("stable") if state else None
        entry = {"name": t, "method": state.method_for(t) if state else None,
                 # the stable arm's kMax for the type: the loop's ceiling where it set one
                 "kMax": state.k_ceilings.get(t, stable_k.k_max) if state and stable_k else None,
                 "mode": None if state is None else
                 ("fallback" if not state.speculate or t in state.fallback else "speculative"),
                 "slo": ((obs.loop or {}).get("memory") or {}).get("keys", {}).get(f"type:{t}"),
                 **_window_doc(sum_windows([w for w in by_arm.values() if w])),
                 "byArm": {arm: {"method": state.method_for(t, arm) if state else None, **_window_doc(w)}
                           for arm, w in by_arm.items()}}
        types.append(entry)
    overall = sum_windows([w for by_type in obs.windows.values() for w in by_type.values()])
    ready = [a["ready"] for a in arms]
    replicas = [a["replicas"] for a in arms]
    return {
        "deployment": f"{obs.namespace}/{obs.name}",
        "model": run.get("model"),
        "phase": run.get("phase"),
        "mode": None if state is None else ("speculative" if state.speculate else "fallback"),
        "ready": None if None in ready or None in replicas else f"{sum(ready)}/{sum(replicas)}",
        "alpha": _round(overall.alpha), "tau": _round(overall.tau),
        "arms": arms,
        "promptTypes": types,
        "fallback": {"promptTypes": list(state.fallback) if state else [],
                     "clusters": list(state.fallback_clusters) if state else [],
                     "probeShare": state.probe_share if state else None},
        # prompt clusters the loop moved to a draft method of their own (their type runs another)
        "clusterMethods": dict(state.cluster_routes) if state else {},
        "loop": None if obs.loop is None else {"ticks": obs.loop.get("ticks"), "decisions": obs.loop.get("decisions", {}),
                                               "events": obs.loop.get("events", [])[-10:]},
        "kBounds": {a["name"]: {"kMin": a["kMin"], "kMax": a["kMax"]} for a in arms},
        "router": {
            "url": obs.router_url, "openai": f"{obs.router_url.rstrip('/')}/v1" if obs.router_url else None,
            "reachable": obs.metrics is not None, "error": obs.router_error,
            "ready": None if obs.readyz is None else obs.readyz[0] == 200,
            "readyz": None if obs.readyz is None else obs.readyz[1].strip(),
            "stateVersion": _int(_gauge(obs.metrics, "specfleet_router_state_version")),
            "canaryWeight": _gauge(obs.metrics, "specfleet_router_canary_weight_percent"),
        },
        "redis": {
            "url": obs.redis_url,
            "connected": None if obs.redis_url is None else obs.redis_error is None,
            "error": obs.redis_error or obs.state_error,
            "stateVersion": state.version if state else None,
            "stateAgeSeconds": _round(obs.now - state.updated, 1) if state else None,
            "routerConnected": None if obs.metrics is None else
            bool(_gauge(obs.metrics, "specfleet_router_redis_connected")),
            "secondsStale": _round(_gauge(obs.metrics, "specfleet_router_redis_staleness_seconds"), 2),
        },
    }


def _int(x: float | None) -> int | None:
    return None if x is None else int(x)


def _fmt(x: Any, spec: str = "", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _method(prompt_type: dict[str, Any]) -> str:
    """The type's method, and each arm's where it differs.

    >>> _method({"method": "ngram", "byArm": {"stable": {"method": "ngram"}, "canary": {"method": "none"}}})
    'ngram (canary: none)'
    """
    other = [f"{arm}: {a['method']}" for arm, a in prompt_type["byArm"].items() if a["method"] != prompt_type["method"]]
    return _fmt(prompt_type["method"]) + (f" ({', '.join(other)})" if other else "")


def table(doc: dict[str, Any]) -> str:
    """The document as `kubectl get -o wide` would print it, then the arms, the prompt types (the
    stable arm's method, with each arm's that differs) and Redis."""
    arms = {a["name"]: a for a in doc["arms"]}
    canary = arms.get("canary", {}).get("weight")
    k = " / ".join(f"{a['kMin']}-{a['kMax']}" for a in doc["arms"] if a["kMin"] is not None) or "-"
    out = [_columns([
        ["NAME", "READY", "MODE", "ALPHA", "TAU", "K", "CANARY", "MODEL", "API"],
        [doc["deployment"], _fmt(doc["ready"]), _fmt(doc["mode"]), _fmt(doc["alpha"], ".2f"),
         _fmt(doc["tau"], ".2f"), k, _fmt(canary, "g", "0") + "%", _fmt(doc["model"]),
         _fmt(doc["router"]["openai"])]])]
    out.append("")
    out.append(_columns([["ARM", "WEIGHT", "REPLICAS", "READY", "K"]] + [
        [a["name"], _fmt(a["weight"], "g") + "%", _fmt(a["replicas"]), _fmt(a["ready"]),
         f"{_fmt(a['kMin'])}-{_fmt(a['kMax'])}"] for a in doc["arms"]]))
    out.append("")
    out.append(_columns([["PROMPT TYPE", "METHOD", "KMAX", "MODE", "ALPHA", "TAU", "SPEEDUP", "REQUESTS"]] + [
        [t["name"], _method(t), _fmt(t["kMax"]), _fmt(t["mode"]), _fmt(t["alpha"], ".2f"), _fmt(t["tau"], ".2f"),
         _fmt(t["speedup"], ".2f"), str(t["requests"])] for t in doc["promptTypes"]]))
    window = max((t["windowSeconds"] or 0 for t in doc["promptTypes"]), default=0)
    out.append(f"(alpha, tau, speedup, requests: the workers' windows, last {window or 60:.0f} s)")
    if doc.get("clusterMethods"):
        out.append("prompt clusters on a method of their own: "
                   + ", ".join(f"{c} {m}" for c, m in sorted(doc["clusterMethods"].items())))
    if doc.get("loop"):
        loop = doc["loop"]
        made = ", ".join(f"{reason} {n}" for reason, n in sorted(loop.get("decisions", {}).items())) or "none"
        out.append(f"LOOP: {_fmt((loop.get('ticks') or {}).get('decided'))} ticks judged; decisions: {made}")
    r, rt = doc["redis"], doc["router"]
    if r["connected"]:
        redis_line = (f"REDIS {r['url']}: connected, state version {_fmt(r['stateVersion'])}, written "
                      f"{_fmt(r['stateAgeSeconds'], '.0f')} s ago")
        if rt["reachable"]:
            redis_line += (f"; the router {'reads it' if r['routerConnected'] else 'cannot read it'}, "
                           f"{_fmt(r['secondsStale'], '.1f')} s stale, at version {_fmt(rt['stateVersion'])}")
    else:
        redis_line = f"REDIS {_fmt(r['url'])}: not connected ({_fmt(r['error'])})"
    out += ["", redis_line]
    if rt["reachable"]:
        out.append(f"ROUTER {rt['url']}: {rt['readyz']}")
    else:
        out.append(f"ROUTER {_fmt(rt['url'])}: not reachable ({_fmt(rt['error'])})")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet status",
                                description="The fleet `specfleet up` runs, as `kubectl get sdd -o wide` shows one: "
                                            "arms, prompt types, K bounds, Redis. See docs/local.md.")
    p.add_argument("-o", "--output", choices=("wide", "json"), default="wide",
                   help="wide: tables (default); json: the document docs/local.md specifies")
    p.add_argument("--run-file", default=None,
                   help=f"`up`'s run file (default ${runfile.ENV}, else $XDG_RUNTIME_DIR/specfleet/up.json, else "
                        "~/.cache/specfleet/up.json)")
    p.add_argument("--redis-url", default=None, help="read this Redis instead of the run file's")
    p.add_argument("--deployment", default=None, metavar="NAMESPACE/NAME", help="instead of the run file's")
    p.add_argument("--router-url", default=None, help="the router's HTTP address (e.g. http://127.0.0.1:8000)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = Path(args.run_file) if args.run_file else runfile.default_path()
    run = runfile.running(path)
    deployment = args.deployment or (run or {}).get("deployment")
    redis_url = args.redis_url or ((run or {}).get("redis") or {}).get("url")
    router_url = args.router_url or ((run or {}).get("router") or {}).get("url")
    if not deployment or not (redis_url or router_url):
        print(f"specfleet status: no `specfleet up` is running here (no live run file at {path}); start one "
              "(specfleet up -f deploy/examples/local.yaml), or pass --deployment with --redis-url and/or "
              "--router-url", file=sys.stderr)
        return 1
    namespace, slash, name = deployment.partition("/")
    if not slash or not namespace or not name:
        print(f"specfleet status: --deployment {deployment!r}: expected NAMESPACE/NAME", file=sys.stderr)
        return 2
    doc = document(observe(namespace, name, redis_url, router_url, run))
    print(json.dumps(doc, indent=2) if args.output == "json" else table(doc))
    return 0
